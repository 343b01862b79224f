"""``residency``: data residency under the loss of a region, on a live cluster (slow).

Two regions (us-east-1, eu-west-1), one engine each, one router. The eu-west-1 engine's actor is killed;
once the router sees it gone, requests marked ``X-Residency: eu-west-1`` must be refused (503), never
served in us-east-1, while unmarked requests from eu-west-1 fail over to us-east-1. Counts of each.
"""

from __future__ import annotations

import json
import time
import urllib.error
import urllib.request
from typing import Any

from cluster.launch import launch
from cluster.scenarios import Claim, Finding, Scenario, ScenarioContext, ScenarioResult, Verdict, register_scenario
from config import ClusterSpec

CLAIM = Claim("residency-hard-filter", "EU request served in us-east-1 | Router ignores residency | Partition routers "
              "by residency", "lessons-card.md", "Troubleshooting")
REGIONS = ("us-east-1", "eu-west-1")


def _post(url: str, headers: dict[str, str]) -> tuple[int, str | None]:
    body = json.dumps({"prompt": [5, 6, 7, 8], "max_tokens": 2}).encode()
    req = urllib.request.Request(url + "/v1/completions", data=body,
                                 headers={"Content-Type": "application/json", **headers})
    try:
        with urllib.request.urlopen(req, timeout=60) as r:
            return r.status, r.headers.get("X-Served-Region")
    except urllib.error.HTTPError as e:
        return e.code, None


def run(ctx: ScenarioContext) -> ScenarioResult:
    n = 5 if ctx.quick else 20
    spec = ClusterSpec.model_validate({
        "name": "scenario-residency", "regions": [{"name": r} for r in REGIONS],
        "nodes": [{"name": f"n-{r}", "region": r, "hardware": "h100-80g-sxm", "gpus": 1,
                   "engines": [{"name": f"e-{r}", "model": "llama-3.1-8b"}]} for r in REGIONS],
        "router": {"policy": "least_loaded", "region": "eu-west-1"}})
    out: dict[str, Any] = {}
    with launch(spec) as h:
        ctx.progress("residency: killing the eu-west-1 engine")
        h.kill_engine_actor("e-eu-west-1")
        deadline = time.monotonic() + 30
        while True:
            with urllib.request.urlopen(h.router_url + "/workers", timeout=30) as r:
                workers = json.loads(r.read())
            if not any(w["eligible"] for w in workers if w["region"] == "eu-west-1"):
                break
            if time.monotonic() > deadline:
                raise TimeoutError("the router still lists the killed eu-west-1 engine as eligible after 30 s")
            time.sleep(0.1)
        resident = [_post(h.router_url, {"X-Residency": "eu-west-1"}) for _ in range(n)]
        free = [_post(h.router_url, {"X-Region": "eu-west-1"}) for _ in range(n)]
    out["resident"] = {"refused_503": sum(s == 503 for s, _ in resident),
                       "served_elsewhere": sum(s == 200 and reg != "eu-west-1" for s, reg in resident)}
    out["unmarked"] = {"served_us": sum(s == 200 and reg == "us-east-1" for s, reg in free), "sent": n}
    ok = out["resident"]["refused_503"] == n and out["resident"]["served_elsewhere"] == 0
    fig = (f"after losing eu-west-1: {out['resident']['refused_503']}/{n} EU-resident requests refused (503), "
           f"{out['resident']['served_elsewhere']} served elsewhere; {out['unmarked']['served_us']}/{n} unmarked EU "
           "requests failed over to us-east-1")
    return ScenarioResult("residency", "live cluster (Ray, HTTP)",
                          [Finding(CLAIM, fig, Verdict.HOLDS if ok else Verdict.BREAKS,
                                   "kvmesh treats residency as a hard filter (never a score): the symptom the card "
                                   "names cannot happen; the cost is that resident traffic fails while its region "
                                   "is down", value=float(out["resident"]["served_elsewhere"]))], out)


register_scenario(Scenario("residency", "data residency when its region is lost (live cluster)", run, (CLAIM,),
                           slow=True))

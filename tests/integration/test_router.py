"""The router against real engines on Ray: regions, residency, KV-event routing, migration, membership."""

from __future__ import annotations

import asyncio
import json
import random
import time
import urllib.request
from collections.abc import Iterator
from typing import Any

import aiohttp
import pytest
from prometheus_client.parser import text_string_to_metric_families

from cluster.launch import ClusterHandle, launch
from config import ClusterSpec

REGIONS = ["us-east-1", "us-west-2", "eu-west-1"]
pytestmark = [pytest.mark.integration, pytest.mark.slow]


def spec(name: str, per_region: int, regions: list[str], **router: Any) -> ClusterSpec:
    return ClusterSpec.model_validate({
        "name": name, "regions": [{"name": r} for r in regions],
        "nodes": [{"name": f"n-{r}", "region": r, "hardware": "h100-80g-sxm", "gpus": per_region,
                   "engines": [{"name": f"e-{r}", "model": "llama-3.1-8b", "replicas": per_region}]}
                  for r in regions],
        "router": {"policy": "kv_aware", "region": regions[0], **router}})


@pytest.fixture(scope="module")
def regional(ray_cluster: object) -> Iterator[ClusterHandle]:
    h = launch(spec("rt-regions", 1, REGIONS))
    try:
        yield h
    finally:
        h.shutdown()


def prompt(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(16, 128000) for _ in range(n)]


async def stream(url: str, body: dict[str, Any], headers: dict[str, str] | None = None,
                 ) -> tuple[int, dict[str, str], list[dict[str, Any]], float]:
    """(status, response headers, parsed data events, seconds to first token)."""
    t0 = time.monotonic()
    first = 0.0
    events: list[dict[str, Any]] = []
    async with aiohttp.ClientSession() as s, s.post(url + "/v1/completions", json={**body, "stream": True},
                                                   headers=headers or {}) as r:
        if r.status != 200:
            return r.status, dict(r.headers), [await r.json()], 0.0
        async for line in r.content:
            if not line.startswith(b"data: "):
                continue
            if line.strip() == b"data: [DONE]":
                events.append({"done": True})
                continue
            ev = json.loads(line[6:])
            if ev.get("choices") and ev["choices"][0].get("text") and not first:
                first = time.monotonic() - t0
            events.append(ev)
        return r.status, dict(r.headers), events, first


def get_json(url: str) -> Any:
    with urllib.request.urlopen(url) as r:
        return json.loads(r.read())


def test_residency_is_a_hard_filter(regional: ClusterHandle) -> None:
    for _ in range(3):
        status, headers, _, _ = asyncio.run(stream(regional.router_url, {"prompt": prompt(64, 1), "max_tokens": 2},
                                                   {"X-Residency": "eu-west-1"}))
        assert status == 200 and headers["X-Served-Region"] == "eu-west-1"
    status, _, body, _ = asyncio.run(stream(regional.router_url, {"prompt": [5, 6], "max_tokens": 2},
                                            {"X-Residency": "ap-south-1"}))
    assert status == 503 and "residency region 'ap-south-1'" in body[0]["error"]["message"]


def test_a_remote_region_pays_the_round_trip(regional: ClusterHandle) -> None:
    body = {"prompt": prompt(32, 2), "max_tokens": 2}
    _, h1, _, local = asyncio.run(stream(regional.router_url, body, {"X-Region": "us-east-1",
                                                                      "X-Residency": "us-east-1"}))
    _, h2, _, remote = asyncio.run(stream(regional.router_url, {**body, "prompt": prompt(32, 3)},
                                          {"X-Region": "us-east-1", "X-Residency": "eu-west-1"}))
    assert h1["X-Served-Region"] == "us-east-1" and h2["X-Served-Region"] == "eu-west-1"
    assert remote - local >= 0.075 * 0.9  # the 75 ms east-EU round trip, emulated by the router
    text = urllib.request.urlopen(regional.router_url + "/metrics").read().decode()
    fams = {f.name: f for f in text_string_to_metric_families(text)}
    cross = {(s.labels["origin"], s.labels["served"]): s.value for s in fams["kvmesh_router_cross_region"].samples
             if s.name.endswith("_total")}
    assert cross[("us-east-1", "eu-west-1")] >= 1


def test_kv_events_steer_a_shared_prefix_to_the_worker_that_holds_it() -> None:
    h = launch(spec("rt-kv", 3, ["us-east-1"]))
    try:
        shared = prompt(2000, 7)
        _, h0, _, cold = asyncio.run(stream(h.router_url, {"prompt": shared + [11] * 20, "max_tokens": 2}))
        served = h0["X-Served-By"]
        time.sleep(0.3)  # the stored events reach the router
        workers = {w["name"]: w for w in get_json(h.router_url + "/workers")}
        assert workers[served]["indexed_blocks"] >= 2000 // 16
        hits = []
        for k in range(3):
            _, hk, _, warm = asyncio.run(stream(h.router_url, {"prompt": shared + [12 + k] * 20,
                                                                     "max_tokens": 2}))
            hits.append(hk["X-Served-By"])
        assert hits == [served] * 3
        assert warm < cold  # the cached 2,000 tokens are not prefilled again
        # Every prompt the router counted as awaiting its first token was settled.
        assert all(w["prefilling_blocks"] == 0 for w in get_json(h.router_url + "/workers"))
        text = urllib.request.urlopen(h.router_url + "/metrics").read().decode()
        fams = {f.name: f for f in text_string_to_metric_families(text)}
        predicted = sum(s.value for s in fams["kvmesh_router_predicted_prefix_hit_tokens"].samples
                        if s.name.endswith("_total"))
        realized = sum(s.value for s in fams["kvmesh_router_realized_prefix_hit_tokens"].samples
                       if s.name.endswith("_total"))
        assert predicted >= 3 * 1984 and realized >= 3 * 1984

        # A worker that leaves gets nothing; back again, it serves again.
        with urllib.request.urlopen(urllib.request.Request(h.router_url + f"/workers/{served}",
                                                           method="DELETE")) as r:
            assert r.status == 200
        for k in range(3):
            _, hk, _, _ = asyncio.run(stream(h.router_url, {"prompt": shared + [40 + k] * 20, "max_tokens": 2}))
            assert hk["X-Served-By"] != served
        add = json.dumps({"name": served, **h.engines[served]}).encode()
        urllib.request.urlopen(urllib.request.Request(h.router_url + "/workers", data=add, method="POST",
                                                      headers={"Content-Type": "application/json"}))
        deadline = time.monotonic() + 10
        while not {w["name"]: w for w in get_json(h.router_url + "/workers")}[served]["eligible"]:
            assert time.monotonic() < deadline
            time.sleep(0.1)
        # While it was away another worker cached the shared part too, so only a prompt whose last full block
        # the returning worker alone holds (the first request's) tells that it is back in the index.
        _, hk, _, _ = asyncio.run(stream(h.router_url, {"prompt": shared + [11] * 20, "max_tokens": 2}))
        assert hk["X-Served-By"] == served
    finally:
        h.shutdown()


def test_a_worker_killed_mid_stream_is_migrated_without_losing_or_repeating_tokens() -> None:
    h = launch(spec("rt-migrate", 2, ["us-east-1"], policy="least_loaded"))
    try:
        async def main() -> tuple[int, dict[str, str], list[dict[str, Any]]]:
            async with aiohttp.ClientSession() as s, s.post(
                    h.router_url + "/v1/chat/completions",
                    json={"messages": [{"role": "user", "content": "tell me a long story"}], "max_tokens": 120,
                          "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}) as r:
                served = r.headers["X-Served-By"]
                events: list[dict[str, Any]] = []
                killed = False
                async for line in r.content:
                    if not line.startswith(b"data: "):
                        continue
                    if line.strip() == b"data: [DONE]":
                        events.append({"done": True})
                        continue
                    events.append(json.loads(line[6:]))
                    if len(events) == 20 and not killed:
                        killed = True
                        await asyncio.get_running_loop().run_in_executor(None, h.kill_engine_actor, served)
                return r.status, dict(r.headers), events

        status, _, events = asyncio.run(main())
        assert status == 200
        content = [e for e in events if e.get("choices")]
        ids = {e["id"] for e in content}
        assert len(ids) == 1  # one stream, one identity
        tokens = [t for e in content for t in e["choices"][0].get("token_ids", [])]
        assert len(tokens) == 120
        finishes = [e["choices"][0]["finish_reason"] for e in content if e["choices"][0]["finish_reason"]]
        assert finishes == ["length"]
        usage = [e["usage"] for e in events if e.get("usage")]
        assert len(usage) == 1 and usage[0]["completion_tokens"] == 120
        assert sum(1 for e in events if e.get("done")) == 1
        text = urllib.request.urlopen(h.router_url + "/metrics").read().decode()
        fams = {f.name: f for f in text_string_to_metric_families(text)}
        ok = [s.value for s in fams["kvmesh_router_migrations"].samples
              if s.name.endswith("_total") and s.labels["outcome"] == "ok"]
        assert ok == [1.0]
    finally:
        h.shutdown()


def test_residency_survives_the_loss_of_its_region() -> None:
    h = launch(spec("rt-res-kill", 1, ["us-east-1", "eu-west-1"]))
    try:
        h.kill_engine_actor("e-eu-west-1")
        deadline = time.monotonic() + 10
        while any(w["eligible"] for w in get_json(h.router_url + "/workers") if w["region"] == "eu-west-1"):
            assert time.monotonic() < deadline
            time.sleep(0.1)
        for _ in range(3):
            status, _, body, _ = asyncio.run(stream(h.router_url, {"prompt": [7, 8, 9], "max_tokens": 2},
                                                    {"X-Residency": "eu-west-1"}))
            assert status == 503 and "data residency" in body[0]["error"]["message"]
        status, headers, _, _ = asyncio.run(stream(h.router_url, {"prompt": [7, 8, 9], "max_tokens": 2}))
        assert status == 200 and headers["X-Served-Region"] == "us-east-1"
    finally:
        h.shutdown()


def test_partitioned_routers_policy_override_and_saturation() -> None:
    h = launch(ClusterSpec.model_validate({
        "name": "rt-misc", "regions": [{"name": "us-east-1"}, {"name": "eu-west-1"}],
        "nodes": [{"name": f"n-{r}", "region": r, "hardware": "h100-80g-sxm", "gpus": 1,
                   "engines": [{"name": f"e-{r}", "model": "llama-3.1-8b",
                                "scheduler": {"max_num_seqs": 1}}]} for r in ("us-east-1", "eu-west-1")],
        "router": {"policy": "round_robin", "partition_by_residency": True, "max_waiting": 2}}))
    try:
        assert set(h.router_urls) == {"us-east-1", "eu-west-1"}
        eu = h.router_urls["eu-west-1"]
        assert [w["region"] for w in get_json(eu + "/workers")] == ["eu-west-1"]
        for _ in range(2):
            _, hdr, _, _ = asyncio.run(stream(eu, {"prompt": [3, 4, 5], "max_tokens": 1}))
            assert hdr["X-Served-Region"] == "eu-west-1"
        status, _, body, _ = asyncio.run(stream(eu, {"prompt": [3, 4], "max_tokens": 1},
                                                {"X-Route-Policy": "no-such-policy"}))
        assert status == 400 and "unknown routing policy" in body[0]["error"]["message"]
        status, _, _, _ = asyncio.run(stream(eu, {"prompt": [3, 4], "max_tokens": 1},
                                             {"X-Route-Policy": "kv_aware"}))
        assert status == 200

        async def flood() -> list[int]:
            async def long_one(k: int) -> int:
                async with aiohttp.ClientSession() as s, s.post(
                        eu + "/v1/completions", json={"prompt": prompt(64, 100 + k), "max_tokens": 400,
                                                      "ignore_eos": True}) as r:
                    await r.read()
                    return r.status

            tasks = [asyncio.create_task(long_one(k)) for k in range(4)]  # 1 running, 3 waiting
            deadline = time.monotonic() + 10
            while get_json(eu + "/workers")[0]["waiting"] < 2:
                assert time.monotonic() < deadline
                await asyncio.sleep(0.05)
            async with aiohttp.ClientSession() as s, s.post(eu + "/v1/completions",
                                                            json={"prompt": [1, 2], "max_tokens": 1}) as r:
                assert r.headers.get("Retry-After") == "1"
                extra = r.status
            return [extra, *await asyncio.gather(*tasks)]

        statuses = asyncio.run(flood())
        assert statuses[0] == 429 and statuses[1:] == [200] * 4
    finally:
        h.shutdown()


def test_a_request_past_its_deadline_ends_cleanly_and_frees_the_engine() -> None:
    h = launch(spec("rt-deadline", 1, ["us-east-1"], policy="least_loaded", request_timeout_s=0.4))
    try:
        body = {"prompt": prompt(32, 7), "max_tokens": 2000, "ignore_eos": True}
        status, _, events, _ = asyncio.run(stream(h.router_url, body))
        assert status == 200  # the stream began, so it ends with an error event and [DONE]
        assert events[-1] == {"done": True}
        assert "deadline" in events[-2]["error"]["message"]
        tokens = sum(len(e["choices"][0]["text"]) > 0 for e in events if e.get("choices"))
        assert 0 < tokens < 2000

        async def plain() -> tuple[int, Any]:
            async with aiohttp.ClientSession() as s, s.post(h.router_url + "/v1/completions", json=body) as r:
                return r.status, await r.json()

        code, err = asyncio.run(plain())
        assert code == 504 and "deadline" in err["error"]["message"]
        deadline = time.monotonic() + 10
        while get_json(h.router_url + "/workers")[0]["running"] != 0:  # the engine dropped both requests
            assert time.monotonic() < deadline
            time.sleep(0.05)
        # An ordinary request still goes through afterwards.
        status, _, events, _ = asyncio.run(stream(h.router_url, {"prompt": [1, 2, 3], "max_tokens": 2}))
        assert status == 200 and events[-1] == {"done": True}
    finally:
        h.shutdown()

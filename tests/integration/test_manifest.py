"""The DR manifest on a live cluster: the failover region lacks its tokenizer, so its engine does not
start (the refusal names the file) and the router serves that region's traffic from the other region."""

from __future__ import annotations

import json
import urllib.request
from pathlib import Path
from typing import Any

from cluster.launch import launch
from config import ClusterSpec
from config.manifest import ArtifactKind, manifest_of

FILES = {ArtifactKind.WEIGHTS: "model.safetensors", ArtifactKind.TOKENIZER: "tokenizer.json",
         ArtifactKind.QUANT_CONFIG: "quant_config.json"}


def get_json(url: str) -> Any:
    with urllib.request.urlopen(url, timeout=30) as r:
        return json.loads(r.read())


def test_failover_region_without_tokenizer_is_routed_around(ray_cluster: object, tmp_path: Path) -> None:
    roots = {}
    for r in ("us-east-1", "eu-west-1"):
        roots[r] = tmp_path / r
        roots[r].mkdir()
        for f in FILES.values():
            if not (r == "eu-west-1" and f == "tokenizer.json"):
                (roots[r] / f).write_bytes(f.encode() * 64)
    manifest = manifest_of("llama-3.1-8b", roots["us-east-1"], FILES)
    spec = ClusterSpec.model_validate({
        "name": "dr-manifest", "time_scale": 1.0, "regions": [{"name": "us-east-1"}, {"name": "eu-west-1"}],
        "nodes": [{"name": f"n-{r}", "region": r, "hardware": "h100-80g-sxm", "gpus": 1,
                   "engines": [{"name": f"e-{r}", "model": "llama-3.1-8b"}]} for r in roots],
        "router": {"policy": "least_loaded", "region": "eu-west-1"},
        "manifest": {"models": [manifest.model_dump(mode="json")], "roots": {r: str(p) for r, p in roots.items()}}})
    with launch(spec) as h:
        assert set(h.engines) == {"e-us-east-1"}
        assert "tokenizer file 'tokenizer.json' missing" in h.refused["e-eu-west-1"]
        assert [w["name"] for w in get_json(h.router_url + "/workers")] == ["e-us-east-1"]
        body = json.dumps({"prompt": [5, 6, 7], "max_tokens": 2}).encode()
        req = urllib.request.Request(h.router_url + "/v1/completions", data=body,
                                     headers={"Content-Type": "application/json", "X-Region": "eu-west-1"})
        with urllib.request.urlopen(req, timeout=60) as r:
            assert r.status == 200
            assert r.headers["X-Served-Region"] == "us-east-1"
            assert json.loads(r.read())["usage"]["completion_tokens"] == 2

"""KV tiers in a real cluster (Ray actor, HTTP): a prefix pushed out of a small GPU cache, through a tiny CPU
tier, onto real files on disk, comes back from the disk tier on the next request: the answer is complete,
the usage reports the loaded tokens as cached, the engine's /metrics count the disk load, and the files are
there, one per block."""

from __future__ import annotations

import json
import random
import re
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from cluster.launch import ClusterHandle, launch
from config import ClusterSpec


@pytest.fixture(scope="module")
def tier_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("kv-disk")


@pytest.fixture(scope="module")
def cluster(ray_cluster: object, tier_dir: Path) -> Iterator[ClusterHandle]:
    h = launch(ClusterSpec.model_validate({
        "name": "tiers", "transport": {"kv_payload_scale": 0.01},
        "nodes": [{"name": "n0", "region": "local", "hardware": "h100-80g-sxm", "gpus": 1,
                   "engines": [{"name": "e", "model": "llama-3.1-8b",
                                "scheduler": {"num_gpu_blocks": 128, "async_scheduling": False},
                                "tiers": {"cpu": {"capacity_gb": 0.02},
                                          "disk": {"capacity_gb": 1.0, "directory": str(tier_dir)}}}]}]}))
    try:
        yield h
    finally:
        h.shutdown()


def post(url: str, body: dict[str, Any]) -> dict[str, Any]:
    req = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=60) as r:
        out: dict[str, Any] = json.loads(r.read())
        return out


def metric(text: str, name: str, medium: str) -> float:
    m = re.search(rf'^{re.escape(name)}{{[^}}]*medium="{medium}"[^}}]*}} (\S+)$', text, re.M)
    return float(m.group(1)) if m else 0.0


def test_a_prefix_comes_back_from_the_disk_tier(cluster: ClusterHandle, tier_dir: Path) -> None:
    url = cluster.router_url + "/v1/completions"
    rng = random.Random(7)
    a = [rng.randrange(16, 100_000) for _ in range(1600)]
    b = [rng.randrange(16, 100_000) for _ in range(1600)]
    for prompt in (a, b):  # b needs most of the 128 GPU blocks: a's are evicted, written down, spilled to disk
        out = post(url, {"model": "llama-3.1-8b", "prompt": prompt, "max_tokens": 4, "ignore_eos": True})
        assert out["usage"]["completion_tokens"] == 4
    again = post(url, {"model": "llama-3.1-8b", "prompt": a, "max_tokens": 4, "ignore_eos": True})
    assert again["usage"]["completion_tokens"] == 4
    cached = again["usage"].get("prompt_tokens_details", {}).get("cached_tokens", 0)
    assert cached >= 1024  # most of a's prompt came back from a tier instead of being recomputed

    engine_url = next(iter(cluster.engine_urls.values()))
    with urllib.request.urlopen(engine_url + "/metrics", timeout=10) as r:
        text = r.read().decode()
    assert metric(text, "vllm:kv_offload_load_bytes_total", "DISK") > 0
    assert metric(text, "vllm:kv_offload_store_bytes_total", "CPU") > 0
    assert metric(text, "kvmesh:kv_tier_evictions_total", "CPU") > 0
    assert metric(text, "kvmesh:kv_tier_fallbacks_total", "DISK") == 0
    files = list((tier_dir / "e").glob("*.kv"))
    assert len(files) > 50

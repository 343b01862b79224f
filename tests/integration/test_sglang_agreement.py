"""Our ``sglang_cache_aware`` against the real sgl-router (``pip install sglang-router``, run as a subprocess
from ``.venv-sglang`` as ``bench/router.py`` runs it), both fronting the same four engines.

One request sequence (shared prefixes, fresh prompts, prompts sharing part of a prefix) is sent one probe
at a time through each router, in phases during which 0 to 3 long "holder" requests (fresh prompts, many
output tokens) are kept open through the same router, so the routers' load counts differ between workers
the same way for both (each holder is started only once the previous one streams). Which engine served each
probe is read from the engines' own success counters (no other request ends meanwhile, so exactly one
counter moves), which needs nothing from the routers. The two runs use the same texts up to a letter
rotation (a bijection on characters keeps every common-prefix length, hence the radix trees' shapes and
sizes, identical, while the engines see disjoint tokens, so the second run finds no blocks of the first in
their caches).

sgl-router breaks ties among equally loaded workers by its own worker order (and a shared node's tenant by
hash-map order under a per-process random seed), so its choices are compared up to a renaming of the
engines: the renaming that agrees most (an assignment problem, scipy's ``linear_sum_assignment``) is
applied, and the agreement must be >= 95%; the engines' prefix hit ratios over each run must be within 2 points.
"""

from __future__ import annotations

import random
import string
import urllib.request
from collections.abc import Iterator

import numpy as np
import pytest
from prometheus_client.parser import text_string_to_metric_families
from scipy.optimize import linear_sum_assignment

from cluster.launch import ClusterHandle, launch
from cluster.loadtest.client import ids_to_text
from config import ClusterSpec

pytestmark = [pytest.mark.integration, pytest.mark.slow]

ROT = str.maketrans(string.ascii_lowercase, string.ascii_lowercase[13:] + string.ascii_lowercase[:13])


def workload(n: int, seed: int) -> list[str]:
    """Prompts as text: most extend one of ten shared prefixes, some are fresh, some share only part of a
    prefix (around sgl-router's 0.3 match threshold)."""
    rng = random.Random(seed)

    def ids(k: int) -> list[int]:
        return [rng.randrange(17576) for _ in range(k)]

    prefixes = [ids(rng.randint(150, 500)) for _ in range(10)]
    weights = [1.0 / (i + 1) for i in range(len(prefixes))]
    out = []
    for _ in range(n):
        u = rng.random()
        if u < 0.7:
            p = rng.choices(prefixes, weights)[0]
            out.append(ids_to_text(p + ids(rng.randint(10, 80))))
        elif u < 0.85:
            out.append(ids_to_text(ids(rng.randint(80, 400))))
        else:
            p = rng.choice(prefixes)
            cut = int(len(p) * rng.uniform(0.15, 0.5))
            out.append(ids_to_text(p[:cut] + ids(rng.randint(60, 200))))
    return out


def engine_counters(h: ClusterHandle) -> dict[str, dict[str, float]]:
    out: dict[str, dict[str, float]] = {}
    for name, url in h.engine_urls.items():
        c = {"success": 0.0, "queries": 0.0, "hits": 0.0}
        text = urllib.request.urlopen(url + "/metrics", timeout=10).read().decode()
        for fam in text_string_to_metric_families(text):
            for s in fam.samples:
                if s.name == "vllm:request_success_total":
                    c["success"] += s.value
                elif s.name == "vllm:prefix_cache_queries_total":
                    c["queries"] += s.value
                elif s.name == "vllm:prefix_cache_hits_total":
                    c["hits"] += s.value
        out[name] = c
    return out


PHASES = (0, 1, 2, 3, 0, 2, 1)
"""Holders kept open during each phase of probes."""


async def run(h: ClusterHandle, url: str, prompts: list[str], holders: list[str]) -> tuple[list[str], float]:
    """The engine that served each probe and the run's prefix hit ratio over the probes."""
    import aiohttp

    per_phase = -(-len(prompts) // len(PHASES))
    chosen: list[str] = []
    hq = hit = 0.0
    held = iter(holders)
    async with aiohttp.ClientSession() as s:
        for k, n_hold in enumerate(PHASES):
            opened = []
            for _ in range(n_hold):
                body = {"model": "llama-3.1-8b", "prompt": next(held), "max_tokens": 1500, "ignore_eos": True,
                        "stream": True}
                resp = await s.post(url + "/v1/completions", json=body)
                assert resp.status == 200
                await resp.content.readline()  # its first event: it is routed and running
                opened.append(resp)
            before = engine_counters(h)
            for p in prompts[k * per_phase:(k + 1) * per_phase]:
                body = {"model": "llama-3.1-8b", "prompt": p, "max_tokens": 1, "ignore_eos": True}
                async with s.post(url + "/v1/completions", json=body) as r:
                    assert r.status == 200
                    await r.read()
                after = engine_counters(h)
                moved = [n for n in after if after[n]["success"] > before[n]["success"]]
                assert len(moved) == 1, f"expected one engine to serve the probe, saw {moved} (a holder ended?)"
                chosen.append(moved[0])
                hq += sum(after[n]["queries"] - before[n]["queries"] for n in after)
                hit += sum(after[n]["hits"] - before[n]["hits"] for n in after)
                before = after
            for resp in opened:
                await resp.read()
                resp.release()
    return chosen, hit / hq if hq else 0.0


def agreement(a: list[str], b: list[str]) -> tuple[float, float]:
    """Raw agreement, and agreement under the renaming of b's labels that maximizes it."""
    la, lb = sorted(set(a) | set(b)), sorted(set(a) | set(b))
    m = np.zeros((len(la), len(lb)))
    for x, y in zip(a, b, strict=True):
        m[la.index(x), lb.index(y)] += 1
    rows, cols = linear_sum_assignment(-m)
    return sum(x == y for x, y in zip(a, b, strict=True)) / len(a), float(m[rows, cols].sum()) / len(a)


@pytest.fixture(scope="module")
def cluster(ray_cluster: object) -> Iterator[ClusterHandle]:
    spec = ClusterSpec.model_validate({
        "name": "sglang-agreement", "time_scale": 0.5, "gpus_per_actor": 4,
        "nodes": [{"name": "n0", "region": "local", "hardware": "h100-80g-sxm", "gpus": 4,
                   "engines": [{"name": "e", "model": "llama-3.1-8b", "replicas": 4}]}],
        "router": {"policy": "sglang_cache_aware"}})
    h = launch(spec)
    try:
        yield h
    finally:
        h.shutdown()


def test_sglang_cache_aware_chooses_as_the_real_sgl_router(cluster: ClusterHandle) -> None:
    from bench.router import SGLangRouter, sglang_python

    py = sglang_python(install=False)
    if py is None:
        pytest.skip("sgl-router is not installed in .venv-sglang (bench/router.py creates it)")
    import asyncio

    prompts = workload(175, seed=7)
    rng = random.Random(11)
    holders = [ids_to_text([rng.randrange(17576) for _ in range(64)]) for _ in range(sum(PHASES))]
    sgl = SGLangRouter(py, list(cluster.engine_urls.values()))
    try:
        theirs, their_hits = asyncio.run(run(cluster, sgl.url, prompts, holders))
    finally:
        sgl.stop()
    rot = [p.translate(ROT) for p in prompts]
    ours, our_hits = asyncio.run(run(cluster, cluster.router_url, rot, [p.translate(ROT) for p in holders]))
    raw, renamed = agreement(theirs, ours)
    print(f"agreement raw {raw:.3f}, up to renaming {renamed:.3f}; hit ratio sgl-router {their_hits:.4f}, "
          f"ours {our_hits:.4f}")
    assert renamed >= 0.95
    assert abs(their_hits - our_hits) <= 0.02

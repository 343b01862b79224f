"""Tier-aware routing: KV events that name a lower medium place a prefix in a worker's CPU or disk tier or its
region's store, and kv_aware prices such a hit by its load time against a cold prefill elsewhere."""

from __future__ import annotations

import random

import pytest

from actors.engine.kv_blocks import hash_request_blocks
from cluster.router.app import default_prefill_estimate
from cluster.router.choice import Chooser, RoutedRequest
from cluster.router.policies import make_policy
from cluster.router.regions import Topology
from cluster.router.tiers import TierHoldings, catalog_pricing
from cluster.router.view import ClusterView, RequestContext, WorkerId, WorkerInfo
from config.cluster import RouterSpec

MODEL, HW = "llama-3.1-8b", "h100-80g-sxm"
PROMPT = list(range(5000, 5000 + 256 * 16))  # 256 full blocks: ~0.5 GB of KV for an 8B model
HASHES = [int(h) for h in hash_request_blocks(PROMPT, 16)]


def rig(priced: bool = True, regions: tuple[str, ...] = ("r", "r", "r")) -> tuple[Chooser, list[WorkerInfo]]:
    ws = [WorkerInfo(WorkerId(f"w{i}"), f"http://w{i}", model=MODEL, hardware=HW, region=reg, num_blocks=4000,
                     free_blocks=4000, feed_connected=True) for i, reg in enumerate(regions)]
    view = ClusterView(ws, now=lambda: 0.0)
    est = default_prefill_estimate()
    ch = Chooser(RouterSpec(policy="kv_aware", index_mode="events", inflight_prefixes=False), view, Topology(),
                 est, random.Random(0), catalog_pricing(est, "rdma-ib-ndr400") if priced else None)
    for w in ws:
        ch.index.apply_snapshot(w.name, 0, [])
    return ch, ws


def route(ch: Chooser) -> tuple[str, RequestContext]:
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 1}
    ctx = RequestContext(body)
    pool = ch.eligible(MODEL, None)
    policy = make_policy("kv_aware")
    ch.prepare(policy, ctx, RoutedRequest.of(body, chat=False), pool)
    return ch.rank(policy, pool, ctx)[0].name, ctx


def stored(medium: str, hashes: list[int] = HASHES) -> list[object]:
    return ["stored", hashes, None, medium]


def test_a_cpu_tier_hit_beats_a_cold_prefill_elsewhere() -> None:
    ch, ws = rig()
    ws[0].free_blocks = 4000 - 300  # w0 is busier (decoding 300 blocks): without its CPU hit it would lose
    ch.index.apply(WorkerId("w0"), 1, [stored("CPU")])
    chosen, ctx = route(ch)
    assert chosen == "w0"
    assert ctx.overlap[WorkerId("w0")] == 0 and ctx.tier_hits[WorkerId("w0")] == 256
    # PCIe Gen5 loads 0.5 GB in ~10 ms; the 8B prefill of 4096 tokens takes far longer: a cheap hit, not free.
    assert 0 < ctx.tier_load_blocks[WorkerId("w0")] < 0.5 * 256

    unpriced, ws2 = rig(priced=False)  # the same events, but lower tiers counted as misses
    ws2[0].free_blocks = 4000 - 300
    unpriced.index.apply(WorkerId("w0"), 1, [stored("CPU")])
    assert route(unpriced)[0] != "w0"


def test_a_gpu_hit_beats_a_cpu_hit_and_a_removed_block_ends_the_chain() -> None:
    ch, _ = rig()
    ch.index.apply(WorkerId("w0"), 1, [stored("CPU")])
    ch.index.apply(WorkerId("w1"), 1, [stored("GPU")])
    assert route(ch)[0] == "w1"
    ch.index.apply(WorkerId("w1"), 2, [["removed", HASHES, "GPU"]])
    ch.index.apply(WorkerId("w0"), 2, [["removed", HASHES[100:101], "CPU"]])
    chosen, ctx = route(ch)
    assert chosen == "w0" and ctx.tier_hits[WorkerId("w0")] == 100  # the chain stops at the missing block


def test_a_store_hit_counts_for_every_worker_of_the_region_and_a_disk_hit_costs_more_than_a_cpu_hit() -> None:
    ch, _ = rig(regions=("r", "r", "far"))
    ch.index.apply(WorkerId("w1"), 1, [stored("STORE")])
    _, ctx = route(ch)
    assert ctx.tier_hits.get(WorkerId("w0")) == 256 and ctx.tier_hits.get(WorkerId("w1")) == 256
    assert WorkerId("w2") not in ctx.tier_hits  # another region's store
    ch.index.apply(WorkerId("w0"), 2, [stored("DISK")])
    ch.index.apply(WorkerId("w1"), 2, [stored("CPU")])
    _, ctx = route(ch)
    assert ctx.tier_load_blocks[WorkerId("w1")] < ctx.tier_load_blocks[WorkerId("w0")]
    ch.drop_worker(WorkerId("w1"))
    assert not ch.index.tiers.blocks_of(WorkerId("w1"), "CPU")


def test_events_without_a_medium_are_gpu_and_unknown_media_are_ignored() -> None:
    ch, _ = rig()
    ch.index.apply(WorkerId("w0"), 1, [["stored", HASHES[:4], None]])
    ch.index.apply(WorkerId("w0"), 2, [["stored", HASHES[4:8], None, "HBM-NEXT"]])
    assert ch.index.overlap(HASHES, [WorkerId("w0")]) == {WorkerId("w0"): 4}
    assert not ch.index.tiers


def test_a_load_slower_than_the_compute_is_worth_nothing() -> None:
    h = TierHoldings()
    h.stored(WorkerId("w"), "DISK", HASHES)
    w = WorkerInfo(WorkerId("w"), "http://w", model=MODEL, hardware=HW)
    pricing = catalog_pricing(lambda w, new, cached: 1e-3, "rdma-ib-ndr400")  # a GPU that prefills instantly
    k, cost = pricing.equivalent_blocks(w, 0, h.extend(HASHES, 0, WorkerId("w"), ()))
    assert k == 256 and cost == pytest.approx(256.0)

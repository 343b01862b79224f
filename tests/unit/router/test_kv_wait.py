"""kv_aware prices the wait behind a busy worker's current step, between workers that are balanced."""

from __future__ import annotations

import pytest

from actors.cost_model import RooflineCostModel, StepShape
from cluster.router.policies import make_policy
from cluster.router.policies.kv_aware import KVAware
from cluster.router.timing import CostModelTiming
from cluster.router.view import ClusterView, RequestContext, WorkerId, WorkerInfo
from config.catalog import default_catalog

BLOCK_MS = 0.35
STEP_MS = 6.5


class FixedTiming:
    """Every worker prefills a block in ``BLOCK_MS`` and runs a decode step in ``STEP_MS``."""

    def block_ms(self, w: WorkerInfo) -> float | None:
        return BLOCK_MS

    def decode_step_ms(self, w: WorkerInfo, seqs: int, context_tokens: int) -> float | None:
        return STEP_MS


def two_workers() -> list[WorkerInfo]:
    return [WorkerInfo(WorkerId(f"w{i}"), f"http://w{i}", num_blocks=1000, free_blocks=1000) for i in range(2)]


def names(ws: list[WorkerInfo]) -> list[str]:
    return [w.name for w in ws]


def homes(p: KVAware, ws: list[WorkerInfo], computed: tuple[int, int]) -> None:
    """Make the policy believe it sent each worker ``computed`` prompt blocks to compute."""
    for w, n in zip(ws, computed, strict=True):
        p.on_routed(w, RequestContext({}, block_hashes=list(range(n))))
        w.pending_blocks = 0


def busy(w: WorkerInfo) -> None:
    """One request decoding: the router has it open, its KV in use."""
    w.inflight, w.running, w.free_blocks = 1, 1, w.num_blocks - 137


def miss() -> RequestContext:
    return RequestContext({"max_tokens": 32}, block_hashes=list(range(1000, 1136)))


def test_a_miss_goes_to_the_idle_worker_when_both_are_balanced() -> None:
    ws = two_workers()
    p = make_policy("kv_aware")
    assert isinstance(p, KVAware)
    homes(p, ws, (136, 160))  # w0 computed 24 blocks less: within half a footprint (69 blocks)
    busy(ws[0])
    timed = ClusterView(ws, timing=FixedTiming())
    assert p.wait_blocks(ws[0], timed) == pytest.approx(1.5 * STEP_MS / BLOCK_MS)
    assert p.wait_blocks(ws[1], timed) == 0.0
    assert names(p.rank(ws, miss(), timed)) == ["w1", "w0"]
    # With balance_requests 0 (the old rule) the fewest computed goes first, busy or not.
    strict = make_policy("kv_aware", params={"balance_requests": 0})
    homes(strict, ws, (136, 160))  # type: ignore[arg-type]
    assert names(strict.rank(ws, miss(), timed)) == ["w0", "w1"]


def test_balance_still_wins_over_a_momentary_wait() -> None:
    # w1 is idle but already home to one more prefix than w0: a new home goes to w0 all the same, since
    # every later request of the prefix would follow it to the busier worker.
    ws = two_workers()
    p = make_policy("kv_aware")
    homes(p, ws, (136, 272))  # type: ignore[arg-type]
    busy(ws[0])
    assert names(p.rank(ws, miss(), ClusterView(ws, timing=FixedTiming())))[0] == "w0"
    p2 = make_policy("kv_aware", params={"balance_requests": 1.0})
    homes(p2, ws, (136, 272))  # type: ignore[arg-type]
    assert names(p2.rank(ws, miss(), ClusterView(ws, timing=FixedTiming())))[0] == "w1"


def test_a_hit_held_twice_goes_to_the_holder_that_is_idle() -> None:
    ws = two_workers()
    p = make_policy("kv_aware")
    busy(ws[0])
    ws[0].free_blocks = ws[1].free_blocks = 900  # as reported a beat ago: the decode's blocks do not tell them apart
    hit = RequestContext({"max_tokens": 32}, block_hashes=list(range(136)),
                         overlap={WorkerId("w0"): 128, WorkerId("w1"): 128})
    assert names(p.rank(ws, hit, ClusterView(ws, timing=FixedTiming())))[0] == "w1"
    assert names(make_policy("kv_aware", params={"steps_ahead": 0}).rank(ws, hit, ClusterView(ws)))[0] == "w0"


def test_cost_model_timing_is_the_catalog_cost_model_and_none_for_an_unknown_worker() -> None:
    cat = default_catalog()
    cm = RooflineCostModel(cat.hardware.get("h100-80g-sxm"), cat.models.get("llama-3.1-8b"), 1)
    w = WorkerInfo(WorkerId("w"), "http://w", model="llama-3.1-8b", hardware="h100-80g-sxm")
    t = CostModelTiming()
    assert t.block_ms(w) == pytest.approx(cm.step(StepShape.of(prefills=[(2048, 0)])).total_ms / 128)
    assert t.decode_step_ms(w, 4, 4 * 1024) == pytest.approx(cm.step(StepShape.of(decodes=[1024] * 4)).total_ms)
    # A decode step is dearer than a block of prefill and cheaper than a 2k-token prompt's prefill.
    step = t.decode_step_ms(w, 1, 2200)
    block = t.block_ms(w)
    assert step is not None and block is not None and block < step < 128 * block
    unknown = WorkerInfo(WorkerId("u"), "http://u", model="no-such-model", hardware="h100-80g-sxm")
    assert t.block_ms(unknown) is None and t.decode_step_ms(unknown, 1, 100) is None
    p = make_policy("kv_aware")
    busy(unknown)
    assert p.wait_blocks(unknown, ClusterView([unknown], timing=t)) == 0.0  # type: ignore[attr-defined]

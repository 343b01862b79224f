"""The engine with KV tiers, on the virtual clock: prefix hits from the CPU tier pay the modelled load time,
swap preemption resumes with the same tokens, a failing tier falls back to recompute, events carry media."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable

import pytest
from prometheus_client.parser import text_string_to_metric_families

from actors.cost_model import EmpiricalCostModel, StepTime
from actors.engine.engine import Engine, EngineConfig, EngineObserver
from actors.engine.kv_blocks import BlockStored, KVEvent
from actors.engine.scheduler import ScheduledStep, SchedulerLimits, TokenOutput
from actors.engine.sequence import Sequence
from actors.engine.tiers.base import MEDIUM_CPU, MEDIUM_GPU
from actors.engine.tiers.faulty import FaultyTier
from actors.metrics import EngineMetrics
from config import default_catalog
from config.tiers import CPUTierSpec, TiersSpec
from tests.virtual_clock import VirtualClock

LESSON = default_catalog().profiles.get("lesson-70b-fp8")
CPU_1GB = TiersSpec(cpu=CPUTierSpec(capacity_gb=1.0))

MakeTiered = Callable[..., Engine]


class Steps:
    """Records each step's cost (an EngineObserver)."""

    def __init__(self) -> None:
        self.costs: list[tuple[float, StepTime]] = []

    def on_step(self, engine: Engine, step: ScheduledStep, cost: StepTime, lag_wall_ms: float) -> None:
        self.costs.append((step.start_ms, cost))

    def on_tokens(self, engine: Engine, outputs: list[TokenOutput], end_ms: float) -> None:
        pass

    def on_finish(self, engine: Engine, seq: Sequence) -> None:
        pass


@pytest.fixture
async def make_tiered(vclock: VirtualClock) -> AsyncIterator[MakeTiered]:
    made: list[Engine] = []

    def make(blocks: int, tiers: TiersSpec = CPU_1GB, *, seqs: int = 256,
             obs: list[EngineObserver] | None = None) -> Engine:
        cfg = EngineConfig(f"t{len(made)}", "lesson", "colocated", blocks, 16, SchedulerLimits(seqs, 8192, 100_000),
                           tiers=tiers, kv_payload_scale=1 / 256)
        eng = Engine(cfg, EmpiricalCostModel(LESSON, "colocated"), vclock, observers=obs)
        made.append(eng)
        eng.start()
        return eng

    yield make
    for eng in made:
        await eng.stop()
    for _ in range(3):
        await asyncio.sleep(0)
    leftover = [t for t in asyncio.all_tasks() if t is not asyncio.current_task() and not t.done()]
    assert not leftover, f"tasks left behind: {leftover}"
    for eng in made:
        assert eng.tiers is None or not eng.tiers.loading
        assert not eng.kv.req_blocks and eng.kv.pool.num_free == eng.cfg.num_blocks


def prompt(seed: int, n: int) -> list[int]:
    return [(seed * 7919 + i * 31) % 30000 + 1 for i in range(n)]


async def run(eng: Engine, ids: list[int], max_tokens: int, arrival_ms: float | None = None) -> tuple[list[int], float]:
    stream = eng.submit(ids, max_tokens, ignore_eos=True, arrival_ms=arrival_ms)
    toks: list[int] = []
    first = -1.0
    async for ev in stream:
        if ev.token_ids and first < 0:
            first = ev.time_ms
        toks.extend(ev.token_ids)
    return toks, first - stream.seq.arrival_ms


async def test_prefix_from_cpu_tier_costs_the_modelled_load(vclock: VirtualClock, make_tiered: MakeTiered) -> None:
    steps = Steps()
    metrics = EngineMetrics("lesson", "t0")
    eng = make_tiered(64, obs=[steps, metrics])
    events: list[KVEvent] = []
    eng.kv_subscribers.append(lambda _seq, evs: events.extend(evs))
    a, b = prompt(1, 960), prompt(2, 960)

    async def scenario() -> tuple[float, float, int]:
        _, cold = await run(eng, a, 1)
        await run(eng, b, 1)  # needs the GPU blocks A left cached: they are evicted, written to the CPU tier
        assert eng.tiers is not None
        await eng.tiers.chain.flush()
        steps.costs.clear()
        toks, warm = await run(eng, a, 1, arrival_ms=vclock.now_ms())
        return cold, warm, len(toks)

    cold, warm, n = await vclock.run(scenario())
    assert n == 1 and eng.tiers is not None
    cpu = eng.tiers.chain.stats[MEDIUM_CPU]
    assert cpu.load_blocks > 0 and eng.tiers.counters.loads == 1 and eng.tiers.counters.fallbacks == 0
    (_, step), = steps.costs  # one step computes the rest of the prompt after the load
    assert warm == pytest.approx(cpu.load_s * 1000.0 + step.total_ms)
    assert warm < cold
    media = {(type(e).__name__, getattr(e, "medium", None)) for e in events}
    assert ("BlockStored", MEDIUM_CPU) in media and ("BlockRemoved", MEDIUM_GPU) in media
    cpu_stored = {h for e in events if isinstance(e, BlockStored) and e.medium == MEDIUM_CPU for h in e.block_hashes}
    assert cpu_stored  # the router learns where evicted prefixes went
    got = {(m.name, tuple(sorted(m.labels.items()))): m.value
           for fam in text_string_to_metric_families(metrics.exposition().decode()) for m in fam.samples}
    cpu_lv = (("engine", "t0"), ("medium", "CPU"), ("model_name", "lesson"))
    assert got["vllm:kv_offload_load_bytes_total", cpu_lv] == cpu.load_bytes
    assert got["vllm:kv_offload_store_bytes_total", cpu_lv] == cpu.store_bytes > 0
    assert got["kvmesh:kv_tier_hit_blocks_total", cpu_lv] == cpu.load_blocks
    assert got["lmcache:time_to_retrieve_count", cpu_lv] == 1
    assert got["vllm:external_prefix_cache_hits_total", (("engine", "t0"), ("model_name", "lesson"))] \
        == cpu.load_blocks * 16


async def test_failing_tier_falls_back_to_recompute(vclock: VirtualClock, make_tiered: MakeTiered) -> None:
    eng = make_tiered(64)
    ref = make_tiered(4096, TiersSpec())
    a, b = prompt(1, 960), prompt(2, 960)

    async def scenario() -> tuple[list[int], list[int]]:
        await run(eng, a, 1)
        await run(eng, b, 1)
        assert eng.tiers is not None
        await eng.tiers.chain.flush()
        faulty = FaultyTier(eng.tiers.chain.tiers[0], "fail")
        eng.tiers.chain.tiers[0] = faulty
        got, _ = await run(eng, a, 8, arrival_ms=vclock.now_ms())
        assert faulty.gets == 1
        want, _ = await run(ref, a, 8)
        return got, want

    got, want = await vclock.run(scenario())
    assert got == want  # served in full, by recompute
    assert eng.tiers is not None
    assert eng.tiers.counters.fallbacks == 1
    assert eng.tiers.chain.stats[MEDIUM_CPU].fallbacks == 1


@pytest.mark.parametrize("mode", ["swap", "recompute"])
async def test_swap_preemption_resumes_with_the_same_tokens(vclock: VirtualClock, make_tiered: MakeTiered,
                                                            mode: str) -> None:
    # Two 256-token prompts decoding 200 tokens each need 2 x 29 blocks; 40 blocks force preemptions.
    eng = make_tiered(40, TiersSpec(cpu=CPUTierSpec(capacity_gb=1.0), preemption=mode))
    ref = make_tiered(4096, TiersSpec())
    prompts = [prompt(3, 256), prompt(4, 256)]

    async def both(e: Engine) -> list[list[int]]:
        outs = await asyncio.gather(*(run(e, p, 200) for p in prompts))
        return [t for t, _ in outs]

    got = await vclock.run(both(eng))
    want = await vclock.run(both(ref))
    assert got == want
    assert eng.scheduler.stats.preemptions > 0 and eng.tiers is not None
    if mode == "swap":
        assert eng.tiers.counters.swaps_out == eng.scheduler.stats.preemptions
        assert eng.tiers.counters.swaps_in == eng.tiers.counters.swaps_out
        assert eng.scheduler.stats.prompt_tokens == 512  # nothing recomputed: every prompt prefilled once
    else:
        assert eng.tiers.counters.swaps_out == 0
        assert eng.scheduler.stats.prompt_tokens >= 512


async def test_hanging_tier_times_out_into_recompute() -> None:
    """On the real clock (the I/O timeout is wall time): a tier that never answers costs ``io_timeout_s``,
    then the request recomputes and completes."""
    from actors.clock import Clock

    clock = Clock(0.01, spin_ms=0)
    cfg = EngineConfig("hang", "lesson", "colocated", 64, 16, SchedulerLimits(256, 8192, 100_000),
                       tiers=TiersSpec(cpu=CPUTierSpec(capacity_gb=1.0), io_timeout_s=0.05), kv_payload_scale=1 / 256)
    eng = Engine(cfg, EmpiricalCostModel(LESSON, "colocated"), clock)
    eng.start()
    try:
        a, b = prompt(1, 960), prompt(2, 960)
        first, _ = await run(eng, a, 4)
        await run(eng, b, 1)
        assert eng.tiers is not None
        await eng.tiers.chain.flush()
        faulty = FaultyTier(eng.tiers.chain.tiers[0], "hang")
        eng.tiers.chain.tiers[0] = faulty
        again, _ = await asyncio.wait_for(run(eng, a, 4), 10)
        assert again == first and faulty.gets == 1
        assert eng.tiers.chain.fallback_reasons[(MEDIUM_CPU, "TierTimeout")] == 1
    finally:
        await eng.stop()
    assert not eng.kv.req_blocks and eng.kv.pool.num_free == 64


def test_virtual_driver_refuses_tiers() -> None:
    from actors.engine.virtual import VirtualDriver

    cfg = EngineConfig("v", "lesson", "colocated", 64, 16, SchedulerLimits(8, 8192, 100_000), tiers=CPU_1GB)
    with pytest.raises(ValueError, match="does not run KV tiers"):
        VirtualDriver(cfg, EmpiricalCostModel(LESSON, "colocated"))


async def test_tiers_price_their_store_path_unless_off(vclock: VirtualClock, make_tiered: MakeTiered) -> None:
    from actors.engine.tiers.overhead import ConnectorCostModel

    lm = make_tiered(64, TiersSpec(cpu=CPUTierSpec(capacity_gb=1.0), connector_overhead="kernel-sync"))
    assert isinstance(lm.cost, ConnectorCostModel) and lm.cost.path_name == "kernel-sync"
    off = make_tiered(64, TiersSpec(cpu=CPUTierSpec(capacity_gb=1.0), connector_overhead="off"))
    assert isinstance(off.cost, EmpiricalCostModel)

    async def scenario() -> tuple[float, float]:
        _, slow = await run(lm, prompt(3, 960), 1)
        _, fast = await run(off, prompt(3, 960), 1)
        return slow, fast

    slow, fast = await vclock.run(scenario())
    assert slow - fast == pytest.approx(lm.cost.connector_ms) and lm.cost.connector_ms > 0

"""KV tiers: throughput of each tier against its preset, and the overhead of tiers at low memory pressure.

1. Per tier (CPU DRAM, local disk): blocks of Llama-3.1-8B KV (16 tokens, 2 MiB emulated) are put and read
   back in batches of 16. Reported: the preset's rate, the modelled rate (emulated bytes / ``transfer_s``, so
   latency included), the real rate of our implementation on this host (real, payload-scaled bytes per wall
   second) and what that real rate stands for in emulated bytes (``/ kv_payload_scale``): above the preset,
   the emulator moves the real bytes faster than the link it models, so tier I/O never holds it back.
2. Low pressure: the same trace (sessions sharing 1,536-token prefixes, Poisson arrivals, seeded) through
   one engine whose KV fits in HBM, with tiers off and on (CPU + disk). Reported: TTFT p50/mean and makespan
   in emulated ms for both, their ratio (the overhead; the lessons card quotes 3-5% for LMCache at low
   pressure), and the wall seconds each run took (the emulator's own cost of the tiers).
3. For contrast, the same trace with a GPU cache too small for it: prefix hit ratio and TTFT with tiers off
   (recompute) and on (load from CPU).

The engine runs its real step loop on the shared virtual clock (``tests/virtual_clock.py``): emulated time
jumps to each deadline, so figures are exact and the run takes its bookkeeping time only.
"""

from __future__ import annotations

import asyncio
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from actors.cost_model import RooflineCostModel
from actors.engine.engine import Engine, EngineConfig
from actors.engine.kv_blocks import BlockHash
from actors.engine.scheduler import SchedulerLimits
from actors.engine.tiers.base import KVTier
from actors.engine.tiers.cpu import CPUTier
from actors.engine.tiers.disk import DiskTier
from actors.engine.tiers.payload import BlockPayloads
from actors.engine.tiers.policies import make_policy
from bench._common import emit, parser
from config import default_catalog
from config.tiers import CPUTierSpec, DiskTierSpec, TierDevice, TiersSpec, tier_devices
from tests.virtual_clock import VirtualClock

SCALE = 1 / 64
BATCH = 16


def cost_model() -> RooflineCostModel:
    cat = default_catalog()
    return RooflineCostModel(cat.hardware.get("h100-80g-sxm"), cat.models.get("llama-3.1-8b"), 1)


async def tier_rates(tier: KVTier, device: TierDevice, payloads: BlockPayloads, n: int) -> dict[str, float]:
    keys = [BlockHash(0x5000 + i) for i in range(n)]
    blocks = [(k, payloads.payload(k)) for k in keys]
    t0 = time.perf_counter()
    for i in range(0, n, BATCH):
        await tier.put(blocks[i:i + BATCH])
    put_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    for i in range(0, n, BATCH):
        got = await tier.get(keys[i:i + BATCH])
        assert all(payloads.matches(k, g) for k, g in zip(keys[i:i + BATCH], got, strict=True))
    get_s = time.perf_counter() - t0
    real = n * payloads.block_bytes
    emu_batch = BATCH * payloads.emulated_block_bytes
    out = {"preset_read_gbps": device.read_gbps, "preset_write_gbps": device.write_gbps,
           "modelled_load_gbps": emu_batch / tier.transfer_s(int(emu_batch), False) / 1e9,
           "modelled_store_gbps": emu_batch / tier.transfer_s(int(emu_batch), True) / 1e9,
           "real_load_gbps": real / get_s / 1e9, "real_store_gbps": real / put_s / 1e9}
    out["real_load_as_emulated_gbps"] = out["real_load_gbps"] / SCALE
    out["real_store_as_emulated_gbps"] = out["real_store_gbps"] / SCALE
    out["load_keeps_up_ratio"] = out["real_load_as_emulated_gbps"] / device.read_gbps
    out["store_keeps_up_ratio"] = out["real_store_as_emulated_gbps"] / device.write_gbps
    await tier.close()
    return {k: round(v, 3) for k, v in out.items()}


def trace(n: int, seed: int) -> list[tuple[float, list[int]]]:
    """(arrival ms, prompt): 8 sessions, each request its session's 1,536-token prefix + 512 new tokens."""
    rng = np.random.default_rng(seed)
    t = 0.0
    out = []
    prefixes = [list(rng.integers(16, 100_000, 1536)) for _ in range(8)]
    for i in range(n):
        t += float(rng.exponential(40.0))
        out.append((t, [int(x) for x in prefixes[i % 8]] + [int(x) for x in rng.integers(16, 100_000, 512)]))
    return out


async def replay(blocks: int, tiers: TiersSpec, reqs: list[tuple[float, list[int]]]) -> dict[str, Any]:
    clock = VirtualClock()
    cost = cost_model()
    cfg = EngineConfig("bench", "llama-3.1-8b", "colocated", blocks, 16, SchedulerLimits(256, 8192, 131_072),
                       tiers=tiers, kv_payload_scale=SCALE)
    eng = Engine(cfg, cost, clock)
    eng.start()
    ttft: list[float] = []
    ends: list[float] = []

    async def one(at: float, prompt: list[int]) -> None:
        await clock.sleep_until(at)
        stream = eng.submit(prompt, 64, ignore_eos=True, arrival_ms=at)
        first = None
        async for ev in stream:
            if ev.token_ids and first is None:
                first = ev.time_ms
            if ev.finish_reason is not None:
                ends.append(ev.time_ms)
        assert first is not None
        ttft.append(first - at)

    async def all_of() -> None:
        await asyncio.gather(*(one(at, p) for at, p in reqs))

    t0 = time.perf_counter()
    await clock.run(all_of())
    wall = time.perf_counter() - t0
    st = eng.scheduler.stats
    out: dict[str, Any] = {
        "ttft_p50_ms": round(float(np.percentile(ttft, 50)), 3), "ttft_mean_ms": round(float(np.mean(ttft)), 3),
        "makespan_ms": round(max(ends), 3), "gpu_prefix_hit_ratio": round(st.prefix_hits / st.prefix_queries, 4),
        "preemptions": st.preemptions, "wall_s": round(wall, 3)}
    if eng.tiers is not None:
        c = eng.tiers.counters
        out.update(tier_hit_ratio=round(c.external_hits / max(1, c.external_queries), 4), tier_loads=c.loads,
                   fallbacks=c.fallbacks, gpu_evictions_written=sum(s.store_blocks for s in
                                                                   eng.tiers.chain.stats.values()))
    await eng.stop()
    return out


def pct_over(on: dict[str, Any], off: dict[str, Any], key: str) -> float:
    return round(100.0 * (on[key] / off[key] - 1.0), 3)


async def main(quick: bool) -> dict[str, Any]:
    dev = tier_devices()
    emu_block = 16 * cost_model().kv_bytes_per_token
    payloads = BlockPayloads(emu_block, SCALE)
    n = 256 if quick else 2048
    rates = {"cpu": await tier_rates(CPUTier(n, dev["pcie-gen5-x16"], make_policy("lru")), dev["pcie-gen5-x16"],
                                     payloads, n)}
    with tempfile.TemporaryDirectory(prefix="kvmesh-bench-tiers-") as d:
        rates["disk"] = await tier_rates(DiskTier(n, dev["nvme-gen4"], make_policy("lru"), Path(d)),
                                         dev["nvme-gen4"], payloads, n)
    reqs = trace(48 if quick else 192, seed=1)
    with tempfile.TemporaryDirectory(prefix="kvmesh-bench-disk-") as d:
        on = TiersSpec(cpu=CPUTierSpec(capacity_gb=32), disk=DiskTierSpec(capacity_gb=64, directory=d))
        low_off = await replay(20_000, TiersSpec(), reqs)
        low_on = await replay(20_000, on, reqs)
        # 640 blocks (10,240 tokens) hold five 2,048-token prompts: sessions' prefixes are evicted between turns.
        high_off = await replay(640, TiersSpec(), reqs)
        high_on = await replay(640, on, reqs)
    return {
        "payload_scale": SCALE, "tier_rates": rates,
        "low_pressure": {"tiers_off": low_off, "tiers_on": low_on,
                         "ttft_mean_overhead_pct": pct_over(low_on, low_off, "ttft_mean_ms"),
                         "makespan_overhead_pct": pct_over(low_on, low_off, "makespan_ms"),
                         "wall_overhead_pct": pct_over(low_on, low_off, "wall_s"),
                         "lessons_card_claim_pct": "3-5"},
        "high_pressure": {"tiers_off": high_off, "tiers_on": high_on,
                          "ttft_mean_change_pct": pct_over(high_on, high_off, "ttft_mean_ms")},
    }


if __name__ == "__main__":
    args = parser(__doc__.splitlines()[0]).parse_args()
    emit(asyncio.run(main(args.quick)))

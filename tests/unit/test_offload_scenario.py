"""The offload scenario's parts: the ideal hit ratio of hash ids, and a virtual cluster serving every request
under each configuration, the shared store supplying hits the GPU caches miss."""

from __future__ import annotations

from cluster.loadtest.spec import RequestId, RequestSpec
from cluster.scenarios.offload import CONFIGS, ideal_hit_ratios, run_config, sessions_workload


def spec(i: int, ids: tuple[int, ...], input_len: int) -> RequestSpec:
    return RequestSpec(RequestId(f"r{i}"), float(i), input_len, 4, ids, 512)


def test_ideal_hit_ratio_counts_blocks_seen_before_and_leading_tokens() -> None:
    specs = [spec(0, (1, 2, 3), 1536), spec(1, (1, 2, 4), 1400), spec(2, (5, 2), 1024)]
    ideal = ideal_hit_ratios(specs)
    assert ideal["blocks"] == 3 / 8  # 1, 2 again in r1; 2 again in r2 (an id is a whole prefix in Mooncake)
    assert ideal["tokens"] == (2 * 512) / (1536 + 1400 + 1024)  # r2's first block misses: no leading hit
    assert ideal["distinct_blocks"] == 5


def test_every_configuration_serves_every_request_and_the_store_adds_hits() -> None:
    work = sessions_workload(quick=True, seed=1)[:24]
    # 1024 blocks per engine: the 24 long sessions overflow the GPU caches, so the CPU tier has blocks to return
    rows = {c: run_config(c, work, gpu_blocks=1024, seed=1) for c in CONFIGS}
    for r in rows.values():
        assert r["served"] == r["requests"] == 24 and r["tier_fallbacks"] == 0
    assert rows["NATIVE_ONLY"]["tier_hit_ratio"] == 0.0
    assert rows["LMCACHE"]["store_blocks"] > 0
    assert rows["CPU_OFFLOAD"]["prefix_hit_ratio"] > rows["NATIVE_ONLY"]["prefix_hit_ratio"]

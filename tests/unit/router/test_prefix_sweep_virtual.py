"""kv_aware on bench/router.py's prefix-heavy workload, replayed on virtual time (no Ray, no sockets)."""

from __future__ import annotations

from bench._router_virtual import replay_point

POINT = {"ratio": 1.0, "n": 300, "rate": 10.0, "seed": 100}
"""A working set of one engine's cache: 8 prefixes that each fit on every one of the 4 engines."""


def test_kv_aware_spreads_prefix_homes_over_the_engines() -> None:
    # With exact ties only, a miss that met one engine finishing a decode went to an idle one that already
    # was home to more prefixes: 3 homes there, 1 on another (108 and 38 of 300 requests).
    before = replay_point("kv_aware", **POINT, params={"near_tie_requests": 0})  # type: ignore[arg-type]
    after = replay_point("kv_aware", **POINT)  # type: ignore[arg-type]
    assert max(after["requests_per_engine"]) < max(before["requests_per_engine"])
    assert min(after["requests_per_engine"]) > min(before["requests_per_engine"])
    assert after["prefix_hit_ratio"] == before["prefix_hit_ratio"]  # every prefix still has one home
    assert after["ttft_mean_ms"] < before["ttft_mean_ms"]


def test_kv_aware_matches_sglang_cache_aware_hits_with_a_lower_mean_ttft() -> None:
    kv = replay_point("kv_aware", **POINT)  # type: ignore[arg-type]
    sg = replay_point("sglang_cache_aware", **POINT)  # type: ignore[arg-type]
    assert kv["prefix_hit_ratio"] >= sg["prefix_hit_ratio"]
    assert kv["ttft_mean_ms"] < sg["ttft_mean_ms"]


def test_kv_aware_sends_a_miss_to_an_idle_engine_rather_than_behind_a_busy_ones_step() -> None:
    # Two engines' caches of prefixes. With the fewest blocks computed always first (balance_requests 0), some
    # misses met an engine mid-decode (its running request's ~137 blocks inside the near-tie slack) while
    # another, as balanced, was idle, and waited ~1.5 decode steps: 47 -> 56 ms, the TTFT p99.
    point = {"ratio": 2.0, "n": 300, "rate": 10.0, "seed": 201}
    before = replay_point("kv_aware", **point, params={"balance_requests": 0})  # type: ignore[arg-type]
    after = replay_point("kv_aware", **point)  # type: ignore[arg-type]
    assert after["ttft_p99_ms"] < before["ttft_p99_ms"]
    assert after["ttft_mean_ms"] <= before["ttft_mean_ms"]
    assert after["prefix_hit_ratio"] == before["prefix_hit_ratio"]

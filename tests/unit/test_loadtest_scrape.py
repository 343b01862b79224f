"""Reading the target's Prometheus page: counter deltas, step-lag quantiles, worker lists."""

from __future__ import annotations

import math

import pytest

from cluster.loadtest.scrape import (
    RUNNING,
    STEP_LAG,
    WAITING,
    TargetProbe,
    histogram_quantile,
    merge,
    only_metrics,
    parse_metrics,
    parse_workers,
    prefix_hit_ratio,
    step_lag,
)


def page(queries: float, hits: float, buckets: dict[str, float], running: float = 0, waiting: float = 0) -> str:
    lines = [
        "# HELP vllm:prefix_cache_queries Prefix cache queries.",
        "# TYPE vllm:prefix_cache_queries counter",
        f'vllm:prefix_cache_queries_total{{engine="e0",model_name="m"}} {queries}',
        "# HELP vllm:prefix_cache_hits Prefix cache hits.",
        "# TYPE vllm:prefix_cache_hits counter",
        f'vllm:prefix_cache_hits_total{{engine="e0",model_name="m"}} {hits}',
        "# TYPE kvmesh:step_lag_ms histogram",
    ]
    total = 0.0
    for le, n in buckets.items():
        total = n
        lines.append(f'kvmesh:step_lag_ms_bucket{{engine="e0",le="{le}",model_name="m"}} {n}')
    lines += [f'kvmesh:step_lag_ms_count{{engine="e0",model_name="m"}} {total}',
              'kvmesh:step_lag_ms_sum{engine="e0",model_name="m"} 1.0',
              "# TYPE vllm:num_requests_running gauge",
              f'vllm:num_requests_running{{engine="e0",model_name="m"}} {running}',
              "# TYPE vllm:num_requests_waiting gauge",
              f'vllm:num_requests_waiting{{engine="e0",model_name="m"}} {waiting}']
    return "\n".join(lines) + "\n"


BEFORE = page(1000, 100, {"1.0": 10, "2.0": 10, "5.0": 10, "+Inf": 10})
AFTER = page(3000, 900, {"1.0": 60, "2.0": 100, "5.0": 109, "+Inf": 110}, running=3, waiting=2)


def test_counters_are_read_by_name_without_total() -> None:
    m = parse_metrics(AFTER)
    assert m.total("vllm:prefix_cache_queries") == 3000
    assert m.total("vllm:num_requests_running") == 3
    assert m.buckets["kvmesh:step_lag_ms"] == {1.0: 60, 2.0: 100, 5.0: 109, math.inf: 110}


def test_prefix_hit_ratio_is_the_delta_of_hits_over_queries() -> None:
    assert prefix_hit_ratio(parse_metrics(BEFORE), parse_metrics(AFTER)) == pytest.approx(800 / 2000)
    assert prefix_hit_ratio(None, parse_metrics(AFTER)) is None
    assert prefix_hit_ratio(parse_metrics(AFTER), parse_metrics(AFTER)) is None  # nothing queried
    assert prefix_hit_ratio(parse_metrics("x 1\n"), parse_metrics("x 2\n")) is None


def test_step_lag_quantiles_from_the_bucket_deltas() -> None:
    lag = step_lag(parse_metrics(BEFORE), parse_metrics(AFTER))
    assert lag is not None
    # deltas: <=1: 50, <=2: 90, <=5: 99, +Inf: 100. p50 at rank 50 -> 1.0; p99 at rank 99 -> 5.0.
    assert lag["steps"] == 100
    assert lag["p50"] == pytest.approx(1.0)
    assert lag["p99"] == pytest.approx(5.0)
    assert lag["max"] == 5.0  # the +Inf bucket gained one: the largest finite bound
    assert lag["steps_over_top_bucket"] == 1
    assert step_lag(None, parse_metrics("x 1\n")) is None


def test_histogram_quantile_interpolates_inside_a_bucket() -> None:
    cum = {1.0: 10.0, 2.0: 30.0, math.inf: 30.0}
    assert histogram_quantile(0.5, cum) == pytest.approx(1.25)  # rank 15: 5 of the 20 in (1, 2]
    assert histogram_quantile(0.2, cum) == pytest.approx(0.6)
    assert histogram_quantile(0.5, {1.0: 0.0, math.inf: 0.0}) is None
    assert histogram_quantile(0.99, {1.0: 1.0, math.inf: 5.0}) == 1.0


def test_worker_lists_of_every_shape() -> None:
    assert parse_workers(["http://a:1", "nope"]) == [("http://a:1", "http://a:1")]
    assert parse_workers([{"name": "e0", "url": "http://h:2/"}, {"url": 5}]) == [("e0", "http://h:2")]
    assert parse_workers({"workers": [{"id": "w", "base_url": "http://h:3"}]}) == [("w", "http://h:3")]
    assert parse_workers({"something": 1}) == []
    assert parse_workers("text") == []


def test_workers_pages_fill_in_what_the_target_lacks() -> None:
    router = parse_metrics("kvmesh_router_decisions_total{worker=\"e0\"} 5\n")
    w0, w1 = parse_metrics(BEFORE), parse_metrics(AFTER)
    both = TargetProbe.combined(router, {"e0": w0, "e1": w1})
    assert both is not None
    assert both.total("vllm:prefix_cache_queries") == 4000
    assert both.total("kvmesh_router_decisions") == 5
    assert merge([w0, w1]).buckets["kvmesh:step_lag_ms"][1.0] == 70
    assert TargetProbe.combined(None, {}) is None


def test_the_depth_poll_parses_only_its_two_gauges_with_the_same_values() -> None:
    text = """# HELP vllm:num_requests_running Running.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="e-0",model_name="m"} 3.0
# HELP vllm:num_requests_running_extra Not this one.
# TYPE vllm:num_requests_running_extra gauge
vllm:num_requests_running_extra{engine="e-0"} 9.0
# HELP vllm:num_requests_waiting Waiting.
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting 2.0
# HELP kvmesh:step_lag_ms Lag.
# TYPE kvmesh:step_lag_ms histogram
kvmesh:step_lag_ms_bucket{le="1.0"} 5.0
kvmesh:step_lag_ms_bucket{le="+Inf"} 6.0
kvmesh:step_lag_ms_count 6.0
kvmesh:step_lag_ms_sum 7.0
"""
    full = parse_metrics(text)
    cut = parse_metrics(only_metrics(text, (RUNNING, WAITING)))
    assert cut.series(RUNNING) == full.series(RUNNING) == {(("engine", "e-0"),): 3.0}
    assert cut.total(WAITING) == full.total(WAITING) == 2.0
    assert not cut.has("vllm:num_requests_running_extra") and not cut.has(STEP_LAG)

"""Shaping a trace: windows, request caps, bucket jitter, re-timing to a rate."""

from __future__ import annotations

import numpy as np
import pytest

from cluster.loadtest import RequestId, RequestSpec
from cluster.loadtest.schedule import RETIMERS, jitter_buckets, mean_rate, poisson_retime, scale_to_rate, window


def specs(times: list[float]) -> tuple[RequestSpec, ...]:
    return tuple(RequestSpec(RequestId(f"r{i}"), t, 16, 1) for i, t in enumerate(times))


def test_window_rebases_and_caps() -> None:
    s = specs([1000, 2000, 3000, 4000, 5000])
    w = window(s, start_s=1.0, duration_s=2.5)
    assert [(x.request_id, x.arrival_ms) for x in w] == [("r1", 0.0), ("r2", 1000.0), ("r3", 2000.0)]
    assert [x.request_id for x in window(s, max_requests=2)] == ["r0", "r1"]
    assert window(s, start_s=100.0) == ()
    assert window((), 0.0) == ()


def test_jitter_spreads_each_bucket_up_to_the_next_timestamp() -> None:
    s = specs([0, 0, 0, 3000, 3000, 6000, 9000])
    j = jitter_buckets(s, np.random.default_rng(0))
    assert j == jitter_buckets(s, np.random.default_rng(0))
    by_id: dict[str, float] = {x.request_id: x.arrival_ms for x in j}
    assert all(0 <= by_id[f"r{i}"] < 3000 for i in range(3))
    assert all(3000 <= by_id[f"r{i}"] < 6000 for i in (3, 4))
    assert 9000 <= by_id["r6"] < 12000  # the last bucket takes the median width
    assert [x.arrival_ms for x in j] == sorted(x.arrival_ms for x in j)
    assert len({by_id[f"r{i}"] for i in range(3)}) == 3


def test_retimers() -> None:
    s = specs([0, 500, 1000, 2000])
    assert mean_rate(s) == pytest.approx(1.5)
    scaled = scale_to_rate(s, 3.0, 1.0, np.random.default_rng(0))
    assert [x.arrival_ms for x in scaled] == pytest.approx([0, 250, 500, 1000])
    assert mean_rate(scaled) == pytest.approx(3.0)
    many = specs([0.0] * 2001)
    p = poisson_retime(many, 100.0, 1.0, np.random.default_rng(1))
    assert p[0].arrival_ms == 0.0 and [x.request_id for x in p] == [x.request_id for x in many]
    assert mean_rate(p) == pytest.approx(100.0, rel=0.1)
    with pytest.raises(ValueError, match="no time span"):
        scale_to_rate(specs([5, 5]), 1.0, 1.0, np.random.default_rng(0))
    assert set(RETIMERS) == {"scale", "poisson"}


def test_gamma_burstiness_changes_the_spread_not_the_rate() -> None:
    many = specs([0.0] * 4001)
    smooth = poisson_retime(many, 50.0, 10.0, np.random.default_rng(2))
    bursty = poisson_retime(many, 50.0, 0.2, np.random.default_rng(2))

    def cv(x: tuple[RequestSpec, ...]) -> float:
        gaps = np.diff([r.arrival_ms for r in x])
        return float(gaps.std() / gaps.mean())

    assert cv(smooth) < 0.5 < 1.5 < cv(bursty)
    assert mean_rate(smooth) == pytest.approx(50, rel=0.1) and mean_rate(bursty) == pytest.approx(50, rel=0.25)

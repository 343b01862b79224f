"""vLLM's benchmark metrics over a hand-built timeline whose answers are known exactly."""

from __future__ import annotations

import pytest

from cluster.loadtest import RequestId, RequestRecord, calculate_metrics, max_rate_meeting_target, parse_slos
from cluster.loadtest.metrics import cdf, meets_slos, stats, throughput_timeline


def rec(rid: str, sent: float, ttft: float | None, itl: tuple[float, ...], out: int, n_in: int = 100,
        status: str = "ok") -> RequestRecord:
    ok = status == "ok"
    return RequestRecord(
        request_id=RequestId(rid), status=status, scheduled_ms=sent, sent_ms=sent, input_len=n_in,  # type: ignore[arg-type]
        expected_output_len=out, ttft_ms=ttft if ok else None,
        e2e_ms=(ttft + sum(itl)) if ok and ttft is not None else None, itl_ms=itl if ok else (),
        output_tokens=out if ok else 0)


# A: 4 tokens in 4 chunks; B: 2 tokens; C: one token (no TPOT); D: 6 tokens in 3 chunks (usage says 6);
# E: failed with an HTTP error.
TIMELINE = [
    rec("A", 0.0, 100.0, (20.0, 30.0, 50.0), 4, n_in=10),
    rec("B", 500.0, 300.0, (40.0,), 2, n_in=20),
    rec("C", 1000.0, 50.0, (), 1, n_in=30),
    rec("D", 2000.0, 200.0, (100.0, 100.0), 6, n_in=40),
    rec("E", 3000.0, None, (), 5, n_in=50, status="http_error"),
]


def test_counts_and_throughput() -> None:
    m = calculate_metrics(TIMELINE, duration_s=10.0)
    assert (m.completed, m.failed, m.failures) == (4, 1, {"http_error": 1})
    assert (m.total_input_tokens, m.total_output_tokens) == (100, 13)
    assert m.request_throughput == pytest.approx(0.4)
    assert m.output_throughput == pytest.approx(1.3)
    assert m.total_token_throughput == pytest.approx(11.3)


def test_ttft_tpot_itl_e2e_exactly() -> None:
    m = calculate_metrics(TIMELINE, duration_s=10.0)
    # TTFT over completed requests: 100, 300, 50, 200
    assert m.ttft_ms["mean"] == pytest.approx(162.5)
    assert m.ttft_ms["p50"] == pytest.approx(150.0)
    assert m.ttft_ms["p90"] == pytest.approx(270.0)   # linear: 200 + 0.7 * 100
    assert m.ttft_ms["p95"] == pytest.approx(285.0)
    assert m.ttft_ms["p99"] == pytest.approx(297.0)
    # TPOT = (E2E - TTFT) / (tokens - 1), only where tokens > 1: A 100/3, B 40/1, D 200/5
    assert m.tpot_ms["mean"] == pytest.approx((100 / 3 + 40 + 40) / 3)
    assert m.tpot_ms["p50"] == pytest.approx(40.0)
    # ITL pooled over every chunk gap: 20, 30, 50, 40, 100, 100
    assert m.itl_ms["mean"] == pytest.approx(340 / 6)
    assert m.itl_ms["p50"] == pytest.approx(45.0)
    assert m.itl_ms["p99"] == pytest.approx(100.0)
    # E2E: 200, 340, 50, 400
    assert m.e2e_ms["mean"] == pytest.approx(247.5)
    assert m.e2e_ms["p50"] == pytest.approx(270.0)
    assert m.e2e_ms["p90"] == pytest.approx(382.0)    # 340 + 0.7 * 60


def test_goodput_counts_requests_meeting_every_slo() -> None:
    # ttft <= 200 and tpot <= 35: A (100, 33.3) good; B ttft 300 bad; C (50, one token: TPOT 0) good;
    # D ttft 200 (bound inclusive) but tpot 40 bad; E failed.
    m = calculate_metrics(TIMELINE, duration_s=10.0, slos={"ttft": 200, "tpot": 35})
    assert m.good == 2
    assert m.request_goodput == pytest.approx(0.2)
    assert m.slo_attainment == pytest.approx(0.4)
    m2 = calculate_metrics(TIMELINE, duration_s=10.0, slos={"e2el": 300})
    assert (m2.good, m2.slo_attainment) == (2, pytest.approx(0.4))
    none = calculate_metrics(TIMELINE, duration_s=10.0)
    assert (none.good, none.request_goodput, none.slo_attainment) == (None, None, None)
    assert not meets_slos(TIMELINE[4], {"ttft": 1e9})


def test_to_json_has_the_summary_keys() -> None:
    j = calculate_metrics(TIMELINE, duration_s=10.0).to_json()
    for key in ("ttft_ms", "tpot_ms", "itl_ms", "e2e_ms"):
        assert {"mean", "p50", "p90", "p95", "p99"} <= set(j[key])
    assert {"completed", "failed", "duration_s", "request_throughput", "output_throughput"} <= set(j)


def test_empty_lists_give_none_not_zero() -> None:
    only_one_token = [rec("C", 0.0, 50.0, (), 1)]
    m = calculate_metrics(only_one_token, duration_s=1.0)
    assert m.tpot_ms["mean"] is None and m.itl_ms["p99"] is None
    assert m.ttft_ms["p50"] == 50.0
    assert stats([])["p50"] is None
    with pytest.raises(ValueError):
        calculate_metrics(TIMELINE, duration_s=0.0)
    with pytest.raises(ValueError):
        calculate_metrics(TIMELINE, duration_s=1.0, slos={"latency": 1.0})


def test_parse_slos() -> None:
    assert parse_slos(["ttft:500", "TPOT:50", "e2e:2000"]) == {"ttft": 500.0, "tpot": 50.0, "e2el": 2000.0}
    for bad in ("ttft", "itl:5", "ttft:fast", "ttft:-1"):
        with pytest.raises(ValueError, match="bad SLO"):
            parse_slos([bad])


def test_highest_rate_keeping_the_goodput_target() -> None:
    pts = [(5.0, 1.0), (10.0, 0.95), (20.0, 0.7), (40.0, 0.92)]
    assert max_rate_meeting_target(pts, 0.9) == 10.0
    assert max_rate_meeting_target(list(reversed(pts)), 0.9) == 10.0
    assert max_rate_meeting_target(pts, 0.99) == 5.0
    assert max_rate_meeting_target(pts, 1.01) is None
    assert max_rate_meeting_target([(5.0, None)], 0.5) is None


def test_throughput_timeline_and_cdf() -> None:
    tl = throughput_timeline(TIMELINE, bin_ms=1000.0)
    assert tl["t_s"] == [0.0, 1.0, 2.0, 3.0]
    assert tl["requests_per_s"] == [2.0, 1.0, 1.0, 0.0]       # A ends 200, B 840, C 1050, D 2400
    assert sum(tl["output_tokens_per_s"]) == pytest.approx(13.0)
    assert tl["in_flight"] == [1, 1, 1, 0]  # at 0, 1000 (C just sent), 2000 (D), 3000 ms (E failed at once)
    x, y = cdf([3.0, 1.0, 2.0])
    assert list(x) == [1.0, 2.0, 3.0] and list(y) == pytest.approx([1 / 3, 2 / 3, 1.0])

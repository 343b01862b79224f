"""An engine's ``/metrics`` page cut to the samples a scraper names (Prometheus' ``name[]``), as a load test's
queue-depth poll asks for it: the same values as the whole page, and nothing else."""

from __future__ import annotations

from actors.metrics import EngineMetrics
from cluster.loadtest.scrape import RUNNING, STEP_LAG, WAITING, parse_metrics


def test_named_samples_alone_with_the_values_of_the_whole_page() -> None:
    m = EngineMetrics("lesson", "e0")
    m.running.set(3)
    m.waiting.set(2)
    m.step_lag.observe(0.4, 5)
    m.step_lag.observe(7.0)
    whole = parse_metrics(m.exposition().decode())
    cut = parse_metrics(m.exposition((RUNNING, WAITING)).decode())
    assert set(cut.samples) == {RUNNING, WAITING}
    assert cut.series(RUNNING) == whole.series(RUNNING) and cut.total(RUNNING) == 3.0
    assert cut.series(WAITING) == whole.series(WAITING) and cut.total(WAITING) == 2.0
    assert not cut.buckets and whole.buckets[STEP_LAG]
    # a histogram's samples by their own names (``_bucket``, ``_count``), as prometheus_client's handlers take them
    lag = parse_metrics(m.exposition((f"{STEP_LAG}_bucket", f"{STEP_LAG}_count")).decode())
    assert lag.buckets[STEP_LAG] == whole.buckets[STEP_LAG]
    assert not lag.has(RUNNING)


def test_no_names_is_the_whole_page() -> None:
    m = EngineMetrics("lesson", "e0")
    assert m.exposition(()) == m.exposition()

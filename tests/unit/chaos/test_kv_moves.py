"""The chaos run's live-migration figures from a router's metrics page and the engines' stats (no cluster)."""

from __future__ import annotations

import pytest

from cluster.chaos.kv_moves import event_moves, summarize
from cluster.chaos.schedule import KillNode, SpotPreempt
from cluster.loadtest.scrape import parse_metrics

PAGE = """# TYPE kvmesh_router_kv_migrations counter
kvmesh_router_kv_migrations_total{source="f",outcome="ok"} 3.0
kvmesh_router_kv_migrations_total{source="f",outcome="refused"} 1.0
# TYPE kvmesh_router_kv_resumes counter
kvmesh_router_kv_resumes_total{source="f",kind="migrated",outcome="ok"} 3.0
kvmesh_router_kv_resumes_total{source="e-1",kind="checkpoint",outcome="ok"} 2.0
# TYPE kvmesh_router_kv_migration_seconds histogram
kvmesh_router_kv_migration_seconds_bucket{le="0.01"} 3.0
kvmesh_router_kv_migration_seconds_bucket{le="+Inf"} 3.0
kvmesh_router_kv_migration_seconds_count 3.0
kvmesh_router_kv_migration_seconds_sum 0.006
# TYPE kvmesh_router_migrations counter
kvmesh_router_migrations_total{outcome="ok"} 4.0
kvmesh_router_migrations_total{outcome="failed"} 1.0
# TYPE kvmesh_router_retries counter
kvmesh_router_retries_total{reason="upstream_failure"} 2.0
"""


def test_counts_by_source_and_times_from_the_router_and_the_surviving_peers() -> None:
    engines = {"e-0": {"migrated_in": 3, "checkpoint_ms_per_32_tokens": [0.5, 1.5], "prompt_checkpoint_ms": [4.0],
                       "recomputed_tokens": [20, 30]}}
    fig = summarize(parse_metrics(PAGE), engines)
    assert fig["migrated"] == 3 and fig["resumed_from_checkpoint"] == 2
    assert fig["by_source"]["f"] == {"migrations_ok": 3, "migrations_refused": 1, "resumed_migrated_ok": 3}
    assert fig["migration_ms_mean"] == pytest.approx(2.0)
    assert fig["checkpoint_ms_per_32_tokens"]["mean"] == pytest.approx(1.0)
    assert fig["recomputed_tokens_per_resume"]["max"] == 30
    assert fig["engines"] == {"e-0": {"migrated_in": 3}}
    assert fig["stream_migrations"] == {"ok": 4, "failed": 1} and fig["retries"] == {"upstream_failure": 2}
    spot = SpotPreempt(at_s=1.0, engine="f")
    assert event_moves(spot, fig, {}) == {"migrated": 3, "resumed_from_checkpoint": 0}
    node = KillNode(at_s=1.0, node="n0")
    assert event_moves(node, fig, {"n0": ["e-0", "e-1"]}) == {"migrated": 0, "resumed_from_checkpoint": 2}


def test_no_router_page_and_no_peers_leave_the_figures_empty() -> None:
    fig = summarize(None, {}, ["router metrics unreadable"])
    assert fig["migrated"] == 0 and fig["migration_ms_mean"] is None
    assert fig["stream_migrations"] == {} and fig["retries"] == {}
    assert fig["checkpoint_ms_per_32_tokens"] is None and fig["notes"] == ["router metrics unreadable"]

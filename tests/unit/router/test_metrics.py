"""The router's loop-local counters and histogram expose what prometheus_client's own types would."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st
from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from cluster.router.metrics import LoopCounter, LoopHistogram, RouterMetrics

BUCKETS = (1e-5, 3e-5, 1e-4, 3e-4, 1e-3, 3e-3, 1e-2, 3e-2)


def samples(registry: CollectorRegistry) -> set[tuple[str, tuple[tuple[str, str], ...], float]]:
    text = generate_latest(registry).decode()
    return {(s.name, tuple(sorted(s.labels.items())), round(s.value, 9))
            for fam in text_string_to_metric_families(text) for s in fam.samples if not s.name.endswith("_created")}


@settings(max_examples=50, deadline=None)
@given(events=st.lists(st.tuples(st.sampled_from(["200", "429", "503"]), st.sampled_from(["a", "b"]),
                                 st.floats(0, 0.1, allow_nan=False)), max_size=40))
def test_same_exposition_as_the_library_types(events: list[tuple[str, str, float]]) -> None:
    ours, theirs = CollectorRegistry(), CollectorRegistry()
    c1 = LoopCounter("kvmesh_x_responses", "Responses.", ["status", "worker"], registry=ours)
    c2 = Counter("kvmesh_x_responses", "Responses.", ["status", "worker"], registry=theirs)
    t1 = LoopCounter("kvmesh_x_tokens", "Tokens.", registry=ours)
    t2 = Counter("kvmesh_x_tokens", "Tokens.", registry=theirs)
    h1 = LoopHistogram("kvmesh_x_seconds", "Latency.", BUCKETS, registry=ours)
    h2 = Histogram("kvmesh_x_seconds", "Latency.", buckets=BUCKETS, registry=theirs)
    for status, worker, v in events:
        c1.inc_labels(status, worker)
        c2.labels(status, worker).inc()
        t1.inc(3)
        t2.inc(3)
        h1.observe(v)
        h2.observe(v)
    c1.inc_labels("200", "a", amount=0)  # a series made but never counted still shows, as the library's does
    c2.labels("200", "a").inc(0)
    assert samples(ours) == samples(theirs)


def test_wrong_label_count_is_refused() -> None:
    c = LoopCounter("kvmesh_y", "Y.", ["a"], registry=CollectorRegistry())
    try:
        c.inc_labels("1", "2")
    except ValueError as e:
        assert "takes labels" in str(e)
    else:
        raise AssertionError("accepted two labels for one")


def test_router_metrics_register_once_per_router() -> None:
    a, b = RouterMetrics(), RouterMetrics()  # separate registries: two routers in one process do not clash
    a.responses.inc_labels("200")
    assert a.responses.value("200") == 1.0 and b.responses.value("200") == 0.0

"""The engine's counted histogram exposes what prometheus_client's own histogram does for the same observations."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st
from prometheus_client import CollectorRegistry, Histogram, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from actors.metrics import ITL_BUCKETS, CountedHistogram

NAME = "vllm:inter_token_latency_seconds"


def samples(registry: CollectorRegistry) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    out = {}
    for fam in text_string_to_metric_families(generate_latest(registry).decode()):
        for s in fam.samples:
            if not s.name.endswith("_created"):
                out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


@settings(deadline=None)  # a loaded CI host: no per-example time limit
@given(obs=st.lists(st.tuples(st.sampled_from([*ITL_BUCKETS, 0.0, 0.0063, 0.2001, 1e3]), st.integers(1, 5)),
                    max_size=20))
def test_counted_observations_expose_as_one_by_one_observations(obs: list[tuple[float, int]]) -> None:
    ours, ref = CollectorRegistry(), CollectorRegistry()
    counted = CountedHistogram(NAME, "itl", ["model_name", "engine"], ["m", "e0"], ITL_BUCKETS, ours)
    plain = Histogram(NAME, "itl", ["model_name", "engine"], buckets=ITL_BUCKETS, registry=ref).labels("m", "e0")
    for value, n in obs:
        counted.observe(value, n)
        for _ in range(n):
            plain.observe(value)
    a, b = samples(ours), samples(ref)
    assert a.keys() == b.keys()
    for k, v in b.items():  # the sum adds value * n at once: equal up to rounding
        assert abs(a[k] - v) <= 1e-9 * max(1.0, abs(v)), k

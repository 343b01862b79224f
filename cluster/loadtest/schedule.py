"""Shaping a trace before replay: a time window and a request cap, bucket jitter, re-timing to a rate.

All functions are pure (a new tuple of specs; randomness from the generator passed in):

- ``window``: requests arriving in ``[start_s, start_s + duration_s)`` of trace time, at most
  ``max_requests`` of them, with arrivals re-based so the window starts at 0.
- ``jitter_buckets``: spread requests that share a timestamp uniformly over their bucket, i.e. up to the
  next distinct timestamp (the last bucket uses the median bucket width). The Mooncake conversation trace
  is quantized to ~3 s buckets; firing each bucket as one burst overstates burstiness.
- ``RETIMERS`` (keyed by name, for ``--rate`` and sweeps): ``scale`` keeps the trace's shape and scales
  its timestamps so the mean rate becomes ``rate``; ``poisson`` replaces the timestamps with gamma /
  Poisson arrivals at ``rate`` (shape ``burstiness``).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence

import numpy as np

from cluster.loadtest.spec import RequestSpec
from cluster.loadtest.synthetic import gamma_arrivals_ms


def window(specs: Sequence[RequestSpec], start_s: float = 0.0, duration_s: float | None = None,
           max_requests: int | None = None) -> tuple[RequestSpec, ...]:
    """The requests of a window of the trace, re-based to start at 0 ms (``start_s`` is measured from the
    trace's first arrival)."""
    if not specs:
        return ()
    t0 = specs[0].arrival_ms + start_s * 1000.0
    t1 = None if duration_s is None else t0 + duration_s * 1000.0
    picked = [s for s in specs if s.arrival_ms >= t0 and (t1 is None or s.arrival_ms < t1)]
    if max_requests is not None:
        picked = picked[:max_requests]
    return tuple(dataclasses.replace(s, arrival_ms=s.arrival_ms - t0) for s in picked)


def jitter_buckets(specs: Sequence[RequestSpec], rng: np.random.Generator) -> tuple[RequestSpec, ...]:
    """Each request moved uniformly inside its timestamp bucket; the result is sorted by arrival."""
    if not specs:
        return ()
    stamps = sorted({s.arrival_ms for s in specs})
    widths = np.diff(stamps)
    fallback = float(np.median(widths)) if widths.size else 0.0
    width_of = {t: (float(widths[i]) if i < widths.size else fallback) for i, t in enumerate(stamps)}
    moved = [dataclasses.replace(s, arrival_ms=s.arrival_ms + float(rng.uniform(0.0, width_of[s.arrival_ms])))
             for s in specs]
    return tuple(sorted(moved, key=lambda s: s.arrival_ms))


def mean_rate(specs: Sequence[RequestSpec]) -> float | None:
    """Requests per second of trace time ((n - 1) / span); None for fewer than two or a zero span."""
    if len(specs) < 2:
        return None
    span = specs[-1].arrival_ms - specs[0].arrival_ms
    return (len(specs) - 1) / (span / 1000.0) if span > 0 else None


Retimer = Callable[[Sequence[RequestSpec], float, float, np.random.Generator], tuple[RequestSpec, ...]]


def scale_to_rate(specs: Sequence[RequestSpec], rate: float, burstiness: float,
                  rng: np.random.Generator) -> tuple[RequestSpec, ...]:
    """Timestamps scaled so the mean rate is ``rate``; raises ValueError when the trace has no span."""
    current = mean_rate(specs)
    if current is None:
        raise ValueError("the trace has no time span to scale; use --retime poisson")
    factor = current / rate
    t0 = specs[0].arrival_ms
    return tuple(dataclasses.replace(s, arrival_ms=(s.arrival_ms - t0) * factor) for s in specs)


def poisson_retime(specs: Sequence[RequestSpec], rate: float, burstiness: float,
                   rng: np.random.Generator) -> tuple[RequestSpec, ...]:
    """Same requests in the same order, new gamma/Poisson arrivals at ``rate`` starting at 0."""
    times = gamma_arrivals_ms(len(specs), rate, burstiness, rng)
    if len(times):
        times = times - times[0]
    return tuple(dataclasses.replace(s, arrival_ms=float(t)) for s, t in zip(specs, times, strict=True))


RETIMERS: dict[str, Retimer] = {"scale": scale_to_rate, "poisson": poisson_retime}

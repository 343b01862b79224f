"""Serving metrics exactly as vLLM's ``benchmark_serving`` / ``vllm bench serve`` define them.

Pure functions over ``RequestRecord``s (times in emulated ms) and the run's duration:

- completed / failed: requests with / without ``status == "ok"``.
- TTFT: send to the first content chunk, over completed requests.
- TPOT: ``(E2E - TTFT) / (output_tokens - 1)``, only over completed requests with more than one output
  token (for goodput a request with one token counts as TPOT 0, as vLLM does).
- ITL: every gap between successive content chunks, pooled over all completed requests.
- E2E (vLLM's E2EL): send to the last content chunk, over completed requests.
- request_throughput = completed / duration; output_throughput = sum of output tokens of completed
  requests / duration; total_token_throughput adds their input tokens.
- goodput = requests per second that meet every given SLO (``ttft``, ``tpot``, ``e2el`` in ms; a request
  meets an SLO when its value is <= the bound), i.e. good completed requests / duration.
- SLO attainment (not in vLLM): good requests / all requests sent, a failed request missing every SLO.
- Statistics: mean, std, p50 (= median), p90, p95, p99 with numpy's linear-interpolated percentiles.
  Where vLLM prints 0 for an empty list (e.g. TPOT when every answer is one token) these return None.

In a sweep, ``max_rate_meeting_target`` is the highest swept rate such that it and every lower swept
rate keep SLO attainment at or above the target.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from cluster.loadtest.record import RequestRecord

PERCENTILES: tuple[int, ...] = (50, 90, 95, 99)
SLO_METRICS: tuple[str, ...] = ("ttft", "tpot", "e2el")


def parse_slos(items: Iterable[str]) -> dict[str, float]:
    """``["ttft:500", "tpot:50"]`` -> ``{"ttft": 500.0, "tpot": 50.0}`` (ms). Raises ValueError naming
    the bad item; ``e2e`` is accepted for ``e2el``."""
    out: dict[str, float] = {}
    for item in items:
        name, sep, value = item.partition(":")
        key = "e2el" if name.strip().lower() == "e2e" else name.strip().lower()
        if not sep or key not in SLO_METRICS:
            raise ValueError(f"bad SLO {item!r}: expected NAME:MS with NAME one of {', '.join(SLO_METRICS)}")
        try:
            bound = float(value)
        except ValueError:
            raise ValueError(f"bad SLO {item!r}: {value!r} is not a number of milliseconds") from None
        if bound <= 0:
            raise ValueError(f"bad SLO {item!r}: the bound must be positive")
        out[key] = bound
    return out


def stats(values: Sequence[float], percentiles: Sequence[int] = PERCENTILES) -> dict[str, float | None]:
    """mean, std and the percentiles (keys ``p50`` ...) of ``values``; every value None when empty."""
    keys = ["mean", "std", *[f"p{p}" for p in percentiles]]
    if len(values) == 0:
        return dict.fromkeys(keys)
    a = np.asarray(values, dtype=float)
    out: dict[str, float | None] = {"mean": float(a.mean()), "std": float(a.std())}
    for p in percentiles:
        out[f"p{p}"] = float(np.percentile(a, p))
    return out


def meets_slos(r: RequestRecord, slos: Mapping[str, float]) -> bool:
    """True when a completed request meets every SLO given (TPOT 0 for a one-token answer, as vLLM)."""
    if not r.success or r.ttft_ms is None or r.e2e_ms is None:
        return False
    values = {"ttft": r.ttft_ms, "tpot": r.tpot_ms or 0.0, "e2el": r.e2e_ms}
    return all(values[k] <= bound for k, bound in slos.items())


@dataclass(frozen=True)
class Metrics:
    """The summary of one run's requests (times in emulated ms, rates per emulated second)."""

    completed: int
    failed: int
    duration_s: float
    total_input_tokens: int
    total_output_tokens: int
    request_throughput: float
    output_throughput: float
    total_token_throughput: float
    ttft_ms: dict[str, float | None]
    tpot_ms: dict[str, float | None]
    itl_ms: dict[str, float | None]
    e2e_ms: dict[str, float | None]
    slos: dict[str, float]
    good: int | None
    request_goodput: float | None
    slo_attainment: float | None
    failures: dict[str, int]

    def to_json(self) -> dict[str, Any]:
        return {
            "completed": self.completed, "failed": self.failed, "duration_s": self.duration_s,
            "total_input_tokens": self.total_input_tokens, "total_output_tokens": self.total_output_tokens,
            "request_throughput": self.request_throughput, "output_throughput": self.output_throughput,
            "total_token_throughput": self.total_token_throughput,
            "ttft_ms": self.ttft_ms, "tpot_ms": self.tpot_ms, "itl_ms": self.itl_ms, "e2e_ms": self.e2e_ms,
            "slo_ms": self.slos, "good_requests": self.good, "request_goodput": self.request_goodput,
            "slo_attainment": self.slo_attainment, "failures": self.failures,
        }


def calculate_metrics(records: Sequence[RequestRecord], duration_s: float,
                      slos: Mapping[str, float] | None = None,
                      percentiles: Sequence[int] = PERCENTILES) -> Metrics:
    """vLLM's ``calculate_metrics`` over emulated-time records; ``duration_s`` is the run's length
    (emulated seconds from the start of the schedule until the last request finished). Raises
    ValueError for a non-positive duration or an unknown SLO name."""
    if duration_s <= 0:
        raise ValueError(f"duration must be positive (got {duration_s})")
    slo = dict(slos or {})
    unknown = set(slo) - set(SLO_METRICS)
    if unknown:
        raise ValueError(f"unknown SLO metric(s) {sorted(unknown)} (known: {', '.join(SLO_METRICS)})")
    ok = [r for r in records if r.success]
    ttfts = [r.ttft_ms for r in ok if r.ttft_ms is not None]
    e2es = [r.e2e_ms for r in ok if r.e2e_ms is not None]
    tpots = [t for t in (r.tpot_ms for r in ok) if t is not None]
    itls = [gap for r in ok for gap in r.itl_ms]
    total_in = sum(r.input_len for r in ok)
    total_out = sum(r.output_tokens for r in ok)
    failures: dict[str, int] = {}
    for r in records:
        if not r.success:
            failures[r.status] = failures.get(r.status, 0) + 1
    good: int | None = None
    goodput = attainment = None
    if slo:
        good = sum(1 for r in ok if meets_slos(r, slo))
        goodput = good / duration_s
        attainment = good / len(records) if records else None
    return Metrics(
        completed=len(ok), failed=len(records) - len(ok), duration_s=duration_s,
        total_input_tokens=total_in, total_output_tokens=total_out,
        request_throughput=len(ok) / duration_s, output_throughput=total_out / duration_s,
        total_token_throughput=(total_in + total_out) / duration_s,
        ttft_ms=stats(ttfts, percentiles), tpot_ms=stats(tpots, percentiles), itl_ms=stats(itls, percentiles),
        e2e_ms=stats(e2es, percentiles), slos=slo, good=good, request_goodput=goodput,
        slo_attainment=attainment, failures=failures,
    )


def max_rate_meeting_target(points: Sequence[tuple[float, float | None]], target: float) -> float | None:
    """The highest rate r among ``(rate, attainment)`` points such that every point with rate <= r has
    attainment >= ``target``; None when even the lowest rate misses it (or has no attainment)."""
    best: float | None = None
    for rate, attained in sorted(points, key=lambda p: p[0]):
        if attained is None or attained < target:
            break
        best = rate
    return best


# -- timelines for plots -----------------------------------------------------------------------------------

def chunk_times_ms(r: RequestRecord) -> list[float]:
    """Times (emulated ms from the run start) of a completed request's content chunks."""
    if not r.success or r.ttft_ms is None:
        return []
    t = r.sent_ms + r.ttft_ms
    out = [t]
    for gap in r.itl_ms:
        t += gap
        out.append(t)
    return out


def throughput_timeline(records: Sequence[RequestRecord], bin_ms: float = 1000.0) -> dict[str, list[float]]:
    """Per ``bin_ms`` bin from the run start: completed requests per second, output tokens per second
    (a request's tokens spread evenly over its content chunks) and requests in flight at the bin's start."""
    ends = [r.end_ms for r in records if r.success and r.end_ms is not None]
    horizon = max([*ends, *(r.sent_ms for r in records)], default=0.0)
    n = int(horizon // bin_ms) + 1
    done = np.zeros(n)
    toks = np.zeros(n)
    for r in records:
        if r.success and r.end_ms is not None:
            done[int(r.end_ms // bin_ms)] += 1
            times = chunk_times_ms(r)
            per = r.output_tokens / len(times) if times else 0.0
            for t in times:
                toks[min(n - 1, int(t // bin_ms))] += per
    edges = np.arange(n) * bin_ms
    sent = np.sort(np.array([r.sent_ms for r in records]))
    finished = np.sort(np.array([r.end_ms if r.end_ms is not None else r.sent_ms for r in records]))
    in_flight = np.searchsorted(sent, edges, side="right") - np.searchsorted(finished, edges, side="right")
    scale = 1000.0 / bin_ms
    return {"t_s": list((np.arange(n) * bin_ms / 1000.0).tolist()), "requests_per_s": list((done * scale).tolist()),
            "output_tokens_per_s": list((toks * scale).tolist()), "in_flight": [int(x) for x in in_flight]}


def cdf(values: Iterable[float]) -> tuple[np.ndarray, np.ndarray]:
    """Sorted values and their empirical cumulative fractions (i / n)."""
    a = np.sort(np.asarray(list(values), dtype=float))
    return a, np.arange(1, a.size + 1) / max(1, a.size)

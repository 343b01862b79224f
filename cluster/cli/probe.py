"""``probe``: the smallest time scale a cluster spec and a trace can hold on this machine.

A run is trusted when the engines kept up: step-lag p99 (wall ms, as the load test reports it) at most
``--lag-bound``. Smaller time scales run faster than real time and load the host more, so lag grows as the
scale shrinks. The probe launches the spec at one scale, replays a short slice of the trace (``--duration``
trace seconds from ``--start``), reads the lag p99 from the load test's summary, shuts the cluster down,
and searches (``search_scale``):

1. from the start scale (``--from``, default the spec's), double until a trial passes (at most ``--max``);
2. halve from the passing scale until one fails (at least ``--min``);
3. bisect geometrically between the failing and passing scales until they are within ``--tolerance``.

It prints each trial (scale, lag p99, requests, failures) and the answer: the smallest passing scale
found. Each trial costs a launch (seconds) plus the slice's wall time (duration x scale). The answer holds
for that slice on this host at that moment: a busier host or a heavier part of the trace may need more.
Failure behaviour: a trial whose cluster does not start, or whose replay fails every request, is an error
(exit 2), not a pass; a trial that reports no lag (a target without kvmesh's lag histogram) is too.
"""

from __future__ import annotations

import argparse
import math
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from cluster.cli import Command, register
from cluster.cli.output import console, print_json


@dataclass(frozen=True)
class Trial:
    time_scale: float
    lag_p99_ms: float
    passed: bool
    requests: int = 0
    failed: int = 0


class ProbeError(RuntimeError):
    """A trial could not be measured (the cluster did not start, or nothing was served)."""


@dataclass(frozen=True)
class SearchBounds:
    start: float = 1.0
    smallest: float = 0.02
    largest: float = 16.0
    tolerance: float = 1.25
    """Stop when the failing and passing scales are within this factor of each other."""

    def __post_init__(self) -> None:
        if not 0 < self.smallest <= self.start <= self.largest:
            raise ValueError("time scales must satisfy 0 < smallest <= start <= largest")
        if self.tolerance <= 1.0:
            raise ValueError("tolerance is a factor above 1 (e.g. 1.25)")


def search_scale(measure: Callable[[float], Trial], bounds: SearchBounds) -> tuple[float | None, list[Trial]]:
    """The smallest passing time scale found (None: not even ``largest`` passed) and every trial, in order.

    Assumes lag falls as the scale grows (monotone); a noisy host can break that, so every trial is kept.
    """
    trials: list[Trial] = []

    def run(scale: float) -> bool:
        t = measure(scale)
        trials.append(t)
        return t.passed

    passing: float | None = None
    failing: float | None = None
    scale = bounds.start
    while True:
        if run(scale):
            passing = scale
            break
        failing = scale
        if scale >= bounds.largest:
            return None, trials
        scale = min(bounds.largest, scale * 2)
    if failing is None:
        scale = passing
        while scale > bounds.smallest:
            scale = max(bounds.smallest, scale / 2)
            if run(scale):
                passing = scale
            else:
                failing = scale
                break
    if failing is None:
        return passing, trials
    while passing / failing > bounds.tolerance:
        mid = math.sqrt(passing * failing)
        if run(mid):
            passing = mid
        else:
            failing = mid
    return passing, trials


def configure(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", type=Path, required=True, metavar="FILE", help="cluster spec to probe")
    p.add_argument("--trace", type=Path, required=True, help="trace file (Mooncake JSONL, Azure CSV, synthetic YAML)")
    p.add_argument("--format", default="auto", help="trace format (default: detect)")
    p.add_argument("--start", type=float, default=0.0, help="slice start, trace seconds from its first arrival")
    p.add_argument("--duration", type=float, default=10.0, help="slice length in trace seconds (default 10)")
    p.add_argument("--max-requests", type=int, default=None, help="at most this many requests per trial")
    p.add_argument("--lag-bound", type=float, default=5.0, help="step-lag p99 (wall ms) a trusted run stays under")
    p.add_argument("--from", dest="from_scale", type=float, default=None,
                   help="first time scale tried (default: the spec's)")
    p.add_argument("--min", dest="min_scale", type=float, default=0.02, help="smallest scale tried (default 0.02)")
    p.add_argument("--max", dest="max_scale", type=float, default=16.0, help="largest scale tried (default 16)")
    p.add_argument("--tolerance", type=float, default=1.25, help="stop within this factor (default 1.25)")
    p.add_argument("--seed", type=int, default=0, help="seed of prompt synthesis")
    p.add_argument("--json", action="store_true", help="print the result as one JSON object (last line)")


def measure_on_cluster(spec: Any, trace: Any, args: argparse.Namespace) -> Callable[[float], Trial]:
    """One trial: launch ``spec`` at the scale, replay the slice, read the lag p99, shut down."""
    from cluster.launch import launch
    from cluster.loadtest import ClientConfig, LoadTestConfig, WorkloadSlice, run_loadtest, run_sync

    out = console()

    def measure(scale: float) -> Trial:
        try:
            handle = launch(spec.model_copy(update={"time_scale": scale}))
        except Exception as e:  # Ray and start-up errors come in many types; all mean the same here
            raise ProbeError(f"cluster {spec.name} did not start at time scale {scale:g}: "
                             f"{type(e).__name__}: {e}") from None
        try:
            config = LoadTestConfig(name=f"probe-{scale:g}", seed=args.seed, progress=False, plots=False,
                                    step_lag_threshold_ms=args.lag_bound,
                                    slice=WorkloadSlice(start_s=args.start, duration_s=args.duration,
                                                        max_requests=args.max_requests),
                                    client=ClientConfig(time_scale=scale))
            summary = run_sync(run_loadtest(handle.router_url, trace, config, out_root=None)).summary
        finally:
            handle.shutdown()
        lag = (summary.get("step_lag_ms") or {}).get("p99")
        completed, failed = int(summary.get("completed") or 0), int(summary.get("failed") or 0)
        if lag is None or completed == 0:
            raise ProbeError(f"time scale {scale:g}: no step lag measured or nothing completed "
                             f"({completed} completed, {failed} failed)")
        t = Trial(scale, float(lag), float(lag) <= args.lag_bound and failed == 0, completed + failed, failed)
        out.print(f"  time scale {scale:<8.4g} step-lag p99 {t.lag_p99_ms:8.2f} ms  "
                  f"{'ok' if t.passed else 'too fast'}  ({t.requests} requests, {t.failed} failed)")
        return t

    return measure


def run(args: argparse.Namespace) -> int:
    from cluster.loadtest import ReadOptions, TraceError, read_trace
    from config import ConfigError, load_cluster

    try:
        spec = load_cluster(args.config)
        trace = read_trace(args.trace, args.format, ReadOptions(seed=args.seed))
        bounds = SearchBounds(start=args.from_scale or spec.time_scale, smallest=args.min_scale,
                              largest=args.max_scale, tolerance=args.tolerance)
    except (ConfigError, TraceError, ValueError) as e:
        raise SystemExit(f"error: {e}") from None
    out = console()
    out.print(f"probing {spec.name} ({len(spec.engines())} engines) with {args.trace.name} "
              f"[{args.start:g}, {args.start + args.duration:g}) s, step-lag p99 bound {args.lag_bound:g} ms")
    try:
        best, trials = search_scale(measure_on_cluster(spec, trace, args), bounds)
    except ProbeError as e:
        out.print(f"error: {e}")
        return 2
    if best is None:
        out.print(f"no time scale up to {bounds.largest:g} kept step-lag p99 under {args.lag_bound:g} ms")
    else:
        out.print(f"smallest time scale that held: {best:.3g} ({1 / best:.2f}x real time)")
    if args.json:
        print_json({"config": str(args.config), "trace": str(args.trace), "lag_bound_ms": args.lag_bound,
                    "smallest_time_scale": best, "trials": [asdict(t) for t in trials]})
    return 0 if best is not None else 1


register(Command("probe", "the smallest time scale a cluster spec and trace can hold on this machine "
                          "(binary search on short slices, step-lag p99 bound)", configure, run))

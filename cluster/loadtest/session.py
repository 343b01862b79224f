"""A load test from trace to report: slice, re-time, replay, summarize, write the run folder.

``run_loadtest`` is the whole job against a running target URL (the ``loadtest`` command and ``make demo``
call it); ``replay_slice`` is the short form for a demo: replay a slice of a trace (or the bundled
synthetic workload) and print the summary.

Order of shaping: the trace's window (``start_s``, ``duration_s``, ``max_requests``), then bucket jitter,
then — for each rate of a sweep — re-timing to that rate; ``speed`` divides every arrival time at replay.
Each sweep point synthesizes prompts with its own seed (``seed + index``) so a later rate does not find
its prompts already cached by an earlier one; every point thus starts as cold as the first.

The summary's trust flags: ``step_lag_ms.p99`` above ``step_lag_threshold_ms`` (the emulator could not
keep its own clock), the send lag p99 above ``send_lag_threshold_ms`` (the load generator could not keep
the schedule; the note adds it when the host refused the generator the engines' priority, ``priority.py``),
or more than ``transfer_bottleneck_threshold`` of KV transfers slower over the real transport than over the
emulated link (transfer times overstate the fabric) set ``trustworthy`` false
and add a note with the figure; the numbers are still reported. Step lag is also given per engine and per
process (the workers' own pages; a process is what the router's ``GET /workers`` names it): a lagging run's
note names the engines whose own p99 passed the threshold and suggests the time scale that would likely
have kept up (``scrape.suggest_time_scale``: each step's wall time stretched by the p99 lag).
"""

from __future__ import annotations

import asyncio
import dataclasses
import sys
import uuid
from collections.abc import Callable, Coroutine, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import numpy as np

from cluster.loadtest.client import ClientConfig
from cluster.loadtest.formats import ReadOptions, read_trace
from cluster.loadtest.metrics import calculate_metrics, max_rate_meeting_target, stats
from cluster.loadtest.record import RequestRecord
from cluster.loadtest.replay import ReplayConfig, ReplayResult, replay
from cluster.loadtest.report import new_run_folder, plot_slo_vs_rate, print_summary, print_sweep, write_json, write_run
from cluster.loadtest.schedule import RETIMERS, jitter_buckets, mean_rate, window
from cluster.loadtest.scrape import (
    lag_by_group,
    mean_step_ms,
    prefix_hit_ratio,
    step_lag,
    suggest_time_scale,
    transfer_bottleneck,
)
from cluster.loadtest.spec import RequestSpec, TraceData
from cluster.loadtest.synthesis import PromptSynthesizer, ideal_block_hit_ratio_of_ids
from cluster.loadtest.synthetic import DEMO_WORKLOAD

T = TypeVar("T")
REPO_ROOT = Path(__file__).resolve().parents[2]
SHARED_TRACES = REPO_ROOT.parent / "shared" / "traces"
DEMO_TRACE = SHARED_TRACES / "llmservingsim_vllm_runs" / "derived" / "sharegpt-llama-3.1-8b-300-sps10.blk16.jsonl"


@dataclass(frozen=True)
class WorkloadSlice:
    """Which part of the trace to replay (trace seconds from its first arrival)."""

    start_s: float = 0.0
    duration_s: float | None = None
    max_requests: int | None = None
    jitter_buckets: bool = False


@dataclass(frozen=True)
class LoadTestConfig:
    """Everything a load test needs besides the target URL and the trace."""

    name: str = "loadtest"
    slice: WorkloadSlice = field(default_factory=WorkloadSlice)
    replay: ReplayConfig = field(default_factory=ReplayConfig)
    client: ClientConfig = field(default_factory=ClientConfig)
    rates: tuple[float, ...] = ()
    """Re-time the trace to each rate (req/s) in turn; empty = the trace's own timestamps."""
    retime: str = "scale"
    burstiness: float = 1.0
    slos: Mapping[str, float] = field(default_factory=dict)
    goodput_target: float | None = None
    seed: int = 0
    step_lag_threshold_ms: float = 10.0
    send_lag_threshold_ms: float = 10.0
    transfer_bottleneck_threshold: float = 0.01
    """Share of KV transfers the real transport may slow (against the emulated link) before a run is flagged."""
    progress: bool = True
    plots: bool = True

    def __post_init__(self) -> None:
        if self.retime not in RETIMERS:
            raise ValueError(f"unknown re-timing {self.retime!r} (known: {', '.join(sorted(RETIMERS))})")
        if any(r <= 0 for r in self.rates):
            raise ValueError("every rate must be positive")
        if self.goodput_target is not None and not 0 < self.goodput_target <= 1:
            raise ValueError("goodput target is a fraction of requests in (0, 1]")


@dataclass
class RunOutcome:
    label: str
    rate: float | None
    specs: tuple[RequestSpec, ...]
    result: ReplayResult
    summary: dict[str, Any]


@dataclass
class LoadTestResult:
    """The runs (one, or one per swept rate), the summary printed / written, and the run folder."""

    runs: list[RunOutcome]
    summary: dict[str, Any]
    folder: Path | None


def build_summary(name: str, base_url: str, trace: TraceData, specs: Sequence[RequestSpec],
                  result: ReplayResult, config: LoadTestConfig, rate: float | None) -> dict[str, Any]:
    """The summary object of one run: vLLM's metrics plus the target's figures, trust flags and notes."""
    m = calculate_metrics(result.records, result.duration_s, config.slos)
    notes: list[str] = list(trace.notes)
    hit = prefix_hit_ratio(result.before, result.after)
    if hit is None:
        notes.append("prefix_hit_ratio: the target exports no vllm:prefix_cache_queries/hits counters "
                     "(or nothing was queried)")
    lag = step_lag(result.before, result.after)
    if lag is None:
        notes.append("step_lag_ms: the target exports no kvmesh:step_lag_ms histogram (not a kvmesh server?)")
    send_lag = stats([r.send_lag_wall_ms for r in result.records], (50, 99))
    send_lag["max"] = max((r.send_lag_wall_ms for r in result.records), default=None)
    trustworthy = True
    by_engine = lag_by_group(result.before_workers, result.after_workers)
    by_process = lag_by_group(result.before_workers, result.after_workers, result.processes)
    behind = sorted((n for n, v in by_engine.items() if float(v.get("p99") or 0.0) > config.step_lag_threshold_ms),
                    key=lambda n: -float(by_engine[n].get("p99") or 0.0))
    suggested: float | None = None
    if lag is not None and lag.get("p99") is not None and float(lag["p99"] or 0.0) > config.step_lag_threshold_ms:
        trustworthy = False
        over = lag.get("steps_over_top_bucket") or 0.0
        bound = f" ({over:.0f} steps beyond the top bucket: a lower bound)" if over else ""
        suggested = suggest_time_scale(config.client.time_scale, float(lag["p99"] or 0.0),
                                       mean_step_ms(result.before, result.after))
        named = ""
        if behind:
            shown = ", ".join(f"{n} ({float(by_engine[n].get('p99') or 0.0):.1f} ms)" for n in behind[:8])
            named = f"; engines that fell behind: {shown}" + (f" and {len(behind) - 8} more" if len(behind) > 8 else "")
        hint = (f"; time_scale {suggested:.2g} (now {config.client.time_scale:g}) would likely have kept up"
                if suggested is not None else "")
        notes.append(f"the emulator lagged: step lag p99 {lag['p99']:.2f} ms{bound} > {config.step_lag_threshold_ms} "
                     f"ms; latencies are inflated by an overloaded host{named}{hint}")
    if send_lag.get("p99") is not None and float(send_lag["p99"] or 0.0) > config.send_lag_threshold_ms:
        trustworthy = False
        why = f"; {result.priority.note}" if result.priority is not None and result.priority.note else ""
        notes.append(f"the load generator fell behind its schedule: send lag p99 {send_lag['p99']:.2f} wall ms "
                     f"> {config.send_lag_threshold_ms} ms{why}")
    slow = transfer_bottleneck(result.before, result.after)
    if slow is not None and slow["share"] > config.transfer_bottleneck_threshold:
        trustworthy = False
        notes.append(f"the real transport was the bottleneck: {slow['real_bottleneck']:.0f} of {slow['transfers']:.0f} "
                     f"KV transfers ({100 * slow['share']:.1f}% > {100 * config.transfer_bottleneck_threshold:.1f}%) "
                     f"took longer over the real transport than over the emulated link; their transfer times "
                     f"overstate the fabric")
    prompt_tokens = sum(r.prompt_tokens or 0 for r in result.records if r.cached_tokens is not None)
    cached_tokens = sum(r.cached_tokens or 0 for r in result.records if r.cached_tokens is not None)
    if result.scrape_errors:
        notes.append(f"{result.scrape_errors} /metrics scrape(s) failed")
    asked, opened = result.warm_connections
    if opened < asked:
        notes.append(f"only {opened} of {asked} keep-alive connections opened before the run (GET /v1/models "
                     f"failed); the rest of a burst's sends connect first")
    return {
        "name": name, "target": base_url, "model": result.model, "trace": trace.source, "format": trace.format,
        "block_size": trace.block_size, "malformed_lines": trace.malformed_count,
        "mode": config.replay.mode, "speed": config.replay.speed, "concurrency": config.replay.concurrency,
        "rate": rate, "retime": config.retime if rate is not None else None,
        "time_scale": config.client.time_scale, "requests": len(specs), "wall_s": round(result.wall_s, 3),
        "trace_rate": mean_rate(specs), "trace_ideal_block_hit_ratio": ideal_block_hit_ratio_of_ids(specs),
        **m.to_json(),
        "prefix_hit_ratio": hit,
        "client_cached_token_ratio": cached_tokens / prompt_tokens if prompt_tokens else None,
        "step_lag_ms": lag,
        "step_lag_by_process": by_process or None,
        "step_lag_by_engine": by_engine or None,
        "engines_behind": behind,
        "suggested_time_scale": suggested,
        "send_lag_wall_ms": send_lag,
        "load_generator": result.priority.to_json() if result.priority is not None else None,
        "warm_connections": {"asked": asked, "opened": opened},
        "kv_transfer_real_bottleneck": slow,
        "workers": [w for w, _ in result.workers],
        "trustworthy": trustworthy,
        "notes": notes,
    }


def _progress(total: int, enabled: bool, desc: str) -> tuple[Callable[[RequestRecord], None], Callable[[], None]]:
    if not enabled:
        return (lambda r: None), (lambda: None)
    from tqdm import tqdm

    bar = tqdm(total=total, desc=desc, unit="req", file=sys.stderr, dynamic_ncols=True, leave=False)
    failed = 0

    def on_done(r: RequestRecord) -> None:
        nonlocal failed
        if not r.success:
            failed += 1
            bar.set_postfix(failed=failed)
        bar.update(1)

    return on_done, bar.close


def shape(trace: TraceData, config: LoadTestConfig) -> tuple[RequestSpec, ...]:
    """The trace after the window and (optionally) bucket jitter; raises ValueError when empty."""
    sl = config.slice
    specs = window(trace.requests, sl.start_s, sl.duration_s, sl.max_requests)
    if sl.jitter_buckets:
        specs = jitter_buckets(specs, np.random.default_rng([config.seed, 1]))
    if not specs:
        raise ValueError(f"{trace.source}: no request in the chosen window (start {sl.start_s} s, duration "
                         f"{sl.duration_s} s, cap {sl.max_requests})")
    return specs


async def run_loadtest(base_url: str, trace: TraceData, config: LoadTestConfig,
                       out_root: Path | None = Path("runs"), folder: Path | None = None) -> LoadTestResult:
    """Replay ``trace`` against ``base_url`` as ``config`` says and write the run folder.

    ``folder`` names the run folder exactly; otherwise one is made under ``out_root``
    (``<timestamp>-<name>``); both None writes nothing. Raises ``TargetError`` when the target cannot be
    used, ValueError for an empty slice; per-request failures are only counted.
    """
    base = shape(trace, config)
    if folder is None and out_root is not None:
        folder = new_run_folder(out_root, config.name)
    points: list[tuple[str, float | None]] = (
        [(f"rate-{r:g}", r) for r in config.rates] if config.rates else [("run", None)])
    runs: list[RunOutcome] = []
    for i, (label, rate) in enumerate(points):
        if rate is None:
            specs = base
        else:
            specs = RETIMERS[config.retime](base, rate, config.burstiness, np.random.default_rng([config.seed, 2, i]))
        synth = PromptSynthesizer(seed=config.seed + i)
        client = dataclasses.replace(config.client, request_id_prefix=f"{uuid.uuid4().hex[:8]}-")
        on_done, close = _progress(len(specs), config.progress, label if rate is not None else config.name)
        try:
            result = await replay(base_url, specs, config.replay, client, synth, on_done=on_done)
        finally:
            close()
        name = config.name if rate is None else f"{config.name}@{rate:g}rps"
        summary = build_summary(name, base_url, trace, specs, result, config, rate)
        if folder is not None:
            sub = folder if rate is None else folder / label
            summary["folder"] = "." if rate is None else label
            summary["notes"].extend(write_run(sub, summary, result.records, result.depth, plots=config.plots))
            write_json(sub / "summary.json", summary)
        runs.append(RunOutcome(label, rate, specs, result, summary))
    if not config.rates:
        return LoadTestResult(runs, runs[0].summary, folder)
    curve = [(o.rate or 0.0, o.summary.get("slo_attainment")) for o in runs]
    sweep: dict[str, Any] = {
        "sweep": True, "name": config.name, "target": base_url, "trace": trace.source, "retime": config.retime,
        "burstiness": config.burstiness, "rates": list(config.rates), "slo_ms": dict(config.slos),
        "goodput_target": config.goodput_target,
        "max_rate_meeting_target": (max_rate_meeting_target(curve, config.goodput_target)
                                    if config.goodput_target is not None and config.slos else None),
        "runs": [o.summary for o in runs],
    }
    if config.goodput_target is not None and not config.slos:
        sweep["notes"] = ["a goodput target needs at least one --slo; no highest rate computed"]
    if folder is not None:
        write_json(folder / "summary.json", sweep)
        if config.plots and config.slos:
            try:
                plot_slo_vs_rate(folder, curve, config.goodput_target, config.name)
            except Exception as e:  # a plot must never cost the run its data
                sweep.setdefault("notes", []).append(f"SLO plot skipped: {type(e).__name__}: {e}")
    return LoadTestResult(runs, sweep, folder)


def run_sync(coro: Coroutine[Any, Any, T]) -> T:
    """Run a coroutine on a fresh event loop (uvloop when installed)."""
    try:
        import uvloop
    except ImportError:
        return asyncio.run(coro)
    return uvloop.run(coro)


def default_demo_trace() -> tuple[Path, str]:
    """The demo's trace and format: the derived ShareGPT trace of set-ups A/B when ../shared is next to
    the checkout, else the bundled synthetic workload."""
    if DEMO_TRACE.is_file():
        return DEMO_TRACE, "mooncake"
    return DEMO_WORKLOAD, "synthetic"


def replay_slice(url: str, trace: Path | str | None = None, *, fmt: str = "auto", block_size: int | None = None,
                 duration_s: float | None = 30.0, max_requests: int | None = 100, speed: float = 1.0,
                 time_scale: float = 1.0, name: str = "demo", out_root: Path | None = Path("runs"),
                 progress: bool = True, console: Any = None) -> dict[str, Any]:
    """Replay a slice of ``trace`` (default: ``default_demo_trace()``) against a running router at ``url``,
    print the summary table and return the summary object. Blocking; starts its own event loop."""
    if trace is None:
        path, fmt = default_demo_trace()
    else:
        path = Path(trace)
    data = read_trace(path, fmt, ReadOptions(block_size=block_size))
    config = LoadTestConfig(name=name, slice=WorkloadSlice(duration_s=duration_s, max_requests=max_requests),
                            replay=ReplayConfig(speed=speed), client=ClientConfig(time_scale=time_scale),
                            progress=progress)
    result = run_sync(run_loadtest(url, data, config, out_root=out_root))
    if console is None:
        from rich.console import Console

        console = Console(file=sys.stdout, highlight=False, width=None if sys.stdout.isatty() else 160)
    print_summary(console, result.summary)
    if result.folder is not None:
        console.print(f"run folder: {result.folder}")
    return result.summary


def print_result(console: Any, result: LoadTestResult) -> None:
    """Print a single run's summary, or a sweep's table and each point's summary."""
    if result.summary.get("sweep"):
        print_sweep(console, result.summary)
    else:
        print_summary(console, result.summary)
    if result.folder is not None:
        console.print(f"run folder: {result.folder}")


__all__ = ["LoadTestConfig", "LoadTestResult", "WorkloadSlice", "default_demo_trace",
           "print_result", "replay_slice", "run_loadtest", "run_sync"]

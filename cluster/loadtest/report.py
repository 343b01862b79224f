"""Run folders, plots, summary tables, and side-by-side comparison of runs.

A run folder (default ``runs/<YYYYmmdd-HHMMSS>-<name>/``) holds:

- ``summary.json``: the summary object (see ``session.build_summary``); for a sweep, the sweep summary with
  one sub-folder per rate (``rate-<r>/``) laid out like a single run;
- ``requests.jsonl``: one ``RequestRecord`` per line (every inter-token gap included);
- ``timeseries.json``: client-side throughput and in-flight per second, the target's queue depth samples;
- PNG plots (matplotlib, Agg backend): ``ttft_cdf.png``, ``tpot_cdf.png``, ``throughput.png``,
  ``queue_depth.png``, ``worker_load.png`` (when the target exposes per-worker depth or a worker header),
  and for sweeps ``slo_attainment_vs_rate.png``.

Plotting never fails a run: a plot that cannot be drawn is skipped and named in the returned notes.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import asdict
from datetime import datetime
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

from cluster.loadtest.metrics import cdf, throughput_timeline
from cluster.loadtest.record import RequestRecord
from cluster.loadtest.scrape import DepthSample

SUMMARY_FILE = "summary.json"
REQUESTS_FILE = "requests.jsonl"
TIMESERIES_FILE = "timeseries.json"


def _plt() -> Any:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def new_run_folder(root: Path | str, name: str, now: datetime | None = None) -> Path:
    """``root/<YYYYmmdd-HHMMSS>-<name>``, made unique with a ``-2``, ``-3`` ... suffix; created."""
    stamp = (now or datetime.now()).strftime("%Y%m%d-%H%M%S")
    safe = "".join(c if c.isalnum() or c in "-_." else "-" for c in name) or "run"
    base = Path(root) / f"{stamp}-{safe}"
    folder, k = base, 1
    while folder.exists():
        k += 1
        folder = base.with_name(f"{base.name}-{k}")
    folder.mkdir(parents=True)
    return folder


def write_json(path: Path, obj: Any) -> None:
    path.write_text(json.dumps(obj, indent=2, default=str, allow_nan=True) + "\n")


def write_records(path: Path, records: Sequence[RequestRecord]) -> None:
    with path.open("w") as f:
        for r in records:
            f.write(json.dumps(r.to_json(), separators=(",", ":")) + "\n")


def read_records(path: Path) -> list[RequestRecord]:
    out: list[RequestRecord] = []
    with path.open() as f:
        for line in f:
            if line.strip():
                out.append(RequestRecord.from_json(json.loads(line)))
    return out


def write_run(folder: Path, summary: Mapping[str, Any], records: Sequence[RequestRecord],
              depth: Sequence[DepthSample], *, plots: bool = True) -> list[str]:
    """Write one run's files into ``folder`` (created); returns notes about plots that were skipped."""
    folder.mkdir(parents=True, exist_ok=True)
    write_json(folder / SUMMARY_FILE, summary)
    write_records(folder / REQUESTS_FILE, records)
    timeline = throughput_timeline(records)
    write_json(folder / TIMESERIES_FILE, {"client": timeline, "target_depth": [asdict(d) for d in depth]})
    if not plots:
        return []
    notes: list[str] = []
    title = str(summary.get("name", folder.name))
    for fn in (plot_latency_cdfs, plot_throughput, plot_queue_depth, plot_worker_load):
        try:
            notes.extend(fn(folder, title, records, depth, timeline))
        except Exception as e:  # a plot must never cost the run its data
            notes.append(f"plot {fn.__name__} skipped: {type(e).__name__}: {e}")
    return notes


def plot_latency_cdfs(folder: Path, title: str, records: Sequence[RequestRecord], depth: Sequence[DepthSample],
                      timeline: Mapping[str, list[float]]) -> list[str]:
    plt = _plt()
    ok = [r for r in records if r.success]
    for metric, values in (("ttft", [r.ttft_ms for r in ok if r.ttft_ms is not None]),
                           ("tpot", [t for t in (r.tpot_ms for r in ok) if t is not None])):
        fig, ax = plt.subplots(figsize=(6, 4))
        x, y = cdf(values)
        ax.plot(x, y, drawstyle="steps-post")
        ax.set_xlabel(f"{metric.upper()} (emulated ms)")
        ax.set_ylabel("fraction of requests")
        ax.set_title(f"{metric.upper()} CDF: {title}")
        ax.grid(alpha=0.3)
        fig.tight_layout()
        fig.savefig(folder / f"{metric}_cdf.png", dpi=100)
        plt.close(fig)
    return []


def plot_throughput(folder: Path, title: str, records: Sequence[RequestRecord], depth: Sequence[DepthSample],
                    timeline: Mapping[str, list[float]]) -> list[str]:
    plt = _plt()
    fig, ax = plt.subplots(figsize=(7, 4))
    ax.plot(timeline["t_s"], timeline["output_tokens_per_s"], label="output tokens/s")
    ax.set_xlabel("time (emulated s)")
    ax.set_ylabel("output tokens/s")
    ax2 = ax.twinx()
    ax2.plot(timeline["t_s"], timeline["requests_per_s"], color="tab:orange", label="completed requests/s")
    ax2.set_ylabel("completed requests/s")
    ax.set_title(f"throughput: {title}")
    lines = ax.get_lines() + ax2.get_lines()
    ax.legend(lines, [ln.get_label() for ln in lines], loc="lower center", fontsize="small")
    fig.tight_layout()
    fig.savefig(folder / "throughput.png", dpi=100)
    plt.close(fig)
    return []


def plot_queue_depth(folder: Path, title: str, records: Sequence[RequestRecord], depth: Sequence[DepthSample],
                     timeline: Mapping[str, list[float]]) -> list[str]:
    plt = _plt()
    fig, ax = plt.subplots(figsize=(7, 4))
    ax.plot(timeline["t_s"], timeline["in_flight"], label="in flight (client)", color="tab:gray")
    notes: list[str] = []
    running = [(d.t_ms / 1000.0, d.running) for d in depth if d.running is not None]
    waiting = [(d.t_ms / 1000.0, d.waiting) for d in depth if d.waiting is not None]
    if running:
        ax.plot(*zip(*running, strict=True), label="running (target)")
    if waiting:
        ax.plot(*zip(*waiting, strict=True), label="waiting (target)")
    if not running and not waiting:
        notes.append("queue depth: the target exports no vllm:num_requests_running/waiting; plotted the "
                     "client's in-flight count only")
    ax.set_xlabel("time (emulated s)")
    ax.set_ylabel("requests")
    ax.set_title(f"queue depth: {title}")
    ax.legend()
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(folder / "queue_depth.png", dpi=100)
    plt.close(fig)
    return notes


def plot_worker_load(folder: Path, title: str, records: Sequence[RequestRecord], depth: Sequence[DepthSample],
                     timeline: Mapping[str, list[float]]) -> list[str]:
    names = sorted({name for d in depth for name in d.per_series})
    by_header: dict[str, int] = {}
    for r in records:
        if r.worker:
            by_header[r.worker] = by_header.get(r.worker, 0) + 1
    if not names and not by_header:
        return ["per-worker load: the target lists no workers and names none per request; no plot"]
    plt = _plt()
    fig, ax = plt.subplots(figsize=(7, 4))
    if names:
        for name in names:
            pts = [(d.t_ms / 1000.0, sum(d.per_series[name])) for d in depth if name in d.per_series]
            ax.plot(*zip(*pts, strict=True), label=name)
        ax.set_xlabel("time (emulated s)")
        ax.set_ylabel("running + waiting")
        if len(names) <= 12:
            ax.legend(fontsize="small")
    else:
        ax.bar(list(by_header), list(by_header.values()))
        ax.set_ylabel("requests served")
        ax.tick_params(axis="x", rotation=45)
    ax.set_title(f"per-worker load: {title}")
    fig.tight_layout()
    fig.savefig(folder / "worker_load.png", dpi=100)
    plt.close(fig)
    return []


def plot_slo_vs_rate(folder: Path, points: Sequence[tuple[float, float | None]], target: float | None,
                     title: str) -> None:
    plt = _plt()
    fig, ax = plt.subplots(figsize=(6, 4))
    xs = [p[0] for p in points if p[1] is not None]
    ys = [p[1] for p in points if p[1] is not None]
    ax.plot(xs, ys, marker="o")
    if target is not None:
        ax.axhline(target, color="tab:red", linestyle="--", label=f"target {target:g}")
        ax.legend()
    ax.set_xlabel("request rate (req/s)")
    ax.set_ylabel("SLO attainment")
    ax.set_ylim(0, 1.05)
    ax.set_title(f"SLO attainment vs rate: {title}")
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(folder / "slo_attainment_vs_rate.png", dpi=100)
    plt.close(fig)


# -- printing ----------------------------------------------------------------------------------------------

def _f(x: Any, digits: int = 1) -> str:
    if x is None:
        return "-"
    if isinstance(x, float):
        return f"{x:,.{digits}f}"
    return str(x)


def print_summary(console: Console, s: Mapping[str, Any]) -> None:
    """The summary table of one run: latency statistics, then counts, throughput and target figures."""
    t = Table(title=f"{s.get('name', 'run')}: {s.get('completed')} completed, {s.get('failed')} failed "
                    f"in {_f(s.get('duration_s'))} s (emulated)")
    t.add_column("metric (emulated ms)")
    for col in ("mean", "p50", "p90", "p95", "p99"):
        t.add_column(col, justify="right")
    for key, label in (("ttft_ms", "TTFT"), ("tpot_ms", "TPOT"), ("itl_ms", "ITL"), ("e2e_ms", "E2E")):
        st = s.get(key) or {}
        t.add_row(label, *[_f(st.get(c), 2 if key in ("tpot_ms", "itl_ms") else 1)
                           for c in ("mean", "p50", "p90", "p95", "p99")])
    console.print(t)
    lag = s.get("step_lag_ms")
    send = s.get("send_lag_wall_ms") or {}
    rows = [
        ("requests/s", _f(s.get("request_throughput"), 3)), ("output tokens/s", _f(s.get("output_throughput"))),
        ("prefix hit ratio (target)", _f(s.get("prefix_hit_ratio"), 3)),
        ("step lag p50 / p99 / max ms", "-" if not lag else
         f"{_f(lag.get('p50'), 2)} / {_f(lag.get('p99'), 2)} / {_f(lag.get('max'), 2)}"),
        ("send lag p99 (wall ms)", _f(send.get("p99"), 3)),
    ]
    by_process = s.get("step_lag_by_process") or {}
    if len(by_process) > 1:
        worst = max(by_process, key=lambda p: float(by_process[p].get("p99") or 0.0))
        rows.append(("worst process step lag p99 ms", f"{_f(by_process[worst].get('p99'), 2)} ({worst})"))
    if s.get("engines_behind"):
        rows.append(("engines behind", str(len(s["engines_behind"]))))
    if s.get("suggested_time_scale") is not None:
        rows.append(("suggested time scale", _f(s["suggested_time_scale"], 2)))
    if s.get("slo_ms"):
        rows += [("SLOs (ms)", ", ".join(f"{k}<={v:g}" for k, v in s["slo_ms"].items())),
                 ("SLO attainment", _f(s.get("slo_attainment"), 3)), ("goodput req/s", _f(s.get("request_goodput"), 3))]
    t2 = Table(show_header=False)
    t2.add_column("")
    t2.add_column("", justify="right")
    for k, v in rows:
        t2.add_row(k, v)
    console.print(t2)
    for note in s.get("notes") or []:
        console.print(f"note: {note}")


def print_sweep(console: Console, sweep: Mapping[str, Any]) -> None:
    t = Table(title=f"sweep {sweep.get('name')}: {sweep.get('retime')} re-timing")
    for col in ("rate", "completed", "failed", "req/s", "TTFT p50", "TTFT p99", "TPOT p50", "TPOT p99",
                "SLO attainment", "goodput"):
        t.add_column(col, justify="right")
    for s in sweep.get("runs", []):
        t.add_row(_f(s.get("rate"), 2), str(s.get("completed")), str(s.get("failed")),
                  _f(s.get("request_throughput"), 3), _f(s["ttft_ms"].get("p50")), _f(s["ttft_ms"].get("p99")),
                  _f(s["tpot_ms"].get("p50"), 2), _f(s["tpot_ms"].get("p99"), 2), _f(s.get("slo_attainment"), 3),
                  _f(s.get("request_goodput"), 3))
    console.print(t)
    if sweep.get("goodput_target") is not None:
        best = sweep.get("max_rate_meeting_target")
        console.print(f"highest rate keeping SLO attainment >= {sweep['goodput_target']:g}: "
                      f"{'none of the swept rates' if best is None else f'{best:g} req/s'}")


# -- comparing runs ----------------------------------------------------------------------------------------

def load_runs(paths: Sequence[Path]) -> list[tuple[str, dict[str, Any], Path]]:
    """(label, summary, folder) of each run; a sweep folder expands to its rate sub-runs. Raises
    FileNotFoundError naming a folder without ``summary.json``."""
    out: list[tuple[str, dict[str, Any], Path]] = []
    for p in paths:
        f = p / SUMMARY_FILE
        if not f.is_file():
            raise FileNotFoundError(f"{p}: no {SUMMARY_FILE} (not a load-test run folder)")
        s = json.loads(f.read_text())
        if s.get("sweep"):
            for sub in s.get("runs", []):
                folder = p / str(sub.get("folder", ""))
                out.append((f"{p.name}/{folder.name}", sub, folder))
        else:
            out.append((p.name, s, p))
    return out


COMPARE_ROWS: tuple[tuple[str, str, str | None], ...] = (
    ("completed", "completed", None), ("failed", "failed", None), ("duration s", "duration_s", None),
    ("requests/s", "request_throughput", None), ("output tokens/s", "output_throughput", None),
    ("TTFT mean", "ttft_ms", "mean"), ("TTFT p50", "ttft_ms", "p50"), ("TTFT p99", "ttft_ms", "p99"),
    ("TPOT mean", "tpot_ms", "mean"), ("TPOT p50", "tpot_ms", "p50"), ("TPOT p99", "tpot_ms", "p99"),
    ("ITL p50", "itl_ms", "p50"), ("ITL p99", "itl_ms", "p99"),
    ("E2E p50", "e2e_ms", "p50"), ("E2E p99", "e2e_ms", "p99"),
    ("prefix hit ratio", "prefix_hit_ratio", None), ("step lag p99 ms", "step_lag_ms", "p99"),
    ("SLO attainment", "slo_attainment", None),
)


def compare_rows(runs: Sequence[tuple[str, Mapping[str, Any], Path]]) -> list[tuple[str, list[Any]]]:
    rows: list[tuple[str, list[Any]]] = []
    for label, key, sub in COMPARE_ROWS:
        vals: list[Any] = []
        for _, s, _ in runs:
            v = s.get(key)
            if sub is not None:
                v = v.get(sub) if isinstance(v, dict) else None
            vals.append(v)
        rows.append((label, vals))
    return rows


def print_compare(console: Console, runs: Sequence[tuple[str, Mapping[str, Any], Path]]) -> None:
    t = Table(title="runs side by side (emulated ms)")
    t.add_column("metric")
    for label, _, _ in runs:
        t.add_column(label, justify="right")
    for label, vals in compare_rows(runs):
        t.add_row(label, *[_f(v, 3 if isinstance(v, float) and abs(v) < 10 else 1) for v in vals])
    console.print(t)


def plot_compare(out: Path, runs: Sequence[tuple[str, Mapping[str, Any], Path]]) -> list[Path]:
    """Overlaid CDFs of TTFT, TPOT, ITL and E2E of every run, one PNG per metric, into ``out``."""
    plt = _plt()
    out.mkdir(parents=True, exist_ok=True)
    loaded = [(label, read_records(folder / REQUESTS_FILE) if (folder / REQUESTS_FILE).is_file() else [])
              for label, _, folder in runs]
    written: list[Path] = []
    for metric in ("ttft", "tpot", "itl", "e2e"):
        fig, ax = plt.subplots(figsize=(7, 4))
        for label, records in loaded:
            ok = [r for r in records if r.success]
            if metric == "ttft":
                values = [r.ttft_ms for r in ok if r.ttft_ms is not None]
            elif metric == "tpot":
                values = [t for t in (r.tpot_ms for r in ok) if t is not None]
            elif metric == "itl":
                values = [g for r in ok for g in r.itl_ms]
            else:
                values = [r.e2e_ms for r in ok if r.e2e_ms is not None]
            x, y = cdf(values)
            ax.plot(x, y, drawstyle="steps-post", label=label)
        ax.set_xlabel(f"{metric.upper()} (emulated ms)")
        ax.set_ylabel("fraction")
        ax.set_title(f"{metric.upper()} CDF")
        ax.legend(fontsize="small")
        ax.grid(alpha=0.3)
        fig.tight_layout()
        path = out / f"{metric}_cdf.png"
        fig.savefig(path, dpi=100)
        plt.close(fig)
        written.append(path)
    return written


__all__ = ["load_runs", "new_run_folder", "plot_compare", "print_compare", "print_summary",
           "print_sweep", "read_records", "write_run"]

"""``chaos``: launch a cluster, replay a trace while a fault schedule plays, check the history, report.

Writes the load test's run folder plus ``events.jsonl`` (each action with its planned and actual emulated
time), ``chaos_context.json``, ``checker.json`` and ``chaos.json`` (per event: requests failed, TTFT/TPOT
before/during/after, time until throughput is back to 90%); prints a table per event and the checker's
verdict, and with ``--json`` the ``chaos.json`` object as the last line. Exit status 1 when the checker
found a violation.

``--hosts-run-dir DIR`` (a cluster on the hosts harness, ``run_cluster.py hosts``): host-level faults, so
``kill_node`` loses the node's whole host (its raylet and every actor on it) and ``partition`` may name a
``host`` (its link down for ``duration_s``). Run the driver on a host the schedule does not fault.

``--soak``: instead of a schedule file, seeded random kills and spot preemptions (``--every`` emulated
seconds apart on average, each engine replaced ``--replace-after`` s after its kill) over ``--duration``
seconds of the trace (default: the Mooncake conversation trace in ``../shared/traces/``); ``chaos.json``
then carries ``soak``: requests succeeded (%), tokens lost or repeated, step lag.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import TYPE_CHECKING, Any

from cluster.cli import Command, register
from cluster.cli.output import console, print_json

if TYPE_CHECKING:
    from cluster.hosts.harness import Harness


def configure(p: argparse.ArgumentParser) -> None:
    from cluster.loadtest.formats import format_names

    p.add_argument("--config", type=Path, required=True, metavar="FILE", help="cluster spec to launch")
    p.add_argument("--address", help="attach to this Ray cluster (HOST:PORT) instead of starting an embedded one")
    p.add_argument("--schedule", type=Path, default=None, metavar="FILE", help="fault schedule (YAML)")
    p.add_argument("--hosts-run-dir", type=Path, default=None, metavar="DIR",
                   help="the hosts harness's run dir (run_cluster.py hosts up --run-dir): kill_node then loses the "
                        "node's whole host (raylet and every actor) and partition may name a host (its link down)")
    p.add_argument("--trace", type=Path, default=None,
                   help="trace file (Mooncake JSONL, Azure CSV, synthetic YAML); --soak: Mooncake's by default")
    p.add_argument("--soak", action="store_true",
                   help="random kills and preemptions over --duration seconds instead of --schedule")
    p.add_argument("--every", type=float, default=30.0, help="--soak: mean emulated seconds between faults")
    p.add_argument("--notice", type=float, default=30.0, help="--soak: spot preemption notice, emulated s")
    p.add_argument("--replace-after", type=float, default=10.0,
                   help="--soak: emulated seconds from a kill until a fresh engine joins")
    p.add_argument("--fault-seed", type=int, default=0, help="--soak: seed of the fault draws")
    p.add_argument("--keep-alive", type=int, default=1,
                   help="--soak: engines never down at once below this many (kills and notices count as down)")
    p.add_argument("--format", default="auto", choices=["auto", *format_names()], help="trace format")
    p.add_argument("--block-size", type=int, default=None, help="tokens per hash-id block (default: inferred)")
    p.add_argument("--duration", type=float, default=None, help="replay this many trace seconds")
    p.add_argument("--max-requests", type=int, default=None, help="at most this many requests")
    p.add_argument("--speed", type=float, default=1.0, help="divide trace times by this factor")
    p.add_argument("--time-scale", type=float, default=None, help="override the spec's wall s per emulated s")
    p.add_argument("--request-timeout", type=float, default=600.0,
                   help="wall seconds per request (its deadline, which the checker enforces)")
    p.add_argument("--window", type=float, default=10.0,
                   help="emulated seconds before/after each event over which latency and throughput are compared")
    p.add_argument("--seed", type=int, default=0, help="seed of prompt synthesis")
    p.add_argument("--name", default=None, help="run name (default: the schedule's name)")
    p.add_argument("--out", type=Path, default=None, help="run folder (default runs/<timestamp>-<name>/)")
    p.add_argument("--runs-dir", type=Path, default=Path("runs"), help="where default run folders go")
    p.add_argument("--no-plots", action="store_true", help="skip the PNG plots")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.add_argument("--json", action="store_true", help="print chaos.json as one JSON object on the last line")


def _harness(run_dir: Path | None) -> Harness | None:
    """The hosts harness up in ``run_dir`` (ValueError when none is), or None without ``--hosts-run-dir``."""
    if run_dir is None:
        return None
    from cluster.hosts.harness import Harness, HarnessError

    h = Harness(run_dir)
    try:
        h.state()
    except HarnessError as e:
        raise ValueError(f"--hosts-run-dir: {e}") from None
    return h


def _fmt(x: Any) -> str:
    return "-" if x is None else f"{x:.1f}"


def print_chaos(out: Any, summary: dict[str, Any]) -> None:
    from rich.table import Table

    table = Table(title=f"chaos: {summary['schedule']}")
    for col in ("#", "kind", "at s", "failed", "migrated", "ckpt resumed", "TTFT p50 before/during/after ms",
                "TPOT p50 before/during/after ms", "recovery s"):
        table.add_column(col)
    for imp in summary["impact"]:
        ttft = "/".join(_fmt(imp[w]["ttft_ms"]["p50"]) for w in ("before", "during", "after"))
        tpot = "/".join(_fmt(imp[w]["tpot_ms"]["p50"]) for w in ("before", "during", "after"))
        table.add_row(str(imp["index"]), imp["kind"], f"{imp['at_s']:g}", str(imp["failed"]),
                      str(imp.get("migrated", "-")), str(imp.get("resumed_from_checkpoint", "-")), ttft, tpot,
                      _fmt(imp["recovery_s"]))
    out.print(table)
    kv = summary.get("kv_migration") or {}
    if kv.get("migrated") or kv.get("resumed_from_checkpoint") or kv.get("checkpoint_ms_per_32_tokens"):
        ck, rc = kv.get("checkpoint_ms_per_32_tokens") or {}, kv.get("recomputed_tokens_per_resume") or {}
        out.print(f"KV moves: {kv['migrated']} migrated (mean {_fmt(kv.get('migration_ms_mean'))} ms each), "
                  f"{kv['resumed_from_checkpoint']} resumed from a checkpoint (tokens recomputed: mean "
                  f"{_fmt(rc.get('mean'))}, max {_fmt(rc.get('max'))}); checkpoint per 32 tokens: mean "
                  f"{ck.get('mean', float('nan')):.3f} ms over {ck.get('n', 0)}")
    chk = summary["checker"]
    out.print(f"checker: {'OK' if chk['ok'] else 'VIOLATIONS'} over {chk['requests']} requests, "
              f"{chk['tokens_checked']} tokens; by rule: {chk['violations_by_rule'] or 'none'}")
    for v in chk["violations"][:10]:
        out.print(f"  {v['rule']} {v['subject']}: {v['detail']}")
    for s in chk["skipped"]:
        out.print(f"  skipped: {s}")
    out.print(f"run folder: {summary['folder']}")


def run(args: argparse.Namespace) -> int:
    from cluster.chaos.injectors import UnsupportedEvent, plan_actions
    from cluster.chaos.run import run_chaos
    from cluster.chaos.schedule import load_schedule
    from cluster.chaos.soak import DEFAULT_TRACE, SoakConfig, soak_schedule
    from cluster.loadtest import (
        ClientConfig,
        LoadTestConfig,
        ReadOptions,
        ReplayConfig,
        TargetError,
        TraceError,
        WorkloadSlice,
        read_trace,
        run_sync,
    )
    from cluster.loadtest.report import new_run_folder
    from config import ConfigError, load_cluster

    if args.soak == (args.schedule is not None):
        raise SystemExit("error: give either --schedule FILE or --soak (with --duration)")
    if args.soak and args.duration is None:
        raise SystemExit("error: --soak needs --duration (seconds of the trace to replay)")
    trace_path = args.trace or (Path(__file__).resolve().parents[2] / DEFAULT_TRACE if args.soak else None)
    if trace_path is None:
        raise SystemExit("error: --trace is required without --soak")
    try:
        spec = load_cluster(args.config)
        if args.soak:
            schedule = soak_schedule(SoakConfig(duration_s=args.duration, every_s=args.every, notice_s=args.notice,
                                                replace_after_s=args.replace_after, seed=args.fault_seed,
                                                keep_alive=args.keep_alive),
                                     [e.name for e in spec.engines()])
        else:
            schedule = load_schedule(args.schedule)
        plan_actions(schedule)  # an event this build cannot inject fails before anything starts
        trace = read_trace(trace_path, args.format, ReadOptions(block_size=args.block_size, seed=args.seed))
    except (ConfigError, UnsupportedEvent, TraceError, ValueError) as e:
        raise SystemExit(f"error: {e}") from None
    if args.time_scale is not None:
        if args.time_scale <= 0:
            raise SystemExit("error: --time-scale must be positive")
        spec = spec.model_copy(update={"time_scale": args.time_scale})
    try:
        schedule.check_against([e.name for e in spec.engines()], {e.node for e in spec.engines()},
                               str(args.schedule or "--soak"), hosts=[h.name for h in spec.placement.hosts])
        harness = _harness(args.hosts_run_dir)
        config = LoadTestConfig(
            name=args.name or schedule.name,
            slice=WorkloadSlice(duration_s=args.duration, max_requests=args.max_requests),
            replay=ReplayConfig(speed=args.speed),
            client=ClientConfig(time_scale=spec.time_scale, request_timeout_s=args.request_timeout),
            seed=args.seed, progress=not args.no_progress, plots=not args.no_plots)
    except (ConfigError, ValueError) as e:
        raise SystemExit(f"error: {e}") from None
    folder = args.out or new_run_folder(args.runs_dir, config.name)
    from cluster.launch import launch

    out = console()
    out.print(f"launching cluster {spec.name} ({len(spec.engines())} engines, time scale {spec.time_scale})")
    try:
        handle = launch(spec, address=args.address)
    except Exception as e:  # Ray and start-up errors come in many types; all mean the same here
        raise SystemExit(f"error: cluster {spec.name} did not start: {type(e).__name__}: {e}") from None
    try:
        control = None
        if harness is not None:
            from cluster.hosts.faults import HostFaultControl

            control = HostFaultControl(handle, harness)
        summary = run_sync(run_chaos(handle, schedule, trace, config, folder, window_s=args.window, control=control))
    except (TargetError, ValueError) as e:
        raise SystemExit(f"error: {e}") from None
    finally:
        handle.shutdown()
    if args.soak:
        from cluster.chaos.run import CHAOS_FILE
        from cluster.chaos.soak import soak_figures
        from cluster.loadtest.report import write_json

        summary["soak"] = soak_figures(summary)
        write_json(folder / CHAOS_FILE, summary)
        out.print(f"soak: {summary['soak']}")
    print_chaos(out, summary)
    if args.json:
        print_json(summary)
    return 0 if summary["checker"]["ok"] else 1


register(Command("chaos", "replay a trace against a launched cluster while a fault schedule plays; "
                          "check every request's history", configure, run))

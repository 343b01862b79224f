"""``loadtest``: replay a trace against an OpenAI-compatible target (or a cluster launched from a spec).

``--target URL`` drives any running server; ``--config FILE`` launches that cluster spec with
``cluster.launch.launch``, replays, and shuts it down (the emulated time scale then comes from the spec).
Writes a run folder (summary.json, requests.jsonl, timeseries.json, PNG plots), prints a summary table,
shows a progress bar on stderr, and with ``--json`` prints the summary object as the last line.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from cluster.cli import Command, register
from cluster.cli.output import console, print_json


def _rates(text: str) -> tuple[float, ...]:
    try:
        rates = tuple(float(x) for x in text.split(",") if x.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"--rate takes comma-separated numbers, got {text!r}") from None
    if not rates or any(r <= 0 for r in rates):
        raise argparse.ArgumentTypeError("--rate values must be positive")
    return rates


def configure(p: argparse.ArgumentParser) -> None:
    from cluster.loadtest.formats import format_names
    from cluster.loadtest.schedule import RETIMERS

    where = p.add_mutually_exclusive_group(required=True)
    where.add_argument("--target", metavar="URL", help="base URL of a running OpenAI-compatible server")
    where.add_argument("--config", type=Path, metavar="FILE", help="cluster spec to launch, drive and shut down")
    p.add_argument("--address", help="with --config: attach to this Ray cluster (HOST:PORT) instead of an embedded one")
    p.add_argument("--trace", type=Path, required=True, help="trace file (Mooncake JSONL, Azure CSV, synthetic YAML)")
    p.add_argument("--format", default="auto", choices=["auto", *format_names()],
                   help="trace format (default: detected from the extension or first line)")
    p.add_argument("--block-size", type=int, default=None,
                   help="tokens per hash-id block (512 for the Mooncake files, 16 for the derived ShareGPT files; "
                        "default: inferred from the hash ids)")
    p.add_argument("--strict", action="store_true", help="fail on the first malformed trace line instead of counting")
    p.add_argument("--name", default=None, help="run name (default: the trace's file stem)")
    g = p.add_argument_group("what to replay")
    g.add_argument("--start", type=float, default=0.0, help="skip this many trace seconds from its first arrival")
    g.add_argument("--duration", type=float, default=None, help="replay this many trace seconds")
    g.add_argument("--max-requests", type=int, default=None, help="at most this many requests")
    g.add_argument("--jitter-buckets", action="store_true",
                   help="spread requests that share a timestamp uniformly up to the next timestamp (seeded)")
    g = p.add_argument_group("pacing")
    g.add_argument("--speed", type=float, default=1.0, help="divide trace times by this factor (open loop)")
    g.add_argument("--concurrency", type=int, default=None, help="closed loop: keep this many requests in flight")
    g.add_argument("--rate", type=_rates, default=(), metavar="R[,R...]",
                   help="re-time the trace to these request rates (req/s), one run each (a sweep)")
    g.add_argument("--retime", default="scale", choices=sorted(RETIMERS),
                   help="how --rate re-times: scale the trace's timestamps, or draw Poisson/gamma arrivals")
    g.add_argument("--burstiness", type=float, default=1.0, help="gamma shape for --retime poisson (1 = Poisson)")
    g = p.add_argument_group("client")
    g.add_argument("--model", default=None, help="model name to request (default: the target's first model)")
    g.add_argument("--time-scale", type=float, default=None,
                   help="wall seconds per emulated second: of the target with --target (default 1.0); with "
                        "--config it overrides the spec's (above 1 gives a small host headroom)")
    g.add_argument("--request-timeout", type=float, default=3600.0, help="wall seconds per request")
    g.add_argument("--prompt-format", choices=["ids", "text"], default="ids",
                   help="send prompts as token ids, or as text of one word per token (for text-only routers)")
    g.add_argument("--seed", type=int, default=0, help="seed of prompt synthesis, jitter and re-timing")
    g.add_argument("--generator-nice", type=int, default=None, metavar="N",
                   help="niceness of the load generator's thread for the run (-20..19): with --config the spec's "
                        "engine_nice, else the engines' default (-5), so it does not wait for a core behind "
                        "emulated engines on the same host; kept as it is where the host refuses (no root or "
                        "CAP_SYS_NICE), which the summary notes")
    g = p.add_argument_group("SLOs and output")
    g.add_argument("--slo", action="append", default=[], metavar="NAME:MS",
                   help="an SLO, e.g. ttft:500, tpot:50, e2el:20000 (repeatable)")
    g.add_argument("--goodput-target", type=float, default=None,
                   help="fraction of requests that must meet the SLOs; a sweep reports the highest rate keeping it")
    g.add_argument("--out", type=Path, default=None, help="run folder (default runs/<timestamp>-<name>/)")
    g.add_argument("--runs-dir", type=Path, default=Path("runs"), help="where default run folders go")
    g.add_argument("--no-plots", action="store_true", help="skip the PNG plots")
    g.add_argument("--no-progress", action="store_true", help="no progress bar")
    g.add_argument("--metrics-interval", type=float, default=0.5, help="seconds between /metrics polls")
    g.add_argument("--json", action="store_true",
                   help="print the summary as one JSON object on the last line (for --rate sweeps: the sweep "
                        "object, each rate's summary under 'runs')")


def _config(args: argparse.Namespace, time_scale: float, engine_nice: int | None = None) -> Any:
    """The load test's config from the arguments; ``engine_nice``: the launched spec's, the generator's default."""
    from cluster.loadtest import ClientConfig, LoadTestConfig, ReplayConfig, WorkloadSlice, parse_slos
    from cluster.loadtest.priority import ENGINE_NICE_DEFAULT

    try:
        slos = parse_slos(args.slo)
        return LoadTestConfig(
            name=args.name or args.trace.stem,
            slice=WorkloadSlice(start_s=args.start, duration_s=args.duration, max_requests=args.max_requests,
                                jitter_buckets=args.jitter_buckets),
            replay=ReplayConfig(speed=args.speed, concurrency=args.concurrency,
                                metrics_interval_s=args.metrics_interval,
                                generator_nice=next(n for n in (args.generator_nice, engine_nice,
                                                                ENGINE_NICE_DEFAULT) if n is not None)),
            client=ClientConfig(model=args.model, time_scale=time_scale, request_timeout_s=args.request_timeout,
                                prompt_format=args.prompt_format),
            rates=tuple(args.rate), retime=args.retime, burstiness=args.burstiness, slos=slos,
            goodput_target=args.goodput_target, seed=args.seed, progress=not args.no_progress,
            plots=not args.no_plots)
    except ValueError as e:
        raise SystemExit(f"error: {e}") from None


def run(args: argparse.Namespace) -> int:
    from cluster.loadtest import ReadOptions, TargetError, TraceError, print_result, read_trace, run_loadtest, run_sync

    try:
        trace = read_trace(args.trace, args.format,
                           ReadOptions(block_size=args.block_size, strict=args.strict, seed=args.seed))
    except TraceError as e:
        raise SystemExit(f"error: {e}") from None
    out = console()
    if trace.malformed_count:
        out.print(f"warning: {trace.malformed_count} malformed line(s) in {trace.source} skipped; first: "
                  + "; ".join(f"line {m.line}: {m.reason}" for m in trace.malformed[:3]))
    handle: Any = None
    engine_nice: int | None = None
    if args.config is not None:
        from config import ConfigError, load_cluster

        try:
            spec = load_cluster(args.config)
        except ConfigError as e:
            raise SystemExit(f"error: {e}") from None
        if args.time_scale is not None:
            if args.time_scale <= 0:
                raise SystemExit("error: --time-scale must be positive")
            spec = spec.model_copy(update={"time_scale": args.time_scale})
        from cluster.launch import launch

        out.print(f"launching cluster {spec.name} ({len(spec.engines())} engines, time scale {spec.time_scale})")
        try:
            handle = launch(spec, address=args.address)
        except Exception as e:  # Ray and start-up errors come in many types; all mean the same here
            raise SystemExit(f"error: cluster {spec.name} did not start: {type(e).__name__}: {e}") from None
        url, time_scale, engine_nice = str(handle.router_url), spec.time_scale, spec.engine_nice
    else:
        url, time_scale = args.target, args.time_scale if args.time_scale is not None else 1.0
    try:
        config = _config(args, time_scale, engine_nice)
        folder = args.out
        if folder is not None:
            folder.mkdir(parents=True, exist_ok=True)
        result = run_sync(run_loadtest(url, trace, config, out_root=args.runs_dir, folder=folder))
    except (TargetError, ValueError) as e:
        raise SystemExit(f"error: {e}") from None
    finally:
        if handle is not None:
            handle.shutdown()
    print_result(out, result)
    if args.json:
        print_json(result.summary)
    return 0


register(Command("loadtest", "replay a trace against a target URL or a launched cluster; vLLM-standard metrics",
                 configure, run))

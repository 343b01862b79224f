"""``demo``: the README's main job: launch a small cluster, replay a slice of a real trace, report.

Launches ``config/presets/demo-4xh100-llama8b.yaml`` (four emulated H100s serving Llama-3.1-8B behind
the router) on an embedded local Ray cluster, replays a slice of the ShareGPT trace behind the published
vLLM runs (or the bundled synthetic workload when ../shared is absent) with a progress bar, prints
TTFT, TPOT, throughput and step lag, and shuts everything down.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from cluster.cli import Command, register
from cluster.cli.output import console, print_json
from config import PRESETS_DIR, load_cluster

DEMO_PRESET = PRESETS_DIR / "demo-4xh100-llama8b.yaml"


def configure(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", type=Path, default=DEMO_PRESET, help="cluster spec (default: the demo preset)")
    p.add_argument("--trace", type=Path, default=None, help="trace to replay (default: ShareGPT slice)")
    p.add_argument("--duration", type=float, default=15.0, help="trace seconds to replay (default 15)")
    p.add_argument("--time-scale", type=float, default=2.0,
                   help="wall seconds per emulated second (default 2.0: 15 trace seconds take ~30 s and leave "
                        "this host headroom to keep step lag low)")
    p.add_argument("--address", help="attach to this Ray cluster instead of starting an embedded one")
    p.add_argument("--json", action="store_true", help="print the summary as one JSON object on the last line")


def run(args: argparse.Namespace) -> int:
    from cluster.launch import launch
    from cluster.loadtest.session import replay_slice

    out = console()
    spec = load_cluster(args.config)
    spec = spec.model_copy(update={"time_scale": args.time_scale})
    out.print(f"[bold]kvmesh demo[/bold]: {spec.description or spec.name}, time scale {spec.time_scale}")
    handle = launch(spec, address=args.address, progress=lambda m: out.print(f"[dim]{m}[/dim]"))
    try:
        summary = replay_slice(handle.router_url, args.trace, duration_s=args.duration, max_requests=None,
                               time_scale=spec.time_scale, name="demo", console=out)
    finally:
        handle.shutdown()
    if args.json:
        print_json(summary)
    return 0


register(Command("demo", "the main job: launch a small cluster, replay a slice of a real trace, report",
                 configure, run))

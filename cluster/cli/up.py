"""``up``: launch a cluster from a spec and serve until interrupted."""

from __future__ import annotations

import argparse
import signal
import threading
from pathlib import Path

from rich.table import Table

from cluster.cli import Command, register
from cluster.cli.output import console, print_json
from config import ConfigError, load_cluster


def configure(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", type=Path, required=True, help="cluster spec YAML (e.g. config/presets/...)")
    p.add_argument("--address", help="attach to this Ray cluster instead of starting an embedded one")
    p.add_argument("--json", action="store_true", help="print the router and engine URLs as JSON once up")


def run(args: argparse.Namespace) -> int:
    from cluster.launch import launch

    out = console()
    try:
        spec = load_cluster(args.config)
    except ConfigError as e:
        raise SystemExit(f"error: {e}") from None
    handle = launch(spec, address=args.address, progress=lambda m: out.print(f"[dim]{m}[/dim]"))
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    try:
        t = Table(title=f"{spec.name}: up in {handle.startup_s:.1f} s")
        for col in ("engine", "role", "region", "node", "hardware", "TP", "KV blocks", "URL"):
            t.add_column(col)
        for name, d in handle.engines.items():
            t.add_row(name, d["role"], d["region"], d["node"], d["hardware"], str(d["tp"]), str(d["num_blocks"]),
                      d["url"])
        out.print(t)
        out.print(f"router: [bold]{handle.router_url}[/bold]  (OpenAI API; Ctrl-C stops the cluster)")
        if args.json:
            print_json({"router_url": handle.router_url, "engines": handle.engine_urls,
                        "startup_s": round(handle.startup_s, 2)})
        stop.wait()
    finally:
        out.print("shutting down")
        handle.shutdown()
    return 0


register(Command("up", "launch a cluster from a spec and serve until interrupted", configure, run))

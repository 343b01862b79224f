"""``scenario list | run NAME | run all``: each claim of the background reading beside the emulated figure.

``run all --json`` prints one JSON object (every claim, its figure and verdict, then each scenario's
details) as the last stdout line; ``--out DIR`` also writes it to ``DIR/scenarios.json``, which
``run_cluster.py report DIR`` renders as HTML.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from rich.table import Table

from cluster.cli import Command, register
from cluster.cli.output import console, print_json


def configure(p: argparse.ArgumentParser) -> None:
    sub = p.add_subparsers(dest="action", required=True, metavar="ACTION")
    sub.add_parser("list", help="every scenario with its claims")
    r = sub.add_parser("run", help="run one scenario by name, or all of them")
    r.add_argument("name", help="a scenario name (see `scenario list`) or 'all'")
    r.add_argument("--quick", action="store_true", help="fewer rows (seconds for the fast scenarios)")
    r.add_argument("--skip-slow", action="store_true",
                   help="with 'all': leave out the scenarios that launch clusters on Ray")
    r.add_argument("--seed", type=int, default=0)
    r.add_argument("--output-tokens", type=int, default=None, help="output length, where a scenario takes one")
    r.add_argument("--time-scale", type=float, default=None, help="wall seconds per emulated second (live runs)")
    r.add_argument("--profiles", default=None, help="comma-separated subset of a scenario's profiles")
    r.add_argument("--no-load", action="store_true", help="skip a scenario's rate sweep under load")
    r.add_argument("--out", type=Path, default=None, help="also write DIR/scenarios.json (for `report DIR`)")
    r.add_argument("--json", action="store_true", help="print the result as one JSON object on the last line")


def run(args: argparse.Namespace) -> int:
    from cluster.scenarios import SCENARIOS, ScenarioContext, load_all, run_one, summary

    load_all()
    out = console()
    if args.action == "list":
        for sc in SCENARIOS.values():
            out.print(f"[bold]{sc.name}[/bold]{' (slow: launches clusters)' if sc.slow else ''}: {sc.help}")
            for c in sc.claims:
                out.print(f"   - \"{c.quote}\" ({c.source}: {c.section})")
        return 0
    if args.name != "all" and args.name not in SCENARIOS:
        out.print(f"[red]unknown scenario {args.name!r}; known: {', '.join(sorted(SCENARIOS))}, all[/red]")
        return 2
    chosen = ([s for s in SCENARIOS.values() if not (args.skip_slow and s.slow)] if args.name == "all"
              else [SCENARIOS[args.name]])
    options = {"output_tokens": args.output_tokens, "time_scale": args.time_scale, "load": not args.no_load,
               "profiles": tuple(args.profiles.split(",")) if args.profiles else None}
    ctx = ScenarioContext(quick=args.quick, seed=args.seed, options=options,
                          progress=lambda m: out.print(f"[dim]{m}[/dim]"))
    results = []
    for sc in chosen:
        out.print(f"[bold]{sc.name}[/bold] ...")
        results.append(run_one(sc, ctx))
        if args.out:  # after every scenario, so a long run that is cut short leaves what it finished
            args.out.mkdir(parents=True, exist_ok=True)
            (args.out / "scenarios.json").write_text(json.dumps(summary(results), indent=1, default=str))
    doc = summary(results)
    t = Table(title="claims against the emulator")
    for col in ("scenario", "claim", "emulated", "verdict"):
        t.add_column(col, overflow="fold")
    for c in doc["claims"]:
        t.add_row(c["scenario"], f"{c['text']} ({c['source']})", c["figure"], c["verdict"])
    out.print(t)
    if args.json:
        print_json(doc)
    return 0


register(Command("scenario", "claims of the background reading against the emulator (list | run NAME | run all)",
                 configure, run))

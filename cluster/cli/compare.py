"""``compare``: load-test runs side by side — a table of their summaries and overlaid latency CDFs."""

from __future__ import annotations

import argparse
from datetime import datetime
from pathlib import Path

from cluster.cli import Command, register
from cluster.cli.output import console, print_json


def configure(p: argparse.ArgumentParser) -> None:
    p.add_argument("runs", nargs="+", type=Path, metavar="RUN", help="run folders (a sweep folder adds each rate)")
    p.add_argument("--out", type=Path, default=None,
                   help="folder for the overlaid CDF PNGs (default runs/<timestamp>-compare/)")
    p.add_argument("--no-plots", action="store_true", help="print the table only")
    p.add_argument("--json", action="store_true", help="print the compared figures as one JSON object last")


def run(args: argparse.Namespace) -> int:
    from cluster.loadtest.report import compare_rows, load_runs, plot_compare, print_compare

    try:
        runs = load_runs(args.runs)
    except (FileNotFoundError, ValueError) as e:
        raise SystemExit(f"error: {e}") from None
    out = console()
    print_compare(out, runs)
    written: list[Path] = []
    if not args.no_plots:
        folder = args.out or Path("runs") / f"{datetime.now():%Y%m%d-%H%M%S}-compare"
        written = plot_compare(folder, runs)
        out.print(f"overlaid CDFs: {', '.join(str(p) for p in written)}")
    if args.json:
        print_json({"runs": [label for label, _, _ in runs],
                    "rows": {label: vals for label, vals in compare_rows(runs)},
                    "plots": [str(p) for p in written]})
    return 0


register(Command("compare", "set load-test runs side by side: a table and overlaid latency CDFs", configure, run))

"""``report RUN [--open]``: one static HTML page for a run folder (load test, sweep or scenario suite)."""

from __future__ import annotations

import argparse
import webbrowser
from pathlib import Path

from cluster.cli import Command, register
from cluster.cli.output import console


def configure(p: argparse.ArgumentParser) -> None:
    p.add_argument("run", type=Path, help="a run folder (summary.json and/or scenarios.json, PNG plots)")
    p.add_argument("--open", action="store_true", help="open the page in the default browser")


def run(args: argparse.Namespace) -> int:
    from cluster.report.html import ReportError, write_report

    out = console()
    try:
        page = write_report(args.run)
    except ReportError as e:
        out.print(f"[red]{e}[/red]")
        return 2
    out.print(f"report: {page}")
    if args.open:
        webbrowser.open(page.resolve().as_uri())
    return 0


register(Command("report", "one static HTML report for a run folder (report RUN [--open])", configure, run))

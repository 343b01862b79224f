"""``scenario NAME``: run a registered experiment (launches its clusters, drives them, reports)."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from rich.table import Table

from cluster.cli import Command, register
from cluster.cli.output import console, print_json


def configure(p: argparse.ArgumentParser) -> None:
    from cluster.scenarios import SCENARIOS, load_all

    load_all()
    p.add_argument("name", choices=sorted(SCENARIOS), help="the scenario")
    p.add_argument("--quick", action="store_true", help="fewer rows, no long load sweep")
    p.add_argument("--output-tokens", type=int, default=128, help="output length of each request")
    p.add_argument("--time-scale", type=float, default=5.0,
                   help="wall seconds per emulated second (above 1 keeps real overheads small in emulated time)")
    p.add_argument("--profiles", default=None, help="comma-separated subset of the scenario's profiles")
    p.add_argument("--no-load", action="store_true", help="skip the rate sweep under concurrent load")
    p.add_argument("--out", type=Path, default=None, help="also write the result JSON here")
    p.add_argument("--json", action="store_true", help="print the result as one JSON object on the last line")


def run(args: argparse.Namespace) -> int:
    from cluster.scenarios import SCENARIOS

    out = console()
    sc = SCENARIOS[args.name]
    def checkpoint(partial: dict[str, object]) -> None:
        if args.out:
            args.out.write_text(json.dumps(partial, indent=1))

    result = sc.run(quick=args.quick, output=args.output_tokens, time_scale=args.time_scale,
                    profiles=tuple(args.profiles.split(",")) if args.profiles else None, load=not args.no_load,
                    progress=lambda m: out.print(f"[dim]{m}[/dim]"), checkpoint=checkpoint)
    for prof in result.get("profiles", []):
        t = Table(title=f"{prof['profile']}: {result['output_tokens']} output tokens, emulated ms "
                        "(predicted | measured)")
        for col in ("mode", "prompt", "TTFT", "transfer", "end-to-end", "TTFT error", "transfer error", "e2e error"):
            t.add_column(col, justify="right" if col != "mode" else "left")
        for r in prof["rows"]:
            p, m = r["predicted"], r["measured"]
            t.add_row(r["mode"], f"{r['prompt']:,}", f"{p['ttft_ms']:,.1f} | {m['ttft_ms']:,.1f}",
                      f"{p['transfer_ms']:,.1f} | {m['transfer_ms']:,.1f}",
                      f"{p['e2e_ms']:,.1f} | {m['e2e_ms']:,.1f}",
                      *(f"{100 * e:+.1f}%" if (e := r["error"].get(k)) is not None else "-"
                        for k in ("ttft_ms", "transfer_ms", "e2e_ms")))
        out.print(t)
        for k, v in prof["crossover"].items():
            out.print(f"crossover {k}: analytic {v['analytic_prompt_tokens']}, measured {v['measured_prompt_tokens']}")
        for row in prof.get("load", []):
            out.print(f"load {row['config']} @ {row['rate']} req/s: ITL p50 {row['itl_ms']['p50']} p99 "
                      f"{row['itl_ms']['p99']} ms, TTFT p99 {row['ttft_ms']['p99']} ms")
    if args.out:
        args.out.write_text(json.dumps(result, indent=1))
    if args.json:
        print_json(result)
    return 0


register(Command("scenario", "run a registered experiment (e.g. disagg-crossover)", configure, run))

"""``calibrate``: fit the cost model on measured step times and print the error per group."""

from __future__ import annotations

import argparse
from pathlib import Path

from rich.table import Table

from actors.calibration import DEFAULT_DATA, FitResult, GroupError, current_errors, fit_all, load_points, write_presets
from cluster.cli import Command, register
from cluster.cli.output import console, print_json
from config.catalog import default_catalog

MEDIAN_BOUND = 0.12
P90_BOUND = 0.30


def configure(p: argparse.ArgumentParser) -> None:
    p.add_argument("--data", type=Path, default=DEFAULT_DATA, help="measurements (Splitwise perf_model.csv)")
    p.add_argument("--write", action="store_true", help="write the fitted values into config/presets/hardware.yaml")
    p.add_argument("--no-fit", action="store_true", help="report the error of the values now in the presets")
    p.add_argument("--json", action="store_true", help="print the result as one JSON object on the last line")


def _pct(x: float) -> str:
    return f"{100 * x:.1f}%"


def run(args: argparse.Namespace) -> int:
    if not args.data.exists():
        raise SystemExit(f"error: no measurements at {args.data} (pass --data; the shared folder holds them)")
    cat = default_catalog()
    groups = load_points(args.data)
    fits: list[FitResult] = []
    if args.no_fit:
        errors: list[GroupError] = current_errors(cat, groups)
    else:
        fits = fit_all(cat, groups)
        errors = [e for f in fits for e in f.errors]
    out = console()
    t = Table(title="cost model against measured medians: absolute percentage error")
    for col in ("model", "hardware", "TP", "points (excluded)", "prefill median", "prefill p90",
                "decode median", "decode p90", "within bounds"):
        t.add_column(col, justify="left" if col in ("model", "hardware") else "right")
    for e in errors:
        t.add_row(e.model, e.hardware, str(e.tp), f"{e.points} ({e.excluded})", _pct(e.prefill_median),
                  _pct(e.prefill_p90), _pct(e.decode_median), _pct(e.decode_p90),
                  "yes" if e.within(MEDIAN_BOUND, P90_BOUND) else "NO")
    out.print(t)
    for f in fits:
        eff = f.efficiency
        out.print(f"{f.hardware}: compute {eff.compute}, memory {eff.memory}, link {eff.link} "
                  f"(beyond {eff.knee_tokens} tokens: {eff.link_large}), "
                  f"overhead per layer {eff.layer_overhead_us} us, "
                  f"per sequence and layer {eff.seq_layer_overhead_us} us, "
                  f"all-reduce hop {eff.allreduce_latency_us} us")
    if args.write and fits:
        write_presets(fits)
        out.print("wrote the fitted values into config/presets/hardware.yaml")
    ok = all(e.within(MEDIAN_BOUND, P90_BOUND) for e in errors)
    if args.json:
        print_json({
            "bounds": {"median": MEDIAN_BOUND, "p90": P90_BOUND},
            "all_within_bounds": ok,
            "groups": [{"model": e.model, "hardware": e.hardware, "tp": e.tp, "points": e.points,
                        "excluded": e.excluded, "prefill_median_ape": round(e.prefill_median, 4),
                        "prefill_p90_ape": round(e.prefill_p90, 4), "decode_median_ape": round(e.decode_median, 4),
                        "decode_p90_ape": round(e.decode_p90, 4)} for e in errors],
            "fitted": {f.hardware: f.efficiency.model_dump() for f in fits},
        })
    return 0


register(Command("calibrate", "fit the cost model on measured step times; print the error per group",
                 configure, run))

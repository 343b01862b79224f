"""``calibrate``: fit the cost model's op rooflines on vLLM's kernel tables; print the error per
(GPU, op family), and the Splitwise DGX step times as a report (2023 software: no bound)."""

from __future__ import annotations

import argparse
from pathlib import Path

from rich.table import Table

from actors.calibration import (
    FP8_GEMM_BF16_BOUND,
    FP8_SPEEDUP_RANGES,
    OP_DATA,
    OP_TABLE_GPUS,
    OpError,
    OpFitResult,
    current_op_errors,
    fit_hardware_ops,
    fp8_gemm_speedup,
    write_presets,
)
from actors.splitwise_report import DEFAULT_DATA, load_points, splitwise_report
from cluster.cli import Command, register
from cluster.cli.output import console, print_json
from config.catalog import default_catalog

MEDIAN_BOUND = 0.10
"""Median absolute op-time error allowed per (GPU, op family) on the op tables."""


def configure(p: argparse.ArgumentParser) -> None:
    p.add_argument("--data", type=Path, default=OP_DATA,
                   help="op tables (aiconfigurator_vllm/data: <gpu>/<op>/vllm/<version>/*.parquet)")
    p.add_argument("--splitwise", type=Path, default=DEFAULT_DATA,
                   help="Splitwise perf_model.csv, reported only (skipped when absent)")
    p.add_argument("--hardware", action="append", choices=sorted(OP_TABLE_GPUS),
                   help="fit only this GPU (repeatable; default: every GPU with tables)")
    p.add_argument("--write", action="store_true", help="write the fitted values into config/presets/hardware.yaml")
    p.add_argument("--no-fit", action="store_true", help="report the error of the values now in the presets")
    p.add_argument("--json", action="store_true", help="print the result as one JSON object on the last line")


def _pct(x: float) -> str:
    return f"{100 * x:.1f}%"


def run(args: argparse.Namespace) -> int:
    if not args.data.is_dir():
        raise SystemExit(f"error: no op tables at {args.data} (pass --data; the shared folder holds them)")
    cat = default_catalog()
    # Sorted: a GPU that borrows a family (EXCLUDED_TABLES) comes after the one it borrows from.
    names = args.hardware or sorted(OP_TABLE_GPUS)
    missing = [n for n in names if not (args.data / OP_TABLE_GPUS[n]).is_dir()]
    if missing:
        raise SystemExit(f"error: no op tables for {', '.join(missing)} under {args.data}")
    out = console()
    fits: list[OpFitResult] = []
    errors: list[OpError] = []
    for name in names:
        if args.no_fit:
            errors.extend(current_op_errors(cat, name, args.data))
        else:
            fit = fit_hardware_ops(cat, name, args.data, {f.hardware: f.efficiency for f in fits})
            fits.append(fit)
            errors.extend(fit.errors)
    t = Table(title="op rooflines against vLLM's measured kernel times: absolute percentage error")
    for col in ("hardware", "op family", "table", "rows", "median", "p90", f"median <= {_pct(MEDIAN_BOUND)}"):
        t.add_column(col, justify="left" if col in ("hardware", "op family", "table") else "right")
    for e in errors:
        t.add_row(e.hardware, e.family, e.source, str(e.rows), _pct(e.median), _pct(e.p90),
                  "excluded" if e.excluded else "yes" if e.within(MEDIAN_BOUND) else "NO")
    out.print(t)
    for e in errors:
        if e.excluded:
            out.print(f"{e.hardware} {e.family}: {e.excluded}")
    speedups = {name: fp8_gemm_speedup(args.data / OP_TABLE_GPUS[name]) for name in names}
    sp = Table(title="fp8 GEMM table against the bf16 one on the same shapes (time bf16 / fp8; a tuned fp8 "
                     "kernel is faster: > 1)")
    ranges = sorted({r for v in speedups.values() for r in v}, key=list(FP8_SPEEDUP_RANGES).index)
    for col in ("hardware", *ranges):
        sp.add_column(col, justify="left" if col == "hardware" else "right")
    for name, v in speedups.items():
        if v:
            sp.add_row(name, *(f"{v[r]:.2f}x" if r in v else "-" for r in ranges))
    out.print(sp)
    for name, v in speedups.items():
        if v and min(v.values()) < 1.0:
            bound = ("the cost model takes min(fp8, bf16) per GEMM (FP8_GEMM_BF16_BOUND)" if name in FP8_GEMM_BF16_BOUND
                     else "the fp8 fit follows a kernel slower than a tuned one")
            out.print(f"{name}: its fp8 GEMM table is no faster than its bf16 one somewhere ({v}): {bound}")
    report = []
    if args.splitwise.exists():
        report = splitwise_report(cat, load_points(args.splitwise))
        s = Table(title="report: Splitwise DGX step times (2023 serving stack, eager; no bound) against the model")
        for col in ("model", "hardware", "TP", "points", "prefill median |err|", "prefill bias", "decode median |err|",
                    "decode bias"):
            s.add_column(col, justify="left" if col in ("model", "hardware") else "right")
        for g in report:
            s.add_row(g.model, g.hardware, str(g.tp), str(g.points), _pct(g.prefill_median), f"{g.prefill_bias:+.1%}",
                      _pct(g.decode_median), f"{g.decode_bias:+.1%}")
        out.print(s)
    if args.write and fits:
        write_presets(fits)
        out.print("wrote the fitted values into config/presets/hardware.yaml")
    ok = all(e.within(MEDIAN_BOUND) for e in errors)
    if args.json:
        print_json({
            "bound": {"median": MEDIAN_BOUND},
            "all_within_bound": ok,
            "ops": [{"hardware": e.hardware, "family": e.family, "table": e.source, "rows": e.rows,
                     "median_ape": round(e.median, 4), "p90_ape": round(e.p90, 4),
                     **({"excluded": e.excluded} if e.excluded else {})} for e in errors],
            "splitwise_report": [{"model": g.model, "hardware": g.hardware, "tp": g.tp, "points": g.points,
                                  "prefill_median_ape": round(g.prefill_median, 4),
                                  "prefill_bias": round(g.prefill_bias, 4),
                                  "decode_median_ape": round(g.decode_median, 4),
                                  "decode_bias": round(g.decode_bias, 4)} for g in report],
            "fitted_on": {f.hardware: f.efficiency.fitted_on for f in fits},
            "fp8_gemm_speedup": {name: v for name, v in speedups.items() if v},
        })
    return 0


register(Command("calibrate", "fit the cost model's op rooflines on vLLM kernel tables; print the error per "
                              "(GPU, op family)", configure, run))

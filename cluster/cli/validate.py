"""``validate``: replay measured vLLM serving runs on the emulator's engine; predicted vs measured.

See ``cluster.validation`` for how the runs were measured and what is assumed.
"""

from __future__ import annotations

import argparse
import re
import subprocess
import sys
from collections import Counter
from pathlib import Path

from rich.table import Table

from cluster.cli import Command, register
from cluster.cli.output import console, print_json
from cluster.validation import (
    DEFAULT_CSV,
    IMPLAUSIBLE_SHARE,
    PRIMARY_HARNESS,
    QUICK_PER_GROUP,
    REPO_ROOT,
    CaseResult,
    default_jobs,
    validate,
)
from config.catalog import default_catalog
from config.errors import ConfigError

TTFT_BOUND = 0.20
TPOT_BOUND = 0.10


def configure(p: argparse.ArgumentParser) -> None:
    p.add_argument("--csv", type=Path, default=DEFAULT_CSV,
                   help="measured runs (aiconfigurator's silicon_sample.csv; default: the shared folder's)")
    p.add_argument("--quick", action="store_true", help=f"{QUICK_PER_GROUP} rows per (model, GPU) group")
    p.add_argument("--per-group", type=int, default=QUICK_PER_GROUP, help="rows per group with --quick")
    p.add_argument("--rounds", type=int, default=None,
                   help="measured rounds of C requests per row (default: the row's harness protocol, "
                        "cluster.benchmark_protocol)")
    p.add_argument("--match", metavar="REGEX", help="only rows whose id, model or system this finds "
                                                      "(e.g. 'Llama-3.1-70B.*h200')")
    p.add_argument("--jobs", type=int, default=None,
                   help="worker processes (default: one per usable core); rows are independent, figures the same")
    p.add_argument("--json", action="store_true", help="print the result as one JSON object on the last line")


def _pct(x: float) -> str:
    return f"{100 * x:+.1f}%"


def _commit() -> str:
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO_ROOT, capture_output=True,
                              text=True, timeout=5).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return ""


def _row_json(r: CaseResult) -> dict[str, object]:
    row = r.case.row
    return {"id": row.id, "model": r.case.model, "hardware": r.case.hardware, "tp": r.case.tp,
            "concurrency": r.case.concurrency, "isl": row.isl, "osl": row.osl, "vllm": row.backend_version,
            "ttft_measured_ms": round(row.silicon_ttft_ms, 3), "ttft_predicted_ms": round(r.ttft_ms, 3),
            "ttft_error": round(r.ttft_error, 4), "ttft_queue_ms": round(r.ttft_queue_ms, 3),
            "tpot_measured_ms": round(row.silicon_tpot_ms, 4),
            "tpot_predicted_ms": round(r.tpot_ms, 4), "tpot_error": round(r.tpot_error, 4),
            "kv_blocks": r.num_blocks, "preemptions": r.preemptions, "steps": r.steps,
            "implied_tensor_share": round(r.case.implied_share, 3), "implausible": r.case.implausible,
            "wall_s": round(r.wall_s, 3)}


def run(args: argparse.Namespace) -> int:
    out = console()
    if not args.csv.exists():
        msg = (f"skipped: no measured runs at {args.csv} (the shared folder ../shared is absent; "
               "pass --csv to use another copy)")
        out.print(msg)
        if args.json:
            print_json({"skipped": True, "reason": msg})
        return 0
    cat = default_catalog()

    def progress(r: CaseResult) -> None:
        row = r.case.row
        print(f"  {row.id}: TTFT {r.ttft_ms:,.1f} (queued {r.ttft_queue_ms:,.1f}) vs {row.silicon_ttft_ms:,.1f} ms "
              f"({_pct(r.ttft_error)}), "
              f"TPOT {r.tpot_ms:.2f} vs {row.silicon_tpot_ms:.2f} ms ({_pct(r.tpot_error)}) "
              f"[{r.wall_s:.1f} s]", file=sys.stderr, flush=True)

    jobs = args.jobs if args.jobs is not None else default_jobs()
    try:
        res = validate(args.csv, cat, quick=args.quick, rounds=args.rounds, per_group=args.per_group,
                       match=args.match, progress=progress,
                       jobs=jobs)
    except ConfigError as e:
        raise SystemExit(f"error: {e}") from None
    except re.error as e:
        raise SystemExit(f"error: --match is not a regular expression: {e}") from None
    t = Table(title="predicted against measured mean TTFT and TPOT per row (error: predicted / measured - 1)")
    for col in ("row", "model", "GPU", "TP", "C", "isl/osl", "TTFT meas ms", "TTFT pred ms", "TTFT err",
                "TPOT meas ms", "TPOT pred ms", "TPOT err", "preempt"):
        t.add_column(col, justify="left" if col in ("row", "model", "GPU") else "right")
    for r in res.results:
        row = r.case.row
        t.add_row(row.id, r.case.model, r.case.hardware, str(r.case.tp), str(r.case.concurrency),
                  f"{row.isl}/{row.osl}", f"{row.silicon_ttft_ms:,.1f}", f"{r.ttft_ms:,.1f}", _pct(r.ttft_error),
                  f"{row.silicon_tpot_ms:.2f}", f"{r.tpot_ms:.2f}", _pct(r.tpot_error), str(r.preemptions))
    out.print(t)
    groups = res.groups
    for harness in dict.fromkeys(s.harness for s in groups):
        primary = harness == PRIMARY_HARNESS
        title = ("|error| per (model, GPU) group, aiconfigurator's benchmark (the bounds apply: TTFT median <= "
                 f"{TTFT_BOUND:.0%}, TPOT median <= {TPOT_BOUND:.0%})" if primary else
                 f"|error| per (model, GPU) group, harness {harness} (reported apart: its protocol is not known)")
        g = Table(title=f"{title}; bias = median signed error")
        for col in ("model", "GPU", "vLLM", "rows", "TTFT median", "TTFT p90", "TTFT bias", "TPOT median",
                    "TPOT p90", "TPOT bias", "within", "implied peak", "implausible"):
            g.add_column(col, justify="left" if col in ("model", "GPU") else "right")
        for s in (s for s in groups if s.harness == harness):
            g.add_row(s.model, s.system, s.versions, str(s.rows), f"{s.ttft_median:.1%}", f"{s.ttft_p90:.1%}",
                      _pct(s.ttft_bias), f"{s.tpot_median:.1%}", f"{s.tpot_p90:.1%}", _pct(s.tpot_bias),
                      "yes" if s.within(TTFT_BOUND, TPOT_BOUND) else "NO", f"{s.implied_share_median:.0%}",
                      str(s.implausible))
        out.print(g)
    out.print(f"implied peak: median share of the GPUs' dense tensor peak that a closed loop at the measured "
              f"figures needs (cluster.validation.implied_tensor_share); implausible: rows needing more than "
              f"{IMPLAUSIBLE_SHARE:.0%}, which were not measured as the replay assumes")
    reasons = Counter(s.reason for s in res.skipped)
    out.print(f"{len(res.results)} rows replayed, {len(res.skipped)} vLLM rows skipped, "
              f"in {res.wall_s:.1f} s (commit {_commit() or 'unknown'}):")
    for reason, n in reasons.most_common():
        out.print(f"  skipped {n}: {reason}")
    if args.json:
        print_json({
            "commit": _commit(), "csv": str(args.csv), "quick": bool(args.quick),
            "bounds": {"ttft_median": TTFT_BOUND, "tpot_median": TPOT_BOUND},
            "all_within_bounds": bool(groups) and all(s.within(TTFT_BOUND, TPOT_BOUND) for s in groups),
            "primary_harness": PRIMARY_HARNESS,
            "primary_within_bounds": any(s.primary for s in groups) and all(
                s.within(TTFT_BOUND, TPOT_BOUND) for s in groups if s.primary),
            "rows_replayed": len(res.results), "rows_skipped": len(res.skipped),
            "wall_s": round(res.wall_s, 2), "jobs": jobs,
            "groups": [{"model": s.model, "gpu": s.system, "vllm": s.versions, "harness": s.harness,
                        "rows": s.rows,
                        "implied_tensor_share_median": round(s.implied_share_median, 3),
                        "implausible_rows": s.implausible,
                        "ttft_median_ape": round(s.ttft_median, 4), "ttft_p90_ape": round(s.ttft_p90, 4),
                        "ttft_bias": round(s.ttft_bias, 4), "tpot_median_ape": round(s.tpot_median, 4),
                        "tpot_p90_ape": round(s.tpot_p90, 4), "tpot_bias": round(s.tpot_bias, 4)}
                       for s in groups],
            "rows": [_row_json(r) for r in res.results],
            "skipped": [{"id": s.row.id, "reason": s.reason} for s in res.skipped],
        })
    return 0


register(Command("validate", "replay measured vLLM serving runs (silicon_sample.csv) on the engine; "
                             "predicted vs measured TTFT and TPOT", configure, run))

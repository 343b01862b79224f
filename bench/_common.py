"""Helpers shared by benchmarks: argument parsing and the final JSON line."""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

import numpy as np


def parser(description: str) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=description)
    p.add_argument("--quick", action="store_true", help="a smaller run that ends within a minute")
    return p


def pct(values: Any) -> dict[str, float]:
    """p50 / p99 / max of a sequence, rounded to microseconds (the unit of every value is the caller's)."""
    a = np.asarray(values, dtype=float)
    if a.size == 0:
        return {"p50": float("nan"), "p99": float("nan"), "max": float("nan"), "n": 0}
    return {"p50": round(float(np.percentile(a, 50)), 4), "p99": round(float(np.percentile(a, 99)), 4),
            "max": round(float(a.max()), 4), "n": int(a.size)}


def emit(result: dict[str, Any]) -> None:
    """The benchmark's result: one JSON object, the last line of output."""
    sys.stdout.write(json.dumps(result, separators=(",", ":")) + "\n")
    sys.stdout.flush()

"""Printing: rich tables for people, one JSON object as the last line for programs."""

from __future__ import annotations

import json
import sys
from typing import Any

from rich.console import Console


def console() -> Console:
    """Stdout console; wide when stdout is not a terminal so tables are not folded in logs."""
    width = None if sys.stdout.isatty() else 160
    return Console(file=sys.stdout, highlight=False, width=width)


def print_json(obj: Any) -> None:
    """The machine-readable result: one JSON object on the last line of stdout."""
    sys.stdout.write(json.dumps(obj, separators=(",", ":"), default=str) + "\n")
    sys.stdout.flush()


def fmt_ms(x: float) -> str:
    return f"{x:,.1f}"

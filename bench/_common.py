"""Helpers shared by benchmarks: argument parsing and the final JSON line."""

from __future__ import annotations

import argparse
import asyncio
import cProfile
import json
import sys
import time
from collections.abc import Callable
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


async def serve_profile_commands(q: Any, cmd: Any, summarize: Callable[[cProfile.Profile], Any],
                                 dump: str | None = None) -> None:
    """A profiled child process's command loop: on each command ("plain" or "profile") measure this process's
    CPU time until "stop", then answer ``(cpu_s, summarize(profile) or None)`` on ``q``; "quit" ends it. With
    ``dump``, a profile is also written there (pstats format)."""
    loop = asyncio.get_running_loop()
    while True:
        what = await loop.run_in_executor(None, cmd.get)
        if what == "quit":
            return
        prof = cProfile.Profile(time.process_time) if what == "profile" else None
        t0 = time.process_time()
        if prof is not None:
            prof.enable()
        assert await loop.run_in_executor(None, cmd.get) == "stop"
        if prof is not None:
            prof.disable()
            if dump:
                prof.dump_stats(dump)
        q.put((time.process_time() - t0, summarize(prof) if prof is not None else None))

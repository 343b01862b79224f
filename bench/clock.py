"""Emulated clock: lag of deadline sleeps at time_scale 1.0 and 0.1, beside plain asyncio.sleep overshoot.

Sleeps of 1 to 50 emulated ms (uniform, seeded) run in ``--tasks`` concurrent chains, as engines share
an actor's event loop (uvloop, as in Ray async actors). Each chain sleeps to absolute deadlines; the
baseline chains call ``asyncio.sleep(d)`` and measure how much longer than ``d`` it took.
"""

from __future__ import annotations

import asyncio
import random
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import uvloop

from actors.clock import Clock
from bench._common import emit, parser, pct


async def deadline_chain(clock: Clock, durations: list[float], lags: list[float]) -> None:
    deadline = clock.now_ms()
    for d in durations:
        deadline += d
        lags.append(await clock.sleep_until(deadline))


async def plain_chain(durations: list[float], scale: float, over: list[float]) -> None:
    for d in durations:
        wall = d / 1000.0 * scale
        t0 = time.monotonic()
        await asyncio.sleep(wall)
        over.append((time.monotonic() - t0 - wall) * 1000.0)


async def run(n: int, tasks: int, seed: int) -> dict:
    rng = random.Random(seed)
    per = max(1, n // tasks)
    plans = [[rng.uniform(1.0, 50.0) for _ in range(per)] for _ in range(tasks)]
    out: dict = {"sleeps": per * tasks, "concurrent_chains": tasks}
    for scale in (1.0, 0.1):
        for spin, label in ((1.0, "deadline"), (0.0, "deadline_nospin")):
            lags: list[float] = []
            clock = Clock(scale, spin_ms=spin)
            t0 = time.process_time()
            await asyncio.gather(*(deadline_chain(clock, p, lags) for p in plans))
            cpu = time.process_time() - t0
            out[f"{label}_lag_wall_ms_scale_{scale}"] = pct(lags)
            out[f"{label}_lag_emulated_ms_scale_{scale}"] = pct([x / scale for x in lags])
            out[f"{label}_cpu_s_scale_{scale}"] = round(cpu, 3)
        over: list[float] = []
        await asyncio.gather(*(plain_chain(p, scale, over) for p in plans))
        out[f"baseline_asyncio_sleep_overshoot_wall_ms_scale_{scale}"] = pct(over)
    for scale in (1.0, 0.1):
        base = out[f"baseline_asyncio_sleep_overshoot_wall_ms_scale_{scale}"]["p99"]
        mine = out[f"deadline_lag_wall_ms_scale_{scale}"]["p99"]
        out[f"p99_ratio_deadline_vs_baseline_scale_{scale}"] = round(mine / base, 3) if base > 0 else None
    return out


def main() -> None:
    p = parser(__doc__ or "")
    p.add_argument("--sleeps", type=int, default=None)
    p.add_argument("--tasks", type=int, default=8)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()
    n = args.sleeps or (800 if args.quick else 10_000)
    result = uvloop.run(run(n, args.tasks, args.seed))
    for k, v in result.items():
        print(f"{k}: {v}")
    emit({"bench": "clock", **result})


if __name__ == "__main__":
    main()

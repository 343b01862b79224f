"""Emulation density: what idle emulated GPUs cost, and how many tokens/s a few of them stream in time.

Figures, each beside its same-run baseline (the old feed: one WebSocket per engine, every engine's load
every 50 ms whether it changed or not: ``FeedSpec(per_actor=False, only_changes=False, heartbeat_ms=50)``):
- idle CPU: cores the worker actors and the router burn together with no request, for 64 and 256 emulated
  GPUs packed ``GPUS_PER_ACTOR`` to an actor, measured from /proc over a window after start-up settles;
  per emulated GPU too. Goal: 256 idle GPUs under 0.1 core. (The old engine's 50 ms lease-reaper timer
  is gone from the code, so the baseline understates the old cost.)
- capacity: the highest output tokens/s streamed through the router by 4 emulated GPUs with engine step
  lag p99 <= 5 ms (``bench/engine.py``'s closed-loop ladder, reused), new feed and old.
``--quick``: shorter windows and the capacity ladder's first four levels.
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import ray

from bench._common import emit, parser
from bench.engine import LAG_BOUND_MS, capacity
from cluster.launch import ClusterHandle, launch, start_local_ray
from config import ClusterSpec

GPUS_PER_ACTOR = 64
GOAL_IDLE_CORES_256 = 0.1
FEEDS: dict[str, dict[str, Any]] = {
    "new": {},
    "old": {"per_actor": False, "only_changes": False, "heartbeat_ms": 50.0},
}


def spec(gpus: int, feed: dict[str, Any], scale: float = 1.0) -> ClusterSpec:
    return ClusterSpec.model_validate({
        "name": f"bench-density-{gpus}", "time_scale": scale, "gpus_per_actor": min(gpus, GPUS_PER_ACTOR),
        "nodes": [{"name": "n0", "region": "local", "hardware": "h100-80g-sxm", "gpus": gpus,
                   "engines": [{"name": "e", "model": "llama-3.1-8b", "replicas": gpus}]}],
        "router": {"policy": "least_loaded"}, "feed": feed})


def cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of a process and its reaped children (/proc/<pid>/stat fields 14-17)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return sum(int(x) for x in fields[11:15]) / os.sysconf("SC_CLK_TCK")


def pids_of(h: ClusterHandle) -> dict[str, int]:
    out = {f"worker{i}": p for i, p in enumerate(h.worker_pids)}
    for zone, r in h.routers.items():
        out[f"router{zone}"] = int(ray.get(r.pid.remote(), timeout=30))
    return out


def idle(gpus: int, feed: dict[str, Any], settle_s: float, window_s: float) -> dict[str, Any]:
    h = launch(spec(gpus, feed))
    try:
        time.sleep(settle_s)
        pids = pids_of(h)
        c0 = {k: cpu_seconds(p) for k, p in pids.items()}
        t0 = time.monotonic()
        time.sleep(window_s)
        wall = time.monotonic() - t0
        per = {k: (cpu_seconds(p) - c0[k]) / wall for k, p in pids.items()}
        total = sum(per.values())
        return {"gpus": gpus, "actors": len(h.workers), "startup_s": round(h.startup_s, 2),
                "cores": round(total, 4), "cores_per_gpu": round(total / gpus, 6),
                "router_cores": round(sum(v for k, v in per.items() if k.startswith("router")), 4),
                "max_worker_cores": round(max(v for k, v in per.items() if k.startswith("worker")), 4)}
    finally:
        h.shutdown()


def main() -> None:
    args = parser(__doc__ or "").parse_args()
    settle, window = (3.0, 5.0) if args.quick else (5.0, 15.0)
    start_local_ray()
    result: dict[str, Any] = {"bench": "density", "gpus_per_actor": GPUS_PER_ACTOR, "lag_bound_ms": LAG_BOUND_MS,
                              "window_s": window}
    try:
        for gpus in (64, 256):
            for label, feed in FEEDS.items():
                r = idle(gpus, feed, settle, window)
                result[f"idle_{gpus}gpu_{label}"] = r
                print(f"idle {gpus} GPUs, {label} feed: {r}", flush=True)
            new, old = result[f"idle_{gpus}gpu_new"]["cores"], result[f"idle_{gpus}gpu_old"]["cores"]
            result[f"idle_{gpus}gpu_cores_ratio_new_over_old"] = round(new / old, 4) if old > 0 else None
        result["idle_256gpu_goal_cores"] = GOAL_IDLE_CORES_256
        result["idle_256gpu_goal_met"] = result["idle_256gpu_new"]["cores"] < GOAL_IDLE_CORES_256
        for label, feed in FEEDS.items():
            h = launch(spec(4, feed))
            try:
                cap = capacity(h, 4, 1.0, args.quick)
            finally:
                h.shutdown()
            result[f"capacity_4gpu_{label}"] = cap
            print(f"capacity 4 GPUs, {label} feed: {cap['sustained_rate_tok_s']} tok/s", flush=True)
        old_rate = result["capacity_4gpu_old"]["sustained_rate_tok_s"]
        result["capacity_4gpu_ratio_new_over_old"] = (
            round(result["capacity_4gpu_new"]["sustained_rate_tok_s"] / old_rate, 4) if old_rate else None)
    finally:
        ray.shutdown()
    emit(result)


if __name__ == "__main__":
    main()

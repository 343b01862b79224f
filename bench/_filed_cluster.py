"""Serve a cluster of the code as it stood when issue 20 was filed, for ``bench._filed.FiledFleet``.

Run by ``bench/_filed.py`` with the filed tree's own interpreter (``.venv-filed/bin/python``), never with this
checkout's: everything it imports beyond the standard library is the filed tree's (``cluster``, ``bench.engine``
resolve there), so the cluster is exactly what that commit's ``bench/engine.py`` measured.

Protocol, one JSON object per line: after launch it prints ``{"router_url", "engines", "router", "actors",
"startup_s"}`` (PIDs of the worker actors and routers), then answers each command read from stdin: ``reset``
(the engines' step lag starts over: ``{"ok": true}``), ``lag`` (``{"p50", "p99", "max", "worst_engine_p99"}`` in ms,
as the filed ``bench/engine.py`` took them: the worst engine's percentile, since its workers report no samples),
``quit`` (shut down, exit). Anything else gets ``{"error": ...}`` and the loop goes on.
"""

from __future__ import annotations

import argparse
import importlib
import json
import shutil
import sys
from typing import Any


def reply(obj: dict[str, Any]) -> None:
    sys.stdout.write(json.dumps(obj) + "\n")
    sys.stdout.flush()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--tree", required=True, help="the filed tree (its bench/engine.py gives the spec)")
    p.add_argument("--gpus", type=int, default=4)
    args = p.parse_args()
    sys.path[0] = args.tree  # not this script's folder: its ``bench`` package is the filed tree's
    import ray

    launch_mod: Any = importlib.import_module("cluster.launch")
    engine: Any = importlib.import_module("bench.engine")
    ray_tmp = launch_mod.start_local_ray()
    h = launch_mod.launch(engine.spec(args.gpus, 1.0))
    try:
        routers = [int(ray.get(r.pid.remote(), timeout=30)) for r in h.routers.values()]
        reply({"router_url": h.router_url, "engines": list(h.worker_pids), "router": routers,
               "actors": len(h.workers), "startup_s": round(h.startup_s, 2)})
        for line in sys.stdin:
            cmd = line.strip()
            if cmd == "quit":
                break
            if cmd == "reset":
                ray.get([w.reset_lag.remote() for w in h.workers], timeout=60)
                reply({"ok": True})
            elif cmd == "lag":
                lag = engine.lag_of(h)
                reply({"p50": lag["p50"], "p99": lag["p99"], "max": lag["max"], "worst_engine_p99": lag["p99"]})
            else:
                reply({"error": f"unknown command {cmd[:40]!r} (reset, lag, quit)"})
    finally:
        h.shutdown()
        ray.shutdown()
        shutil.rmtree(ray_tmp, ignore_errors=True)


if __name__ == "__main__":
    main()

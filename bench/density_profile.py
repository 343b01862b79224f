"""Where the CPU goes per emulated output token, end to end and per process, without Ray.

The real processes of a streamed run, each its own OS process on uvloop: the engines of one worker actor
(``actors.worker.GpuWorker``, the default layout: one HTTP server, one clock), the router
(``cluster.router.actor.RouterActor``) and the load generator (``bench/engine.py``'s closed loop, in this
process). Per process: CPU microseconds per output token, unprofiled (``time.process_time`` in each process
over the same window); then a profiled window (cProfile on process CPU time) whose own time is split by layer
(aiohttp server, aiohttp client, asyncio, JSON, engine, router, rest) with the top functions, so a change to the
hot path is measured before and after on the same harness. ``--quick``: 4 s windows.

Not a capacity figure (``bench/density.py`` measures that with Ray, the feed and the lag bound); no timed
assertion: the last line is JSON, each process's figure beside the total.
"""

from __future__ import annotations

import cProfile
import gc
import multiprocessing as mp
import pstats
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench._common import emit, parser, serve_profile_commands

LAYERS = (
    ("aiohttp_server", ("aiohttp/web", "aiohttp/http_writer", "aiohttp/http_parser", "aiohttp/base_protocol")),
    ("aiohttp_client", ("aiohttp/client", "aiohttp/connector", "aiohttp/streams", "aiohttp/payload",
                        "aiohttp/helpers", "yarl/", "multidict/")),
    ("asyncio", ("asyncio/", "uvloop", "<built-in method _asyncio", "selectors")),
    ("json", ("json/", "orjson")),
    ("engine", ("actors/",)),
    ("router", ("cluster/router/",)),
)
TOP = 14


def layer_of(where: str) -> str:
    for name, marks in LAYERS:
        if any(m in where for m in marks):
            return name
    return "other"


def summarize(prof: cProfile.Profile) -> dict[str, Any]:
    """Own CPU seconds by layer, and the top functions by own time."""
    st = pstats.Stats(prof)
    own = {f"{f}:{ln}({fn})": tt for (f, ln, fn), (_, _, tt, _, _) in st.stats.items()}  # type: ignore[attr-defined]
    layers: dict[str, float] = {}
    for where, tt in own.items():
        layers[layer_of(where)] = layers.get(layer_of(where), 0.0) + tt
    top = sorted(own.items(), key=lambda kv: -kv[1])[:TOP]
    return {"layers_s": {k: round(v, 4) for k, v in sorted(layers.items(), key=lambda kv: -kv[1])},
            "top_s": {k.split("site-packages/")[-1].split("/work/main/")[-1]: round(v, 4) for k, v in top}}


def _timed_emits(steps: list[tuple[float, float, int]], gcs: list[tuple[float, int, float]]) -> None:
    """Record, per engine step, the wall ms from the start of ``Engine.apply_step`` until every request handler it
    woke has written its token (a callback queued after their wake-ups runs after them, the loop's ready queue
    being first in first out), with the step's requests; and each garbage collection's generation and ms (each
    with its start, ``time.perf_counter``).

    What an engine's emit costs its process's loop: while it runs, no other engine of the process can start its
    step (the step lag a process causes itself, as against waiting for a core)."""
    import asyncio

    from actors.engine.engine import Engine

    apply = Engine.apply_step

    def timed(self: Engine, step: Any, cost: Any, end: float, lag: float) -> None:
        t0 = time.perf_counter()
        apply(self, step, cost, end, lag)
        n = len(step.items)
        asyncio.get_running_loop().call_soon(lambda: steps.append((t0, (time.perf_counter() - t0) * 1e3, n)))

    Engine.apply_step = timed  # type: ignore[method-assign]
    started = [0.0]

    def on_gc(phase: str, info: dict[str, Any]) -> None:
        if phase == "start":
            started[0] = time.perf_counter()
        else:
            gcs.append((started[0], int(info["generation"]), (time.perf_counter() - started[0]) * 1e3))

    gc.callbacks.append(on_gc)


def emit_summary(steps: list[tuple[float, float, int]], gcs: list[tuple[float, int, float]]) -> dict[str, Any]:
    """Percentiles of the emit ms per step (all steps, and steps of 8 requests or more) and the collections while
    the engines stepped (between the first step and the last: start-up's and shut-down's left out)."""
    import numpy as np

    def pct(xs: list[float]) -> dict[str, float] | None:
        if not xs:
            return None
        p50, p99 = np.percentile(xs, [50, 99])
        return {"n": len(xs), "p50": round(float(p50), 3), "p99": round(float(p99), 3), "max": round(max(xs), 3)}

    first, last = (steps[0][0], steps[-1][0]) if steps else (0.0, 0.0)
    during = [(g, ms) for t, g, ms in gcs if first <= t <= last]
    by_gen = {g: [ms for gg, ms in during if gg == g] for g in sorted({g for g, _ in during})}
    return {"emit_ms": pct([ms for _, ms, _ in steps]),
            "emit_ms_8_or_more_requests": pct([ms for _, ms, n in steps if n >= 8]),
            "requests_per_step_mean": round(sum(n for _, _, n in steps) / max(1, len(steps)), 2),
            "stepping_s": round(last - first, 2),
            "gc_ms": {str(g): {"n": len(v), "total": round(sum(v), 2), "max": round(max(v), 3)}
                      for g, v in by_gen.items()}}


def _worker(spec_json: str, names: list[str], q: Any, cmd: Any, dump: str | None, emit_path: str | None) -> None:
    import json

    import uvloop

    from actors.worker import GpuWorker

    steps: list[tuple[float, float, int]] = []
    gcs: list[tuple[float, int, float]] = []
    if emit_path:
        _timed_emits(steps, gcs)

    async def main() -> None:
        w = GpuWorker(spec_json, names)
        q.put(await w.start())
        await serve_profile_commands(q, cmd, summarize, dump and f"{dump}/engines.pstats")
        await w.stop()

    uvloop.run(main())
    if emit_path:
        Path(emit_path).write_text(json.dumps(emit_summary(steps, gcs)))


def _router(engines: dict[str, Any], spec_json: str, q: Any, cmd: Any, dump: str | None) -> None:
    import uvloop

    from cluster.router.actor import RouterActor

    async def main() -> None:
        r = RouterActor(engines, spec_json)
        q.put(await r.start())
        await serve_profile_commands(q, cmd, summarize, dump and f"{dump}/router.pstats")
        await r.stop()

    uvloop.run(main())


def run(gpus: int, streams: int, seconds: float, dump: str | None = None,
        modes: tuple[str, ...] = ("plain", "profile"), layout: str = "new", emit: bool = False) -> dict[str, Any]:
    """Per process CPU us per output token, plain then profiled (``dump``: a folder for the pstats files).
    ``emit``: the engine process's emit ms per step and its garbage collections over the whole run, warm-up
    included (``_timed_emits``; with ``modes`` plain alone, so no profiler inflates them)."""
    import json
    import tempfile

    import uvloop

    from bench.density import LAYOUTS, VARIANTS, spec
    from bench.engine import closed_loop
    from cluster.launch import pack_engines

    s = spec(gpus, {k: v for k, v in {**LAYOUTS, **VARIANTS}[layout].items() if k not in ("gpus_per_actor",)})
    groups = pack_engines(s.engines(), gpus)  # every engine in one worker: one process to profile
    ctx = mp.get_context("spawn")
    wq, wcmd, rq, rcmd = ctx.Queue(), ctx.Queue(), ctx.Queue(), ctx.Queue()
    emit_path = tempfile.mktemp(prefix="density-emit-", suffix=".json") if emit else None
    worker = ctx.Process(target=_worker, args=(s.model_dump_json(), [e.name for e in groups[0]], wq, wcmd, dump,
                                               emit_path), daemon=True)
    worker.start()
    engines = wq.get(timeout=120)
    router = ctx.Process(target=_router, args=(engines, s.model_dump_json(), rq, rcmd, dump), daemon=True)
    router.start()
    url = rq.get(timeout=120)
    out: dict[str, Any] = {"gpus": gpus, "streams": streams, "window_s": seconds, "layout": layout}
    try:
        uvloop.run(closed_loop(url, streams, 1.0, 0))  # warm connections and caches
        for mode in modes:
            for c in (wcmd, rcmd):
                c.put(mode)
            prof = cProfile.Profile(time.process_time) if mode == "profile" else None
            t0 = time.process_time()
            if prof is not None:
                prof.enable()
            r = uvloop.run(closed_loop(url, streams, seconds, 1))
            if prof is not None:
                prof.disable()
                if dump:
                    prof.dump_stats(f"{dump}/load_generator.pstats")
            gen = time.process_time() - t0
            for c in (wcmd, rcmd):
                c.put("stop")
            (wcpu, wprof), (rcpu, rprof) = wq.get(timeout=60), rq.get(timeout=60)
            tokens = max(1, int(r["tokens"]))
            row: dict[str, Any] = {
                "rate_tok_s": round(r["rate_tok_s"], 1),
                "us_per_token": {"engines": round(wcpu / tokens * 1e6, 1), "router": round(rcpu / tokens * 1e6, 1),
                                 "load_generator": round(gen / tokens * 1e6, 1),
                                 "total": round((wcpu + rcpu + gen) / tokens * 1e6, 1)}}
            if prof is not None:
                row["engines"], row["router"], row["load_generator"] = wprof, rprof, summarize(prof)
            out[mode] = row
            print(f"{mode}: {row['rate_tok_s']} tok/s, us/token {row['us_per_token']}", flush=True)
    finally:
        for c in (wcmd, rcmd):
            c.put("quit")
        for p in (router, worker):
            p.join(timeout=30)
            if p.is_alive():
                p.terminate()
    if emit_path and Path(emit_path).exists():
        out["engines_emit"] = json.loads(Path(emit_path).read_text())
        Path(emit_path).unlink()
        print(f"engines' emit per step and collections: {out['engines_emit']}", flush=True)
    return out


def main() -> None:
    p = parser(__doc__ or "")
    p.add_argument("--gpus", type=int, default=4)
    p.add_argument("--streams", type=int, default=48)
    p.add_argument("--seconds", type=float, default=8.0)
    p.add_argument("--layout", default="new", help="a layout or variant of bench/density.py (its engine settings)")
    p.add_argument("--modes", default="plain,profile", help="windows measured: plain (unprofiled), profile")
    p.add_argument("--dump", default=None, help="a folder to write each process's pstats file into")
    p.add_argument("--emit", action="store_true", help="the engine process's emit ms per step and collections")
    args = p.parse_args()
    gc.collect()
    result = {"bench": "density_profile", **run(args.gpus, args.streams, 4.0 if args.quick else args.seconds,
                                                     args.dump, tuple(args.modes.split(",")), args.layout,
                                                     args.emit)}
    emit(result)


if __name__ == "__main__":
    main()

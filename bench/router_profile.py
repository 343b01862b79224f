"""Where the router's CPU goes per request: cProfile of the real router (aiohttp server and client, the
mechanism) in its own process, in front of two small aiohttp engines in another, driven by a client in a third
(no Ray: nothing else in the router's process).

Per concurrency (1 and 32): the router's CPU per request unprofiled (``time.process_time`` over the run) and
its added latency over going straight to an engine (the baseline, same run); then a profiled run whose time
(process CPU time, so another process's turn on the core does not count) is split by layer: aiohttp's
server, aiohttp's client, the router's mechanism (``cluster/router``), the JSON codec, asyncio and the rest;
and the top functions by own time. The request is ``bench/router.py``'s overhead request (a one-token text
completion, answered whole). ``--parts hit`` measures the choice for a prefix-cache hit in process instead
(``hit_path``: the prompt memo against tokenizing every prompt from its start). ``--quick`` runs fewer requests.
"""

from __future__ import annotations

import asyncio
import collections
import cProfile
import gc
import json
import multiprocessing as mp
import os
import pstats
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench._common import emit, parser, pct, serve_profile_commands

LAYERS = (
    ("aiohttp_server", ("aiohttp/web_", "aiohttp/http_writer", "aiohttp/http_parser", "aiohttp/base_protocol")),
    ("aiohttp_client", ("aiohttp/client", "aiohttp/connector", "aiohttp/streams", "aiohttp/payload",
                        "aiohttp/helpers", "aiohttp/cookiejar", "aiohttp/tracing", "yarl/", "multidict/")),
    ("router", ("cluster/router/",)),
    ("json", ("json/",)),
    ("asyncio", ("asyncio/", "uvloop")),
)


def _own_times(prof: cProfile.Profile) -> dict[str, float]:
    """Own time per function, keyed ``file:line(name)``."""
    st = pstats.Stats(prof)
    return {f"{f}:{ln}({fn})": tt for (f, ln, fn), (_, _, tt, _, _) in st.stats.items()}  # type: ignore[attr-defined]


def layer_of(filename: str) -> str:
    for name, marks in LAYERS:
        if any(m in filename for m in marks):
            return name
    return "other"


def _engines(q: Any, n: int) -> None:
    import uvloop
    from aiohttp import web

    from actors.http import serve_app

    body = json.dumps({"id": "cmpl-1", "object": "text_completion", "created": 1, "model": "llama-3.1-8b",
                       "choices": [{"index": 0, "text": " a", "logprobs": None, "finish_reason": "length"}],
                       "usage": {"prompt_tokens": 20, "completion_tokens": 1, "total_tokens": 21}}).encode()

    async def completions(request: web.Request) -> web.Response:
        await request.read()
        return web.Response(body=body, content_type="application/json")

    async def main() -> None:
        ports = []
        for _ in range(n):
            app = web.Application()
            app.router.add_post("/v1/completions", completions)
            ports.append((await serve_app(app, "127.0.0.1", 0))[1])
        q.put(ports)
        await asyncio.Event().wait()

    uvloop.run(main())


def _router(ports: list[int], q: Any, cmd: Any) -> None:
    """Serve; on each command ("plain" or "profile") measure CPU until "stop", answer with the figures."""
    import uvloop

    from cluster.router.app import RouterServer
    from cluster.router.view import WorkerId, WorkerInfo
    from cluster.router.web import RouterHTTP
    from config.cluster import RouterSpec

    async def main() -> None:
        ws = [WorkerInfo(WorkerId(f"e{i}"), f"http://127.0.0.1:{p}", model="llama-3.1-8b") for i, p in enumerate(ports)]
        http = RouterHTTP(RouterServer(ws, RouterSpec(policy="least_loaded", index_mode="approximate"),
                                       prefill_ms=lambda w, new, cached: 0.0))
        q.put(await http.start())
        gc.freeze()  # as the router actor does after start-up
        await serve_profile_commands(q, cmd, _own_times)
        await http.stop()

    uvloop.run(main())


async def _load(url: str, concurrency: int, n: int) -> list[float]:
    """Wall ms of ``n`` one-token requests at ``concurrency``: bench/router.py's own client loop."""
    import aiohttp

    from bench.router import latencies

    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as s:
        return await latencies(s, [url], concurrency, n)


def profile(quick: bool) -> dict[str, Any]:
    ctx = mp.get_context("spawn")
    q, cmd = ctx.Queue(), ctx.Queue()
    engines = ctx.Process(target=_engines, args=(q, 2), daemon=True)
    engines.start()
    ports = q.get(timeout=60)
    router = ctx.Process(target=_router, args=(ports, q, cmd), daemon=True)
    router.start()
    url = q.get(timeout=60)
    direct = f"http://127.0.0.1:{ports[0]}"
    out: dict[str, Any] = {}
    try:
        for conc, n in ((1, 500 if quick else 3000), (32, 1000 if quick else 6000)):
            asyncio.run(_load(url, conc, 200))  # warm pools
            base = asyncio.run(_load(direct, conc, n))
            cmd.put("plain")
            lat = asyncio.run(_load(url, conc, n))
            cmd.put("stop")
            cpu, _ = q.get(timeout=60)
            cmd.put("profile")
            asyncio.run(_load(url, conc, n))
            cmd.put("stop")
            _, stats = q.get(timeout=120)
            total = sum(stats.values())
            layers: collections.Counter[str] = collections.Counter()
            for key, tt in stats.items():
                layers[layer_of(key.replace(os.sep, "/"))] += tt
            top = sorted(stats.items(), key=lambda kv: -kv[1])[:12]
            here = str(Path.cwd()) + "/"
            row = {"direct_ms": pct(base), "router_ms": pct(lat),
                   "added_p50_ms": round(pct(lat)["p50"] - pct(base)["p50"], 3),
                   "router_cpu_ms_per_request": round(cpu / n * 1000.0, 3),
                   "cpu_share_by_layer": {k: round(v / total, 3) for k, v in layers.most_common()},
                   "top_functions_share": {k.split("site-packages/")[-1].split(here)[-1]: round(v / total, 3)
                                           for k, v in top}}
            out[f"concurrency_{conc}"] = row
            print(f"profile at concurrency {conc}: cpu {row['router_cpu_ms_per_request']} ms/request, added p50 "
                  f"{row['added_p50_ms']} ms, by layer {row['cpu_share_by_layer']}", flush=True)
    finally:
        cmd.put("quit")
        router.join(20)
        engines.kill()
    return out


def hit_path(quick: bool, prefixes: int = 8, prefix_tokens: int = 2048, fresh: int = 128) -> dict[str, Any]:
    """CPU of the router's choice for a prefix-cache hit, in process: ``Chooser.prepare``, ``rank`` and
    ``routed`` for ``kv_aware`` on 4 workers whose index holds ``prefixes`` prefixes of ``prefix_tokens`` tokens,
    each request one of them plus ``fresh`` new tokens as text (``bench/router.py``'s prefix part), with the
    prompt memo (``cluster.router.prompt_memo``) and without it (the baseline), in alternating rounds; median
    and p90 microseconds per request, and whether both gave the same ids, hashes and worker for every request."""
    import random

    import numpy as np

    from cluster.loadtest.client import ids_to_text
    from cluster.router.choice import Chooser, RoutedRequest
    from cluster.router.regions import Topology
    from cluster.router.view import ClusterView, RequestContext, RoutingConfig, WorkerId, WorkerInfo
    from config.cluster import RouterSpec

    def chooser(memo: bool) -> tuple[Chooser, list[WorkerInfo]]:
        ws = [WorkerInfo(WorkerId(f"w{i}"), f"http://w{i}", model="llama-3.1-8b", hardware="h100-80g-sxm",
                         num_blocks=1024, free_blocks=1024) for i in range(4)]
        c = Chooser(RouterSpec(policy="kv_aware"), ClusterView(ws, RoutingConfig(require_feed=False), lambda: 0.0),
                    Topology(), lambda w, n, cached: n / 100.0, random.Random(0), prompt_memo=memo)
        for w in ws:
            c.index.apply_snapshot(w.name, 0, [])
        return c, ws

    rng = random.Random(0)
    heads = [[rng.randrange(17576) for _ in range(prefix_tokens)] for _ in range(prefixes)]
    n = 200 if quick else 1000
    bodies = [{"model": "llama-3.1-8b", "max_tokens": 32, "stream": True,
               "prompt": ids_to_text(heads[k % prefixes] + [rng.randrange(17576) for _ in range(fresh)])}
              for k in range(prefixes + n)]
    runs = {memo: chooser(memo) for memo in (False, True)}
    times: dict[bool, list[float]] = {False: [], True: []}
    picks: dict[bool, list[tuple[str, list[int], list[int]]]] = {False: [], True: []}
    for k, body in enumerate(bodies):
        for memo in ((False, True) if k % 2 else (True, False)):
            c, ws = runs[memo]
            ctx = RequestContext(body)
            t0 = time.process_time_ns()
            c.prepare(c.policy, ctx, RoutedRequest.of(body, False), ws, defer_tail=True)
            w = c.rank(c.policy, ws, ctx)[0]
            c.routed(c.policy, w, ctx)
            c.complete(ctx)
            dt = (time.process_time_ns() - t0) / 1000.0
            c.index.apply(w.name, k + 1, [["stored", ctx.block_hashes, None]])  # the engine's events arrive
            w.pending_blocks = 0
            if k >= prefixes:  # every prefix is held by now: hits only
                times[memo].append(dt)
                picks[memo].append((w.name, ctx.prompt_ids, ctx.block_hashes))
    out = {name: {"median_us": round(float(np.median(times[memo])), 1),
                  "p90_us": round(float(np.percentile(times[memo], 90)), 1)}
           for name, memo in (("without_memo", False), ("with_memo", True))}
    return {"requests": n, **out, "ratio": round(out["with_memo"]["median_us"] / out["without_memo"]["median_us"], 3),
            "same_decisions": picks[False] == picks[True]}


def main() -> None:
    p = parser(__doc__ or "")
    p.add_argument("--parts", default="profile,hit", help="profile (the HTTP router), hit (the hit path in process)")
    args = p.parse_args()
    parts = set(args.parts.split(","))
    out: dict[str, Any] = {"bench": "router_profile"}
    if "profile" in parts:
        out.update(profile(args.quick))
    if "hit" in parts:
        out["hit_path"] = hit_path(args.quick)
        print(f"hit path: {out['hit_path']}", flush=True)
    emit(out)


if __name__ == "__main__":
    main()

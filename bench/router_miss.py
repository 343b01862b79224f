"""The router's miss path, span by span: one streamed request with a 2176-token text prompt that no engine holds,
through kvmesh's router (kv_aware, the engines' KV-event feed) and through sgl-router (cache_aware), in front of
the same fake engines, beside going straight to an engine, in alternating rounds (no Ray).

Every process stamps ``time.perf_counter_ns`` (CLOCK_MONOTONIC on Linux: one clock for every process), so one
request's path splits into: the client's send to the router's handler (request read by aiohttp's server), the
router's own steps (JSON parse, ``prepare``: the prompt's head tokenized, hashed and looked up for a miss, the
whole prompt for a hit; policy ranking, body splice; a miss's tail is tokenized after the send), the upstream send
to the engine's handler (pool, connect, write), the engine's answer (headers at once, then the first content
chunk ``--engine-ms`` later, as a prefill would), the first chunk's way back through the router (read, relay,
write) and to the client. The engines stamp their times into the first chunk itself; the router's spans come
from wrappers around its methods (this process only). Medians per span, in wall microseconds, and the loop thread's
CPU in some (``*_cpu``: the router's write of the first chunk takes ~100 us of CPU, its wall also holds the
client's turn on a shared core); the router process's CPU per request over the run; the added TTFT of each router
over the direct path. ``--quick`` sends fewer requests. ``--hit``: the prefix-heavy workload's hits
instead (``hit_prompt``: one of 8 prompts of 2048 words, then 128 new words; the first request of each prefix is
a warm-up miss): kvmesh's router finds the prefix in its prompt memo and in its in-flight index (the fake engines
send no KV events), sgl-router in its radix tree. ``--cold``: misses whose every word is new to the router's
tokenizer (``cold_prompt``), as a run's first request of each prefix brings: ``prompt_text``'s words come from
17,576 three-letter words, nearly all met after the first ~20 requests, so its misses past those learn almost none.
Each path sends the same prompts once; 104 requests per path (54 with ``--quick``). ``--engine-tokenizes``: the
engines tokenize each prompt on receipt with a fresh tokenizer, as a real one meets a new prefix's words, so their
CPU and the router's share the host's cores; ``ttft_added_us`` is then the figure (the whole TTFT over the direct
path's, the engine's span included, which ``added_us`` subtracts).
"""

from __future__ import annotations

import asyncio
import itertools
import json
import multiprocessing as mp
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench._common import emit, parser

PROMPT_TOKENS = 2176
ENGINES = 4
NOW = time.perf_counter_ns
CPU = time.thread_time_ns


def prompt_text(i: int) -> str:
    """A 2176-word prompt of random words (so a miss on every engine, and words the router may not have met,
    as the first request of a new prefix brings), as the load test writes it."""
    import random

    from cluster.loadtest.client import ids_to_text

    rng = random.Random(i)
    return ids_to_text([rng.randrange(17576) for _ in range(PROMPT_TOKENS)])


COLD_ALPHABET = "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789"
COLD_WORDS = len(COLD_ALPHABET) ** 3
"""Words of ``cold_prompt``: a space and three of these characters, each one token of kvmesh's tokenizer."""


def cold_prompt(i: int) -> str:
    """Prompt ``i`` of ``PROMPT_TOKENS`` words no other ``cold_prompt(j)`` holds (``i < COLD_WORDS //
    PROMPT_TOKENS``, 109 prompts): every word new to a router that has met only these prompts, as the first
    request of a new prefix brings at the start of a sweep's run (``prompt_text``'s words come from 17,576, all
    met after ~20 prompts). A space and three letters or digits: one token each, as ``ids_to_text`` writes."""
    if not 0 <= i < COLD_WORDS // PROMPT_TOKENS:
        raise ValueError(f"cold prompt {i} out of range (0..{COLD_WORDS // PROMPT_TOKENS - 1})")
    a, n = COLD_ALPHABET, len(COLD_ALPHABET)
    ks = range(i * PROMPT_TOKENS, (i + 1) * PROMPT_TOKENS)
    return "".join(" " + a[k % n] + a[k // n % n] + a[k // (n * n)] for k in ks)


HIT_PREFIXES = 8
HIT_PREFIX_WORDS = 2048


def hit_prompt(i: int) -> str:
    """Prefix ``i % HIT_PREFIXES`` (2048 random words, the same for every request of that prefix) and 128 new words,
    as ``bench/router.py``'s prefix-heavy part sends: 2176 tokens of which the first 2048 are met before."""
    return prompt_text(-1 - i % HIT_PREFIXES)[:4 * HIT_PREFIX_WORDS] + prompt_text(i)[:4 * 128]


def _engines(q: Any, n: int, engine_ms: float, tokenize: bool = False) -> None:
    """``n`` aiohttp engines (the same server setup as kvmesh's engines) that answer a stream's headers at once
    and its first content chunk ``engine_ms`` later, with a KV feed that reports them alive and empty.
    ``tokenize``: each prompt is first tokenized by a fresh tokenizer, as an engine meets a new prefix's words
    (its CPU then shares the host's cores with the router's)."""
    import msgpack
    import uvloop
    from aiohttp import WSMsgType, web

    from actors.engine.tokenizer import Tokenizer
    from actors.http import serve_app

    def chunk(extra: dict[str, Any], finish: str | None, ids: list[int]) -> bytes:
        return b"data: " + json.dumps({"id": "cmpl-1", "object": "text_completion", "created": 1,
                                       "model": "llama-3.1-8b", "choices": [{"index": 0, "text": " a",
                                       "token_ids": ids, "logprobs": None, "finish_reason": finish}],
                                       **extra}, separators=(",", ":")).encode() + b"\n\n"

    usage = b'data: {"id":"cmpl-1","object":"text_completion","created":1,"model":"llama-3.1-8b","choices":[],' \
            b'"usage":{"prompt_tokens":2176,"completion_tokens":2,"total_tokens":2178}}\n\ndata: [DONE]\n\n'

    async def completions(request: web.Request) -> web.StreamResponse:
        e_in = NOW()
        raw = await request.read()
        e_read = NOW()
        if tokenize:
            Tokenizer(128256).encode(json.loads(raw)["prompt"])
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
        await resp.prepare(request)
        await asyncio.sleep(engine_ms / 1000.0)
        await resp.write(chunk({"e_in": e_in, "e_read": e_read, "e_first": NOW()}, None, [5]))
        await resp.write(chunk({}, "length", [6]))
        await resp.write(usage)
        await resp.write_eof()
        return resp

    async def feed(request: web.Request) -> web.WebSocketResponse:
        ws = web.WebSocketResponse(heartbeat=5.0)
        await ws.prepare(request)

        async def beats() -> None:
            while not ws.closed:
                await ws.send_bytes(msgpack.packb({"t": "beat"}))
                await asyncio.sleep(1.0)

        task = asyncio.get_running_loop().create_task(beats())
        async for msg in ws:
            if msg.type == WSMsgType.BINARY:
                m = msgpack.unpackb(msg.data)
                if m.get("t") == "sub":
                    for name in m.get("e", []):
                        await ws.send_bytes(msgpack.packb({"t": "snapshot", "e": name, "seq": 0, "bs": 16,
                                                           "hashes": [], "load": {"num_blocks": 1024}}))
        task.cancel()
        return ws

    async def ok(request: web.Request) -> web.Response:
        return web.json_response({"model_path": "llama-3.1-8b", "served_model_name": "llama-3.1-8b",
                                  "is_generation": True, "page_size": 16})

    async def main() -> None:
        ports = []
        for _ in range(n):
            app = web.Application(client_max_size=64 << 20)
            app.router.add_post("/v1/completions", completions)
            app.router.add_get("/kvmesh/feed", feed)
            for path in ("/health", "/get_model_info", "/model_info", "/get_server_info", "/server_info"):
                app.router.add_get(path, ok)
            ports.append((await serve_app(app, "127.0.0.1", 0))[1])
        q.put(ports)
        await asyncio.Event().wait()

    uvloop.run(main())


SPANS = ("parse", "prepare", "fill_prompt", "encode", "hash", "overlap", "rank", "payload", "upstream", "client_start")
BEFORE_SEND = ("parse", "prepare", "rank", "payload")
"""The router's steps between the body and the upstream send (``prepare`` holds ``fill_prompt``, ``encode``, ``hash``
and ``overlap`` when it walks the whole prompt; a miss ranked from its head leaves them to ``Chooser.complete``,
after the send, where the spans of the same names then lie; since the tail runs a slice per loop pass
(``Chooser.complete_soon``: ``bench/router_holds``), in a task of its own beside the relay
(``Chooser.tail_meanwhile``), a miss has no ``fill_prompt`` or ``encode`` span: the spans are the request task's)."""


def _instrument(marks: dict[str, dict[str, int]]) -> None:
    """Wrap the router's steps so each request's task records when each began and ended (this process only)."""
    from actors.engine import tokenizer
    from cluster.router import app, choice, proxy, upstream, web

    def task_marks() -> dict[str, int] | None:
        t = asyncio.current_task()
        return marks.get(t.get_name()) if t is not None else None

    def sync(owner: Any, attr: str, span: str) -> None:
        fn = getattr(owner, attr)

        def wrapped(*a: Any, **k: Any) -> Any:
            m = task_marks()
            c0, t0 = CPU(), NOW()
            out = fn(*a, **k)
            if m is not None and span + "_s" not in m:
                m[span + "_s"], m[span + "_e"], m[span + "_cpu"] = t0, NOW(), CPU() - c0
            return out
        setattr(owner, attr, wrapped)

    def coro(owner: Any, attr: str, span: str) -> None:
        fn = getattr(owner, attr)

        async def wrapped(*a: Any, **k: Any) -> Any:
            m = task_marks()
            c0, t0 = CPU(), NOW()
            out = await fn(*a, **k)
            if m is not None and span + "_s" not in m:  # (CPU: the loop's thread, whoever ran while it waited)
                m[span + "_s"], m[span + "_e"], m[span + "_cpu"] = t0, NOW(), CPU() - c0
            return out
        setattr(owner, attr, wrapped)

    dispatch = web.Dispatch.__call__
    numbers = itertools.count()

    async def entry(self: Any, request: Any) -> Any:
        t = asyncio.current_task()
        assert t is not None
        name = f"req-{next(numbers)}"  # (not the task's id: a finished task's id is reused, its marks overwritten)
        t.set_name(name)
        marks[name] = {"dispatch": NOW(), "rid": int(request.headers.get("X-Request-Id", "-1"))}
        return await dispatch(self, request)
    web.Dispatch.__call__ = entry  # type: ignore[method-assign]

    route = app.RouterServer.route

    async def routed(self: Any, call: Any, out: Any, chat: bool) -> Any:
        m = task_marks()
        if m is not None:
            m["body_read"] = NOW()
        return await route(self, call, out, chat)
    app.RouterServer.route = routed  # type: ignore[method-assign]

    sync(app, "parse_json_object", "parse")
    sync(choice.Chooser, "prepare", "prepare")
    sync(choice.Chooser, "fill_prompt", "fill_prompt")
    sync(tokenizer.Tokenizer, "encode", "encode")
    sync(choice, "hash_request_blocks", "hash")
    sync(choice.Chooser, "overlap", "overlap")
    sync(choice.Chooser, "rank", "rank")
    sync(proxy.ColocatedFlow, "payload", "payload")
    coro(upstream.AiohttpUpstream, "request", "upstream")

    seen: set[Any] = set()
    """Every connection a send went out on (held, so a closed one's id is never taken for a new one's)."""
    request = upstream.AiohttpUpstream.request

    async def count_connects(self: Any, *a: Any, **k: Any) -> Any:
        out = await request(self, *a, **k)
        conn = out._resp.connection  # (None once an answer that came whole released it)
        m = task_marks()
        if m is not None and conn is not None and conn.protocol is not None:
            m["fresh_connection"] = int(conn.protocol not in seen)  # a new connection, not a pooled one
            seen.add(conn.protocol)
        return out
    upstream.AiohttpUpstream.request = count_connects  # type: ignore[method-assign]
    coro(web.WebStream, "start", "client_start")

    chunk = upstream.AiohttpResponse.chunk

    async def first_chunk(self: Any) -> bytes:
        out = await chunk(self)
        m = task_marks()
        if m is not None and "chunk1" not in m:
            m["chunk1"] = NOW()
        return out
    upstream.AiohttpResponse.chunk = first_chunk  # type: ignore[method-assign]

    write = web.WebStream.write

    async def first_write(self: Any, data: bytes) -> None:
        m = task_marks()
        if m is not None and "write1_s" not in m:
            c0 = CPU()
            m["write1_s"] = NOW()
            await write(self, data)
            m["write1_e"] = NOW()
            m["write1_cpu"] = CPU() - c0  # (the wall above also holds the client's turn on a shared core)
            return
        await write(self, data)
    web.WebStream.write = first_write  # type: ignore[method-assign]


def _router(ports: list[int], q: Any, cmd: Any) -> None:
    import uvloop

    from actors.worker import freeze_heap
    from cluster.router.app import RouterServer
    from cluster.router.view import WorkerId, WorkerInfo
    from cluster.router.web import RouterHTTP
    from config.cluster import RouterSpec

    marks: dict[str, dict[str, int]] = {}
    _instrument(marks)

    async def main() -> None:
        ws = [WorkerInfo(WorkerId(f"e{i}"), f"http://127.0.0.1:{p}", model="llama-3.1-8b") for i, p in enumerate(ports)]
        http = RouterHTTP(RouterServer(ws, RouterSpec(policy="kv_aware")))
        url = await http.start()
        while not all(w.feed_connected for w in http.server.view.workers.values()):
            await asyncio.sleep(0.05)
        freeze_heap()  # as the router actor does after start-up
        q.put(url)
        cpu0 = time.process_time_ns()  # (the router's process: its loop, its GC, aiohttp's both sides)
        loop = asyncio.get_running_loop()
        while (what := await loop.run_in_executor(None, cmd.get)) != "quit":
            assert what == "marks"
            q.put(({m["rid"]: m for m in marks.values() if m.get("rid", -1) >= 0}, time.process_time_ns() - cpu0))
        await http.stop()

    uvloop.run(main())


async def _send(session: Any, url: str, rid: int, hit: bool = False, prompt: str | None = None) -> dict[str, int]:
    if prompt is None:
        prompt = hit_prompt(rid) if hit else prompt_text(rid)
    body = json.dumps({"model": "llama-3.1-8b", "prompt": prompt, "max_tokens": 2, "ignore_eos": True,
                       "stream": True, "stream_options": {"include_usage": True}, "temperature": 0.0}).encode()
    headers = {"Content-Type": "application/json", "X-Request-Id": str(rid)}
    c_send = NOW()
    async with session.post(url + "/v1/completions", data=body, headers=headers) as r:
        c_headers = NOW()
        async for piece in r.content.iter_any():
            if b'"e_first"' in piece:
                c_first = NOW()
                line = piece.split(b"\n\n")[0][6:]
                ev = json.loads(line)
                rest = await r.read()
                assert rest.endswith(b"data: [DONE]\n\n") or rest == b"", rest[-40:]
                return {"c_send": c_send, "c_headers": c_headers, "c_first": c_first,
                        "e_in": ev["e_in"], "e_read": ev["e_read"], "e_first": ev["e_first"]}
    raise RuntimeError(f"{url}: no first chunk")


def _median_us(rows: list[dict[str, int]], a: str, b: str) -> float:
    vals = [r[b] - r[a] for r in rows if a in r and b in r]
    return round(statistics.median(vals) / 1000.0, 1) if vals else float("nan")


def _split(rows: list[dict[str, int]], through_router: bool) -> dict[str, float]:
    """Median wall microseconds per span of the path (the router's own spans when it is kvmesh's)."""
    out = {"ttft_minus_engine": round(statistics.median(
        (r["c_first"] - r["c_send"]) - (r["e_first"] - r["e_read"]) for r in rows) / 1000.0, 1),
        "client_to_engine_handler": _median_us(rows, "c_send", "e_in"),
        "engine_read_body": _median_us(rows, "e_in", "e_read"),
        "engine_first_to_client": _median_us(rows, "e_first", "c_first"),
        "ttft": _median_us(rows, "c_send", "c_first")}
    if through_router:
        seq: list[tuple[str, str, str]] = [("client_to_router_handler", "c_send", "dispatch"),
                                           ("router_read_body", "dispatch", "body_read"),
                                           ("body_to_parse", "body_read", "parse_s")]
        seq += [(s, f"{s}_s", f"{s}_e") for s in SPANS]
        seq += [("parse_to_upstream_other", "parse_e", "upstream_s"),
                ("upstream_to_engine_handler", "upstream_s", "e_in"),
                ("engine_first_to_router_chunk", "e_first", "chunk1"),
                ("router_chunk_to_write", "chunk1", "write1_s"),
                ("router_write", "write1_s", "write1_e"),
                ("router_write_to_client", "write1_e", "c_first")]
        for name, a, b in seq:
            out[name] = _median_us(rows, a, b)
        fresh = [r["fresh_connection"] for r in rows if "fresh_connection" in r]
        out["fresh_connections"] = sum(fresh)  # sends that opened a connection (~2 ms more than a pooled one)
        out["router_steps_sum"] = round(sum(out[s] for s in BEFORE_SEND), 1)
        # what the wall from parse to send holds beyond the wrapped steps (admission, bookkeeping, the loop)
        out["parse_to_upstream_unwrapped"] = round(out["parse_to_upstream_other"] - sum(
            out[s] for s in BEFORE_SEND if s != "parse"), 1)
        # CPU time of the steps (what a loaded host stretches above)
        for s in (*BEFORE_SEND, "fill_prompt", "overlap", "encode", "hash", "write1", "upstream", "client_start"):
            vals = [r[s + "_cpu"] for r in rows if s + "_cpu" in r]
            out[s + "_cpu"] = round(statistics.median(vals) / 1000.0, 1) if vals else float("nan")
    return out


def miss_path(quick: bool, engine_ms: float, sgl_py: str | None, hit: bool = False,
              cold_words: bool = False, engine_tokenizes: bool = False) -> dict[str, Any]:
    import aiohttp

    from bench.router import SGLangRouter

    ctx = mp.get_context("spawn")
    q, cmd = ctx.Queue(), ctx.Queue()
    engines = ctx.Process(target=_engines, args=(q, ENGINES, engine_ms, engine_tokenizes), daemon=True)
    engines.start()
    ports = q.get(timeout=60)
    router = ctx.Process(target=_router, args=(ports, q, cmd), daemon=True)
    router.start()
    kv_url = q.get(timeout=60)
    urls = [f"http://127.0.0.1:{p}" for p in ports]
    sgl = SGLangRouter(sgl_py, urls) if sgl_py else None
    paths = {"direct": urls[0], "kvmesh": kv_url, **({"sgl_router": sgl.url} if sgl else {})}
    rounds, per = (4, 10) if quick and cold_words else (5, 18) if cold_words else (4, 25) if quick else (10, 60)
    rows: dict[str, list[dict[str, int]]] = {k: [] for k in paths}
    cold: dict[str, list[dict[str, int]]] = {k: [] for k in paths}
    rid = 0
    sent = dict.fromkeys(paths, 0)

    def fresh(k: str) -> str | None:
        """``--cold``: the path's next ``cold_prompt`` (each path sends the same prompts, each once)."""
        if not cold_words:
            return None
        sent[k] += 1
        return cold_prompt(sent[k] - 1)

    async def run() -> None:
        nonlocal rid
        sessions = {k: aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) for k in paths}
        try:
            for k, url in paths.items():  # cold: the first request to each engine after the router started
                for _ in range(ENGINES):
                    rid += 1
                    r = await _send(sessions[k], url, rid, hit, fresh(k))
                    r["rid"] = rid
                    cold[k].append(r)
            for k, url in paths.items():  # warm: pools, the router's tokenizer cache (not its words: --cold)
                for _ in range(10):
                    await _send(sessions[k], url, rid := rid + 1, hit, fresh(k))  # (every prefix among them)
            for _ in range(rounds):
                for k, url in paths.items():
                    for _ in range(per):
                        rid += 1
                        r = await _send(sessions[k], url, rid, hit, fresh(k))
                        r["rid"] = rid
                        rows[k].append(r)
                        await asyncio.sleep(0.002)
        finally:
            for s in sessions.values():
                await s.close()

    try:
        asyncio.run(run())
        cmd.put("marks")
        marks, router_cpu_ns = q.get(timeout=60)
    finally:
        cmd.put("quit")
        router.join(20)
        if sgl is not None:
            sgl.stop()
        engines.kill()
    for r in rows["kvmesh"] + cold["kvmesh"]:
        r.update({k: v for k, v in marks.get(r["rid"], {}).items() if k != "rid"})
    out: dict[str, Any] = {"prompt_tokens": PROMPT_TOKENS, "engine_ms": engine_ms,
                           "prompts": "hits" if hit else "misses of new words" if cold_words else "misses",
                           "requests_per_path": rounds * per,
                           "sgl_router": "measured" if sgl else "absent (.venv-sglang)"}
    # The router process's CPU over the run (its feeds' beats included) per request it served: its whole path,
    # tails, relays and writes after the first chunk too.
    served = len(rows["kvmesh"]) + len(cold["kvmesh"]) + 10  # (and the 10 warm-up requests)
    out["router_cpu_per_request_us"] = round(router_cpu_ns / served / 1000.0, 1)
    print(f"kvmesh router process CPU per request (us): {out['router_cpu_per_request_us']}", flush=True)
    for k, rs in rows.items():
        out[k] = _split(rs, k == "kvmesh")
        print(f"{k}: {out[k]}", flush=True)
    base = out["direct"]["ttft_minus_engine"]
    out["added_us"] = {k: round(out[k]["ttft_minus_engine"] - base, 1) for k in paths if k != "direct"}
    print(f"added over direct (median us): {out['added_us']}", flush=True)
    # The whole TTFT's difference, the engine's own span included: what the router's CPU costs an engine that
    # shares the host's cores (``--engine-tokenizes``), which ``added_us`` subtracts with the engine's span.
    out["ttft_added_us"] = {k: round(out[k]["ttft"] - out["direct"]["ttft"], 1) for k in paths if k != "direct"}
    print(f"TTFT added over direct, engine included (median us): {out['ttft_added_us']}", flush=True)
    # The first request to each engine (fresh connections, cold caches): a run's first misses.
    out["cold"] = {k: _split(rs, k == "kvmesh") for k, rs in cold.items()}
    print(f"cold (first {ENGINES} requests): {out['cold']}", flush=True)
    out["cold_added_us"] = {k: round(out["cold"][k]["ttft_minus_engine"] - out["cold"]["direct"]["ttft_minus_engine"],
                                     1) for k in paths if k != "direct"}
    print(f"cold added over direct (median us): {out['cold_added_us']}", flush=True)
    return out


def main(argv: list[str] | None = None) -> None:
    p = parser(__doc__ or "")
    p.add_argument("--engine-ms", type=float, default=20.0, help="wall ms from an engine's headers to its first chunk")
    p.add_argument("--no-sglang", action="store_true", help="skip sgl-router")
    p.add_argument("--hit", action="store_true", help="prefix-cache hits (a known 2048-word prefix + 128 new words)")
    p.add_argument("--cold", action="store_true",
                   help="misses whose every word is new to the router (cold_prompt; 104 requests per path)")
    p.add_argument("--engine-tokenizes", action="store_true",
                   help="engines tokenize each prompt with a fresh tokenizer on receipt (their CPU shares the cores)")
    args = p.parse_args(argv)
    if args.hit and args.cold:
        p.error("--hit and --cold are exclusive")
    from bench.router import sglang_python

    emit({"bench": "router_miss", **miss_path(args.quick, args.engine_ms,
                                               None if args.no_sglang else sglang_python(install=False), args.hit,
                                               args.cold, args.engine_tokenizes)})


if __name__ == "__main__":
    main()

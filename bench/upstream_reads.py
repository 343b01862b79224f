"""CPU per SSE event the router's client to its engines spends reading a stream, against aiohttp's plain client.

An aiohttp server (standing in for an engine) writes one event at a time and waits until the reader has it (one
read per event, as a router keeping up with its engines reads); the reader is either the router's
``AiohttpUpstream`` (its connector resumes only a paused connection, its body read timeout is one watch, not a timer
per chunk) or, as the baseline in the same run, a plain aiohttp ``ClientSession`` with the same ``sock_read``
reading with ``readany`` (what the router did before). Both sides run in this process on uvloop: the figure is
process CPU (``time.process_time``) per event, the least of ``--repeats`` rounds, the two readers alternated; the
server's share is the same in both, so the difference is the reader's.

Last line: JSON with each reader's us per event and their ratio.
"""

from __future__ import annotations

import asyncio
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import aiohttp
import uvloop
from aiohttp import web

from actors.http import serve_app
from bench._common import emit, parser
from cluster.router.upstream import AiohttpUpstream, UpstreamLimits

EVENT = (b'data: {"id":"cmpl-0123456789abcdef0123456789abcdef","object":"text_completion","created":1764680000,'
         b'"model":"llama-3.1-8b","choices":[{"index":0,"text":" tokenword","logprobs":null,"finish_reason":null,'
         b'"stop_reason":null,"token_ids":[12345]}]}\n\n')
READ_TIMEOUT_S = UpstreamLimits().read_timeout_s


async def run(events: int, repeats: int) -> dict[str, Any]:
    read = asyncio.Event()

    async def stream(request: web.Request) -> web.StreamResponse:
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        for _ in range(events):
            read.clear()
            await resp.write(EVENT)
            await read.wait()
        await resp.write(b"data: [DONE]\n\n")
        await resp.write_eof()
        return resp

    app = web.Application()
    app.router.add_post("/v1/completions", stream)
    runner, port = await serve_app(app, "127.0.0.1", 0)
    base = f"http://127.0.0.1:{port}"
    upstream = AiohttpUpstream()
    plain = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=None, sock_read=READ_TIMEOUT_S),
                                  auto_decompress=False)

    async def router_reader() -> int:
        async with await upstream.request("POST", base, "/v1/completions", b"{}") as up:
            n = 0
            while await up.chunk():
                n += 1
                read.set()
            return n

    async def plain_reader() -> int:
        async with plain.post(base + "/v1/completions", data=b"{}") as r:
            n = 0
            while await r.content.readany():
                n += 1
                read.set()
            return n

    best = {"router_upstream": float("inf"), "plain_aiohttp": float("inf")}
    try:
        for _ in range(repeats):
            for name, reader in (("plain_aiohttp", plain_reader), ("router_upstream", router_reader)):
                t0 = time.process_time()
                reads = await reader()
                cpu = time.process_time() - t0
                if reads < events:
                    raise RuntimeError(f"{name} read {reads} chunks for {events} events")
                best[name] = min(best[name], cpu / events * 1e6)
    finally:
        await upstream.close()
        await plain.close()
        await runner.cleanup()
    return {"events": events, "repeats": repeats,
            "us_per_event": {k: round(v, 2) for k, v in best.items()},
            "ratio_router_to_plain": round(best["router_upstream"] / best["plain_aiohttp"], 3)}


def main() -> None:
    p = parser(__doc__ or "")
    p.add_argument("--events", type=int, default=20000)
    p.add_argument("--repeats", type=int, default=7)
    args = p.parse_args()
    result = uvloop.run(run(5000 if args.quick else args.events, 3 if args.quick else args.repeats))
    emit({"bench": "upstream_reads", **result})


if __name__ == "__main__":
    main()

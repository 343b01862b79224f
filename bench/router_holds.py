"""How long a cache miss holds the router's event loop: the longest stretch of the loop thread's CPU between two
turns of another task, per miss, with the router (kv_aware, the prompt memo, the prefix index) in process over a
fake upstream (no sockets, no Ray), as ``bench/router_miss`` sends misses: 2176 words from 17,576, the first
prompts' words new to the router's tokenizer, later ones' mostly known; ``--cold``: every word new (a new prefix's
first request at a run's start, ``bench.router_miss.cold_prompt``).

While one task holds the loop, every other request's relay, ranking and send waits: a miss's tail (tokenizing and
hashing its prompt after the send) was one stretch of ~3-5 ms. A ticker task yields (``asyncio.sleep(0)``) in a
loop and notes the thread's CPU at each turn; a request's longest gap between two turns is its longest hold. CPU
time, not wall, so another process's turn on the core does not count. Then, without the ticker, the router's CPU
per miss (its whole path in process: parse, ranking, the tail, the relay of a two-event stream). Medians and p90
over the misses after the first three; ``--quick`` sends fewer.
"""

from __future__ import annotations

import asyncio
import json
import statistics
import sys
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from types import TracebackType
from typing import Any, Self

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench._common import emit, parser

CPU = time.thread_time_ns
EVENTS = (b'data: {"id":"c","object":"text_completion","created":1,"model":"m","choices":[{"index":0,"text":" a",'
          b'"token_ids":[5],"logprobs":null,"finish_reason":"length"}]}\n\n', b"data: [DONE]\n\n")


class _Answer:
    """An engine's streamed answer: its headers at once, each event 5 ms later (a prefill, then a step)."""

    def __init__(self) -> None:
        self.status = 200
        self.headers: Mapping[str, str] = {"Content-Type": "text/event-stream"}
        self.parts = list(EVENTS)

    async def chunk(self) -> bytes:
        await asyncio.sleep(0.005)
        return self.parts.pop(0) if self.parts else b""

    async def read(self) -> bytes:
        return b""

    async def drain(self, wait_s: float = 0.05) -> bool:
        return True

    def close(self) -> None:
        pass

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(self, t: type[BaseException] | None, e: BaseException | None,
                        tb: TracebackType | None) -> None:
        pass


class _Upstream:
    async def request(self, method: str, base_url: str, path: str, body: bytes = b"",
                      headers: Mapping[str, str] | None = None, sent: Callable[[], None] | None = None) -> _Answer:
        if sent is not None:
            sent()
        await asyncio.sleep(0.0005)  # the send, and the engine's headers coming back
        return _Answer()

    async def warm(self, base_url: str, connections: int) -> int:
        return 0

    async def close(self) -> None:
        pass


class _Client:
    started = False

    async def start(self, headers: Any) -> None:
        self.started = True

    async def write(self, data: bytes) -> None:
        pass


async def holds(n: int, ticker: bool, cold: bool = False) -> list[int]:
    """Per miss: the longest hold (ns of loop CPU) with ``ticker``, else the CPU of its whole route (``cold``:
    prompts whose every word is new to the router, ``bench.router_miss.cold_prompt``)."""
    import gc

    from multidict import CIMultiDict

    from bench.router_miss import cold_prompt, prompt_text
    from cluster.router.app import RouterServer
    from cluster.router.exchange import Call
    from cluster.router.view import WorkerId, WorkerInfo
    from config.cluster import RouterSpec

    ws = [WorkerInfo(WorkerId(f"e{i}"), f"http://e{i}", model="llama-3.1-8b", num_blocks=1024, free_blocks=1024)
          for i in range(4)]
    router = RouterServer(ws, RouterSpec(policy="kv_aware"), upstream=_Upstream())
    for w in ws:
        w.feed_connected = True
    gc.collect()
    gc.freeze()  # as the router actor does after start-up (actors.worker.freeze_heap)
    gaps: list[int] = []
    running = True

    async def tick() -> None:
        last = CPU()
        while running:
            await asyncio.sleep(0)
            now = CPU()
            gaps.append(now - last)
            last = now

    task = asyncio.get_running_loop().create_task(tick()) if ticker else None
    out: list[int] = []
    for i in range(n):
        for w in ws:
            w.last_seen = router.view.now()
        prompt = (cold_prompt if cold else prompt_text)(i)
        body = json.dumps({"model": "llama-3.1-8b", "prompt": prompt, "max_tokens": 2, "ignore_eos": True,
                           "stream": True, "stream_options": {"include_usage": True}}).encode()
        call = Call("/v1/completions", CIMultiDict({"Content-Type": "application/json"}), body, {})
        await asyncio.sleep(0)
        await asyncio.sleep(0)  # (the ticker's turn after the prompt was made)
        gaps.clear()
        c0 = CPU()
        await router.route(call, _Client(), False)
        if i >= 3:
            out.append(max(gaps) if ticker else CPU() - c0)
    running = False
    if task is not None:
        await task
    return out


def _us(vals: list[int]) -> dict[str, float]:
    vals = sorted(vals)
    return {"median_us": round(statistics.median(vals) / 1000.0, 1),
            "p90_us": round(vals[int(0.9 * (len(vals) - 1))] / 1000.0, 1)}


def main(argv: list[str] | None = None) -> None:
    import uvloop

    p = parser(__doc__ or "")
    p.add_argument("--cold", action="store_true", help="every miss's words new to the router (router_miss --cold)")
    args = p.parse_args(argv)
    n = 20 if args.quick else 60
    longest = uvloop.run(holds(n, ticker=True, cold=args.cold))
    cpu = uvloop.run(holds(n, ticker=False, cold=args.cold))
    out = {"bench": "router_holds", "misses": n - 3, "words": "new" if args.cold else "prompt_text's",
           "longest_hold": _us(longest), "route_cpu": _us(cpu)}
    print(f"longest loop hold per miss: {out['longest_hold']}; router CPU per miss: {out['route_cpu']}", flush=True)
    emit(out)


if __name__ == "__main__":
    main()

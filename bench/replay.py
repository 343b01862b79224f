"""Replayer send accuracy: p99 of (actual - scheduled) send time at 50, 200 and 500 req/s.

The real replayer (``cluster.loadtest.replay``, open loop, uvloop) sends Poisson arrivals (seeded) to a
trivial OpenAI-style sink (this benchmark's own fixture, in a separate process so it does not share the
replayer's CPU): ``/v1/models`` names one model, ``/v1/completions`` answers one content chunk, a usage
chunk and ``[DONE]``. Each request records how late its send really started against its schedule.

Baselines, measured in the same run on the same event loop:
- ``timer_idle``: lateness of ``loop.call_at`` callbacks at the very same deadlines with nothing else
  running (the event loop's own timer jitter);
- ``timer_under_load``: lateness of a probe that sleeps to deadlines every 5 ms while the replay runs
  (how late the loop wakes anyone while it is busy sending and streaming).
The last line is one JSON object; ``--quick`` ends within a minute.
"""

from __future__ import annotations

import asyncio
import json
import multiprocessing as mp
import sys
import time
from multiprocessing.connection import Connection
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import numpy as np
import uvloop

from bench._common import emit, parser, pct
from cluster.loadtest.client import ClientConfig
from cluster.loadtest.replay import ReplayConfig, replay
from cluster.loadtest.spec import RequestId, RequestSpec
from cluster.loadtest.synthesis import PromptSynthesizer
from cluster.loadtest.synthetic import gamma_arrivals_ms

RATES = (50.0, 200.0, 500.0)


# -- the sink (runs in its own process) --------------------------------------------------------------------

def _sink_main(conn: Connection) -> None:
    from aiohttp import web

    head = {"id": "x", "object": "text_completion"}
    chunk = {**head, "choices": [{"index": 0, "text": " ok", "finish_reason": "length"}]}
    usage = {**head, "choices": [], "usage": {"prompt_tokens": 32, "completion_tokens": 1, "total_tokens": 33}}
    answer = b"".join(b"data: " + json.dumps(x).encode() + b"\n\n" for x in (chunk, usage)) + b"data: [DONE]\n\n"

    async def models(request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [{"id": "sink", "object": "model"}]})

    async def completions(request: web.Request) -> web.StreamResponse:
        await request.read()
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        await resp.write(answer)
        await resp.write_eof()
        return resp

    async def serve() -> None:
        app = web.Application()
        app.router.add_get("/v1/models", models)
        app.router.add_post("/v1/completions", completions)
        runner = web.AppRunner(app, access_log=None)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        server = site._server
        assert server is not None
        conn.send(server.sockets[0].getsockname()[1])  # type: ignore[attr-defined]
        while not conn.poll():
            await asyncio.sleep(0.1)
        await runner.cleanup()

    uvloop.run(serve())


# -- measurements ------------------------------------------------------------------------------------------

async def timer_idle(deadlines_s: list[float]) -> list[float]:
    """Lateness (wall ms) of ``loop.call_at`` at each deadline (offsets from now), nothing else running."""
    loop = asyncio.get_running_loop()
    base = loop.time() + 0.05
    late: list[float] = []
    done = asyncio.Event()
    remaining = len(deadlines_s)

    def fire(target: float) -> None:
        nonlocal remaining
        late.append((loop.time() - target) * 1000.0)
        remaining -= 1
        if remaining == 0:
            done.set()

    for d in deadlines_s:
        loop.call_at(base + d, fire, base + d)
    await done.wait()
    return late


async def probe(stop: asyncio.Event, period_s: float, out: list[float]) -> None:
    deadline = time.monotonic()
    while not stop.is_set():
        deadline += period_s
        delay = deadline - time.monotonic()
        if delay > 0:
            await asyncio.sleep(delay)
        out.append(max(0.0, (time.monotonic() - deadline) * 1000.0))


async def one_rate(url: str, rate: float, n: int, seed: int) -> dict:
    rng = np.random.default_rng([seed, int(rate)])
    arrivals = gamma_arrivals_ms(n, rate, 1.0, rng)
    arrivals -= arrivals[0]
    specs = [RequestSpec(RequestId(f"b{i}"), float(t), 32, 1, (), 16) for i, t in enumerate(arrivals)]
    idle = await timer_idle([t / 1000.0 for t in arrivals])
    stop = asyncio.Event()
    under: list[float] = []
    probe_task = asyncio.create_task(probe(stop, 0.005, under))
    t0 = time.process_time()
    result = await replay(url, specs, ReplayConfig(scrape=False), ClientConfig(model="sink"), PromptSynthesizer(0))
    cpu = time.process_time() - t0
    stop.set()
    await probe_task
    lags = [r.send_lag_wall_ms for r in result.records]
    failed = sum(1 for r in result.records if not r.success)
    send = pct(lags)
    base = pct(idle)
    return {
        "rate": rate, "requests": n, "failed": failed, "achieved_rate": round((n - 1) / (arrivals[-1] / 1000.0), 2),
        "send_lag_wall_ms": send, "timer_idle_wall_ms": base, "timer_under_load_wall_ms": pct(under),
        "p99_ratio_send_vs_timer_idle": round(send["p99"] / base["p99"], 3) if base["p99"] > 0 else None,
        "client_cpu_s": round(cpu, 3),
    }


async def run(url: str, seconds: float, seed: int) -> dict:
    out: dict = {"seconds_per_rate": seconds, "loop": "uvloop"}
    for rate in RATES:
        out[f"rate_{int(rate)}"] = await one_rate(url, rate, max(2, int(rate * seconds)), seed)
    return out


def main() -> None:
    p = parser(__doc__ or "")
    p.add_argument("--seconds", type=float, default=None, help="seconds of arrivals per rate")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()
    seconds = args.seconds or (3.0 if args.quick else 15.0)
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    sink = ctx.Process(target=_sink_main, args=(child,), daemon=True)
    sink.start()
    try:
        if not parent.poll(30):
            raise SystemExit("error: the sink server did not start")
        port = parent.recv()
        result = uvloop.run(run(f"http://127.0.0.1:{port}", seconds, args.seed))
    finally:
        parent.send("stop")
        sink.join(5)
        if sink.is_alive():
            sink.terminate()
    for key, value in result.items():
        print(f"{key}: {json.dumps(value)}")
    summary = {f"p99_send_lag_ms_at_{int(r)}": result[f"rate_{int(r)}"]["send_lag_wall_ms"]["p99"] for r in RATES}
    summary.update({f"p99_timer_idle_ms_at_{int(r)}": result[f"rate_{int(r)}"]["timer_idle_wall_ms"]["p99"]
                    for r in RATES})
    emit({"bench": "replay", **summary, **result})


if __name__ == "__main__":
    main()

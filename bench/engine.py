"""Engines on a real local Ray cluster: fidelity at low load, capacity of this machine, start-up and memory.

Figures, each beside its same-run baseline:
- fidelity: a client's measured TTFT and TPOT of isolated requests against the cost model's prediction
  (ratio), with the engines' step lag p50/p99;
- capacity: the highest output-token rate streamed to clients through the router that 4 and 8 emulated
  GPUs sustain with step-lag p99 <= 5 ms, closed-loop concurrency doubling until the lag bound breaks,
  at time_scale 1.0, 0.5 and 2.0 (``--quick``: 4 GPUs at 1.0 only); baseline: the ideal rate the cost
  model gives for the same batch sizes;
- start-up: seconds from launch to every engine healthy, and resident memory per worker actor.
"""

from __future__ import annotations

import asyncio
import json
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import aiohttp
import numpy as np
import orjson
import ray

from actors.cost_model import RooflineCostModel, StepShape, request_colocated
from bench._common import emit, parser
from cluster.launch import ClusterHandle, launch, start_local_ray
from config import ClusterSpec, default_catalog

LAG_BOUND_MS = 5.0
PROMPT, OUTPUT = 512, 128


def spec(gpus: int, scale: float) -> ClusterSpec:
    return ClusterSpec.model_validate({
        "name": f"bench-{gpus}xh100", "time_scale": scale,
        "nodes": [{"name": "n0", "region": "local", "hardware": "h100-80g-sxm", "gpus": gpus,
                   "engines": [{"name": "e", "model": "llama-3.1-8b", "replicas": gpus}]}],
        "router": {"policy": "least_loaded"}})


def prompt(rng: np.random.Generator, n: int) -> list[int]:
    """``n`` random token ids (numpy: a 512-token prompt in 30 us, not the 290 us of ``random.randrange`` calls,
    which were a third of the load generator's CPU per token)."""
    return list(rng.integers(16, 128000, n).tolist())


class Tally:
    """Text events that arrived within ``[start, stop)`` (monotonic seconds): the closed loop's sustained rate."""

    def __init__(self, start: float, stop: float) -> None:
        self.start, self.stop, self.n = start, stop, 0

    def add(self, k: int, now: float) -> None:
        if self.start <= now < self.stop:
            self.n += k


def text_events(buf: bytes, piece: bytes) -> tuple[int, bytes]:
    """The text events (``data: {...}`` with a ``"text"``) that ``piece`` completes after ``buf`` (what the reads
    before left of an event), and what is left of an event now. A read of one whole event (the router's usual
    write) is counted as it came, without concatenating or splitting it."""
    if buf:
        piece = buf + piece
    end = piece.find(b"\n\n")
    if end < 0:
        return 0, piece
    if end == len(piece) - 2:
        return (1 if piece.startswith(b"data: {") and b'"text"' in piece else 0), b""
    *events, rest = piece.split(b"\n\n")
    return sum(1 for e in events if e.startswith(b"data: {") and b'"text"' in e), rest


async def stream_one(s: aiohttp.ClientSession, url: str, body: dict[str, Any],
                     tally: Tally | None = None) -> tuple[float, float, int]:
    """Send one streamed request: seconds to the first text event, seconds from it to the end, text events
    (each also counted in ``tally`` at its arrival).

    The body is read as it arrives (``readany``) and split into SSE events here (``text_events``): reading it
    line by line (``async for line in r.content``) made two buffered reads per token, the load generator's
    largest cost."""
    t0 = time.monotonic()
    first = 0.0
    n = 0
    buf = b""
    async with s.post(url, data=orjson.dumps(body), headers=JSON_HEADERS) as r:
        content = r.content
        while piece := await content.readany():
            k, buf = text_events(buf, piece)
            if k:
                now = time.monotonic()
                if n == 0:
                    first = now
                n += k
                if tally is not None:
                    tally.add(k, now)
    return first - t0, time.monotonic() - first, n


JSON_HEADERS = {"Content-Type": "application/json"}
WARMUP_FRACTION, WARMUP_MAX_S = 0.25, 1.0
"""The first quarter of a closed-loop level (at most 1 s) is not counted in its rate: every user starts at once
(a burst of prefills no steady state has)."""


async def closed_loop(url: str, concurrency: int, duration_s: float, seed: int) -> dict[str, float]:
    """``concurrency`` users each sending the next request when its last one ended, for ``duration_s``.

    ``rate_tok_s``: text events that arrived within the level after its warm-up, per second of that window (the
    sustained rate; the requests still running at the end finish but are not counted: counting them over the
    wall time that includes their drain, at ever fewer users, understated a 4 s level by up to ~10%).
    ``tokens`` and ``wall_s`` count everything, for the CPU per token."""
    rng = np.random.default_rng(seed)
    tokens = 0
    t0 = time.monotonic()
    stop = t0 + duration_s
    tally = Tally(t0 + min(WARMUP_MAX_S, WARMUP_FRACTION * duration_s), stop)

    async def user(s: aiohttp.ClientSession) -> None:
        nonlocal tokens
        while time.monotonic() < stop:
            body = {"prompt": prompt(rng, PROMPT), "max_tokens": OUTPUT, "ignore_eos": True, "stream": True}
            _, _, n = await stream_one(s, url + "/v1/completions", body, tally)
            tokens += n

    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0),
                                     timeout=aiohttp.ClientTimeout(total=600)) as s:
        await asyncio.gather(*(user(s) for _ in range(concurrency)))
    wall = time.monotonic() - t0
    return {"tokens": tokens, "wall_s": wall, "rate_tok_s": tally.n / (tally.stop - tally.start),
            "rate_over_wall_tok_s": tokens / wall}


def lag_of(h: ClusterHandle) -> dict[str, float]:
    """Step lag since the last ``reset_lag``: p50/p99/max over every step of every engine (pooled, as the load
    test's histogram takes it), and the worst single engine's p99.

    The bound applies to the pooled p99. The worst engine's p99 (the figure before) grows with the number of
    engines alone: at 64 GPUs and 8 streams each engine runs a few hundred steps of a level, so its p99 is
    about its third-worst step, and the worst of 64 such is the cluster's p99.98, not its p99."""
    lags = np.asarray([x for part in ray.get([w.lag_samples.remote() for w in h.workers], timeout=60)
                       for x in part])
    load = h.load()
    worst = max((v["lag_p99_ms"] for v in load.values()), default=0.0)
    if lags.size == 0:
        return {"p50": 0.0, "p99": 0.0, "max": 0.0, "worst_engine_p99": worst}
    p50, p99 = np.percentile(lags, [50, 99])
    return {"p50": float(p50), "p99": float(p99), "max": float(lags.max()), "worst_engine_p99": worst}


def ideal_rate(gpus: int, concurrency: int, scale: float) -> float:
    """Output tokens per wall second the cost model allows when each engine decodes its share of the users.

    Per engine and cycle of its ``per`` users (each a prefill then ``OUTPUT`` tokens): ``OUTPUT`` steps of
    ``per`` decodes, ``per`` of which also carry one user's prefill (the step that admits a user is that long
    for all its users, with chunked prefill). Counting the prefill once per request as if it ran apart (the
    figure before) overstated 48 users on 4 GPUs by 9% (6,895 against 6,352 tok/s)."""
    cat = default_catalog()
    cm = RooflineCostModel(cat.hardware.get("h100-80g-sxm"), cat.models.get("llama-3.1-8b"), 1)
    per = -(-concurrency // gpus)  # users on the busiest engine
    ctx = PROMPT + OUTPUT // 2
    step = cm.step(StepShape.of(decodes=[ctx] * per)).total_ms
    with_prefill = cm.step(StepShape.of(prefills=[(PROMPT, 0)], decodes=[ctx] * (per - 1))).total_ms
    cycle_ms = OUTPUT * step + per * (with_prefill - step)
    return concurrency * OUTPUT / (cycle_ms / 1000.0) / scale


def fidelity(h: ClusterHandle, scale: float) -> dict[str, Any]:
    cat = default_catalog()
    cm = RooflineCostModel(cat.hardware.get("h100-80g-sxm"), cat.models.get("llama-3.1-8b"), 1)
    expected = request_colocated(cm, 4000, 64, 8192)
    rng = np.random.default_rng(1)

    async def main() -> list[tuple[float, float, int]]:
        async with aiohttp.ClientSession() as s:
            return [await stream_one(s, h.router_url + "/v1/completions",
                                     {"prompt": prompt(rng, 4000), "max_tokens": 64, "ignore_eos": True,
                                      "stream": True}) for _ in range(5)]

    ray.get([w.reset_lag.remote() for w in h.workers])
    runs = asyncio.run(main())
    ttft = sorted(r[0] * 1000 / scale for r in runs)[2]
    tpot = sorted(r[1] * 1000 / scale / 63 for r in runs)[2]
    return {"ttft_ms": round(ttft, 2), "ttft_model_ms": round(expected.ttft_ms, 2),
            "ttft_ratio": round(ttft / expected.ttft_ms, 4), "tpot_ms": round(tpot, 3),
            "tpot_model_ms": round(expected.tpot_ms, 3), "tpot_ratio": round(tpot / expected.tpot_ms, 4),
            "step_lag_ms": lag_of(h)}


def cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of a process (/proc/<pid>/stat fields 14-17, children included)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return sum(int(x) for x in fields[11:15]) / os.sysconf("SC_CLK_TCK")


def process_pids(h: ClusterHandle) -> list[int]:
    """Every process of the emulated cluster on this host: worker actors and routers."""
    return [*h.worker_pids, *(int(ray.get(r.pid.remote(), timeout=30)) for r in h.routers.values())]


def run_and_wait_s(pids: list[int]) -> tuple[float, float]:
    """Seconds the processes' threads ran, and waited runnable for a core (``/proc/<pid>/task/*/schedstat``):
    the second is the host contention an engine's step lag comes from."""
    run = wait = 0
    for pid in pids:
        for task in Path(f"/proc/{pid}/task").iterdir():
            try:
                fields = (task / "schedstat").read_text().split()
            except OSError:  # a thread that ended
                continue
            run, wait = run + int(fields[0]), wait + int(fields[1])
    return run / 1e9, wait / 1e9


def main_thread_run_and_wait_s() -> tuple[float, float]:
    """``run_and_wait_s`` of this process's main thread alone: the load generator's loop (the Ray driver's own
    threads left out)."""
    fields = Path(f"/proc/self/task/{os.getpid()}/schedstat").read_text().split()
    return int(fields[0]) / 1e9, int(fields[1]) / 1e9


LADDER = (2, 4, 8, 12, 16, 24, 32, 48, 64, 96, 128, 192, 256)
WARMUP_SEED = 0
"""The discarded warm-up's prompt seed: no level's (each level seeds its prompts with its concurrency, 2 or more),
so the first level does not resend the warm-up's prompts and find them in the engines' prefix caches."""
REFINE_FRACTION, REFINE_MIN_STREAMS = 0.125, 4
"""After the ladder breaks the lag bound, the gap between the last sustained level and the one that broke is
halved (bisection) while it is wider than ``REFINE_FRACTION`` of the sustained level and ``REFINE_MIN_STREAMS``."""


def refine(sustained: int, broke: int) -> int | None:
    """The next level to try between the highest sustained concurrency and the lowest that broke the bound, or
    None when they are close enough.

    Why: the ladder's top steps are 50% apart (64, 96, 128), so "the highest sustained rate" was known only to
    within a third: 4 GPUs sustained 96 streams (9,413 tok/s) and broke at 128 (12,227 tok/s, lag p99 7.35 ms),
    with nothing measured between. Every layout gets the same refinement, so a same-run ratio stays fair."""
    if broke <= sustained:
        raise ValueError(f"the level that broke ({broke}) must be above the sustained one ({sustained})")
    gap = broke - sustained
    if gap <= max(REFINE_MIN_STREAMS, REFINE_FRACTION * sustained):
        return None
    return sustained + gap // 2


class Fleet(Protocol):
    """What the capacity ladder drives: a router to stream through, the processes whose CPU it counts and the
    engines' step lag. ``RayFleet`` is a cluster this code launched; ``bench._filed.FiledFleet`` runs the code as it
    stood when issue 20 was filed."""

    @property
    def router_url(self) -> str: ...

    def process_groups(self) -> dict[str, list[int]]:
        """PIDs by role: ``engines`` (the worker actors) and ``router``."""
        ...

    def reset_lag(self) -> None: ...

    def lag(self) -> dict[str, float]:
        """Step lag since ``reset_lag``: ``p50``, ``p99`` (the bound's figure), ``max``, ``worst_engine_p99``."""
        ...


@dataclass
class RayFleet:
    """A cluster launched by this code (``launch``)."""

    h: ClusterHandle

    @property
    def router_url(self) -> str:
        return self.h.router_url

    def process_groups(self) -> dict[str, list[int]]:
        pids = process_pids(self.h)
        return {"engines": list(self.h.worker_pids), "router": pids[len(self.h.worker_pids):]}

    def reset_lag(self) -> None:
        ray.get([w.reset_lag.remote() for w in self.h.workers])

    def lag(self) -> dict[str, float]:
        return lag_of(self.h)


def capacity(fleet: Fleet, gpus: int, scale: float, quick: bool, levels_quick: int = 4,
             level_s: float | None = None, start: int | None = None, warmup_s: float | None = None) -> dict[str, Any]:
    """Closed-loop ladder; per level the rate, the lag and the CPU microseconds per output token end to end
    (worker actors + routers + this process, which runs the load generator). The ladder starts at ``start``
    concurrent streams (default: half the GPUs) and rises through ``LADDER`` until the lag bound breaks; then
    (not ``quick``) the levels between the last sustained one and the one that broke are bisected (``refine``).
    A warm-up at the first level (``warmup_s``: default 1 s with ``quick``, 2 s without) runs before the ladder and
    is discarded (its lag is reported as ``warmup``): a fresh fleet's first seconds (connections opened, pools
    filled, first collections) broke the bound at the first level of some runs, where the next levels held.
    ``levels`` are in the order measured. Each level's ``ran_waited_s``: seconds the engine processes, the
    routers and the load generator's loop (this process's main thread) ran, and waited runnable for a core,
    over the level (``run_and_wait_s``): a lag that grows with the engines' wait is the host's cores, not their
    own loop."""
    levels: list[dict[str, Any]] = []
    best: dict[str, Any] | None = None
    first = gpus // 2 if start is None else start
    ladder = [c for c in LADDER if c >= first]
    duration = level_s or (3.0 if quick else 10.0)
    groups = fleet.process_groups()
    pids = [p for group in groups.values() for p in group]

    def measure(conc: int) -> dict[str, Any]:
        fleet.reset_lag()
        sched0 = {k: run_and_wait_s(v) for k, v in groups.items()}
        gen0 = main_thread_run_and_wait_s()
        cpu0 = sum(cpu_seconds(p) for p in pids) + time.process_time()
        r = asyncio.run(closed_loop(fleet.router_url, conc, duration, conc))
        cpu = sum(cpu_seconds(p) for p in pids) + time.process_time() - cpu0
        gen1 = main_thread_run_and_wait_s()
        sched = {k: [round(x1 - x0, 2) for x0, x1 in zip(sched0[k], run_and_wait_s(v), strict=True)]
                 for k, v in groups.items()}
        sched["load_generator"] = [round(x1 - x0, 2) for x0, x1 in zip(gen0, gen1, strict=True)]
        lag = fleet.lag()
        row = {"concurrency": conc, "rate_tok_s": round(r["rate_tok_s"], 1),
               "rate_over_wall_tok_s": round(r["rate_over_wall_tok_s"], 1),
               "ideal_rate_tok_s": round(ideal_rate(gpus, conc, scale), 1), "lag_p99_ms": round(lag["p99"], 3),
               "lag_p99_worst_engine_ms": round(lag["worst_engine_p99"], 3), "lag_max_ms": round(lag["max"], 3),
               "cpu_us_per_token": round(cpu / max(1, r["tokens"]) * 1e6, 1), "cores": round(cpu / r["wall_s"], 3),
               "ran_waited_s": sched, "host_load_avg_1m": round(os.getloadavg()[0], 2)}
        levels.append(row)
        print(f"  {gpus} GPUs scale {scale}: {row}", flush=True)
        return row

    warm = (1.0 if quick else 2.0) if warmup_s is None else warmup_s
    warmup: dict[str, Any] | None = None
    if warm > 0 and ladder:
        fleet.reset_lag()
        w = asyncio.run(closed_loop(fleet.router_url, ladder[0], warm, WARMUP_SEED))
        lag = fleet.lag()
        warmup = {"concurrency": ladder[0], "seconds": warm,
                  "rate_over_wall_tok_s": round(w["rate_over_wall_tok_s"], 1),
                  "lag_p99_ms": round(lag["p99"], 3), "lag_max_ms": round(lag["max"], 3)}
        print(f"  {gpus} GPUs scale {scale}: warm-up (discarded) {warmup}", flush=True)
    broke: int | None = None
    for conc in ladder[:levels_quick] if quick else ladder:
        row = measure(conc)
        if row["lag_p99_ms"] > LAG_BOUND_MS:
            broke = conc
            break
        best = row
    while not quick and best is not None and broke is not None:
        conc_next = refine(best["concurrency"], broke)
        if conc_next is None:
            break
        row = measure(conc_next)
        if row["lag_p99_ms"] > LAG_BOUND_MS:
            broke = conc_next
        else:
            best = row
    return {"warmup": warmup, "levels": levels, "sustained_rate_tok_s": best["rate_tok_s"] if best else 0.0,
            "sustained_concurrency": best["concurrency"] if best else 0,
            "cpu_us_per_token_at_sustained": best["cpu_us_per_token"] if best else None,
            "ladder_ended_by_lag": broke is not None,
            "ideal_rate_at_that_concurrency": best["ideal_rate_tok_s"] if best else 0.0}


def main() -> None:
    args = parser(__doc__ or "").parse_args()
    start_local_ray()
    result: dict[str, Any] = {"bench": "engine", "lag_bound_ms": LAG_BOUND_MS}
    try:
        plans = [(4, 1.0)] if args.quick else [(4, 1.0), (8, 1.0), (4, 0.5), (4, 2.0), (8, 0.5), (8, 2.0)]
        for gpus, scale in plans:
            h = launch(spec(gpus, scale))
            try:
                key = f"{gpus}gpu_scale_{scale}"
                rss = ray.get([w.rss_bytes.remote() for w in h.workers])
                result[f"startup_s_{gpus}gpu"] = round(h.startup_s, 2)
                result[f"worker_rss_mib_{gpus}gpu"] = round(max(rss) / 2**20, 1)
                if scale == 1.0:
                    result[f"fidelity_{gpus}gpu"] = fidelity(h, scale)
                    print(f"fidelity {gpus} GPUs: {result[f'fidelity_{gpus}gpu']}", flush=True)
                result[f"capacity_{key}"] = capacity(RayFleet(h), gpus, scale, args.quick)
            finally:
                h.shutdown()
    finally:
        ray.shutdown()
    print(json.dumps(result, indent=1))
    emit(result)


if __name__ == "__main__":
    main()

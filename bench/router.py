"""The router: its overhead beside SGLang's Rust router, routing quality per policy, regions and residency.

Figures (each beside its same-run baseline):
- overhead: added latency p50/p99 of kvmesh's router over going straight to an engine, at concurrency
  1 and 32, beside sgl-router (``pip install sglang-router``; ``--policy cache_aware``) fronting the
  same engines, the three paths measured in alternating rounds; each router's CPU per request; the
  highest request rate each sustains (closed loop), beside the engines' own;
- quality: a slice of the Mooncake conversation trace on 8 emulated H100s (Llama-3.1-8B), the same rate,
  for every kvmesh policy and for sgl-router's cache_aware: prefix hit ratio, TTFT p50/p99, goodput;
- prefix: a prefix-heavy synthetic workload (shared prefixes of 2048 tokens, Poisson arrivals) on 4 emulated
  H100s whose KV caches are pinned small, the prefix working set swept from one engine's cache to 4x it
  (``--ratios``); kv_aware, sglang_cache_aware, sgl-router's cache_aware and round_robin, each on a fresh
  launch of the same spec: hit ratio, TTFT mean/p50/p99, goodput, step lag (with the trust threshold);
- regions: the lessons card's router comparison on 3 regions x 4 replicas: hit ratio, TTFT p50/p99 and
  cross-region requests for ROUND_ROBIN, REGIONAL and GLOBAL; then a run where one region's workers are
  killed midway: residency violations (must be 0).

``--quick`` measures the overhead (small counts) and, with ``--parts prefix``, one small sweep point;
``--parts`` and ``--policies`` pick what a full run measures; ``--parts profile`` adds where the router's
CPU goes by layer (``bench/router_profile.py``), ``--parts miss`` a cache miss's path span by span beside
sgl-router's (``bench/router_miss.py``); ``--parts prefix-virtual`` replays the prefix sweep on virtual
time (``bench/_router_virtual.py``: kvmesh's policies, several seeds, seconds per point, no Ray).
sgl-router runs from its own virtualenv (``.venv-sglang``, created with pip when missing; ``--no-sglang``
skips it, and the figures say so).
"""

from __future__ import annotations

import asyncio
import json
import os
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import aiohttp
import numpy as np
import ray

from bench._common import emit, parser, pct
from cluster.launch import ClusterHandle, launch, start_local_ray
from config import ClusterSpec

ROOT = Path(__file__).resolve().parents[1]
SGL_VENV = ROOT / ".venv-sglang"
MOONCAKE = ROOT.parent / "shared" / "traces" / "mooncake_fast25" / "conversation_trace.jsonl"
POLICIES = ("round_robin", "random", "least_loaded", "power_of_two", "session_affinity", "prefix_hash",
            "kv_aware", "sglang_cache_aware")


# -- sgl-router ------------------------------------------------------------------------------------------
def sglang_python(install: bool) -> str | None:
    py = SGL_VENV / "bin" / "python"
    if not py.exists() and install:
        subprocess.run([sys.executable, "-m", "venv", str(SGL_VENV)], check=True)
        subprocess.run([str(py), "-m", "pip", "install", "--quiet", "sglang-router"], check=False)
    if py.exists() and subprocess.run([str(py), "-c", "import sglang_router"], capture_output=True).returncode == 0:
        return str(py)
    return None


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class SGLangRouter:
    def __init__(self, py: str, worker_urls: list[str], policy: str = "cache_aware") -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        fd, self.log = tempfile.mkstemp(prefix="sglang-router-", suffix=".log")
        self.proc = subprocess.Popen([py, "-m", "sglang_router.launch_router", "--host", "127.0.0.1",
                                      "--port", str(self.port), "--worker-urls", *worker_urls, "--policy", policy,
                                      "--log-level", "error",
                                      # its Prometheus server binds 0.0.0.0:29000 unless told: two sgl-routers at
                                      # once (a test beside a bench) then fail to start; ours is loopback, any port
                                      "--prometheus-host", "127.0.0.1", "--prometheus-port", str(free_port())],
                                     stdout=fd, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 60
        while True:
            try:
                urllib.request.urlopen(self.url + "/health", timeout=1)
                return
            except OSError:
                if time.monotonic() > deadline or self.proc.poll() is not None:
                    self.stop()
                    raise RuntimeError(f"sgl-router did not start (log: {self.log})") from None
                time.sleep(0.2)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                self.proc.kill()


# -- overhead ----------------------------------------------------------------------------------------------
def cpu_seconds(pid: int) -> float:
    """User + system CPU of a process and its waited-for children so far (``/proc``)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return sum(int(x) for x in fields[11:15]) / os.sysconf("SC_CLK_TCK")


def idle_cpu_rate(pids: dict[str, int], seconds: float = 4.0) -> dict[str, float]:
    """CPU seconds per second each process burns with no request (Ray's threads, feeds, health checks)."""
    c0 = {k: cpu_seconds(p) for k, p in pids.items()}
    time.sleep(seconds)
    return {k: (cpu_seconds(p) - c0[k]) / seconds for k, p in pids.items()}


def small_spec(n: int, scale: float) -> ClusterSpec:
    return ClusterSpec.model_validate({
        "name": "bench-router", "time_scale": scale,
        "nodes": [{"name": "n0", "region": "local", "hardware": "h100-80g-sxm", "gpus": n,
                   "engines": [{"name": "e", "model": "llama-3.1-8b", "replicas": n}]}],
        "router": {"policy": "least_loaded"}})


async def latencies(session: aiohttp.ClientSession, targets: list[str], concurrency: int, n: int) -> list[float]:
    """Wall ms of ``n`` one-token requests (text prompt, with a model name) at ``concurrency``."""
    out: list[float] = []
    counter = iter(range(n))
    body_base = {"model": "llama-3.1-8b", "max_tokens": 1, "ignore_eos": True}

    async def user(s: aiohttp.ClientSession, k: int) -> None:
        for i in counter:
            url = targets[(i + k) % len(targets)]
            body = json.dumps({**body_base, "prompt": f"request {i} " + "word " * 12}).encode()
            t0 = time.perf_counter()
            async with s.post(url + "/v1/completions", data=body, headers={"Content-Type": "application/json"}) as r:
                await r.read()
                if r.status != 200:
                    raise RuntimeError(f"{url}: HTTP {r.status}")
            out.append((time.perf_counter() - t0) * 1000.0)

    await asyncio.gather(*(user(session, k) for k in range(concurrency)))
    return out


async def interleaved(paths: dict[str, list[str]], concurrency: int, n: int, rounds: int = 6) -> dict[str, list[float]]:
    """``n`` requests per path at ``concurrency``, in rounds of each path in turn, so the host's drift
    (this VM's speed wanders by tens of percent over a minute) weighs on every path alike. One warm
    connection pool per path: no connect in the figures."""
    sessions = {name: aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) for name in paths}
    try:
        for name, targets in paths.items():
            await latencies(sessions[name], targets, concurrency, concurrency * 4)
        samples: dict[str, list[float]] = {name: [] for name in paths}
        for _ in range(rounds):
            for name, targets in paths.items():
                samples[name] += await latencies(sessions[name], targets, concurrency, n // rounds)
        return samples
    finally:
        for s in sessions.values():
            await s.close()


def rate(targets: list[str], concurrency: int, seconds: float) -> float:
    async def main() -> float:
        done = 0
        stop = time.monotonic() + seconds

        async def user(s: aiohttp.ClientSession, k: int) -> None:
            nonlocal done
            i = k
            while time.monotonic() < stop:
                body = json.dumps({"model": "llama-3.1-8b", "max_tokens": 1, "prompt": f"r {i} x y"}).encode()
                async with s.post(targets[i % len(targets)] + "/v1/completions", data=body,
                                  headers={"Content-Type": "application/json"}) as r:
                    await r.read()
                done += 1
                i += concurrency

        t0 = time.monotonic()
        async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as s:
            await asyncio.gather(*(user(s, k) for k in range(concurrency)))
        return done / (time.monotonic() - t0)

    return asyncio.run(main())


def overhead(quick: bool, sgl_py: str | None) -> dict[str, Any]:
    out: dict[str, Any] = {}
    with launch(small_spec(2, 1.0)) as h:
        engines = list(h.engine_urls.values())
        sgl = SGLangRouter(sgl_py, engines) if sgl_py else None
        try:
            paths = {"direct": engines, "kvmesh": [h.router_url]}
            if sgl is not None:
                paths["sglang"] = [sgl.url]
            pids = {"kvmesh": ray.get(next(iter(h.routers.values())).pid.remote())}
            if sgl is not None:
                pids["sglang"] = sgl.proc.pid
            time.sleep(3.0)  # past start-up (feeds connecting, sgl-router's first health checks)
            idle = idle_cpu_rate(pids)
            for conc, n in ((1, 60 if quick else 600), (32, 192 if quick else 1920)):
                c0 = {k: cpu_seconds(p) for k, p in pids.items()}
                t0 = time.monotonic()
                samples = asyncio.run(interleaved(paths, conc, n))
                wall = time.monotonic() - t0
                row: dict[str, Any] = {name: pct(v) for name, v in samples.items()}
                # Each router's CPU over the run per request it proxied, and the part of that its idle
                # rate accounts for (Ray's threads, health checks: sgl-router's wanders run to run).
                row["router_cpu_ms_per_request"] = {
                    k: {"all": round((cpu_seconds(p) - c0[k]) / len(samples[k]) * 1000.0, 3),
                        "idle_share": round(idle[k] * wall / len(samples[k]) * 1000.0, 3)}
                    for k, p in pids.items()}
                for name in ("kvmesh", "sglang"):
                    if name in row:
                        row[f"{name}_added_p50_ms"] = round(row[name]["p50"] - row["direct"]["p50"], 3)
                        row[f"{name}_added_p99_ms"] = round(row[name]["p99"] - row["direct"]["p99"], 3)
                if "sglang" in row:
                    # The goal: kvmesh's added p50 at most 1.5x sgl-router's. At concurrency 32 sgl-router's
                    # "added" latency can be negative (requests through it reach the engines in step and
                    # batch better), where a ratio means nothing: the difference in ms says it then.
                    ks, ss = row["kvmesh_added_p50_ms"], row["sglang_added_p50_ms"]
                    row["ratio_added_p50_kvmesh_vs_sglang"] = round(ks / ss, 3) if ss >= 0.1 else None
                    row["kvmesh_minus_sglang_p50_ms"] = round(ks - ss, 3)
                out[f"concurrency_{conc}"] = row
                print(f"overhead at concurrency {conc}: {row}", flush=True)
        finally:
            if sgl is not None:
                sgl.stop()
    # Highest request rate: engines fast (time scale 0.02), so routers and clients are the limit.
    with launch(small_spec(2, 0.02)) as h:
        engines = list(h.engine_urls.values())
        sgl = SGLangRouter(sgl_py, engines, "round_robin") if sgl_py else None
        try:
            secs = 3.0 if quick else 10.0
            rates = {"direct": rate(engines, 64, secs), "kvmesh": rate([h.router_url], 64, secs)}
            if sgl is not None:
                rates["sglang"] = rate([sgl.url], 64, secs)
            out["max_rate_rps"] = {k: round(v, 1) for k, v in rates.items()}
            out["max_rate_ratio_kvmesh_vs_direct"] = round(rates["kvmesh"] / rates["direct"], 3)
            if "sglang" in rates:
                out["max_rate_ratio_kvmesh_vs_sglang"] = round(rates["kvmesh"] / rates["sglang"], 3)
            print(f"max rate: {out['max_rate_rps']}", flush=True)
        finally:
            if sgl is not None:
                sgl.stop()
    return out


# -- routing quality -------------------------------------------------------------------------------------
QUALITY_TIME_SCALE = 3.0
"""Eight engines, the router and the client share two cores here: the run goes three times slower than
real time so that the emulation keeps up (step lag is reported beside every row)."""


def quality_spec(policy: str) -> ClusterSpec:
    return ClusterSpec.model_validate({
        "name": f"bench-quality-{policy}", "time_scale": QUALITY_TIME_SCALE, "gpus_per_actor": 2,
        "nodes": [{"name": "n0", "region": "local", "hardware": "h100-80g-sxm", "gpus": 8,
                   "engines": [{"name": "e", "model": "llama-3.1-8b", "replicas": 8}]}],
        "router": {"policy": policy if policy != "sglang-router" else "least_loaded"}})


def replay_summary(url: str, trace: Any, name: str, speed: float, slos: dict[str, float],
                   time_scale: float = 1.0, folder: Path | None = None) -> dict[str, Any]:
    from cluster.loadtest.client import ClientConfig
    from cluster.loadtest.replay import ReplayConfig
    from cluster.loadtest.session import LoadTestConfig, run_loadtest, run_sync

    cfg = LoadTestConfig(name=name, replay=ReplayConfig(speed=speed), slos=slos, progress=False, plots=False,
                         client=ClientConfig(model="llama-3.1-8b", prompt_format="text", time_scale=time_scale))
    return run_sync(run_loadtest(url, trace, cfg, out_root=None, folder=folder)).summary


def quality(sgl_py: str | None, seconds: float, speed: float,
            policies: tuple[str, ...] = (*POLICIES, "sglang-router")) -> dict[str, Any]:
    from cluster.loadtest.formats import ReadOptions, read_trace
    from cluster.loadtest.schedule import window
    from cluster.loadtest.spec import TraceData

    if not MOONCAKE.exists():
        return {"skipped": f"{MOONCAKE} is absent"}
    full = read_trace(MOONCAKE, "mooncake", ReadOptions(block_size=512))
    specs = window(full.requests, 0.0, seconds)
    trace = TraceData(str(MOONCAKE), "mooncake", specs, block_size=512)
    slos = {"ttft": 2000.0, "tpot": 50.0}
    rows: dict[str, Any] = {"requests": len(specs), "speed": speed, "slos_ms": slos}
    for policy in (p for p in policies if p != "sglang-router" or sgl_py):
        with launch(quality_spec(policy)) as h:
            url = h.router_url
            sgl = SGLangRouter(sgl_py, list(h.engine_urls.values())) if policy == "sglang-router" and sgl_py else None
            try:
                s = replay_summary(sgl.url if sgl else url, trace, policy, speed, slos, QUALITY_TIME_SCALE)
                # The engines' own counters give the hit ratio whatever router is in front.
                hits = prefix_hits(h)
            finally:
                if sgl is not None:
                    sgl.stop()
        rows[policy] = {"prefix_hit_ratio": round(hits, 4), "ttft_ms": s["ttft_ms"],
                        "goodput_rps": s.get("request_goodput"), "slo_attainment": s.get("slo_attainment"),
                        "completed": s["completed"], "failed": s["failed"], "step_lag_ms": s.get("step_lag_ms")}
        print(f"quality {policy}: {rows[policy]}", flush=True)
    return rows


def prefix_hits(h: ClusterHandle) -> float:
    q = sum(engine_counters(h, "vllm:prefix_cache_queries_total").values())
    hit = sum(engine_counters(h, "vllm:prefix_cache_hits_total").values())
    return hit / q if q else 0.0


def engine_counters(h: ClusterHandle, name: str) -> dict[str, float]:
    """One counter summed over its labels, per engine, from the engines' own ``/metrics`` (so whatever
    router is in front, including sgl-router, which names no worker in its responses)."""
    from prometheus_client.parser import text_string_to_metric_families

    out: dict[str, float] = {}
    for engine, url in h.engine_urls.items():
        out[engine] = 0.0
        for fam in text_string_to_metric_families(urllib.request.urlopen(url + "/metrics").read().decode()):
            out[engine] += sum(s.value for s in fam.samples if s.name == name)
    return out


# -- prefix-heavy sweep ----------------------------------------------------------------------------------
PREFIX_TIME_SCALE = 2.0
"""Four engines (two per actor), the router, sgl-router and the load generator share two cores: the run goes
at half speed so the engines' step lag stays under the report's trust threshold (checked per row)."""
PREFIX_ENGINE_BLOCKS = 1024
"""KV blocks per engine (16 tokens each: 16384 tokens), pinned so a sweep to 4x fits in a short run."""
PREFIX_LEN = 2048
PREFIX_POLICIES = ("kv_aware", "sglang_cache_aware", "sglang-router", "round_robin")


def prefix_spec(policy: str) -> ClusterSpec:
    return ClusterSpec.model_validate({
        "name": f"bench-prefix-{policy}", "time_scale": PREFIX_TIME_SCALE, "gpus_per_actor": 2,
        "nodes": [{"name": "n0", "region": "local", "hardware": "h100-80g-sxm", "gpus": 4,
                   "engines": [{"name": "e", "model": "llama-3.1-8b", "replicas": 4,
                                "scheduler": {"num_gpu_blocks": PREFIX_ENGINE_BLOCKS}}]}],
        "router": {"policy": policy if policy != "sglang-router" else "round_robin"}})


def prefix_workload(ratio: float, n: int, rate: float, seed: int, offset: int) -> Any:
    """Shared prefixes whose total size is ``ratio`` x one engine's KV cache; every request extends one of
    them (uniformly) by 128 fresh tokens. ``offset`` shifts every block id, so runs on the same engines
    share no content while their structure stays identical."""
    import dataclasses

    from cluster.loadtest.spec import TraceData
    from cluster.loadtest.synthetic import SyntheticSpec, generate

    num_prefixes = max(1, round(ratio * PREFIX_ENGINE_BLOCKS * 16 / PREFIX_LEN))
    spec = SyntheticSpec.model_validate({
        "num_requests": n, "rate": rate, "input_len": {"kind": "fixed", "mean": 128},
        "output_len": {"kind": "uniform", "mean": 32, "spread": 16},
        "prefixes": {"num_prefixes": num_prefixes, "prefix_len": PREFIX_LEN}, "seed": seed})
    reqs = [dataclasses.replace(r, hash_ids=tuple(h + offset for h in r.hash_ids))
            for r in generate(spec, np.random.default_rng(seed))]
    return TraceData(f"prefix-heavy x{ratio}", "synthetic", tuple(reqs), block_size=16), num_prefixes


def prefix_heavy(sgl_py: str | None, ratios: list[float], n: int, rate: float,
                 policies: tuple[str, ...] = PREFIX_POLICIES, seed_shift: int = 0,
                 records: Path | None = None) -> dict[str, Any]:
    """The sweep; ``seed_shift`` moves every point's workload seed (default: the ratio x 100), ``records``
    keeps each run's folder (per-request records, which worker served each) under it."""
    from cluster.loadtest.session import LoadTestConfig

    slos = {"ttft": 1000.0, "tpot": 50.0}
    threshold = LoadTestConfig(name="x").step_lag_threshold_ms
    out: dict[str, Any] = {"engine_kv_tokens": PREFIX_ENGINE_BLOCKS * 16, "prefix_len": PREFIX_LEN,
                           "requests": n, "rate_rps": rate, "slos_ms": slos, "time_scale": PREFIX_TIME_SCALE,
                           "step_lag_threshold_ms": threshold, "seed_shift": seed_shift}
    for ratio in ratios:
        row: dict[str, Any] = {}
        for k, policy in enumerate(p for p in policies if p != "sglang-router" or sgl_py):
            trace, num_prefixes = prefix_workload(ratio, n, rate, seed=int(ratio * 100) + seed_shift,
                                                  offset=k * 10_000_000)
            row["num_prefixes"] = num_prefixes
            with launch(prefix_spec(policy)) as h:
                sgl = SGLangRouter(sgl_py, list(h.engine_urls.values())) if policy == "sglang-router" and sgl_py \
                    else None
                try:
                    s = replay_summary(sgl.url if sgl else h.router_url, trace, f"prefix-{policy}", 1.0, slos,
                                       PREFIX_TIME_SCALE,
                                       records / f"x{ratio:g}-s{seed_shift}-{policy}" if records else None)
                    hits = prefix_hits(h)
                    served = engine_counters(h, "vllm:request_success_total")
                finally:
                    if sgl is not None:
                        sgl.stop()
            ttft = s["ttft_ms"]
            lag = s.get("step_lag_ms") or {}
            row[policy] = {"prefix_hit_ratio": round(hits, 4),
                           "ttft_mean_ms": ttft.get("mean"), "ttft_p50_ms": ttft.get("p50"),
                           "ttft_p99_ms": ttft.get("p99"), "goodput_rps": s.get("request_goodput"),
                           "completed": s["completed"], "failed": s["failed"], "step_lag_ms": lag,
                           "requests_per_engine": sorted(int(v) for v in served.values()),
                           "trusted": lag.get("p99") is not None and float(lag["p99"]) <= threshold}
            print(f"prefix x{ratio} {policy}: {row[policy]}", flush=True)
        if "kv_aware" in row and "sglang-router" in row:
            kv, sg = row["kv_aware"], row["sglang-router"]
            row["kv_aware_vs_sglang_router"] = {
                "hit_ratio_points": round((kv["prefix_hit_ratio"] - sg["prefix_hit_ratio"]) * 100, 2),
                "ttft_mean_ratio": round(kv["ttft_mean_ms"] / sg["ttft_mean_ms"], 3),
                "ttft_p99_ratio": round(kv["ttft_p99_ms"] / sg["ttft_p99_ms"], 3)}
            print(f"prefix x{ratio} kv_aware vs sgl-router: {row['kv_aware_vs_sglang_router']}", flush=True)
        out[f"x{ratio:g}"] = row
    return out


# -- regions and residency -------------------------------------------------------------------------------
REGIONS = ("us-east-1", "us-west-2", "eu-west-1")


REGIONS_TIME_SCALE = 2.0


def region_spec(strategy: str) -> ClusterSpec:
    return ClusterSpec.model_validate({
        "name": f"bench-regions-{strategy}", "time_scale": REGIONS_TIME_SCALE, "gpus_per_actor": 4,
        "regions": [{"name": r} for r in REGIONS],
        "nodes": [{"name": f"n-{r}", "region": r, "hardware": "h100-80g-sxm", "gpus": 4,
                   "engines": [{"name": f"e-{r}", "model": "llama-3.1-8b", "replicas": 4}]} for r in REGIONS],
        "router": {"policy": "kv_aware", "region_strategy": strategy, "region": REGIONS[0]}})


def region_workload(n: int, residency: float, seed: int) -> Any:
    from cluster.loadtest.spec import TraceData
    from cluster.loadtest.synthetic import SyntheticSpec, generate

    spec = SyntheticSpec.model_validate({
        "num_requests": n, "rate": 6.0, "input_len": {"kind": "fixed", "mean": 256},
        "output_len": {"kind": "fixed", "mean": 32}, "prefixes": {"num_prefixes": 24, "prefix_len": 4096},
        "origin_regions": dict.fromkeys(REGIONS, 1.0), "residency_ratio": residency, "seed": seed})
    return TraceData("synthetic regions", "synthetic", tuple(generate(spec, np.random.default_rng(seed))),
                     block_size=16)


def cross_region(url: str) -> float:
    from prometheus_client.parser import text_string_to_metric_families

    text = urllib.request.urlopen(url + "/metrics").read().decode()
    return sum(s.value for f in text_string_to_metric_families(text) for s in f.samples
               if s.name == "kvmesh_router_cross_region_total")


def regions(quick: bool) -> dict[str, Any]:
    n = 40 if quick else 150
    trace = region_workload(n, 0.0, 1)
    rows: dict[str, Any] = {"requests": n}
    for strategy in ("ROUND_ROBIN", "REGIONAL", "GLOBAL"):
        with launch(region_spec(strategy)) as h:
            s = replay_summary(h.router_url, trace, strategy, 1.0, {"ttft": 1000.0}, REGIONS_TIME_SCALE)
            rows[strategy] = {"prefix_hit_ratio": round(prefix_hits(h), 4), "ttft_ms": s["ttft_ms"],
                              "cross_region_requests": cross_region(h.router_url), "completed": s["completed"]}
        print(f"regions {strategy}: {rows[strategy]}", flush=True)
    # Residency while a region dies: half the requests carry a residency region; eu-west-1 is killed midway.
    from cluster.loadtest.client import ClientConfig
    from cluster.loadtest.replay import ReplayConfig
    from cluster.loadtest.session import LoadTestConfig, run_loadtest, run_sync

    trace = region_workload(n, 0.5, 2)
    with launch(region_spec("GLOBAL")) as h:
        region_of = {name: d["region"] for name, d in h.engines.items()}
        victim = next(name for name, d in h.engines.items() if d["region"] == "eu-west-1")
        killer = threading.Timer(n / 6.0 / 2.0 * REGIONS_TIME_SCALE, h.kill_engine_actor, args=(victim,))
        killer.start()
        cfg = LoadTestConfig(name="residency", replay=ReplayConfig(), progress=False, plots=False,
                             client=ClientConfig(model="llama-3.1-8b", time_scale=REGIONS_TIME_SCALE))
        result = run_sync(run_loadtest(h.router_url, trace, cfg, out_root=None))
        killer.join()
        records = result.runs[0].result.records
    residency = {s.request_id: s.residency_region for s in trace.requests if s.residency_region}
    served = [(r.request_id, r.worker) for r in records if r.request_id in residency and r.worker]
    violations = sum(1 for rid, w in served if region_of.get(w.split(":")[0], "?") != residency[rid])
    failed = [r for r in records if r.status != "ok"]
    rows["residency_run"] = {"tagged_requests": len(residency), "tagged_served": len(served),
                             "residency_violations": violations, "completed": result.summary["completed"],
                             "failed": result.summary["failed"], "killed": victim,
                             "failed_by_tag": {str(k): sum(1 for r in failed if residency.get(r.request_id) == k)
                                               for k in {None, *residency.values()}},
                             "failed_by_http_status": {str(k): sum(1 for r in failed if r.http_status == k)
                                                       for k in {r.http_status for r in failed}}}
    print(f"residency: {rows['residency_run']}", flush=True)
    return rows


def main() -> None:
    p = parser(__doc__ or "")
    p.add_argument("--no-sglang", action="store_true", help="do not install or run sgl-router")
    p.add_argument("--seconds", type=float, default=90.0, help="Mooncake slice length (trace seconds)")
    p.add_argument("--speed", type=float, default=1.0, help="Mooncake replay speed")
    p.add_argument("--parts", default="overhead,quality,regions",
                   help="which parts to run (comma-separated; 'profile' adds bench/router_profile.py's CPU profile, "
                        "'miss' bench/router_miss.py's miss path span by span)")
    p.add_argument("--ratios", default="1,2,4",
                   help="prefix part: working set / one engine's KV cache, per sweep point (comma-separated)")
    p.add_argument("--prefix-requests", type=int, default=300, help="prefix part: requests per run")
    p.add_argument("--prefix-rate", type=float, default=10.0, help="prefix part: arrivals per emulated second")
    p.add_argument("--prefix-policies", default=",".join(PREFIX_POLICIES),
                   help="prefix part: routers compared (comma-separated; sglang-router is sgl-router's cache_aware)")
    p.add_argument("--prefix-seed", type=int, default=0, help="prefix part: added to every point's workload seed")
    p.add_argument("--records", type=Path, default=None,
                   help="prefix part: keep each run's folder (per-request records) under this directory")
    p.add_argument("--virtual-seeds", default="0,1",
                   help="prefix-virtual part (bench/_router_virtual.py): seeds added to every point's seed")
    p.add_argument("--policies", default=",".join((*POLICIES, "sglang-router")),
                   help="the quality part's policies (comma-separated; sglang-router is sgl-router's cache_aware)")
    args = p.parse_args()
    parts = set(args.parts.split(","))
    live = bool(parts & {"overhead", "quality", "prefix", "regions"})  # the parts that launch clusters on Ray
    sgl_py = None if args.no_sglang or not live else sglang_python(install=not args.quick)
    if live:
        start_local_ray()
    result: dict[str, Any] = {"bench": "router", "sglang_router": sgl_py is not None}
    if sgl_py is None:
        result["note"] = "sgl-router not available (--no-sglang, or not installed in --quick): its figures are absent"
    try:
        if "overhead" in parts:
            result["overhead"] = overhead(args.quick, sgl_py)
        if not args.quick and "quality" in parts:
            result["quality"] = quality(sgl_py, args.seconds, args.speed, tuple(args.policies.split(",")))
        if "prefix" in parts:
            ratios = [2.0] if args.quick else [float(r) for r in args.ratios.split(",")]
            result["prefix"] = prefix_heavy(sgl_py, ratios, 60 if args.quick else args.prefix_requests,
                                            args.prefix_rate, tuple(args.prefix_policies.split(",")),
                                            args.prefix_seed, args.records)
        if "prefix-virtual" in parts:
            from bench._router_virtual import prefix_virtual

            ratios = [2.0] if args.quick else [float(r) for r in args.ratios.split(",")]
            result["prefix_virtual"] = prefix_virtual(ratios, [int(s) for s in args.virtual_seeds.split(",")],
                                                      60 if args.quick else args.prefix_requests, args.prefix_rate)
        if not args.quick and "regions" in parts:
            result["regions"] = regions(False)
        if "profile" in parts:
            from bench.router_profile import profile

            result["profile"] = profile(args.quick)
        if "miss" in parts:
            from bench.router_miss import miss_path

            result["miss"] = miss_path(args.quick, 90.0, None if args.no_sglang else sglang_python(install=False))
    finally:
        ray.shutdown()
    emit(result)


if __name__ == "__main__":
    main()

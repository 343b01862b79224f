"""The offload comparison live: the first seconds of the Mooncake conversation trace through a launched cluster
(Ray actors, router, HTTP, TCP transport, real tier and store bytes), NATIVE_ONLY against LMCACHE (and
CPU_OFFLOAD when named in ``--configs``).

Clusters: the presets ``config/presets/scenario-offload-native-only.yaml``, ``scenario-offload-cpu.yaml`` and
``scenario-offload-lmcache.yaml`` (4 x H100, Llama-3.1-8B, kv_aware; CPU_OFFLOAD adds a CPU tier per engine,
LMCACHE the CPU tier and the region's shared store), run at ``--time-scale`` (wall seconds per emulated second;
slow enough that step lag stays under the trust threshold: 3 held on a 2-core host, 2.5 did not always).
Each configuration is launched, run and shut down alone, so a run of N trace seconds takes about N x scale
wall seconds plus a minute per configuration (600 s at scale 3: ~31 min each).

Reported per configuration: the prefix hit ratio the engines counted (GPU prefix-cache hits plus external hits:
CPU tier and store, over prompt tokens queried, from the engines' vLLM counters before and after), TTFT p50/p99
in emulated ms, step lag p50/p99 (wall ms) and whether the run was flagged untrustworthy (with the load test's
notes); beside them the trace's ideal block hit ratio (an infinite cache, from its hash ids) as the baseline.
``--quick`` (about a minute): a 4 s slice with every answer cut to ``QUICK_MAX_OUTPUT`` tokens (12 s of wall
time per configuration at scale 3, plus its launch and the drain of its longest prefills: ~35 s a configuration
here; the offload figures are prompt-side: hit ratios and TTFT). A 20 s slice with the trace's own answers took
160 s, 6 s of it 104 s (answers of hundreds of tokens drained at scale 3). The last stdout line is one JSON
object.
"""

from __future__ import annotations

import dataclasses
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench._common import emit, parser

ROOT = Path(__file__).resolve().parent.parent
PRESETS = {"NATIVE_ONLY": "scenario-offload-native-only.yaml", "CPU_OFFLOAD": "scenario-offload-cpu.yaml",
           "LMCACHE": "scenario-offload-lmcache.yaml"}
TRACE = ROOT.parent / "shared" / "traces" / "mooncake_fast25" / "conversation_trace.jsonl"
QUICK_MAX_OUTPUT = 32


def run_one(config: str, seconds: float, time_scale: float, start_s: float,
            max_output: int | None = None) -> dict[str, Any]:
    from cluster.launch import launch
    from cluster.loadtest import ClientConfig, LoadTestConfig, ReplayConfig, read_trace, run_sync
    from cluster.loadtest.formats import ReadOptions
    from cluster.loadtest.scrape import counter_delta
    from cluster.loadtest.session import WorkloadSlice, run_loadtest
    from config import ClusterSpec
    from config.yamlio import read_yaml

    raw = read_yaml(ROOT / "config" / "presets" / PRESETS[config])
    spec = ClusterSpec.model_validate({**raw, "time_scale": time_scale})
    trace = read_trace(TRACE, "mooncake", ReadOptions(block_size=512))
    if max_output is not None:
        trace = dataclasses.replace(trace, requests=tuple(
            dataclasses.replace(r, output_len=min(r.output_len, max_output)) for r in trace.requests))
    cfg = LoadTestConfig(name=f"offload-live-{config.lower()}",
                         slice=WorkloadSlice(start_s=start_s, duration_s=seconds),
                         replay=ReplayConfig(), client=ClientConfig(time_scale=time_scale, request_timeout_s=600.0),
                         progress=False, plots=False)
    t0 = time.monotonic()
    with launch(spec) as h:
        result = run_sync(run_loadtest(h.router_url, trace, cfg, out_root=None))
    run = result.runs[0]
    s = run.summary
    before, after = run.result.before, run.result.after
    queries = counter_delta(before, after, "vllm:prefix_cache_queries") or 0.0
    gpu = counter_delta(before, after, "vllm:prefix_cache_hits") or 0.0
    ext = counter_delta(before, after, "vllm:external_prefix_cache_hits") or 0.0
    return {"config": config, "requests": s.get("completed"), "failed": s.get("failed"),
            "prefix_hit_ratio": round((gpu + ext) / queries, 4) if queries else None,
            "gpu_hit_ratio": round(gpu / queries, 4) if queries else None,
            "external_hit_ratio": round(ext / queries, 4) if queries else None,
            "ideal_block_hit_ratio": s.get("trace_ideal_block_hit_ratio"),
            "ttft_p50_ms": (s.get("ttft_ms") or {}).get("p50"), "ttft_p99_ms": (s.get("ttft_ms") or {}).get("p99"),
            "step_lag_ms": s.get("step_lag_ms"), "send_lag_wall_ms": s.get("send_lag_wall_ms"),
            "suggested_time_scale": s.get("suggested_time_scale"), "trustworthy": s.get("trustworthy"),
            "notes": s.get("notes"), "wall_s": round(time.monotonic() - t0, 1)}


def main() -> int:
    p = parser(__doc__.splitlines()[0])
    p.add_argument("--seconds", type=float, default=600.0, help="trace seconds to replay (default 600)")
    p.add_argument("--start", type=float, default=0.0, help="skip this many trace seconds")
    p.add_argument("--time-scale", type=float, default=3.0, help="wall seconds per emulated second")
    p.add_argument("--configs", default="NATIVE_ONLY,LMCACHE",
                   help=f"comma-separated subset of {','.join(PRESETS)}")
    args = p.parse_args()
    if not TRACE.exists():
        emit({"skipped": f"{TRACE} is absent (the shared data folder is not next to the checkout)"})
        return 0
    configs = [c for c in args.configs.split(",") if c]
    unknown = [c for c in configs if c not in PRESETS]
    if unknown:
        p.error(f"unknown configuration(s) {unknown} (known: {', '.join(PRESETS)})")
    seconds, max_output = (4.0, QUICK_MAX_OUTPUT) if args.quick else (args.seconds, None)
    rows = [run_one(c, seconds, args.time_scale, args.start, max_output) for c in configs]  # each launch owns its Ray
    emit({"trace": "mooncake conversation", "start_s": args.start, "seconds": seconds,
          "time_scale": args.time_scale, "max_output_tokens": max_output, "rows": rows})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""Disaggregated serving on one trace: push against pull, and what 5% failing KV transfers cost.

Figures (each beside its same-run baseline):
- push against pull: the same Poisson trace (lognormal prompts, fixed output) replayed on one prefill plus
  one decode engine (``lesson-70b-fp8``, joined by the card's 10 GB/s TCP link), hand-off by push and by
  pull: TTFT p50/p99, inter-token latency p99, end-to-end p50;
- failures: the same trace with 5% of KV transfers failing (drop, reset, hang, truncate, corrupt: 1% each),
  finishing on prefill and, in a second run, re-prefilling on decode: the fallback counts by cause, the
  transfer outcomes, requests completed and lost (must be 0), and whether every engine's free KV blocks
  came back to their baseline (no leak); beside the fault-free run's TTFT.

The hand-off gap is the first inter-token gap: the first token comes from prefill, the second from decode
after the KV arrived. ``--quick`` replays fewer requests and runs only the push fault run.
"""

from __future__ import annotations

import sys
import urllib.request
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import numpy as np
import ray

from bench._common import emit, parser
from cluster.launch import launch, start_local_ray
from cluster.loadtest.metrics import stats
from cluster.loadtest.scrape import parse_metrics
from config import ClusterSpec

TIME_SCALE = 2.0
FAULTS = {"drop": 0.01, "reset": 0.01, "hang": 0.01, "truncate": 0.01, "corrupt": 0.01}


def spec(hand_off: str, faults: dict[str, float] | None = None, on_failure: str = "prefill") -> ClusterSpec:
    engine = {"model": "lesson-70b-fp8", "scheduler": {"max_num_batched_tokens": 8192, "max_num_seqs": 256}}
    transport: dict[str, Any] = {"backend": "tcp", "kv_payload_scale": 1 / 256}
    if faults:
        transport["faults"] = {"seed": 11, "rates": faults}
    return ClusterSpec.model_validate({
        "name": f"bench-disagg-{hand_off}", "time_scale": TIME_SCALE,
        "nodes": [{"name": "np", "region": "local", "hardware": "h100-80g-sxm", "gpus": 1, "nic": "lesson-tcp",
                   "engines": [{"name": "p", "role": "prefill", **engine}]},
                  {"name": "nd", "region": "local", "hardware": "h100-80g-sxm", "gpus": 1, "nic": "lesson-tcp",
                   "engines": [{"name": "d", "role": "decode", **engine}]}],
        "transport": transport,
        "disagg": {"hand_off": hand_off, "on_transfer_failure": on_failure, "min_uncached_tokens": 0},
        "router": {"policy": "least_loaded"}})


def trace(n: int, seed: int) -> Any:
    from cluster.loadtest.spec import TraceData
    from cluster.loadtest.synthetic import SyntheticSpec, generate

    s = SyntheticSpec.model_validate({
        "num_requests": n, "rate": 3.0, "seed": seed,
        "input_len": {"kind": "lognormal", "mean": 3000, "spread": 0.6, "min": 600, "max": 16000},
        "output_len": {"kind": "fixed", "mean": 48}})
    return TraceData("bench-disagg", "synthetic", tuple(generate(s, np.random.default_rng(seed))), block_size=16)


def samples(url: str, name: str) -> dict[str, float]:
    """Every series of one metric (``_total`` left off), keyed by its labels (``k=v,...``)."""
    page = parse_metrics(urllib.request.urlopen(url + "/metrics").read().decode())
    return {",".join(f"{k}={v}" for k, v in key) or "all": value for key, value in page.series(name).items()}


def brief(stats: dict[str, float | None]) -> dict[str, float | None]:
    return {k: None if stats.get(k) is None else round(float(stats[k] or 0.0), 2) for k in ("p50", "p90", "p99")}


def replay(label: str, cluster: ClusterSpec, data: Any) -> dict[str, Any]:
    from cluster.loadtest.client import ClientConfig
    from cluster.loadtest.replay import ReplayConfig
    from cluster.loadtest.session import LoadTestConfig, run_loadtest, run_sync

    with launch(cluster) as h:
        cfg = LoadTestConfig(name=label, replay=ReplayConfig(), progress=False, plots=False,
                             client=ClientConfig(time_scale=TIME_SCALE))
        result = run_sync(run_loadtest(h.router_url, data, cfg, out_root=None))
        s = result.summary
        # The hand-off shows in the gap between the first token (from prefill) and the second (decode's).
        gaps = [r.itl_ms[0] for r in result.runs[0].result.records if r.itl_ms]
        row = {"requests": len(data.requests), "completed": s["completed"], "failed": s["failed"],
               **{k: brief(s[k]) for k in ("ttft_ms", "itl_ms", "e2e_ms")},
               "handoff_gap_ms": brief(stats(gaps)),
               "fallbacks": samples(h.router_url, "kvmesh_router_kv_fallbacks"),
               "decisions": samples(h.router_url, "kvmesh_router_disagg_decisions"),
               "transfers": {e: samples(u, "kvmesh:kv_transfers") for e, u in h.engine_urls.items()},
               "blocks_back_to_baseline": h.blocks_returned(20.0)}
    row["lost"] = row["requests"] - row["completed"]
    print(f"{label}: {row}", flush=True)
    return row


def main() -> None:
    args = parser(__doc__ or "").parse_args()
    n = 16 if args.quick else 150
    data = trace(n, 5)
    start_local_ray()
    result: dict[str, Any] = {"bench": "disagg", "time_scale": TIME_SCALE, "requests": n, "faults": FAULTS}
    try:
        push = replay("push", spec("push"), data)
        pull = replay("pull", spec("pull"), data)
        result["push"], result["pull"] = push, pull
        result["push_vs_pull"] = {
            "ttft_p50_ms": [push["ttft_ms"]["p50"], pull["ttft_ms"]["p50"]],
            "ttft_p99_ms": [push["ttft_ms"]["p99"], pull["ttft_ms"]["p99"]],
            "handoff_gap_p50_ms": [push["handoff_gap_ms"]["p50"], pull["handoff_gap_ms"]["p50"]],
            "itl_p99_ms": [push["itl_ms"]["p99"], pull["itl_ms"]["p99"]]}
        runs = [("push_faults_finish_on_prefill", "push", "prefill")]
        if not args.quick:
            runs += [("push_faults_reprefill_on_decode", "push", "decode"),
                     ("pull_faults_finish_on_prefill", "pull", "prefill")]
        for label, hand_off, target in runs:
            row = replay(label, spec(hand_off, FAULTS, target), data)
            base = push if hand_off == "push" else pull
            row["ttft_p99_ms_vs_fault_free"] = [row["ttft_ms"]["p99"], base["ttft_ms"]["p99"]]
            result[label] = row
    finally:
        ray.shutdown()
    emit(result)


if __name__ == "__main__":
    main()

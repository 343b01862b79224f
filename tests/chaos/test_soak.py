"""A bounded soak: seeded random kills and spot preemptions (each engine replaced) during 30 s of the Mooncake
conversation trace on four engines; the history checker over the result, and the soak's figures."""

from __future__ import annotations

from pathlib import Path

from cluster.chaos.run import run_chaos
from cluster.chaos.soak import DEFAULT_TRACE, SoakConfig, soak_figures, soak_schedule
from cluster.launch import launch
from cluster.loadtest import (
    ClientConfig,
    LoadTestConfig,
    ReadOptions,
    ReplayConfig,
    WorkloadSlice,
    read_trace,
    run_sync,
)
from config import ClusterSpec
from tests.conftest import shared_path

SPEC = {"name": "soak", "time_scale": 1.0,
        "nodes": [{"name": f"n{i}", "region": "local", "hardware": "h100-80g-sxm", "gpus": 1,
                   "engines": [{"name": f"e{i}", "model": "llama-3.1-8b"}]} for i in range(4)],
        "router": {"policy": "least_loaded"}}


def test_bounded_soak(ray_cluster: object, tmp_path: Path) -> None:
    trace_path = shared_path(*Path(DEFAULT_TRACE).parts[2:])
    cfg = SoakConfig(duration_s=30.0, every_s=5.0, notice_s=3.0, replace_after_s=2.0, seed=0)
    schedule = soak_schedule(cfg, [f"e{i}" for i in range(4)])
    assert schedule == soak_schedule(cfg, [f"e{i}" for i in range(4)])  # seeded: the same draws
    kills = [e for e in schedule.events if e.kind in ("kill_engine", "spot_preempt")]
    assert len(kills) >= 2
    config = LoadTestConfig(name="soak", slice=WorkloadSlice(duration_s=30.0), replay=ReplayConfig(),
                            client=ClientConfig(request_timeout_s=120.0), progress=False, plots=False)
    handle = launch(ClusterSpec.model_validate(SPEC))
    try:
        summary = run_sync(run_chaos(handle, schedule, read_trace(trace_path, "mooncake", ReadOptions()), config,
                                     tmp_path / "run", window_s=5.0, settle_s=20.0))
    finally:
        handle.shutdown()
    figures = soak_figures(summary)
    assert figures["checker_ok"], summary["checker"]
    assert figures["token_violations"] == 0 and figures["other_violations"] == {}
    assert figures["faults"] >= 2 and figures["replacements"] >= 1
    assert figures["requests"] > 30 and figures["failed"] == 0, figures

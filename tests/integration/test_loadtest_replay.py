"""Load test end to end against a real local kvmesh cluster (Ray actors, router, engines, real HTTP)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml

from cluster.launch import ClusterHandle, launch
from cluster.loadtest import (
    LoadTestConfig,
    ReplayConfig,
    RequestId,
    RequestSpec,
    TraceData,
    WorkloadSlice,
    read_trace,
    replay_slice,
    run_loadtest,
    run_sync,
)
from config import ClusterSpec
from run_cluster import main

pytestmark = pytest.mark.integration

SPEC: dict[str, object] = {
    "name": "it-loadtest",
    "time_scale": 1.0,
    "nodes": [{"name": "n0", "region": "local", "hardware": "h100-80g-sxm", "gpus": 2,
               "engines": [{"name": "e", "model": "llama-3.1-8b", "replicas": 2}]}],
    "router": {"policy": "round_robin"},
}

WORKLOAD = """format: synthetic
num_requests: 24
rate: 20
block_size: 16
input_len: {kind: uniform, mean: 96, spread: 64}
output_len: {kind: uniform, mean: 8, spread: 4, min: 2}
prefixes: {num_prefixes: 2, prefix_len: 64, share_ratio: 0.75}
sessions:
  turns: {kind: uniform, mean: 1.5, spread: 1, min: 1, max: 2}
  think_time_s: 0.2
  user_len: {kind: fixed, mean: 20}
seed: 5
"""

REQUIRED = {"ttft_ms", "tpot_ms", "itl_ms", "e2e_ms", "completed", "failed", "duration_s", "request_throughput",
            "output_throughput", "prefix_hit_ratio", "step_lag_ms"}


@pytest.fixture(scope="module")
def cluster(ray_cluster: object) -> Iterator[ClusterHandle]:
    handle = launch(ClusterSpec.model_validate(SPEC))
    try:
        yield handle
    finally:
        handle.shutdown()


@pytest.fixture()
def workload(tmp_path: Path) -> TraceData:
    p = tmp_path / "w.yaml"
    p.write_text(WORKLOAD)
    return read_trace(p)


def quiet(**kw: object) -> LoadTestConfig:
    return LoadTestConfig(progress=False, **kw)  # type: ignore[arg-type]


def test_open_loop_replay_records_every_token_of_every_request(cluster: ClusterHandle, workload: TraceData,
                                                                tmp_path: Path) -> None:
    result = run_sync(run_loadtest(cluster.router_url, workload, quiet(name="open"), folder=tmp_path / "run"))
    s = result.summary
    assert set(s) >= REQUIRED
    assert (s["completed"], s["failed"]) == (24, 0)
    records = result.runs[0].result.records
    specs = {sp.request_id: sp for sp in workload.requests}
    for r in records:
        assert r.success, r.error
        assert r.output_tokens == specs[r.request_id].output_len          # ignore_eos: exactly max_tokens
        assert len(r.itl_ms) == r.output_tokens - 1                       # one chunk per token
        assert r.prompt_tokens == specs[r.request_id].input_len          # the token-id prompt arrived whole
        assert r.ttft_ms is not None and r.e2e_ms is not None and 0 < r.ttft_ms <= r.e2e_ms
        assert r.sent_ms >= r.scheduled_ms
    assert s["model"] == "llama-3.1-8b"
    assert sorted(s["workers"]) == ["e-0", "e-1"]
    assert s["prefix_hit_ratio"] is not None and 0 < s["prefix_hit_ratio"] < 1
    assert s["step_lag_ms"] is not None and s["step_lag_ms"]["steps"] > 0
    folder = tmp_path / "run"
    for name in ("summary.json", "requests.jsonl", "timeseries.json", "ttft_cdf.png", "tpot_cdf.png",
                 "throughput.png", "queue_depth.png", "worker_load.png"):
        assert (folder / name).exists(), name
    depth = json.loads((folder / "timeseries.json").read_text())["target_depth"]
    assert depth and set(depth[0]["per_series"]) == {"e-0", "e-1"}


def test_shared_blocks_reach_the_engine_as_prefix_cache_hits(cluster: ClusterHandle) -> None:
    # Ten requests in a row to one engine, each 4 shared blocks (64 tokens) then 2 blocks of its own: the
    # engine's prefix cache must hit exactly the 9 x 64 shared tokens of the 10 x 96 it is asked for.
    specs = tuple(RequestSpec(RequestId(f"p{i}"), 0.0, 96, 2, (9000, 9001, 9002, 9003, 9100 + 2 * i, 9101 + 2 * i), 16)
                  for i in range(10))
    trace = TraceData(source="inline", format="mooncake", requests=specs, block_size=16)
    engine_url = cluster.engine_urls["e-0"]
    config = quiet(name="prefix", replay=ReplayConfig(concurrency=1), seed=123)
    s = run_sync(run_loadtest(engine_url, trace, config, out_root=None)).summary
    assert s["completed"] == 10
    assert s["prefix_hit_ratio"] == pytest.approx(9 * 64 / (10 * 96))
    assert s["workers"] == []  # an engine lists no workers: tolerated
    assert s["client_cached_token_ratio"] in (None, pytest.approx(9 * 64 / (10 * 96)))


def test_sweep_reports_the_highest_rate_keeping_the_target(cluster: ClusterHandle, workload: TraceData,
                                                           tmp_path: Path) -> None:
    config = quiet(name="sweep", rates=(5.0, 10.0), retime="poisson", slos={"ttft": 60_000.0},
                   goodput_target=0.9, slice=WorkloadSlice(max_requests=12), plots=True)
    result = run_sync(run_loadtest(cluster.router_url, workload, config, folder=tmp_path / "sweep"))
    sweep = result.summary
    assert sweep["sweep"] is True and [r["rate"] for r in sweep["runs"]] == [5.0, 10.0]
    assert all(r["completed"] == 12 and r["slo_attainment"] == 1.0 for r in sweep["runs"])
    assert sweep["max_rate_meeting_target"] == 10.0
    assert (tmp_path / "sweep" / "slo_attainment_vs_rate.png").exists()
    assert (tmp_path / "sweep" / "rate-5" / "requests.jsonl").exists()


def test_requests_the_server_rejects_are_counted_not_lost(cluster: ClusterHandle) -> None:
    specs = (RequestSpec(RequestId("ok"), 0.0, 32, 3, (1, 2), 16),
             RequestSpec(RequestId("too-long"), 10.0, 32, 200_000, (1, 3), 16))
    trace = TraceData(source="inline", format="mooncake", requests=specs, block_size=16)
    s = run_sync(run_loadtest(cluster.router_url, trace, quiet(), out_root=None)).summary
    assert (s["completed"], s["failed"], s["failures"]) == (1, 1, {"http_error": 1})
    assert s["warm_connections"] == {"asked": 2, "opened": 2}  # both due within WARM_WINDOW_S: two warmed


def test_replay_slice_prints_the_summary(cluster: ClusterHandle, tmp_path: Path,
                                         capsys: pytest.CaptureFixture[str]) -> None:
    p = tmp_path / "w.yaml"
    p.write_text(WORKLOAD)
    s = replay_slice(cluster.router_url, p, max_requests=6, out_root=tmp_path, progress=False)
    assert s["completed"] == 6
    assert "TTFT" in capsys.readouterr().out


def test_loadtest_command_launches_the_config_and_prints_json(ray_cluster: object, tmp_path: Path,
                                                              capsys: pytest.CaptureFixture[str]) -> None:
    spec = {"name": "it-loadtest-cli", "time_scale": 0.5, "engine_nice": -3,
            "nodes": [{"name": "n0", "region": "local", "hardware": "h100-80g-sxm", "gpus": 1,
                       "engines": [{"name": "solo", "model": "llama-3.1-8b"}]}]}
    cfg = tmp_path / "cluster.yaml"
    cfg.write_text(yaml.safe_dump(spec))
    trace = tmp_path / "t.jsonl"
    trace.write_text("\n".join(json.dumps({"timestamp": 100 * i, "input_length": 40, "output_length": 4,
                                           "hash_ids": [0, 1, 2 + i]}) for i in range(8)) + "\n")
    rc = main(["loadtest", "--config", str(cfg), "--trace", str(trace), "--block-size", "16", "--json",
               "--no-progress", "--out", str(tmp_path / "run"), "--slo", "ttft:5000"])
    assert rc == 0
    out = capsys.readouterr().out.strip().splitlines()
    s = json.loads(out[-1])
    assert set(s) >= REQUIRED
    assert (s["completed"], s["failed"], s["time_scale"]) == (8, 0, 0.5)
    for key in ("ttft_ms", "tpot_ms", "itl_ms", "e2e_ms"):
        assert all(s[key][k] is not None for k in ("mean", "p50", "p90", "p99"))
    assert s["prefix_hit_ratio"] is not None and s["step_lag_ms"] is not None
    assert (tmp_path / "run" / "summary.json").exists()
    gen = s["load_generator"]  # the generator asked for the launched engines' niceness, got it where allowed
    assert gen["wanted"] == -3 and gen["nice"] in (-3, gen["before"]) and (gen["nice"] == -3) == (gen["note"] is None)

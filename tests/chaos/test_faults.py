"""One test per implemented fault kind: a short synthetic trace on a real 3-engine cluster (Ray actors,
router, HTTP) while the event plays, then the history checker over the run folder.

Cluster: engines e-0, e-1 on node n0 and f on node n1, round-robin routing, real time (time scale 1).
Requests stream ~150 tokens each (about a second of emulated decode), so faults land mid-stream.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from cluster.chaos.checker import check_folder
from cluster.chaos.run import CHAOS_FILE, CHECKER_FILE, EVENTS_FILE, run_chaos
from cluster.chaos.schedule import parse_schedule
from cluster.launch import launch
from cluster.loadtest import ClientConfig, LoadTestConfig, ReplayConfig, read_trace, run_sync
from config import ClusterSpec

SPEC: dict[str, Any] = {
    "name": "chaos-test",
    "time_scale": 1.0,
    "nodes": [
        {"name": "n0", "region": "local", "hardware": "h100-80g-sxm", "gpus": 2,
         "engines": [{"name": "e", "model": "llama-3.1-8b", "replicas": 2}]},
        {"name": "n1", "region": "local", "hardware": "h100-80g-sxm", "gpus": 1,
         "engines": [{"name": "f", "model": "llama-3.1-8b", "replicas": 1}]},
    ],
    "router": {"policy": "round_robin"},
}

WORKLOAD = """format: synthetic
num_requests: 40
rate: 10
block_size: 16
input_len: {kind: uniform, mean: 128, spread: 64}
output_len: {kind: uniform, mean: 150, spread: 40}
seed: 3
"""


def chaos(tmp_path: Path, events: list[dict[str, Any]]) -> tuple[dict[str, Any], Path]:
    wl = tmp_path / "wl.yaml"
    wl.write_text(WORKLOAD)
    trace = read_trace(wl, "synthetic")
    schedule = parse_schedule({"name": "t", "events": events})
    folder = tmp_path / "run"
    config = LoadTestConfig(name="chaos", replay=ReplayConfig(), client=ClientConfig(request_timeout_s=60.0),
                            progress=False, plots=False)
    handle = launch(ClusterSpec.model_validate(SPEC))
    try:
        summary = run_sync(run_chaos(handle, schedule, trace, config, folder, window_s=1.0, settle_s=10.0))
    finally:
        handle.shutdown()
    return summary, folder


def assert_clean(summary: dict[str, Any], folder: Path) -> None:
    """The checker passes, skipped nothing, and checked every request's tokens."""
    report = check_folder(folder)
    assert report.ok, report.violations
    assert report.skipped == []
    assert report.requests == 40 and report.tokens_checked > 40 * 100
    assert json.loads((folder / CHECKER_FILE).read_text())["ok"] is True
    assert json.loads((folder / CHAOS_FILE).read_text())["checker"]["ok"] is True
    log = [json.loads(line) for line in (folder / EVENTS_FILE).read_text().splitlines()]
    assert log and all(e["outcome"] == "done" for e in log), log
    assert all(abs(e["actual_s"] - e["at_s"]) < 0.5 for e in log)


def test_kill_engine(ray_cluster: object, tmp_path: Path) -> None:
    summary, folder = chaos(tmp_path, [{"kind": "kill_engine", "at_s": 2.0, "engine": "e-1"}])
    assert_clean(summary, folder)
    assert summary["dead_engines"] == ["e-1"]
    assert summary["loadtest"]["failed"] == 0  # the router continued every stream cut by the kill
    assert summary["impact"][0]["failed"] == 0


def test_kill_node(ray_cluster: object, tmp_path: Path) -> None:
    summary, folder = chaos(tmp_path, [{"kind": "kill_node", "at_s": 2.0, "node": "n0"}])
    assert_clean(summary, folder)
    assert summary["dead_engines"] == ["e-0", "e-1"]
    assert summary["loadtest"]["failed"] == 0


def test_spot_preempt_without_migration(ray_cluster: object, tmp_path: Path) -> None:
    summary, folder = chaos(tmp_path, [{"kind": "spot_preempt", "at_s": 1.0, "engine": "f", "notice_s": 1.5}])
    assert_clean(summary, folder)
    assert summary["dead_engines"] == ["f"]
    assert summary["loadtest"]["failed"] == 0
    notice, kill = summary["events"]
    assert notice["at_s"] == 1.0 and kill["at_s"] == 2.5
    # no request sent after the notice was served by the preempted engine
    records = [json.loads(line) for line in (folder / "requests.jsonl").read_text().splitlines()]
    late = [r for r in records if r["sent_ms"] > notice["actual_s"] * 1000 + 200]
    assert late and all(r["worker"] != "f" for r in late)


def test_slow_gpu(ray_cluster: object, tmp_path: Path) -> None:
    summary, folder = chaos(tmp_path, [{"kind": "slow_gpu", "at_s": 0.5, "engine": "e-0", "factor": 5.0,
                                        "duration_s": 8.0}])
    assert_clean(summary, folder)
    assert summary["dead_engines"] == []
    records = [json.loads(line) for line in (folder / "requests.jsonl").read_text().splitlines()]
    # sent after the slowdown began, finished (< 190 tokens x 5 x ~6.2 ms) before it ended at 8.5 s
    slowed = [r["tpot_ms"] for r in records if r["worker"] == "e-0" and 600 < r["sent_ms"] < 1200]
    normal = [r["tpot_ms"] for r in records if r["worker"] != "e-0" and 600 < r["sent_ms"] < 1200]
    assert slowed and normal
    assert min(slowed) > 3 * max(normal)  # a 5x step time shows in every stream it served


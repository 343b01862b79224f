"""Requests survive preemption: live KV migration on a spot notice, and resumes from decode checkpoints.

Real clusters (Ray actors, router, HTTP, KV over TCP): ``test_faults``' three engines (e-0, e-1 on node
n0, f on n1) with ``router.kv_migration`` on, real KV bytes scaled to 1/256. The history checker runs on
every result: each client's token stream must equal what the engines generated for it, across the moves.
"""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

from cluster.chaos.checker import check_folder
from cluster.chaos.run import EVENTS_FILE, run_chaos
from cluster.chaos.schedule import parse_schedule
from cluster.launch import launch
from cluster.loadtest import ClientConfig, LoadTestConfig, ReplayConfig, read_trace, run_sync
from config import ClusterSpec
from tests.chaos.test_faults import SPEC, WORKLOAD


def spec_with(time_scale: float, **migration: Any) -> dict[str, Any]:
    spec = copy.deepcopy(SPEC)
    spec["time_scale"] = time_scale
    spec["transport"] = {"backend": "tcp", "kv_payload_scale": 1 / 256}
    spec["router"] = {**spec["router"], "kv_migration": migration}
    return spec


# ~36 emulated s of arrivals (the default 30 s notice ends inside the run), ~2.5 s of decode each.
SPOT_WORKLOAD = """format: synthetic
num_requests: 72
rate: 2
block_size: 16
input_len: {kind: uniform, mean: 128, spread: 64}
output_len: {kind: uniform, mean: 400, spread: 40}
seed: 4
"""


def chaos(tmp_path: Path, spec: dict[str, Any], workload: str,
          events: list[dict[str, Any]]) -> tuple[dict[str, Any], Path]:
    wl = tmp_path / "wl.yaml"
    wl.write_text(workload)
    trace = read_trace(wl, "synthetic")
    folder = tmp_path / "run"
    config = LoadTestConfig(name="chaos", replay=ReplayConfig(),
                            client=ClientConfig(request_timeout_s=120.0, time_scale=spec["time_scale"]),
                            progress=False, plots=False)
    handle = launch(ClusterSpec.model_validate(spec))
    try:
        summary = run_sync(run_chaos(handle, parse_schedule({"name": "t", "events": events}), trace, config,
                                     folder, window_s=1.0, settle_s=10.0))
    finally:
        handle.shutdown()
    return summary, folder


def assert_clean(summary: dict[str, Any], folder: Path, n: int) -> None:
    report = check_folder(folder)
    assert report.ok, report.violations
    assert report.skipped == []
    assert report.requests == n
    assert summary["loadtest"]["failed"] == 0
    log = [json.loads(line) for line in (folder / EVENTS_FILE).read_text().splitlines()]
    assert log and all(e["outcome"] == "done" for e in log), log


def test_spot_preempt_live_migration(ray_cluster: object, tmp_path: Path) -> None:
    """Default 30 s notice at 4x speed: f's running streams move at the notice, none is lost."""
    summary, folder = chaos(tmp_path, spec_with(0.25, live=True), SPOT_WORKLOAD,
                            [{"kind": "spot_preempt", "at_s": 3.0, "engine": "f"}])
    assert_clean(summary, folder, 72)
    assert summary["dead_engines"] == ["f"]
    moves = summary["kv_migration"]
    impact = summary["impact"][0]
    assert impact["failed"] == 0
    assert impact["migrated"] >= 1 and impact["migrated"] == moves["migrated"], moves
    assert moves["by_source"]["f"].get("resumed_migrated_ok") == impact["migrated"]
    assert moves["migration_ms_mean"] is not None and moves["migration_ms_mean"] > 0
    assert sum(s["migrated_in"] for s in moves["engines"].values()) == impact["migrated"]
    # the migrated streams went on where their KV went: nothing was recomputed, nothing re-prefilled
    assert moves["resumed_from_checkpoint"] == 0
    assert "migrations_refused" not in moves["by_source"]["f"]


def test_kill_resumes_from_checkpoint(ray_cluster: object, tmp_path: Path) -> None:
    """A kill without notice: f's streams resume on their checkpoint peers, recomputing only the tokens
    since the last checkpoint (every 32 generated tokens; the KV covered is whole 16-token blocks)."""
    summary, folder = chaos(tmp_path, spec_with(1.0, checkpoints=True), WORKLOAD,
                            [{"kind": "kill_engine", "at_s": 2.0, "engine": "f"}])
    assert_clean(summary, folder, 40)
    moves = summary["kv_migration"]
    impact = summary["impact"][0]
    assert impact["resumed_from_checkpoint"] >= 1, moves
    assert impact["migrated"] == 0
    recomputed = moves["recomputed_tokens_per_resume"]
    assert recomputed is not None and recomputed["n"] == impact["resumed_from_checkpoint"]
    # since the checkpoint: < 32 tokens generated after it, plus < 16 of a block it could not yet cover,
    # plus the tokens generated while that checkpoint was on its way (a few steps)
    assert recomputed["max"] < 32 + 16 + 8, recomputed
    per32 = moves["checkpoint_ms_per_32_tokens"]
    assert per32 is not None and per32["n"] > 0 and per32["mean"] > 0

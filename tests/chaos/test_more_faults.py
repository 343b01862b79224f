"""One test per remaining fault kind (replacement, partition, KV-event disturbance, router restart, transfer
faults), each on a real cluster (Ray actors, router, HTTP, TCP transport) with the history checker run on
the result.

The colocated cases reuse ``test_faults``' 3-engine cluster and 40-request workload; the transport cases
run a 1P1D cluster (prompts long enough to be disaggregated).
"""

from __future__ import annotations

import json
import urllib.request
from pathlib import Path
from typing import Any

from cluster.chaos.checker import check_folder
from cluster.chaos.run import EVENTS_FILE, run_chaos
from cluster.chaos.schedule import parse_schedule
from cluster.launch import launch
from cluster.loadtest import ClientConfig, LoadTestConfig, ReplayConfig, read_trace, run_sync
from cluster.loadtest.client import HEADER_WORKER
from config import ClusterSpec
from tests.chaos.test_faults import SPEC, WORKLOAD

PD_SPEC: dict[str, Any] = {
    "name": "chaos-pd",
    "time_scale": 1.0,
    "nodes": [{"name": "np", "region": "local", "hardware": "h100-80g-sxm", "gpus": 1, "nic": "lesson-rdma",
               "engines": [{"name": "p", "role": "prefill", "model": "llama-3.1-8b"}]},
              {"name": "nd", "region": "local", "hardware": "h100-80g-sxm", "gpus": 1, "nic": "lesson-rdma",
               "engines": [{"name": "d", "role": "decode", "model": "llama-3.1-8b"}]}],
    "transport": {"backend": "tcp", "kv_payload_scale": 1 / 256},
    "disagg": {"hand_off": "push", "transfer_timeout_ms": 300},
    "router": {"policy": "least_loaded"},
}

PD_WORKLOAD = """format: synthetic
num_requests: 30
rate: 6
block_size: 16
input_len: {kind: uniform, mean: 1500, spread: 400}
output_len: {kind: uniform, mean: 60, spread: 20}
seed: 5
"""


def served_by(router_url: str, n: int) -> list[tuple[int, str | None]]:
    """(HTTP status, the worker that served it) of ``n`` short completions sent one after another to the router."""
    out = []
    for i in range(n):
        body = json.dumps({"model": "llama-3.1-8b", "prompt": f"probe {i} after the run", "max_tokens": 4}).encode()
        req = urllib.request.Request(router_url + "/v1/completions", data=body,
                                     headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=30) as resp:
            resp.read()
            out.append((resp.status, resp.headers.get(HEADER_WORKER)))
    return out


def chaos(tmp_path: Path, events: list[dict[str, Any]], spec: dict[str, Any] = SPEC,
          workload: str = WORKLOAD, probes: int = 0) -> tuple[dict[str, Any], Path, list[dict[str, Any]]]:
    """Launch ``spec``, replay ``workload`` while ``events`` play, then (cluster still up) send ``probes`` requests
    one by one through the router: ``summary["probes"]`` holds their (status, worker)."""
    wl = tmp_path / "wl.yaml"
    wl.write_text(workload)
    trace = read_trace(wl, "synthetic")
    folder = tmp_path / "run"
    config = LoadTestConfig(name="chaos", replay=ReplayConfig(), client=ClientConfig(request_timeout_s=60.0),
                            progress=False, plots=False)
    handle = launch(ClusterSpec.model_validate(spec))
    try:
        summary = run_sync(run_chaos(handle, parse_schedule({"name": "t", "events": events}), trace, config,
                                     folder, window_s=1.0, settle_s=10.0))
        summary["router_metrics"] = urllib.request.urlopen(handle.router_url + "/metrics", timeout=10).read().decode()
        summary["probes"] = served_by(handle.router_url, probes)
    finally:
        handle.shutdown()
    records = [json.loads(line) for line in (folder / "requests.jsonl").read_text().splitlines()]
    return summary, folder, records


def assert_clean(summary: dict[str, Any], folder: Path, n: int = 40) -> list[dict[str, Any]]:
    """The checker passes over every request and every action ran on time; the event log."""
    report = check_folder(folder)
    assert report.ok, report.violations
    assert report.skipped == []
    assert report.requests == n and report.tokens_checked > n * 10
    assert summary["checker"]["ok"] is True
    log = [json.loads(line) for line in (folder / EVENTS_FILE).read_text().splitlines()]
    assert log and all(e["outcome"] == "done" for e in log), log
    return log


def metric(text: str, name: str) -> float:
    """A counter summed over its labels (not its ``_created`` timestamps)."""
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith((name + "{", name + " ")))


def test_kill_engine_with_replacement(ray_cluster: object, tmp_path: Path) -> None:
    # The fresh engine's actor can take seconds to start on a loaded host (3.2 s in one suite run, 8 s in another,
    # after the workload's last send), so whether the workload still sends after it joined is a race with the host.
    # What the test needs does not depend on it: the run is clean, and once it joined, the round-robin router sends
    # it its share of the requests that follow (3 probes after the run, one per worker), and it serves them.
    summary, folder, records = chaos(tmp_path, [{"kind": "kill_engine", "at_s": 1.0, "engine": "e-1",
                                                 "replace_after_s": 0.5}],
                                     workload=WORKLOAD.replace("num_requests: 40", "num_requests: 80"), probes=3)
    log = assert_clean(summary, folder, n=80)
    assert summary["loadtest"]["failed"] == 0
    assert summary["dead_engines"] == [] and summary["replaced_engines"] == ["e-1"]
    joined_ms = 1000 * max(e["done_s"] for e in log)  # the replacement is in the router's view
    late = [r for r in records if r["sent_ms"] > joined_ms and r["status"] == "ok"]
    assert all(r["worker"] in ("e-0", "e-1", "f") for r in late)
    assert sorted(summary["probes"]) == [(200, "e-0"), (200, "e-1"), (200, "f")]  # the fresh engine serves
    assert summary["index_converged"] is True


def test_spot_preempt_with_replacement(ray_cluster: object, tmp_path: Path) -> None:
    # 8 s of arrivals: on a loaded host the replacement can take a few seconds to start and join, and the
    # test needs requests sent after that (with 4 s of arrivals it once joined after the last one)
    summary, folder, records = chaos(tmp_path, [{"kind": "spot_preempt", "at_s": 0.5, "engine": "f",
                                                 "notice_s": 1.0, "replace_after_s": 0.5}],
                                     workload=WORKLOAD.replace("num_requests: 40", "num_requests: 80"))
    log = assert_clean(summary, folder, n=80)
    assert summary["loadtest"]["failed"] == 0
    assert summary["dead_engines"] == [] and summary["replaced_engines"] == ["f"]
    joined_ms = 1000 * log[-1]["done_s"]  # the replacement is in the router's view
    late = [r for r in records if r["sent_ms"] > joined_ms]
    assert late and any(r["worker"] == "f" and r["status"] == "ok" for r in late)


def test_partition_router_from_an_engine(ray_cluster: object, tmp_path: Path) -> None:
    # Streams cut by the partition count as failures of f: a short breaker cooldown lets it back soon after.
    spec = {**SPEC, "router": {**SPEC["router"], "breaker_cooldown_s": 0.5}}
    summary, folder, records = chaos(tmp_path, [{"kind": "partition", "at_s": 1.0, "engines": ["f"],
                                                 "duration_s": 1.5}], spec)
    cut, heal = assert_clean(summary, folder)
    assert summary["loadtest"]["failed"] == 0  # streams cut by the partition continued elsewhere
    during = [r for r in records if cut["actual_s"] * 1000 + 100 < r["sent_ms"] < heal["actual_s"] * 1000]
    assert during and all(r["worker"] != "f" for r in during)  # routed around
    assert any(r["worker"] == "f" for r in records if r["sent_ms"] > heal["actual_s"] * 1000 + 500)  # recovered
    assert summary["index_converged"] is True


def test_kv_event_loss_duplication_and_reordering_converge(ray_cluster: object, tmp_path: Path) -> None:
    summary, folder, _ = chaos(tmp_path, [{"kind": "kv_events", "at_s": 0.2, "loss": 0.3, "duplicate": 0.2,
                                           "reorder": 0.3, "duration_s": 2.0, "seed": 7}])
    assert_clean(summary, folder)
    counts = summary["kv_events_disturbed"]
    assert sum(c["lost"] for c in counts.values()) > 0
    assert sum(c["duplicated"] for c in counts.values()) > 0
    assert sum(c["reordered"] for c in counts.values()) > 0
    # after healing, every router's index equals each engine's cache, block for block
    assert summary["index_converged"] is True
    assert all(a["engine_blocks"] > 0 and a["missing"] == 0 and a["extra"] == 0
               for a in summary["index_agreement"].values())


def test_router_restart(ray_cluster: object, tmp_path: Path) -> None:
    # Graceful (the default mode). 8 s of arrivals: on a loaded host the new router can take a few seconds
    # to see every engine, and the test needs requests sent after that
    summary, folder, records = chaos(tmp_path, [{"kind": "router_restart", "at_s": 1.5, "down_s": 0.3}],
                                     workload=WORKLOAD.replace("num_requests: 40", "num_requests: 80"))
    (restart,) = assert_clean(summary, folder, n=80)  # one terminal state each, no token lost or repeated
    back_ms = 1000 * restart["done_s"] + 200  # the action ends once the new router sees every engine
    # A graceful restart: every stream open through the old router ended with its error event (a 503 saying
    # the router is shutting down) and [DONE], none with a dropped connection; requests that came while it
    # stopped were refused (503) or found no listener.
    failed = [r for r in records if r["status"] != "ok"]
    told = [r for r in failed if r["status"] == "protocol_error" and "error event" in r["error"]
            and "shutting down" in r["error"] and "503" in r["error"]]
    assert told, failed
    assert not [r for r in failed if r.get("token_ids") and r not in told], failed
    assert all(r in told or (r["status"] == "http_error" and r["http_status"] == 503)
               or r["status"] == "connection_error" for r in failed), failed
    assert all(r["sent_ms"] < back_ms for r in failed), failed
    late = [r for r in records if r["sent_ms"] > back_ms]
    assert late, f"no request was sent after the new router was up at {back_ms:.0f} ms"
    assert all(r["status"] == "ok" for r in late)  # the new router serves on the same URL
    assert summary["index_converged"] is True  # rebuilt from the engines' snapshots


def test_partition_between_prefill_and_decode(ray_cluster: object, tmp_path: Path) -> None:
    summary, folder, _ = chaos(tmp_path, [{"kind": "partition", "at_s": 1.0, "engines": ["p", "d"],
                                           "between": "engines", "duration_s": 2.0}], PD_SPEC, PD_WORKLOAD)
    assert_clean(summary, folder, n=30)
    assert summary["loadtest"]["failed"] == 0  # a failed hand-off falls back to prefill on decode
    assert metric(summary["router_metrics"], "kvmesh_router_kv_fallbacks_total") >= 1


def test_transfer_faults(ray_cluster: object, tmp_path: Path) -> None:
    plan = {"seed": 2, "rates": {"drop": 0.3, "corrupt": 0.3, "reset": 0.2}}
    summary, folder, _ = chaos(tmp_path, [{"kind": "transfer_faults", "at_s": 0.5, "duration_s": 2.5,
                                           "plan": plan}], PD_SPEC, PD_WORKLOAD)
    assert_clean(summary, folder, n=30)
    assert summary["loadtest"]["failed"] == 0
    assert metric(summary["router_metrics"], "kvmesh_router_kv_fallbacks_total") >= 1

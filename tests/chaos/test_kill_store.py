"""``kill_store``: the region's shared KV store actor killed mid-run on a real cluster (Ray actors, router,
HTTP, TCP transport, the store written through after prefill and read on prefix misses); every request is
still served whole (a failed get is recompute), the history checker passes."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from tests.chaos.test_more_faults import assert_clean, chaos
from tests.integration.test_kvstore import CLUSTER

# the store integration test's cluster: 2 x H100 8B round robin, 512 GPU blocks each, TCP, a 20 GB store
STORE_SPEC: dict[str, Any] = {**CLUSTER, "name": "chaos-store", "time_scale": 1.0}

# 4 shared 1024-token prefixes over 2 engines in turn: each prefix is prefilled on one engine and found in the
# store by the other, before and after the kill
STORE_WORKLOAD = """format: synthetic
num_requests: 40
rate: 8
block_size: 16
input_len: {kind: uniform, mean: 64, spread: 32}
output_len: {kind: uniform, mean: 40, spread: 10}
prefixes: {num_prefixes: 4, prefix_len: 1024}
seed: 7
"""


def test_kill_store_mid_run_loses_no_request(ray_cluster: object, tmp_path: Path) -> None:
    summary, folder, records = chaos(tmp_path, [{"kind": "kill_store", "at_s": 1.5, "region": "local"}],
                                     spec=STORE_SPEC, workload=STORE_WORKLOAD)
    log = assert_clean(summary, folder)
    assert summary["loadtest"]["failed"] == 0
    assert [e["kind"] for e in log] == ["kill_store"]
    killed_ms = 1000 * log[0]["actual_s"]
    after = [r for r in records if r["sent_ms"] > killed_ms]
    assert after and all(r["status"] == "ok" for r in after)  # requests sent after the store died were served

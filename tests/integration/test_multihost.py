"""Three hosts on one machine (the namespace harness), one Ray cluster with token auth: the prefill engine on
host1, the decode engine on host2, the router on host3; a trace replayed with KV crossing hosts over tcp.
Then host-level faults through the chaos schedule (``run_cluster.py chaos --hosts-run-dir``): host2's link
down and up again, then host2 lost (raylet and every actor), with the history checker on the run.

The drivers (``cluster.hosts.trial``, ``run_cluster.py chaos``) run on host1 as a user would run
``run_cluster.py ... --address``; this test, outside every namespace, reads their reports. Needs root (skips,
saying so, without it). The host-fault tests come last: host2 is gone after them.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import pytest

from cluster.hosts.harness import Harness, HarnessState, HarnessUnavailable, check_available
from cluster.hosts.trial import host_chaos as run_host_chaos

pytestmark = [pytest.mark.integration, pytest.mark.slow]

REPO = Path(__file__).resolve().parents[2]
SPEC = REPO / "config" / "presets" / "hosts-3-pd.yaml"


@pytest.fixture(scope="module")
def hosts() -> Iterator[tuple[Harness, HarnessState]]:
    try:
        check_available()
    except HarnessUnavailable as e:
        pytest.skip(str(e))
    run_dir = Path(tempfile.mkdtemp(prefix="kvit-", dir="/tmp"))  # short: Ray's socket paths are limited
    h = Harness(run_dir)
    try:
        st = h.up(3, "tcp-10g", name="kvit", subnet="10.214.0.0/24")
        yield h, st
    finally:
        h.down()
        shutil.rmtree(run_dir, ignore_errors=True)


def trial(h: Harness, st: HarnessState, *extra: str) -> dict[str, Any]:
    argv = h.exec_argv(st, "host1", [sys.executable, "-m", "cluster.hosts.trial", "--config", str(SPEC),
                                     "--address", st.head_address, *extra])
    p = subprocess.run(argv, cwd=REPO, capture_output=True, text=True, timeout=240, check=False)
    assert p.returncode == 0, p.stderr[-3000:]
    out: dict[str, Any] = json.loads(p.stdout.strip().splitlines()[-1])
    return out


def test_harness_hosts_are_separate_ray_nodes_with_token_auth(hosts: tuple[Harness, HarnessState]) -> None:
    h, st = hosts
    assert [x.address for x in st.hosts] == ["10.214.0.2", "10.214.0.3", "10.214.0.4"]
    assert Path(st.token_path).stat().st_mode & 0o077 == 0
    probe = ("import ray; ray.init(log_to_driver=False); "
             "print(sorted(k for n in ray.nodes() if n['Alive'] for k in n['Resources'] if k.startswith('kvmesh')))")
    out = subprocess.run(h.exec_argv(st, "host2", [sys.executable, "-c", probe]), capture_output=True, text=True,
                         timeout=60, check=True).stdout.strip().splitlines()[-1]
    assert out == "['kvmesh_host:host1', 'kvmesh_host:host2', 'kvmesh_host:host3']"
    no_token = [a for a in h.exec_argv(st, "host2", [sys.executable, "-c", probe]) if not a.startswith("RAY_AUTH")]
    refused = subprocess.run(no_token, capture_output=True, text=True, timeout=60, check=False)
    assert refused.returncode != 0  # a driver without the token is turned away


def test_prefill_decode_and_router_on_three_hosts_replay_with_every_token_and_block(
        hosts: tuple[Harness, HarnessState]) -> None:
    h, st = hosts
    r = trial(h, st, "--requests", "12", "--rate", "6")
    ip = {x.name: x.address for x in st.hosts}
    assert urlsplit(r["engines"]["p"]["url"]).hostname == ip["host1"]
    assert urlsplit(r["engines"]["d"]["url"]).hostname == ip["host2"]
    assert urlsplit(r["router_url"]).hostname == ip["host3"]
    assert r["requests"] == 12 and r["completed"] == 12 and r["failed"] == 0
    assert r["tokens_ok"], r["short"]  # every request got exactly the tokens it asked for
    assert r["blocks_returned"], r["load"]  # every engine has every KV block free again
    moved = r["transfers"]["p"]  # KV pushed from host1 to host2 for (nearly) every request
    assert moved["transfers"] + moved["failures"] >= 12 and moved["transfers"] >= 10 and moved["bytes_real"] > 0


HEAL_S, KILL_S = 6.0, 14.0
"""Emulated s of the schedule: host2's link down at 2 s for 4 s (Ray's node survives: its health check
allows ~15 s), host2 lost at 14 s, while the trace (3 requests/s for ~18 s) goes on."""
SCHEDULE = f"""name: host-faults
events:
- {{kind: partition, at_s: 2.0, host: host2, duration_s: {HEAL_S - 2.0}}}
- {{kind: kill_node, at_s: {KILL_S}, node: decode-node}}
"""


@pytest.fixture(scope="module")
def host_chaos(hosts: tuple[Harness, HarnessState]) -> dict[str, Any]:
    """One chaos run with both host-level faults (sharing one cluster launch keeps the module short)."""
    h, st = hosts
    return run_host_chaos(h, st, SPEC, SCHEDULE, h.run_dir / "chaos", requests=54, rate=3)


def test_a_host_partition_heals_and_the_cluster_serves_again(host_chaos: dict[str, Any]) -> None:
    s, records = host_chaos["summary"], host_chaos["records"]
    link = [e for e in s["events"] if e["kind"] == "partition"]
    assert [(e["what"], e["outcome"]) for e in link] == [("host host2: link down", "done"),
                                                         ("host host2: link up", "done")], link
    assert s["checker"]["ok"], s["checker"]  # every request one terminal state, no token lost or repeated
    healed_at_ms = max(e["done_s"] for e in link) * 1000.0
    after_heal = [r for r in records if healed_at_ms + 1000.0 <= r["sent_ms"] and r["finished_ms"] is not None
                  and r["finished_ms"] < KILL_S * 1000.0]
    assert after_heal, "no request was sent and finished between the heal and the kill"
    assert all(r["status"] == "ok" and r["output_tokens"] == r["expected_output_len"] for r in after_heal), after_heal


def test_a_host_killed_through_the_chaos_schedule_loses_its_engines_and_every_request_ends(
        host_chaos: dict[str, Any]) -> None:
    s, records = host_chaos["summary"], host_chaos["records"]
    (kill,) = [e for e in s["events"] if e["kind"] == "kill_node"]
    assert kill["outcome"] == "done" and kill["killed"] == ["d"], kill
    assert s["dead_engines"] == ["d"]
    assert s["checker"]["ok"], s["checker"]  # including: the surviving prefill engine has every block back
    assert len(records) == 54 and s["checker"]["requests"] == 54
    late = [r for r in records if r["sent_ms"] > kill["done_s"] * 1000.0 + 1000.0]
    assert late and all(r["status"] != "ok" for r in late)  # the only decode host is gone: refused, not hung
    (view,) = s["router_view_after"].values()
    assert [w["name"] for w in view if not w["eligible"]] == ["d"], view  # the router gave up on d alone

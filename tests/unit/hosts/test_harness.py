"""The hosts harness without root: names, tbf, the plumbing commands, and teardown of exactly what was made."""

from __future__ import annotations

import signal
from collections.abc import Sequence
from pathlib import Path

import pytest

from cluster.hosts.harness import (
    Harness,
    HarnessError,
    HarnessState,
    HarnessUnavailable,
    HostState,
    Made,
    check_available,
)
from cluster.hosts.network import TBF_MIN_BURST, create_link, layout, tbf_args


class FakeNet:
    """A Runner that records commands and keeps a tiny model of which links, namespaces and PIDs exist."""

    def __init__(self) -> None:
        self.calls: list[list[str]] = []
        self.links: set[str] = set()
        self.netns: set[str] = set()
        self.pids: dict[str, list[int]] = {}

    def __call__(self, argv: Sequence[str], *, check: bool = True) -> str:
        a = list(argv)
        self.calls.append(a)
        if a[:3] == ["ip", "netns", "list"]:
            return "".join(f"{n} (id: 0)\n" for n in sorted(self.netns))
        if a[:3] == ["ip", "netns", "pids"]:
            return "".join(f"{p}\n" for p in self.pids.get(a[3], []))
        if a[:4] == ["ip", "-o", "link", "show"]:
            return f"1: {a[5]}: <UP>\n" if a[5] in self.links else ""
        if a[:3] == ["ip", "netns", "del"]:
            self.netns.discard(a[3])
            self.pids.pop(a[3], None)
        if a[:3] == ["ip", "link", "del"]:
            self.links.discard(a[3])
        return ""


def test_layout_names_fit_interface_limits_and_addresses_follow_the_gateway() -> None:
    net = layout("kvmesh", 3, "10.213.0.0/24")
    assert net.bridge == "kvmesh-br" and net.gateway == "10.213.0.1"
    assert [(h.name, h.netns, h.veth, h.address) for h in net.hosts] == [
        ("host1", "kvmesh-host1", "kvmesh-h1", "10.213.0.2"),
        ("host2", "kvmesh-host2", "kvmesh-h2", "10.213.0.3"),
        ("host3", "kvmesh-host3", "kvmesh-h3", "10.213.0.4")]
    assert all(len(h.veth) <= 15 for h in net.hosts)


@pytest.mark.parametrize(("name", "count", "subnet", "why"), [
    ("much-too-long", 3, "10.0.0.0/24", "1-8 letters"),
    ("kv", 0, "10.0.0.0/24", "at least one host"),
    ("kv", 3, "10.0.0.0/30", "room for 3 hosts"),
    ("kv", 3, "fd00::/64", "not an IPv4 network"),
])
def test_layout_refuses_bad_input(name: str, count: int, subnet: str, why: str) -> None:
    with pytest.raises(ValueError, match=why):
        layout(name, count, subnet)


def test_tbf_rate_is_the_presets_bandwidth_with_a_bucket_that_holds_gso_packets() -> None:
    args = tbf_args(1.25e9)  # tcp-10g
    assert args[:3] == ["tbf", "rate", "10000000000bit"]
    assert int(args[args.index("burst") + 1]) == 1_250_000  # a millisecond of the rate
    slow = tbf_args(1e6)
    assert int(slow[slow.index("burst") + 1]) == TBF_MIN_BURST


def test_a_hosts_link_is_a_bridged_veth_with_eth0_inside_and_a_default_route() -> None:
    run = FakeNet()
    net = layout("kv", 1, "10.9.0.0/24")
    create_link(run, net, net.hosts[0])
    assert run.calls == [
        ["ip", "link", "add", "kv-h1", "type", "veth", "peer", "name", "eth0", "netns", "kv-host1"],
        ["ip", "link", "set", "kv-h1", "master", "kv-br", "up"],
        ["ip", "-n", "kv-host1", "addr", "add", "10.9.0.2/24", "dev", "eth0"],
        ["ip", "-n", "kv-host1", "link", "set", "eth0", "up"],
        ["ip", "-n", "kv-host1", "link", "set", "lo", "up"],
        ["ip", "-n", "kv-host1", "route", "add", "default", "via", "10.9.0.1"]]


def test_without_root_the_harness_says_so() -> None:
    with pytest.raises(HarnessUnavailable, match="needs root"):
        check_available(euid=1000)
    with pytest.raises(HarnessUnavailable, match="needs tc"):
        check_available(which=lambda t: None if t == "tc" else "/sbin/ip", euid=0)


def crashed_state(tmp_path: Path) -> HarnessState:
    """A harness that crashed after making the bridge and host1 (its veth recorded, host2 never reached)."""
    hosts = [HostState(name=f"host{i}", netns=f"kv-host{i}", veth=f"kv-h{i}", address=f"10.9.0.{i + 1}",
                       prefix_len=24, gpus=8) for i in (1, 2)]
    token = tmp_path / "token"
    token.write_text("t")
    return HarnessState(name="kv", subnet="10.9.0.0/24", bridge="kv-br", gateway="10.9.0.1", link="tcp-10g",
                        rate_bytes_s=1.25e9, token_path=str(token), ray_temp_dir=str(tmp_path / "ray"),
                        python="/usr/bin/python3", hosts=hosts,
                        made=[Made(kind="bridge", name="kv-br"), Made(kind="netns", name="kv-host1"),
                              Made(kind="veth", name="kv-h1")])


def test_down_after_a_crash_removes_exactly_what_was_recorded_and_ends_only_its_processes(tmp_path: Path) -> None:
    run = FakeNet()
    run.links = {"kv-br", "kv-h1", "eth0", "somebody-elses-br"}
    run.netns = {"kv-host1", "kv-host2", "other"}  # kv-host2 was never recorded: not ours to delete
    run.pids = {"kv-host1": [101, 102], "other": [999]}
    killed: list[tuple[int, signal.Signals]] = []

    def kill(pid: int, sig: signal.Signals) -> None:
        killed.append((pid, sig))
        for pids in run.pids.values():
            if pid in pids:
                pids.remove(pid)

    h = Harness(tmp_path, run=run, kill=kill, grace_s=0.1)
    h._save(crashed_state(tmp_path))
    removed = h.down()
    assert removed == ["veth kv-h1", "netns kv-host1", "bridge kv-br"]
    assert killed == [(101, signal.SIGTERM), (102, signal.SIGTERM)]
    assert run.links == {"eth0", "somebody-elses-br"} and run.netns == {"kv-host2", "other"}
    assert not (tmp_path / "state.json").exists() and not (tmp_path / "token").exists()
    assert h.down() == []  # nothing left: a second down is a no-op


def test_a_process_that_ignores_sigterm_gets_sigkill(tmp_path: Path) -> None:
    run = FakeNet()
    run.links, run.netns, run.pids = {"kv-br", "kv-h1"}, {"kv-host1"}, {"kv-host1": [7]}
    killed: list[tuple[int, signal.Signals]] = []

    def kill(pid: int, sig: signal.Signals) -> None:
        killed.append((pid, sig))
        if sig == signal.SIGKILL:
            run.pids["kv-host1"].remove(pid)

    h = Harness(tmp_path, run=run, kill=kill, grace_s=0.05)
    h._save(crashed_state(tmp_path))
    h.down()
    assert killed[0] == (7, signal.SIGTERM) and killed[-1] == (7, signal.SIGKILL)


def test_kill_host_sigkills_every_process_in_that_namespace_and_partition_toggles_its_link(tmp_path: Path) -> None:
    run = FakeNet()
    run.pids = {"kv-host2": [201, 202, 203], "kv-host1": [101]}
    killed: list[tuple[int, signal.Signals]] = []
    h = Harness(tmp_path, run=run, kill=lambda p, s: killed.append((p, s)))
    h._save(crashed_state(tmp_path))
    assert h.kill_host("host2") == [201, 202, 203]
    assert killed == [(p, signal.SIGKILL) for p in (201, 202, 203)]
    h.partition("host1", connected=False)
    h.partition("host1", connected=True)
    assert run.calls[-2:] == [["ip", "-n", "kv-host1", "link", "set", "eth0", "down"],
                              ["ip", "-n", "kv-host1", "link", "set", "eth0", "up"]]
    with pytest.raises(KeyError, match="no host 'host9'"):
        h.kill_host("host9")


def test_exec_argv_runs_inside_the_namespace_with_token_auth_and_the_head_address(tmp_path: Path) -> None:
    h = Harness(tmp_path, run=FakeNet())
    st = crashed_state(tmp_path)
    argv = h.exec_argv(st, "host2", ["python", "x.py"])
    assert argv[:5] == ["ip", "netns", "exec", "kv-host2", "env"]
    assert "RAY_AUTH_MODE=token" in argv and f"RAY_AUTH_TOKEN_PATH={st.token_path}" in argv
    assert "RAY_ADDRESS=10.9.0.2:6379" in argv and argv[-2:] == ["python", "x.py"]


def test_a_second_up_on_the_same_run_dir_is_refused(tmp_path: Path) -> None:
    h = Harness(tmp_path, run=FakeNet())
    h._save(crashed_state(tmp_path))
    with pytest.raises((HarnessError, HarnessUnavailable)):
        h.up(2, "tcp-10g", name="kv")

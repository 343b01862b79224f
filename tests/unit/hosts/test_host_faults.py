"""Host-level faults: the injectors hand kill_node and a host partition to a HostControl; the control acts by
namespace, and never on the driver's own host."""

from __future__ import annotations

import os
import signal
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from cluster.chaos.injectors import UnsupportedEvent, plan_actions
from cluster.chaos.schedule import FaultSchedule, parse_schedule
from cluster.hosts.faults import HostFaultControl
from cluster.hosts.harness import Harness
from config.errors import ConfigError
from tests.unit.hosts.test_harness import FakeNet, crashed_state


class RecordingHostControl:
    def __init__(self) -> None:
        self.hosts_killed: list[str] = []
        self.engines_killed: list[str] = []
        self.links: list[tuple[str, bool]] = []

    def kill_host_of(self, node: str) -> list[str]:
        self.hosts_killed.append(node)
        return ["a", "b"]

    def partition_host(self, host: str, on: bool) -> None:
        self.links.append((host, on))

    def kill_engine(self, engine: str) -> list[str]:
        self.engines_killed.append(engine)
        return [engine]

    def engines_on_node(self, node: str) -> list[str]:
        return ["a"]


def test_kill_node_on_a_host_control_kills_the_host_not_engine_by_engine() -> None:
    schedule = FaultSchedule.model_validate({"events": [{"kind": "kill_node", "at_s": 1.0, "node": "n2"}]})
    (action,) = plan_actions(schedule)
    c = RecordingHostControl()
    assert action.do(c) == ["a", "b"]  # type: ignore[arg-type]
    assert c.hosts_killed == ["n2"] and c.engines_killed == []


def test_host_fault_control_kills_every_process_of_the_nodes_host_and_marks_its_engines_dead(tmp_path: Path) -> None:
    harness, run, killed = harness_with(tmp_path, {"kv-host2": [21, 22]})
    spec: Any = SimpleNamespace(nodes=[SimpleNamespace(name="nd", host="host2"),
                                       SimpleNamespace(name="np", host="host1")])
    handle: Any = SimpleNamespace(spec=spec, engines={"d": {"host": "host2"}, "d2": {"host": "host2"},
                                                      "p": {"host": "host1"}})
    c = HostFaultControl(handle, harness)
    assert c.kill_host_of("nd") == ["d", "d2"]
    assert killed == [(21, signal.SIGKILL), (22, signal.SIGKILL)] and c.dead == {"d", "d2"}
    assert "p" not in c.dead
    c.partition_host("host1", on=True)
    assert run.calls[-1] == ["ip", "-n", "kv-host1", "link", "set", "eth0", "down"]


def harness_with(tmp_path: Path, pids: dict[str, list[int]]) -> tuple[Harness, Any, list[tuple[int, signal.Signals]]]:
    run = FakeNet()
    run.pids = pids
    killed: list[tuple[int, signal.Signals]] = []
    harness = Harness(tmp_path, run=run, kill=lambda p, s: killed.append((p, s)))
    harness._save(crashed_state(tmp_path))
    return harness, run, killed


def test_host_partition_is_link_down_then_up_after_its_duration() -> None:
    schedule = parse_schedule({"events": [{"kind": "partition", "at_s": 2.0, "host": "host2", "duration_s": 3.0}]})
    down, up = plan_actions(schedule)
    assert (down.at_s, up.at_s) == (2.0, 5.0)
    c = RecordingHostControl()
    assert down.do(c) == [] and up.do(c) == []  # type: ignore[arg-type]
    assert c.links == [("host2", True), ("host2", False)]


def test_host_partition_without_host_control_is_refused_saying_what_it_needs() -> None:
    schedule = parse_schedule({"events": [{"kind": "partition", "at_s": 2.0, "host": "host2", "duration_s": 3.0}]})
    down, _ = plan_actions(schedule)
    with pytest.raises(UnsupportedEvent, match="hosts-run-dir"):
        down.do(object())  # type: ignore[arg-type]


def test_partition_names_engines_or_a_host_and_the_host_must_be_declared() -> None:
    for bad in ({}, {"engines": ["a"], "host": "host1"}):
        with pytest.raises(ConfigError, match="either engines"):
            parse_schedule({"events": [{"kind": "partition", "at_s": 1, "duration_s": 1, **bad}]})
    schedule = parse_schedule({"events": [{"kind": "partition", "at_s": 1, "duration_s": 1, "host": "host9"}]})
    with pytest.raises(ConfigError, match=r"no host 'host9' in the spec's placement\.hosts \(hosts: host1, host2\)"):
        schedule.check_against(["a"], ["n"], hosts=["host1", "host2"])


def test_the_driver_never_kills_or_cuts_its_own_host(tmp_path: Path) -> None:
    harness, run, killed = harness_with(tmp_path, {"kv-host1": [os.getpid(), 11]})
    handle: Any = SimpleNamespace(spec=SimpleNamespace(nodes=[SimpleNamespace(name="np", host="host1")]),
                                  engines={"p": {"host": "host1"}})
    c = HostFaultControl(handle, harness)
    with pytest.raises(ValueError, match="cannot kill host1: this driver runs on it"):
        c.kill_host_of("np")
    with pytest.raises(ValueError, match="cannot partition host1"):
        c.partition_host("host1", on=True)
    assert killed == [] and not any("link" in a for a in run.calls) and c.dead == set()


def test_chaos_cli_says_when_no_harness_is_up_in_the_hosts_run_dir(tmp_path: Path) -> None:
    from cluster.cli.chaos import _harness

    assert _harness(None) is None
    with pytest.raises(ValueError, match=r"--hosts-run-dir: no harness is up in .* \(no state\.json\)"):
        _harness(tmp_path)
    Harness(tmp_path)._save(crashed_state(tmp_path))
    h = _harness(tmp_path)
    assert h is not None and h.run_dir == tmp_path

"""Host-level kill_node: the injector hands the whole host to a HostControl; the control kills by namespace."""

from __future__ import annotations

import signal
from pathlib import Path
from types import SimpleNamespace
from typing import Any

from cluster.chaos.injectors import plan_actions
from cluster.chaos.schedule import FaultSchedule
from cluster.hosts.faults import HostFaultControl
from cluster.hosts.harness import Harness
from tests.unit.hosts.test_harness import FakeNet, crashed_state


class RecordingHostControl:
    def __init__(self) -> None:
        self.hosts_killed: list[str] = []
        self.engines_killed: list[str] = []

    def kill_host_of(self, node: str) -> list[str]:
        self.hosts_killed.append(node)
        return ["a", "b"]

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
    run = FakeNet()
    run.pids = {"kv-host2": [21, 22]}
    killed: list[tuple[int, signal.Signals]] = []
    harness = Harness(tmp_path, run=run, kill=lambda p, s: killed.append((p, s)))
    harness._save(crashed_state(tmp_path))
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

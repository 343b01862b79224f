"""Fault schedules: typed events, errors that name the event and field, a seeded generator."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from cluster.chaos.schedule import (
    EVENT_KINDS,
    KillEngine,
    SlowGpu,
    SpotPreempt,
    TransferFaults,
    generate_schedule,
    load_schedule,
    parse_schedule,
)
from config.errors import ConfigError

GOOD = """
name: mixed
events:
  - {kind: slow_gpu, at_s: 5, engine: e0, factor: 4, duration_s: 10}
  - {kind: kill_engine, at_s: 1, engine: e1}
  - {kind: spot_preempt, at_s: 2, engine: e2}
  - {kind: kill_node, at_s: 3, node: n0}
  - {kind: partition, at_s: 4, engines: [e0, e1], duration_s: 2}
  - {kind: kv_events, at_s: 4, loss: 0.5, duration_s: 2}
  - {kind: router_restart, at_s: 6}
  - {kind: transfer_faults, at_s: 7, duration_s: 3, plan: {seed: 1, rates: {drop: 0.1, corrupt: 0.1}}}
  - {kind: kill_store, at_s: 8, region: local, replica: 0}
"""


def test_every_kind_loads_sorted_by_time(tmp_path: Path) -> None:
    f = tmp_path / "s.yaml"
    f.write_text(GOOD)
    s = load_schedule(f)
    assert s.name == "mixed"
    assert [e.at_s for e in s.events] == sorted(e.at_s for e in s.events)
    assert {e.kind for e in s.events} == set(EVENT_KINDS)
    assert isinstance(s.events[0], KillEngine)
    spot = next(e for e in s.events if isinstance(e, SpotPreempt))
    assert spot.notice_s == 30.0 and spot.replace_after_s is None  # the default notice
    assert spot.end_s() == 32.0
    tf = next(e for e in s.events if isinstance(e, TransferFaults))
    assert tf.end_s() == 10.0
    assert s.end_s() == 32.0


def test_a_bare_list_is_a_schedule() -> None:
    s = parse_schedule([{"kind": "kill_engine", "at_s": 0, "engine": "e0"}])
    assert len(s.events) == 1


@pytest.mark.parametrize(("event", "path", "words"), [
    ({"kind": "slow_gpu", "at_s": 1, "engine": "e0", "factor": 0.5, "duration_s": 1},
     "events[1].slow_gpu.factor", "greater than or equal to 1"),
    ({"kind": "slow_gpu", "at_s": 1, "engine": "e0", "factor": 2},
     "events[1].slow_gpu.duration_s", "required"),
    ({"kind": "kill_engine", "at_s": -1, "engine": "e0"}, "events[1].kill_engine.at_s", "greater than"),
    ({"kind": "kill_engine", "at_s": 1, "engine": "e0", "typo": 1}, "events[1].kill_engine.typo", "unknown key"),
    ({"kind": "meteor", "at_s": 1}, "events[1]", "does not match"),
    ({"kind": "kv_events", "at_s": 1, "duration_s": 1}, "events[1].kv_events", "at least one of"),
    ({"kind": "transfer_faults", "at_s": 1, "duration_s": 1, "plan": {"rates": {"drop": 2.0}}},
     "events[1].transfer_faults.plan", "within [0, 1]"),
    ({"kind": "transfer_faults", "at_s": 1, "duration_s": 1, "plan": {"rates": {"melt": 0.1}}},
     "events[1].transfer_faults.plan.rates.melt.[key]", "Input should be"),
])
def test_a_bad_event_is_named_by_index_and_field(event: dict[str, object], path: str, words: str) -> None:
    with pytest.raises(ConfigError) as info:
        parse_schedule({"events": [{"kind": "kill_engine", "at_s": 0, "engine": "e0"}, event]}, "f.yaml")
    problems = info.value.problems
    assert any(p == path and words in r for p, r in problems), problems
    assert "f.yaml" in str(info.value)


def test_unknown_engine_or_node_is_refused_against_the_cluster() -> None:
    s = parse_schedule([{"kind": "kill_engine", "at_s": 0, "engine": "ghost"},
                        {"kind": "kill_node", "at_s": 1, "node": "n9"}])
    with pytest.raises(ConfigError) as info:
        s.check_against(["e0", "e1"], ["n0"])
    paths = [p for p, _ in info.value.problems]
    assert paths == ["events[0].kill_engine", "events[1].kill_node.node"]
    s.check_against(["ghost"], ["n9"])  # no error


def test_generator_is_seeded_and_keeps_engines_alive() -> None:
    engines = ["e0", "e1", "e2"]
    a = generate_schedule(np.random.default_rng(7), engines, duration_s=600, every_s=10)
    b = generate_schedule(np.random.default_rng(7), engines, duration_s=600, every_s=10)
    c = generate_schedule(np.random.default_rng(8), engines, duration_s=600, every_s=10)
    assert a == b and a != c
    assert len(a.events) > 20
    assert all(0 <= e.at_s < 600 for e in a.events)
    killed = [e.engine for e in a.events if isinstance(e, KillEngine | SpotPreempt)]
    assert len(set(killed)) == len(killed) <= len(engines) - 1
    slow = [e for e in a.events if isinstance(e, SlowGpu)]
    assert slow and all(2.0 <= e.factor <= 8.0 for e in slow)
    # a killed engine is never the target of a later event
    for i, e in enumerate(a.events):
        if isinstance(e, KillEngine):
            assert all(getattr(later, "engine", None) != e.engine for later in a.events[i + 1:])


def test_generator_refuses_bad_arguments() -> None:
    rng = np.random.default_rng(0)
    with pytest.raises(ValueError, match="subset"):
        generate_schedule(rng, ["e0"], duration_s=10, every_s=1, kinds=["router_restart"])
    with pytest.raises(ValueError, match="no engine"):
        generate_schedule(rng, [], duration_s=10, every_s=1)

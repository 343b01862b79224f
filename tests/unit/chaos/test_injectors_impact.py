"""Planning a schedule into timed actions, and the per-event impact figures (no Ray)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import pytest

from cluster.chaos.impact import event_impact, token_throughput
from cluster.chaos.injectors import Action, UnsupportedEvent, plan_actions
from cluster.chaos.schedule import KvEvents, parse_schedule
from cluster.loadtest.record import RequestRecord
from cluster.loadtest.spec import RequestId


class FakeControl:
    """Records what the actions asked for (the injectors' seam, no cluster)."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, object]] = []
        self.nodes = {"n0": ["a", "b"]}

    def kill_engine(self, engine: str) -> list[str]:
        self.calls.append(("kill", engine))
        return [engine]

    def engines_on_node(self, node: str) -> list[str]:
        return self.nodes[node]

    def drain(self, engine: str) -> None:
        self.calls.append(("drain", engine))

    def set_slowdown(self, engine: str, factor: float) -> None:
        self.calls.append(("slow", (engine, factor)))

    def replace_engine(self, engine: str) -> None:
        self.calls.append(("replace", engine))

    def partition(self, engines: Sequence[str], between: str, on: bool) -> None:
        self.calls.append(("partition", (tuple(engines), between, on)))

    def disturb_kv_events(self, event: KvEvents, on: bool) -> None:
        self.calls.append(("kv_events", (event.engines, on)))

    def restart_router(self, down_s: float, graceful: bool = True) -> None:
        self.calls.append(("restart_router", (down_s, graceful)))

    def set_transfer_faults(self, plan: Mapping[str, Any] | None) -> None:
        self.calls.append(("transfer_faults", plan))

    def kill_store(self, region: str | None, replica: int | None) -> list[str]:
        self.calls.append(("kill_store", (region, replica)))
        return []


def run(actions: list[Action]) -> FakeControl:
    c = FakeControl()
    for a in actions:
        a.do(c)
    return c


def test_actions_are_time_ordered_and_do_what_the_event_says() -> None:
    s = parse_schedule([{"kind": "slow_gpu", "at_s": 1, "engine": "a", "factor": 3, "duration_s": 4},
                        {"kind": "spot_preempt", "at_s": 2, "engine": "b", "notice_s": 1},
                        {"kind": "kill_node", "at_s": 6, "node": "n0"}])
    actions = plan_actions(s)
    assert [(a.at_s, a.event_index) for a in actions] == [(1, 0), (2, 1), (3, 1), (5, 0), (6, 2)]
    assert run(actions).calls == [("slow", ("a", 3.0)), ("drain", "b"), ("kill", "b"), ("slow", ("a", 1.0)),
                                  ("kill", "a"), ("kill", "b")]


def test_periods_switch_on_then_off_and_replacements_follow_the_kill() -> None:
    s = parse_schedule([
        {"kind": "kill_engine", "at_s": 1, "engine": "a", "replace_after_s": 4},
        {"kind": "spot_preempt", "at_s": 2, "engine": "b", "notice_s": 1, "replace_after_s": 0.5},
        {"kind": "partition", "at_s": 3, "engines": ["a", "b"], "between": "engines", "duration_s": 1},
        {"kind": "kv_events", "at_s": 3, "loss": 0.5, "duration_s": 3},
        {"kind": "router_restart", "at_s": 7, "down_s": 0.5},
        {"kind": "transfer_faults", "at_s": 8, "duration_s": 1, "plan": {"rates": {"drop": 0.1}}},
    ])
    actions = plan_actions(s)
    assert [(a.at_s, a.event_index) for a in actions] == [
        (1, 0), (2, 1), (3, 1), (3, 2), (3, 3), (3.5, 1), (4, 2), (5, 0), (6, 3), (7, 4), (8, 5), (9, 5)]
    assert run(actions).calls == [
        ("kill", "a"), ("drain", "b"), ("kill", "b"), ("partition", (("a", "b"), "engines", True)),
        ("kv_events", ((), True)), ("replace", "b"), ("partition", (("a", "b"), "engines", False)),
        ("replace", "a"), ("kv_events", ((), False)), ("restart_router", (0.5, True)),
        ("transfer_faults", {"rates": {"drop": 0.1}}), ("transfer_faults", None)]
    crash = plan_actions(parse_schedule([{"kind": "router_restart", "at_s": 1, "mode": "crash"}]))
    assert run(crash).calls == [("restart_router", (0.0, False))] and "kill the router" in crash[0].what


def test_a_kind_without_injector_fails_before_the_run() -> None:
    s = parse_schedule([{"kind": "slow_gpu", "at_s": 1, "engine": "a", "factor": 2, "duration_s": 1}])
    with pytest.raises(UnsupportedEvent, match=r"events\[0\]: slow_gpu"):
        plan_actions(s, injectors={})


def rec(rid: str, sent_s: float, *, ok: bool = True, ttft: float = 100.0, e2e: float = 1000.0,
        tokens: int = 10) -> RequestRecord:
    return RequestRecord(RequestId(rid), "ok" if ok else "connection_error", sent_s * 1000, sent_s * 1000, 10, tokens,
                         ttft_ms=ttft if ok else None, e2e_ms=e2e if ok else None, output_tokens=tokens if ok else 0,
                         finished_ms=sent_s * 1000 + e2e)


def test_throughput_spreads_tokens_over_each_stream() -> None:
    t = token_throughput([rec("a", 0.0, ttft=0.0, e2e=1999.0, tokens=20)], bin_s=1.0, horizon_s=3.0)
    assert t.tolist() == [10.0, 10.0, 0.0]


def test_impact_counts_failures_compares_windows_and_finds_recovery() -> None:
    # steady 10 requests/s before the kill at 5 s; none sent from 5 to 7 s; back from 7 s
    records = [rec(f"r{i}", i / 10) for i in range(50)] + [rec(f"s{i}", 7 + i / 10) for i in range(30)]
    records.append(rec("lost", 4.5, ok=False, e2e=800.0))
    event = parse_schedule([{"kind": "kill_engine", "at_s": 5, "engine": "a"}]).events[0]
    imp = event_impact(event, 0, records, window_s=2.0)
    assert imp["failed"] == 1 and imp["failed_ids"] == ["lost"]
    assert imp["before"]["requests"] == 21 and imp["before"]["ok"] == 20
    assert imp["during"]["requests"] == 0 and imp["after"]["requests"] == 20
    assert imp["before"]["tpot_ms"]["p50"] == pytest.approx(100.0)
    assert imp["throughput_before_tok_s"] == pytest.approx(100.0)
    # throughput dips after the gap in sends (streams of 1 s) and is back once the new ones run
    assert imp["recovery_s"] is not None and 2.0 <= imp["recovery_s"] <= 3.0

"""The engine- and transport-side switches the injectors flip, without Ray or sockets: the feed's KV-event
disturbance and partition, the transport wrapper's peer cut, and the soak's seeded schedule."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from actors.feed import FeedDisturbance, FeedHub, _Connection
from cluster.chaos.soak import SoakConfig, soak_schedule
from transport import PeerGone
from transport.base import Address, Site
from transport.faulty import FaultPlan, FaultyTransport


def frames(n: int) -> list[dict[str, Any]]:
    return [{"t": "kv", "e": "a", "seq": i} for i in range(1, n + 1)]


def test_disturbance_loses_duplicates_and_reorders_each_batch_at_most_once() -> None:
    d = FeedDisturbance(loss=0.2, duplicate=0.2, reorder=0.3, seed=1)
    out = [f["seq"] for fr in frames(200) for f in d.pass_on(fr)] + [f["seq"] for f in d.flush()]
    c = d.counts
    assert c["lost"] > 0 and c["duplicated"] > 0 and c["reordered"] > 0
    assert len(out) == 200 - c["lost"] + c["duplicated"]
    assert len(set(out)) == 200 - c["lost"]  # a lost batch never comes back, every other one does
    assert out != sorted(out)  # some arrive late
    again = FeedDisturbance(loss=0.2, duplicate=0.2, reorder=0.3, seed=1)
    assert [f["seq"] for fr in frames(200) for f in again.pass_on(fr)] + [f["seq"] for f in again.flush()] == out


def test_a_cut_engine_is_gone_from_connections_until_healed_with_a_snapshot() -> None:
    class Src:
        pass

    hub = FeedHub()
    hub._sources["a"] = Src()  # type: ignore[assignment]
    hub._sources["b"] = Src()  # type: ignore[assignment]
    c = _Connection(set(), 16)
    hub._conns.add(c)
    hub._subscribe(c, ["a", "b"])
    c.snapshots.clear()
    hub.cut("a")
    assert c.engines == {"b"} and c.gone == {"a"} and c.severed == {"a"}
    hub._fan_out("a", {"t": "kv", "e": "a", "seq": 1})
    assert not c.kv  # nothing of a reaches the router while cut
    late = _Connection(set(), 16)
    hub._conns.add(late)
    hub._subscribe(late, ["a"])  # a router reconnecting during the cut is told a is gone too
    assert late.engines == set() and late.gone == {"a"}
    hub.heal("a")
    assert c.engines == {"a", "b"} and "a" in c.snapshots and late.engines == {"a"}


def test_a_transport_cut_refuses_the_peer_and_switch_changes_the_plan() -> None:
    class Inner:
        name, site, clock = "fake", Site("n", "r"), None

        def deadline(self, deadline_ms: float | None) -> float:
            return 0.0

        async def push(self, *a: Any, **k: Any) -> str:
            return "pushed"

    t = FaultyTransport(Inner(), FaultPlan())  # type: ignore[arg-type]
    peer, other = Address("tcp", "10.0.0.1:1", Site("m", "r")), Address("tcp", "10.0.0.2:1", Site("m", "r"))
    t.cut([peer.location])
    with pytest.raises(PeerGone, match="partition"):
        asyncio.run(t.push(peer, "r1", []))  # type: ignore[arg-type]
    assert asyncio.run(t.push(other, "r1", [])) == "pushed"  # type: ignore[arg-type]
    t.heal()
    assert asyncio.run(t.push(peer, "r1", [])) == "pushed"  # type: ignore[arg-type]
    t.switch(FaultPlan(seed=3, rates={"drop": 1.0}))
    assert t._draw() == "drop"
    t.switch(None)
    assert t._draw() is None


def test_soak_schedule_is_seeded_and_never_hits_an_engine_that_is_down() -> None:
    cfg = SoakConfig(duration_s=600, every_s=20, notice_s=30, replace_after_s=10, seed=9)
    s = soak_schedule(cfg, ["a", "b", "c"])
    assert s == soak_schedule(cfg, ["a", "b", "c"]) and len(s.events) > 10
    busy: dict[str, float] = {}
    for e in s.events:
        assert e.kind in ("kill_engine", "spot_preempt")
        engine = e.engine
        assert busy.get(engine, 0.0) <= e.at_s
        busy[engine] = e.end_s()
        assert e.replace_after_s == 10

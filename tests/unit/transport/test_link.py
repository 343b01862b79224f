"""The link model: processor-sharing math, topology from a cluster spec, timing on a virtual clock."""

from __future__ import annotations

import asyncio

import pytest

from config.cluster import ClusterSpec
from config.link import LinkProfile
from tests.unit.transport.conftest import VirtualClock
from transport.base import Site
from transport.link import LinkModel, ProcessorSharing, Topology

GBPS10 = LinkProfile(name="ten", source="test", kind="tcp", bandwidth_gbps=10.0, latency_us=100.0)
MB = 1e6


def test_single_flow_drains_at_full_rate() -> None:
    ps = ProcessorSharing(rate_bytes_per_ms=1000.0)
    assert ps.add(0.0, 1, 5000.0) == []
    assert ps.next_completion() == pytest.approx(5.0)
    assert ps.advance(4.99) == []
    assert ps.advance(10.0) == [(1, pytest.approx(5.0))]


def test_equal_flows_finish_together() -> None:
    ps = ProcessorSharing(1000.0)
    for f in range(4):
        ps.add(0.0, f, 1000.0)
    done = ps.advance(100.0)
    assert sorted(f for f, _ in done) == [0, 1, 2, 3]
    assert all(t == pytest.approx(4.0) for _, t in done)


def test_staggered_arrival_is_re_rated() -> None:
    # A (2000 B) alone for 1 ms drains 1000 B; then B (500 B) joins: both at 500 B/ms.
    # B finishes at 1 + 500/500 = 2 ms; A has 500 B left, alone again: done at 2.5 ms.
    ps = ProcessorSharing(1000.0)
    ps.add(0.0, "A", 2000.0)  # type: ignore[arg-type]
    ps.add(1.0, "B", 500.0)  # type: ignore[arg-type]
    assert ps.advance(10.0) == [("B", pytest.approx(2.0)), ("A", pytest.approx(2.5))]


def test_removal_speeds_up_the_rest() -> None:
    ps = ProcessorSharing(1000.0)
    ps.add(0.0, 1, 1000.0)
    ps.add(0.0, 2, 1000.0)
    ps.remove(1.0, 2)  # flow 1 drained 500 B in the first ms
    assert ps.advance(5.0) == [(1, pytest.approx(1.5))]
    assert ps.add(5.0, 3, 0.0) == [(3, 5.0)]  # an empty flow completes at once


def test_topology_from_cluster() -> None:
    spec = ClusterSpec.model_validate({
        "name": "t",
        "regions": [{"name": "us-east-1"}, {"name": "eu-west-1"}],
        "nodes": [
            {"name": "a", "region": "us-east-1", "hardware": "h100-80g-sxm",
             "engines": [{"name": "e1", "model": "llama-3.1-8b"}]},
            {"name": "b", "region": "us-east-1", "hardware": "h100-80g-sxm", "nic": "roce-100g",
             "engines": [{"name": "e2", "model": "llama-3.1-8b"}]},
            {"name": "c", "region": "eu-west-1", "hardware": "h100-80g-sxm",
             "engines": [{"name": "e3", "model": "llama-3.1-8b"}]},
        ],
    })
    topo = Topology.from_cluster(spec)
    a0, a1 = Site("a", "us-east-1"), Site("a", "us-east-1")
    same_node = topo.route(a0, a1)
    assert same_node.link.kind == "nvlink" and same_node.resource == ("gpu-link", "a")
    nic = topo.route(a0, Site("b", "us-east-1"))
    assert nic.link.name == "roce-100g" and nic.resource == ("nic", "a")  # the slower end's NIC
    wan = topo.route(a0, Site("c", "eu-west-1"))
    assert wan.link.kind == "wan" and wan.link.latency_us == pytest.approx(75_000 / 2)
    assert wan.resource == ("wan", "eu-west-1", "us-east-1")
    with pytest.raises(KeyError, match="not in the topology"):
        topo.route(a0, Site("zz", "us-east-1"))


@pytest.mark.parametrize("n", [1, 8, 32])
async def test_concurrent_transfers_match_the_analytic_time(vclock: VirtualClock, n: int) -> None:
    model = LinkModel(Topology.flat(GBPS10), vclock, payload_scale=1 / 64)
    a, b = Site("a", "r"), Site("b", "r")

    async def scenario() -> list[float]:
        results = await asyncio.gather(*(model.transfer(a, b, 10 * MB) for _ in range(n)))
        return [m.end_ms for m in results]

    ends = await vclock.run(scenario())
    expected = n * 10 * MB / (10.0 * 1e6) + 0.1  # n x 1 ms of bytes, plus 100 us latency
    assert ends == [pytest.approx(expected)] * n
    assert model.active() == 0
    await model.close()


async def test_pull_pays_the_request_leg_and_cancel_re_rates(vclock: VirtualClock) -> None:
    model = LinkModel(Topology.flat(GBPS10), vclock)
    a, b = Site("a", "r"), Site("b", "r")

    async def scenario() -> tuple[float, float]:
        pulled = await model.transfer(a, b, 10 * MB, request_leg=True)
        slow = asyncio.ensure_future(model.transfer(a, b, 100 * MB))
        fast = asyncio.ensure_future(model.transfer(a, b, 10 * MB))
        await vclock.sleep_until(vclock.now_ms() + 1.0)  # both shared the link for 1 ms: 5 MB each
        slow.cancel()
        done = await fast
        with pytest.raises(asyncio.CancelledError):
            await slow
        return pulled.end_ms, done.end_ms - done.start_ms

    pull_end, fast_ms = await vclock.run(scenario())
    assert pull_end == pytest.approx(0.1 + 1.0 + 0.1)
    assert fast_ms == pytest.approx(1.0 + 0.5 + 0.1)  # 5 MB left alone at 10 GB/s after the cancel
    await model.close()


def test_payload_scale_converts_bytes() -> None:
    model = LinkModel(Topology.flat(GBPS10), VirtualClock(), payload_scale=1 / 64)
    assert model.emulated_bytes(1 << 20) == 64 << 20
    with pytest.raises(ValueError):
        LinkModel(Topology.flat(GBPS10), VirtualClock(), payload_scale=0)


def test_prediction_under_sharing() -> None:
    ps = ProcessorSharing(1000.0)
    ps.add(0.0, 1, 1000.0)
    ps.add(0.0, 2, 3000.0)
    assert ps.predict(1) == pytest.approx(2.0)  # both drain 1000 B at 500 B/ms
    assert ps.predict(2) == pytest.approx(4.0)  # then flow 2 alone: 2000 B at 1000 B/ms
    assert ps.predict(3) is None
    assert ps.advance(10.0) == [(1, pytest.approx(2.0)), (2, pytest.approx(4.0))]


async def test_push_flow_signals_early_by_the_commit_round_trip(vclock: VirtualClock) -> None:
    model = LinkModel(Topology.flat(GBPS10), vclock)
    a, b = Site("a", "r"), Site("b", "r")

    async def scenario() -> tuple[float, float, float]:
        flow = model.open_push(a, b, 10 * MB, start_ms=0.0, early_ms=0.3)
        await flow.arrival()
        opened = vclock.now_ms()
        early = flow.result().end_ms  # predicted while the bytes still drain
        await vclock.sleep_until(5.0)
        exact = flow.result().end_ms
        flow.close()
        return opened, early, exact

    opened, early, exact = await vclock.run(scenario())
    assert opened == pytest.approx(1.1 - 0.3)  # 1 ms of bytes + 100 us latency, opened 300 us ahead
    assert early == pytest.approx(1.1) and exact == pytest.approx(1.1)
    assert model.active() == 0
    await model.close()

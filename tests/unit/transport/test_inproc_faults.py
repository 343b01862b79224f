"""The in-process backend, the shaping wrapper on it, the fault wrapper over it, and the registry."""

from __future__ import annotations

import asyncio
from collections import Counter

import numpy as np
import pytest

from actors.clock import Clock
from config.cluster import TransportSpec
from config.link import LinkProfile
from tests.unit.transport.conftest import VirtualClock
from transport import (
    Block,
    BlockId,
    BlockNotFound,
    ConnectError,
    FaultPlan,
    FaultyTransport,
    IntegrityError,
    PeerGone,
    RequestId,
    ShapedTransport,
    Site,
    Topology,
    TransferTimeout,
    TransportClosed,
    TransportError,
    backend_factory,
    make_transport,
    register,
)
from transport.base import Address, translate
from transport.inproc import InprocHub, InprocTransport

A, B = Site("a", "r"), Site("b", "r")
R = RequestId("req")


def blocks(n: int = 3, size: int = 5000, seed: int = 0) -> list[Block]:
    rng = np.random.default_rng(seed)
    return [Block.of(i, rng.integers(0, 256, size, dtype=np.uint8), (0, 4)) for i in range(n)]


@pytest.fixture
async def pair(clock: Clock):
    hub = InprocHub()
    a, b = InprocTransport(A, clock, hub=hub), InprocTransport(B, clock, hub=hub)
    addr = await b.serve()
    yield a, b, addr
    await a.close()
    await b.close()
    assert a.stats().pending == b.stats().pending == 0


async def test_push_hands_views_and_detach_copies(pair) -> None:
    a, b, addr = pair
    sent = blocks()
    rec = await a.push(addr, R, sent)
    assert rec.op == "push" and rec.blocks == 3 and rec.real_bytes == 15000 and rec.link is None
    with await b.receive(R, count=3) as got:
        assert [g.block_id for g in got.blocks] == [0, 1, 2]
        view, source = np.frombuffer(got.blocks[0].payload, np.uint8), np.frombuffer(sent[0].payload, np.uint8)
        assert np.shares_memory(view, source)
        assert got.blocks[0].payload.readonly
        owned = got.detach()
    assert bytes(owned[1].payload) == bytes(sent[1].payload)
    assert not np.shares_memory(np.frombuffer(owned[1].payload, np.uint8), np.frombuffer(sent[1].payload, np.uint8))


async def test_pull_and_errors(pair) -> None:
    a, b, addr = pair
    sent = blocks()
    b.publish(R, sent)
    sizes: list[int] = []
    with await a.pull(addr, R, [BlockId(2), BlockId(0)], on_size=sizes.append) as got:
        assert [g.block_id for g in got.blocks] == [2, 0] and sizes == [10000]
        assert got.record is not None and got.record.op == "pull"
    with pytest.raises(BlockNotFound):
        await a.pull(addr, R, [BlockId(9)])
    b.withdraw(R)
    with pytest.raises(BlockNotFound):
        await a.pull(addr, R, [BlockId(0)])
    with pytest.raises(ConnectError):
        await a.push(Address("inproc", "nowhere", B), R, sent)


async def test_supplied_checksums_are_verified(pair) -> None:
    a, b, addr = pair
    good = blocks(1)[0].with_checksum()
    assert good.checksum is not None
    bad = Block(good.block_id, memoryview(bytearray(good.payload)), good.layers, good.checksum ^ 1)
    with pytest.raises(IntegrityError):
        await a.push(addr, R, [good, bad])
    assert b.inbox.count(R) == 0  # nothing half-delivered
    await a.push(addr, R, [good])
    b.discard(R)


async def test_gate_holds_visibility_and_cancel_leaves_nothing(pair) -> None:
    a, b, addr = pair
    opened = asyncio.Event()

    async def gate() -> None:
        await opened.wait()

    task = asyncio.ensure_future(a.push(addr, R, blocks(), gate=gate))
    await asyncio.sleep(0.01)
    assert b.inbox.count(R) == 0
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert b.inbox.count(R) == 0
    task = asyncio.ensure_future(a.push(addr, R, blocks(), gate=gate))
    await asyncio.sleep(0.01)
    opened.set()
    await task
    assert b.inbox.count(R) == 3
    b.discard(R)


async def test_deadlines_and_close(pair, clock: Clock) -> None:
    a, b, addr = pair

    async def never() -> None:
        await asyncio.Event().wait()

    with pytest.raises(TransferTimeout):
        await a.push(addr, R, blocks(), gate=never, deadline_ms=clock.now_ms() + 20)
    with pytest.raises(TransferTimeout):
        await b.receive(R, deadline_ms=clock.now_ms() + 10)
    await b.close()
    with pytest.raises((ConnectError, PeerGone)):
        await a.push(addr, R, blocks())
    with pytest.raises(TransportClosed):
        await b.receive(R)


async def test_shaped_push_becomes_visible_at_emulated_arrival(vclock: VirtualClock) -> None:
    link = LinkProfile(name="l", source="t", kind="tcp", bandwidth_gbps=1.0, latency_us=1000.0)
    hub = InprocHub()
    a = make_transport(TransportSpec(backend="inproc", kv_payload_scale=0.5), site=A, clock=vclock,
                       topology=Topology.flat(link))
    assert isinstance(a, ShapedTransport)
    b = InprocTransport(B, vclock, hub=hub)
    a.inner.hub = hub  # type: ignore[attr-defined]
    addr = await b.serve()

    async def scenario() -> tuple[float, float]:
        rec = await a.push(addr, R, blocks(2, 500_000))  # 1 MB real = 2 MB emulated at scale 1/2
        assert b.inbox.count(R) == 2
        b.discard(R)
        return rec.modelled_ms, rec.emulated_ms

    modelled, emulated = await vclock.run(scenario())
    assert modelled == pytest.approx(2.0 + 1.0) and emulated == pytest.approx(modelled)  # 2 ms of bytes + 1 ms
    b.publish(R, blocks(1, 1_000_000))

    async def pulled() -> float:
        with await a.pull(addr, R, [BlockId(0)]) as d:
            assert d.record is not None
            return d.record.modelled_ms

    assert await vclock.run(pulled()) == pytest.approx(1.0 + 2.0 + 1.0)  # request leg, bytes, latency
    await a.close()
    await b.close()


async def test_every_fault_kind_fails_typed_or_delivers_intact() -> None:
    clock = Clock(0.01)  # 100x faster than real time: deadlines and delays pass quickly
    hub = InprocHub()
    plan = FaultPlan.every_kind(0.7, seed=3, delay_ms=(0.0, 30.0))
    a = FaultyTransport(InprocTransport(A, clock, hub=hub), plan)
    b = FaultyTransport(InprocTransport(B, clock, hub=hub), plan)
    addr = await b.serve()
    outcomes: Counter[str] = Counter()
    for i in range(300):
        rid = RequestId(f"r{i}")
        sent = blocks(2, 1000, seed=i)
        try:
            if i % 2:
                await a.push(addr, rid, sent, deadline_ms=clock.now_ms() + 50)
                got = await b.receive(rid, count=2, deadline_ms=clock.now_ms() + 50)
            else:
                b.publish(rid, sent)
                got = await a.pull(addr, rid, [BlockId(0), BlockId(1)], deadline_ms=clock.now_ms() + 50)
        except TransportError as e:
            outcomes[type(e).__name__] += 1
            b.discard(rid)
            continue
        with got:
            assert [bytes(g.payload) for g in got.blocks] == [bytes(s.payload) for s in sent], "silent corruption"
        outcomes["ok"] += 1
    assert set(outcomes) == {"ok", "TransferTimeout", "IntegrityError", "PeerGone"}
    assert set(a.injected) == {"drop", "delay", "bandwidth", "truncate", "corrupt", "reset", "hang"}
    assert {"corrupt@publish", "truncate@publish"} <= set(b.injected)
    await a.close()
    await b.close()


def test_fault_plans_are_validated_and_seeded() -> None:
    with pytest.raises(ValueError, match="at most 1"):
        FaultPlan(rates={"drop": 0.6, "hang": 0.6})
    with pytest.raises(ValueError):
        FaultPlan.model_validate({"rates": {"explode": 0.1}})
    draws = [FaultyTransport(InprocTransport(A, Clock(), hub=InprocHub()), FaultPlan.every_kind(0.5, seed=7))
             for _ in range(2)]
    assert [draws[0]._draw() for _ in range(50)] == [draws[1]._draw() for _ in range(50)]


def test_registry() -> None:
    assert backend_factory("inproc") is InprocTransport
    with pytest.raises(KeyError, match=r"known: .*tcp"):
        backend_factory("carrier-pigeon")
    register("fake", lambda site, clock, options: InprocTransport(site, clock, options, hub=InprocHub()))
    t = make_transport(TransportSpec(backend="inproc"), site=A, clock=Clock())
    assert isinstance(t, InprocTransport)
    assert isinstance(backend_factory("fake")(A, Clock(), t.options), InprocTransport)


def test_translate_maps_backend_errors() -> None:
    assert isinstance(translate(ConnectionRefusedError(), "x"), ConnectError)
    assert isinstance(translate(ConnectionResetError(), "x"), PeerGone)
    assert isinstance(translate(TimeoutError(), "x"), TransferTimeout)
    assert isinstance(translate(type("UCXConnectionResetError", (Exception,), {})(), "x"), PeerGone)
    err = IntegrityError("kept")
    assert translate(err, "x") is err


def test_inbox_is_idempotent_per_block() -> None:
    from transport.base import Inbox

    released: list[int] = []

    class Lease:
        def __init__(self, n: int) -> None:
            self.n = n

        def release(self) -> None:
            released.append(self.n)

    inbox = Inbox()
    first, again = blocks(2), blocks(2, seed=1)
    inbox.deliver(R, first, [Lease(1), Lease(2)])
    inbox.deliver(R, again[:1], [Lease(3)])  # a retried push re-delivers block 0
    assert inbox.count(R) == 2 and released == [1]
    got = inbox.take(R)
    assert [bytes(b.payload) for b in got.blocks] == [bytes(again[0].payload), bytes(first[1].payload)]
    got.release()
    assert sorted(released) == [1, 2, 3]


async def test_inproc_push_keys_blocks_like_deliver(pair) -> None:
    """The inproc push keys its blocks as it checks them (``Inbox.deliver_keyed``): a block pushed twice in one
    push or again in a retried push counts once and the last copy wins; blocks that held a buffer are released
    when a keyed push replaces them."""
    a, b, addr = pair
    first, again = blocks(2), blocks(2, seed=1)
    await a.push(addr, R, [first[0], again[0], first[1]])  # block 0 twice in one push: the later copy stays
    assert b.inbox.count(R) == 2
    await a.push(addr, R, [again[1]])  # a retry of block 1
    got = await b.receive(R, count=2)
    assert [bytes(g.payload) for g in got.blocks] == [bytes(again[0].payload), bytes(again[1].payload)]
    got.release()

    released: list[int] = []

    class Lease:
        def release(self) -> None:
            released.append(1)

    b.inbox.deliver(R, first[:1], [Lease()])  # as a socket backend delivers: the block holds a buffer
    await a.push(addr, R, again[:1])
    assert released == [1] and b.inbox.count(R) == 1
    with await b.receive(R) as got:
        assert bytes(got.blocks[0].payload) == bytes(again[0].payload)

"""UCX transport (the optional ``ucx`` extra): both ways to connect, cleanup, faults, and worker addresses
exchanged through Ray between two actors on this host. Skipped, saying why, where ucxx does not import."""

from __future__ import annotations

import asyncio
import contextlib
from collections import Counter
from collections.abc import AsyncIterator
from typing import Any

import numpy as np
import pytest

from actors.clock import Clock
from transport import (
    Block,
    BlockId,
    BlockNotFound,
    FaultPlan,
    FaultyTransport,
    IntegrityError,
    RequestId,
    Site,
    TransferTimeout,
    TransportError,
    TransportOptions,
)
from transport.base import Address, TransportStats
from transport.ucx import ucx_available
from transport.verify import VERIFY_THREAD_MIN

REASON = ucx_available()
pytestmark = [pytest.mark.integration, pytest.mark.skipif(REASON is not None, reason=f"ucxx unavailable: {REASON}")]
A, B = Site("a", "r"), Site("b", "r")
R = RequestId("req")


def blocks(n: int = 3, size: int = 200_000, seed: int = 0) -> list[Block]:
    rng = np.random.default_rng(seed)
    return [Block.of(i, rng.integers(0, 256, size, dtype=np.uint8), (i, i + 1)) for i in range(n)]


def same(got: list[Block], sent: list[Block]) -> bool:
    return [(g.block_id, g.layers, bytes(g.payload)) for g in got] == [(s.block_id, s.layers, bytes(s.payload))
                                                                       for s in sent]


async def settle(*ts: object) -> None:
    for _ in range(200):
        if all(t.stats().pending == t.stats().staged == 0  # type: ignore[attr-defined]
               and t.pool.leases <= t.inbox.total_blocks() for t in ts):  # type: ignore[attr-defined]
            return
        await asyncio.sleep(0.01)


@pytest.fixture(params=["listener", "worker_address"])
async def pair(request: pytest.FixtureRequest) -> AsyncIterator[tuple[object, object, Address, Clock]]:
    from transport.ucx import UcxTransport

    clock = Clock(1.0)
    opts = TransportOptions(ucx_same_host=request.param, pool_bytes=64 << 20, max_frame_payload=16 << 20)
    a, b = UcxTransport(A, clock, opts), UcxTransport(B, clock, opts)
    addr = await b.serve()
    yield a, b, addr, clock
    await settle(a, b)
    await a.close()
    await b.close()
    assert a.stats() == TransportStats() and b.stats() == TransportStats()
    for _ in range(5):
        await asyncio.sleep(0)
    mine = [t for t in asyncio.all_tasks() if t is not asyncio.current_task() and "ucx" in repr(t.get_coro())
            and "transport" in repr(t.get_coro())]
    assert not mine, f"tasks left behind: {mine}"


async def test_push_pull_and_multiplexing(pair) -> None:
    a, b, addr, _ = pair
    sent = [*blocks(), Block.of(9, b"", (0, 4))]
    await a.push(addr, R, sent)
    with await b.receive(R, count=4) as got:
        assert same(got.blocks, sent)
    b.publish(R, sent)
    with await a.pull(addr, R, [BlockId(2), BlockId(9), BlockId(0)]) as got:
        assert same(got.blocks, [sent[2], sent[3], sent[0]])
    with pytest.raises(BlockNotFound):
        await a.pull(addr, R, [BlockId(5)])

    async def one(i: int) -> bool:
        rid = RequestId(f"m{i}")
        await a.push(addr, rid, blocks(2, 50_000, seed=i))
        with await b.receive(rid, count=2) as got:
            return same(got.blocks, blocks(2, 50_000, seed=i))

    assert all(await asyncio.gather(*(one(i) for i in range(32))))
    assert a.connects == 1 and sum(a.paths.values()) == 1


async def test_a_ucx_connection_keeps_a_small_window_in_flight(pair) -> None:
    a, b, addr, _ = pair
    assert a.inflight_bytes == a.options.ucx_inflight_bytes == 8 << 20 < a.options.max_inflight_bytes
    sent = {i: blocks(3, 1 << 20, seed=i) for i in range(8)}  # 24 MiB of pushes at once over an 8 MiB window
    await asyncio.gather(*(a.push(addr, RequestId(f"w{i}"), s) for i, s in sent.items()))
    for i, s in sent.items():
        with await b.receive(RequestId(f"w{i}"), count=3) as got:
            assert same(got.blocks, s)
    [client] = a._clients.values()
    assert client.budget.capacity == 8 << 20 and client.budget.used == 0


async def test_deadline_and_cancellation_leave_nothing(pair) -> None:
    a, b, addr, clock = pair

    async def never() -> None:
        await asyncio.Event().wait()

    with pytest.raises(TransferTimeout):
        await a.push(addr, R, blocks(), gate=never, deadline_ms=clock.now_ms() + 100)
    big = blocks(8, 1_000_000)
    task = asyncio.ensure_future(a.push(addr, RequestId("c"), big))
    await asyncio.sleep(0.002)
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await task
    await settle(a, b)
    b.discard(RequestId("c"))
    assert b.stats().staged == 0 and b.pool.leases == 0 and b.inbox.count(R) == 0


async def test_reconnect_after_reset(pair) -> None:
    a, b, addr, _ = pair
    await a.push(addr, R, blocks(1))
    assert a.abort_connections(addr) == 1
    await a.push(addr, R, blocks(1))
    assert a.connects == 2
    b.discard(R)


async def test_garbage_closes_only_that_endpoint(pair) -> None:
    from transport.ucx import UcxConnection, UcxTransport

    a, b, addr, clock = pair
    await a.push(addr, R, blocks(1))
    b.discard(R)
    c = UcxTransport(Site("c", "r"), clock, a.options)
    await c.push(addr, RequestId("c"), blocks(1))
    b.discard(RequestId("c"))
    conn = c._clients[addr.location].conn  # a peer that turns bad on an established connection
    assert isinstance(conn, UcxConnection)
    conn.w.send(conn.ep, b"GARBAGE!" * 4, conn.tag_ctrl_out, lambda _exc: None)
    for _ in range(200):
        if b.frame_errors:
            break
        await asyncio.sleep(0.01)
    assert b.frame_errors == 1
    await c.close()
    await a.push(addr, R, blocks(1))  # still serving the first peer
    b.discard(R)


async def test_faults_never_deliver_corrupt_bytes() -> None:
    from transport.ucx import UcxTransport

    clock = Clock(1.0)
    plan = FaultPlan.every_kind(0.6, seed=5, delay_ms=(0.0, 40.0))
    a = FaultyTransport(UcxTransport(A, clock), plan)
    b = FaultyTransport(UcxTransport(B, clock), plan)
    addr = await b.serve()
    outcomes: Counter[str] = Counter()
    for i in range(80):
        rid = RequestId(f"r{i}")
        sent = blocks(2, 10_000, seed=i)
        try:
            if i % 2:
                await a.push(addr, rid, sent, deadline_ms=clock.now_ms() + 200)
                got = await b.receive(rid, count=2, deadline_ms=clock.now_ms() + 200)
            else:
                b.publish(rid, sent)
                got = await a.pull(addr, rid, [BlockId(0), BlockId(1)], deadline_ms=clock.now_ms() + 200)
        except TransportError as e:
            outcomes[type(e).__name__] += 1
            b.discard(rid)
            continue
        finally:
            b.withdraw(rid)
        with got:
            assert same(got.blocks, sent), "silent corruption"
        outcomes["ok"] += 1
    assert outcomes["ok"] > 10 and outcomes["IntegrityError"] > 0
    await a.close()
    await b.close()


async def test_large_payloads_verified_off_the_loop_still_catch_corruption() -> None:
    """Payloads over ``verify_thread_min_bytes`` (set: ucx's default keeps checks on the worker's thread) are
    checked on the verifier thread: a corrupted one still fails its push with IntegrityError and is never
    delivered; intact ones arrive as sent."""
    from transport.ucx import UcxTransport

    clock = Clock(1.0)
    plan = FaultPlan.model_validate({"seed": 3, "rates": {"corrupt": 0.5}})
    threaded = TransportOptions(verify_thread_min_bytes=VERIFY_THREAD_MIN)
    a = FaultyTransport(UcxTransport(A, clock, threaded), plan)
    b = UcxTransport(B, clock, threaded)
    addr = await b.serve()
    outcomes: Counter[str] = Counter()
    for i in range(12):
        rid = RequestId(f"v{i}")
        sent = blocks(2, 400_000, seed=i)
        try:
            await a.push(addr, rid, sent)
        except IntegrityError:
            outcomes["IntegrityError"] += 1
            assert b.inbox.count(rid) == 0
            continue
        with await b.receive(rid, count=2) as got:
            assert same(got.blocks, sent), "silent corruption"
        outcomes["ok"] += 1
    assert outcomes["ok"] > 0 and outcomes["IntegrityError"] > 0
    await a.close()
    await b.close()


def test_worker_addresses_exchanged_through_ray(ray_cluster: object) -> None:
    """Two actors on this host: the receiver's address (with its UCX worker address) goes through Ray."""
    import ray

    class Peer:
        def __init__(self, name: str) -> None:
            from transport.ucx import UcxTransport

            self.t = UcxTransport(Site(name, "local"), Clock())

        async def serve(self) -> Address:
            return await self.t.serve()

        async def push(self, addr: Address, n: int) -> tuple[list[bytes], dict[str, int]]:
            sent = blocks(n, 100_000, seed=42)
            await self.t.push(addr, RequestId("ray"), sent)
            return [bytes(b.payload[:16]) for b in sent], dict(self.t.paths)

        async def receive(self, n: int) -> list[bytes]:
            with await self.t.receive(RequestId("ray"), count=n) as got:
                return [bytes(b.payload[:16]) for b in got.blocks]

        async def close(self) -> None:
            await self.t.close()

    actor: Any = ray.remote(num_cpus=0)(Peer)
    server, client = actor.remote("node-a"), actor.remote("node-b")
    addr = ray.get(server.serve.remote(), timeout=60)
    assert addr.get("worker") and addr.get("host")
    heads, paths = ray.get(client.push.remote(addr, 3), timeout=60)
    assert ray.get(server.receive.remote(3), timeout=60) == heads
    assert paths == {"worker_address": 1}  # same host: shared memory, not the listener
    ray.get([server.close.remote(), client.close.remote()], timeout=60)
    for actor in (server, client):
        ray.kill(actor)


async def test_closing_initiator_frees_the_server_side(pair) -> None:
    a, b, addr, _ = pair
    await a.push(addr, R, blocks(1))
    b.discard(R)
    assert b.stats().connections == 1
    await a.close()  # by worker address the server only knows because the initiator says goodbye
    for _ in range(300):
        if b.stats().connections == 0:
            break
        await asyncio.sleep(0.01)
    assert b.stats().connections == 0

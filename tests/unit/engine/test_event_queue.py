"""A request's event queue: FIFO, a reader waits for the next event, one reader at a time."""

from __future__ import annotations

import asyncio

import pytest

from actors.engine.api import EventQueue, StreamEvent


def ev(i: int) -> StreamEvent:
    return StreamEvent((i,), float(i))


async def test_events_come_out_in_order_and_a_reader_waits_for_the_next() -> None:
    q = EventQueue()
    q.put_nowait(ev(1))
    q.put_nowait(ev(2))
    assert (await q.get()).token_ids == (1,) and q.get_nowait().token_ids == (2,) and q.empty()
    reader = asyncio.ensure_future(q.get())
    await asyncio.sleep(0)
    assert not reader.done()
    q.put_nowait(ev(3))
    assert (await reader).token_ids == (3,)
    with pytest.raises(asyncio.QueueEmpty):
        q.get_nowait()


async def test_a_cancelled_reader_leaves_the_queue_usable_and_a_second_reader_is_refused() -> None:
    q = EventQueue()
    reader = asyncio.ensure_future(q.get())
    await asyncio.sleep(0)
    with pytest.raises(RuntimeError):
        await q.get()
    reader.cancel()
    await asyncio.gather(reader, return_exceptions=True)
    q.put_nowait(ev(4))
    assert (await q.get()).token_ids == (4,)


async def test_pop_and_arrival_deliver_every_event_in_order_and_a_cancelled_wait_leaves_the_queue_usable() -> None:
    """The streaming handler's way to read: ``pop`` until None, then await ``arrival`` (resolved by the next put)."""
    q = EventQueue()
    assert q.pop() is None
    waiting = q.arrival()
    with pytest.raises(RuntimeError):
        q.arrival()  # one reader
    q.put_nowait(ev(1))
    q.put_nowait(ev(2))
    await waiting
    assert [q.pop(), q.pop(), q.pop()] == [ev(1), ev(2), None]
    cancelled = asyncio.ensure_future(q.arrival())
    await asyncio.sleep(0)
    cancelled.cancel()
    await asyncio.gather(cancelled, return_exceptions=True)
    again = q.arrival()
    q.put_nowait(ev(3))
    await again
    assert q.pop() == ev(3) and q.empty()

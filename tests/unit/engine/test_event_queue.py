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


async def test_direct_takes_events_only_while_the_reader_waits_on_an_empty_queue() -> None:
    """``direct`` runs in ``put_nowait`` only when every earlier event was handled (the reader waits, nothing is
    queued); what it takes never wakes the reader, what it refuses is queued and wakes it, in order."""
    q = EventQueue()
    took: list[StreamEvent] = []

    def direct(e: StreamEvent) -> bool:
        if e.token_ids[0] % 2:
            return False
        took.append(e)
        return True

    q.direct = direct
    q.put_nowait(ev(0))  # no reader waiting: queued
    waiting = q.arrival()
    assert q.pop() == ev(0)
    q.put_nowait(ev(2))
    assert took == [ev(2)] and not waiting.done()  # taken; the reader sleeps on
    q.put_nowait(ev(3))  # refused: queued, the reader woken
    q.put_nowait(ev(4))  # the reader has not read ev(3) yet: queued behind it, not taken out of order
    await waiting
    assert took == [ev(2)] and [q.pop(), q.pop(), q.pop()] == [ev(3), ev(4), None]


async def test_what_direct_leaves_unfinished_wakes_the_reader_and_later_events_wait_behind_it() -> None:
    q = EventQueue()
    error = ConnectionResetError("the client went away")

    def direct(e: StreamEvent) -> bool:
        q.held = error
        return True

    q.direct = direct
    waiting = q.arrival()
    q.put_nowait(ev(1))
    q.put_nowait(ev(2))  # the reader is woken but has not run: queued, not handed to direct
    await waiting
    assert q.held is error and q.pop() == ev(2) and q.pop() is None


async def test_write_now_ends_a_write_here_or_hands_the_rest_to_the_task_that_awaits_it() -> None:
    """``actors.http.write_now``: a write that does not wait ends at once (None), one that raises gives its error,
    one that must wait goes on, from where it stopped, in the task that awaits what is returned."""
    from actors.http import write_now

    log: list[str] = []
    drained: asyncio.Future[None] = asyncio.get_running_loop().create_future()

    async def write(wait: bool) -> None:
        log.append("sent")
        if wait:
            await drained
            log.append("drained")

    async def broken() -> None:
        raise ConnectionResetError("closing transport")

    assert write_now(write(False)) is None and log == ["sent"]
    assert isinstance(write_now(broken()), ConnectionResetError)
    rest = write_now(write(True))
    assert rest is not None and not isinstance(rest, BaseException) and log == ["sent", "sent"]
    task = asyncio.ensure_future(rest)
    await asyncio.sleep(0)
    assert not task.done()
    drained.set_result(None)
    await task
    assert log == ["sent", "sent", "drained"]

"""The relay's bytes to the client, however the engine's stream is cut into reads; the eager body write's
hand-over of a write that must wait (``actors.http.go_on``); a request's first step, then its bookkeeping, then
the rest (``actors.http.first_step_then``). Pure: fake reads, no sockets."""

from __future__ import annotations

import asyncio
import itertools
import json
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from actors.http import first_step_then, go_on
from cluster.router.metrics import RouterMetrics
from cluster.router.relay import ENDED_EARLY, Relay, StreamState
from tests.unit.router.fakes import event


class _Reads:
    """An engine's answer as the router reads it: ``chunk`` hands out the given reads, then b""."""

    def __init__(self, reads: list[bytes]) -> None:
        self.reads = list(reads)

    async def chunk(self) -> bytes:
        return self.reads.pop(0) if self.reads else b""


class _Sink:
    def __init__(self) -> None:
        self.writes: list[bytes] = []

    async def write(self, data: bytes) -> None:
        self.writes.append(data)


def _relay(reads: list[bytes], sink: _Sink, state: StreamState) -> str | None:
    """``Relay.relay`` over these reads, driven to its end at once (nothing here waits: no loop needed)."""
    coro = Relay(None, None, RouterMetrics()).relay(_Reads(reads), sink, state)  # type: ignore[arg-type]
    try:
        coro.send(None)
    except StopIteration as done:
        return done.value
    raise AssertionError("the relay waited on something")


def _token(t: int, finish: bool) -> bytes:
    return event({"id": "cmpl-e", "object": "text_completion", "created": 7, "model": "m",
                  "choices": [{"index": 0, "text": f"t{t} ", "token_ids": [t], "logprobs": None,
                               "finish_reason": "length" if finish else None}]})


USAGE = event({"id": "cmpl-e", "object": "text_completion", "created": 7, "model": "m", "choices": [],
               "usage": {"prompt_tokens": 5, "completion_tokens": 3, "total_tokens": 8}})
ERROR = b'data: {"error": {"message": "aborted", "code": 503}}\n\n'
COMMENT = b": keep-alive\n\n"
DONE = b"data: [DONE]\n\n"
KINDS = st.sampled_from(["token", "usage", "error", "comment"])


def _stream(kinds: list[str]) -> tuple[bytes, bytes, list[int]]:
    """An engine's stream of these events, the bytes the client is owed of it (token events as they came,
    nothing of the rest) and its token ids; the last token finishes it, then [DONE] and an event past it."""
    kinds = [*kinds, "token"]
    last = len(kinds) - 1
    parts, owed, ids = [], [], []
    for k, kind in enumerate(kinds):
        if kind == "token":
            e = _token(k, k == last)
            owed.append(e)
            ids.append(k)
        else:
            e = {"usage": USAGE, "error": ERROR, "comment": COMMENT}[kind]
        parts.append(e)
    return b"".join(parts) + DONE + _token(99, False), b"".join(owed), ids


@settings(max_examples=100, deadline=None)
@given(kinds=st.lists(KINDS, max_size=8), cuts=st.lists(st.integers(0, 4000), max_size=12))
def test_the_client_gets_each_token_event_as_it_came_however_the_reads_cut_the_stream(
        kinds: list[str], cuts: list[int]) -> None:
    stream, owed, ids = _stream(kinds)
    points = sorted({c % (len(stream) + 1) for c in cuts} | {0, len(stream)})
    reads = [stream[a:b] for a, b in itertools.pairwise(points) if b > a]
    sink = _Sink()
    state = StreamState(chat=False, client_usage=True, max_tokens=None)
    assert _relay(reads, sink, state) is None
    assert b"".join(sink.writes) == owed
    assert all(sink.writes) and len(sink.writes) <= len(reads)  # one write per read at most, none empty
    assert state.token_ids == ids and state.finished
    assert state.prompt_tokens == (5 if "usage" in kinds else None)
    assert json.loads(state.first_event or b"{}")["id"] == "cmpl-e"


def test_a_stream_whose_reads_end_before_its_last_token_ended_early_with_what_came_passed_on() -> None:
    reads = [_token(1, False) + _token(2, False)[:20]]
    sink = _Sink()
    state = StreamState(chat=False, client_usage=False, max_tokens=None)
    assert _relay(reads, sink, state) == ENDED_EARLY
    assert sink.writes == [_token(1, False)] and state.token_ids == [1]


async def _body(steps: list[asyncio.Future[None]], log: list[str]) -> None:
    """A body write that waits on each future in turn (a transport draining), logging what happened."""
    try:
        for k, f in enumerate(steps):
            await f
            log.append(f"step {k}")
        log.append("done")
    except asyncio.CancelledError:
        log.append("cancelled")
        raise


async def test_a_body_write_that_must_wait_goes_on_in_its_task_from_where_it_stopped() -> None:
    loop = asyncio.get_running_loop()
    steps: list[asyncio.Future[None]] = [loop.create_future(), loop.create_future()]
    log: list[str] = []
    coro = _body(steps, log)
    waiting = coro.send(None)  # as ``_EagerBodyRequest.write_bytes`` runs it, up to its first wait
    task = loop.create_task(go_on(coro, waiting))
    await asyncio.sleep(0)
    assert log == [] and not task.done()
    steps[0].set_result(None)
    await asyncio.sleep(0)
    assert log == ["step 0"]
    steps[1].set_result(None)
    await task
    assert log == ["step 0", "step 1", "done"]


async def test_cancelling_the_task_of_a_waiting_body_write_cancels_the_write() -> None:
    loop = asyncio.get_running_loop()
    steps: list[asyncio.Future[None]] = [loop.create_future()]
    log: list[str] = []
    coro = _body(steps, log)
    task = loop.create_task(go_on(coro, coro.send(None)))
    await asyncio.sleep(0)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert log == ["cancelled"] and steps[0].cancelled()


async def test_a_body_written_whole_leaves_its_task_nothing_to_do() -> None:
    async def written_whole() -> None:  # a write that never waits for the transport
        return None

    rest: Any = first_step_then(written_whole())  # (an awaitable the task runs: a coroutine)
    task = asyncio.get_running_loop().create_task(rest)
    await task
    assert task.done() and not task.cancelled() and task.exception() is None


async def test_first_step_then_runs_the_callback_after_the_first_step_and_before_any_other_task() -> None:
    loop = asyncio.get_running_loop()
    answer: asyncio.Future[None] = loop.create_future()
    log: list[str] = []

    async def request() -> int:
        log.append("written")
        await answer
        log.append("answered")
        return 7

    async def other() -> None:
        log.append("other task")

    task = loop.create_task(other())  # ready: it runs at the loop's next pass
    rest = first_step_then(request(), lambda: log.append("then"))
    assert log == ["written", "then"]
    await asyncio.sleep(0)
    assert log == ["written", "then", "other task"] and task.done()
    answer.set_result(None)
    assert await rest == 7
    assert log == ["written", "then", "other task", "answered"]


async def test_first_step_then_calls_back_when_the_first_step_ends_or_raises() -> None:
    log: list[str] = []

    async def at_once() -> str:
        log.append("ran")
        return "done"

    async def refused() -> str:
        log.append("ran")
        raise ConnectionRefusedError("no engine")

    assert await first_step_then(at_once(), lambda: log.append("then")) == "done"
    assert log == ["ran", "then"]
    log.clear()
    with pytest.raises(ConnectionRefusedError):
        first_step_then(refused(), lambda: log.append("then"))
    assert log == ["ran", "then"]

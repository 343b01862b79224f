"""The engine's interface types: its config, what it needs of a clock, what it tells observers, the errors it
raises, the stream a request's tokens come out of, and a decode reservation (``actors.engine.engine`` runs
them; split out so the step loop's module stays about the loop)."""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

from actors.cost_model import StepTime
from actors.engine.scheduler import ScheduledStep, SchedulerLimits, TokenOutput
from actors.engine.sequence import FinishReason, RequestId, Sequence
from config.tiers import TiersSpec

if TYPE_CHECKING:
    from actors.engine.engine import Engine


class EngineClock(Protocol):
    """What the engine needs of its time source: ``actors.clock.Clock``, or a virtual clock in unit tests.
    Every timed wait of the engine (steps, leases) goes through ``sleep_until``, so a clock that jumps
    to the next deadline drives the whole engine."""

    def now_ms(self) -> float: ...

    async def sleep_until(self, deadline_ms: float) -> float: ...


class EngineError(Exception):
    """A request the engine refuses; ``status`` is the HTTP status the API should answer with."""

    def __init__(self, status: int, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param


@dataclass(frozen=True)
class EngineConfig:
    name: str
    model_name: str
    role: str
    num_blocks: int
    block_size: int
    limits: SchedulerLimits
    enable_prefix_caching: bool = True
    vocab_size: int = 32000
    seed: int = 0
    tiers: TiersSpec = field(default_factory=TiersSpec)
    kv_payload_scale: float = 1.0
    """Real bytes per emulated KV byte in the tiers (the transport's ``kv_payload_scale``)."""


@dataclass(slots=True)
class StreamEvent:
    """Tokens a step produced for one request, at emulated time ``time_ms``. Treated as immutable but not
    ``frozen``: a frozen slotted dataclass sets each field through ``object.__setattr__`` (2.0 instead of 0.7 us
    to build one, and one is built per streamed token)."""

    token_ids: tuple[int, ...]
    time_ms: float
    finish_reason: FinishReason | None = None


class EngineObserver(Protocol):
    """What the engine reports as it runs (the metrics exporter implements it)."""

    def on_step(self, engine: Engine, step: ScheduledStep, cost: StepTime, lag_wall_ms: float) -> None: ...

    def on_tokens(self, engine: Engine, outputs: list[TokenOutput], end_ms: float) -> None: ...

    def on_finish(self, engine: Engine, seq: Sequence) -> None: ...


@dataclass(frozen=True, slots=True)
class Reservation:
    """KV blocks a decode engine set aside for a request whose prompt's KV a prefill engine will send.

    ``cached_blocks`` leading blocks were already in this engine's prefix cache: they need no transfer.
    """

    request_id: RequestId
    prompt_tokens: int
    cached_blocks: int
    total_blocks: int
    block_hashes: tuple[int, ...]
    expires_ms: float


class EventQueue:
    """A request's events between the step loop (one producer, never blocked) and its handler (one consumer).

    ``asyncio.Queue``'s interface where the engine uses it (``put_nowait``, ``get``, ``get_nowait``, ``empty``)
    on a deque and one waiter future, without its bound, its getter and putter queues and their bookkeeping:
    every output token passes through one (1 us less per token in a microbenchmark, on a path each token of
    each request takes). Single consumer: a second concurrent ``get`` is a bug and raises.

    ``direct``: the reader's own handler of an event, run by ``put_nowait`` itself while the reader waits on an
    empty queue (every earlier event fully handled, so order holds); True when it took the event, and the reader
    sleeps on. The streaming handler writes a steady decode's token this way: from the engine's step, without
    waking its task (a future, a loop callback and a resume through the handler's await chain per token). What
    it took but could not finish (``held``: the rest of a write that must wait, or the error a write raised)
    wakes the reader, which finishes or raises it (and clears it) before reading any later event.
    """

    __slots__ = ("_items", "_waiter", "direct", "held")

    def __init__(self) -> None:
        self._items: deque[StreamEvent] = deque()
        self._waiter: asyncio.Future[None] | None = None
        self.direct: Callable[[StreamEvent], bool] | None = None
        self.held: Awaitable[None] | BaseException | None = None

    def put_nowait(self, ev: StreamEvent) -> None:
        w = self._waiter
        if w is not None and self.direct is not None and not self._items and not w.done() and self.direct(ev):
            if self.held is None:
                return  # handled whole while the reader waits: it sleeps on
        else:
            self._items.append(ev)
        if w is not None:
            self._waiter = None
            if not w.done():
                w.set_result(None)

    def pop(self) -> StreamEvent | None:
        """The next event, or None when there is none yet (then await ``arrival``)."""
        return self._items.popleft() if self._items else None

    def arrival(self) -> asyncio.Future[None]:
        """A future that resolves at the next ``put_nowait``: the streaming handler awaits it directly and then
        ``pop``s, one await level per token where ``async for`` over ``get`` took an async generator and a
        coroutine (``actors.server.EngineServer._stream``). Cancelling the await leaves the queue usable."""
        if self._waiter is not None and not self._waiter.done():
            raise RuntimeError("a request stream has one reader")
        self._waiter = fut = asyncio.get_running_loop().create_future()
        return fut

    def empty(self) -> bool:
        return not self._items

    def get_nowait(self) -> StreamEvent:
        if not self._items:
            raise asyncio.QueueEmpty
        return self._items.popleft()

    async def get(self) -> StreamEvent:
        while not self._items:
            waiter = self.arrival()
            try:
                await waiter
            finally:
                if self._waiter is waiter:
                    self._waiter = None
        return self._items.popleft()


class RequestStream:
    """The engine's output for one request, consumed by the API handler."""

    def __init__(self, engine: Engine, seq: Sequence) -> None:
        self.engine = engine
        self.seq = seq
        self.queue = EventQueue()

    @property
    def request_id(self) -> RequestId:
        return self.seq.request_id

    def __aiter__(self) -> AsyncIterator[StreamEvent]:
        return self._iter()

    async def _iter(self) -> AsyncIterator[StreamEvent]:
        while True:
            ev = await self.queue.get()
            yield ev
            if ev.finish_reason is not None:
                return

    def abort(self) -> None:
        self.engine.abort(self.seq.request_id)

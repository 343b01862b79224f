"""The KV block transport protocol: blocks, addresses, records, errors, and the state every backend shares.

One protocol moves KV blocks between endpoints (:class:`KVTransport`):

- ``serve()`` starts accepting peers and returns this endpoint's :class:`Address`;
- ``push(address, request_id, blocks)`` moves blocks into the peer's inbox, where its owner
  ``receive()``\\ s them;
- ``pull(address, request_id, block_ids)`` fetches blocks the peer ``publish()``\\ ed;
- ``close()`` releases everything.

Every call has a deadline in emulated milliseconds on the transport's clock (``deadline_ms``; ``None``
means now plus ``TransportOptions.default_timeout_ms``) and raises :class:`TransferTimeout` when it
passes. Every failure is one of the typed errors below; :func:`translate` is the one place that maps a
backend's own exceptions (``OSError``, asyncio timeouts, UCX errors) into that tree, and
:func:`error_from_wire` the one place that maps an error a peer reported.

Ownership. A block's payload is a buffer, never a copy: the sender lends it to the transport until
``push`` returns (``inproc`` lends it to the receiver for as long as the receiver holds it, so a
sender must not write into a pushed or published buffer afterwards). A receiver gets blocks inside a
:class:`Delivery`; their payloads stay valid until the delivery is released, and ``detach()`` copies
them out when the receiver must own them.

Pushes are atomic: the receiver stages a push's blocks and makes them visible (commits them) only
when all arrived intact and the sender's commit gate opened (the link model uses the gate to hold
the blocks until their emulated arrival time). A push that fails, times out or is cancelled before
its commit leaves nothing staged or registered at either end; a receiver refuses a commit that
reaches it after the sender's deadline. Pushes are idempotent (the inbox keeps one copy per block
id and layer range), so a sender may retry one whose error says ``maybe_delivered``.
"""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import Awaitable, Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal, NewType, Protocol, runtime_checkable

from pydantic import Field, model_validator

from config.base import Frozen, PositiveFloat, PositiveInt
from transport.checksum import ChecksumChoice, ChecksumName, checksum_of, pick

RequestId = NewType("RequestId", str)
"""The request whose KV the blocks belong to; the key of inboxes and offers."""
BlockId = NewType("BlockId", int)
"""A block's id or its chained prefix hash: any integer in [-2**63, 2**64)."""
TransferId = NewType("TransferId", int)
"""One push or pull on one connection (assigned by the initiator, unique per connection)."""

Gate = Callable[[], Awaitable[None]]
"""Awaited by a backend after a push's bytes are staged at the receiver and before it commits them."""
SizeHook = Callable[[int], None]
"""Called by a backend once it knows how many payload bytes a pull will move (before they move)."""

BLOCK_ID_MIN = -(2**63)
BLOCK_ID_MAX = 2**64 - 1


# -- clock ----------------------------------------------------------------------------------------
@runtime_checkable
class ClockLike(Protocol):
    """What the transport needs of ``actors.clock.Clock``: emulated ms, deadline sleeps, conversions."""

    time_scale: float

    def now_ms(self) -> float: ...

    async def sleep_until(self, deadline_ms: float) -> float: ...

    def to_wall_s(self, emulated_ms: float) -> float: ...

    def to_emulated_ms(self, wall_seconds: float) -> float: ...


# -- errors ---------------------------------------------------------------------------------------
class TransportError(Exception):
    """Base of every transport failure. ``code`` is the name sent on the wire when a peer reports it.

    ``maybe_delivered`` is true when a push failed after its commit had been sent: the receiver may
    have committed it (it refuses commits that reach it after the sender's deadline, so this happens
    only when the acknowledgement itself was late). Pushes are idempotent, so a retry is safe.
    """

    code = "transport"
    maybe_delivered = False


class ConnectError(TransportError):
    """The peer could not be reached (refused, unreachable, connect timed out): check its address."""

    code = "connect"


class TransferTimeout(TransportError, TimeoutError):
    """The call's deadline passed before it completed; nothing it moved stays registered."""

    code = "timeout"


class FrameError(TransportError):
    """Malformed or unexpected bytes on a connection; that connection is closed, others keep serving."""

    code = "frame"


class IntegrityError(TransportError):
    """Bytes arrived that differ from those sent (checksum or length mismatch); nothing was delivered."""

    code = "integrity"


class PeerGone(TransportError):
    """The connection closed or reset during the call; a later call reconnects."""

    code = "peer_gone"


class BlockNotFound(TransportError):
    """A pull asked for blocks the peer does not offer under that request id."""

    code = "not_found"


class TransportClosed(TransportError):
    """This transport was closed."""

    code = "closed"


_BY_CODE: dict[str, type[TransportError]] = {
    cls.code: cls
    for cls in (TransportError, ConnectError, TransferTimeout, FrameError, IntegrityError, PeerGone,
                BlockNotFound, TransportClosed)
}

# UCX errors by class name, so this module never imports ucxx.
_UCX_PEER_GONE = {"UCXConnectionResetError", "UCXCanceled", "UCXCloseError", "UCXNotConnectedError",
                  "UCXEndpointTimeoutError", "UCXUnreachableError"}
_UCX_CONNECT = {"UCXUnreachableError", "UCXConnectionRefusedError", "UCXRejectedError"}


def translate(exc: BaseException, what: str) -> TransportError:
    """Map any exception a backend raised into the transport's tree (the one place that does so).

    ``what`` says which operation failed and with whom; it prefixes the message. Typed errors pass
    through unchanged. ``asyncio.CancelledError`` is never translated: callers re-raise it.
    """
    if isinstance(exc, TransportError):
        return exc
    name = type(exc).__name__
    if isinstance(exc, TimeoutError):
        err: TransportError = TransferTimeout(f"{what}: timed out")
    elif isinstance(exc, ConnectionRefusedError) or (name in _UCX_CONNECT and "connect" in what):
        err = ConnectError(f"{what}: connection refused ({exc})")
    elif isinstance(exc, (ConnectionResetError, BrokenPipeError, ConnectionAbortedError, EOFError,
                          asyncio.IncompleteReadError)) or name in _UCX_PEER_GONE:
        err = PeerGone(f"{what}: connection lost ({name}: {exc})")
    elif isinstance(exc, OSError):
        err = ConnectError(f"{what}: {exc.strerror or exc}")
    elif name.startswith("UCX"):
        err = PeerGone(f"{what}: UCX error ({name}: {exc})")
    else:
        err = TransportError(f"{what}: unexpected {name}: {exc}")
    err.__cause__ = exc
    return err


def error_from_wire(code: str, message: str) -> TransportError:
    """The typed error a peer reported as ``code`` (unknown codes become the base class)."""
    return _BY_CODE.get(code, TransportError)(message)


# -- blocks ---------------------------------------------------------------------------------------
def as_bytes_view(payload: Any) -> memoryview:
    """A flat, byte-format view of any C-contiguous buffer (bytes, bytearray, numpy array, memoryview)."""
    mv = payload if isinstance(payload, memoryview) else memoryview(payload)
    if mv.format == "B" and mv.ndim == 1:
        return mv
    if not mv.c_contiguous:
        raise ValueError("a block payload must be C-contiguous")
    return mv.cast("B")


@dataclass(frozen=True, slots=True)
class Block:
    """One KV block: its id (or prefix hash), the half-open layer range it covers, and its bytes.

    ``payload`` is a view of the caller's buffer (never copied here), read-only: neither the transport
    nor a receiver writes into it. ``checksum`` is the payload's
    checksum under ``checksum_algo`` when the producer supplied it; a transport verifies a supplied
    checksum end to end and computes one when it moves bytes without one.
    """

    block_id: BlockId
    payload: memoryview
    layers: tuple[int, int] = (0, 1)
    checksum: int | None = None
    checksum_algo: ChecksumName = "xxh3"

    def __post_init__(self) -> None:
        if not BLOCK_ID_MIN <= self.block_id <= BLOCK_ID_MAX:
            raise ValueError(f"block id {self.block_id} does not fit in 64 bits")
        lo, hi = self.layers
        if not 0 <= lo < hi:
            raise ValueError(f"layer range {self.layers} must satisfy 0 <= start < stop")

    def over(self, payload: memoryview) -> Block:
        """This block's id, layers and checksum over another buffer holding the same bytes (not checked:
        the id and layers were validated when this block was made). Skips ``__init__``: it is called per
        block on hot paths (a receiver copying blocks out), where dataclass construction costs as much
        as copying 64 KiB."""
        b: Block = _new_block(Block)
        _set_block_id(b, self.block_id)
        _set_payload(b, payload)
        _set_layers(b, self.layers)
        _set_checksum(b, self.checksum)
        _set_checksum_algo(b, self.checksum_algo)
        return b

    @staticmethod
    def of(block_id: int, payload: Any, layers: tuple[int, int] = (0, 1)) -> Block:
        """A block over ``payload`` (any C-contiguous buffer; viewed read-only, not copied), without a checksum."""
        return Block(BlockId(block_id), as_bytes_view(payload).toreadonly(), (int(layers[0]), int(layers[1])))

    @property
    def nbytes(self) -> int:
        return self.payload.nbytes

    def with_checksum(self, choice: ChecksumChoice = "auto") -> Block:
        """This block with its checksum computed (itself when it already carries one)."""
        if self.checksum is not None and choice in ("auto", self.checksum_algo):
            return self
        algo = pick(choice, self.nbytes)
        return Block(self.block_id, self.payload, self.layers, checksum_of(algo, self.payload), algo)

    def intact(self) -> bool:
        """True when the payload matches the supplied checksum (or none was supplied)."""
        return self.checksum is None or checksum_of(self.checksum_algo, self.payload) == self.checksum

    def owned(self) -> Block:
        """A copy whose payload is private memory (``bytearray``), keeping the checksum."""
        return Block(self.block_id, memoryview(bytearray(self.payload)), self.layers, self.checksum,
                     self.checksum_algo)


# Slot setters for ``Block.over`` (a frozen dataclass forbids ``setattr``, not its slots' descriptors).
_new_block = object.__new__
_set_block_id = Block.__dict__["block_id"].__set__
_set_payload = Block.__dict__["payload"].__set__
_set_layers = Block.__dict__["layers"].__set__
_set_checksum = Block.__dict__["checksum"].__set__
_set_checksum_algo = Block.__dict__["checksum_algo"].__set__


class Releasable(Protocol):
    def release(self) -> None: ...


class Delivery:
    """Blocks handed to a receiver, with the buffers that hold them.

    The payloads are valid until ``release()`` (or the end of a ``with`` block); ``detach()`` returns
    owned copies and releases the buffers. Releasing twice is harmless. Deliveries of ``pull`` carry
    the transfer's record; deliveries of ``receive`` carry ``None``.
    """

    __slots__ = ("_leases", "blocks", "record")

    def __init__(self, blocks: list[Block], leases: Sequence[Releasable] = (),
                 record: TransferRecord | None = None) -> None:
        self.blocks = blocks
        self.record = record
        self._leases: list[Releasable] = list(leases)

    def __len__(self) -> int:
        return len(self.blocks)

    @property
    def nbytes(self) -> int:
        return sum(b.nbytes for b in self.blocks)

    def release(self) -> None:
        leases, self._leases = self._leases, []
        for lease in leases:
            lease.release()

    def detach(self, into: Sequence[Any] | None = None) -> list[Block]:
        """Copies the receiver owns; the transport's buffers go back to it.

        Without ``into`` the copies go to fresh memory; with it, block ``i`` is copied into the
        receiver's own writable buffer ``into[i]`` (at least as large; e.g. a slot of its KV cache)
        and the returned block views that buffer.
        """
        if into is None:
            out = [b.owned() for b in self.blocks]
        else:
            if len(into) != len(self.blocks):
                raise ValueError(f"{len(into)} destination buffers for {len(self.blocks)} blocks")
            out = []
            for b, dst in zip(self.blocks, into, strict=True):
                payload = b.payload
                n = payload.nbytes
                view = as_bytes_view(dst)
                if view.nbytes != n:
                    view = view[:n]
                if view.nbytes < n or view.readonly:
                    raise ValueError(f"destination for block {b.block_id} is read-only or smaller than "
                                     f"{n} bytes")
                view[:] = payload  # memoryview assignment: a memcpy with less call overhead than numpy's
                out.append(b.over(view))
        self.release()
        return out

    def __enter__(self) -> Delivery:
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()


# -- addresses and records --------------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class Site:
    """Where an endpoint sits in the emulated topology (its node and region)."""

    node: str
    region: str

    def __str__(self) -> str:
        return f"{self.node}@{self.region}"


@dataclass(frozen=True, slots=True)
class Address:
    """How to reach an endpoint: backend key, backend location, emulated site, backend extras.

    Addresses are plain data: they travel through Ray (the control plane) between actors. ``extra``
    carries backend details (the UCX worker address and host identity).
    """

    backend: str
    location: str
    site: Site
    extra: tuple[tuple[str, bytes], ...] = ()

    def get(self, key: str) -> bytes | None:
        for k, v in self.extra:
            if k == key:
                return v
        return None

    def __str__(self) -> str:
        return f"{self.backend}://{self.location}#{self.site}"


Op = Literal["push", "pull"]


@dataclass(frozen=True, slots=True)
class TransferRecord:
    """What one push or pull did, in emulated milliseconds unless the name says wall.

    ``emulated_ms`` is how long the call took as the caller saw it; ``modelled_ms`` what the link
    model says the transfer takes over the emulated fabric (0 when the transport is not shaped);
    ``wall_ms`` how long the real bytes took to move and be verified. ``real_bottleneck`` is true when
    the real transport was slower than the emulated link (``wall_ms`` in emulated ms exceeded
    ``modelled_ms``, counting a push's commit round trip): then ``emulated_ms`` overstates the
    fabric and the result should be flagged. ``lag_ms`` is how late the call returned against the
    model, whatever the cause (real transport, or an event loop too busy to wake on time).
    """

    request_id: RequestId
    op: Op
    backend: str
    peer: Site
    blocks: int
    real_bytes: int
    emulated_bytes: float
    started_ms: float
    emulated_ms: float
    wall_ms: float
    link: str | None = None
    modelled_ms: float = 0.0
    real_bottleneck: bool = False

    @property
    def lag_ms(self) -> float:
        """How much later than the emulated link the call returned (0 when not shaped)."""
        return max(0.0, self.emulated_ms - self.modelled_ms) if self.link is not None else 0.0


@dataclass(frozen=True, slots=True)
class TransportStats:
    """What a transport holds right now; all zero after ``close()`` (tests assert so)."""

    connections: int = 0
    pending: int = 0
    staged: int = 0
    inbox_blocks: int = 0
    pool_leases: int = 0
    pool_in_use_bytes: int = 0
    tasks: int = 0


# -- options --------------------------------------------------------------------------------------
MiB = 1 << 20


class TransportOptions(Frozen):
    """Knobs of a transport backend (the cluster spec's ``TransportSpec`` picks the backend)."""

    host: str = "127.0.0.1"
    """Interface servers bind; loopback unless told otherwise."""
    advertise_host: str | None = None
    """Address peers dial when ``host`` is a wildcard (0.0.0.0): the node's own; None: ``host`` itself."""
    port: int = Field(default=0, ge=0, le=65535)
    default_timeout_ms: PositiveFloat = 30_000.0
    """Deadline of a call that gives none, emulated ms from its start."""
    connect_timeout_ms: PositiveFloat = 5_000.0
    """Wall-clock cap on opening one connection (within the call's deadline)."""
    max_inflight_bytes: PositiveInt = 64 * MiB
    """Sender-side bound on bytes written but not yet acknowledged, per connection."""
    pool_bytes: PositiveInt = 512 * MiB
    """Receive buffer pool per transport; a full pool stops reading from sockets (backpressure)."""
    max_frame_payload: PositiveInt = 128 * MiB
    """Largest payload one frame (one block) may declare; larger declarations are rejected unread."""
    max_meta_bytes: PositiveInt = 64 * 1024
    checksum: ChecksumChoice = "auto"
    """Payload checksum senders compute: ``auto`` is xxh3 (XXH3-64) at every size."""
    inproc_verify: Literal["supplied", "always"] = "supplied"
    """``inproc`` moves no bytes, so it verifies only checksums a producer supplied, unless ``always``."""
    ucx_same_host: Literal["auto", "worker_address", "listener"] = "auto"
    """UCX on one host: connect by worker address (shared memory) or through the listener."""

    @model_validator(mode="after")
    def _fits(self) -> TransportOptions:
        if self.max_frame_payload > self.pool_bytes:
            raise ValueError("max_frame_payload must not exceed pool_bytes (one frame must fit the pool)")
        return self


# -- shared endpoint state ------------------------------------------------------------------------
class Inbox:
    """Committed pushes waiting for their receiver, by request id.

    ``receive`` waits until at least ``count`` distinct blocks of a request were committed, then hands
    all of them over in one delivery (first-arrival order). Deliveries are idempotent: a block that
    arrives again under the same request, id and layer range replaces the earlier copy, so a sender
    may retry a push whose outcome it does not know. ``discard`` drops a request's blocks (releasing
    their buffers); ``close`` drops everything and fails waiters with :class:`TransportClosed`.
    """

    def __init__(self) -> None:
        self._entries: dict[RequestId, dict[tuple[int, tuple[int, int]], tuple[Block, Releasable | None]]] = {}
        self._changed: dict[RequestId, asyncio.Event] = {}
        self._closed = False

    def deliver(self, request_id: RequestId, blocks: Sequence[Block],
                leases: Sequence[Releasable | None] = ()) -> None:
        """Register ``blocks`` (with ``leases[i]`` holding ``blocks[i]``, if any) in one step."""
        held = list(leases) + [None] * (len(blocks) - len(leases))
        if self._closed:
            for lease in held:
                if lease is not None:
                    lease.release()
            return
        table = self._entries.setdefault(request_id, {})
        for b, lease in zip(blocks, held, strict=True):
            old = table.get((b.block_id, b.layers))
            if old is not None and old[1] is not None:
                old[1].release()
            table[(b.block_id, b.layers)] = (b, lease)
        ev = self._changed.get(request_id)
        if ev is not None:
            ev.set()

    def count(self, request_id: RequestId) -> int:
        return len(self._entries.get(request_id, ()))

    def total_blocks(self) -> int:
        return sum(len(v) for v in self._entries.values())

    def take(self, request_id: RequestId) -> Delivery:
        table = self._entries.pop(request_id, {})
        return Delivery([b for b, _ in table.values()], [lease for _, lease in table.values() if lease is not None])

    async def wait(self, request_id: RequestId, count: int) -> Delivery:
        """Wait (no deadline here: the caller's scope has it) until ``count`` blocks are in, then take them."""
        while self.count(request_id) < max(1, count):
            if self._closed:
                raise TransportClosed("transport closed while waiting to receive")
            ev = self._changed.setdefault(request_id, asyncio.Event())
            ev.clear()
            try:
                await ev.wait()
            finally:
                if self._changed.get(request_id) is ev and not ev.is_set():
                    del self._changed[request_id]
        self._changed.pop(request_id, None)
        return self.take(request_id)

    def discard(self, request_id: RequestId) -> None:
        self.take(request_id).release()

    def close(self) -> None:
        self._closed = True
        for rid in list(self._entries):
            self.discard(rid)
        for ev in self._changed.values():
            ev.set()
        self._changed.clear()


class Offers:
    """Blocks published for peers to pull, by request id then block id (insertion ordered)."""

    def __init__(self) -> None:
        self._by_request: dict[RequestId, dict[BlockId, Block]] = {}

    def publish(self, request_id: RequestId, blocks: Iterable[Block]) -> None:
        table = self._by_request.setdefault(request_id, {})
        for b in blocks:
            table[b.block_id] = b

    def withdraw(self, request_id: RequestId) -> None:
        self._by_request.pop(request_id, None)

    def unpublish(self, request_id: RequestId, block_ids: Iterable[BlockId]) -> None:
        """Stop offering some blocks of ``request_id`` (a store evicting blocks it published)."""
        table = self._by_request.get(request_id)
        if table is not None:
            for b in block_ids:
                table.pop(b, None)

    def get(self, request_id: RequestId, block_ids: Sequence[BlockId]) -> list[Block]:
        table = self._by_request.get(request_id)
        if table is None:
            raise BlockNotFound(f"no blocks offered for request {request_id!r}")
        missing = [b for b in block_ids if b not in table]
        if missing:
            raise BlockNotFound(f"request {request_id!r} offers no block {missing[:8]}"
                                f"{' ...' if len(missing) > 8 else ''}")
        return [table[b] for b in block_ids]

    def clear(self) -> None:
        self._by_request.clear()


# -- deadlines ------------------------------------------------------------------------------------
class within:
    """Run the body until emulated time ``deadline_ms``; past it, cancel the body and raise TransferTimeout.

    The deadline is turned into a wall delay once, on the event loop's timer; backend exceptions that
    escape the body are translated (``translate``), so callers see only typed errors. A class rather than
    a generator-based context manager: it is entered once per transfer, and small pushes count every
    microsecond.
    """

    __slots__ = ("_deadline_ms", "_timeout", "_what")

    def __init__(self, clock: ClockLike, deadline_ms: float, what: str) -> None:
        self._deadline_ms = deadline_ms
        self._what = what
        self._timeout = asyncio.timeout(max(0.0, clock.to_wall_s(deadline_ms - clock.now_ms())))

    async def __aenter__(self) -> None:
        await self._timeout.__aenter__()

    async def __aexit__(self, et: type[BaseException] | None, e: BaseException | None, tb: Any) -> None:
        try:
            await self._timeout.__aexit__(et, e, tb)
        except TimeoutError as te:
            raise TransferTimeout(f"{self._what}: missed its deadline ({self._deadline_ms:.3f} emulated ms)") from te
        if e is None or isinstance(e, (asyncio.CancelledError, TransportError)):
            return
        if isinstance(e, TimeoutError):
            raise TransferTimeout(f"{self._what}: missed its deadline ({self._deadline_ms:.3f} emulated ms)") from e
        if isinstance(e, (OSError, EOFError)) or type(e).__name__.startswith("UCX"):
            raise translate(e, self._what) from e


class EndpointBase:
    """State and calls every backend shares: site, clock, options, inbox, offers, deadlines.

    Subclasses implement ``serve``, ``push``, ``pull``, ``close`` and ``stats``.
    """

    name = "base"

    def __init__(self, site: Site, clock: ClockLike, options: TransportOptions | None = None) -> None:
        self.site = site
        self.clock = clock
        self.options = options or TransportOptions()
        self.inbox = Inbox()
        self.offers = Offers()
        self._closed = False
        self._ids = itertools.count(1)

    def deadline(self, deadline_ms: float | None) -> float:
        return self.clock.now_ms() + self.options.default_timeout_ms if deadline_ms is None else deadline_ms

    def _check_open(self) -> None:
        if self._closed:
            raise TransportClosed(f"{self.name} transport at {self.site} is closed")

    def publish(self, request_id: RequestId, blocks: Iterable[Block]) -> None:
        """Offer blocks for peers to pull until ``withdraw``; the buffers must not change meanwhile."""
        self._check_open()
        self.offers.publish(request_id, blocks)

    def withdraw(self, request_id: RequestId) -> None:
        self.offers.withdraw(request_id)

    async def receive(self, request_id: RequestId, *, count: int = 1, deadline_ms: float | None = None) -> Delivery:
        """Wait until at least ``count`` pushed blocks of ``request_id`` are committed; take them all."""
        self._check_open()
        if self.inbox.count(request_id) >= max(1, count):  # already here: no timer needed
            return self.inbox.take(request_id)
        async with within(self.clock, self.deadline(deadline_ms), f"receive {request_id!r}"):
            return await self.inbox.wait(request_id, count)

    def discard(self, request_id: RequestId) -> None:
        """Drop the committed, unreceived blocks of ``request_id``."""
        self.inbox.discard(request_id)

    def _record(self, op: Op, request_id: RequestId, peer: Site, blocks: Sequence[Block], started_ms: float,
                wall_s: float) -> TransferRecord:
        real = sum(b.nbytes for b in blocks)
        return TransferRecord(
            request_id=request_id, op=op, backend=self.name, peer=peer, blocks=len(blocks), real_bytes=real,
            emulated_bytes=float(real), started_ms=started_ms, emulated_ms=self.clock.now_ms() - started_ms,
            wall_ms=wall_s * 1000.0)


@runtime_checkable
class KVTransport(Protocol):
    """The KV block transport every backend and wrapper implements (see the module docstring)."""

    name: str
    site: Site
    clock: ClockLike

    def deadline(self, deadline_ms: float | None) -> float:
        """The absolute emulated deadline a call given ``deadline_ms`` runs under."""
        ...

    async def serve(self) -> Address: ...

    async def push(self, address: Address, request_id: RequestId, blocks: Sequence[Block], *,
                   deadline_ms: float | None = None, gate: Gate | None = None) -> TransferRecord: ...

    async def pull(self, address: Address, request_id: RequestId, block_ids: Sequence[BlockId], *,
                   deadline_ms: float | None = None, on_size: SizeHook | None = None) -> Delivery: ...

    def publish(self, request_id: RequestId, blocks: Iterable[Block]) -> None: ...

    def withdraw(self, request_id: RequestId) -> None: ...

    async def receive(self, request_id: RequestId, *, count: int = 1,
                      deadline_ms: float | None = None) -> Delivery: ...

    def discard(self, request_id: RequestId) -> None: ...

    def stats(self) -> TransportStats: ...

    async def close(self) -> None: ...


@runtime_checkable
class Abortable(Protocol):
    """A backend whose connections to a peer can be reset on purpose (fault injection)."""

    def abort_connections(self, address: Address) -> int: ...


@dataclass
class ByteBudget:
    """An async byte semaphore: bounded in-flight bytes with FIFO waiters (cancellation-safe).

    A request larger than the whole capacity is admitted when nothing else is in flight, so one
    oversized transfer cannot deadlock.
    """

    capacity: int
    used: int = 0
    _waiters: list[tuple[int, asyncio.Future[None]]] = field(default_factory=list)

    async def acquire(self, n: int) -> None:
        if not self._waiters and self._fits(n):
            self.used += n
            return
        fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        entry = (n, fut)
        self._waiters.append(entry)
        try:
            await fut
        except BaseException:
            if entry in self._waiters:
                self._waiters.remove(entry)
            elif fut.done() and not fut.cancelled():
                self.used -= n  # granted while being cancelled: give it back
                self._wake()
            raise

    def _fits(self, n: int) -> bool:
        return self.used + n <= self.capacity or self.used == 0

    def release(self, n: int) -> None:
        self.used -= n
        self._wake()

    def _wake(self) -> None:
        while self._waiters and self._fits(self._waiters[0][0]):
            n, fut = self._waiters.pop(0)
            if fut.done():
                continue
            self.used += n
            fut.set_result(None)

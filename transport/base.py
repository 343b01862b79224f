"""The KV block transport protocol: blocks, addresses, records, errors, and the state every backend shares.

One protocol moves KV blocks between endpoints (:class:`KVTransport`):

- ``serve()`` starts accepting peers and returns this endpoint's :class:`Address`;
- ``push(address, request_id, blocks)`` moves blocks into the peer's inbox, where its owner
  ``receive()``\\ s them;
- ``pull(address, request_id, block_ids)`` fetches blocks the peer ``publish()``\\ ed;
- ``close()`` releases everything.

Every call has a deadline in emulated milliseconds on the transport's clock (``deadline_ms``; ``None``
means now plus ``TransportOptions.default_timeout_ms``) and raises :class:`TransferTimeout` when it
passes. Every failure is one of the typed errors of :mod:`transport.errors`; :func:`translate` is
the one place that maps a backend's own exceptions (``OSError``, asyncio timeouts, UCX errors) into
that tree, and :func:`error_from_wire` the one place that maps an error a peer reported.

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

The pieces live by subject: ids, blocks and deliveries in :mod:`transport.blocks`, errors in
:mod:`transport.errors`, the inbox and offers in :mod:`transport.inbox` (all re-exported here), and
what every backend shares (deadlines, byte budget, ``EndpointBase``) in :mod:`transport.endpoint`.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Iterable, Sequence
from dataclasses import dataclass, fields
from typing import Literal, Protocol, runtime_checkable

from pydantic import Field, model_validator

from config.base import Frozen, PositiveFloat, PositiveInt
from transport.blocks import (
    BLOCK_ID_MAX,
    BLOCK_ID_MIN,
    Block,
    BlockId,
    Delivery,
    Releasable,
    RequestId,
    TransferId,
    as_bytes_view,
)
from transport.checksum import ChecksumChoice
from transport.errors import (
    BlockNotFound,
    ConnectError,
    FrameError,
    IntegrityError,
    PeerGone,
    TransferTimeout,
    TransportClosed,
    TransportError,
    error_from_wire,
    translate,
)
from transport.inbox import Inbox, Offers
from transport.verify import VERIFY_THREAD_MIN

__all__ = [
    "BLOCK_ID_MAX", "BLOCK_ID_MIN", "Abortable", "Address", "Block", "BlockId", "BlockNotFound", "ClockLike",
    "ConnectError", "Delivery", "FrameError", "Gate", "Inbox", "IntegrityError", "KVTransport", "Offers", "Op",
    "PeerGone",
    "Releasable", "RequestId", "Site", "SizeHook", "TransferId", "TransferRecord", "TransferTimeout",
    "TransportClosed", "TransportError", "TransportOptions", "TransportStats", "as_bytes_view",
    "error_from_wire", "translate",
]

Gate = Callable[[], Awaitable[None]]
"""Awaited by a backend after a push's bytes are staged at the receiver and before it commits them."""
SizeHook = Callable[[int], None]
"""Called by a backend once it knows how many payload bytes a pull will move (before they move)."""


# -- clock ----------------------------------------------------------------------------------------
@runtime_checkable
class ClockLike(Protocol):
    """What the transport needs of ``actors.clock.Clock``: emulated ms, deadline sleeps, conversions."""

    time_scale: float

    def now_ms(self) -> float: ...

    async def sleep_until(self, deadline_ms: float) -> float: ...

    def to_wall_s(self, emulated_ms: float) -> float: ...

    def to_emulated_ms(self, wall_seconds: float) -> float: ...


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

    @staticmethod
    def unshaped(request_id: RequestId, op: Op, backend: str, peer: Site, blocks: int, real_bytes: int,
                 started_ms: float, emulated_ms: float, wall_ms: float) -> TransferRecord:
        """The record of a transfer no link model shaped (``emulated_bytes`` = ``real_bytes``), made without
        the frozen dataclass ``__init__``: it runs once per transfer, also for small pushes. The caller passes
        checked values (a backend's own measurements). See :class:`_UnshapedRecord` for how."""
        return _UnshapedRecord(request_id, op, backend, peer, blocks, real_bytes, started_ms, emulated_ms,
                               wall_ms)  # type: ignore[return-value]  # it is a TransferRecord once built


class _UnshapedRecord:
    """Builds a :class:`TransferRecord` fast: a plain class with the very same slots, whose ``__init__`` fills
    them with ordinary attribute stores (which the interpreter specialises to direct slot writes) and then
    makes the object a ``TransferRecord`` by assigning ``__class__`` (allowed between classes of identical
    layout). A frozen dataclass forbids those stores; its slots' descriptors (``__set__``, one call each)
    cost twice as much: 1.2 against 0.55 us per record in a hot loop on this host."""

    __slots__ = TransferRecord.__slots__

    def __init__(self, request_id: RequestId, op: Op, backend: str, peer: Site, blocks: int, real_bytes: int,
                 started_ms: float, emulated_ms: float, wall_ms: float) -> None:
        self.request_id = request_id
        self.op = op
        self.backend = backend
        self.peer = peer
        self.blocks = blocks
        self.real_bytes = real_bytes
        self.emulated_bytes = float(real_bytes)
        self.started_ms = started_ms
        self.emulated_ms = emulated_ms
        self.wall_ms = wall_ms
        self.link = None
        self.modelled_ms = 0.0
        self.real_bottleneck = False
        self.__class__ = TransferRecord  # type: ignore[assignment]


assert _UnshapedRecord.__slots__ == tuple(f.name for f in fields(TransferRecord)), "slots out of step with fields"


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
    ucx_inflight_bytes: PositiveInt = 8 * MiB
    """Bytes of pushes a UCX connection keeps in flight (at most ``max_inflight_bytes``). Kept small so the
    receiver's pooled buffers stay in the CPU cache: with 64 MiB in flight each 1 MiB payload landed in a
    buffer cold from DRAM (locked sweep, 1 MiB blocks, 4 per push: sm 4.3 -> 5.7 GB/s, tcp 3.5 -> 4.2 GB/s)."""
    verify_thread_min_bytes: int = Field(default=VERIFY_THREAD_MIN, ge=0)
    """Payloads at least this large get their checksum computed (senders) or checked (receivers) on a thread
    of the transport's own, overlapping the loop's next send or receive (:mod:`transport.verify`); 0 keeps
    every checksum on the event loop's thread. Every payload is verified before delivery either way. TCP
    receivers hash large xxh3 payloads as their reads land instead (:mod:`transport.frame`); the thread
    checks their other algorithms. Unset, ucx uses 0: its checks run on its worker's thread
    (:func:`transport.ucx.ucx_options`). Locked ``bench/transport.py`` (load 2.2): tcp 64 MiB 3.41 GB/s with
    the thread, 2.14 without (both before TCP receivers hashed as their reads land)."""

    @model_validator(mode="after")
    def _fits(self) -> TransportOptions:
        if self.max_frame_payload > self.pool_bytes:
            raise ValueError("max_frame_payload must not exceed pool_bytes (one frame must fit the pool)")
        return self

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

"""What a backend supplies to the framed session protocol: a connection of whole frames, and its handler."""

from __future__ import annotations

import asyncio
from typing import Any, Protocol

from transport.base import (
    Block,
)
from transport.checksum import ChecksumChoice
from transport.frame import (
    Direct,
    Frame,
    FrameType,
)

MAX_STAGED_PER_CONNECTION = 4096
YIELD_BYTES = 256 * 1024
"""A transfer yields to others on its connection after each this many payload bytes (not after every
frame: small frames queued in one loop iteration go out together, in one write or one UCX message)."""
SMALL_PUSH = 64 * 1024
"""A push of one block at most this large, without a gate, takes the small-push fast path (see
:meth:`transport.session_client.Client.send_small`)."""


class Handler(Direct, Protocol):
    """What a connection hands its frames and its end to. A connection may hand a compact ACK or a small push
    straight from its decoder (``on_ack``, ``on_small_push``: :class:`transport.frame.Direct`), or as a frame."""

    def on_frame(self, frame: Frame) -> None: ...

    def on_lost(self, exc: BaseException | None) -> None: ...


class Connection(Protocol):
    """One connection of a backend: whole frames out in order, frames in to its handler.

    ``send`` queues or writes one frame without waiting (frames never interleave); ``drain`` waits
    while too much is queued; ``lost`` resolves once the connection is gone and its handler's
    ``on_lost`` ran.
    """

    lost: asyncio.Future[None]

    @property
    def alive(self) -> bool: ...

    @property
    def ready(self) -> bool:
        """True when a frame may be sent now: alive and ``drain`` would not wait."""
        ...

    def send(self, ftype: FrameType, meta: dict[str, Any], payload: memoryview | None = None, *,
             block: Block | None = None, algo: ChecksumChoice = "auto") -> None: ...

    def send_encoded(self, head: bytes, body: memoryview | None = None) -> None:
        """Queue or write one frame already encoded (a compact ACK, a small push: its header and metadata,
        then its payload), like ``send``."""
        ...

    async def drain(self) -> None: ...

    def abort(self) -> None:
        """Reset the connection now."""
        ...

    def close(self) -> None:
        """Close the connection, telling the peer if it could not otherwise know."""
        ...

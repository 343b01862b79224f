"""KV blocks and deliveries: the ids, the read-only block view, and the leased buffers a receiver holds.

A :class:`Block` views a caller's buffer (never copied here); a :class:`Delivery` hands blocks to a
receiver together with the leases that keep their buffers alive until ``release`` or ``detach``.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, NewType, Protocol, overload

from transport.checksum import ChecksumChoice, ChecksumName, checksum_of, pick

if TYPE_CHECKING:
    from transport.base import TransferRecord

RequestId = NewType("RequestId", str)
"""The request whose KV the blocks belong to; the key of inboxes and offers."""
BlockId = NewType("BlockId", int)
"""A block's id or its chained prefix hash: any integer in [-2**63, 2**64)."""
TransferId = NewType("TransferId", int)
"""One push or pull on one connection (assigned by the initiator, unique per connection)."""

BLOCK_ID_MIN = -(2**63)
BLOCK_ID_MAX = 2**64 - 1


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
        return Block.decoded(self.block_id, payload, self.layers, self.checksum, self.checksum_algo)

    @staticmethod
    def decoded(block_id: int, payload: memoryview, layers: tuple[int, int], checksum: int | None,
                algo: ChecksumName) -> Block:
        """A block a receiver decoded from a frame, without re-validating it: the frame's fields were
        checked as they were read (``field_int``, ``field_layers``; a msgpack integer always fits 64
        bits). Skips ``__init__`` as ``over`` does: it runs once per received block."""
        b: Block = _new_block(Block)
        _set_block_id(b, block_id)
        _set_payload(b, payload)
        _set_layers(b, layers)
        _set_checksum(b, checksum)
        _set_checksum_algo(b, algo)
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


_view: Callable[[Any], memoryview] = memoryview
"""``memoryview`` as a plain callable (for ``map``)."""

# Slot setters for ``Block.over`` (a frozen dataclass forbids ``setattr``, not its slots' descriptors).
_new_block = object.__new__
_set_block_id = Block.__dict__["block_id"].__set__
_set_payload = Block.__dict__["payload"].__set__
_set_layers = Block.__dict__["layers"].__set__
_set_checksum = Block.__dict__["checksum"].__set__
_set_checksum_algo = Block.__dict__["checksum_algo"].__set__


def _destination(block: Block, view: memoryview) -> memoryview:
    """``view`` as a flat byte buffer of ``block``'s size holding a copy of its payload (or a clear error)."""
    if view.ndim != 1 or view.format != "B":
        view = as_bytes_view(view)
    n = block.payload.nbytes
    if view.readonly or view.nbytes < n:
        raise ValueError(f"destination for block {block.block_id} is read-only or smaller than {n} bytes")
    if view.nbytes != n:
        view = view[:n]
    view[:] = block.payload
    return view


class DetachedBlocks(Sequence[Block]):
    """Blocks copied into a receiver's buffers: block ``i`` is ``blocks[i]`` over ``views[i]``, built when read.

    Immutable; the views are the receiver's memory, so the blocks stay valid as long as it keeps them.
    """

    __slots__ = ("_blocks", "_views")

    def __init__(self, blocks: Sequence[Block], views: Sequence[memoryview]) -> None:
        self._blocks = blocks
        self._views = views

    def __len__(self) -> int:
        return len(self._blocks)

    @overload
    def __getitem__(self, i: int) -> Block: ...

    @overload
    def __getitem__(self, i: slice) -> list[Block]: ...

    def __getitem__(self, i: int | slice) -> Block | list[Block]:
        if isinstance(i, slice):
            return list(map(Block.over, self._blocks[i], self._views[i]))
        return self._blocks[i].over(self._views[i])

    def __iter__(self) -> Iterator[Block]:
        return map(Block.over, self._blocks, self._views)

    def __repr__(self) -> str:
        return f"DetachedBlocks({list(self)!r})"


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

    def detach(self, into: Sequence[Any] | None = None) -> Sequence[Block]:
        """Copies the receiver owns; the transport's buffers go back to it.

        Without ``into`` the copies go to fresh memory (a list of blocks). With it, block ``i`` is copied
        into the receiver's own writable buffer ``into[i]`` (at least as large; e.g. a slot of its KV
        cache) and the returned sequence's block ``i`` views that buffer. The copies are made here, all at
        once: when every destination is a flat byte buffer of exactly its block's size, each is one
        memoryview assignment; otherwise each destination is checked and cut to size (a clear
        ``ValueError`` for one that is read-only or too small). The returned blocks are built
        when read (:class:`DetachedBlocks`): a receiver that copied into its own slots rarely needs them.
        """
        if into is None:
            out: Sequence[Block] = [b.owned() for b in self.blocks]
        else:
            blocks = self.blocks
            if len(into) != len(blocks):
                raise ValueError(f"{len(into)} destination buffers for {len(blocks)} blocks")
            try:
                views: list[memoryview] = list(map(_view, into))  # made in C: 0.1 us a block less than in the loop
                for view, b in zip(views, blocks, strict=True):  # lengths were checked above
                    view[:] = b.payload  # memoryview assignment: a memcpy with less call overhead than numpy's
            except (TypeError, ValueError, NotImplementedError):  # another size, format or shape: checked
                views = [_destination(b, memoryview(dst)) for b, dst in zip(blocks, into, strict=True)]
            out = DetachedBlocks(blocks, views)
        self.release()
        return out

    def __enter__(self) -> Delivery:
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()

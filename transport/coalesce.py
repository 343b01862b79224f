"""Consecutive small blocks of one push or pull answer as one frame: a block table in the metadata, one payload.

Why. Every frame costs both ends a fixed amount of Python whatever its size: msgpack, a checksum call, the
header parse, a pooled lease, staging, and over ucx a control-batch parse. Measured here (``/tmp`` harness,
one push of 64 KiB in ``NB`` blocks, sender and receiver in two processes, locked, host otherwise nearly
idle): 36 us per extra block over tcp and 18 us over ucx with both sides busy, 60-80 us a block after an
idle gap (cold caches), so a push of 16 x 4 KiB took 2.0 ms over tcp and 2.3 ms over ucx against 1.1 and
1.7 ms for one 64 KiB block. One frame per run of small blocks pays that cost once.

Wire. A ``PUSH_DATA`` (or ``PULL_DATA``) frame whose metadata carries ``bt`` (the block table) instead of
``b`` and ``l``: one row per block, in order, ``[block id, layer start, layer stop, nbytes, checksum algo id,
checksum]``; the payload is the blocks' bytes back to back. ``i`` is the transfer index of the table's
first block (the frame after it starts at ``i + len(bt)``); the last frame of a push also carries the
push's end fields, as a one-block frame does. Msgpack metadata only, like every frame.

Verification. The frame's payload checksum covers the whole payload and is checked by the decoder as for
any frame (a transfer whose frame fails it fails with ``IntegrityError``, the connection carries on). Each
row's checksum is its block's own (the producer's when it supplied one, else computed by the sender as a
one-block frame's is) and the receiver checks it as it unpacks: a producer-supplied checksum that does not
match its bytes is still caught end to end, and every delivered block carries its verified checksum, as
a block sent in its own frame does.

What goes together (:func:`runs`). Runs of at least two consecutive blocks of at most
``COALESCE_BLOCK_MAX`` bytes each, cut at ``COALESCE_MAX`` bytes and ``COALESCE_ROWS`` rows per frame (the
table stays far below the metadata cap). The sender copies a run's payloads into one buffer (a memcpy of at
most 256 KiB, a few us) rather than write each block separately: the copy costs less than one frame's
Python. Larger blocks keep one frame each (their bytes dominate, and they are written without a copy).

Failure behaviour. A table that is not a list of rows of six integers, a row with an empty or negative
layer range, an unknown checksum algorithm, a block id or checksum out of 64-bit range, sizes that do not
add up to the payload's length, or more than ``MAX_ROWS`` rows is a ``FrameError``: the stream is not a
valid kvmesh stream and only that connection closes.

Receive buffers. A frame's payload is one pooled lease shared by its blocks: each block holds a part of
it (:func:`share`) and the buffer goes back to the pool when the last part is released, so a block
replaced in an inbox, or released with its delivery, never frees bytes another block still views.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from xxhash import xxh3_64_intdigest

from transport.base import FrameError
from transport.blocks import BLOCK_ID_MAX, BLOCK_ID_MIN, Block, Releasable
from transport.checksum import ALGO_IDS, ALGO_NAMES, ChecksumChoice, checksum_of, pick
from transport.pool import Lease

COALESCE_BLOCK_MAX = 64 * 1024
"""Blocks at most this large may share a frame with their neighbours."""
COALESCE_MAX = 256 * 1024
"""The most payload bytes one table frame carries."""
COALESCE_ROWS = 256
"""The most blocks one table frame carries (its table is then at most ~8 KiB of msgpack)."""
MAX_ROWS = 4096
"""The most rows a receiver accepts in one table (a bound on the work one frame can ask for)."""
_U64_MAX = (1 << 64) - 1
_XXH3 = ALGO_IDS["xxh3"]


def runs(blocks: Sequence[Block], most: int = COALESCE_MAX) -> list[tuple[int, int]]:
    """``blocks`` cut into frames, as ``[start, stop)`` index spans in order: each span of two or more blocks is
    one table frame of at most ``most`` payload bytes, each span of one block a frame of its own (see the module
    docstring). A backend sets ``most`` (``FramedTransport.coalesce_bytes``): ucx keeps a table frame's payload
    inline in its control message."""
    out: list[tuple[int, int]] = []
    n = len(blocks)
    i = 0
    while i < n:
        j, total = i, 0
        while (j < n and j - i < COALESCE_ROWS and (size := blocks[j].payload.nbytes) <= COALESCE_BLOCK_MAX
               and total + size <= most):
            total += size
            j += 1
        if j - i < 2:
            j = i + 1
        out.append((i, j))
        i = j
    return out


def pack(blocks: Sequence[Block], choice: ChecksumChoice) -> tuple[list[list[int]], bytearray]:
    """The block table and the payload (the blocks' bytes back to back) of one table frame.

    A block's row carries its supplied checksum, or one computed under ``pick(choice, nbytes)`` as a one-block
    frame's would be.
    """
    total = 0
    for b in blocks:
        total += b.payload.nbytes
    buf = bytearray(total)
    view = memoryview(buf)
    table: list[list[int]] = []
    pos = 0
    for b in blocks:
        payload = b.payload
        n = payload.nbytes
        if b.checksum is not None:
            algo_id, s = ALGO_IDS[b.checksum_algo], b.checksum
        else:
            algo = pick(choice, n)
            algo_id = ALGO_IDS[algo]
            s = xxh3_64_intdigest(payload) if algo_id == _XXH3 else checksum_of(algo, payload)
        view[pos:pos + n] = payload
        pos += n
        lo, hi = b.layers
        table.append([b.block_id, lo, hi, n, algo_id, s])
    return table, buf


def unpack(table: Any, payload: memoryview) -> tuple[list[Block], int | None]:
    """The blocks of a table frame, over read-only slices of ``payload``, and the id of the first whose bytes
    fail its row's checksum (None when all match). ``FrameError`` when the table is malformed (see the module
    docstring)."""
    if type(table) is not list or not table or len(table) > MAX_ROWS:
        raise FrameError(f"frame field 'bt' must be a block table of 1 to {MAX_ROWS} rows")
    ro = payload.toreadonly()
    total = ro.nbytes
    blocks: list[Block] = []
    bad: int | None = None
    pos = 0
    for row in table:
        if type(row) is not list or len(row) != 6:
            raise FrameError("a block table row must be [id, layer start, layer stop, nbytes, algo, checksum]")
        b, lo, hi, n, algo_id, s = row
        if (type(b) is not int or type(lo) is not int or type(hi) is not int or type(n) is not int
                or type(algo_id) is not int or type(s) is not int):
            raise FrameError("every field of a block table row must be an integer")
        if not 0 <= lo < hi:
            raise FrameError(f"block table layer range [{lo}, {hi}] must satisfy 0 <= start < stop")
        if not BLOCK_ID_MIN <= b <= BLOCK_ID_MAX or not 0 <= s <= _U64_MAX:
            raise FrameError("a block table id or checksum does not fit in 64 bits")
        algo = ALGO_NAMES.get(algo_id)
        if algo is None:
            raise FrameError(f"block table row names unknown checksum algorithm id {algo_id}")
        if n < 0 or pos + n > total:
            raise FrameError(f"block table sizes overrun the frame's {total}-byte payload")
        view = ro[pos:pos + n]
        pos += n
        if bad is None and (xxh3_64_intdigest(view) if algo_id == _XXH3 else checksum_of(algo, view)) != s:
            bad = b
        blocks.append(Block.decoded(b, view, (lo, hi), s, algo))
    if pos != total:
        raise FrameError(f"block table sizes add up to {pos} bytes, the frame's payload has {total}")
    return blocks, bad


class _Shared:
    """A lease and how many parts of it are still held."""

    __slots__ = ("held", "lease")

    def __init__(self, lease: Lease, held: int) -> None:
        self.lease = lease
        self.held = held


class LeasePart:
    """One block's hold on a lease shared by a frame's blocks: the lease is released with its last part.
    Releasing a part twice is harmless (the second does nothing)."""

    __slots__ = ("_shared",)

    def __init__(self, shared: _Shared) -> None:
        self._shared: _Shared | None = shared

    def release(self) -> None:
        shared, self._shared = self._shared, None
        if shared is not None:
            shared.held -= 1
            if not shared.held:
                shared.lease.release()


def share(lease: Lease | None, n: int) -> list[Releasable | None]:
    """``n`` parts of ``lease`` (one per block viewing it), or ``n`` Nones when there is no lease (an empty
    payload)."""
    if lease is None:
        return [None] * n
    shared = _Shared(lease, n)
    return [LeasePart(shared) for _ in range(n)]

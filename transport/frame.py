"""Wire frames of the socket backends, and an incremental decoder that needs no socket.

A frame is a fixed 32-byte header, msgpack metadata (a map), then the raw payload::

    offset size field
         0    4 magic          b"KVMF"
         4    1 version        1
         5    1 type           FrameType
         6    1 checksum algo  1 = sum64, 2 = crc32, 3 = xxh3 (of the payload)
         7    1 flags          0, 1 (COMPACT: a success ACK without metadata) or 2 (SMALL: a small push), see below
         8    4 meta length    <= max_meta_bytes
        12    8 payload length <= max_frame_payload
        20    8 payload checksum
        28    4 header CRC-32  over bytes 0..27 and the metadata

All integers little-endian. Never pickle: metadata is msgpack of plain maps, lists, ints, strings.

A compact ACK (flags ``COMPACT``, type ACK, no metadata, no payload) is the 32-byte header alone: the
answer ``{t, ok: true}`` to the transfer whose id is in the payload-checksum field. It is the common
answer (every push that commits), so it costs neither side a msgpack call; its header CRC still
covers the id. ``COMPACT`` on any other frame, or with metadata or payload, is a ``FrameError``.

A small push (flags ``SMALL``, type PUSH_DATA) is a whole one-block push that commits at once, with
fixed-layout metadata instead of msgpack (small pushes are the common KV push, and msgpack on both
sides costs them more than the rest of their framing)::

    offset size field (of the metadata)
         0    8 t              transfer id (unsigned)
         8    8 b              block id modulo 2**64 (unsigned)
        16    4 layer start
        20    4 layer stop     > layer start
        24    8 x              the sender's deadline (``time.time()`` seconds, float64)
        32    1 negative       1 when the block id is negative (it is then b - 2**64 >= -2**63), else 0
        33    -  r             the request id, UTF-8 (the rest of the metadata)

It decodes to the map a msgpack PUSH_DATA of one block would carry (``{t, i: 0, b, l, r, n: 1, c: true,
x}``) with every field's type already checked (``Frame.checked``). ``SMALL`` on another type, with less
metadata than the fixed part, with an empty layer range, a sign byte that is not 0 or 1 (or 1 under an
id that would be below -2**63) or a request id that is not UTF-8, is a ``FrameError``.

:class:`FrameDecoder` is sans-I/O: ``get_buffer``/``buffer_updated`` match ``asyncio.BufferedProtocol``
and ``feed`` replays bytes (tests, fuzzing). Small reads land in a fixed staging buffer; a payload is
read into a buffer leased from a :class:`BufferPool` (large remainders directly, so the kernel copies
into it once; a staged read is capped at ``STAGE_READ``, so at most that much of a payload is copied
twice), so decoding allocates nothing per frame beyond the metadata map.

Verification. Every payload's checksum is checked before its frame is emitted intact. An xxh3 payload
of at least ``STREAM_MIN`` bytes (the senders' default algorithm) is hashed piece by piece as each read
lands, with XXH3's streaming state (one per decoder, reset per payload; the same digest as hashing it
whole): the bytes are still in the core's cache then, where hashing the whole payload after its last
read touches a megabyte the cache no longer holds. A decoder told to (``defer_verify_min``) leaves other
large payloads unverified for its caller to check off the loop's thread.

Failure behaviour. A header that is not a frame (magic, version, type, algorithm, flags), declares a
length over the caps, or fails its CRC raises :class:`FrameError` before anything is allocated: a
stream cannot be trusted after that, so the connection must be closed. A payload that fails its
checksum does not desynchronise the stream: the frame is emitted with ``intact=False`` and the
connection carries on (the transfer it belongs to fails with ``IntegrityError``). When the pool is
exhausted the decoder stops after the metadata (``waiting_for_buffer``); the caller pauses reading and
calls ``resume()`` when buffers come back.
"""

from __future__ import annotations

import struct
import zlib
from dataclasses import dataclass
from enum import IntEnum
from typing import Any, Protocol

import msgpack
import xxhash

from transport.base import FrameError
from transport.checksum import ALGO_IDS, ALGO_NAMES, ChecksumName, checksum_of
from transport.frame_fields import unpack_meta
from transport.pool import BufferPool, Lease

MAGIC = b"KVMF"
VERSION = 1
HEADER = struct.Struct("<4sBBBBIQQI")
HEADER_SIZE = HEADER.size
assert HEADER_SIZE == 32
_PREFIX = struct.Struct("<4sBBBBIQQ")
"""Header bytes 0..27 (what the header CRC covers, with the metadata)."""
_CRC = struct.Struct("<I")
DIRECT_MIN = 64 * 1024
"""Payload remainders at least this large are received straight into their pool buffer."""
STREAM_MIN = DIRECT_MIN
"""xxh3 payloads at least this large are hashed piece by piece as they are received (see the module docstring)."""
STAGE_READ = 64 * 1024
"""The most one read puts into the staging buffer. The bytes after a header are read there before the
header says how long its payload is, and whatever of a large payload came with them is copied out again:
with a read of the whole staging area (320 KiB) a socket with a backlog put up to a third of each 1 MiB
payload through that second copy, with this cap at most 64 KiB of it."""
_EMPTY = memoryview(b"")
COMPACT = 0x01
"""Header flag of a compact ACK (see the module docstring)."""
SMALL = 0x02
"""Header flag of a small push: fixed-layout metadata (see the module docstring)."""
_SMALL_META = struct.Struct("<QQIIdB")
"""The fixed part of a small push's metadata: t, b mod 2**64, layer start, layer stop, x, b negative."""
_2_64 = 1 << 64
SMALL_META_SIZE = _SMALL_META.size
_SMALL_FRAME = struct.Struct(HEADER.format + _SMALL_META.format[1:])
"""A small push's header and fixed metadata, read by the decoder in one call."""


class FrameType(IntEnum):
    PUSH_DATA = 1
    """One block of a push: meta {t, i, b, l}; the last block also carries PUSH_END's {r, n, c, x}."""
    PUSH_END = 2
    """End of a push: meta {t, r, n, c, x}; c = commit now (no gate), x = the sender's deadline."""
    COMMIT = 3
    """Make a staged push visible: meta {t, x}."""
    ACK = 4
    """Answer to PUSH_END or COMMIT: meta {t, ok, s?, e?, m?}."""
    PULL = 5
    """Ask for blocks: meta {t, r, ids}."""
    PULL_HEAD = 6
    """Size of the answer to a PULL, sent before its data: meta {t, n, bytes}."""
    PULL_DATA = 7
    """One block of a pull answer: meta {t, i, b, l}."""
    PULL_END = 8
    """End of a pull answer: meta {t, ok, n?, e?, m?}."""
    CANCEL = 9
    """The initiator gave up on a transfer: meta {t}; {t: 0, bye: true} closes the connection."""


_TYPES = {int(t): t for t in FrameType}
PUSH_DATA, ACK = FrameType.PUSH_DATA, FrameType.ACK
"""The types of a small push and its answer as plain globals: an enum member's lookup through its class costs
about 0.13 us on Python 3.11 (ten times a global's), several times per small push on each side."""


@dataclass(frozen=True)
class Limits:
    max_meta_bytes: int = 64 * 1024
    max_payload: int = 128 * 1024 * 1024


@dataclass(slots=True)
class Frame:
    """A decoded frame. ``payload`` is a view of ``lease`` (None for an empty payload)."""

    type: FrameType
    meta: dict[str, Any]
    payload: memoryview
    lease: Lease | None
    checksum: int
    algo: ChecksumName
    intact: bool = True
    checked: bool = False
    """The metadata's fields were type-checked by the decoder (a small push, a compact ACK): handlers need not
    check them again."""
    verified: bool = True
    """False while the payload's checksum is still to be checked (a decoder told to leave large payloads to a
    :class:`~transport.verify.Verifier`); ``intact`` is False until then, so an unchecked frame never passes."""

    def release(self) -> None:
        if self.lease is not None:
            self.lease.release()


def encode(ftype: FrameType, meta: dict[str, Any], payload: Any = None, *, algo: ChecksumName = "xxh3",
           checksum: int | None = None) -> tuple[bytes, memoryview]:
    """Header plus metadata (one bytes object) and the payload view (written separately, never copied).

    ``checksum`` is the payload's checksum under ``algo`` when the caller already has it.
    """
    meta_b = msgpack.packb(meta, use_bin_type=True)
    body = _EMPTY if payload is None else (payload if isinstance(payload, memoryview) else memoryview(payload))
    if body.nbytes and (body.format != "B" or body.ndim != 1):
        body = body.cast("B")
    n = body.nbytes
    psum = (checksum if checksum is not None else checksum_of(algo, body)) if n else 0
    prefix = _PREFIX.pack(MAGIC, VERSION, ftype, ALGO_IDS[algo], 0, len(meta_b), n, psum)
    return b"".join((prefix, _CRC.pack(zlib.crc32(meta_b, zlib.crc32(prefix))), meta_b)), body


_ACK_PREFIX = _PREFIX.pack(MAGIC, VERSION, FrameType.ACK, ALGO_IDS["xxh3"], COMPACT, 0, 0, 0)[:20]
"""The first 20 bytes of every compact ACK ``encode_ack`` writes (the decoder recognises them without a Header)."""
_ACK_TAIL = struct.Struct("<QI")
"""A compact ACK's last 12 bytes: the transfer id and the header CRC."""

_ACK_PREFIX_CRC = zlib.crc32(_ACK_PREFIX)
_U64 = struct.Struct("<Q")


def encode_ack(tid: int) -> bytes:
    """The compact ACK answering transfer ``tid`` with success (decoded as the map ``{t: tid, ok: true}``): the
    constant first 20 bytes, the id, and the header CRC continued from the constant part's."""
    tail = _U64.pack(tid)
    return _ACK_PREFIX + tail + _CRC.pack(zlib.crc32(tail, _ACK_PREFIX_CRC))


def encode_small_push(tid: int, block_id: int, layers: tuple[int, int], request_id: str, expires_at: float,
                      payload: memoryview, checksum: int, algo: ChecksumName) -> bytes:
    """Header and fixed metadata of a small push (see the module docstring); its payload is sent after it.

    ``payload`` is a flat byte view and ``checksum`` its checksum under ``algo``; ``block_id`` is in
    [-2**63, 2**64) as every block id. Raises ``struct.error`` when the transfer id or a layer does not
    fit the fixed layout (the caller then sends a msgpack frame).
    """
    meta = _SMALL_META.pack(tid, block_id % _2_64, layers[0], layers[1], expires_at, block_id < 0) + request_id.encode()
    prefix = _PREFIX.pack(MAGIC, VERSION, PUSH_DATA, ALGO_IDS[algo], SMALL, len(meta), payload.nbytes, checksum)
    return b"".join((prefix, _CRC.pack(zlib.crc32(meta, zlib.crc32(prefix))), meta))


def encode_bytes(ftype: FrameType, meta: dict[str, Any], payload: Any = None, *, algo: ChecksumName = "xxh3",
                 checksum: int | None = None) -> bytes:
    """One frame as a single bytes object (tests and small control frames)."""
    head, body = encode(ftype, meta, payload, algo=algo, checksum=checksum)
    return head + bytes(body)


class Direct(Protocol):
    """Takes a compact ACK or a small push straight from the decoder (``FrameDecoder.direct``): no Frame, no map."""
    def on_ack(self, tid: int) -> None: ...

    def on_small_push(self, t: int, b: int, layers: tuple[int, int], request_id: str, expires_at: float,
                      payload: memoryview, lease: Lease | None, checksum: int, algo: ChecksumName,
                      intact: bool) -> None: ...


class FrameDecoder:
    """Incremental frame decoder over a pool (see the module docstring for its failure behaviour). With ``direct``
    set, a compact ACK or a small push that is the first frame a read completes goes to it, decoded and verified
    (``intact``), instead of into the returned list (the small push's synchronous path); one behind others in the
    list goes into the list too, so order is kept."""

    _HEAD, _META, _PAYLOAD, _WAIT = range(4)

    def __init__(self, pool: BufferPool, limits: Limits = Limits(), defer_verify_min: int = 0) -> None:
        if not pool.fits(limits.max_payload):
            raise ValueError("the pool cannot hold the largest payload the limits allow")
        self.pool = pool
        self.limits = limits
        self.defer_verify_min = defer_verify_min
        """Payloads received in the payload state at least this large (0: none) are emitted unverified
        (``Frame.verified`` False) for the caller to check off the loop's thread."""
        self._stage = bytearray(HEADER_SIZE + limits.max_meta_bytes + 4 * DIRECT_MIN)
        self._stage_view = memoryview(self._stage)
        self._r = 0
        self._w = 0
        self._state = self._HEAD
        self._type = FrameType.PUSH_DATA
        self._algo: ChecksumName = "xxh3"
        self._meta_len = 0
        self._payload_len = 0
        self._psum = 0
        self._header: Header | None = None
        self._meta: dict[str, Any] = {}
        self._lease: Lease | None = None
        self._filled = 0
        self._direct = False
        self._hasher: Any = None
        """The running XXH3 of the payload being received (xxh3 payloads of at least ``STREAM_MIN`` bytes)."""
        self._xxh3 = xxhash.xxh3_64()
        """The one XXH3 state ``_hasher`` uses, reset per payload (a fresh state is a malloc, at times an mmap)."""
        self._failed: FrameError | None = None
        self.direct: Direct | None = None

    # -- BufferedProtocol side -------------------------------------------------------------------
    @property
    def waiting_for_buffer(self) -> bool:
        return self._state == self._WAIT

    def get_buffer(self, sizehint: int = -1) -> memoryview:
        """Where the next received bytes go: the pending payload's buffer, or the staging area."""
        if (self._state == self._PAYLOAD and self._lease is not None and self._r == self._w
                and self._payload_len - self._filled >= DIRECT_MIN):
            self._direct = True
            return self._lease.view[self._filled:self._payload_len]
        self._direct = False
        if self._r == self._w:
            self._r = self._w = 0
        elif len(self._stage) - self._w < DIRECT_MIN:
            pending = self._w - self._r
            self._stage[:pending] = self._stage[self._r:self._w]
            self._r, self._w = 0, pending
        if self._w >= len(self._stage):
            raise FrameError("receive staging buffer is full while waiting for a pool buffer")
        return self._stage_view[self._w:self._w + STAGE_READ]

    def buffer_updated(self, nbytes: int) -> list[Frame]:
        """Account ``nbytes`` just written into the last ``get_buffer`` view; return completed frames."""
        if self._direct:
            if self._hasher is not None:
                assert self._lease is not None
                self._hasher.update(self._lease.view[self._filled:self._filled + nbytes])
            self._filled += nbytes
            if self._filled < self._payload_len:  # a read into the middle of a payload (most reads of a large
                return []  # one): the staging area is empty in direct mode, so nothing else can complete
        else:
            self._w += nbytes
        return self._process()

    def resume(self) -> list[Frame]:
        """Retry after the pool released buffers; returns frames completed by bytes already staged."""
        return self._process()

    def feed(self, data: bytes | bytearray | memoryview) -> list[Frame]:
        """Decode ``data`` as if it had arrived on a socket (for tests and fuzzing)."""
        src = memoryview(data).cast("B")
        out: list[Frame] = []
        while src.nbytes:
            if self.waiting_for_buffer:
                out.extend(self._process())  # bytes keep landing in the staging area meanwhile
            dst = self.get_buffer(src.nbytes)
            k = min(dst.nbytes, src.nbytes)
            dst[:k] = src[:k]
            src = src[k:]
            out.extend(self.buffer_updated(k))
        return out

    def close(self) -> None:
        """Release the partially received payload, if any."""
        if self._lease is not None:
            self._lease.release()
            self._lease = None
        self._hasher = None
        self._state = self._HEAD

    # -- decoding --------------------------------------------------------------------------------
    def _process(self) -> list[Frame]:
        if self._failed is not None:
            raise self._failed
        out: list[Frame] = []
        try:
            self._step_all(out)
        except FrameError as e:
            self._abandon(out, e)
            raise
        return out

    def _abandon(self, out: list[Frame], e: FrameError) -> None:
        """The stream failed with ``e``: remember it, release frames completed before the error too."""
        self._failed = e
        for f in out:
            f.release()
        self.close()

    def _step_all(self, out: list[Frame]) -> None:
        while True:
            avail = self._w - self._r
            if self._state == self._HEAD:
                if avail < HEADER_SIZE:
                    return
                r = self._r
                flags = self._stage[r + 7]
                if flags == COMPACT and self._stage_view[r:r + 20] == _ACK_PREFIX:  # the common answer: no Header
                    tid, crc = _ACK_TAIL.unpack_from(self._stage, r + 20)
                    if zlib.crc32(self._stage_view[r:r + 28]) != crc:
                        raise FrameError("frame header checksum mismatch (corrupt or not a kvmesh stream)")
                    self._r = r + HEADER_SIZE
                    if self.direct is not None and not out:
                        self.direct.on_ack(tid)
                    else:
                        out.append(Frame(ACK, {"t": tid, "ok": True}, _EMPTY, None, 0, "xxh3", True, True))
                    continue
                if flags == SMALL and self._small(out, r):
                    continue
                self._parse_header(self._stage_view[self._r:self._r + HEADER_SIZE])
                self._r += HEADER_SIZE
                self._state = self._META
                if self._meta_len + self._payload_len <= avail - HEADER_SIZE and self._whole(out):
                    continue
            elif self._state == self._META:
                if avail < self._meta_len:
                    return
                meta_b = self._stage_view[self._r:self._r + self._meta_len]
                self._r += self._meta_len
                assert self._header is not None
                self._meta = self._header.check_meta(meta_b)
                self._state = self._WAIT
            elif self._state == self._WAIT:
                if self._payload_len == 0:
                    out.append(Frame(self._type, self._meta, _EMPTY, None, 0, self._algo, True,
                                     self._header is not None and self._header.small))
                    self._state = self._HEAD
                    continue
                lease = self.pool.acquire(self._payload_len)
                if lease is None:
                    return
                self._lease, self._filled = lease, 0
                self._hasher = None
                if self._algo == "xxh3" and self._payload_len >= STREAM_MIN:
                    self._hasher = self._xxh3
                    self._hasher.reset()
                self._state = self._PAYLOAD
            else:  # payload
                assert self._lease is not None
                need = self._payload_len - self._filled
                k = min(need, avail)
                if k:
                    staged = self._stage_view[self._r:self._r + k]
                    self._lease.view[self._filled:self._filled + k] = staged
                    if self._hasher is not None:
                        self._hasher.update(staged)
                    self._r += k
                    self._filled += k
                if self._filled < self._payload_len:
                    return
                lease, self._lease = self._lease, None
                hasher, self._hasher = self._hasher, None
                view = lease.view
                small = self._header is not None and self._header.small
                if hasher is not None:  # hashed as it landed
                    out.append(Frame(self._type, self._meta, view, lease, self._psum, self._algo,
                                     hasher.intdigest() == self._psum, small))
                elif self.defer_verify_min and self._payload_len >= self.defer_verify_min:
                    out.append(Frame(self._type, self._meta, view, lease, self._psum, self._algo, False, small, False))
                else:
                    intact = checksum_of(self._algo, view) == self._psum
                    out.append(Frame(self._type, self._meta, view, lease, self._psum, self._algo, intact, small))
                self._state = self._HEAD

    def _whole(self, out: list[Frame]) -> bool:
        """Decode a frame whose metadata and payload are already staged in one step (small frames: the
        common case of control frames and small pushes), instead of one state per pass; False (nothing
        consumed, state unchanged) when the pool has no buffer for its payload."""
        h = self._header
        assert h is not None
        r = self._r
        body = r + self._meta_len
        n = self._payload_len
        if n:
            lease = self.pool.acquire(n)
            if lease is None:
                return False
            try:
                meta = h.check_meta(self._stage_view[r:body])
            except FrameError:
                lease.release()
                raise
            view = lease.view
            view[:] = self._stage_view[body:body + n]
            self._r = body + n
            out.append(Frame(h.type, meta, view, lease, h.checksum, h.algo, checksum_of(h.algo, view) == h.checksum,
                             h.small))
        else:
            self._r = body
            out.append(Frame(h.type, h.check_meta(self._stage_view[r:body]), _EMPTY, None, 0, h.algo, True, h.small))
        self._state = self._HEAD
        return True

    def _small(self, out: list[Frame], r: int) -> bool:
        """Decode the small push staged whole at ``r`` in one step, without a Header (the common KV push);
        False (nothing consumed) when it is not staged whole, the pool has no buffer, or its header is
        not a valid small push: the general path then decodes it, waits, or says what is wrong."""
        fixed = r + HEADER_SIZE + SMALL_META_SIZE
        if fixed > self._w:
            return False
        magic, version, ftype, algo, _, meta_len, n, psum, crc, t, b, start, stop, x, negative = (
            _SMALL_FRAME.unpack_from(self._stage, r))  # header and fixed metadata in one call
        body = r + HEADER_SIZE + meta_len
        if (magic != MAGIC or version != VERSION or ftype != PUSH_DATA or algo not in ALGO_NAMES
                or not SMALL_META_SIZE <= meta_len <= self.limits.max_meta_bytes or n > self.limits.max_payload
                or body + n > self._w):
            return False
        view = self._stage_view
        if zlib.crc32(view[r + HEADER_SIZE:body], zlib.crc32(view[r:r + 28])) != crc:
            raise FrameError("frame header checksum mismatch (corrupt or not a kvmesh stream)")
        if start >= stop or negative:  # an empty layer range or a negative id: checked (or refused) in full
            t, b, start, stop, x, rid = _small_fields(view[r + HEADER_SIZE:body])
        else:
            try:
                rid = str(view[fixed:body], "utf-8")
            except UnicodeDecodeError as e:
                raise FrameError("small push request id is not UTF-8") from e
        name = ALGO_NAMES[algo]
        lease = None
        payload = _EMPTY
        if n:
            lease = self.pool.acquire(n)
            if lease is None:
                return False
            payload = lease.view
            payload[:] = view[body:body + n]
        self._r = body + n
        intact = not n or (xxhash.xxh3_64_intdigest(payload) if name == "xxh3" else checksum_of(name, payload)) == psum
        if self.direct is not None and not out:
            self.direct.on_small_push(t, b, (start, stop), rid, x, payload, lease, psum if n else 0, name, intact)
        else:
            meta = small_push_meta(t, b, start, stop, x, rid)
            out.append(Frame(PUSH_DATA, meta, payload, lease, psum if n else 0, name, intact, True))
        return True

    def _parse_header(self, head: memoryview) -> None:
        h = parse_header(head, self.limits)
        self._type, self._algo, self._meta_len, self._payload_len = h.type, h.algo, h.meta_len, h.payload_len
        self._psum, self._header = h.checksum, h


@dataclass(slots=True)
class Header:
    """A parsed, validated frame header (the metadata is not yet checked). Not frozen: a frozen dataclass
    costs a microsecond more to build, and one is built per frame received; nothing writes to it."""

    type: FrameType
    algo: ChecksumName
    meta_len: int
    payload_len: int
    checksum: int
    prefix_crc: int
    """CRC-32 of header bytes 0..27, continued over the metadata by ``check_meta``."""
    crc: int
    compact: bool = False
    """A compact ACK: ``checksum`` is the transfer id, the metadata is implied."""
    small: bool = False
    """A small push: the metadata has the fixed layout of the module docstring."""

    def check_meta(self, meta_b: bytes | memoryview) -> dict[str, Any]:
        """The metadata map, after checking the header CRC over header and metadata (FrameError if not)."""
        if zlib.crc32(meta_b, self.prefix_crc) != self.crc:
            raise FrameError("frame header checksum mismatch (corrupt or not a kvmesh stream)")
        if self.compact:
            return {"t": self.checksum, "ok": True}
        if self.small:
            return small_push_meta(*_small_fields(meta_b))
        return unpack_meta(meta_b)


def parse_header(head: bytes | memoryview, limits: Limits) -> Header:
    """Validate a 32-byte header against the protocol and the caps; FrameError names what is wrong."""
    magic, version, ftype, algo, flags, meta_len, payload_len, psum, hcrc = HEADER.unpack(head)
    if magic != MAGIC:
        raise FrameError(f"bad frame magic {bytes(magic)!r} (expected {MAGIC!r}): not a kvmesh peer")
    if version != VERSION:
        raise FrameError(f"peer speaks frame version {version}, this end speaks {VERSION}")
    if ftype not in _TYPES:
        raise FrameError(f"unknown frame type {ftype}")
    if algo not in ALGO_NAMES:
        raise FrameError(f"unknown checksum algorithm id {algo}")
    if flags != 0 and not ((flags == COMPACT and ftype == FrameType.ACK and not meta_len and not payload_len)
                           or (flags == SMALL and ftype == FrameType.PUSH_DATA and meta_len >= SMALL_META_SIZE)):
        raise FrameError(f"unsupported frame flags {flags:#x}" + _FLAG_USE.get(flags, ""))
    if meta_len > limits.max_meta_bytes:
        raise FrameError(f"declared metadata length {meta_len} exceeds the cap {limits.max_meta_bytes}")
    if payload_len > limits.max_payload:
        raise FrameError(f"declared payload length {payload_len} exceeds the cap {limits.max_payload}")
    return Header(_TYPES[ftype], ALGO_NAMES[algo], meta_len, payload_len, psum, zlib.crc32(head[:28]), hcrc,
                  flags == COMPACT, flags == SMALL)


_FLAG_USE = {COMPACT: " (compact is for an ACK without metadata or payload)",
             SMALL: f" (small is for a PUSH_DATA with at least {SMALL_META_SIZE} bytes of metadata)"}


def small_push_meta(t: int, b: int, start: int, stop: int, x: float, r: str) -> dict[str, Any]:
    """A small push's fields as the map a msgpack PUSH_DATA of one block carries."""
    return {"t": t, "i": 0, "b": b, "l": [start, stop], "r": r, "n": 1, "c": True, "x": x}


def _small_fields(meta_b: bytes | memoryview) -> tuple[int, int, int, int, float, str]:
    """A small push's fixed metadata, checked: t, b, layer start, layer stop, x, r."""
    t, b, start, stop, x, negative = _SMALL_META.unpack_from(meta_b)
    if start >= stop:
        raise FrameError(f"small push layer range [{start}, {stop}] is empty")
    if negative:
        if negative != 1 or b < _2_64 >> 1:
            raise FrameError(f"small push block id sign byte {negative} does not fit id {b}")
        b -= _2_64
    try:
        r = str(meta_b[SMALL_META_SIZE:], "utf-8")
    except UnicodeDecodeError as e:
        raise FrameError("small push request id is not UTF-8") from e
    return t, b, start, stop, x, r

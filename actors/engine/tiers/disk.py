"""The local disk tier: one real file per block under the engine's folder, behind an NVMe preset.

File format: a 24-byte header (``<QQQ``: key, payload length, xxh3 of the payload) then the payload. Writes
go to a temporary name and are renamed into place (``os.replace``), so a reader sees a whole file or none.
All file I/O runs in a worker thread (``asyncio.to_thread``): the event loop never blocks on the disk.

Invariants: the in-memory index (key -> payload length) names exactly the files this tier wrote and has not
evicted, so ``lookup`` does no I/O; ``len(index) <= capacity_blocks``. The index is updated on the loop
thread only after a write's thread finished, so a block is visible once it is on disk.

Failure behaviour: a missing or unreadable file raises ``TierMiss``/``TierIOError``; a header or checksum
mismatch (torn or corrupted file) raises ``TierIntegrity``; each of these forgets the key. ``get`` never
returns part of what was asked. A write that fails (disk full, I/O error) raises ``TierIOError`` and
stores nothing more from that batch.
"""

from __future__ import annotations

import asyncio
import os
import shutil
import struct
import tempfile
from collections.abc import Sequence
from pathlib import Path

from actors.engine.kv_blocks import BlockHash
from actors.engine.tiers.base import (
    MEDIUM_DISK,
    PutResult,
    TierIntegrity,
    TierIOError,
    TierMiss,
    TierUsage,
)
from actors.engine.tiers.policies import EvictionPolicy
from config.tiers import TierDevice
from transport.checksum import xxh3

HEADER = struct.Struct("<QQQ")


class DiskTier:
    """Local disk tier (see the module docstring)."""

    name = "disk"
    medium = MEDIUM_DISK

    def __init__(self, capacity_blocks: int, device: TierDevice, policy: EvictionPolicy,
                 directory: Path | None = None, label: str = "engine") -> None:
        if capacity_blocks < 1:
            raise ValueError("a disk tier needs room for at least one block")
        self.capacity_blocks = capacity_blocks
        self.device = device
        self.policy = policy
        self._owns_dir = directory is None
        if directory is None:
            self.directory = Path(tempfile.mkdtemp(prefix=f"kvmesh-disk-{label}-"))
        else:
            self.directory = Path(directory) / label
            self.directory.mkdir(parents=True, exist_ok=True)
        self.index: dict[BlockHash, int] = {}
        self._bad: list[BlockHash] = []
        """Keys an I/O thread found corrupt; the loop thread forgets them (the index is the loop's)."""
        self._lock = asyncio.Lock()
        """Serialises puts: eviction choices and the index stay consistent across overlapping writers."""

    def path_of(self, h: BlockHash) -> Path:
        return self.directory / f"{int(h):016x}.kv"

    def lookup(self, hashes: Sequence[BlockHash]) -> int:
        n = 0
        for h in hashes:
            if h not in self.index:
                break
            n += 1
        return n

    async def put(self, blocks: Sequence[tuple[BlockHash, bytes]]) -> PutResult:
        async with self._lock:
            fresh: list[tuple[BlockHash, bytes]] = []
            seen: set[BlockHash] = set()
            for h, data in blocks:
                if h in self.index or h in seen:
                    self.policy.touch(h)
                    continue
                seen.add(h)
                fresh.append((h, data))
            fresh = fresh[-self.capacity_blocks:]
            room = self.capacity_blocks - len(self.index)
            victims: list[BlockHash] = []
            while room < len(fresh):
                v = self.policy.victim()
                self.policy.forget(v)
                del self.index[v]
                victims.append(v)
                room += 1
            try:
                await asyncio.to_thread(self._write, fresh, victims)
            except OSError as e:
                raise TierIOError(self.name, f"write failed: {e}") from e
            for h, data in fresh:
                self.index[h] = len(data)
                self.policy.touch(h)
            return PutResult(tuple(h for h, _ in fresh), tuple(victims), ())

    def _write(self, fresh: list[tuple[BlockHash, bytes]], victims: list[BlockHash]) -> None:
        for v in victims:
            self.path_of(v).unlink(missing_ok=True)
        for h, data in fresh:
            path = self.path_of(h)
            tmp = path.with_suffix(".tmp")
            with open(tmp, "wb") as f:
                f.write(HEADER.pack(int(h), len(data), xxh3(data)))
                f.write(data)
            os.replace(tmp, path)

    async def get(self, hashes: Sequence[BlockHash]) -> list[bytes]:
        for h in hashes:
            if h not in self.index:
                raise TierMiss(self.name, f"block {h:#x} is not held")
        try:
            out = await asyncio.to_thread(self._read, list(hashes))
        except FileNotFoundError as e:
            self._forget_path(e.filename)
            raise TierMiss(self.name, f"block file vanished: {e.filename}") from e
        except OSError as e:
            raise TierIOError(self.name, f"read failed: {e}") from e
        except TierIntegrity:
            bad, self._bad = self._bad, []
            for h in bad:
                self.drop(h)
            raise
        for h in hashes:
            self.policy.touch(h)
        return out

    def _read(self, hashes: list[BlockHash]) -> list[bytes]:
        out: list[bytes] = []
        for h in hashes:
            raw = self.path_of(h).read_bytes()
            if len(raw) < HEADER.size:
                self._drop_later(h)
                raise TierIntegrity(self.name, f"block {h:#x}: truncated file ({len(raw)} bytes)")
            key, length, check = HEADER.unpack_from(raw)
            payload = raw[HEADER.size:]
            if key != int(h) or length != len(payload) or xxh3(payload) != check:
                self._drop_later(h)
                raise TierIntegrity(self.name, f"block {h:#x}: header or checksum mismatch")
            out.append(payload)
        return out

    def _drop_later(self, h: BlockHash) -> None:
        """Called from the I/O thread: remove the file; ``get`` forgets the key on the loop thread."""
        self.path_of(h).unlink(missing_ok=True)
        self._bad.append(h)

    def _forget_path(self, filename: str | None) -> None:
        if filename is None:
            return
        try:
            h = BlockHash(int(Path(filename).stem, 16))
        except ValueError:
            return
        self.drop(h)

    def drop(self, h: BlockHash) -> None:
        if self.index.pop(h, None) is not None:
            self.policy.forget(h)

    def transfer_s(self, nbytes: int, write: bool) -> float:
        return self.device.transfer_s(nbytes, write)

    def usage(self) -> TierUsage:
        return TierUsage(len(self.index), self.capacity_blocks, sum(self.index.values()))

    async def close(self) -> None:
        self.index.clear()
        if self._owns_dir:
            await asyncio.to_thread(shutil.rmtree, self.directory, True)

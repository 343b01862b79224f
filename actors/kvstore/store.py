"""The blocks a shared KV store holds: bounded by bytes, evicted by policy, checksummed, with a change log.

``BlockStore`` maps a block's chained prefix hash to its payload and the payload's checksum (XXH3-64, as
the transport's frames). It is the pure part of the store: no I/O, no clock, no Ray (unit-tested alone).

Invariants:
- ``used_bytes`` is the sum of the payload sizes held and never exceeds ``capacity_bytes`` after a ``put``;
- every key held is tracked by the eviction policy and only those (``len(policy) == len(blocks)``);
- a block whose payload is larger than the whole store is refused (not stored, nothing evicted for it);
- ``get`` is all or nothing (Mooncake Store's rule): every block asked for, in order, verified against the
  checksum written with it, or ``TierMiss`` / ``TierIntegrity``; a block failing its checksum is dropped.

The change log numbers every add and remove (``version``), so clients that keep a local view of the
store's keys (``client.StoreTier.lookup`` must answer without I/O) catch up with ``changes_since``: the
adds and removes after the version they hold, or, when the log no longer reaches back that far (it keeps
``log_limit`` to twice that entries), a full snapshot flagged ``reset``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from actors.engine.kv_blocks import BlockHash
from actors.engine.tiers.base import PutResult, TierIntegrity, TierMiss, TierUsage
from actors.engine.tiers.policies import EvictionPolicy, make_policy
from transport.checksum import ChecksumName, checksum_of

CHECKSUM: ChecksumName = "xxh3"


@dataclass(frozen=True, slots=True)
class Changes:
    """What changed in a store after ``since``: keys added and removed, up to ``version``.

    With ``reset`` the client must replace its view by ``added`` (the log did not reach back to ``since``).
    """

    version: int
    added: tuple[BlockHash, ...] = ()
    removed: tuple[BlockHash, ...] = ()
    reset: bool = False


@dataclass(slots=True)
class _Entry:
    payload: bytes
    checksum: int


class BlockStore:
    """Blocks by prefix hash within a byte capacity (see the module docstring for the invariants)."""

    def __init__(self, capacity_bytes: int, eviction: str = "lru", *, name: str = "store",
                 log_limit: int = 1 << 16) -> None:
        if capacity_bytes <= 0:
            raise ValueError(f"store capacity must be positive, got {capacity_bytes} bytes")
        self.name = name
        self.capacity_bytes = capacity_bytes
        self.used_bytes = 0
        self._blocks: dict[BlockHash, _Entry] = {}
        self._policy: EvictionPolicy = make_policy(eviction)
        self._log: list[tuple[bool, BlockHash]] = []
        """Entry ``i`` is version ``self._log_base + i + 1``; trimmed to ``log_limit`` when twice that."""
        self._log_base = 0
        self._log_limit = log_limit
        self.version = 0
        self.hits = 0
        self.misses = 0
        self.evictions = 0
        self.corrupt = 0
        self.refused = 0

    def __len__(self) -> int:
        return len(self._blocks)

    def __contains__(self, key: BlockHash) -> bool:
        return key in self._blocks

    def keys(self) -> list[BlockHash]:
        return list(self._blocks)

    def _logged(self, added: bool, key: BlockHash) -> None:
        self.version += 1
        self._log.append((added, key))
        if len(self._log) >= 2 * self._log_limit:
            drop = len(self._log) - self._log_limit
            del self._log[:drop]
            self._log_base += drop

    def _drop(self, key: BlockHash) -> None:
        entry = self._blocks.pop(key)
        self.used_bytes -= len(entry.payload)
        self._policy.forget(key)
        self._logged(False, key)

    def put(self, blocks: Sequence[tuple[BlockHash, bytes]], checksums: Sequence[int | None] | None = None
            ) -> PutResult:
        """Store blocks (a key already held is refreshed, not rewritten), evicting by policy to make room.

        ``checksums[i]`` is block i's XXH3-64 when the caller already has it (the transport verified it on
        arrival); otherwise it is computed here.
        """
        stored: list[BlockHash] = []
        evicted: list[BlockHash] = []
        for i, (key, payload) in enumerate(blocks):
            if key in self._blocks:
                self._policy.touch(key)
                stored.append(key)
                continue
            size = len(payload)
            if size > self.capacity_bytes:
                self.refused += 1
                continue
            while self.used_bytes + size > self.capacity_bytes:
                victim = self._policy.victim()
                self._drop(victim)
                self.evictions += 1
                evicted.append(victim)
            given = checksums[i] if checksums is not None else None
            data = bytes(payload)
            self._blocks[key] = _Entry(data, given if given is not None else checksum_of(CHECKSUM, data))
            self.used_bytes += size
            self._policy.touch(key)
            self._logged(True, key)
            stored.append(key)
        return PutResult(stored=tuple(stored), evicted=tuple(evicted))

    def lookup(self, hashes: Sequence[BlockHash]) -> int:
        n = 0
        for h in hashes:
            if h not in self._blocks:
                break
            n += 1
        return n

    def entries(self, hashes: Sequence[BlockHash]) -> list[tuple[bytes, int]]:
        """Payload and checksum of every block asked for, verified, in order; else ``TierMiss``/``TierIntegrity``."""
        out: list[tuple[bytes, int]] = []
        for h in hashes:
            entry = self._blocks.get(h)
            if entry is None:
                self.misses += 1
                raise TierMiss(self.name, f"block {h:#x} is not in the store")
            if checksum_of(CHECKSUM, entry.payload) != entry.checksum:
                self.corrupt += 1
                self._drop(h)
                raise TierIntegrity(self.name, f"block {h:#x} failed its checksum (dropped)")
            out.append((entry.payload, entry.checksum))
        for h in hashes:
            self._policy.touch(h)
        self.hits += len(hashes)
        return out

    def get(self, hashes: Sequence[BlockHash]) -> list[bytes]:
        return [p for p, _ in self.entries(hashes)]

    def corrupt_for_test(self, key: BlockHash) -> tuple[bytes, int]:
        """Flip a byte of a held block, keeping its checksum (fault injection: bit rot at rest)."""
        entry = self._blocks[key]
        flipped = bytearray(entry.payload)
        flipped[0] ^= 0xFF
        entry.payload = bytes(flipped)
        return entry.payload, entry.checksum

    def changes_since(self, since: int) -> Changes:
        """Keys added and removed after version ``since`` (a snapshot with ``reset`` if the log is too short)."""
        if since >= self.version:
            return Changes(self.version)
        if since < self._log_base:
            return Changes(self.version, tuple(self._blocks), (), reset=True)
        added: dict[BlockHash, None] = {}
        removed: dict[BlockHash, None] = {}
        for was_added, key in self._log[since - self._log_base:]:
            if was_added:
                removed.pop(key, None)
                added[key] = None
            else:
                added.pop(key, None)
                removed[key] = None
        return Changes(self.version, tuple(added), tuple(removed))

    def usage(self, block_bytes: int | None = None) -> TierUsage:
        per = block_bytes or (self.used_bytes // len(self._blocks) if self._blocks else 0)
        return TierUsage(blocks=len(self._blocks), capacity_blocks=self.capacity_bytes // per if per else 0,
                         real_bytes=self.used_bytes)

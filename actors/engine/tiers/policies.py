"""Eviction policies of a KV tier, by name (SGLang's ``evict_policy`` shape: one small class each).

A policy only orders keys; the tier owns the payloads and the capacity. ``touch`` is called when a key is
stored or read, ``forget`` when the tier drops it, ``victim`` names the key to evict next (the tier then
calls ``forget``). Ties break deterministically (insertion order), so a replayed trace evicts alike.
"""

from __future__ import annotations

from collections import Counter, OrderedDict
from collections.abc import Callable
from typing import Protocol

from actors.engine.kv_blocks import BlockHash


class EvictionPolicy(Protocol):
    def touch(self, key: BlockHash) -> None: ...

    def forget(self, key: BlockHash) -> None: ...

    def victim(self) -> BlockHash:
        """The key to evict next; raises ``LookupError`` when the policy tracks none."""
        ...

    def __len__(self) -> int: ...


class LRU:
    """Least recently stored or read first."""

    def __init__(self) -> None:
        self._order: OrderedDict[BlockHash, None] = OrderedDict()

    def touch(self, key: BlockHash) -> None:
        self._order[key] = None
        self._order.move_to_end(key)

    def forget(self, key: BlockHash) -> None:
        self._order.pop(key, None)

    def victim(self) -> BlockHash:
        if not self._order:
            raise LookupError("nothing to evict")
        return next(iter(self._order))

    def __len__(self) -> int:
        return len(self._order)


class FIFO(LRU):
    """First stored first, whatever was read since (reads do not refresh)."""

    def touch(self, key: BlockHash) -> None:
        if key not in self._order:
            self._order[key] = None


class LFU(LRU):
    """Least often used first; among equals, least recently used (LRU order breaks ties)."""

    def __init__(self) -> None:
        super().__init__()
        self._hits: Counter[BlockHash] = Counter()

    def touch(self, key: BlockHash) -> None:
        super().touch(key)
        self._hits[key] += 1

    def forget(self, key: BlockHash) -> None:
        super().forget(key)
        self._hits.pop(key, None)

    def victim(self) -> BlockHash:
        if not self._order:
            raise LookupError("nothing to evict")
        return min(self._order, key=self._hits.__getitem__)  # min keeps the first (LRU) among equals


POLICIES: dict[str, Callable[[], EvictionPolicy]] = {"lru": LRU, "fifo": FIFO, "lfu": LFU}


def make_policy(name: str) -> EvictionPolicy:
    try:
        return POLICIES[name]()
    except KeyError:
        raise ValueError(f"unknown eviction policy {name!r} (known: {', '.join(sorted(POLICIES))})") from None

"""The KV tier protocol: what a storage level below the GPU's paged cache offers the engine.

A tier holds whole KV blocks keyed by their chained prefix hash (``actors.engine.kv_blocks``), as vLLM's
offloading connector and LMCache key theirs. The engine chains tiers GPU -> CPU -> disk -> store
(``actors.engine.tiers.chain``): a block evicted from one level is written to the next; a prefix found
only in a lower level is loaded back into GPU blocks, paying that level's modelled time.

Contract of a ``KVTier`` (httpcore-like, as ``transport.base``):
- Ownership: ``put`` copies (or writes out) the payload it is given; ``get`` returns fresh ``bytes`` the
  caller owns. Payloads are the real, payload-scaled block bytes; the tier never looks inside them.
- Atomicity (Mooncake Store's rule): ``get`` returns every block asked for, byte-exact, in order, or
  raises a ``TierError`` (``TierMiss`` when one is absent, ``TierIntegrity`` when its bytes fail their
  checksum, ``TierTimeout``/``TierIOError`` otherwise). It never returns a partial or corrupt list.
- ``lookup`` is a cheap, in-memory count of the *leading* hashes present (no I/O): a prefix query. A
  block present at lookup may still be evicted before ``get`` (then ``TierMiss``): callers treat every
  ``TierError`` as "recompute".
- ``put`` never fails for lack of room: it evicts by its policy (``actors.engine.tiers.policies``) and
  reports what it stored and what it evicted (with payloads when it held them in memory, so the chain
  can spill them to the next level). A block larger than the whole tier is not stored.
- Time: tiers do the real I/O as fast as the host allows; the *emulated* time a transfer costs comes from
  ``transfer_s`` (link / device presets), which the chain charges on the engine's clock.
- Events: ``medium`` is the name vLLM's KV events carry (``BlockStored.medium``: ``"GPU"`` for the paged
  cache, ``"CPU"`` for its CPU offload). Evictions are reported by ``put``'s result, so the chain emits
  ``BlockRemoved`` with the tier's medium.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

from actors.engine.kv_blocks import MEDIUM_GPU, BlockHash

__all__ = ["MEDIUM_CPU", "MEDIUM_DISK", "MEDIUM_GPU", "MEDIUM_STORE", "KVTier", "PutResult", "TierError",
           "TierIOError", "TierIntegrity", "TierMiss", "TierTimeout", "TierUsage"]

MEDIUM_CPU = "CPU"
"""vLLM's CPU offloading spec (``CPULoadStoreSpec.medium()``)."""
MEDIUM_DISK = "DISK"
MEDIUM_STORE = "STORE"
"""A shared KV store reached over the transport (LMCache server / Mooncake Store)."""


class TierError(Exception):
    """A tier could not serve a request. Every subclass means: fall back to recompute."""

    def __init__(self, tier: str, message: str) -> None:
        super().__init__(f"{tier}: {message}")
        self.tier = tier


class TierMiss(TierError):
    """A block asked for is not (or no longer) in the tier."""


class TierIntegrity(TierError):
    """A block's bytes read back do not match the checksum written with them (the block is dropped)."""


class TierTimeout(TierError):
    """The tier did not answer within the deadline the caller set."""


class TierIOError(TierError):
    """The medium failed (disk error, store unreachable, tier marked failed by fault injection)."""


@dataclass(frozen=True, slots=True)
class PutResult:
    """What a ``put`` did: blocks now held, blocks evicted to make room, and the payloads of evicted
    blocks the tier held in memory (``spill``: the chain writes them to the next level down)."""

    stored: tuple[BlockHash, ...] = ()
    evicted: tuple[BlockHash, ...] = ()
    spill: tuple[tuple[BlockHash, bytes], ...] = ()


@dataclass(frozen=True, slots=True)
class TierUsage:
    blocks: int
    capacity_blocks: int
    real_bytes: int


@runtime_checkable
class KVTier(Protocol):
    """One storage level below the GPU (see the module docstring for the contract)."""

    name: str
    """Short name used in metrics labels and logs: ``cpu``, ``disk``, ``store``."""
    medium: str
    """The medium vLLM's KV events name (``MEDIUM_CPU``, ``MEDIUM_DISK``, ``MEDIUM_STORE``)."""

    def lookup(self, hashes: Sequence[BlockHash]) -> int:
        """How many of the leading ``hashes`` the tier holds (stops at the first absent). No I/O."""
        ...

    async def put(self, blocks: Sequence[tuple[BlockHash, bytes]]) -> PutResult:
        """Store blocks (a hash already held is refreshed, not rewritten), evicting by policy."""
        ...

    async def get(self, hashes: Sequence[BlockHash]) -> list[bytes]:
        """Every block's payload, in order, byte-exact; or raise a ``TierError`` (never partial)."""
        ...

    def transfer_s(self, nbytes: int, write: bool) -> float:
        """Emulated seconds to move ``nbytes`` (emulated, not payload-scaled) into (``write``) or out of
        the tier from the level above, per the tier's device/link preset."""
        ...

    def usage(self) -> TierUsage: ...

    async def close(self) -> None:
        """Release what the tier holds (files, connections). Idempotent."""
        ...

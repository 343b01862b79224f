"""Where a prefix lives below the GPUs, and what loading it from there costs: the router's tier knowledge.

Engines' KV events carry the medium a block was stored in or removed from (vLLM's ``BlockStored.medium``:
``GPU``, ``CPU``; here also ``DISK`` and ``STORE``). ``PrefixIndex`` keeps the GPU holdings itself and hands
every other medium to a ``TierHoldings``:

- ``CPU`` and ``DISK`` holdings belong to the engine that reported them (its own host memory and disk);
- ``STORE`` holdings belong to the region: a block one engine reports in the store can be read by every
  engine of the region (each engine reports what its view of the store holds; any one report suffices).

``TierHoldings.extend(hashes, gpu_depth, worker, region_peers)`` walks the request's blocks past the
leading ones the worker holds in GPU, and counts, for the leading chain that continues in a lower tier,
how many blocks each tier would serve (the fastest one that holds each block: CPU, then disk, then store).

``TierPricing`` turns those counts into prefill-block equivalents for ``kv_aware``: loading ``k`` blocks
from a tier takes ``k x block bytes / tier bandwidth + latency`` (the presets: PCIe for the CPU tier,
NVMe for the disk, the region's NIC for the store), the prefill of the same blocks takes what the worker's
cost model says; a lower-tier hit costs ``k x min(1, load / prefill)`` prefill blocks, so a hit that loads
faster than it computes is cheap but not free, and one slower than recomputing is worth nothing (the engine
would recompute). Unknown models (no preset) price every lower-tier hit as a miss.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field

from actors.engine.tiers.base import MEDIUM_CPU, MEDIUM_DISK, MEDIUM_GPU, MEDIUM_STORE
from cluster.router.view import WorkerId, WorkerInfo

LOWER_MEDIA = (MEDIUM_CPU, MEDIUM_DISK, MEDIUM_STORE)
"""Fastest first: a block held in several is loaded from the first."""

LoadMs = Callable[[float], float]
"""Emulated ms to load this many emulated bytes from a medium into the GPU."""


@dataclass
class TierHoldings:
    """Blocks each worker reported in each lower medium (see the module docstring)."""

    _holders: dict[str, dict[int, set[WorkerId]]] = field(
        default_factory=lambda: {m: {} for m in LOWER_MEDIA})
    _by_worker: dict[WorkerId, dict[str, set[int]]] = field(default_factory=dict)

    def stored(self, worker: WorkerId, medium: str, hashes: Iterable[int]) -> None:
        if medium not in self._holders:
            return  # a medium this router does not price (an unknown name from a newer engine)
        mine = self._by_worker.setdefault(worker, {}).setdefault(medium, set())
        holders = self._holders[medium]
        for h in hashes:
            mine.add(h)
            holders.setdefault(h, set()).add(worker)

    def removed(self, worker: WorkerId, medium: str, hashes: Iterable[int]) -> None:
        mine = self._by_worker.get(worker, {}).get(medium)
        if mine is None:
            return
        holders = self._holders[medium]
        for h in hashes:
            mine.discard(h)
            hs = holders.get(h)
            if hs is not None:
                hs.discard(worker)
                if not hs:
                    del holders[h]

    def forget(self, worker: WorkerId) -> None:
        for medium, hashes in self._by_worker.pop(worker, {}).items():
            holders = self._holders[medium]
            for h in hashes:
                hs = holders.get(h)
                if hs is not None:
                    hs.discard(worker)
                    if not hs:
                        del holders[h]

    def __bool__(self) -> bool:
        return any(self._holders.values())

    def blocks_of(self, worker: WorkerId, medium: str) -> int:
        return len(self._by_worker.get(worker, {}).get(medium, ()))

    def extend(self, hashes: Sequence[int], gpu_depth: int, worker: WorkerId,
               region_peers: Iterable[WorkerId]) -> dict[str, int]:
        """Blocks past ``gpu_depth`` the worker could load, by medium, along the leading chain."""
        peers = set(region_peers) | {worker}
        counts = dict.fromkeys(LOWER_MEDIA, 0)
        cpu, disk, store = (self._holders[m] for m in LOWER_MEDIA)
        for h in hashes[gpu_depth:]:
            if worker in cpu.get(h, ()):
                counts[MEDIUM_CPU] += 1
            elif worker in disk.get(h, ()):
                counts[MEDIUM_DISK] += 1
            elif not peers.isdisjoint(store.get(h, ())):
                counts[MEDIUM_STORE] += 1
            else:
                break
        return counts


BlockBytes = Callable[[WorkerInfo], int | None]
"""Emulated KV bytes of one block on a worker (None when its model is unknown)."""
PrefillMs = Callable[[WorkerInfo, int, int], float]
"""(worker, uncached tokens, cached tokens) -> emulated prefill ms (``regions.PrefillEstimate``)."""


class TierPricing:
    """Prefill-block equivalents of loading a prefix from lower tiers (see the module docstring)."""

    def __init__(self, links: dict[str, LoadMs], block_bytes: BlockBytes, prefill_ms: PrefillMs) -> None:
        missing = set(LOWER_MEDIA) - set(links)
        if missing:
            raise ValueError(f"tier pricing needs a link for every lower medium; missing {sorted(missing)}")
        self.links = links
        self.block_bytes = block_bytes
        self.prefill_ms = prefill_ms

    def load_ms(self, w: WorkerInfo, counts: dict[str, int]) -> float | None:
        per = self.block_bytes(w)
        if per is None:
            return None
        return sum(self.links[m](n * per) for m, n in counts.items() if n)

    def equivalent_blocks(self, w: WorkerInfo, gpu_depth: int, counts: dict[str, int]) -> tuple[int, float]:
        """(blocks the lower tiers supply, what loading them costs in prefill blocks)."""
        k = sum(counts.values())
        if not k:
            return 0, 0.0
        load = self.load_ms(w, counts)
        if load is None:
            return 0, 0.0
        compute = self.prefill_ms(w, k * w.block_size, gpu_depth * w.block_size)
        if compute <= 0:
            return 0, 0.0
        return k, k * min(1.0, load / compute)


def catalog_pricing(prefill_ms: PrefillMs, store_link: str, cpu_link: str = "pcie-gen5-x16",
                    disk_device: str = "nvme-gen4") -> TierPricing:
    """Pricing from the presets: a host link for the CPU tier and a drive for the disk (``config/presets/
    tiers.yaml``; the tier specs' defaults), the region's NIC (``links.yaml``) for the store."""
    from config.catalog import default_catalog
    from config.tiers import tier_devices

    cat = default_catalog()
    devices = tier_devices()
    cpu, disk, nic = devices[cpu_link], devices[disk_device], cat.links.get(store_link)
    links: dict[str, LoadMs] = {
        MEDIUM_CPU: lambda n: cpu.transfer_s(n, write=False) * 1000.0,
        MEDIUM_DISK: lambda n: disk.transfer_s(n, write=False) * 1000.0,
        MEDIUM_STORE: lambda n: nic.transfer_ms(n) + nic.latency_us / 1000.0,  # request leg, then the bytes
    }
    cache: dict[str, int | None] = {}

    def block_bytes(w: WorkerInfo) -> int | None:
        if w.model not in cache:
            cache[w.model] = (cat.models.get(w.model).kv_bytes_per_token * w.block_size
                              if w.model in cat.models else None)
        return cache[w.model]

    return TierPricing(links, block_bytes, prefill_ms)


def medium_of(event: Sequence[object], at: int) -> str:
    """The medium an encoded KV event names at position ``at`` (``GPU`` when absent: older engines)."""
    m = event[at] if len(event) > at else None
    return m if isinstance(m, str) else MEDIUM_GPU

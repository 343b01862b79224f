"""The per-step cost of a KV connector's store path: what offloading costs the forward pass when nothing is
loaded back (the lessons card's "3-5% overhead at low pressure" for LMCache).

A connector that offloads KV copies every newly computed block out of HBM; how that copy meets the forward
pass decides its cost. Two store paths, each a few lines in ``STORE_PATHS``, priced per step from the step's
newly written KV (``StepShape``: prefill tokens, plus one token per decoding sequence where the path stores
decode blocks) and the hardware's own figures, not from a fitted constant:

- ``kernel-sync`` (LMCache's vLLM connector, non-layerwise): ``wait_for_save`` runs at the end of the forward
  pass and gathers the step's paged KV into LMCache's pinned host buffer with a CUDA kernel
  (``multi_layer_kv_transfer``); the step returns only after the copy, so it adds
  ``bytes / host-link write rate + link latency`` to every step that stores. The remote put to the shared
  store then runs on the CPU, off the GPU's path.
- ``dma-async`` (vLLM's native OffloadingConnector since 0.11/0.12): ``cudaMemcpyAsync`` on a side stream, by
  the copy engines, overlapped with the next step; it uses no SMs, only HBM bandwidth the step shares, so it
  adds ``bytes / HBM bandwidth`` (an upper bound: it counts every read as contended).

Sources: vLLM blog "Inside vLLM's New Offloading Connector" (Ozeri, Harnik, 2025-12-29,
vllm-project.github.io/_posts/2025-12-29-offloading-connector.md): GPU->CPU copies reach ~50 GB/s one way on
H100 (our ``pcie-gen5-x16`` preset), and on 10,000 prefills of 512 tokens at 0% hits (Llama-3.2-1B, H100) a
copy kernel on the GPU's cores cost 6% of throughput while DMA cost ~0.5% (5.5% better than the kernel).
gpustack's LMCache evaluation (Qwen3-8B, RTX 4090, vLLM 0.10.1.1) measured -3% to -15% when nothing is reused.

The scheduler-side lookup of a shared store (``LookupPrice``): LMCache's ``get_num_new_matched_tokens`` asks
the store which of a new request's chunks it holds with a blocking call inside vLLM's ``schedule()``, so the
step that admits the request waits for it. Priced at ``STORE_LOOKUP_MS`` per request, once (LMCache caches
the answer for the scheduler's retries), on the step that first admits it. With async scheduling (vLLM
0.19's default, ``SchedulerLimits.async_scheduling``) that step was planned while the previous one ran, so
only the part of its lookups longer than the previous step shows (an engine waking from idle is treated the
same: an optimistic bound for its first step). Source: LMCache PR #936
(2025-07, "optimize get_num_new_matched_tokens latency in vLLM scheduler": one ``batchexist`` RPC to the
Mooncake master, "stabilizing overall latency to around 1-2ms"; LMCache issue #891 measured 2.6-655 ms with
the earlier lookup server). A lookup in the engine's own CPU tier is an in-memory dict probe (vLLM's
offloading manager, LMCache's local backend): not priced.

Invariants: the wrapper changes nothing but the step's ``total_ms`` and ``overhead_ms`` (by the same amount,
never negative); an empty step with no new lookup costs nothing; ``connector_ms`` sums what it added
(``lookup_ms`` the lookups' part of it); each lookup is charged once.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from actors.cost_model import CostModel, StepShape, StepTime
from config.tiers import TierDevice


@dataclass(frozen=True)
class StorePath:
    """How a connector's store meets the step: ``cost_ms(bytes per GPU, host link, HBM GB/s)`` and whether
    blocks filled by decoding are stored too (prefill blocks always are)."""

    cost_ms: Callable[[float, TierDevice, float], float]
    stores_decode: bool
    source: str


def _kernel_sync(nbytes: float, link: TierDevice, hbm_gbps: float) -> float:
    return 1000.0 * link.transfer_s(nbytes, write=True)


def _dma_async(nbytes: float, link: TierDevice, hbm_gbps: float) -> float:
    return 1000.0 * nbytes / (hbm_gbps * 1e9)


STORE_PATHS: dict[str, StorePath] = {
    "kernel-sync": StorePath(_kernel_sync, False, "LMCache vLLM v1 connector: gather kernel in wait_for_save"),
    "dma-async": StorePath(_dma_async, True, "vLLM OffloadingConnector: cudaMemcpyAsync on a side stream"),
}
STORE_LOOKUP_MS = 1.5
"""Emulated ms one new request's lookup in the shared store holds up the scheduler (LMCache PR #936: 1-2 ms)."""


@dataclass(frozen=True)
class LookupPrice:
    """The scheduler-path lookups to price: ``ms`` each, ``count()`` the lookups made so far (a counter that
    only grows, e.g. ``TierCounters.lookups``); ``overlapped``: async scheduling hides them behind the
    previous step."""

    ms: float
    count: Callable[[], int]
    overlapped: bool = False


CONNECTOR_OVERHEADS = ("auto", "off", *STORE_PATHS)
"""``TiersSpec.connector_overhead`` values: ``auto`` picks ``dma-async`` for an engine with a CPU/disk tier and
``kernel-sync`` once it writes through to a shared store (LMCache); ``off`` prices nothing."""


class ConnectorCostModel:
    """``inner``'s step time plus the store path's cost of the KV the step writes (see the module docstring).

    ``kv_bytes_per_gpu_token``: the emulated KV bytes one token adds on one GPU of the engine (the model's
    KV bytes per token over its TP ranks). ``lookup``: the store lookups to charge, each on the next step
    planned after it was made. Counts ``connector_ms`` (emulated ms added), ``lookup_ms`` (its lookups' part)
    and ``stored_bytes``.
    """

    def __init__(self, inner: CostModel, path: str, link: TierDevice, hbm_gbps: float,
                 lookup: LookupPrice | None = None) -> None:
        if path not in STORE_PATHS:
            raise ValueError(f"unknown store path {path!r} (known: {', '.join(STORE_PATHS)})")
        self.inner = inner
        self.path_name = path
        self.path = STORE_PATHS[path]
        self.link = link
        self.hbm_gbps = hbm_gbps
        self.name = inner.name
        self.kv_bytes_per_token = inner.kv_bytes_per_token
        self.max_context = inner.max_context
        tp = int(getattr(inner, "tp", 1) or 1)
        self.kv_bytes_per_gpu_token = inner.kv_bytes_per_token / tp
        self.lookup = lookup
        self._lookups_charged = lookup.count() if lookup is not None else 0
        self.connector_ms = 0.0
        self.lookup_ms = 0.0
        self.stored_bytes = 0.0
        self._prev_step_ms = 0.0

    def added_ms(self, shape: StepShape) -> float:
        tokens = shape.prefill_tokens + (shape.decode_seqs if self.path.stores_decode else 0)
        if tokens <= 0:
            return 0.0
        return self.path.cost_ms(tokens * self.kv_bytes_per_gpu_token, self.link, self.hbm_gbps)

    def _new_lookups_ms(self) -> float:
        if self.lookup is None:
            return 0.0
        seen = self.lookup.count()
        fresh = seen - self._lookups_charged
        self._lookups_charged = seen
        total = max(0, fresh) * self.lookup.ms
        return max(0.0, total - self._prev_step_ms) if self.lookup.overlapped else total

    def step(self, shape: StepShape) -> StepTime:
        t = self.inner.step(shape)
        store = self.added_ms(shape)
        lookups = self._new_lookups_ms()
        extra = store + lookups
        self._prev_step_ms = t.total_ms + extra
        if extra <= 0.0:
            return t
        if store > 0.0:
            tokens = shape.prefill_tokens + (shape.decode_seqs if self.path.stores_decode else 0)
            self.stored_bytes += tokens * self.kv_bytes_per_gpu_token
        self.connector_ms += extra
        self.lookup_ms += lookups
        return dataclasses.replace(t, total_ms=t.total_ms + extra, overhead_ms=t.overhead_ms + extra)

    def __getattr__(self, name: str) -> Any:  # the inner model's other attributes (hardware, tp...)
        return getattr(self.inner, name)


def base_cost(cost: CostModel) -> CostModel:
    return cost.inner if isinstance(cost, ConnectorCostModel) else cost


def with_store_path(cost: CostModel, setting: str, wanted: str, link: TierDevice,
                    lookup: LookupPrice | None = None) -> CostModel:
    """``cost`` priced for the store path ``wanted`` (what ``auto`` resolves to here) and ``lookup`` unless
    ``setting`` overrides it (``off``: the bare model; a path name: that path). Re-wrapping replaces an earlier
    path, so an engine that gains a store after its CPU tier is priced once, as LMCache."""
    bare = base_cost(cost)
    path = wanted if setting == "auto" else setting
    if path == "off":
        return bare
    hw = getattr(bare, "hardware", None)
    hbm = float(getattr(hw, "hbm_bandwidth_gbps", 0.0) or 0.0)
    if path == "dma-async" and hbm <= 0.0:
        return bare  # an empirical profile without an HBM figure: nothing to price the contention by
    return ConnectorCostModel(bare, path, link, hbm or 1.0, lookup)

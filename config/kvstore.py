"""Typed config of the shared KV store (``actors.kvstore``): one store per region, nested in the cluster spec."""

from __future__ import annotations

from pydantic import Field, field_validator

from config.base import Frozen, Name, PositiveFloat


class KVStoreSpec(Frozen):
    """A shared KV store in every region (LMCache server / Mooncake Store-like).

    Engines put full blocks after prefill and get them on a prefix miss, over the KV transport; the emulated
    time of a put or get is the store link's transfer time (``link``), charged on the engine's clock.
    """

    capacity_gb: PositiveFloat = 64.0
    """Emulated capacity per store (GB of full-size KV; the store holds ``kv_payload_scale`` of it in bytes)."""
    eviction: Name = "lru"
    """Eviction policy by name (``actors.engine.tiers.policies.POLICIES``)."""
    replicate: bool = False
    """Run a second store per region and copy every put to it; engines read from it when the first fails."""
    link: Name | None = None
    """Link preset between an engine and its store (None: the cluster's ``transport.intra_region_link``)."""
    sync_interval_ms: PositiveFloat = 100.0
    """How often an engine refreshes its view of the store's keys (emulated ms): its lookups answer from it."""
    timeout_ms: PositiveFloat = 2_000.0
    """Deadline of one put or get (emulated ms); past it the engine recomputes."""
    max_put_inflight: int = Field(default=8, ge=1)
    """Puts an engine keeps in flight to its store; beyond that new puts are dropped (never block a step)."""

    @field_validator("eviction")
    @classmethod
    def _known_policy(cls, v: str) -> str:
        from actors.engine.tiers.policies import POLICIES

        if v not in POLICIES:
            raise ValueError(f"unknown eviction policy {v!r} (known: {', '.join(sorted(POLICIES))})")
        return v

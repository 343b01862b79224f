"""KV tiers below an engine's GPU cache: the CPU DRAM and local disk tiers, swap preemption, and the
transfer-rate presets of the media they sit behind (host links, NVMe drives; ``presets/tiers.yaml``).

Capacities are in emulated bytes of KV (what the emulated host would hold); the real bytes a tier keeps are
those times the transport's ``kv_payload_scale``.
"""

from __future__ import annotations

from functools import cache
from pathlib import Path
from typing import Literal

from pydantic import Field, field_validator, model_validator

from config.base import Frozen, Name, NonNegativeFloat, PositiveFloat
from config.errors import ConfigError
from config.yamlio import read_yaml, validate

TIERS_PRESETS = Path(__file__).resolve().parent / "presets" / "tiers.yaml"
EVICTION_POLICIES = ("lru", "fifo", "lfu")
"""The keys of ``actors.engine.tiers.policies.POLICIES`` (a unit test keeps the two equal)."""


class TierDevice(Frozen):
    """A medium's transfer rates: a host link (GPU <-> CPU DRAM) or a storage device (DRAM <-> NVMe)."""

    name: Name
    source: str = Field(min_length=1)
    kind: Literal["host-link", "nvme"]
    read_gbps: PositiveFloat
    """GB/s (1e9 B/s) out of the tier toward the GPU: host-to-device for a link, sequential read for a drive."""
    write_gbps: PositiveFloat
    latency_us: NonNegativeFloat = 0.0
    """Fixed cost per transfer (DMA set-up, or the drive's access latency), microseconds."""

    def transfer_s(self, nbytes: float, write: bool) -> float:
        rate = self.write_gbps if write else self.read_gbps
        return self.latency_us / 1e6 + nbytes / (rate * 1e9)


class _TierSpec(Frozen):
    capacity_gb: PositiveFloat
    """Emulated GB of KV the tier holds."""
    policy: str = "lru"

    @field_validator("policy")
    @classmethod
    def _known_policy(cls, v: str) -> str:
        if v not in EVICTION_POLICIES:
            raise ValueError(f"unknown eviction policy {v!r} (known: {', '.join(EVICTION_POLICIES)})")
        return v


class CPUTierSpec(_TierSpec):
    link: Name = "pcie-gen5-x16"
    """Host-link preset between the GPU and CPU DRAM."""


class DiskTierSpec(_TierSpec):
    device: Name = "nvme-gen4"
    directory: str | None = None
    """Where block files go (one sub-folder per engine); default: a fresh temporary folder, removed at stop."""


class TiersSpec(Frozen):
    """Tiers of one engine group (``EngineGroupSpec.tiers``); all off by default."""

    cpu: CPUTierSpec | None = None
    disk: DiskTierSpec | None = None
    preemption: Literal["recompute", "swap"] = "recompute"
    """swap: a preempted sequence's KV goes to the CPU tier and comes back (no recompute); needs ``cpu``."""
    io_timeout_s: PositiveFloat = 2.0
    """Wall seconds a tier's real I/O may take before the load counts as failed (recompute instead)."""
    connector_overhead: Literal["auto", "off", "kernel-sync", "dma-async"] = "auto"
    """What the connector's store path costs each step (``actors.engine.tiers.overhead``): ``auto`` prices a
    CPU/disk tier as vLLM's native offload (``dma-async``) and a shared store as LMCache (``kernel-sync``);
    ``off`` prices nothing (the model before this knob)."""

    @property
    def enabled(self) -> bool:
        return self.cpu is not None or self.disk is not None

    @model_validator(mode="after")
    def _swap_needs_cpu(self) -> TiersSpec:
        if self.preemption == "swap" and self.cpu is None:
            raise ValueError("preemption 'swap' needs a cpu tier to swap to")
        wanted = []
        if self.cpu is not None:
            wanted.append(("cpu.link", self.cpu.link, "host-link"))
        if self.disk is not None:
            wanted.append(("disk.device", self.disk.device, "nvme"))
        for key, name, kind in wanted:
            dev = tier_devices().get(name)
            if dev is None or dev.kind != kind:
                known = sorted(n for n, d in tier_devices().items() if d.kind == kind)
                raise ValueError(f"{key}: unknown {kind} preset {name!r} (known: {', '.join(known)})")
        return self


@cache
def tier_devices(path: Path = TIERS_PRESETS) -> dict[str, TierDevice]:
    """The host-link and drive presets by name (loaded once per process)."""
    data = read_yaml(path)
    if not isinstance(data, dict) or set(data) != {"items"} or not isinstance(data["items"], list):
        raise ConfigError(str(path), [("", "a catalog file holds one key, 'items', a list of profiles")])
    out: dict[str, TierDevice] = {}
    for i, raw in enumerate(data["items"]):
        dev = validate(TierDevice, raw, source=str(path), prefix=f"items[{i}]")
        if dev.name in out:
            raise ConfigError(str(path), [(f"items[{i}].name", f"duplicate tier device {dev.name!r}")])
        out[dev.name] = dev
    return out

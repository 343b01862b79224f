"""Link profile: a fabric between two endpoints, as the transport's link model emulates it."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from config.base import Frozen, Name, NonNegativeFloat, PositiveFloat

LinkKind = Literal["nvlink", "pcie", "rdma", "tcp", "wan", "loopback"]


class LinkProfile(Frozen):
    """Bandwidth per direction and one-way latency. Transfers sharing a link share its bandwidth."""

    name: Name
    source: str = Field(min_length=1)
    kind: LinkKind
    bandwidth_gbps: PositiveFloat
    """GB/s per direction (1e9 bytes per second)."""
    latency_us: NonNegativeFloat = 0.0
    """One-way latency added to every transfer, microseconds."""
    setup_us: NonNegativeFloat = 0.0
    """Per-transfer set-up cost (registration, handshake), microseconds."""

    def transfer_ms(self, nbytes: float) -> float:
        """Time to move ``nbytes`` alone on this link: latency + set-up + bytes / bandwidth."""
        return (self.latency_us + self.setup_us) / 1000.0 + nbytes / (self.bandwidth_gbps * 1e9) * 1000.0

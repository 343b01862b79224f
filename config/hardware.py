"""Hardware profile: what one GPU can do, and the few fitted factors that make it match measurements."""

from __future__ import annotations

from pydantic import Field, model_validator

from config.base import Fraction, Frozen, Name, NonNegativeFloat, PositiveFloat, PositiveInt
from config.dtypes import DType


class Efficiency(Frozen):
    """The free parameters of the roofline cost model for one GPU type.

    All are physical: fractions of a peak, or times. ``run_cluster.py calibrate`` fits them on measured
    step times; profiles of GPUs without measurements inherit the values of a similar calibrated GPU
    (said in ``fitted_on``).
    """

    compute: Fraction = 0.6
    """Achieved fraction of peak dense tensor FLOP/s in large GEMMs."""
    memory: Fraction = 0.8
    """Achieved fraction of HBM bandwidth when streaming weights and KV."""
    link: Fraction = 0.7
    """Achieved fraction of the intra-node link bandwidth in an all-reduce of a step up to ``knee_tokens``."""
    link_large: Fraction = 0.15
    """Achieved link fraction for the tokens of a step beyond ``knee_tokens``: large activation tensors
    overflow on-chip buffers and the all-reduce stops overlapping (seen as a knee in measured prefill)."""
    knee_tokens: PositiveInt = 2048
    layer_overhead_us: NonNegativeFloat = 60.0
    """Fixed cost per layer of one engine step (kernel launches, synchronisation), microseconds; a step
    pays it once per layer, so a small model pays less than a large one."""
    seq_layer_overhead_us: NonNegativeFloat = 1.0
    """Cost per sequence per layer of a step (per-sequence attention work that does not scale with
    FLOPs or bytes, sampling), microseconds."""
    allreduce_latency_us: NonNegativeFloat = 10.0
    """Latency of one all-reduce hop (ring step) on the intra-node link."""
    fitted_on: str = "defaults"
    """Where these values come from."""


class HardwareProfile(Frozen):
    """One GPU type. Spec-sheet figures are dense (no structured sparsity), per GPU."""

    name: Name
    source: str = Field(min_length=1, description="one-line note: where the spec figures come from")
    peak_tflops: dict[DType, PositiveFloat]
    """Peak dense tensor TFLOP/s by operand type."""
    hbm_gb: PositiveFloat
    """Device memory, GB (1e9 bytes), as the spec sheet states."""
    hbm_bandwidth_gbps: PositiveFloat
    """Device memory bandwidth, GB/s."""
    intra_node_link_gbps: PositiveFloat
    """Per-GPU, per-direction bandwidth of the GPU-to-GPU link inside a node (NVLink, or PCIe)."""
    intra_node_link: str = "nvlink"
    nic_gbps: PositiveFloat = 50.0
    """Per-GPU network bandwidth to other nodes, GB/s (400 Gb/s = 50 GB/s)."""
    gpus_per_node: PositiveInt = 8
    usd_per_hour: NonNegativeFloat = 0.0
    """Typical on-demand price per GPU-hour, for cost reports."""
    efficiency: Efficiency = Efficiency()
    efficiency_from: Name | None = None
    """Take ``efficiency`` from this calibrated profile (a GPU with no measurements of its own)."""

    @model_validator(mode="after")
    def _has_a_16bit_rate(self) -> HardwareProfile:
        if not ({"bf16", "fp16"} & set(self.peak_tflops)):
            raise ValueError("peak_tflops must give a bf16 or fp16 rate")
        return self

    def tflops(self, dtype: str) -> float:
        """Peak dense TFLOP/s for ``dtype``; a format without its own tensor-core rate runs at 16-bit rate."""
        if dtype in self.peak_tflops:
            return self.peak_tflops[dtype]
        if dtype in ("fp4", "int4") and "fp8" in self.peak_tflops:
            return self.peak_tflops["fp8"]
        return self.peak_tflops.get("bf16") or self.peak_tflops["fp16"]

    @property
    def hbm_bytes(self) -> float:
        return self.hbm_gb * 1e9

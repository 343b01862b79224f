"""Hardware profile: what one GPU can do (datasheet figures), and the fitted efficiencies that make the
cost model's rooflines match the GPU's measured kernel times."""

from __future__ import annotations

import bisect
import math
from collections.abc import Sequence
from typing import Annotated

from pydantic import Field, model_validator

from config.base import Frozen, Name, NonNegativeFloat, PositiveFloat, PositiveInt
from config.dtypes import DType

# Knots of the efficiency curves, in log2 of the op's size (see ``OpFit``). Fixed here so that a preset
# holds only values; the ends clamp (an op smaller or larger than the table's range keeps the end value).
COMPUTE_KNOTS: tuple[float, ...] = tuple(float(x) for x in range(0, 16))
"""log2 of the compute size: tokens of a GEMM (m), tokens per sequence of a prefill attention, sequences
of a decode attention, token-expert pairs a rank computes in a fused MoE: 1 .. 32,768."""
MEMORY_KNOTS: tuple[float, ...] = tuple(float(x) for x in range(10, 34, 2))
"""log2 of the bytes the op moves: 1 KiB .. 8 GiB."""
PARALLEL_KNOTS: tuple[float, ...] = tuple(float(x) for x in range(0, 22, 2))
"""log2 of the op's parallel width (independent output tiles: a GEMM's n, an attention's sequences x
heads, a MoE's touched experts x width): 1 .. 1M. Too few tiles leave SMs idle whatever the size."""
DEPTH_KNOTS: tuple[float, ...] = tuple(float(x) for x in range(4, 18, 2))
"""log2 of a GEMM's reduction depth k: 16 .. 65,536. The size (m) and width (n) curves do not see k, yet the
op tables do: on L40S's bf16 table the size/width-only fit over-predicts k <= 128 by a median 1.17-1.30x and
under-predicts k 1,024-2,048 by 0.92-0.93x (a short k loop finishes each output tile with little more than
its epilogue's write, which streams faster than the bytes curve fitted on weight-bound GEMMs)."""

# Memory efficiency may exceed 1: an operand that fits in L2 (50 MB on H100, 96 MB on L40S) is re-read
# faster than HBM/GDDR streams it.
MemoryEff = Annotated[float, Field(gt=0, le=2.0)]
ComputeEff = Annotated[float, Field(gt=0, le=1.0)]


def interp(x: float, xs: Sequence[float], ys: Sequence[float]) -> float:
    """``numpy.interp`` for one scalar (same formula, same clamped ends), without numpy's per-call cost:
    the cost model evaluates a few efficiency curves per op and op per step, millions of times in
    ``validate``."""
    if x <= xs[0]:
        return float(ys[0])
    if x >= xs[-1]:
        return float(ys[-1])
    j = bisect.bisect_right(xs, x) - 1
    slope = (ys[j + 1] - ys[j]) / (xs[j + 1] - xs[j])
    return float(slope * (x - xs[j]) + ys[j])


class OpFit(Frozen):
    """One op family's roofline on one GPU, fitted on its measured kernel times.

    ``t = latency + unit x width + (c^p + m^p)^(1/p)`` with ``c = FLOPs / (peak x compute(size))`` and
    ``m = bytes / (bandwidth x memory(bytes))``: a roofline whose corner is rounded by ``p`` (``sharpness``;
    large p is the plain max) and whose efficiencies depend on the op's size, piecewise linear in log2 of
    it (``COMPUTE_KNOTS``, ``MEMORY_KNOTS``). Small-m GEMMs reach a small fraction of the tensor peak and
    small transfers a small fraction of the bandwidth: the curves say how small. An empty ``compute`` means
    the op has no compute term (a collective).
    """

    latency_us: NonNegativeFloat = 3.0
    """Fixed time of one kernel (launch inside a CUDA graph, prologue, tail)."""
    sharpness: Annotated[float, Field(ge=1.0, le=50.0)] = 4.0
    compute: list[ComputeEff] = Field(default_factory=lambda: [0.6] * len(COMPUTE_KNOTS))
    memory: list[MemoryEff] = Field(default_factory=lambda: [0.8] * len(MEMORY_KNOTS))
    parallel: list[ComputeEff] = Field(default_factory=list)
    """Factor on both efficiencies by parallel width (``PARALLEL_KNOTS``); empty: 1."""
    depth: list[Annotated[float, Field(ge=1.0, le=16.0)]] = Field(default_factory=list)
    """Factor on both efficiencies by a GEMM's reduction depth k (``DEPTH_KNOTS``), 1 at the deepest knot and
    non-increasing in k, so that time never falls as k grows (FLOPs grow with k, bytes do not fall); the
    compute efficiency it scales stays <= 1. A decode attention's depth is its (mean) context, each query
    reducing over its sequence's KV (``actors.calibration_tables.CONTEXT_DEPTH_TABLES``). Empty: 1."""
    output_ns: NonNegativeFloat = 0.0
    """Time per output element of a GEMM (``outputs`` = m x n): an epilogue's per-element work (fp8: the
    per-token x per-channel dequantization before the 16-bit write) that the bytes curve, keyed by all the
    op's bytes, does not see when k is short (L40S fp8: the size/width fit runs 1.4-1.6x fast at k <= 128). For a
    fused MoE, the time per routed pair of every rank (``outputs`` = tokens x topk: the sort and the walk over the
    whole routed list, ``actors.calibration_tables.MOE_ROUTED_TABLES``)."""
    m_tiles: list[PositiveInt] = Field(default_factory=list)
    """A GEMM kernel dispatch's m buckets, ascending (``actors.calibration_tables.GEMM_TILE_TABLES``): the GEMM
    runs the config of the smallest bucket >= m, padded to it (past the last bucket, to a multiple of it), and
    costs what that padded m costs (``padded_m``; the fit's FLOPs, bytes and size are at the padded m). Empty: m."""
    moe_block_m: list[PositiveInt] = Field(default_factory=list)
    """A fused MoE's Triton ``BLOCK_SIZE_M`` by token count: ``moe_align_block_size`` pads each expert's pairs to a
    whole block and the kernel computes every padded row, so the FLOPs and size are the padded pairs
    (``moe_work(block_m=...)``; ``actors.calibration_tables.MOE_BLOCK_TABLES``). Block i serves tokens up to
    ``moe_block_tokens[i]``, the last one beyond; without thresholds, two blocks as vLLM's ``get_default_config``
    picks them: the first while the tokens are at most the rank's experts. Empty: the routed pairs."""
    moe_block_tokens: list[PositiveInt] = Field(default_factory=list)
    """Token counts up to which each ``moe_block_m`` block but the last serves (a tuned config's M keys), ascending."""
    unit_ns: NonNegativeFloat = 0.0
    """Time per unit of parallel width (a work tile's fixed cost: a decode attention pays it per sequence
    and KV head whatever its context)."""
    l2_gain: Annotated[float, Field(ge=1.0, le=8.0)] = 1.0
    """How much faster than the memory curve the op table's benchmark read an operand that fits in the GPU's
    L2 (``HardwareProfile.l2_cache_mb``): it replays one op back to back, so the same KV stays in L2 between
    replays. Fitted on the table and applied to its resident rows when the fit's error is reported
    (``ms(l2_resident=True)``); never applied by the cost model, where a step reads each layer's KV once,
    after the other layers have passed through L2."""

    @model_validator(mode="after")
    def _knots(self) -> OpFit:
        if self.compute and len(self.compute) != len(COMPUTE_KNOTS):
            raise ValueError(f"compute needs {len(COMPUTE_KNOTS)} values (one per knot) or none")
        if len(self.memory) != len(MEMORY_KNOTS):
            raise ValueError(f"memory needs {len(MEMORY_KNOTS)} values (one per knot)")
        if self.parallel and len(self.parallel) != len(PARALLEL_KNOTS):
            raise ValueError(f"parallel needs {len(PARALLEL_KNOTS)} values (one per knot) or none")
        if self.depth and len(self.depth) != len(DEPTH_KNOTS):
            raise ValueError(f"depth needs {len(DEPTH_KNOTS)} values (one per knot) or none")
        if self.moe_block_tokens and (len(self.moe_block_tokens) != len(self.moe_block_m) - 1 or any(
                b <= a for a, b in zip(self.moe_block_tokens, self.moe_block_tokens[1:], strict=False))):
            raise ValueError("moe_block_tokens needs one ascending threshold per moe_block_m block but the last")
        if self.moe_block_m and not self.moe_block_tokens and len(self.moe_block_m) != 2:
            raise ValueError("moe_block_m without moe_block_tokens needs 2 values (tokens <= local experts, more)")
        if any(b <= a for a, b in zip(self.m_tiles, self.m_tiles[1:], strict=False)):
            raise ValueError("m_tiles must be strictly ascending")
        if any(b > a for a, b in zip(self.depth, self.depth[1:], strict=False)):
            raise ValueError("depth must not increase with k (time would fall as k grows)")
        return self

    def padded_m(self, m: float) -> float:
        """A GEMM's m as its kernel runs it: the smallest bucket of ``m_tiles`` >= m, past the last a multiple
        of the last (unchanged without buckets or at m <= 0)."""
        if not self.m_tiles or m <= 0:
            return m
        i = bisect.bisect_left(self.m_tiles, m)
        last = self.m_tiles[-1]
        if i < len(self.m_tiles):
            return float(self.m_tiles[i])
        return float((math.ceil(m / last) + (1 if m % last else 0)) * last)

    def compute_eff(self, size: float) -> float:
        return interp(math.log2(max(size, 1.0)), COMPUTE_KNOTS, self.compute)

    def memory_eff(self, nbytes: float) -> float:
        return interp(math.log2(max(nbytes, 1.0)), MEMORY_KNOTS, self.memory)

    def parallel_eff(self, width: float) -> float:
        if not self.parallel:
            return 1.0
        return interp(math.log2(max(width, 1.0)), PARALLEL_KNOTS, self.parallel)

    def depth_eff(self, k: float) -> float:
        if not self.depth:
            return 1.0
        return interp(math.log2(max(k, 1.0)), DEPTH_KNOTS, self.depth)

    def ms(self, flops: float, nbytes: float, size: float, flops_per_ms: float, bytes_per_ms: float,
           width: float = 1.0, l2_resident: bool = False, depth: float = 0.0, outputs: float = 0.0) -> float:
        """Time of one op, ms: ``flops`` at ``flops_per_ms`` peak, ``nbytes`` at ``bytes_per_ms`` peak
        (``l2_gain`` times that for an op table's L2-resident replay); a GEMM's k (``depth``) and m x n
        (``outputs``), 0 for other ops."""
        if l2_resident:
            bytes_per_ms *= self.l2_gain
        par = self.parallel_eff(width)
        dep = self.depth_eff(depth) if depth > 0 else 1.0
        fixed = self.latency_us / 1e3 + self.unit_ns * width / 1e6 + self.output_ns * outputs / 1e6
        m = nbytes / (bytes_per_ms * self.memory_eff(nbytes) * par * dep)
        if not self.compute or flops <= 0:
            return fixed + m
        c = flops / (flops_per_ms * min(1.0, self.compute_eff(size) * dep) * par)
        p = self.sharpness
        top = max(c, m)
        return fixed + top * ((c / top) ** p + (m / top) ** p) ** (1.0 / p)


def _default_allreduce() -> dict[int, OpFit]:
    return {2: OpFit(latency_us=8.0, compute=[], memory=[0.5] * len(MEMORY_KNOTS))}


class Efficiency(Frozen):
    """The fitted side of a hardware profile: one ``OpFit`` per op family, and the step overheads.

    ``run_cluster.py calibrate --write`` fits the op families on the aiconfigurator op tables of vLLM's
    kernels (CUDA-graph replays). A GPU without tables inherits the values of the closest calibrated
    part of its architecture family (``HardwareProfile.efficiency_from``), said in ``fitted_on``. The
    overheads are not in any op table: their defaults come from BLIS's published H100 fit (see the cost
    model's module docstring).
    """

    gemm: OpFit = OpFit()
    """16-bit GEMMs (bf16/fp16 operands, fp32 accumulate)."""
    gemm_fp8: OpFit = OpFit()
    """fp8 GEMMs with per-token activation quantization (vLLM's cutlass scaled_mm)."""
    attention_prefill: OpFit = OpFit()
    attention_decode: OpFit = OpFit()
    """Decode attention over a 16-bit KV cache."""
    attention_decode_fp8: OpFit | None = None
    """Decode attention over an fp8 KV cache, fitted on its own rows: the kernels dequantize the cache on the
    fly, so halving the bytes does not halve the time (H200: fp8 rows take 0.89x the bf16 rows' time on
    >= 256 MB of bf16 KV, 0.78x on the rows consistent with H100's, H100 0.66x, B200 0.56x, L40S 0.51x).
    None: ``attention_decode`` at the fp8 bytes."""
    moe: OpFit = OpFit()
    """vLLM's fused MoE (Triton), 16-bit."""
    moe_fp8: OpFit = OpFit()
    allreduce: dict[PositiveInt, OpFit] = Field(default_factory=_default_allreduce)
    """vLLM's custom all-reduce (or NCCL where the part has no NVLink), by GPU count; a TP degree not
    measured takes the nearest one measured."""
    step_overhead_us: NonNegativeFloat = 126.0
    """GPU-visible time per step outside the kernels (input preparation, sampling), BLIS: 126 us."""
    request_overhead_us: NonNegativeFloat = 4.42
    """Per sequence in the step (sampler, detokenizer hand-off), BLIS: 4.42 us."""
    layer_overhead_us: NonNegativeFloat = 32.1
    """Per layer of a step that is not one full CUDA graph (piecewise or eager: attention and its metadata
    run outside the graphs), BLIS: 32.1 us per layer."""
    gemm_fp8_bf16_bound: bool = False
    """The GPU's fp8 GEMM table measured a kernel that loses to its bf16 GEMM on some shapes (B200's, vLLM
    0.19: ``actors.calibration.FP8_GEMM_BF16_BOUND``): an fp8 GEMM then takes the faster of the ``gemm_fp8``
    fit and the ``gemm`` fit at 16-bit bytes and rate, as a deployment does not serve fp8 where it loses."""
    fitted_on: str = "defaults"
    """Where these values come from."""

    def decode_attention(self, kv_dtype: str) -> OpFit:
        """The decode-attention fit for a KV cache of ``kv_dtype``: the fp8 one where fitted."""
        if kv_dtype in ("fp8", "int8") and self.attention_decode_fp8 is not None:
            return self.attention_decode_fp8
        return self.attention_decode

    def allreduce_fit(self, gpus: int) -> OpFit:
        return self.allreduce[min(self.allreduce, key=lambda n: (abs(n - gpus), n))]


class HardwareProfile(Frozen):
    """One GPU type. Datasheet figures are dense (no structured sparsity), per GPU, with a source each."""

    name: Name
    source: str = Field(min_length=1, description="where each datasheet figure comes from")
    peak_tflops: dict[DType, PositiveFloat]
    """Peak dense tensor TFLOP/s by operand type, with fp32 accumulate (as vLLM's GEMMs run)."""
    hbm_gb: PositiveFloat
    """Device memory as the datasheet states it ("GB", which for device memory means GiB: ``hbm_bytes``)."""
    hbm_bandwidth_gbps: PositiveFloat
    """Device memory bandwidth, GB/s."""
    l2_cache_mb: PositiveFloat | None = None
    """On-chip L2 cache, MB (datasheet or architecture whitepaper): an op table's benchmark replays an op whose
    operands fit in it from L2 (``OpFit.l2_gain``); None: not known, no row is taken as resident."""
    intra_node_link_gbps: PositiveFloat
    """Per-GPU, per-direction bandwidth of the GPU-to-GPU link inside a node (NVLink, or PCIe)."""
    intra_node_link: str = "nvlink"
    nic_gbps: PositiveFloat = 50.0
    """Per-GPU network bandwidth to other nodes, GB/s (400 Gb/s = 50 GB/s)."""
    gpus_per_node: PositiveInt = 8
    usd_per_hour: NonNegativeFloat = 0.0
    """Typical on-demand price per GPU-hour, for cost reports."""
    architecture: str = "unknown"
    """Architecture family (ampere, ada, hopper, blackwell): where efficiencies may be borrowed from."""
    efficiency: Efficiency = Efficiency()
    efficiency_from: Name | None = None
    """Take ``efficiency`` from this calibrated profile (a GPU without op tables of its own): the closest
    calibrated part of the same architecture family."""
    allreduce_from: Name | None = None
    """Take the collective fits (``efficiency.allreduce``) from this calibrated profile instead: one with
    the same GPU-to-GPU link (a PCIe part's all-reduce is not an NVLink part's)."""

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
        """Device memory in bytes. NVIDIA's "GB" of device memory are GiB: an "80 GB" H100 reports
        85.9e9 bytes to ``torch.cuda.mem_get_info``, a "24 GB" RTX 4090 25.8e9, which vLLM's KV sizing starts from."""
        return self.hbm_gb * 2**30

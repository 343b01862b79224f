"""Fit the cost model's op rooflines on vLLM's measured kernel times, and report the error.

Data: ``../shared/calibration/aiconfigurator_vllm/data/<gpu>/<op>/<framework>/<version>/*.parquet``,
single ops timed as CUDA-graph replays (vLLM 0.19.0 on H100/H200/B200, 0.22-0.24 on L40S, 0.14 on
A100). For each calibrated GPU and op family (``OP_FAMILIES``) one ``OpFit`` is fitted: a kernel
latency, a corner sharpness and two efficiency curves (compute by op size, memory by bytes), with the
FLOPs and bytes of each row computed by the same functions the cost model uses (``gemm_bytes``,
``moe_work``, the attention formulas below), so a fitted curve means the same thing at fit and at use.
GEMM tables named in ``GEMM_DEPTH_TABLES`` also fit a factor by k (``OpFit.depth``; decode attention in
``CONTEXT_DEPTH_TABLES`` the same factor by context), those in
``GEMM_EPILOGUE_TABLES`` a time per output element (``OpFit.output_ns``; fused MoE in ``MOE_ROUTED_TABLES`` the
same per routed pair; those in ``MOE_BLOCK_TABLES`` compute
the pairs padded to the Triton kernel's blocks, ``OpFit.moe_block_m``); ``actors.calibration_tables`` says why.

The fit minimises the log ratio predicted / measured with a soft-L1 loss over a seeded subsample of
each table (at most ``MAX_FIT_ROWS`` rows); the error is reported on every row. The curves are
parametrised as log-increments bounded so that time never falls as an op grows (see ``_Layout.bounds``).

A table's benchmark replays one op back to back, so an operand that fits in the GPU's L2
(``HardwareProfile.l2_cache_mb``) is re-read from L2: decode-attention rows whose KV fits are marked
resident and the fit gives them one extra factor, ``OpFit.l2_gain`` (L40S: 3.5x), instead of bending the
DRAM curve the cost model uses (on L40S the decode KV's time per byte rose 1.6x past 96 MB).

The Splitwise DGX table (2023 serving stack) stays as a report, in ``actors.splitwise_report``.
"""

from __future__ import annotations

import re
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
from scipy.optimize import least_squares

from actors.calibration_presets import FITTED_FAMILIES as FITTED_FAMILIES  # re-exported
from actors.calibration_presets import write_presets as write_presets
from actors.calibration_routing import moe_table_work
from actors.calibration_tables import (
    BALANCED_ROUTING_TABLES,
    CONTEXT_DEPTH_TABLES,
    EXCLUDED_TABLES,
    FP8_GEMM_BF16_BOUND,
    GEMM_DEPTH_TABLES,
    GEMM_EPILOGUE_TABLES,
    MOE_ROUTED_TABLES,
    SIBLING_GPUS,
    SIBLING_MAX_RATIO,
    m_tiles,
    moe_blocks,
    served_m_tiles,
)
from actors.cost_model import ACTIVATION_BYTES, SCORE_FLOPS, gemm_bytes
from config.catalog import Catalog
from config.hardware import COMPUTE_KNOTS, DEPTH_KNOTS, MEMORY_KNOTS, PARALLEL_KNOTS, Efficiency, HardwareProfile, OpFit

REPO_ROOT = Path(__file__).resolve().parents[1]
OP_DATA = REPO_ROOT.parent / "shared" / "calibration" / "aiconfigurator_vllm" / "data"

# Our presets -> the op tables' GPU folders.
OP_TABLE_GPUS = {"h100-80g-sxm": "h100_sxm", "h200-141g-sxm": "h200_sxm", "b200-180g-sxm": "b200_sxm",
                 "l40s-48g": "l40s", "a100-80g-sxm": "a100_sxm"}
MAX_FIT_ROWS = 20_000
SEED = 12


@dataclass(frozen=True)
class OpSamples:
    """Measured rows of one op family on one GPU, as the roofline sees them."""

    family: str
    source: str
    flops: np.ndarray
    nbytes: np.ndarray
    size: np.ndarray
    measured_ms: np.ndarray
    flops_per_ms: float
    bytes_per_ms: float
    width: np.ndarray | None = None
    """Parallel width per row (``PARALLEL_KNOTS``); None: the family has no width curve."""
    l2_resident: np.ndarray | None = None
    """Rows whose replayed operand fits in the GPU's L2 (``OpFit.l2_gain``); None: none is."""
    depth: np.ndarray | None = None
    """A GEMM's reduction depth k per row (``DEPTH_KNOTS``); None: the family has no depth curve."""
    outputs: np.ndarray | None = None
    """A GEMM's output elements m x n per row (``OpFit.output_ns``); None: no per-output term."""

    def __len__(self) -> int:
        return len(self.measured_ms)

    def take(self, idx: np.ndarray) -> OpSamples:
        """The rows ``idx`` (a mask or indices) of every per-row array."""
        return OpSamples(self.family, self.source, self.flops[idx], self.nbytes[idx], self.size[idx],
                         self.measured_ms[idx], self.flops_per_ms, self.bytes_per_ms,
                         None if self.width is None else self.width[idx],
                         None if self.l2_resident is None else self.l2_resident[idx],
                         None if self.depth is None else self.depth[idx],
                         None if self.outputs is None else self.outputs[idx])


def _latest(folder: Path) -> Path | None:
    """The highest-version subfolder (``0.24.0`` over ``0.22.0``) of ``folder``, or None."""
    if not folder.is_dir():
        return None
    versions = [p for p in folder.iterdir() if p.is_dir()]
    if not versions:
        return None

    def key(p: Path) -> tuple[int, ...]:
        return tuple(int(x) if x.isdigit() else -1 for x in re.split(r"[.\-]", p.name))

    return max(versions, key=key)


def _table(path: Path | None, name: str) -> dict[str, np.ndarray] | None:
    if path is None or not (path / name).exists():
        return None
    t = pq.read_table(path / name)
    return {c: np.asarray(t.column(c).to_numpy(zero_copy_only=False)) for c in t.column_names}


def _where(t: dict[str, np.ndarray], mask: np.ndarray) -> dict[str, np.ndarray]:
    return {k: v[mask] for k, v in t.items()}


def _samples(family: str, source: str, flops: np.ndarray, nbytes: np.ndarray, size: np.ndarray,
             t: dict[str, np.ndarray], flops_per_ms: float, bytes_per_ms: float,
             width: np.ndarray | None = None, l2_resident: np.ndarray | None = None,
             depth: np.ndarray | None = None, outputs: np.ndarray | None = None) -> OpSamples | None:
    lat = t["latency"].astype(float)
    # A row faster than the datasheet allows (FLOPs above the tensor peak, or bytes above twice the
    # bandwidth, an L2-resident operand's most) measured something else: it is left out and counted.
    ok = (lat > 0) & (flops / np.maximum(lat, 1e-12) <= flops_per_ms) & (nbytes / np.maximum(lat, 1e-12)
                                                                         <= 2.0 * bytes_per_ms)
    if not np.any(ok):
        return None
    dropped = int(np.sum(~ok))
    if dropped:
        source = f"{source} ({dropped} rows above the datasheet's peak left out)"
    return OpSamples(family, source, flops[ok].astype(float), nbytes[ok].astype(float), size[ok].astype(float),
                     lat[ok], flops_per_ms, bytes_per_ms, None if width is None else width[ok].astype(float),
                     None if l2_resident is None else l2_resident[ok],
                     None if depth is None else depth[ok].astype(float),
                     None if outputs is None else outputs[ok].astype(float))


def _gemm(root: Path, hw: HardwareProfile, dtype: str, family: str, served: bool) -> OpSamples | None:
    """GEMM rows at m as the fit reads them (``served`` False: ``GEMM_TILE_TABLES``' buckets) or as the cost model
    serves them (True: ``GEMM_TILE_SERVED``'s), which is what every reported error uses."""
    ver = _latest(root / "gemm" / "vllm")
    t = _table(ver, "gemm_perf.parquet")
    if t is None:
        return None
    t = _where(t, t["gemm_dtype"] == dtype)
    tiles = OpFit(m_tiles=(served_m_tiles if served else m_tiles)(hw.name, family))
    m, n, k = np.array([tiles.padded_m(x) for x in t["m"]], dtype=float), t["n"].astype(float), t["k"].astype(float)
    wb, peak = (1.0, hw.tflops("fp8")) if dtype == "fp8" else (2.0, hw.tflops("bf16"))
    return _samples(family, f"gemm {dtype} vLLM {ver.name if ver else '?'}", 2 * m * n * k, gemm_bytes(m, n, k, wb),
                    m, t, peak * 1e9, hw.hbm_bandwidth_gbps * 1e6, width=n,
                    depth=k if (hw.name, family) in GEMM_DEPTH_TABLES else None,
                    outputs=m * n if (hw.name, family) in GEMM_EPILOGUE_TABLES else None)


def _gemm_times(gpu_dir: Path, min_nk: int = 0) -> dict[str, dict[tuple[int, int, int], float]]:
    """The GEMM table's times by dtype and (m, n, k), shapes with n and k >= ``min_nk``; empty without one."""
    t = _table(_latest(gpu_dir / "gemm" / "vllm"), "gemm_perf.parquet")
    times: dict[str, dict[tuple[int, int, int], float]] = defaultdict(dict)
    if t is not None:
        for dt, m, n, k, lat in zip(t["gemm_dtype"], t["m"], t["n"], t["k"], t["latency"], strict=True):
            if n >= min_nk and k >= min_nk:
                times[str(dt)][(int(m), int(n), int(k))] = float(lat)
    return times


ATTENTION_KEY = ("batch_size", "isl", "step", "num_heads", "num_key_value_heads", "head_dim", "kv_cache_dtype")


def _no_slower_than_sibling(t: dict[str, np.ndarray], sibling_root: Path, name: str) -> np.ndarray:
    """Mask of the rows of ``t`` (an attention table) within ``SIBLING_MAX_RATIO`` of the same shape's time in
    the sibling GPU's table (a shape it lacks passes)."""
    s = _table(_latest(sibling_root / "attention" / "vllm"), name)
    if s is None:
        return np.ones(len(t["latency"]), dtype=bool)
    cols = [c for c in ATTENTION_KEY if c in s and c in t]
    ref = dict(zip(zip(*(s[c].tolist() for c in cols), strict=True), s["latency"].tolist(), strict=True))
    keys = zip(*(t[c].tolist() for c in cols), strict=True)
    return np.array([lat <= SIBLING_MAX_RATIO * ref.get(key, np.inf)
                     for key, lat in zip(keys, t["latency"].tolist(), strict=True)], dtype=bool)


def _attention(root: Path, hw: HardwareProfile, prefill: bool, kv_dtype: str = "bfloat16") -> OpSamples | None:
    """Attention rows with a ``kv_dtype`` cache (``bfloat16`` or ``fp8``), full (no sliding window); for a GPU
    in ``SIBLING_GPUS``, decode rows slower than its sibling's on the same shape are left out and counted."""
    ver = _latest(root / "attention" / "vllm")
    name = "context_attention_perf.parquet" if prefill else "generation_attention_perf.parquet"
    t = _table(ver, name)
    if t is None:
        return None
    mask = t["kv_cache_dtype"] == kv_dtype
    if "window_size" in t:
        mask &= t["window_size"] == 0
    sibling = SIBLING_GPUS.get(hw.name)
    left_out = 0
    if sibling is not None and not prefill:
        ok = _no_slower_than_sibling(t, root.parent / OP_TABLE_GPUS[sibling[0]], name)
        left_out = int(np.sum(mask & ~ok))
        mask &= ok
    if not np.any(mask):
        return None
    t = _where(t, mask)
    b, h, kvh, d = (t[c].astype(float) for c in ("batch_size", "num_heads", "num_key_value_heads", "head_dim"))
    kv_bytes = 2 * kvh * d * (1 if kv_dtype == "fp8" else ACTIVATION_BYTES)  # per token, one layer
    resident = None
    if prefill:
        s = t["isl"].astype(float)
        flops = (4 * d + SCORE_FLOPS) * h * b * s * (s + 1) / 2
        nbytes = b * s * kv_bytes + 2 * b * s * h * d * ACTIVATION_BYTES
        size = s
        width = b * h
    else:
        ctx = t["isl"].astype(float) + t["step"].astype(float)  # the step-th generated token sees isl + step
        flops = (4 * d + SCORE_FLOPS) * h * b * ctx
        nbytes = b * ctx * kv_bytes + 2 * b * h * d * ACTIVATION_BYTES
        size = b
        width = b * kvh
        if hw.l2_cache_mb is not None:  # the benchmark's replays re-read a KV that fits in L2 from L2
            resident = b * ctx * kv_bytes <= hw.l2_cache_mb * 1e6
    family = ("attention_prefill" if prefill else "attention_decode") + ("_fp8" if kv_dtype == "fp8" else "")
    note = f" ({left_out} rows slower than {sibling[0]}'s left out)" if sibling and left_out else ""
    depth = ctx if not prefill and (hw.name, family) in CONTEXT_DEPTH_TABLES else None  # a decode reduces over ctx
    return _samples(family, f"{family} vLLM {ver.name if ver else '?'}{note}", flops, nbytes, size, t,
                    hw.tflops("bf16") * 1e9, hw.hbm_bandwidth_gbps * 1e6, width=width, l2_resident=resident,
                    depth=depth)


def _moe(root: Path, hw: HardwareProfile, dtype: str, family: str) -> OpSamples | None:
    ver = _latest(root / "moe" / "vllm")
    t = _table(ver, "moe_perf.parquet")
    if t is None:
        return None
    # vLLM's Triton fused MoE (named per quantization method from 0.22 on); "balanced" routing, or the mildest
    # power law where a table has no balanced rows (A100's), predicted with the work of the routing it measured on
    # the timed rank (``actors.calibration_routing``; balanced rows where ``BALANCED_ROUTING_TABLES`` says).
    triton = np.array(["fused_moe" in k or "tritonexperts" in k for k in t["kernel_source"]], dtype=bool)
    dist = "balanced" if np.any(t["distribution"] == "balanced") else "power_law_1.01"
    t = _where(t, (t["moe_dtype"] == dtype) & (t["distribution"] == dist) & triton)
    wb, peak = (1.0, hw.tflops("fp8")) if dtype == "fp8" else (2.0, hw.tflops("bf16"))
    blocks = moe_blocks(hw.name, family)
    work = moe_table_work(t, dist, wb, exact_balanced=(hw.name, family) in BALANCED_ROUTING_TABLES,
                          block_m=blocks["moe_block_m"], block_tokens=blocks["moe_block_tokens"])
    return _samples(family, f"moe {dtype} {dist} vLLM {ver.name if ver else '?'}", work[:, 0], work[:, 1], work[:, 2],
                    t, peak * 1e9, hw.hbm_bandwidth_gbps * 1e6, width=work[:, 3],
                    outputs=t["num_tokens"] * t["topk"] if (hw.name, family) in MOE_ROUTED_TABLES else None)


def _allreduce(root: Path, hw: HardwareProfile) -> dict[int, OpSamples]:
    """vLLM's custom all-reduce in graph mode; NCCL's where it was not measured (PCIe parts)."""
    ver = _latest(root / "comm" / "vllm")
    t = _table(ver, "custom_allreduce_perf.parquet")
    src = f"vLLM custom all-reduce (graph) {ver.name if ver else '?'}"
    if t is not None:
        t = _where(t, t["backend"] == "vllm_graph")
    else:
        ver = _latest(root / "comm" / "nccl")
        t = _table(ver, "nccl_perf.parquet")
        src = f"NCCL all_reduce {ver.name if ver else '?'}"
        if t is None:
            return {}
        t = _where(t, (t["op_name"] == "all_reduce") & (t["nccl_dtype"] == "half"))
    out = {}
    for n in sorted(set(int(x) for x in t["num_gpus"])):
        sub = _where(t, t["num_gpus"] == n)
        nbytes = sub["message_size"].astype(float) * ACTIVATION_BYTES  # message_size counts 16-bit elements
        s = _samples(f"allreduce_{n}", f"{src}, {n} GPUs", np.zeros_like(nbytes), nbytes, nbytes, sub, 1.0,
                     hw.intra_node_link_gbps * 1e6)
        if s is not None:
            out[n] = s
    return out


FP8_SPEEDUP_RANGES: dict[str, tuple[int, int]] = {"m<=16": (1, 16), "m 64-256": (64, 256), "m>=1024": (1024, 1 << 30)}
"""Token ranges (GEMM m) over which ``fp8_gemm_speedup`` reports: decode-sized, mid, prefill-sized."""


def fp8_gemm_speedup(gpu_dir: Path) -> dict[str, float]:
    """Median time ratio 16-bit / fp8 of the GEMM table's shapes measured in both (n and k >= 1024), per
    ``FP8_SPEEDUP_RANGES``; empty without both dtypes.

    A diagnostic of the table, not a fit: with half the bytes and twice the tensor rate a tuned fp8 kernel
    runs faster than the bf16 one on the same shape (H100 1.21-1.56x, L40S 1.39-1.76x). B200's vLLM 0.19
    table runs its fp8 GEMMs no faster (0.83x at m >= 1024): the cost model bounds its fp8 GEMMs by its bf16
    ones (``FP8_GEMM_BF16_BOUND``).
    """
    times = _gemm_times(gpu_dir, min_nk=1024)
    b16, fp8 = times.get("bfloat16", {}), times.get("fp8", {})
    out = {}
    for name, (lo, hi) in FP8_SPEEDUP_RANGES.items():
        ratios = [b16[key] / lat for key, lat in fp8.items() if lo <= key[0] <= hi and key in b16 and lat > 0]
        if ratios:
            out[name] = round(float(np.median(ratios)), 3)
    return out


def load_op_tables(hw: HardwareProfile, gpu_dir: Path, served: bool = True) -> dict[str, OpSamples]:
    """Every op family's samples for ``hw`` from its table folder (families without a table are absent).
    ``served`` False: GEMM rows at the m the fit reads (``_gemm``); errors are always taken on the served rows."""
    loaders: dict[str, Callable[[], OpSamples | None]] = {
        "gemm": lambda: _gemm(gpu_dir, hw, "bfloat16", "gemm", served),
        "gemm_fp8": lambda: _gemm(gpu_dir, hw, "fp8", "gemm_fp8", served),
        "attention_prefill": lambda: _attention(gpu_dir, hw, True),
        "attention_decode": lambda: _attention(gpu_dir, hw, False),
        "attention_decode_fp8": lambda: _attention(gpu_dir, hw, False, "fp8"),
        "moe": lambda: _moe(gpu_dir, hw, "bfloat16", "moe"),
        "moe_fp8": lambda: _moe(gpu_dir, hw, "fp8", "moe_fp8"),
    }
    out = {}
    for fam, load in loaders.items():
        s = load()
        if s is not None:
            out[fam] = s
    for n, s in _allreduce(gpu_dir, hw).items():
        out[f"allreduce_{n}"] = s
    return out


# -- the fit ------------------------------------------------------------------------------------------
NC, NM, NP = len(COMPUTE_KNOTS), len(MEMORY_KNOTS), len(PARALLEL_KNOTS)
# Time = work / (eff(size) x par(width)) with work growing at least as fast as size and width, and each
# curve linear in log2 between knots. It stays non-decreasing while the slopes' relative growth per log2
# unit sums to at most ln 2: compute knots are 1 apart, memory and parallel knots 2, so
# (r_c - 1) + (r_p - 1) / 2 <= ln 2 and (r_m - 1) / 2 + (r_p - 1) / 2 <= ln 2 for the per-knot ratios r.
MAX_COMPUTE_STEP = float(np.log(1.5))
MAX_MEMORY_STEP = float(np.log(2.05))
MAX_PARALLEL_STEP = float(np.log(1.3))
# The depth factor d(k) never grows with k (log-steps >= 0 towards shallower k), at most 1.5x per knot (2 log2 units).
MAX_DEPTH_STEP = float(np.log(1.5))
ND = len(DEPTH_KNOTS)


@dataclass(frozen=True)
class _Layout:
    """Where each curve sits in the parameter vector: [latency, sharpness, compute.., memory.., parallel..]."""

    compute: bool
    parallel: bool
    l2: bool = False
    """The samples have L2-resident rows: one more parameter, log ``l2_gain``, last."""
    depth: bool = False
    epilogue: bool = False
    """One more parameter after the depth curve: ``output_ns``."""
    """The samples have a GEMM's k: a depth curve (``ND`` log-steps, the deepest knot's a dummy) after memory."""

    def split(self, theta: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        i = 2
        comp = np.clip(np.exp(np.cumsum(theta[i:i + NC])), 1e-4, 1.0) if self.compute else np.zeros(0)
        i += NC if self.compute else 0
        mem = np.clip(np.exp(np.cumsum(theta[i:i + NM])), 1e-4, 2.0)
        i += NM + (ND if self.depth else 0) + (1 if self.epilogue else 0)
        # The parallel factor is normalised to 1 at its widest knot (it only says how much less a narrow op gets).
        par = np.exp(np.cumsum(theta[i:i + NP]) - np.sum(theta[i + 1:i + NP])) if self.parallel else np.zeros(0)
        return comp, mem, np.clip(par, 1e-4, 1.0) if self.parallel else par

    def output_ns(self, theta: np.ndarray) -> float:
        return float(theta[self.curves_end + (ND if self.depth else 0)]) if self.epilogue else 0.0

    def unit_ns(self, theta: np.ndarray) -> float:
        """The per-width-unit time, the parameter after the curves when the family has a width."""
        return float(theta[-2 if self.l2 else -1]) if self.parallel else 0.0

    def l2_gain(self, theta: np.ndarray) -> float:
        return float(np.exp(theta[-1])) if self.l2 else 1.0

    def depth_curve(self, theta: np.ndarray) -> np.ndarray:
        """d(k) at ``DEPTH_KNOTS``, 1 at the deepest; step j is log d(knot j-1) / d(knot j), step 0 pinned to 0."""
        steps = theta[self.curves_end:self.curves_end + ND] if self.depth else np.zeros(0)
        return np.clip(np.exp(np.cumsum(steps[::-1])[::-1] - steps), 1.0, 16.0)

    @property
    def curves_end(self) -> int:
        """Index after latency, sharpness, the compute and the memory curve (where depth and parallel go)."""
        return 2 + (NC if self.compute else 0) + NM

    def bounds(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        lo, hi, x0 = [0.0, 1.0], [500.0, 50.0], [3.0, 4.0]
        if self.compute:
            lo += [np.log(1e-4)] + [-3.0] * (NC - 1)
            hi += [0.0] + [MAX_COMPUTE_STEP] * (NC - 1)
            x0 += [np.log(0.05)] + [0.3] * (NC - 1)
        lo += [np.log(1e-4)] + [-3.0] * (NM - 1)
        hi += [np.log(2.0)] + [MAX_MEMORY_STEP] * (NM - 1)
        x0 += [np.log(0.01)] + [0.5] * (NM - 1)
        if self.depth:
            lo += [0.0] * ND
            hi += [1e-9] + [MAX_DEPTH_STEP] * (ND - 1)
            x0 += [0.0] * ND
        if self.epilogue:
            lo, hi, x0 = [*lo, 0.0], [*hi, 100.0], [*x0, 0.0]
        if self.parallel:
            lo += [0.0] + [0.0] * (NP - 1)  # the first value is the normalisation's dummy; factors only grow
            hi += [1e-9] + [MAX_PARALLEL_STEP] * (NP - 1)
            x0 += [0.0] + [0.0] * (NP - 1)
            lo, hi, x0 = [*lo, 0.0], [*hi, 1e4], [*x0, 0.0]  # unit_ns
        if self.l2:
            lo, hi, x0 = [*lo, 0.0], [*hi, float(np.log(8.0))], [*x0, float(np.log(2.0))]  # log l2_gain
        return np.array(lo), np.array(hi), np.clip(np.array(x0), lo, hi)


def _predict(theta: np.ndarray, s: OpSamples, lay: _Layout) -> np.ndarray:
    comp, mem, par = lay.split(theta)
    p_eff = np.interp(np.log2(np.maximum(s.width, 1.0)), PARALLEL_KNOTS, par) \
        if lay.parallel and s.width is not None else 1.0
    fixed = theta[0] / 1e3 + (lay.unit_ns(theta) * s.width / 1e6 if lay.parallel and s.width is not None else 0.0)
    if lay.epilogue and s.outputs is not None:
        fixed = fixed + lay.output_ns(theta) * s.outputs / 1e6
    bw = s.bytes_per_ms * (np.where(s.l2_resident, lay.l2_gain(theta), 1.0)
                           if lay.l2 and s.l2_resident is not None else 1.0)
    d_eff = np.interp(np.log2(np.maximum(s.depth, 1.0)), DEPTH_KNOTS, lay.depth_curve(theta)) \
        if lay.depth and s.depth is not None else 1.0
    m = s.nbytes / (bw * np.interp(np.log2(np.maximum(s.nbytes, 1.0)), MEMORY_KNOTS, mem) * p_eff * d_eff)
    if not lay.compute:
        return fixed + m
    c_eff = np.minimum(1.0, np.interp(np.log2(np.maximum(s.size, 1.0)), COMPUTE_KNOTS, comp) * d_eff)
    c = s.flops / (s.flops_per_ms * c_eff * p_eff)
    top = np.maximum(c, m)
    p = theta[1]
    return fixed + top * ((c / top) ** p + (m / top) ** p) ** (1.0 / p)


def fit_op(s: OpSamples) -> OpFit:
    """One family's ``OpFit`` on its samples (seeded subsample of at most ``MAX_FIT_ROWS``)."""
    lay = _Layout(compute=bool(np.any(s.flops > 0)), parallel=s.width is not None,
                  l2=s.l2_resident is not None and bool(np.any(s.l2_resident)), depth=s.depth is not None,
                  epilogue=s.outputs is not None)
    rng = np.random.default_rng(SEED)
    idx = rng.choice(len(s), MAX_FIT_ROWS, replace=False) if len(s) > MAX_FIT_ROWS else np.arange(len(s))
    sub = s.take(idx)
    # Two stages: without the depth and parallel curves, then with them starting flat (1 everywhere) from the
    # first stage's solution, so the width and depth can only improve on the size-only fit.
    first = _Layout(lay.compute, parallel=False, l2=lay.l2)
    lo, hi, x0 = first.bounds()
    res = least_squares(lambda th: np.log(_predict(th, sub, first) / sub.measured_ms), x0, bounds=(lo, hi),
                        loss="soft_l1", f_scale=0.05, max_nfev=500, tr_solver="lsmr")
    if lay.parallel or lay.depth or lay.epilogue:
        lo, hi, _ = lay.bounds()
        end = first.curves_end
        extra = (ND if lay.depth else 0) + (1 if lay.epilogue else 0) + (NP + 1 if lay.parallel else 0)
        x1 = np.clip(np.concatenate([res.x[:end], np.zeros(extra), res.x[end:]]), lo, hi)
        res = least_squares(lambda th: np.log(_predict(th, sub, lay) / sub.measured_ms), x1, bounds=(lo, hi),
                            loss="soft_l1", f_scale=0.05, max_nfev=500, tr_solver="lsmr")
    comp, mem, par = lay.split(res.x)
    return OpFit(latency_us=_r(res.x[0]), sharpness=_r(res.x[1]), compute=[_r(x) for x in comp],
                 memory=[_r(x) for x in mem], parallel=[_r(x) for x in par], unit_ns=_r(lay.unit_ns(res.x)),
                 depth=[_r(x) for x in lay.depth_curve(res.x)], output_ns=_r(lay.output_ns(res.x)),
                 l2_gain=_r(lay.l2_gain(res.x)))


def _r(x: float) -> float:
    return float(f"{float(x):.4g}")


def predict_op(fit: OpFit, s: OpSamples) -> np.ndarray:
    """The fitted op's time on every sample, through ``OpFit.ms`` (what the cost model calls)."""
    width = s.width if s.width is not None else np.ones_like(s.flops)
    resident = s.l2_resident if s.l2_resident is not None else np.zeros(len(s), dtype=bool)
    depth = s.depth if s.depth is not None else np.zeros(len(s))
    outs = s.outputs if s.outputs is not None else np.zeros(len(s))
    return np.array([fit.ms(f, b, z, s.flops_per_ms, s.bytes_per_ms, w, bool(r), float(d), float(o)) for
                     f, b, z, w, r, d, o in zip(s.flops, s.nbytes, s.size, width, resident, depth, outs, strict=True)])


@dataclass(frozen=True)
class OpError:
    hardware: str
    family: str
    source: str
    rows: int
    median: float
    p90: float
    excluded: str = ""
    """Why this table is not fitted (``EXCLUDED_TABLES``); its error is then that of the borrowed fit."""

    def within(self, median: float) -> bool:
        return bool(self.excluded) or self.median <= median


def op_error(hardware: str, fit: OpFit, s: OpSamples) -> OpError:
    ape = np.abs(predict_op(fit, s) / s.measured_ms - 1.0)
    excluded = EXCLUDED_TABLES.get((hardware, s.family), ("", ""))[1]
    return OpError(hardware, s.family, s.source, len(s), float(np.median(ape)), float(np.percentile(ape, 90)),
                   excluded)


@dataclass(frozen=True)
class OpFitResult:
    hardware: str
    efficiency: Efficiency
    errors: list[OpError]


def _family_fit(eff: Efficiency, family: str) -> OpFit:
    if family.startswith("allreduce_"):
        return eff.allreduce_fit(int(family.split("_")[1]))
    if family == "attention_decode_fp8":
        return eff.decode_attention("fp8")
    fit: OpFit = getattr(eff, family)
    return fit


def fit_hardware_ops(cat: Catalog, hw_name: str, data: Path = OP_DATA,
                     fitted: dict[str, Efficiency] | None = None) -> OpFitResult:
    """Fit every op family measured for ``hw_name``; families without a table keep the preset's fit
    (fp8 GEMM/MoE fall back to the 16-bit fit on a part with no fp8 tensor cores); an excluded table
    (``EXCLUDED_TABLES``) takes the named GPU's fit, from ``fitted`` (this run's) or the presets."""
    hw = cat.hardware.get(hw_name)
    gpu_dir = data / OP_TABLE_GPUS[hw_name]
    samples = load_op_tables(hw, gpu_dir, served=False)
    if not samples:
        raise ValueError(f"no op tables for {hw_name} under {gpu_dir}")
    fits = {}
    for fam, s in samples.items():
        if (hw_name, fam) in EXCLUDED_TABLES:
            src = EXCLUDED_TABLES[(hw_name, fam)][0]
            fits[fam] = _family_fit((fitted or {}).get(src) or cat.hardware.get(src).efficiency, fam)
        else:
            fits[fam] = fit_op(s).model_copy(update={"m_tiles": served_m_tiles(hw_name, fam),
                                                        **moe_blocks(hw_name, fam)})
    base = hw.efficiency
    upd: dict[str, object] = {fam: fits[fam] for fam in FITTED_FAMILIES if fam in fits}
    for fp8, b16 in (("gemm_fp8", "gemm"), ("moe_fp8", "moe")):
        if fp8 not in upd and b16 in upd:
            upd[fp8] = upd[b16]
    allreduce = {int(f.split("_")[1]): fit for f, fit in fits.items() if f.startswith("allreduce_")}
    if allreduce:
        upd["allreduce"] = allreduce
    versions = sorted({m.group(0) for fam, s in samples.items() if not fam.startswith("allreduce")
                       for m in [re.search(r"\d+\.\d+\.\d+", s.source)] if m})
    upd["gemm_fp8_bf16_bound"] = hw_name in FP8_GEMM_BF16_BOUND
    upd["fitted_on"] = f"aiconfigurator_vllm op tables, {OP_TABLE_GPUS[hw_name]} ({', '.join(versions)})"
    eff = base.model_copy(update=upd)
    served = load_op_tables(hw, gpu_dir)  # the error of what the cost model serves, not of the fit's reading
    errors = [op_error(hw_name, _family_fit(eff, fam), s) for fam, s in served.items()]
    return OpFitResult(hw_name, eff, errors)


def current_op_errors(cat: Catalog, hw_name: str, data: Path = OP_DATA) -> list[OpError]:
    """Errors of the efficiencies now in the presets on ``hw_name``'s op tables (no fitting)."""
    hw = cat.hardware.get(hw_name)
    samples = load_op_tables(hw, data / OP_TABLE_GPUS[hw_name])
    return [op_error(hw_name, _family_fit(hw.efficiency, fam), s) for fam, s in samples.items()]

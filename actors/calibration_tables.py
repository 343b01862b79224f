"""Which op tables the calibration treats specially, and why: each entry names its (GPU, family) and the
measurement that sets it apart (``actors.calibration`` reads these registries; calibrate prints them)."""

from __future__ import annotations

EXCLUDED_TABLES: dict[tuple[str, str], tuple[str, str]] = {
    ("h200-141g-sxm", "attention_prefill"): (
        "h100-80g-sxm", "table inconsistent: from isl 64 up its times scatter from 0.01x to 3x H100's on the same "
                        "shapes (same SMs and clocks), a third above the tensor peak; H100's fit is used"),
}
"""(GPU, family) -> (the GPU whose fit is used instead, why): tables that measured something else."""
SIBLING_GPUS: dict[str, tuple[str, str]] = {
    "h200-141g-sxm": (
        "h100-80g-sxm",
        "the same GH100 die (132 SMs, same clocks) with 1.43x the bandwidth, yet its decode-attention table's "
        "few-KV-head rows at large batch x context take up to 4.6x H100's time on the same shape (1-2 KV "
        "heads: p90 2.4-4.6x; 8 KV heads: p90 1.02x); those rows keep the time of 4 KV heads' work"),
}
"""GPU -> (a sibling GPU no slower on any decode-attention shape, why): rows of the GPU's decode-attention
tables above ``SIBLING_MAX_RATIO`` x the sibling's time on the same shape measured something else."""
SIBLING_MAX_RATIO = 1.25
"""Tolerance of the sibling check: run-to-run spread of a kernel time (p90 of H200/H100 on 8 KV heads: 1.02)."""
FP8_GEMM_BF16_BOUND: dict[str, str] = {
    "b200-180g-sxm":
        "its fp8 GEMM table runs no faster than its bf16 one (time bf16/fp8 0.97x at m <= 16, 1.03x at m 64-256, "
        "0.83x at m >= 1024: fp8_gemm_speedup) where every other fp8 part's is 1.05-1.76x faster, and the "
        "datasheet gives B200 Hopper's 2:1 fp8:bf16 rate. Served B200 fp8 70B runs are faster than this table "
        "allows (validate: TPOT +11%, TTFT +25% bias with the bound; H100's per-shape fp8 gain applied to B200's "
        "bf16 table instead overshoots: TPOT -14%, TTFT -10%); the bound is the part of that which the data "
        "prove: fp8 is never served where it loses to bf16",
}
"""GPU -> why: parts whose fp8 GEMM table measured a kernel that is slower than the same GPU's bf16 GEMM on some
shapes. An fp8 GEMM moves half the bytes at twice the tensor rate, and a deployment does not serve fp8 where it
loses to bf16: both fits stay on their own tables, and the fitted ``Efficiency`` says
``gemm_fp8_bf16_bound``, so the cost model takes the faster of the two per GEMM."""
GEMM_DEPTH_TABLES: dict[tuple[str, str], str] = {
    ("l40s-48g", "gemm"): "median 11.5% -> 9.5%: the size/width fit over-predicts k <= 128 by 1.17-1.30x",
}
"""(GPU, GEMM family) -> why: tables fitted with a depth curve (``OpFit.depth``). On the others it gains < 1 point
(0.0-0.8) and moved validate --quick (70B fp8 H100 TTFT 9.4 -> 11.0%): they keep the size/width fit."""
GEMM_EPILOGUE_TABLES: dict[tuple[str, str], str] = {
    ("l40s-48g", "gemm_fp8"): "k <= 128 ran 1.4-1.6x slower than the size/width fit (k >= 2,048: 0.94-1.0x)",
}
"""(GPU, GEMM family) -> why: tables fitted with a time per output element (``OpFit.output_ns``)."""

GEMM_TILE_TABLES: dict[tuple[str, str], tuple[tuple[int, ...], str]] = {
    ("h100-80g-sxm", "gemm_fp8"): ((16, 64, 128, 256), "as H200's (same die, same kernels, the same unaligned rows): "
                                   "fitted at the raw m the curve ran 1.11x the aligned rows at m 512-4,096 (1.2-1.85x "
                                   "on the 70B TP4/TP8 shapes at m 512-1,024), 1.00x fitted at the padded m; the cost "
                                   "model as served 9.8% -> 9.6%"),
    ("h200-141g-sxm", "gemm_fp8"): ((16, 64, 128, 256), "the cost model as served (this curve at the raw m) 12.7% -> "
                                    "12.1%; read at the padded m, as the fit is, 9.4% (p90 33.7 -> 27.9%)"),
}
"""(GPU, GEMM family) -> (m buckets, why): tables whose kernel dispatch picks a config by m bucket (vLLM's
cutlass_scaled_mm sm90 fp8: m <= 16, <= 64, <= 128, <= 256, larger) and runs m padded to it: the fit reads each of
the table's rows at ``OpFit.padded_m`` of these buckets. Past the last bucket an m that is not a multiple of it pays
one tile more than its padding (the tables' 256j + 1 rows cost about 256(j + 2): H200 fp8 at n = k = 8,192:
t(257) 76.8 us, t(512) 50.5, t(768) 73.2; t(769) 151.6, t(1024) 100.0).

The steps are fitted, not served (``GEMM_TILE_SERVED``): the fit learns the curve of the kernel's own m without the
steps smearing it, and the cost model reads that curve at the served m (the preset's ``OpFit.m_tiles`` stays empty).
``calibrate`` reports the error of what is served (H200 gemm_fp8: 12.1%, over the 10% bound), never the fit's reading
at the padded m (9.4%), which no engine runs.
The table has only m = 256j and 256j + 1 past 256, so the extra tile of any other unaligned m (a prefill chunk of
1,000 tokens would read as 1,280) is not pinned, and serving the steps moved validate --quick by more than a point:
- H200 served with every step: Llama-3.1-70B fp8 H200 TTFT 5.8 -> 4.1%, TPOT 4.7 -> 5.9%; Llama-3.1-8B-FP8 H200 TTFT
  34.1 -> 38.4%, TPOT 149.9 -> 157.1%; served with the buckets <= 256 only: 70B TPOT 4.7 -> 5.8%.
- H200 fitted, not served (as registered): 70B fp8 H200 TTFT 5.8 -> 4.7%, TPOT 4.7 -> 4.8%; Qwen3-235B-FP8 H200
  TTFT 7.0 -> 6.9%, TPOT 36.9 -> 37.2%; 8B-FP8 H200 TTFT 34.1 -> 32.3%, TPOT 149.9 -> 143.3%.
- H100 served with every step (not registered): gemm_fp8 median 9.8% -> 7.8%; 70B fp8 H100 TTFT (quick) 9.4 -> 15.6%.
- H100 fitted, not served (registered, as H200): on the 45 Llama-3.1-70B fp8 H100 rows (``validate --match``) TTFT
  median |error| 30.7 -> 22.8% (p90 60.2 -> 49.9%, bias +26.7 -> +19.1%), TPOT 13.2 -> 14.3% (its decode-sized
  GEMMs read 3-6% over the table before, 2-5% after; the TPOT gap is elsewhere). Fitted at the raw m, the H100
  curve spread the unaligned rows' extra tile over every m: on the 42 (TP, lengths, C) points both parts measured,
  the replay's TTFT ran a median 1.153x H200's, now 1.079x, where the measured runs' ratio is 0.966 (same die,
  compute-bound prefill).

Only Hopper's fp8 tables have the step (median t(256j + 1) / t(256j) at m 512-4,096, n and k >= 1,024: H100 1.22,
H200 1.25; their bf16 tables 1.01 and 1.00; B200 fp8 1.02, L40S fp8 1.03): vLLM 0.19's sm90 cutlass fp8 dispatch."""
GEMM_TILE_SERVED: frozenset[tuple[str, str]] = frozenset()
"""(GPU, GEMM family) of ``GEMM_TILE_TABLES`` whose cost model runs its GEMMs at the padded m (``OpFit.m_tiles`` in the
preset): none yet, see ``GEMM_TILE_TABLES``."""


def m_tiles(hardware: str, family: str) -> list[int]:
    """The m buckets fitted on (hardware, family)'s table (``GEMM_TILE_TABLES``); empty where none."""
    return list(GEMM_TILE_TABLES[(hardware, family)][0]) if (hardware, family) in GEMM_TILE_TABLES else []


def served_m_tiles(hardware: str, family: str) -> list[int]:
    """The m buckets the cost model serves on (hardware, family) (``GEMM_TILE_SERVED``): the fit's ``OpFit.m_tiles``."""
    return m_tiles(hardware, family) if (hardware, family) in GEMM_TILE_SERVED else []


CONTEXT_DEPTH_TABLES: dict[tuple[str, str], str] = {
    ("a100-80g-sxm", "attention_decode"): "median 10.1% -> 9.7% (p90 34.4 -> 28.7): the bytes curve over-predicts "
                                          "contexts of 64-128 tokens by 1.11-1.19x (256-4,096: 0.95x)",
}
"""(GPU, decode-attention family) -> why: tables fitted with a depth curve by context (``OpFit.depth``, the decode's
reduction depth: each query reduces over its sequence's context). Elsewhere the size/width fit keeps them."""

BALANCED_ROUTING_TABLES: dict[tuple[str, str], str] = {
    ("h100-80g-sxm", "moe"): "median 6.4% -> 4.4% (p90 23.6 -> 16.5%)",
    ("h100-80g-sxm", "moe_fp8"): "median 6.4% -> 4.3% (p90 24.0 -> 17.5%)",
    ("b200-180g-sxm", "moe"): "median 11.6% -> 10.6% (p90 36.8 -> 34.9%)",
    ("b200-180g-sxm", "moe_fp8"): "median 13.3% -> 12.7% (p90 40.1 -> 39.7%)",
    ("l40s-48g", "moe"): "median 8.7% -> 7.4% (p90 41.0 -> 37.5%)",
    ("l40s-48g", "moe_fp8"): "median 11.7% -> 8.5% (p90 50.3 -> 39.6%)",
}
"""(GPU, MoE family) -> what it gains: tables whose ``balanced`` rows are predicted with rank 0's exact pairs and
touched experts under the collector's deterministic routing (``actors.calibration_routing.balanced_rank0``); the
others keep the uniform expectation. H200 gains too (moe 8.2 -> 5.8%, moe_fp8 7.8 -> 5.9%), but its refit made
validate --quick's Qwen3-235B-FP8 H200 TPOT median 36.9 -> 39.2% (bias already -37%: too fast), so it is left out."""

MOE_ROUTED_TABLES: dict[tuple[str, str], str] = {
    ("b200-180g-sxm", "moe"): "median 10.6% -> 9.6%: EP 64-256 ran 0.80-0.90x of the fit; at 16,384 tokens on EP 256 "
                              "B200 takes 1.21 ms, H100 1.17 ms, whatever B200's 2.4x bandwidth",
    ("b200-180g-sxm", "moe_fp8"): "median 12.7% -> 10.8%, as its 16-bit table",
}
"""(GPU, MoE family) -> why: tables fitted with a time per routed pair (``OpFit.output_ns``, outputs = every
rank's tokens x topk): ``moe_align_block_size`` sorts, and ``fused_moe_kernel`` walks, the whole routed list on
every rank (an expert another rank holds still gets its blocks, which write zeros), a cost set by the pairs, not
by bytes or FLOPs. Elsewhere it gains < 1 point (H100 0.2, H200 fp8 0.3)."""

MOE_BLOCK_M = (16, 64)
"""vLLM's default ``BLOCK_SIZE_M`` of ``fused_moe_kernel``: while M <= E, after (``fused_moe.get_default_config``)."""
MOE_TUNED_BLOCK_M = ((16, 32, 64, 128), (16, 64, 512))
"""(blocks, token thresholds) of tuned configs: the blocks grow with M as vLLM's tuned files' do (B200 E=128 N=2048
fp8: 16 to M = 128, 64 at 256-512, 128 from 1,024); the thresholds are the best of six candidates on B200's tables
(16/32/64/128 at 16/64/512: fp8 9.6%; at 32/128/512 10.0, 16/64/256 10.0, 16/96/768 10.1; that file's own
16/64/128 at 128/512 10.1, at 192/768 10.4): a table's shapes mix tuned files and the default config."""
MOE_BLOCK_TABLES: dict[tuple[str, str], tuple[tuple[tuple[int, ...], tuple[int, ...]], str]] = {
    ("a100-80g-sxm", "moe"): ((MOE_BLOCK_M, ()), "median 12.2% -> 9.5% (p90 33.0 -> 31.3%): ~11% on every model "
                              "configuration with no axis carrying it; a fixed block of 16 or 64 scores worse than "
                              "none (13.4, 14.5%): the switch at M = E, vLLM's default config, is what the table has"),
    ("b200-180g-sxm", "moe"): (MOE_TUNED_BLOCK_M, "median 9.6% -> 8.0% (p90 30.5 -> 30.0%)"),
    ("b200-180g-sxm", "moe_fp8"): (MOE_TUNED_BLOCK_M, "median 10.8% -> 9.6% (p90 35.4 -> 33.2%): 2-32 tokens ran "
                                   "0.88-0.93x of the fit, 128-1,024 tokens 1.03-1.13x (Triton picks its config by M)"),
}
"""(GPU, MoE family) -> ((blocks, token thresholds), why): tables fitted with the pairs padded to the Triton kernel's
``BLOCK_SIZE_M`` (``OpFit.moe_block_m``, ``moe_block_tokens``; no thresholds: vLLM's default config). A100's
table runs the default config (16 while the tokens are at most the rank's experts, 64 after); B200's the tuned
progression. The default rule on B200 fp8 scores 11.1%; elsewhere the tables are within the bound already."""


def moe_blocks(hardware: str, family: str) -> dict[str, list[int]]:
    """``OpFit`` fields (``moe_block_m``, ``moe_block_tokens``) of (hardware, family)'s MoE blocks
    (``MOE_BLOCK_TABLES``); empty lists where none."""
    blocks, tokens = MOE_BLOCK_TABLES[(hardware, family)][0] if (hardware, family) in MOE_BLOCK_TABLES else ((), ())
    return {"moe_block_m": list(blocks), "moe_block_tokens": list(tokens)}


__all__ = ["BALANCED_ROUTING_TABLES", "CONTEXT_DEPTH_TABLES", "EXCLUDED_TABLES", "FP8_GEMM_BF16_BOUND",
           "GEMM_DEPTH_TABLES", "GEMM_EPILOGUE_TABLES", "GEMM_TILE_SERVED", "GEMM_TILE_TABLES", "MOE_BLOCK_M",
           "MOE_BLOCK_TABLES", "MOE_ROUTED_TABLES", "MOE_TUNED_BLOCK_M", "SIBLING_GPUS", "SIBLING_MAX_RATIO", "m_tiles",
           "moe_blocks", "served_m_tiles"]

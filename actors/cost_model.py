"""The cost model: how long one engine step takes on the emulated hardware (vLLM 0.19, v1 engine).

A step is the sum of the kernels one TP rank runs for the batch, each a roofline fitted on vLLM's own
kernel timings (``Efficiency``'s ``OpFit``: ``latency + soft-max(FLOPs / (peak x eff_c(size)),
bytes / (bandwidth x eff_m(bytes)))``), plus the overheads vLLM v1 has::

    step = layers x (QKV + attention + O + all-reduce + MLP|MoE (+ all-to-all) + all-reduce + small kernels)
           + LM head + step overhead + sequences x request overhead (+ layers x layer overhead unless one graph)

- GEMMs (``gemm``/``gemm_fp8``; their efficiencies also scale by k, ``OpFit.depth``, and T is read at its
  kernel's m bucket, ``OpFit.padded_m``, where the fit has ``m_tiles``; the LM head keeps its m): QKV
  ``[T, (q + 2 kv)/tp, hidden]``, O ``[T, hidden, q/tp]``, gate/up ``[T, 2 inter/tp, hidden]``, down
  ``[T, hidden, inter/tp]``, LM head ``[seqs, vocab/tp, hidden]``;
  bytes = weights + activations in and out; on a GPU whose fp8 table lost to bf16 (``gemm_fp8_bf16_bound``)
  an fp8 GEMM takes the faster of the two fits. The LM head is a 16-bit GEMM whatever the model's GEMM dtype:
  vLLM's ``Fp8Config`` quantizes ``LinearBase`` and ``FusedMoE`` layers, and ``ParallelLMHead`` is neither
  (fp8 checkpoints list ``lm_head`` in their ``ignore``).
- Small kernels (``layer_kernels_ms``): the memory-bound kernels between the GEMMs that no op table times:
  per layer two fused residual-add + RMSNorms, rotary on q and k, the KV-cache write, and SiLU-and-mul in a
  dense MLP (a fused MoE's activation is inside its measured op). Each reads and writes its tensors once
  (``SMALL_KERNELS``: bytes per token from the architecture) at the GPU's fitted GEMM memory efficiency for
  that many bytes, plus the GEMM fit's kernel latency (one kernel's fixed time inside a CUDA graph).
- Attention (``attention_prefill``): causal (query, key) pairs of the chunks x heads x (4 x head_dim +
  ``SCORE_FLOPS``) FLOPs, prior context's KV read; (``attention_decode``, ``attention_decode_fp8`` over an
  fp8 cache, fitted on its own rows): every decode's context KV read.
- Fused MoE (``moe``/``moe_fp8``): top-k token-expert pairs, the expected distinct experts' weights read,
  the intermediate tensors over every routed pair (``moe_work``);
  with expert parallelism (EP) each rank holds ``experts / ep`` and sees the tokens of every DP rank,
  gathered before and reduce-scattered after the experts across the node link.
- All-reduce: 2 per layer when TP > 1, vLLM's custom all-reduce as measured (``allreduce``).
- CUDA graphs (vLLM ``compilation_config``, ``vllm/config/vllm.py: _set_cudagraph_sizes``; the
  ``FULL_AND_PIECEWISE`` default of ``docs/design/cuda_graphs.md``): capture sizes
  ``[1, 2, 4] + range(8, 256, 8) + range(256, max + 1, 16)``, max = min(2 x max_num_seqs, 512), capped by
  max_num_batched_tokens. A uniform decode batch replays one full graph padded up to the next capture
  size; a mixed batch runs piecewise graphs at the padded size with attention outside them (pays
  ``layer_overhead_us`` per layer); a step above the largest size runs eagerly (same per-layer cost).
- Async scheduling (vLLM 0.19's ``async_scheduling``) overlaps the CPU's scheduling of step n+1 with the
  GPU's step n, so only GPU-visible time counts: ``step_overhead_us`` and ``request_overhead_us``.
  Defaults from BLIS's published H100 fit (``../shared/calibration/blis_h100_coefficients``: 126 us per
  step, 4.42 us per request, 32.1 us per layer).
- Synchronous scheduling (``async_scheduling=False``, vLLM 0.11's default): the engine core's loop is
  ``schedule() -> execute_model() -> update_from_output()`` and the GPU waits for the CPU's part of each
  step, so every step also pays ``SYNC_STEP_CPU_US + SYNC_REQUEST_CPU_US x sequences`` (``sync_cpu_ms``).
  With TP > 1 it also waits for the multiprocess executor's IPC (``executor_ipc_ms``): the scheduler output
  pickled into the shared-memory broadcast queue and unpickled by the workers, rank 0's model-runner output
  pickled back and unpickled by the engine core, at the serialization rate of a production capture.

An ``EmpiricalCostModel`` takes fixed rates instead (the lessons card's ``lesson-70b-fp8``); the card's
closed forms for one request are ``ms_colocated`` and ``ms_disaggregated``.
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Protocol, TypeVar

import numpy as np

from config.dtypes import dtype_bytes
from config.hardware import Efficiency, HardwareProfile, OpFit
from config.link import LinkProfile
from config.model import ModelProfile
from config.profile import EmpiricalProfile

ACTIVATION_BYTES = 2  # activations, attention operands and all-reduce payloads are bf16
# A score's softmax (exp, max, rescale) runs on the SMs' special-function units, not the tensor cores: its
# time, in tensor-FLOP equivalents per (query, key) pair and head, fitted on the H100 prefill-attention
# table (head_dim 64 rows run 1.28x slower per tensor FLOP than head_dim 128 ones: (256+S)/(512+S) = 0.64).
SCORE_FLOPS = 192.0
# vLLM 0.19 CompilationConfig: the largest capture size is min(2 x max_num_seqs, 512).
MAX_CAPTURE_SIZE = 512
FIXED_TERMS_CACHE = 1 << 16
SYNC_STEP_CPU_US = 430.0
"""CPU time per step the GPU waits for without async scheduling: ``Scheduler.schedule()`` 0.2 ms, the model
runner's ``_update_states`` at least 0.18 ms and ``_prepare_inputs`` at least 0.05 ms per decode step, as
profiled in vLLM PR #42131 ("Decode fast path for scheduler and model runner", 2026-05, B200: the fast paths
save 0.15, 0.18 and 0.05 ms of them). A lower bound: the sampler's GPU->CPU copy is not counted; the executor's
IPC to its TP workers is ``executor_ipc_ms``."""
SYNC_REQUEST_CPU_US = 1.1
"""CPU time per scheduled sequence the GPU waits for without async scheduling: ``update_from_output()`` over the
batch, 0.142 ms at 128 sequences and 0.287 ms at 256 (vLLM PR #46112's micro-benchmark,
``benchmarks/overheads/benchmark_scheduler_update_from_output.py``, 2026-06): 1.1 us per sequence."""
MP_IPC_NS_PER_BYTE = (845.0 + 1054.0) / 136_904 * 1e3
"""Serialization time per byte of an ``execute_model`` message through vLLM's ``MessageQueue`` (TP > 1,
``MultiprocExecutor``): writer ``pickle.dumps`` 845 us plus reader ``pickle.loads`` 1,054 us for a
136,904-byte ``SchedulerOutput``, the "HY3 Stage4 reference (2K/200 prompts, production capture)" that vLLM's
``benchmarks/overheads/benchmark_scheduler_output_rpc_pack.py`` prints (PR #54406, 2026-08): 13.9 ns per byte,
counted once per message (the TP workers unpickle in parallel)."""
MP_IPC_FIXED_BYTES = 755.0
MP_IPC_BYTES_PER_SEQ = 108.6
MP_IPC_BYTES_PER_PREFILL_SEQ = 940.0
MP_IPC_BYTES_PER_PREFILL_TOKEN = 4.19
"""Pickled bytes of one step's two messages, from vLLM 0.11's dataclasses (``SchedulerOutput`` with
``CachedRequestData``, ``NewRequestData`` with ``SamplingParams``, ``ModelRunnerOutput``) rebuilt with their
fields and pickled at protocol 5 with 41-character ``chatcmpl-<uuid hex>`` request ids, 1 to 256 decodes:
scheduler output 542 + 53.7 per decode, output 213 + 54.9 per sequence; a new request adds about 940 bytes
(sampling parameters, block ids) and its prompt's token ids, 4.19 bytes each over a 128k vocabulary. A
prefill chunk is charged as a new request of its tokens (exact for the one-chunk prefills of the validated
rows; a later chunk of a chunked prompt sends no tokens, a prefix hit sends its cached part too)."""
"""Entries of a roofline model's memo of a step's terms other than attention (cleared when full)."""


def capture_sizes(max_num_seqs: int, max_num_batched_tokens: int) -> tuple[int, ...]:
    """vLLM 0.19's default CUDA graph capture sizes (``vllm/config/vllm.py: _set_cudagraph_sizes``)."""
    top = min(2 * max_num_seqs, MAX_CAPTURE_SIZE, max_num_batched_tokens)
    sizes = [1, 2, 4, *range(8, 256, 8), *range(256, top + 1, 16)]
    return tuple(s for s in sizes if s <= top)


Num = TypeVar("Num", float, np.ndarray)


def gemm_bytes(m: Num, n: Num, k: Num, weight_bytes: float) -> Num:
    """Bytes a GEMM ``[m, k] x [k, n]`` moves: the weights once, activations in and out at 16 bits."""
    return n * k * weight_bytes + m * (k + n) * ACTIVATION_BYTES


def moe_work(tokens: float, hidden: int, inter: int, topk: int, experts: int, tp: int, ep: int,
             weight_bytes: float, gated: bool = True, pairs: float | None = None,
             touched: float | None = None, block_m: Sequence[int] = (),
             block_tokens: Sequence[int] = ()) -> tuple[float, float, float, float]:
    """FLOPs, bytes, size (token-expert pairs routed to the rank) and parallel width (touched experts x
    their width) of one fused-MoE call on one rank.

    ``tokens`` is every DP rank's tokens (EP sees them all); a rank holds ``experts / ep`` experts, each
    with ``inter / tp`` of its width. Uniform routing: an expert is missed by one token with probability
    ``1 - k/E``, so ``E_local x (1 - (1 - k/E)^tokens)`` distinct local experts are read.

    Bytes: the touched experts' weights, the local pairs' inputs (hidden) and down-projection inputs (width),
    and the intermediate tensors of vLLM's Triton ``fused_experts``, which are sized by every routed pair
    (``tokens x topk``) whatever the rank holds: the first GEMM writes ``[tokens, topk, up]`` (an expert
    another rank holds has id -1 in ``expert_map``, and ``fused_moe_kernel`` writes zeros for its blocks),
    the activation reads it and writes ``[tokens x topk, width]``, the second GEMM writes
    ``[tokens, topk, hidden]`` (zeros again for remote experts) and ``moe_sum`` reads it back
    (``vllm/model_executor/layers/fused_moe/fused_moe.py``). With wide EP these writes, not the expert
    GEMMs, set the time: the 256-expert tables' time at 16,384 tokens stops falling at EP 64-256.

    ``pairs`` and ``touched`` replace the uniform routing's pairs on the rank and distinct local experts read
    where the routing is known to be otherwise (an op table's skewed rows: ``actors.calibration_routing``).

    ``block_m`` (``OpFit.moe_block_m``; empty: off): the Triton kernel's ``BLOCK_SIZE_M``, the first block whose
    ``block_tokens`` threshold ``tokens`` does not pass (a tuned config's keys), or without thresholds ``block_m[0]``
    when ``tokens`` is at most the rank's experts, else ``block_m[1]`` (vLLM's ``get_default_config``: 16 while
    M <= E, 64 after). ``moe_align_block_size`` pads each expert's pairs to whole blocks and ``fused_moe_kernel`` runs
    one program per block, padded rows included, so the FLOPs and the size are the padded pairs, taken as the pairs
    spread evenly over the touched experts: ``touched x ceil(pairs / touched / block) x block``. Bytes are not
    padded (padded rows are masked loads and stores); ``actors.calibration_tables.MOE_BLOCK_TABLES`` says where.
    """
    local = experts / ep
    routed = tokens * topk
    pairs = routed / ep if pairs is None else pairs
    width = inter / tp
    mats = 3 if gated else 2
    up = (mats - 1) * width
    if touched is None:
        touched = local * (1.0 - (1.0 - topk / experts) ** tokens)
    computed = pairs
    if block_m and pairs > 0 and touched > 0:
        block = (block_m[bisect.bisect_left(block_tokens, tokens)] if block_tokens else
                 block_m[0] if tokens <= local else block_m[1])
        computed = max(pairs, touched * math.ceil(pairs / touched / block - 1e-9) * block)
    flops = 2.0 * computed * mats * hidden * width
    weights = touched * mats * hidden * width * weight_bytes
    nbytes = weights + (pairs * (hidden + width) + routed * (2 * up + width + 2 * hidden)) * ACTIVATION_BYTES
    return flops, nbytes, computed, touched * width


def small_kernels(model: ModelProfile, tp: int, moe_layer: bool) -> dict[str, float]:
    """Bytes per token each small kernel of one layer moves on one TP rank (vLLM 0.19's Llama-style decoder
    layer, ``vllm/model_executor/models/llama.py``; activations 16-bit).

    - ``norm``: ``fused_add_rms_norm`` before attention and before the MLP, each reading the hidden state and
      the residual and writing both, over the full hidden size (not TP-sharded): 2 x 4 x hidden x 2 bytes;
    - ``rotary``: q and k heads of the rank read and written in place;
    - ``kv_write``: ``reshape_and_cache_flash`` reads k and v and writes them at the cache's dtype;
    - ``act``: ``silu_and_mul`` reads gate and up and writes their product (dense MLP layers only: a fused
      MoE's activation runs inside the fused-MoE op, whose table already times it).
    """
    a = ACTIVATION_BYTES
    d = model.head_dim
    q = model.num_heads * d / tp
    kv = (model.num_kv_heads if model.mla is not None else math.ceil(model.num_kv_heads / tp)) * d
    out = {"norm": 2 * 4 * model.hidden_size * a, "rotary": 2 * (q + kv) * a,
           "kv_write": 2 * kv * (a + dtype_bytes(model.kv_dtype))}
    if not moe_layer:
        inter = model.mlp_width / tp
        out["act"] = (3 if model.mlp_gated else 2) * inter * a
    return out


@dataclass(frozen=True, slots=True)
class StepShape:
    """Aggregates of one step's batch, all the cost model needs.

    ``prefill_pairs`` counts (query, key) pairs of the prefill chunks: a chunk of ``n`` tokens after ``c``
    cached ones attends ``n x c + n (n + 1) / 2`` pairs (causal). ``kv_read_tokens`` is the cached KV the
    step reads: every decode's context plus every chunk's prior context.
    """

    prefill_tokens: int = 0
    prefill_seqs: int = 0
    prefill_pairs: float = 0.0
    decode_seqs: int = 0
    decode_context: int = 0
    kv_read_tokens: int = 0

    @staticmethod
    def of(prefills: Iterable[tuple[int, int]] = (), decodes: Iterable[int] = ()) -> StepShape:
        """``prefills``: (new tokens, tokens already cached) per chunk; ``decodes``: context length per seq."""
        pt = ps = 0
        pairs = 0.0
        kv_read = 0
        for n, c in prefills:
            pt += n
            ps += 1
            pairs += n * c + n * (n + 1) / 2.0
            kv_read += c
        dc = list(decodes)
        dctx = sum(dc)
        return StepShape(pt, ps, pairs, len(dc), dctx, kv_read + dctx)

    @property
    def tokens(self) -> int:
        return self.prefill_tokens + self.decode_seqs

    @property
    def seqs(self) -> int:
        return self.prefill_seqs + self.decode_seqs

    @property
    def empty(self) -> bool:
        return self.tokens == 0


@dataclass(frozen=True, slots=True)
class StepTime:
    """One step's predicted duration (emulated ms) and its parts.

    ``compute_ms``: GEMMs, MoE and the LM head; ``memory_ms``: attention (KV reads); ``comm_ms``:
    all-reduce and all-to-all; ``overhead_ms``: per step, per request, per layer outside graphs, and the CPU's
    part and the TP executor's IPC without async scheduling;
    ``kernels_ms``: the per-layer small kernels (norms, rotary, KV write, activation).
    ``graph``: ``full``, ``piecewise`` or ``eager``; ``padded_tokens``: tokens the graphs ran at.
    """

    total_ms: float
    compute_ms: float = 0.0
    memory_ms: float = 0.0
    comm_ms: float = 0.0
    overhead_ms: float = 0.0
    graph: str = ""
    padded_tokens: int = 0
    kernels_ms: float = 0.0

    @property
    def bound(self) -> str:
        return "compute" if self.compute_ms >= self.memory_ms else "memory"


class CostModel(Protocol):
    """What an engine needs from a cost model."""

    name: str
    kv_bytes_per_token: int
    max_context: int

    def step(self, shape: StepShape) -> StepTime: ...


class RooflineCostModel:
    """Per-op roofline step time for ``model`` on ``tp`` GPUs of ``hardware`` (see the module docstring).

    ``ep`` > 1: the MoE layers are expert-parallel over ``ep`` GPUs (vLLM's ``--enable-expert-parallel``:
    EP = TP x DP, experts whole on their rank, not TP-sharded): ``ep / tp`` data-parallel ranks, each
    running attention on its own batch; the other DP ranks are assumed to carry as many tokens (vLLM steps
    DP ranks together) and their tokens reach the experts by an all-to-all dispatch and combine. ``max_num_seqs`` and
    ``max_num_batched_tokens`` set the CUDA graph capture sizes; ``cudagraphs=False`` runs every step
    eagerly (vLLM's ``enforce_eager``); ``async_scheduling=False`` adds the CPU's part of each step
    (``sync_cpu_ms``), which async scheduling hides behind the previous step.

    Invariants: a step's time never decreases when tokens, sequences or contexts grow (the efficiency
    curves are fitted under that constraint); an empty step takes zero time.
    """

    def __init__(self, hardware: HardwareProfile, model: ModelProfile, tp: int = 1,
                 efficiency: Efficiency | None = None, *, ep: int = 1, max_num_seqs: int = 256,
                 max_num_batched_tokens: int = 8192, cudagraphs: bool = True, async_scheduling: bool = True) -> None:
        if tp < 1 or ep < 1:
            raise ValueError("tp and ep must be at least 1")
        if model.moe is None:
            ep = 1  # as vLLM: --enable-expert-parallel changes nothing in a dense model
        if ep > 1 and ep % tp:
            raise ValueError(f"ep ({ep}) must be a multiple of tp ({tp})")
        self.hardware, self.model, self.tp, self.ep = hardware, model, tp, ep
        self.dp = ep // tp if ep > 1 else 1
        """Data-parallel ranks whose tokens meet in the experts (1: EP over the TP ranks only)."""
        self.name = f"{model.name}@{hardware.name}xTP{tp}" + (f"xEP{ep}" if ep > 1 else "")
        self.kv_bytes_per_token = model.kv_bytes_per_token
        self.max_context = model.max_context
        self.eff = eff = efficiency or hardware.efficiency
        self.capture = capture_sizes(max_num_seqs, max_num_batched_tokens) if cudagraphs else ()
        self.async_scheduling = async_scheduling
        fp8 = model.gemm_dtype in ("fp8", "fp4", "int4")
        self._gemm: OpFit = eff.gemm_fp8 if fp8 else eff.gemm
        self._bf16_bound = fp8 and eff.gemm_fp8_bf16_bound
        """An fp8 GEMM takes the faster of the fp8 and the 16-bit fit (``Efficiency.gemm_fp8_bf16_bound``)."""
        self._moe: OpFit = eff.moe_fp8 if fp8 else eff.moe
        self._decode_attn: OpFit = eff.decode_attention(model.kv_dtype)
        self._wb = dtype_bytes(model.weight_dtype)
        self._gemm_flops = hardware.tflops(model.gemm_dtype) * 1e9  # FLOP per ms
        self._attn_flops = hardware.tflops("bf16") * 1e9
        self._hbm = hardware.hbm_bandwidth_gbps * 1e6  # bytes per ms
        self._link = hardware.intra_node_link_gbps * 1e6
        m, d = model, model.head_dim
        self._q = m.num_heads * d / tp
        kv_heads = m.num_kv_heads if m.mla is not None else math.ceil(m.num_kv_heads / tp)
        self._kv = kv_heads * d
        self._heads = m.num_heads / tp
        self._kv_heads = kv_heads
        layers = m.num_layers
        self._attn_flops_pair = (m.attention_flops_per_token_per_context / layers + SCORE_FLOPS * m.num_heads) / tp
        per_layer_kv = m.kv_bytes_per_token / layers
        self._kv_bytes_layer = per_layer_kv if m.mla is not None else (
            2 * kv_heads * d * dtype_bytes(m.kv_dtype))
        self._kernels = [(count, tuple(small_kernels(m, tp, moe_layer).values()))
                         for count, moe_layer in ((m.dense_layers, False),
                                                    (m.moe.moe_layers if m.moe is not None else 0, True))
                         if count]
        self._fixed: dict[tuple[int, int, str], tuple[float, float, float, float]] = {}

    # -- one kernel each ---------------------------------------------------------------------------
    def gemm_ms(self, m: float, n: float, k: float) -> float:
        mp = self._gemm.padded_m(m)  # the kernel's m bucket (OpFit.m_tiles: GEMM_TILE_TABLES)
        t = self._gemm.ms(2.0 * mp * n * k, gemm_bytes(mp, n, k, self._wb), mp, self._gemm_flops, self._hbm, n,
                          depth=k, outputs=mp * n)
        if self._bf16_bound:
            mp = self.eff.gemm.padded_m(m)
            t = min(t, self.eff.gemm.ms(2.0 * mp * n * k, gemm_bytes(mp, n, k, ACTIVATION_BYTES), mp,
                                        self._attn_flops, self._hbm, n, depth=k, outputs=mp * n))
        return t

    def allreduce_ms(self, tokens: int) -> float:
        """All of a step's all-reduces (2 per layer) of ``tokens`` rows of activations over the TP group."""
        if self.tp == 1 or tokens == 0:
            return 0.0
        nbytes = tokens * self.model.hidden_size * ACTIVATION_BYTES
        one = self.eff.allreduce_fit(self.tp).ms(0.0, nbytes, 0.0, 1.0, self._link)
        return 2 * self.model.num_layers * one

    def alltoall_ms(self, tokens: int) -> float:
        """EP dispatch and combine per MoE layer with vLLM's default all2all backend
        (``allgather_reducescatter``, ``vllm/distributed/device_communicators/all2all.py``): each rank
        gathers the other DP ranks' hidden states before the experts and reduce-scatters the outputs after,
        ``(dp - 1) x tokens`` rows each way, at the link efficiency measured for a collective of that size
        over ``ep`` GPUs."""
        if self.dp == 1 or self.model.moe is None or tokens == 0:
            return 0.0
        nbytes = (self.dp - 1) * tokens * self.model.hidden_size * ACTIVATION_BYTES
        one = self.eff.allreduce_fit(self.ep).ms(0.0, nbytes, 0.0, 1.0, self._link)
        return 2 * self.model.moe.moe_layers * one

    def attention_ms(self, shape: StepShape) -> float:
        """One layer's attention: the prefill chunks' causal pairs, the decodes' KV reads."""
        t = 0.0
        if shape.prefill_seqs:
            ctx = shape.kv_read_tokens - shape.decode_context
            flops = self._attn_flops_pair * shape.prefill_pairs
            nbytes = (ctx + shape.prefill_tokens) * self._kv_bytes_layer \
                + 2 * shape.prefill_tokens * self._q * ACTIVATION_BYTES
            t += self.eff.attention_prefill.ms(flops, nbytes, shape.prefill_tokens / shape.prefill_seqs,
                                               self._attn_flops, self._hbm, shape.prefill_seqs * self._heads)
        if shape.decode_seqs:
            flops = self._attn_flops_pair * shape.decode_context
            nbytes = shape.decode_context * self._kv_bytes_layer + 2 * shape.decode_seqs * self._q * ACTIVATION_BYTES
            t += self._decode_attn.ms(flops, nbytes, shape.decode_seqs, self._attn_flops, self._hbm,
                                      shape.decode_seqs * self._kv_heads,
                                      depth=shape.decode_context / shape.decode_seqs)  # mean context
        return t

    def layer_kernels_ms(self, tokens: int) -> float:
        """Every layer's small kernels (``small_kernels``) at ``tokens`` rows, summed over the layers: each
        kernel takes the 16-bit GEMM fit's kernel latency plus its bytes at that fit's memory efficiency."""
        fit = self.eff.gemm
        t = 0.0
        for layers, per_token in self._kernels:
            for b in per_token:
                nbytes = tokens * b
                t += layers * (fit.latency_us / 1e3 + nbytes / (self._hbm * fit.memory_eff(nbytes)))
        return t

    def lm_head_ms(self, seqs: int) -> float:
        """The LM head ``[seqs, vocab/tp, hidden]``, a 16-bit GEMM whatever the model's GEMM dtype."""
        m, n, k = float(seqs), self.model.vocab_size / self.tp, float(self.model.hidden_size)
        return self.eff.gemm.ms(2.0 * m * n * k, gemm_bytes(m, n, k, ACTIVATION_BYTES), m, self._attn_flops,
                                self._hbm, n, depth=k, outputs=m * n)

    def sync_cpu_ms(self, seqs: int) -> float:
        """The CPU's part of a step that the GPU waits for: none with async scheduling, else
        ``SYNC_STEP_CPU_US + SYNC_REQUEST_CPU_US x seqs``."""
        if self.async_scheduling:
            return 0.0
        return (SYNC_STEP_CPU_US + SYNC_REQUEST_CPU_US * seqs) / 1e3

    def executor_ipc_ms(self, shape: StepShape) -> float:
        """The multiprocess executor's per-step IPC that the GPU waits for: none on one GPU (vLLM's
        ``UniProcExecutor`` calls the worker in process) or with async scheduling (the next step's message is
        sent while this one runs), else the pickled bytes of the step's scheduler output and model-runner
        output (``MP_IPC_*_BYTES*``) at ``MP_IPC_NS_PER_BYTE``. Not counted: the shared-memory hand-offs
        themselves (readers busy-spin on the ring buffer)."""
        if self.tp == 1 or self.async_scheduling or shape.empty:
            return 0.0
        nbytes = (MP_IPC_FIXED_BYTES + MP_IPC_BYTES_PER_SEQ * shape.seqs
                  + MP_IPC_BYTES_PER_PREFILL_SEQ * shape.prefill_seqs
                  + MP_IPC_BYTES_PER_PREFILL_TOKEN * shape.prefill_tokens)
        return nbytes * MP_IPC_NS_PER_BYTE / 1e6

    def graph_mode(self, shape: StepShape) -> tuple[str, int]:
        """(``full`` | ``piecewise`` | ``eager``, tokens the step runs at after padding)."""
        tokens = shape.tokens
        if not self.capture or tokens > self.capture[-1]:
            return "eager", tokens
        padded = self.capture[bisect.bisect_left(self.capture, tokens)]
        return ("full" if shape.prefill_seqs == 0 else "piecewise"), padded

    def layer_gemms_ms(self, tokens: int) -> float:
        """Every layer's GEMMs and MoE at ``tokens`` rows, summed over the layers."""
        m, tp = self.model, self.tp
        h = m.hidden_size
        t = m.num_layers * (self.gemm_ms(tokens, self._q + 2 * self._kv, h) + self.gemm_ms(tokens, h, self._q))
        if m.dense_layers:
            inter = m.mlp_width / tp
            up = 2 * inter if m.mlp_gated else inter
            t += m.dense_layers * (self.gemm_ms(tokens, up, h) + self.gemm_ms(tokens, h, inter))
        if m.moe is not None:
            e = m.moe
            flops, nbytes, size, width = moe_work(
                tokens * self.dp, h, m.expert_width, e.experts_per_token, e.num_experts, 1 if self.ep > 1 else tp,
                self.ep, self._wb, m.mlp_gated, block_m=self._moe.moe_block_m, block_tokens=self._moe.moe_block_tokens)
            routed = tokens * self.dp * e.experts_per_token  # every rank's pairs (OpFit.output_ns: MOE_ROUTED_TABLES)
            per_layer = self.gemm_ms(tokens, e.num_experts, h) + self._moe.ms(flops, nbytes, size, self._gemm_flops,
                                                                             self._hbm, width, outputs=routed)
            if e.shared_intermediate_size:
                si = e.shared_intermediate_size / tp
                per_layer += self.gemm_ms(tokens, 2 * si, h) + self.gemm_ms(tokens, h, si)
            t += e.moe_layers * per_layer
        return t

    def _fixed_terms(self, padded: int, seqs: int, mode: str) -> tuple[float, float, float, float]:
        """(GEMMs with MoE and LM head, collectives, overheads, small kernels) of a step: everything but
        attention, a function of the padded tokens, the sequences and the graph mode alone, hence memoized."""
        key = (padded, seqs, mode)
        terms = self._fixed.get(key)
        if terms is None:
            m = self.model
            gemms = self.layer_gemms_ms(padded) + self.lm_head_ms(seqs)
            comm = self.allreduce_ms(padded) + self.alltoall_ms(padded)
            overhead = (self.eff.step_overhead_us + self.eff.request_overhead_us * seqs
                        + (self.eff.layer_overhead_us * m.num_layers if mode != "full" else 0.0)) / 1e3 \
                + self.sync_cpu_ms(seqs)
            if len(self._fixed) >= FIXED_TERMS_CACHE:
                self._fixed.clear()
            terms = self._fixed[key] = (gemms, comm, overhead, self.layer_kernels_ms(padded))
        return terms

    def step(self, shape: StepShape) -> StepTime:
        if shape.empty:
            return StepTime(0.0)
        mode, padded = self.graph_mode(shape)
        gemms, comm, overhead, kernels = self._fixed_terms(padded, shape.seqs, mode)
        overhead += self.executor_ipc_ms(shape)
        attention = self.model.num_layers * self.attention_ms(shape)
        total = gemms + attention + comm + overhead + kernels
        return StepTime(total, gemms, attention, comm, overhead, mode, padded, kernels)


class EmpiricalCostModel:
    """Fixed rates: prefill ``n`` tokens in ``n / prefill rate``; one decode step in ``1 / decode rate``.

    ``role`` picks the decode rate: a decode-only GPU decodes faster than a colocated one (no prefill
    interference), as the lessons card assumes. A step that holds both prefill and decode work pays both.
    """

    def __init__(self, profile: EmpiricalProfile, role: str = "colocated") -> None:
        self.profile = profile
        self.name = f"{profile.name}[{role}]"
        self.kv_bytes_per_token = profile.kv_bytes_per_token
        self.max_context = profile.max_context
        rate = profile.decode_tokens_per_ms_decode if role == "decode" else profile.decode_tokens_per_ms_colocated
        self._decode_step_ms = 1.0 / rate
        self._prefill_ms_per_token = 1.0 / profile.prefill_tokens_per_ms

    def step(self, shape: StepShape) -> StepTime:
        prefill = shape.prefill_tokens * self._prefill_ms_per_token
        decode = self._decode_step_ms if shape.decode_seqs else 0.0
        return StepTime(prefill + decode, compute_ms=prefill, memory_ms=decode)


# -- the lessons card's closed forms -------------------------------------------------------------------
def ms_colocated(profile: EmpiricalProfile, prompt: int, output: int) -> float:
    """``prompt / PREFILL_TOK_PER_MS + output / DECODE_TOK_PER_MS_COLOCATED``."""
    return prompt / profile.prefill_tokens_per_ms + output / profile.decode_tokens_per_ms_colocated


def ms_disaggregated(profile: EmpiricalProfile, prompt: int, output: int, link: LinkProfile) -> float:
    """Prefill, then the transfer tax for the prompt's KV, then decode on the faster decode pool."""
    prefill_ms = prompt / profile.prefill_tokens_per_ms
    transfer_ms = link.transfer_ms(prompt * profile.kv_bytes_per_token)
    decode_ms = output / profile.decode_tokens_per_ms_decode
    return prefill_ms + transfer_ms + decode_ms


# -- one isolated request through an engine's step loop --------------------------------------------------
@dataclass(frozen=True)
class RequestTimes:
    ttft_ms: float
    tpot_ms: float
    e2e_ms: float
    prefill_ms: float
    transfer_ms: float
    decode_ms: float


def prefill_ms(cost: CostModel, prompt: int, chunk: int, cached: int = 0) -> float:
    """Prefill of ``prompt`` tokens (``cached`` of them already in the KV cache) in chunks of ``chunk``."""
    done = cached
    total = 0.0
    while done < prompt:
        n = min(chunk, prompt - done)
        total += cost.step(StepShape.of(prefills=[(n, done)])).total_ms
        done += n
    return total


def decode_ms(cost: CostModel, prompt: int, steps: int) -> float:
    """``steps`` decode steps of one sequence whose context starts at ``prompt + 1`` tokens."""
    return sum(cost.step(StepShape.of(decodes=[prompt + i])).total_ms for i in range(1, steps + 1))


def request_colocated(cost: CostModel, prompt: int, output: int, chunk: int) -> RequestTimes:
    """An isolated request on one engine, as its step loop runs it: the last prefill chunk emits token 1."""
    p = prefill_ms(cost, prompt, chunk)
    d = decode_ms(cost, prompt, output - 1)
    return RequestTimes(p, d / max(1, output - 1), p + d, p, 0.0, d)


def request_disaggregated(prefill_cost: CostModel, decode_cost: CostModel, link: LinkProfile, prompt: int,
                          output: int, chunk: int, handoff: str = "pull") -> RequestTimes:
    """Prefill engine emits token 1, the prompt's KV crosses ``link`` (one link per engine), the decode
    engine makes the rest.

    ``pull``: the transfer starts when the prefill is done. ``push``: each chunk's KV leaves as soon as the
    chunk is computed, overlapping the next chunk's compute; the decode can start when the last chunk's
    KV has landed. ``transfer_ms`` is the transfer time the request waits for after its prefill.
    """
    kv = prefill_cost.kv_bytes_per_token
    done = 0
    compute_end = 0.0
    wire_free = 0.0
    steps: list[tuple[int, float]] = []
    while done < prompt:
        n = min(chunk, prompt - done)
        compute_end += prefill_cost.step(StepShape.of(prefills=[(n, done)])).total_ms
        steps.append((n, compute_end))
        done += n
    p = compute_end
    if handoff == "push":
        for n, end in steps:
            wire_free = max(wire_free, end) + link.transfer_ms(n * kv)
        t = max(0.0, wire_free - p)
    else:
        t = link.transfer_ms(prompt * kv)
    d = decode_ms(decode_cost, prompt, output - 1)
    return RequestTimes(p, (t + d) / max(1, output - 1), p + t + d, p, t, d)


def crossover(diff: Callable[[int], float], lo: int = 1, hi: int = 1 << 24) -> int | None:
    """Smallest prompt length in [lo, hi] where ``diff`` changes sign from its value at ``lo``; None if never.

    ``diff(p)`` is disaggregated minus colocated time. Scans powers of two, then bisects on integers.
    """
    sign0 = diff(lo) < 0
    prev = lo
    p = lo
    while p < hi:
        p = min(hi, p * 2)
        if (diff(p) < 0) != sign0:
            a, b = prev, p
            while b - a > 1:
                m = (a + b) // 2
                if (diff(m) < 0) == sign0:
                    a = m
                else:
                    b = m
            return b
        prev = p
    return None

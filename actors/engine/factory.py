"""Build an engine's config and cost model from the cluster spec's resolved engine instance."""

from __future__ import annotations

import math

from actors.cost_model import CostModel, EmpiricalCostModel, RooflineCostModel
from actors.engine.engine import EngineConfig
from actors.engine.scheduler import SchedulerLimits
from actors.profile_cost import ProfileCostModel
from config.cluster import EngineInstance, SchedulerSpec
from config.dtypes import dtype_bytes
from config.hardware import HardwareProfile
from config.model import ModelProfile
from config.step_profile import load_step_profile

DEFAULT_VOCAB = 32000


# Memory vLLM 0.19 keeps out of the KV cache besides weights and the profiled activation peak
# (``vllm/v1/worker/gpu_worker.py: determine_available_memory``: requested = total x utilization; KV =
# requested - weights - peak activations of a max_num_batched_tokens dummy step - non-torch memory; CUDA
# graphs are captured after and come out of the same budget). The two constants together (0.87 GB) are
# what set-up A's published figure leaves: 2,588 blocks of Llama-3.1-8B on a 24 GiB RTX 4090 at 0.9.
NON_TORCH_BYTES = 0.57e9
"""CUDA context growth, cuBLAS/cuDNN workspaces, allocator fragmentation seen by the profiler."""
CUDA_GRAPH_BYTES = 0.3e9
"""Captured graphs' private pools (vLLM logs 0.2-0.5 GiB for 8-32B models at the default sizes)."""
NCCL_BYTES = {1: 0.0, 2: 358_612_992.0, 4: 411_041_792.0, 8: 411_041_792.0}
"""NCCL buffers per GPU by group size (aiconfigurator's system files, ``misc.nccl_mem``)."""
LOGITS_COPIES = 4
"""fp32 logits of the sampler's warm-up over max_num_seqs rows: logits, probs, log-probs, sort buffer."""


def activation_peak_bytes(model: ModelProfile, tp: int, sched: SchedulerSpec) -> float:
    """Peak activations of vLLM's profiling step (``max_num_batched_tokens`` tokens, then a sampler warm-up
    over ``max_num_seqs`` rows): the residual stream and its norms (8 hidden-wide bf16 buffers), the
    gate/up output and its activation (3 MLP-wide), and the fp32 logits."""
    t = sched.max_num_batched_tokens
    mlp = max(model.mlp_width, model.expert_width * (model.moe.experts_per_token if model.moe else 0))
    hidden = t * model.hidden_size * 2 * 8
    ffn = t * 3 * mlp / tp * 2
    logits = sched.max_num_seqs * model.vocab_size / tp * 4 * LOGITS_COPIES
    return hidden + ffn + logits


def kv_blocks_for(model: ModelProfile, hw: HardwareProfile, tp: int, sched: SchedulerSpec, ep: int = 1) -> int:
    """KV blocks as vLLM sizes them, per GPU, unless the spec pins ``num_gpu_blocks``:
    ``(utilization x memory - weights - activation peak - non-torch - CUDA graphs - NCCL) / block bytes``.

    Attention heads (and so the KV) are split across the TP ranks (a KV head is replicated when there
    are fewer KV heads than ranks); MLA's single latent is replicated. Under expert parallelism a GPU
    holds the dense weights and ``1/ep`` of the routed experts.
    """
    if sched.num_gpu_blocks is not None:
        return sched.num_gpu_blocks
    routed = model.moe.routed_params_b * 1e9 * dtype_bytes(model.weight_dtype) if model.moe else 0.0
    weights = (model.weight_bytes - routed) / tp + (routed / ep if ep > 1 else routed / tp)
    group = max(tp, ep)
    nccl = NCCL_BYTES.get(group, NCCL_BYTES[8]) if group > 1 else 0.0
    free = (hw.hbm_bytes * sched.gpu_memory_utilization - weights - activation_peak_bytes(model, tp, sched)
            - NON_TORCH_BYTES - CUDA_GRAPH_BYTES - nccl)
    per_token: float
    if model.mla is not None:
        per_token = model.kv_bytes_per_token
    else:
        kv_heads = math.ceil(model.num_kv_heads / tp)
        per_token = 2 * model.num_layers * kv_heads * model.head_dim * dtype_bytes(model.kv_dtype)
    return max(1, int(free // (per_token * sched.block_size)))


def build_engine(inst: EngineInstance, kv_payload_scale: float = 1.0) -> tuple[EngineConfig, CostModel]:
    """The engine's config and cost model; ``kv_payload_scale`` (the transport's) sizes its tiers' real bytes."""
    sched = inst.group.scheduler
    cost: CostModel
    if inst.model is not None:
        cost = RooflineCostModel(inst.hardware, inst.model, inst.tp, ep=inst.group.ep,
                                 max_num_seqs=sched.max_num_seqs,
                                 max_num_batched_tokens=sched.max_num_batched_tokens,
                                 async_scheduling=sched.async_scheduling)
        blocks = kv_blocks_for(inst.model, inst.hardware, inst.tp, sched, inst.group.ep)
        vocab = inst.model.vocab_size
        name = inst.model.name
        max_ctx = inst.model.max_context
    elif inst.profile is not None:
        cost = EmpiricalCostModel(inst.profile, inst.role)
        blocks = sched.num_gpu_blocks or max(1, inst.profile.kv_capacity_tokens // sched.block_size)
        vocab = DEFAULT_VOCAB
        name = inst.profile.name
        max_ctx = inst.profile.max_context
    else:  # pragma: no cover - the spec validator guarantees one of them
        raise ValueError(f"engine {inst.name} has neither a model nor a profile")
    if inst.group.step_profile is not None:
        # A measured step-time table replaces the step times; KV size and context stay the model's.
        cost = ProfileCostModel(load_step_profile(inst.group.step_profile), name=name,
                                kv_bytes_per_token=cost.kv_bytes_per_token, max_context=max_ctx)
    limits = SchedulerLimits(sched.max_num_seqs, sched.max_num_batched_tokens, max_ctx,
                             sched.enable_chunked_prefill, sched.long_prefill_token_threshold,
                             sched.policy, sched.async_scheduling)
    cfg = EngineConfig(inst.name, name, inst.role, blocks, sched.block_size, limits,
                       sched.enable_prefix_caching, vocab, tiers=inst.group.tiers, kv_payload_scale=kv_payload_scale)
    return cfg, cost

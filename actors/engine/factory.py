"""Build an engine's config and cost model from the cluster spec's resolved engine instance."""

from __future__ import annotations

from actors.cost_model import CostModel, EmpiricalCostModel, RooflineCostModel
from actors.engine.engine import EngineConfig
from actors.engine.scheduler import SchedulerLimits
from actors.profile_cost import ProfileCostModel
from config.cluster import EngineInstance, SchedulerSpec
from config.hardware import HardwareProfile
from config.model import ModelProfile
from config.step_profile import load_step_profile

DEFAULT_VOCAB = 32000


def kv_blocks_for(model: ModelProfile, hw: HardwareProfile, tp: int, sched: SchedulerSpec) -> int:
    """KV blocks that fit: HBM x utilization, less weights and the activation reserve, per GPU, over TP.

    Attention heads (and so the KV) are split across the TP ranks, so each rank holds 1/tp of every
    token's KV; MLA's single latent is replicated instead.
    """
    if sched.num_gpu_blocks is not None:
        return sched.num_gpu_blocks
    per_gpu_free = (hw.hbm_bytes * sched.gpu_memory_utilization - sched.activation_reserve_gb * 1e9
                    - model.weight_bytes / tp)
    kv_per_token_per_gpu = model.kv_bytes_per_token / (1 if model.mla is not None else tp)
    return max(1, int(per_gpu_free // (kv_per_token_per_gpu * sched.block_size)))


def build_engine(inst: EngineInstance) -> tuple[EngineConfig, CostModel]:
    sched = inst.group.scheduler
    cost: CostModel
    if inst.model is not None:
        cost = RooflineCostModel(inst.hardware, inst.model, inst.tp)
        blocks = kv_blocks_for(inst.model, inst.hardware, inst.tp, sched)
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
                       sched.enable_prefix_caching, vocab)
    return cfg, cost

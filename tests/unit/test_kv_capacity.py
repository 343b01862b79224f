"""KV capacity as vLLM 0.19 sizes it: set-up A's published block count, pinned counts, what moves it."""

from __future__ import annotations

import pytest

from actors.engine.factory import activation_peak_bytes, kv_blocks_for
from config import default_catalog
from config.cluster import SchedulerSpec

CAT = default_catalog()
LLAMA8B = CAT.models.get("llama-3.1-8b")
RTX4090 = CAT.hardware.get("rtx-4090")
SETUP_A = SchedulerSpec(max_num_seqs=256, max_num_batched_tokens=2048, gpu_memory_utilization=0.9)


def test_setup_a_matches_vllms_published_block_count() -> None:
    # ../shared/traces/llmservingsim_vllm_runs/SOURCE.md: 2,588 blocks x 16 tokens on one RTX 4090 at 0.9.
    assert kv_blocks_for(LLAMA8B, RTX4090, 1, SETUP_A) == pytest.approx(2588, rel=0.01)


def test_a_pinned_block_count_wins() -> None:
    pinned = SETUP_A.model_copy(update={"num_gpu_blocks": 1234})
    assert kv_blocks_for(LLAMA8B, RTX4090, 1, pinned) == 1234


def test_a_larger_step_budget_leaves_fewer_blocks() -> None:
    big = SETUP_A.model_copy(update={"max_num_batched_tokens": 16384})
    assert activation_peak_bytes(LLAMA8B, 1, big) > activation_peak_bytes(LLAMA8B, 1, SETUP_A)
    assert kv_blocks_for(LLAMA8B, RTX4090, 1, big) < kv_blocks_for(LLAMA8B, RTX4090, 1, SETUP_A)


def test_tensor_and_expert_parallelism_free_memory_for_kv() -> None:
    hw = CAT.hardware.get("rtx-pro-6000-blackwell")
    qwen32 = CAT.models.get("qwen3-32b")
    assert kv_blocks_for(qwen32, hw, 2, SETUP_A) > kv_blocks_for(qwen32, hw, 1, SETUP_A)
    moe = CAT.models.get("qwen3-30b-a3b")
    assert kv_blocks_for(moe, hw, 1, SETUP_A, ep=2) > kv_blocks_for(moe, hw, 1, SETUP_A)


def test_kv_heads_fewer_than_ranks_are_replicated() -> None:
    moe = CAT.models.get("qwen3-30b-a3b")  # 4 KV heads
    hw = CAT.hardware.get("h100-80g-sxm")
    tp4 = kv_blocks_for(moe, hw, 4, SETUP_A)
    tp8 = kv_blocks_for(moe, hw, 8, SETUP_A)
    # At TP 8 each rank still holds one whole KV head: per-token KV bytes stop shrinking.
    assert tp8 < 1.5 * tp4

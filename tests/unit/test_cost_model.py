"""The cost model: the lessons card's figures, roofline behaviour, MoE and MLA, TP, the estimate command."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from actors.cost_model import (
    MP_IPC_BYTES_PER_PREFILL_SEQ,
    MP_IPC_BYTES_PER_PREFILL_TOKEN,
    MP_IPC_BYTES_PER_SEQ,
    MP_IPC_FIXED_BYTES,
    MP_IPC_NS_PER_BYTE,
    SYNC_REQUEST_CPU_US,
    SYNC_STEP_CPU_US,
    EmpiricalCostModel,
    RooflineCostModel,
    StepShape,
    capture_sizes,
    crossover,
    moe_work,
    ms_colocated,
    ms_disaggregated,
    request_colocated,
    small_kernels,
)
from cluster.estimate import estimate_profile, estimate_roofline
from config import default_catalog
from config.hardware import OpFit
from tests.conftest import REPO_ROOT

CAT = default_catalog()
LESSON = CAT.profiles.get("lesson-70b-fp8")


def test_lessons_card_closed_forms() -> None:
    assert ms_colocated(LESSON, 4096, 500) == pytest.approx(5102.4)
    assert ms_disaggregated(LESSON, 4096, 500, CAT.links.get("lesson-rdma")) == pytest.approx(2885.3, abs=0.05)
    assert ms_disaggregated(LESSON, 4096, 500, CAT.links.get("lesson-tcp")) == pytest.approx(2931.4, abs=0.05)


def test_estimate_command_prints_the_lessons_card_figures_as_json() -> None:
    out = subprocess.run([sys.executable, "run_cluster.py", "estimate", "--profile", "lesson-70b-fp8", "--prompt",
                          "4096", "--output", "500", "--json"], cwd=REPO_ROOT, capture_output=True, text=True,
                         check=True).stdout
    obj = json.loads(out.strip().splitlines()[-1])
    assert round(obj["colocated_ms"], 1) == 5102.4
    assert round(obj["disaggregated_rdma_ms"], 1) == 2885.3
    assert round(obj["disaggregated_tcp_ms"], 1) == 2931.4
    assert obj["ttft_ms"] == pytest.approx(102.4)
    assert obj["tpot_ms"] == pytest.approx(10.0)
    # disaggregated - colocated = 1.25e-3 P - 500 (10 - 5.556) over RDMA: zero at P = 1,777,778.
    assert obj["crossover_prompt_tokens"] == 1777778
    assert obj["crossover_prompt_tokens_tcp"] == 177778


def test_estimate_rejects_unknown_names_cleanly() -> None:
    r = subprocess.run([sys.executable, "run_cluster.py", "estimate", "--model", "nope", "--hardware",
                        "h100-80g-sxm", "--prompt", "10", "--output", "5"], cwd=REPO_ROOT, capture_output=True,
                       text=True)
    assert r.returncode != 0
    assert "unknown model 'nope'" in r.stderr


def test_empirical_step_uses_role_rate() -> None:
    co = EmpiricalCostModel(LESSON, "colocated")
    de = EmpiricalCostModel(LESSON, "decode")
    assert co.step(StepShape.of(prefills=[(4000, 0)])).total_ms == pytest.approx(100.0)
    assert co.step(StepShape.of(decodes=[10, 20, 30])).total_ms == pytest.approx(10.0)
    assert de.step(StepShape.of(decodes=[10])).total_ms == pytest.approx(1 / 0.18)
    assert co.step(StepShape()).total_ms == 0.0


def test_step_shape_aggregates() -> None:
    s = StepShape.of(prefills=[(4, 10), (2, 0)], decodes=[7, 9])
    assert (s.prefill_tokens, s.prefill_seqs, s.decode_seqs, s.decode_context) == (6, 2, 2, 16)
    assert s.prefill_pairs == 4 * 10 + 4 * 5 / 2 + 2 * 3 / 2
    assert s.kv_read_tokens == 10 + 16
    assert s.tokens == 8 and s.seqs == 4


def roofline(model: str = "llama-3.1-70b", hw: str = "h100-80g-sxm", tp: int = 4) -> RooflineCostModel:
    return RooflineCostModel(CAT.hardware.get(hw), CAT.models.get(model), tp)


def test_capture_sizes_follow_vllm() -> None:
    sizes = capture_sizes(256, 2048)
    assert sizes == (1, 2, 4, *range(8, 256, 8), *range(256, 513, 16))
    assert capture_sizes(128, 2048)[-1] == 256
    assert capture_sizes(256, 100)[-1] == 96  # capped by max_num_batched_tokens


def test_uniform_decode_replays_one_padded_graph() -> None:
    cm = roofline("llama-3.1-8b", tp=1)
    nine = cm.step(StepShape.of(decodes=[500] * 9))
    assert (nine.graph, nine.padded_tokens) == ("full", 16)
    # The layers' GEMMs run at the padded size; the LM head at the sequences sampled.
    m = cm.model
    assert nine.compute_ms == pytest.approx(cm.layer_gemms_ms(16) + cm.lm_head_ms(9))
    assert cm.lm_head_ms(9) == pytest.approx(cm.gemm_ms(9, m.vocab_size, m.hidden_size))  # a bf16 model


def test_fp8_models_keep_a_16bit_lm_head() -> None:
    # vLLM's Fp8Config quantizes LinearBase and FusedMoE layers only; ParallelLMHead stays 16-bit.
    hw = CAT.hardware.get("h100-80g-sxm")
    bf16 = RooflineCostModel(hw, CAT.models.get("llama-3.1-70b"), 4)
    fp8 = RooflineCostModel(hw, CAT.models.get("llama-3.1-70b-fp8"), 4)
    assert fp8.lm_head_ms(32) == pytest.approx(bf16.lm_head_ms(32))
    assert fp8.lm_head_ms(32) > fp8.gemm_ms(32, fp8.model.vocab_size / 4, fp8.model.hidden_size)


def test_small_kernels_move_the_architectures_bytes_and_add_to_every_step() -> None:
    m = CAT.models.get("llama-3.1-70b-fp8-kv8")
    k = small_kernels(m, 4, moe_layer=False)
    assert k == {"norm": 2 * 4 * 8192 * 2, "rotary": 2 * (16 * 128 + 2 * 128) * 2,
                 "kv_write": 2 * 2 * 128 * (2 + 1), "act": 3 * 28672 / 4 * 2}
    assert "act" not in small_kernels(CAT.models.get("qwen3-30b-a3b"), 1, moe_layer=True)
    cm = RooflineCostModel(CAT.hardware.get("h100-80g-sxm"), m, 4)
    step = cm.step(StepShape.of(decodes=[5000] * 32))
    # Four kernels per layer, each at least one kernel's latency in a graph; more bytes take longer.
    assert step.kernels_ms >= 80 * 4 * cm.eff.gemm.latency_us / 1e3
    assert cm.layer_kernels_ms(4096) > cm.layer_kernels_ms(32)
    assert step.total_ms == pytest.approx(step.compute_ms + step.memory_ms + step.comm_ms + step.overhead_ms
                                          + step.kernels_ms)


def test_synchronous_scheduling_adds_the_cpus_part_of_every_step() -> None:
    # Without async scheduling the GPU waits for schedule(), input preparation and update_from_output():
    # a fixed part per step and a part per scheduled sequence, counted as overhead; async hides them.
    hw, m = CAT.hardware.get("h100-80g-sxm"), CAT.models.get("llama-3.1-70b-fp8")
    hidden = RooflineCostModel(hw, m, 4)
    sync = RooflineCostModel(hw, m, 4, async_scheduling=False)
    for shape in (StepShape.of(decodes=[2000] * 16), StepShape.of(prefills=[(512, 0)], decodes=[900] * 3)):
        a, s = hidden.step(shape), sync.step(shape)
        cpu = (SYNC_STEP_CPU_US + SYNC_REQUEST_CPU_US * shape.seqs) / 1e3 + sync.executor_ipc_ms(shape)
        assert s.total_ms - a.total_ms == pytest.approx(cpu)
        assert s.overhead_ms - a.overhead_ms == pytest.approx(cpu)
        assert s.compute_ms == a.compute_ms and s.memory_ms == a.memory_ms
    assert sync.step(StepShape()).total_ms == 0.0


def test_synchronous_tp_steps_wait_for_the_multiprocess_executors_ipc() -> None:
    # TP > 1 without async scheduling: the step's scheduler output and rank 0's output are pickled through the
    # shared-memory queues while the GPUs wait; one GPU (in-process executor) and async scheduling pay none.
    hw, m = CAT.hardware.get("h100-80g-sxm"), CAT.models.get("llama-3.1-70b-fp8")
    decode, mixed = StepShape.of(decodes=[9000] * 32), StepShape.of(prefills=[(8192, 0)], decodes=[9000] * 31)
    for tp in (2, 4, 8):
        sync = RooflineCostModel(hw, m, tp, async_scheduling=False)
        hidden = RooflineCostModel(hw, m, tp)
        for shape in (decode, mixed):
            nbytes = (MP_IPC_FIXED_BYTES + MP_IPC_BYTES_PER_SEQ * shape.seqs
                      + MP_IPC_BYTES_PER_PREFILL_SEQ * shape.prefill_seqs
                      + MP_IPC_BYTES_PER_PREFILL_TOKEN * shape.prefill_tokens)
            ipc = nbytes * MP_IPC_NS_PER_BYTE / 1e6
            cpu = (SYNC_STEP_CPU_US + SYNC_REQUEST_CPU_US * shape.seqs) / 1e3
            assert sync.executor_ipc_ms(shape) == pytest.approx(ipc)
            assert sync.step(shape).overhead_ms - hidden.step(shape).overhead_ms == pytest.approx(cpu + ipc)
            assert hidden.executor_ipc_ms(shape) == 0.0
        # 32 decodes: about 4.2 KB each way, 58 us; an 8k-token prompt's ids add about half a millisecond.
        assert sync.executor_ipc_ms(decode) == pytest.approx(0.059, abs=0.002)
        assert sync.executor_ipc_ms(mixed) - sync.executor_ipc_ms(decode) == pytest.approx(0.49, abs=0.02)
    one = RooflineCostModel(hw, CAT.models.get("llama-3.1-8b"), 1, async_scheduling=False)
    assert one.executor_ipc_ms(decode) == 0.0
    assert RooflineCostModel(hw, m, 4, async_scheduling=False).executor_ipc_ms(StepShape()) == 0.0


def test_mixed_batches_run_piecewise_and_large_ones_eagerly() -> None:
    cm = RooflineCostModel(CAT.hardware.get("h100-80g-sxm"), CAT.models.get("llama-3.1-8b"), 1, max_num_seqs=128,
                           max_num_batched_tokens=2048)
    mixed = cm.step(StepShape.of(prefills=[(100, 0)], decodes=[500] * 8))
    assert (mixed.graph, mixed.padded_tokens) == ("piecewise", 112)
    decode = cm.step(StepShape.of(decodes=[500] * 9))  # as many sequences: same per-request overhead
    assert mixed.overhead_ms - decode.overhead_ms == pytest.approx(cm.eff.layer_overhead_us * 32 / 1e3)
    big = cm.step(StepShape.of(prefills=[(2000, 0)]))
    assert (big.graph, big.padded_tokens) == ("eager", 2000)
    eager = RooflineCostModel(cm.hardware, cm.model, 1, cudagraphs=False).step(StepShape.of(decodes=[500] * 9))
    assert (eager.graph, eager.padded_tokens) == ("eager", 9)


def test_llama_8b_decode_overheads_are_vllm_v1_sized() -> None:
    # vLLM v1 with CUDA graphs and async scheduling: 1-2 ms per step at 128 sequences (BLIS's H100 fit),
    # not the 2023 stack's ~26 ms.
    step = roofline("llama-3.1-8b", tp=1).step(StepShape.of(decodes=[1000] * 128))
    assert step.overhead_ms < 2.0
    assert step.total_ms < 30.0


def test_expert_parallelism_splits_experts_and_pays_all_to_all() -> None:
    hw, moe = CAT.hardware.get("rtx-pro-6000-blackwell"), CAT.models.get("qwen3-30b-a3b")
    one = RooflineCostModel(hw, moe, 1)
    ep2 = RooflineCostModel(hw, moe, 1, ep=2)
    shape = StepShape.of(decodes=[800] * 64)
    assert one.alltoall_ms(64) == 0.0 and ep2.alltoall_ms(64) > 0.0
    assert ep2.step(shape).comm_ms > 0.0
    assert RooflineCostModel(hw, CAT.models.get("qwen3-32b"), 2, ep=2).ep == 1  # a dense model: no effect


def test_fp8_models_run_the_fp8_gemm_fit() -> None:
    hw = CAT.hardware.get("h100-80g-sxm")
    bf16 = RooflineCostModel(hw, CAT.models.get("llama-3.1-70b"), 4)
    fp8 = RooflineCostModel(hw, CAT.models.get("llama-3.1-70b-fp8"), 4)
    shape = StepShape.of(decodes=[2000] * 64)
    assert fp8.step(shape).compute_ms < bf16.step(shape).compute_ms


def test_fp8_kv_cache_runs_its_own_decode_attention_fit() -> None:
    # fp8 KV decode kernels dequantize on the fly: on Hopper they take 0.66-0.9x the bf16 time on large caches,
    # not the 0.5x that half the bytes at the bf16 fit would say. The model reads the fp8 fit (H200: 0.74x).
    hw = CAT.hardware.get("h200-141g-sxm")
    assert hw.efficiency.attention_decode_fp8 is not None
    kv8 = RooflineCostModel(hw, CAT.models.get("llama-3.1-70b-fp8-kv8"), 1)
    kv16 = RooflineCostModel(hw, CAT.models.get("llama-3.1-70b-fp8"), 1)
    shape = StepShape.of(decodes=[9000] * 32)
    assert kv8.attention_ms(shape) > 0.65 * kv16.attention_ms(shape)
    slow = hw.efficiency.model_copy(update={"attention_decode_fp8": OpFit(latency_us=1000.0)})
    assert RooflineCostModel(hw, CAT.models.get("llama-3.1-70b-fp8-kv8"), 1, slow).attention_ms(
        StepShape.of(decodes=[100])) >= 1.0
    assert RooflineCostModel(hw, CAT.models.get("llama-3.1-70b-fp8"), 1, slow).attention_ms(
        StepShape.of(decodes=[100])) < 1.0  # a bf16 cache never reads the fp8 fit


def test_single_gpu_has_no_allreduce_and_tp_adds_it() -> None:
    assert roofline("llama-3.1-8b", tp=1).allreduce_ms(4096) == 0.0
    assert roofline("llama-3.1-8b", tp=2).allreduce_ms(4096) > 0.0
    assert roofline(tp=8).allreduce_ms(4096) > roofline(tp=2).allreduce_ms(4096)


def test_tensor_parallelism_speeds_up_a_large_prefill() -> None:
    shape = StepShape.of(prefills=[(8192, 0)])
    assert roofline(tp=8).step(shape).total_ms < roofline(tp=2).step(shape).total_ms


def test_faster_hardware_is_faster() -> None:
    shape = StepShape.of(decodes=[2000] * 32)
    assert roofline(hw="h200-141g-sxm").step(shape).total_ms < roofline(hw="h100-80g-sxm").step(shape).total_ms
    assert roofline(hw="h100-80g-sxm").step(shape).total_ms < roofline(hw="a100-80g-sxm").step(shape).total_ms


def test_moe_reads_only_touched_experts_and_computes_active_params() -> None:
    moe = CAT.models.get("qwen3-30b-a3b")
    assert moe.active_params_b == pytest.approx(3.3, abs=0.05)
    one = moe.expert_weight_bytes_read(1)
    assert one == pytest.approx(28.99e9 * 2 * 8 / 128)
    assert moe.expert_weight_bytes_read(10_000) == pytest.approx(28.99e9 * 2, rel=1e-6)
    assert moe.expert_weight_bytes_read(4) < moe.expert_weight_bytes_read(64)
    dense = CAT.models.get("qwen3-32b")
    hw = CAT.hardware.get("h100-80g-sxm")
    shape = StepShape.of(decodes=[1000])
    assert RooflineCostModel(hw, moe).step(shape).total_ms < RooflineCostModel(hw, dense).step(shape).total_ms


def test_fused_moe_intermediates_cover_every_routed_pair_whatever_the_ep() -> None:
    # vLLM's Triton fused_experts sizes its intermediate tensors by tokens x topk and writes zeros for the
    # pairs routed to another rank's experts: with wide EP that traffic, not the experts, is the floor.
    tokens, hidden, inter, topk, experts = 16384.0, 7168, 2048, 8, 256
    floor = tokens * topk * (2 * 2 * inter + inter + 2 * hidden) * 2
    flops_1, bytes_1, pairs_1, _ = moe_work(tokens, hidden, inter, topk, experts, 1, 1, 1.0)
    flops_256, bytes_256, pairs_256, _ = moe_work(tokens, hidden, inter, topk, experts, 1, 256, 1.0)
    assert pairs_256 == pytest.approx(pairs_1 / 256) and flops_256 == pytest.approx(flops_1 / 256)
    assert floor < bytes_256 < 1.01 * floor  # the one expert's weights and its pairs' inputs are the rest
    assert bytes_1 > bytes_256
    one_token = moe_work(1.0, hidden, inter, topk, experts, 1, 1, 1.0)[1]
    assert one_token == pytest.approx(topk * 3 * hidden * inter + (topk * (hidden + inter)
                                      + topk * (5 * inter + 2 * hidden)) * 2)


def test_kv_bytes_per_token_follow_the_architecture() -> None:
    assert CAT.models.get("llama-3.1-8b").kv_bytes_per_token == 2 * 32 * 8 * 128 * 2
    assert CAT.models.get("llama-3.1-70b").kv_bytes_per_token == 2 * 80 * 8 * 128 * 2
    assert CAT.models.get("bloom-176b").kv_bytes_per_token == 2 * 70 * 112 * 128 * 2
    # MLA: one latent (512) plus the rope key (64) per layer, not 2 x heads x head_dim.
    assert CAT.models.get("deepseek-v3").kv_bytes_per_token == 61 * (512 + 64) * 2


@settings(max_examples=200, deadline=None)
@given(st.integers(0, 4096), st.integers(0, 8192), st.integers(0, 64), st.integers(1, 8000),
       st.sampled_from(["llama-3.1-8b", "qwen3-30b-a3b", "deepseek-v3", "llama-3.1-70b"]), st.sampled_from([1, 2, 8]))
def test_more_work_never_takes_less_time(n: int, ctx: int, decodes: int, dctx: int, model: str, tp: int) -> None:
    cm = RooflineCostModel(CAT.hardware.get("b200-180g-sxm"), CAT.models.get(model), tp)
    base = StepShape.of(prefills=[(n, ctx)] if n else [], decodes=[dctx] * decodes)
    more_tokens = StepShape.of(prefills=[(n + 16, ctx)], decodes=[dctx] * decodes)
    more_ctx = StepShape.of(prefills=[(n, ctx + 512)] if n else [], decodes=[dctx + 512] * decodes)
    more_seqs = StepShape.of(prefills=[(n, ctx)] if n else [], decodes=[dctx] * (decodes + 1))
    t = cm.step(base).total_ms
    assert cm.step(more_tokens).total_ms >= t
    assert cm.step(more_ctx).total_ms >= t
    assert cm.step(more_seqs).total_ms >= t
    assert (t == 0.0) == base.empty


def test_chunked_prefill_on_one_gpu_costs_more_than_one_whole_step() -> None:
    # On one GPU each chunk re-reads the weights and pays the step overhead.
    cm = roofline("llama-3.1-8b", tp=1)
    whole = request_colocated(cm, 16384, 2, 16384).prefill_ms
    chunked = request_colocated(cm, 16384, 2, 2048).prefill_ms
    assert chunked > whole


def test_crossover_bisects_to_the_exact_integer() -> None:
    assert crossover(lambda p: p - 1000.5) == 1001
    assert crossover(lambda p: 5.0) is None


def test_roofline_estimate_on_identical_hardware_never_favours_disaggregation() -> None:
    est = estimate_roofline(CAT, "llama-3.1-70b", "h100-80g-sxm", 4, 4096, 200)
    assert est.rdma.e2e_ms > est.colocated.e2e_ms
    assert est.tcp.e2e_ms > est.rdma.e2e_ms
    assert est.crossover_rdma is None
    assert est.rdma.ttft_ms == est.colocated.ttft_ms
    # Faster decode hardware can pay for the transfer.
    mixed = estimate_roofline(CAT, "llama-3.1-70b", "a100-80g-sxm", 4, 1024, 500, decode_hardware="h200-141g-sxm")
    assert mixed.rdma.e2e_ms < mixed.colocated.e2e_ms


def test_profile_estimate_json_keys() -> None:
    obj = estimate_profile(CAT, "lesson-70b-fp8", 1000, 10).to_json()
    for key in ("colocated_ms", "disaggregated_rdma_ms", "disaggregated_tcp_ms", "ttft_ms", "tpot_ms",
                "crossover_prompt_tokens"):
        assert key in obj

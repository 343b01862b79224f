"""An op table's MoE rows are predicted with the routing they measured on the timed rank (aiconfigurator's
deterministic balanced routing, or its power law with the most-loaded EP rank timed), not the serving model's
expected uniform routing."""

from __future__ import annotations

import numpy as np
import pytest

from actors.calibration import OpSamples, fit_op, op_error
from actors.calibration_routing import balanced_rank0, moe_table_work, power_law_rank0
from actors.cost_model import RooflineCostModel, moe_work
from config import default_catalog
from config.hardware import OpFit

CAT = default_catalog()


def test_power_law_rank0_holds_the_most_loaded_groups_pairs_on_fewer_experts() -> None:
    tokens, topk, experts = 16, 8, 128
    pairs, touched = power_law_rank0(tokens, topk, experts, 1, 1.01)
    assert pairs == tokens * topk  # one rank holds every pair
    uniform_touched = moe_work(tokens, 1024, 512, topk, experts, 1, 1, 2.0)[3] / 512
    assert touched < 0.9 * uniform_touched  # a skewed routing leaves experts idle that uniform routing reads
    for ep in (2, 8, 32):
        pairs_ep, touched_ep = power_law_rank0(tokens, topk, experts, ep, 1.01)
        assert tokens * topk / ep < pairs_ep <= tokens * topk  # the busiest group is swapped to the timed rank
        assert touched_ep <= experts / ep
    assert power_law_rank0(tokens, topk, experts, 8, 1.01) == power_law_rank0(tokens, topk, experts, 8, 1.01)
    with pytest.raises(ValueError, match="ep dividing experts"):
        power_law_rank0(tokens, topk, experts, 3, 1.01)
    with pytest.raises(ValueError, match="unknown MoE routing"):
        moe_table_work({}, "zipf", 2.0)


def test_balanced_routing_puts_token_zeros_first_expert_on_rank_zero() -> None:
    # Uniform routing expects topk / ep of a pair on a rank for one token; balanced_logits sends token 0 to expert 0.
    assert moe_work(1.0, 1024, 512, 8, 256, 1, 256, 2.0)[2] == pytest.approx(8 / 256)
    assert balanced_rank0(1, 8, 256, 256) == (1.0, 1.0)
    assert balanced_rank0(16384, 8, 256, 256) == (16384 * 8 / 256, 1.0)  # many tokens: the uniform share
    assert balanced_rank0(64, 8, 256, 1) == (512.0, 256.0)  # stride 32 covers every expert twice
    with pytest.raises(ValueError, match="ep dividing experts"):
        balanced_rank0(4, 8, 256, 3)


@pytest.mark.parametrize("distribution", ["power_law_1.01", "balanced"])
def test_fit_recovers_a_moe_table_timed_under_its_routing(distribution: str) -> None:
    # A table timed on the collector's rank 0 (a known roofline on that rank's work): fitted with the routing it
    # measured, the roofline comes back; fitted as if routing were uniform (the old fit), it cannot.
    grid = [(nt, ep) for nt in (1, 4, 16, 64, 256, 1024, 4096, 16384) for ep in (1, 2, 8, 32)]
    t = {"num_tokens": np.array([g[0] for g in grid]), "hidden_size": np.full(len(grid), 2048),
         "inter_size": np.full(len(grid), 768), "topk": np.full(len(grid), 8), "num_experts": np.full(len(grid), 128),
         "moe_tp_size": np.ones(len(grid), dtype=int), "moe_ep_size": np.array([g[1] for g in grid])}
    peak_f, peak_b = 1e9, 2e6
    true = OpFit(latency_us=20.0, compute=[0.5] * 16, memory=[0.7] * 12)
    skew = moe_table_work(t, distribution, 2.0)
    measured = np.array([true.ms(f, b, z, peak_f, peak_b) for f, b, z, _ in skew])
    routed = OpSamples("moe", "synthetic", skew[:, 0], skew[:, 1], skew[:, 2], measured, peak_f, peak_b)
    uni = np.array([moe_work(float(nt), 2048, 768, 8, 128, 1, int(ep), 2.0) for nt, ep in grid])
    blind = OpSamples("moe", "synthetic", uni[:, 0], uni[:, 1], uni[:, 2], measured, peak_f, peak_b)
    err = op_error("x", fit_op(routed), routed)
    assert err.median < 0.02
    assert op_error("x", fit_op(blind), blind).p90 > 3 * max(err.p90, 0.02)  # balanced: only few-token wide-EP rows


def test_fit_recovers_a_time_per_routed_pair_and_the_cost_model_pays_it() -> None:
    # Wide-EP rows whose time carries 5 ns per routed pair of every rank (B200's table: EP 256 as slow as H100's
    # at 16,384 tokens): the fit finds the term with outputs = tokens x topk, a bytes/FLOPs-only fit cannot.
    grid = [(nt, ep) for nt in (1, 8, 64, 256, 1024, 4096, 16384) for ep in (1, 4, 16, 64)]
    work = np.array([moe_work(float(nt), 2048, 768, 8, 128, 1, ep, 2.0) for nt, ep in grid])
    routed = np.array([nt * 8.0 for nt, _ in grid])
    peak_f, peak_b = 1e12, 3e9  # per ms: 1 PFLOP/s, 3 TB/s
    true = OpFit(latency_us=20.0, compute=[0.5] * 16, memory=[0.7] * 12, output_ns=5.0)
    measured = np.array([true.ms(f, b, z, peak_f, peak_b, outputs=o) for (f, b, z, _), o in zip(work, routed,
                                                                                               strict=True)])
    s = OpSamples("moe", "synthetic", work[:, 0], work[:, 1], work[:, 2], measured, peak_f, peak_b, outputs=routed)
    fit = fit_op(s)
    assert fit.output_ns == pytest.approx(5.0, rel=0.2)
    err = op_error("x", fit, s)
    blind = OpSamples("moe", "synthetic", work[:, 0], work[:, 1], work[:, 2], measured, peak_f, peak_b)
    assert err.median < 0.02 and op_error("x", fit_op(blind), blind).p90 > 3 * max(err.p90, 0.02)

    hw = CAT.hardware.get("h100-80g-sxm")
    model = CAT.models.get("qwen3-30b-a3b")
    assert model.moe is not None
    flat = hw.efficiency.model_copy(update={"moe": hw.efficiency.moe.model_copy(update={"output_ns": 0.0})})
    per_pair = hw.efficiency.model_copy(update={"moe": hw.efficiency.moe.model_copy(update={"output_ns": 2.0})})
    tokens, dp = 64, 2  # EP 2 over DP 2: the fused MoE walks both ranks' pairs
    extra = (RooflineCostModel(hw, model, 1, per_pair, ep=2).layer_gemms_ms(tokens)
             - RooflineCostModel(hw, model, 1, flat, ep=2).layer_gemms_ms(tokens))
    assert extra == pytest.approx(model.moe.moe_layers * tokens * dp * model.moe.experts_per_token * 2.0 / 1e6)

"""An op table's MoE rows are predicted with the routing they measured on the timed rank (aiconfigurator's
deterministic balanced routing, or its power law with the most-loaded EP rank timed), not the serving model's
expected uniform routing."""

from __future__ import annotations

import numpy as np
import pytest

from actors.calibration import OpSamples, fit_op, op_error
from actors.calibration_routing import balanced_rank0, moe_table_work, power_law_rank0
from actors.cost_model import moe_work
from config.hardware import OpFit


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

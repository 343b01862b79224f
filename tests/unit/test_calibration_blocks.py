"""A fused MoE's Triton blocks (``OpFit.moe_block_m``, ``moe_block_tokens``, ``MOE_BLOCK_TABLES``): each expert's
pairs are padded to whole ``BLOCK_SIZE_M`` blocks, 16 while the tokens are at most the rank's experts and 64 after
(vLLM's default config), or by token thresholds (tuned configs); the fit recovers a table timed on the padded pairs
where the routed pairs cannot, and the cost model pays them."""

from __future__ import annotations

import math

import numpy as np
import pytest

from actors.calibration import OpSamples, fit_op, op_error
from actors.calibration_tables import MOE_BLOCK_M, MOE_TUNED_BLOCK_M, moe_blocks
from actors.cost_model import RooflineCostModel, moe_work
from config import default_catalog
from config.hardware import OpFit

CAT = default_catalog()
BLOCKS = list(MOE_BLOCK_M)


def test_moe_work_pads_each_touched_experts_pairs_to_the_block_of_its_token_count() -> None:
    flops, nbytes, pairs, width = moe_work(4.0, 1024, 512, 2, 8, 1, 1, 2.0)
    p_flops, p_bytes, padded, p_width = moe_work(4.0, 1024, 512, 2, 8, 1, 1, 2.0, block_m=BLOCKS)
    touched = 8 * (1 - (1 - 2 / 8) ** 4)  # 4 tokens <= 8 local experts: blocks of 16, one per touched expert
    assert pairs == 8 and padded == pytest.approx(touched * 16)
    assert p_flops == pytest.approx(flops * padded / pairs) and (p_bytes, p_width) == (nbytes, width)
    # 64 tokens > 8 experts: blocks of 64; 16 pairs per expert fill a quarter of one
    assert moe_work(64.0, 1024, 512, 2, 8, 1, 1, 2.0, block_m=BLOCKS)[2] == pytest.approx(8 * 64, rel=1e-6)
    # pairs past a block take whole blocks: 4,096 tokens x 2 / 8 experts = 1,024 pairs each = 16 blocks of 64
    assert moe_work(4096.0, 1024, 512, 2, 8, 1, 1, 2.0, block_m=BLOCKS)[2] == pytest.approx(4096 * 2, rel=1e-6)
    # thresholds (a tuned config's M keys): 16 to 16 tokens, 32 to 64, 64 to 512, 128 beyond, whatever the experts
    blocks, thresholds = MOE_TUNED_BLOCK_M
    for tokens, block in ((16, 16), (17, 32), (64, 32), (65, 64), (512, 64), (513, 128)):
        touched = 8 * (1 - (1 - 2 / 8) ** tokens)
        want = touched * math.ceil(tokens * 2 / touched / block - 1e-9) * block
        assert moe_work(float(tokens), 1024, 512, 2, 8, 1, 1, 2.0, block_m=blocks,
                        block_tokens=thresholds)[2] == pytest.approx(want)
    with pytest.raises(ValueError, match="moe_block_m"):
        OpFit(moe_block_m=[16])
    with pytest.raises(ValueError, match="moe_block_tokens"):
        OpFit(moe_block_m=[16, 64], moe_block_tokens=[64, 32])
    assert moe_blocks("a100-80g-sxm", "moe") == {"moe_block_m": BLOCKS, "moe_block_tokens": []}
    assert moe_blocks("b200-180g-sxm", "moe_fp8")["moe_block_tokens"] == list(MOE_TUNED_BLOCK_M[1])
    assert moe_blocks("h100-80g-sxm", "moe") == {"moe_block_m": [], "moe_block_tokens": []}


def test_fit_recovers_a_moe_table_timed_on_padded_pairs() -> None:
    # Rows across the block switch (tokens = local experts: 128, 32, 8) timed on the padded pairs: fitted on them the
    # roofline comes back, fitted on the routed pairs (a smooth curve in pairs) it cannot follow the switch.
    grid = [(nt, ep) for nt in (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 2048, 8192) for ep in (1, 4, 16)]
    args = [(float(nt), 4096, 1536, 8, 128, 1, ep, 2.0) for nt, ep in grid]
    padded = np.array([moe_work(*a, block_m=BLOCKS) for a in args])
    routed = np.array([moe_work(*a) for a in args])
    peak_f, peak_b = 1e9, 1e10  # per ms: 1 TFLOP/s, 10 TB/s: compute-bound, where the padding shows
    true = OpFit(latency_us=15.0, compute=[0.6] * 16, memory=[0.7] * 12)
    measured = np.array([true.ms(f, b, z, peak_f, peak_b) for f, b, z, _ in padded])
    fit_s = OpSamples("moe", "synthetic", padded[:, 0], padded[:, 1], padded[:, 2], measured, peak_f, peak_b)
    blind_s = OpSamples("moe", "synthetic", routed[:, 0], routed[:, 1], routed[:, 2], measured, peak_f, peak_b)
    err, blind = op_error("x", fit_op(fit_s), fit_s), op_error("x", fit_op(blind_s), blind_s)
    assert err.median < 0.02
    assert blind.p90 > 3 * max(err.p90, 0.02)


def test_cost_model_reads_its_moe_at_the_padded_pairs() -> None:
    hw = CAT.hardware.get("a100-80g-sxm")
    model = CAT.models.get("qwen3-30b-a3b")
    assert model.moe is not None
    plain = hw.efficiency.moe.model_copy(update={"moe_block_m": []})
    eff = {name: hw.efficiency.model_copy(update={"moe": fit, "moe_fp8": fit})
           for name, fit in (("plain", plain), ("blocks", plain.model_copy(update={"moe_block_m": BLOCKS})))}
    e = model.moe
    for tokens in (4, 1024):  # few tokens: blocks of 16; past the 128 experts: of 64
        gemms = {k: RooflineCostModel(hw, model, 1, v).layer_gemms_ms(tokens) for k, v in eff.items()}
        flops, nbytes, size, width = moe_work(float(tokens), model.hidden_size, model.expert_width,
                                              e.experts_per_token, e.num_experts, 1, 1, 2.0, model.mlp_gated,
                                              block_m=BLOCKS)
        pairs = tokens * e.experts_per_token
        assert size > pairs or math.isclose(size, pairs)
        flops_ms = hw.tflops("bf16") * 1e9
        bytes_ms = hw.hbm_bandwidth_gbps * 1e6
        moe_pad = plain.ms(flops, nbytes, size, flops_ms, bytes_ms, width, outputs=pairs)
        moe_raw = plain.ms(*moe_work(float(tokens), model.hidden_size, model.expert_width, e.experts_per_token,
                                     e.num_experts, 1, 1, 2.0, model.mlp_gated)[:3], flops_ms, bytes_ms, width,
                           outputs=pairs)
        assert gemms["blocks"] - gemms["plain"] == pytest.approx(e.moe_layers * (moe_pad - moe_raw))

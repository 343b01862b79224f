"""A decode attention's depth curve by context (``CONTEXT_DEPTH_TABLES``): the fit recovers a table whose short
contexts stream faster than its bytes curve, and the cost model reads the curve at a step's mean context."""

from __future__ import annotations

import numpy as np
import pytest

from actors.calibration import OpSamples, fit_op, op_error
from actors.cost_model import RooflineCostModel, StepShape
from config import default_catalog
from config.hardware import DEPTH_KNOTS, OpFit

CAT = default_catalog()


def test_fit_recovers_a_decode_attention_depth_curve_by_context() -> None:
    # Decode rows (batch b, context c) whose KV at c <= 128 streams 1.4x faster than the bytes curve allows (fading
    # to 1 at c = 512): with the context as depth the fit finds it; a bytes-only fit cannot.
    rng = np.random.default_rng(4)
    b = 2.0 ** rng.integers(0, 10, 600)
    c = 2.0 ** rng.integers(2, 17, 600)
    kvh, d = 8.0, 128.0
    nbytes = b * c * 2 * kvh * d * 2 + 2 * b * 4 * kvh * d * 2
    peak_b = 2e6
    gain = np.interp(np.log2(c), [7.0, 9.0], [1.4, 1.0])
    t = 10e-3 + nbytes / (peak_b * 0.7 * gain)
    with_ctx = OpSamples("attention_decode", "synthetic", np.zeros_like(b), nbytes, b, t, 1.0, peak_b, depth=c)
    fit = fit_op(with_ctx)
    assert len(fit.depth) == len(DEPTH_KNOTS) and fit.depth[-1] == 1.0
    assert fit.depth_eff(64) == pytest.approx(1.4, rel=0.1)
    err = op_error("x", fit, with_ctx)
    assert err.median < 0.02
    blind = op_error("x", fit_op(OpSamples("attention_decode", "synthetic", np.zeros_like(b), nbytes, b, t, 1.0,
                                           peak_b)), with_ctx)
    assert blind.p90 > 2 * err.p90 and blind.median > err.median  # same bytes, other contexts: bytes alone can't


def test_cost_model_reads_the_decode_depth_curve_at_the_mean_context() -> None:
    hw = CAT.hardware.get("h100-80g-sxm")
    flat = hw.efficiency.attention_decode.model_copy(update={"depth": []})
    deep = flat.model_copy(update={"depth": [2.0, 2.0, 1.0, 1.0, 1.0, 1.0, 1.0]})  # 2x at contexts <= 64
    model = CAT.models.get("llama-3.1-8b")

    def attention(fit: OpFit, contexts: list[int]) -> float:
        eff = hw.efficiency.model_copy(update={"attention_decode": fit, "attention_decode_fp8": None})
        return RooflineCostModel(hw, model, 1, eff).attention_ms(StepShape.of(decodes=contexts))

    short, long = [32] * 16, [4096] * 16
    assert attention(deep, short) < 0.9 * attention(flat, short)  # the curve speeds up short contexts
    assert attention(deep, long) == pytest.approx(attention(flat, long))  # and leaves deep ones alone
    mixed = [16, 48] * 8  # mean 32: read at the mean context, not per sequence
    assert attention(deep, mixed) < 0.9 * attention(flat, mixed)

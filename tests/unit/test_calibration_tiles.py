"""A GEMM kernel dispatch's m buckets (``OpFit.m_tiles``, ``GEMM_TILE_TABLES``): m is padded to its bucket (past
the last, to a multiple of it, an unaligned m one tile more), the fit recovers a table timed that way where a
smooth curve in m cannot, and the cost model reads its GEMMs at the padded m."""

from __future__ import annotations

import numpy as np
import pytest

from actors.calibration import OpSamples, fit_op, op_error
from actors.calibration_tables import GEMM_TILE_SERVED, GEMM_TILE_TABLES, m_tiles, served_m_tiles
from actors.cost_model import RooflineCostModel, gemm_bytes
from config import default_catalog
from config.hardware import OpFit

CAT = default_catalog()
TILES = [16, 64, 128, 256]


def test_padded_m_takes_the_bucket_then_whole_tiles(monkeypatch: pytest.MonkeyPatch) -> None:
    fit = OpFit(m_tiles=TILES)
    assert [fit.padded_m(m) for m in (1, 16, 17, 64, 65, 129, 256)] == [16, 16, 64, 64, 128, 256, 256]
    assert [fit.padded_m(m) for m in (512, 257, 513, 4096, 4097)] == [512, 768, 1024, 4096, 4608]
    assert OpFit().padded_m(257) == 257 and fit.padded_m(0) == 0
    monkeypatch.setitem(GEMM_TILE_TABLES, ("h200-141g-sxm", "gemm_fp8"), ((16, 64, 128, 256), "test"))
    assert m_tiles("h200-141g-sxm", "gemm_fp8") == TILES and m_tiles("h200-141g-sxm", "gemm") == []
    with pytest.raises(ValueError, match="ascending"):
        OpFit(m_tiles=[64, 16])


def test_fit_recovers_a_table_timed_at_the_padded_m() -> None:
    # A table timed at m padded to its bucket (t(257) is t(768)): with the padded m the fit matches it, a smooth
    # curve in the raw m cannot (the steps at 16/64/128/256 + 1 and the unaligned rows past 256).
    rng = np.random.default_rng(5)
    grid = np.array([1, 8, 16, 17, 32, 48, 64, 65, 96, 128, 129, 192, 256, 257, 512, 513, 768, 769, 1024, 1025,
                     2048, 2049, 4096, 4097, 8192], dtype=float)
    m = rng.choice(grid, 800)
    n = 2.0 ** rng.integers(10, 15, 800)
    k = 2.0 ** rng.integers(10, 15, 800)
    tiled = OpFit(m_tiles=TILES)
    mp = np.array([tiled.padded_m(x) for x in m])
    peak_f, peak_b = 2e9, 5e6
    t = 4e-3 + np.maximum(2 * mp * n * k / (peak_f * 0.7), gemm_bytes(mp, n, k, 1.0) / (peak_b * 0.8))
    padded = OpSamples("gemm_fp8", "synthetic", 2 * mp * n * k, gemm_bytes(mp, n, k, 1.0), mp, t, peak_f, peak_b)
    raw = OpSamples("gemm_fp8", "synthetic", 2 * m * n * k, gemm_bytes(m, n, k, 1.0), m, t, peak_f, peak_b)
    fit, blind = fit_op(padded), fit_op(raw)
    assert op_error("x", fit, padded).median < 0.02
    assert op_error("x", blind, raw).p90 > 3 * op_error("x", fit, padded).p90


def test_cost_model_reads_its_gemms_at_the_padded_m() -> None:
    hw = CAT.hardware.get("h200-141g-sxm")
    smooth = hw.efficiency.gemm_fp8.model_copy(update={"m_tiles": []})
    tiled = smooth.model_copy(update={"m_tiles": TILES})
    model = CAT.models.get("llama-3.1-70b-fp8")  # fp8 GEMMs: the gemm_fp8 fit

    def gemm(fit: OpFit, m: float) -> float:
        eff = hw.efficiency.model_copy(update={"gemm_fp8": fit, "gemm_fp8_bf16_bound": False})
        cost = RooflineCostModel(hw, model, 1, eff)
        return cost.gemm_ms(m, 4096, 4096)

    assert gemm(tiled, 257) == pytest.approx(gemm(smooth, 768))  # an unaligned m past 256 pays a tile more
    assert gemm(tiled, 256) == pytest.approx(gemm(smooth, 256))  # a bucket's own m is unchanged
    assert gemm(tiled, 17) == pytest.approx(gemm(smooth, 64)) and gemm(tiled, 17) > gemm(smooth, 17)


@pytest.mark.parametrize("gpu", ["h100-80g-sxm", "h200-141g-sxm"])
def test_hopper_fits_its_fp8_table_at_the_padded_m_and_serves_the_curve_at_the_served_m(gpu: str) -> None:
    # GEMM_TILE_TABLES without GEMM_TILE_SERVED: the calibration reads the table's rows at the padded m, the preset's
    # fit carries no m_tiles, so the cost model reads the fitted curve at the m it serves (257 stays 257). Both
    # Hopper parts alike: same die, same kernels, the same unaligned rows in their tables.
    assert m_tiles(gpu, "gemm_fp8") == TILES and served_m_tiles(gpu, "gemm_fp8") == []
    assert m_tiles(gpu, "gemm") == []  # the 16-bit tables have no unaligned step (t(256j+1)/t(256j) ~1.01)
    assert set(GEMM_TILE_TABLES) >= GEMM_TILE_SERVED
    hw = CAT.hardware.get(gpu)
    fit = hw.efficiency.gemm_fp8
    assert fit.m_tiles == [] and fit.padded_m(257) == 257
    model = CAT.models.get("llama-3.1-70b-fp8")
    eff = hw.efficiency.model_copy(update={"gemm_fp8_bf16_bound": False})
    cost = RooflineCostModel(hw, model, 1, eff)
    m, n, k = 257, 4096, 4096
    read = fit.ms(2.0 * m * n * k, gemm_bytes(m, n, k, 1.0), m, hw.tflops("fp8") * 1e9, hw.hbm_bandwidth_gbps * 1e6, n,
                  depth=k, outputs=m * n)
    assert cost.gemm_ms(m, n, k) == pytest.approx(read)

"""Profile import: the step-time table's format, its errors, and the cost model that interpolates it."""

from __future__ import annotations

from pathlib import Path

import pytest
from pydantic import ValidationError

from actors.cost_model import RooflineCostModel, StepShape
from actors.engine.factory import build_engine
from actors.profile_cost import ProfileCostModel
from config.catalog import default_catalog
from config.cluster import ClusterSpec
from config.errors import ConfigError
from config.step_profile import load_step_profile, parse_step_profile

TABLE = """# a profiled GPU
kind,tokens,context,ms
decode,1,1000,10
decode,1,3000,12
decode,64,1000,14
decode,64,3000,20
prefill,512,0,40
prefill,1024,0,80
"""


def model(text: str = TABLE) -> ProfileCostModel:
    return ProfileCostModel(parse_step_profile(text), name="m", kv_bytes_per_token=1, max_context=10_000)


def test_grid_points_come_back_exactly() -> None:
    m = model()
    assert m.step(StepShape.of(decodes=[1000])).total_ms == pytest.approx(10)
    assert m.step(StepShape.of(decodes=[3000] * 64)).total_ms == pytest.approx(20)
    assert m.step(StepShape.of(prefills=[(1024, 0)])).total_ms == pytest.approx(80)


def test_interpolation_is_linear_between_points() -> None:
    m = model()
    # Halfway in both batch (1 -> 64 at 32.5) and context (1000 -> 3000 at 2000): mean of the four corners.
    assert m.step(StepShape.of(decodes=[2000] * 32 + [2000])).total_ms == pytest.approx(
        (10 + 12 + 14 + 20) / 4, rel=0.02)
    assert m.step(StepShape.of(prefills=[(768, 0)])).total_ms == pytest.approx(60)


def test_extrapolation_is_linear_and_never_below_the_floor() -> None:
    m = model()
    assert m.step(StepShape.of(prefills=[(2048, 0)])).total_ms == pytest.approx(160)
    tiny = m.step(StepShape.of(prefills=[(16, 0)])).total_ms
    assert 0 < tiny <= 40
    assert m.step(StepShape()).total_ms == 0.0


def test_decodes_in_a_mixed_step_count_as_tokens() -> None:
    m = model()
    mixed = m.step(StepShape.of(prefills=[(512, 0)], decodes=[1000] * 256)).total_ms
    assert mixed == pytest.approx(m.step(StepShape.of(prefills=[(768, 0)])).total_ms)


def test_one_context_value_makes_time_depend_on_tokens_only() -> None:
    m = model()
    assert m.step(StepShape.of(prefills=[(512, 4000)])).total_ms == pytest.approx(40)


@pytest.mark.parametrize(("text", "where", "what"), [
    (TABLE.replace("decode,64,3000,20", "decode,64,3000,fast"), "line 6, column ms", "valid number"),
    (TABLE.replace("decode,64,1000,14", "encode,64,1000,14"), "line 5, column kind", "'decode' or 'prefill'"),
    (TABLE.replace("prefill,512,0,40", "prefill,0,0,40"), "line 7, column tokens", "greater than or equal to 1"),
    (TABLE.replace("prefill,512,0,40", "prefill,512,0"), "line 7", "expected 4 columns"),
    (TABLE.replace("kind,tokens,context,ms", "kind,tokens,ms"), "line 2", "header must be"),
    (TABLE.replace("decode,64,3000,20\n", ""), "kind decode", "tokens=64, context=3000 is missing"),
    (TABLE + "prefill,512,0,41\n", "line 9", "duplicate prefill point"),
    ("kind,tokens,context,ms\ndecode,1,0,1\n", "kind prefill", "no 'prefill' rows"),
])
def test_a_bad_file_names_the_row_and_column(text: str, where: str, what: str) -> None:
    with pytest.raises(ConfigError) as err:
        parse_step_profile(text, "p.csv")
    assert any(path == where and what in reason for path, reason in err.value.problems), err.value.problems
    assert "p.csv" in str(err.value)


def test_load_reads_a_file_and_names_a_missing_one(tmp_path: Path) -> None:
    path = tmp_path / "gpu.csv"
    path.write_text(TABLE)
    assert load_step_profile(path).decode.tokens == (1, 64)
    with pytest.raises(ConfigError, match="cannot read"):
        load_step_profile(tmp_path / "none.csv")


def spec(tmp_path: Path, step_profile: str | None, **sched: object) -> ClusterSpec:
    group: dict[str, object] = {"name": "e", "model": "llama-3.1-8b", "scheduler": sched}
    if step_profile is not None:
        group["step_profile"] = step_profile
    return ClusterSpec.model_validate({"name": "c", "nodes": [
        {"name": "n", "region": "local", "hardware": "h100-80g-sxm", "engines": [group]}]})


def test_an_engine_spec_selects_the_profile_instead_of_the_roofline(tmp_path: Path) -> None:
    path = tmp_path / "gpu.csv"
    path.write_text(TABLE)
    cfg, cost = build_engine(spec(tmp_path, str(path), long_prefill_token_threshold=256, policy="priority",
                                  async_scheduling=False).engines()[0])
    assert isinstance(cost, ProfileCostModel)
    assert cost.step(StepShape.of(decodes=[1000])).total_ms == pytest.approx(10)
    assert cost.kv_bytes_per_token == default_catalog().models.get("llama-3.1-8b").kv_bytes_per_token
    assert (cfg.limits.long_prefill_token_threshold, cfg.limits.policy, cfg.limits.async_scheduling) == (
        256, "priority", False)
    _, roofline = build_engine(spec(tmp_path, None).engines()[0])
    assert isinstance(roofline, RooflineCostModel) and roofline.async_scheduling
    _, sync = build_engine(spec(tmp_path, None, async_scheduling=False).engines()[0])
    assert isinstance(sync, RooflineCostModel) and not sync.async_scheduling  # the CPU's part is charged


def test_a_spec_naming_a_bad_profile_fails_at_load_with_the_row(tmp_path: Path) -> None:
    path = tmp_path / "gpu.csv"
    path.write_text(TABLE.replace("decode,64,1000,14", "decode,64,1000,-1"))
    with pytest.raises(ValidationError, match="line 5, column ms"):
        spec(tmp_path, str(path))

"""The scenario suite: every claim is quoted from the background reading, every fast scenario runs with
--quick and gives a verdict per claim, and `scenario run all --json` prints one JSON object."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from cluster.scenarios import (
    SCENARIOS,
    Claim,
    Finding,
    Scenario,
    ScenarioContext,
    ScenarioResult,
    Verdict,
    load_all,
    run_one,
)
from run_cluster import main
from tests.conftest import shared_path

load_all()


def test_every_claim_is_quoted_verbatim_from_its_source() -> None:
    root = shared_path("background")
    claims = [c for s in SCENARIOS.values() for c in s.claims]
    assert len(claims) >= 15
    for c in claims:
        assert c.found(root), f"{c.key}: {c.quote!r} is not in {c.source}"


def test_the_issue_s_scenarios_are_registered() -> None:
    assert {"disagg-crossover", "transfer-tax", "region-routers", "residency", "offload", "hogwild",
            "transfer-fallback", "spot-checkpoints", "dr-manifest", "small-cluster",
            "colocation-waste"} <= set(SCENARIOS)
    assert {"disagg-crossover", "residency"} <= {s.name for s in SCENARIOS.values() if s.slow}


def test_run_all_quick_prints_one_json_object_with_every_claim(capsys: pytest.CaptureFixture[str],
                                                                 tmp_path: Path) -> None:
    assert main(["scenario", "run", "all", "--quick", "--skip-slow", "--json", "--out", str(tmp_path)]) == 0
    doc = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    fast = [s for s in SCENARIOS.values() if not s.slow]
    assert [r["scenario"] for r in doc["scenarios"]] == [s.name for s in fast]
    assert len(doc["claims"]) == sum(len(s.claims) for s in fast)
    for c in doc["claims"]:
        assert c["verdict"] in {v.value for v in Verdict}
        assert c["figure"] and c["source"] and c["text"]
        if c["verdict"] == Verdict.NOT_RUN:
            assert c["missing"], c  # a claim not run says what is missing
    assert sum(doc["verdicts"].values()) == len(doc["claims"])
    assert json.loads((tmp_path / "scenarios.json").read_text()) == doc


def test_a_failing_scenario_becomes_not_run_rows() -> None:
    claim = Claim("k", "q", "lessons-card.md", "s")

    def boom(ctx: ScenarioContext) -> ScenarioResult:
        raise RuntimeError("engine exploded")

    res = run_one(Scenario("boom", "", boom, (claim,)), ScenarioContext())
    assert [f.verdict for f in res.findings] == [Verdict.NOT_RUN]
    assert "engine exploded" in res.findings[0].figure and res.method == "failed"
    assert Finding(claim, "x", Verdict.HOLDS, "c").to_json()["missing"] is None


def test_unknown_scenario_is_refused(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["scenario", "run", "no-such"]) == 2
    assert "unknown scenario 'no-such'" in capsys.readouterr().out


def test_crossover_quick_is_the_same_sweep_smaller() -> None:
    from cluster.scenarios.disagg_crossover import FULL, QUICK, Plan

    # the same claim conditions (outputs past the card's 200 tokens, prompts on both sides of 512) ...
    assert QUICK.output == FULL.output > 200
    assert min(QUICK.prompts) < 512 < max(QUICK.prompts) and set(QUICK.prompts) <= set(range(1, 32769))
    assert set(QUICK.modes) <= set(FULL.modes) and "colocated" in QUICK.modes
    # ... on fewer launches: the rate sweep rides on the isolated colocated and rdma launches
    assert QUICK.reuse_launches and QUICK.load_time_scale == QUICK.time_scale and QUICK.fine_time_scale is None
    assert len(QUICK.prompts) * len(QUICK.modes) < len(FULL.prompts) * len(FULL.modes)
    with pytest.raises(ValueError, match="load_time_scale"):
        Plan(reuse_launches=True, time_scale=5.0, load_time_scale=2.0)
    with pytest.raises(ValueError, match="colocated"):
        Plan(modes=("rdma",))

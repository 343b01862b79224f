"""Scenarios whose mechanism another part of kvmesh is still building: registered only when no module
has registered the name, each a ``not run`` finding that says what is missing (``load_all`` calls
``register_pending`` after importing every module)."""

from __future__ import annotations

from collections.abc import Callable

from cluster.scenarios import (
    SCENARIOS,
    Claim,
    Finding,
    Scenario,
    ScenarioContext,
    ScenarioResult,
    Verdict,
    register_scenario,
)

OFFLOAD_CLAIMS = (
    Claim("offload-reprefill", "Same 2K prompt re-prefilled | Preemption at 100% HBM | LMCache or native CPU offload",
          "lessons-card.md", "Troubleshooting"),
    Claim("offload-overhead", "3-5% overhead at low pressure", "lessons-card.md",
          "Four methods side by side: LMCache number"),
)
PENDING: dict[str, tuple[str, tuple[Claim, ...], str]] = {
    "offload": ("NATIVE_ONLY vs CPU_OFFLOAD vs LMCACHE under HBM pressure", OFFLOAD_CLAIMS,
                "cluster/scenarios/offload.py (the KV tiers' scenario) has not landed; the tiers and the shared "
                "KV store exist (actors/tiers, actors/kvstore) but no run compares them yet"),
}


def _runner(name: str, claims: tuple[Claim, ...], missing: str) -> Callable[[ScenarioContext], ScenarioResult]:
    def run(ctx: ScenarioContext) -> ScenarioResult:
        return ScenarioResult(name, "not run", [Finding(c, "not run", Verdict.NOT_RUN, "the mechanism is missing",
                                                        missing=missing) for c in claims])
    return run


def register_pending() -> None:
    for name, (help_, claims, missing) in PENDING.items():
        if name not in SCENARIOS:
            register_scenario(Scenario(name, f"{help_} (pending: {missing})", _runner(name, claims, missing), claims))

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

PENDING: dict[str, tuple[str, tuple[Claim, ...], str]] = {}
"""name -> (help, claims, what is missing); empty while every claim's mechanism has landed."""


def _runner(name: str, claims: tuple[Claim, ...], missing: str) -> Callable[[ScenarioContext], ScenarioResult]:
    def run(ctx: ScenarioContext) -> ScenarioResult:
        return ScenarioResult(name, "not run", [Finding(c, "not run", Verdict.NOT_RUN, "the mechanism is missing",
                                                        missing=missing) for c in claims])
    return run


def register_pending() -> None:
    for name, (help_, claims, missing) in PENDING.items():
        if name not in SCENARIOS:
            register_scenario(Scenario(name, f"{help_} (pending: {missing})", _runner(name, claims, missing), claims))

"""Scenarios: each claim of the background reading (``../shared/background/``) as a named experiment.

A scenario is registered by name in ``SCENARIOS``, one module per claim family. It states the claims it
tests (``Claim``: the quoted text, the file and section it comes from), runs the emulator (``run``: a
``ScenarioContext`` in, a ``ScenarioResult`` out) and sets each claim beside the emulated figure with a
verdict (``Finding``): ``holds``, ``breaks``, ``partly`` (holds under some of the swept conditions, named
in ``conditions``), or ``not run`` (the mechanism is not in kvmesh yet, named in ``missing``).

``slow`` scenarios launch clusters on Ray; the others run the engine's cost model, the real scheduler on
virtual time (``actors.engine.virtual``) or pure checks, in seconds. ``run all --skip-slow`` (the test
suite) runs the fast ones; ``bench/scenarios.py`` runs every one.

Failure behaviour: a scenario that raises is reported as a ``not run`` finding per claim with the error,
so one broken scenario never hides the others' rows (``run_one``).
"""

from __future__ import annotations

import time
import traceback
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from enum import StrEnum
from pathlib import Path
from typing import Any

BACKGROUND = Path(__file__).resolve().parents[2].parent / "shared" / "background"
"""The background reading, read at run time from ``../shared/background`` (never copied into the repo)."""


class Verdict(StrEnum):
    HOLDS = "holds"
    BREAKS = "breaks"
    PARTLY = "partly"
    NOT_RUN = "not run"


@dataclass(frozen=True)
class Claim:
    """A claim as the background reading states it: ``quote`` appears verbatim in ``source`` (a file of
    ``../shared/background``), under ``section``."""

    key: str
    quote: str
    source: str
    section: str

    def found(self, root: Path = BACKGROUND) -> bool | None:
        """Whether the quote is in its source file (None when the background folder is absent)."""
        p = root / self.source
        if not p.exists():
            return None
        text = p.read_text(encoding="utf-8").replace("**", "").replace("`", "")  # markdown emphasis is not text
        return " ".join(self.quote.split()) in " ".join(text.split())


@dataclass(frozen=True)
class Finding:
    """One claim beside the emulated figure: ``figure`` in words, ``value`` the headline number (its unit
    in ``figure``), the verdict, and ``conditions``: when it holds and when it breaks."""

    claim: Claim
    figure: str
    verdict: Verdict
    conditions: str
    value: float | None = None
    missing: str = ""
    """What kvmesh lacks to test the claim fully (empty when nothing)."""

    def to_json(self) -> dict[str, Any]:
        c = self.claim
        return {"claim": c.key, "text": c.quote, "source": f"{c.source}: {c.section}",
                "figure": self.figure, "value": self.value, "verdict": str(self.verdict),
                "conditions": self.conditions, "missing": self.missing or None}


@dataclass(frozen=True)
class ScenarioContext:
    """What a run is told: ``quick`` (fewer rows, seconds), a seed for every RNG, a progress printer and
    free-form ``options`` a scenario may read (the CLI's ``--time-scale``, ``--output-tokens``...)."""

    quick: bool = False
    seed: int = 0
    progress: Callable[[str], None] = field(default=lambda m: None)
    options: Mapping[str, Any] = field(default_factory=dict)


@dataclass
class ScenarioResult:
    """A run's findings, how they were obtained (``method``), its detailed figures (``details``, any
    JSON) and, for runs on a live cluster, the worst step lag seen (``step_lag_p99_ms``) with whether it
    passed the trust threshold (``lagging``)."""

    scenario: str
    method: str
    findings: list[Finding]
    details: dict[str, Any] = field(default_factory=dict)
    wall_s: float = 0.0
    step_lag_p99_ms: float | None = None
    lagging: bool = False

    def to_json(self) -> dict[str, Any]:
        return {"scenario": self.scenario, "method": self.method, "wall_s": round(self.wall_s, 2),
                "step_lag_p99_ms": self.step_lag_p99_ms, "lagging": self.lagging,
                "findings": [f.to_json() for f in self.findings], "details": self.details}


@dataclass(frozen=True)
class Scenario:
    name: str
    help: str
    run: Callable[[ScenarioContext], ScenarioResult]
    claims: tuple[Claim, ...] = ()
    slow: bool = False
    """Launches clusters on Ray (minutes): run by ``bench/scenarios.py``, not by the test suite."""


SCENARIOS: dict[str, Scenario] = {}


def register_scenario(s: Scenario) -> Scenario:
    if s.name in SCENARIOS:
        raise ValueError(f"scenario {s.name!r} registered twice")
    SCENARIOS[s.name] = s
    return s


def load_all() -> None:
    """Import every module of this package (each registers its scenarios)."""
    import importlib
    import pkgutil

    import cluster.scenarios as pkg

    for info in pkgutil.iter_modules(pkg.__path__):
        if not info.name.startswith("_"):
            importlib.import_module(f"cluster.scenarios.{info.name}")
    from cluster.scenarios.pending import register_pending

    register_pending()


def run_one(sc: Scenario, ctx: ScenarioContext) -> ScenarioResult:
    """Run ``sc``; an exception becomes a ``not run`` finding per claim carrying the error."""
    t0 = time.monotonic()
    try:
        res = sc.run(ctx)
    except Exception as e:  # reported, not raised: the other scenarios' rows still matter
        tb = traceback.format_exc(limit=3)
        res = ScenarioResult(sc.name, "failed", [Finding(c, f"error: {type(e).__name__}: {e}", Verdict.NOT_RUN,
                                                         "the scenario raised", missing=tb) for c in sc.claims])
    res.wall_s = time.monotonic() - t0
    return res


def summary(results: list[ScenarioResult]) -> dict[str, Any]:
    """The suite's one JSON object: every claim with its figure and verdict, then each scenario's details."""
    claims = [{"scenario": r.scenario, **f.to_json()} for r in results for f in r.findings]
    counts: dict[str, int] = {}
    for c in claims:
        counts[c["verdict"]] = counts.get(c["verdict"], 0) + 1
    return {"claims": claims, "verdicts": counts, "scenarios": [r.to_json() for r in results]}

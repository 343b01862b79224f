"""A soak: seeded random kills and spot preemptions, each engine replaced after a while, during a long replay.

``soak_schedule`` draws the events with ``schedule.generate_schedule``: Poisson times of mean gap ``every_s``
over the soak's ``duration_s``, each a ``kill_engine`` or a ``spot_preempt`` (``notice_s``) of an engine not
already down, replaced ``replace_after_s`` after its kill; at least ``keep_alive`` engines are up at any time.
``soak_figures`` reduces a chaos run's summary to what a soak is judged on: requests succeeded (share),
tokens lost or repeated (the history checker's ``tokens`` violations), every other violation, and the
engines' step lag (a soak run on an overloaded host says so).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
from pydantic import Field

from cluster.chaos.schedule import FaultSchedule, generate_schedule
from config.base import Frozen, NonNegativeFloat, PositiveFloat

DEFAULT_TRACE = "../shared/traces/mooncake_fast25/conversation_trace.jsonl"
"""The Mooncake conversation trace, relative to the repository (the shared data folder beside it)."""


class SoakConfig(Frozen):
    duration_s: PositiveFloat = 30.0
    """Emulated seconds over which faults are drawn (the replay's length)."""
    every_s: PositiveFloat = 10.0
    """Mean emulated seconds between two faults."""
    notice_s: PositiveFloat = 30.0
    """A spot preemption's notice."""
    replace_after_s: NonNegativeFloat = 5.0
    """Emulated seconds from a kill until a fresh engine joins."""
    kinds: tuple[str, ...] = ("kill_engine", "spot_preempt")
    keep_alive: int = Field(default=1, ge=1)
    seed: int = 0


def soak_schedule(cfg: SoakConfig, engines: Sequence[str]) -> FaultSchedule:
    """The soak's events for ``engines`` (same config, same schedule)."""
    return generate_schedule(np.random.default_rng(cfg.seed), engines, duration_s=cfg.duration_s,
                             every_s=cfg.every_s, kinds=cfg.kinds, notice_s=cfg.notice_s,
                             replace_after_s=cfg.replace_after_s, keep_alive=cfg.keep_alive,
                             name=f"soak-{cfg.duration_s:g}s-seed{cfg.seed}")


def soak_figures(summary: dict[str, Any]) -> dict[str, Any]:
    """Succeeded share, tokens lost/repeated, other violations and step lag of a chaos run's summary."""
    lt = summary["loadtest"]
    chk = summary["checker"]
    by_rule: dict[str, int] = chk.get("violations_by_rule") or {}
    requests = int(lt.get("completed", 0)) + int(lt.get("failed", 0))
    ok = int(lt.get("completed", 0))
    # The load test's own lag figure needs every engine's /metrics, which killed engines no longer answer;
    # the surviving engines' own lag windows (each since its start) are reported beside it.
    lag = lt.get("step_lag_ms") or {}
    survivors = summary.get("engine_step_lag_ms") or {}
    return {"requests": requests, "succeeded": ok, "failed": int(lt.get("failed", 0)),
            "succeeded_pct": round(100.0 * ok / requests, 3) if requests else None,
            "token_violations": int(by_rule.get("tokens", 0)),
            "other_violations": {k: v for k, v in by_rule.items() if k != "tokens"},
            "tokens_checked": chk.get("tokens_checked"), "checker_ok": chk.get("ok"),
            "faults": sum(1 for e in summary["events"] if e.get("outcome") == "done"
                          and ("kill" in e["what"] or "preempt" in e["what"])),
            "replacements": len(summary.get("replaced_engines", [])),
            "index_converged": summary.get("index_converged"), "step_lag_ms": lag,
            "survivors_step_lag_p99_ms": max((v.get("lag_p99_ms", 0.0) for v in survivors.values()), default=None),
            "survivors_step_lag_max_ms": max((v.get("lag_max_ms", 0.0) for v in survivors.values()), default=None)}

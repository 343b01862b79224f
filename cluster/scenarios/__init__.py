"""Scenarios: experiments that launch clusters, drive them and report, each registered by name."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Scenario:
    name: str
    help: str
    run: Callable[..., dict[str, Any]]


SCENARIOS: dict[str, Scenario] = {}


def register_scenario(s: Scenario) -> Scenario:
    if s.name in SCENARIOS:
        raise ValueError(f"scenario {s.name!r} registered twice")
    SCENARIOS[s.name] = s
    return s


def load_all() -> None:
    from cluster.scenarios import disagg_crossover  # noqa: F401  (registration)

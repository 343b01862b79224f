"""The policy interface and its registry.

A policy has one job: rank the eligible workers for a request, best first. The router around it owns
eligibility (health, breakers, residency, regions), retries, timeouts, migration and metrics, and tries
the next ranked worker when one fails. ``reason`` names why the first choice was made (for metrics).

Each policy declares its parameters as a small pydantic model (``Params``, unknown keys rejected), so a
misspelt parameter in a cluster spec is an error when the spec is checked (``check_policy``), not a silent
default. ``needs_prefix`` says whether the policy reads the request's token ids, block hashes and prefix
overlaps: the router tokenizes and queries the prefix index only for policies (or region strategies)
that do.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, ClassVar, Protocol

from pydantic import ValidationError

from cluster.router.view import ClusterView, RequestContext, WorkerInfo
from config.base import Frozen


class NoParams(Frozen):
    """A policy without parameters: any key given is an error."""


class RoutingPolicy(Protocol):
    name: str
    reason: str
    needs_prefix: bool
    ranks_on_counts: bool
    """With ``needs_prefix``: ``rank`` and ``on_routed`` read only ``num_blocks`` and ``overlap`` (never token
    ids or hashes), so a prompt that misses every cache may be ranked before it is all tokenized."""

    def rank(self, candidates: list[WorkerInfo], ctx: RequestContext, view: ClusterView) -> list[WorkerInfo]:
        """Candidates ordered best first (callers pass a non-empty list in name order)."""
        ...

    def on_routed(self, worker: WorkerInfo, ctx: RequestContext) -> None:
        """The request went to ``worker`` (policies with their own state update it here)."""
        ...


@dataclass(frozen=True)
class PolicyEntry:
    """A registered policy: its parameter model and how to make one from validated parameters."""

    params: type[Frozen]
    make: Callable[[random.Random, Any], RoutingPolicy]


POLICIES: dict[str, PolicyEntry] = {}


def register_policy(name: str) -> Callable[[type[PolicyBase]], type[PolicyBase]]:
    """Register a policy class under ``name``; its ``Params`` model validates its parameters."""

    def deco(cls: type[PolicyBase]) -> type[PolicyBase]:
        if name in POLICIES:
            raise ValueError(f"policy {name!r} registered twice")
        POLICIES[name] = PolicyEntry(cls.Params, cls)
        return cls
    return deco


class PolicyError(ValueError):
    """An unknown policy or invalid parameters; the message names the key and the reason."""


def check_policy(name: str, params: Mapping[str, Any] | None = None) -> Frozen:
    """The policy's validated parameters; raises :class:`PolicyError` naming what is wrong."""
    entry = POLICIES.get(name)
    if entry is None:
        raise PolicyError(f"unknown routing policy {name!r} (known: {', '.join(sorted(POLICIES))})")
    try:
        return entry.params.model_validate(dict(params or {}))
    except ValidationError as e:
        problems = "; ".join(f"{'.'.join(map(str, err['loc'])) or '(root)'}: {err['msg']}" for err in e.errors())
        raise PolicyError(f"invalid parameters for routing policy {name!r}: {problems}") from None


def make_policy(name: str, rng: random.Random | None = None, params: Mapping[str, Any] | None = None) -> RoutingPolicy:
    validated = check_policy(name, params)
    return POLICIES[name].make(rng or random.Random(0), validated)


class PolicyBase:
    """Defaults for the optional parts of the interface."""

    Params: ClassVar[type[Frozen]] = NoParams
    name = "base"
    reason = "policy"
    needs_prefix = False
    ranks_on_counts = False

    def __init__(self, rng: random.Random, params: Any) -> None:
        self.rng = rng
        self.params = params

    def rank(self, candidates: list[WorkerInfo], ctx: RequestContext, view: ClusterView) -> list[WorkerInfo]:
        raise NotImplementedError

    def on_routed(self, worker: WorkerInfo, ctx: RequestContext) -> None:
        return None


def by_load(candidates: list[WorkerInfo]) -> list[WorkerInfo]:
    """Least loaded first; ties broken by fewer requests sent, then name (deterministic)."""
    return sorted(candidates, key=lambda w: (w.load, w.waiting, w.sent, w.name))

"""Checking a ``RouterSpec`` against the router's registries, where they live (``config`` imports no router)."""

from __future__ import annotations

from cluster.router.policies import PolicyError, check_policy
from cluster.router.regions import REGION_STRATEGIES
from config.cluster import RouterSpec


def router_spec_problems(spec: RouterSpec) -> list[tuple[str, str]]:
    """(field path, reason) for each problem; empty when the spec is usable."""
    problems: list[tuple[str, str]] = []
    try:
        check_policy(spec.policy, spec.policy_params)
    except PolicyError as e:
        problems.append(("router.policy_params" if spec.policy in str(e) and "parameters" in str(e)
                         else "router.policy", str(e)))
    if spec.region_strategy not in REGION_STRATEGIES:
        problems.append(("router.region_strategy", f"unknown region strategy {spec.region_strategy!r} "
                                                   f"(known: {', '.join(REGION_STRATEGIES)})"))
    return problems


def check_router_spec(spec: RouterSpec) -> None:
    """Raise ``ValueError`` naming every problem of ``spec`` (launch runs this before starting anything)."""
    problems = router_spec_problems(spec)
    if problems:
        raise ValueError("; ".join(f"{path}: {why}" for path, why in problems))

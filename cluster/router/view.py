"""The router's view of the cluster: the workers it may send to, and their load as it sees it."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, NewType

WorkerId = NewType("WorkerId", str)


@dataclass
class WorkerInfo:
    """One engine the router can send to. ``inflight`` counts requests this router has open on it."""

    name: WorkerId
    url: str
    role: str = "colocated"
    region: str = "local"
    node: str = ""
    model: str = ""
    inflight: int = 0
    healthy: bool = True
    sent: int = 0
    extra: dict[str, Any] = field(default_factory=dict)

    @staticmethod
    def from_launch(name: str, d: dict[str, Any]) -> WorkerInfo:
        return WorkerInfo(WorkerId(name), d["url"], d.get("role", "colocated"), d.get("region", "local"),
                          d.get("node", ""), d.get("model", ""))


@dataclass(frozen=True)
class RequestContext:
    """What a policy may look at: the parsed request body and routing headers."""

    body: dict[str, Any]
    session_id: str | None = None
    region: str | None = None


class ClusterView:
    def __init__(self, workers: list[WorkerInfo]) -> None:
        self.workers: dict[WorkerId, WorkerInfo] = {w.name: w for w in workers}

    def candidates(self, model: str | None = None) -> list[WorkerInfo]:
        """Healthy workers that can serve a whole request (colocated role), in a stable order."""
        out = [w for w in self.workers.values() if w.healthy and w.role == "colocated"
               and (model is None or not w.model or w.model == model)]
        return sorted(out, key=lambda w: w.name)

    def models(self) -> list[str]:
        return sorted({w.model for w in self.workers.values() if w.model})

"""A fault schedule: timed events as typed data, loaded from YAML or drawn by a seeded generator.

A schedule is a list of events, each at an emulated time (seconds from the run's start) and of one kind
(the ``kind`` field picks the event's type: a pydantic discriminated union, so a bad file is rejected at
load with the event's index, its kind and the field, e.g. ``events[2].slow_gpu.factor``). Events are
kept sorted by time (stable for equal times, so the file's order breaks ties).

Kinds and what they mean (the injectors in ``cluster.chaos.injectors`` carry them out):

- ``kill_engine``: the engine's actor is killed abruptly; ``replace_after_s`` (after the kill) brings a
  fresh engine back.
- ``kill_node``: every actor placed on that emulated node is killed.
- ``spot_preempt``: notice, then kill: the engine stops admitting at ``at_s``, its running requests
  finish or move away, and at ``at_s + notice_s`` it is killed; ``replace_after_s`` (after the kill)
  brings a fresh engine back.
- ``slow_gpu``: the engine's cost-model step time multiplied by ``factor`` for ``duration_s``.
- ``partition``: the router cut from ``engines`` (or those engines from each other) for ``duration_s``;
  or, with ``host``, that host's network link down for ``duration_s`` (a host-level fault).
- ``kv_events``: the router's KV-event feed from ``engines`` loses, duplicates or reorders events
  for ``duration_s``.
- ``router_restart``: the router actor killed and started again.
- ``transfer_faults``: the transport's fault wrapper switched on with ``plan`` for ``duration_s``.
- ``kill_store``: the region's shared KV store actor(s) killed (``replica``: one of them); engines fall back
  to recompute or to a surviving replica.

Failure behaviour: ``load_schedule`` raises ``config.ConfigError`` naming the file, the event index and
field, and the reason; ``check_against`` raises it when an event names an engine or node the cluster
does not have.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Annotated, Any, Literal

import numpy as np
from pydantic import Field, ValidationError, model_validator

from config.base import Frozen, Name, NonNegativeFloat, PositiveFloat
from config.errors import ConfigError
from config.yamlio import SpecProblems, problems_of, read_yaml, validate


class _Event(Frozen):
    at_s: NonNegativeFloat
    """Emulated seconds from the run's start."""

    def targets(self) -> tuple[str, ...]:
        """The engines this event names (checked against the cluster)."""
        return ()

    def end_s(self) -> float:
        """When the event's effect ends (its own time for instantaneous events)."""
        return self.at_s


class KillEngine(_Event):
    kind: Literal["kill_engine"] = "kill_engine"
    engine: Name
    replace_after_s: NonNegativeFloat | None = None
    """Emulated seconds after the kill until a fresh engine of the same name joins; None: none does."""

    def targets(self) -> tuple[str, ...]:
        return (self.engine,)

    def end_s(self) -> float:
        return self.at_s + (self.replace_after_s or 0.0)


class KillNode(_Event):
    kind: Literal["kill_node"] = "kill_node"
    node: Name
    """A node name as the cluster spec's engine instances carry it (``EngineInstance.node``)."""


class SpotPreempt(_Event):
    kind: Literal["spot_preempt"] = "spot_preempt"
    engine: Name
    notice_s: PositiveFloat = 30.0
    """Emulated seconds between the notice and the kill (clouds give 30 s to 2 min)."""
    replace_after_s: NonNegativeFloat | None = None
    """Emulated seconds after the kill until a fresh engine joins; None: no replacement."""

    def targets(self) -> tuple[str, ...]:
        return (self.engine,)

    def end_s(self) -> float:
        return self.at_s + self.notice_s + (self.replace_after_s or 0.0)


class SlowGpu(_Event):
    kind: Literal["slow_gpu"] = "slow_gpu"
    engine: Name
    factor: Annotated[float, Field(ge=1.0, le=1000.0)]
    """Step time multiplier (1 = no change)."""
    duration_s: PositiveFloat

    def targets(self) -> tuple[str, ...]:
        return (self.engine,)

    def end_s(self) -> float:
        return self.at_s + self.duration_s


class Partition(_Event):
    kind: Literal["partition"] = "partition"
    engines: tuple[Name, ...] = ()
    between: Literal["router", "engines"] = "router"
    """``router``: the router cannot reach these engines (requests and feeds); ``engines``: these engines
    cannot reach each other over the transport."""
    host: Name | None = None
    """Instead of ``engines``: a host of ``placement.hosts`` whose network link goes down (its Ray node,
    engines, router, feeds and KV all cut off every other host) and comes back up after ``duration_s``.
    Needs a cluster whose hosts the driver controls (the hosts harness, ``cluster.hosts.faults``)."""
    duration_s: PositiveFloat

    @model_validator(mode="after")
    def _one_target(self) -> Partition:
        if (self.host is None) == (not self.engines):
            raise ValueError("give either engines (cut at the application) or host (its link down), not both")
        return self

    def targets(self) -> tuple[str, ...]:
        return self.engines

    def end_s(self) -> float:
        return self.at_s + self.duration_s


class KvEvents(_Event):
    kind: Literal["kv_events"] = "kv_events"
    engines: tuple[Name, ...] = ()
    """Whose feeds are disturbed; empty = every engine's."""
    loss: Annotated[float, Field(ge=0.0, le=1.0)] = 0.0
    duplicate: Annotated[float, Field(ge=0.0, le=1.0)] = 0.0
    reorder: Annotated[float, Field(ge=0.0, le=1.0)] = 0.0
    duration_s: PositiveFloat
    seed: int = 0

    @model_validator(mode="after")
    def _some(self) -> KvEvents:
        if self.loss + self.duplicate + self.reorder <= 0.0:
            raise ValueError("set at least one of loss, duplicate, reorder above 0")
        return self

    def targets(self) -> tuple[str, ...]:
        return self.engines

    def end_s(self) -> float:
        return self.at_s + self.duration_s


class RouterRestart(_Event):
    kind: Literal["router_restart"] = "router_restart"
    down_s: NonNegativeFloat = 0.0
    """Emulated seconds between the kill and the new router's start."""
    mode: Literal["graceful", "crash"] = "graceful"
    """``graceful``: the router is told to stop first, so every open stream ends with an error event (a 503)
    and ``[DONE]``; ``crash``: the process is killed, its clients lose their connections."""


class TransferFaults(_Event):
    kind: Literal["transfer_faults"] = "transfer_faults"
    duration_s: PositiveFloat
    plan: dict[str, Any]
    """The transport fault wrapper's plan (``transport.faulty.FaultPlan``: seed, rates, ...); validated
    by ``load_schedule`` against the transport's own model."""

    @model_validator(mode="after")
    def _plan(self) -> TransferFaults:
        from transport.faulty import FaultPlan  # the transport owns the fault kinds

        try:
            FaultPlan.model_validate(self.plan)
        except ValidationError as err:
            raise SpecProblems(problems_of(err, "plan")) from None
        return self

    def end_s(self) -> float:
        return self.at_s + self.duration_s


class KillStore(_Event):
    kind: Literal["kill_store"] = "kill_store"
    region: Name | None = None
    """The region whose store dies; None: every region's."""
    replica: Annotated[int, Field(ge=0)] | None = None
    """Which of the region's stores (0: the primary, 1: its replica...); None: all of them."""


Event = Annotated[KillEngine | KillNode | SpotPreempt | SlowGpu | Partition | KvEvents | RouterRestart
                  | TransferFaults | KillStore, Field(discriminator="kind")]
EVENT_KINDS: tuple[str, ...] = ("kill_engine", "kill_node", "spot_preempt", "slow_gpu", "partition",
                                "kv_events", "router_restart", "transfer_faults", "kill_store")


class FaultSchedule(Frozen):
    """A named list of events, sorted by time (stable)."""

    name: str = "faults"
    events: tuple[Event, ...] = ()

    @model_validator(mode="after")
    def _sorted(self) -> FaultSchedule:
        ordered = tuple(sorted(self.events, key=lambda e: e.at_s))
        if ordered != self.events:
            object.__setattr__(self, "events", ordered)
        return self

    def end_s(self) -> float:
        return max((e.end_s() for e in self.events), default=0.0)

    def check_against(self, engines: Iterable[str], nodes: Iterable[str], source: str | None = None,
                      hosts: Iterable[str] = ()) -> None:
        """Raise ConfigError when an event names an engine, a node or a host the cluster lacks."""
        known, known_nodes, known_hosts = set(engines), set(nodes), set(hosts)
        problems: list[tuple[str, str]] = []
        for i, e in enumerate(self.events):
            for t in e.targets():
                if t not in known:
                    problems.append((f"events[{i}].{e.kind}", f"no engine {t!r} in the cluster "
                                                              f"(engines: {', '.join(sorted(known))})"))
            if isinstance(e, KillNode) and e.node not in known_nodes:
                problems.append((f"events[{i}].kill_node.node", f"no node {e.node!r} in the cluster "
                                                                f"(nodes: {', '.join(sorted(known_nodes))})"))
            if isinstance(e, Partition) and e.host is not None and e.host not in known_hosts:
                problems.append((f"events[{i}].partition.host", f"no host {e.host!r} in the spec's placement.hosts "
                                                                f"(hosts: {', '.join(sorted(known_hosts)) or 'none'})"))
        if problems:
            raise ConfigError(source, problems)


def parse_schedule(data: Any, source: str | None = None) -> FaultSchedule:
    """Validate a schedule object (a mapping with ``events``, or a bare list of events)."""
    if isinstance(data, list):
        data = {"events": data}
    if data is None:
        raise ConfigError(source, [("", "the schedule is empty (expected a mapping with 'events')")])
    return validate(FaultSchedule, data, source=source)


def load_schedule(path: Path | str) -> FaultSchedule:
    """Read and validate a YAML schedule file; ConfigError names the event index, kind and field."""
    return parse_schedule(read_yaml(path), str(path))


GENERATED_KINDS: tuple[str, ...] = ("kill_engine", "spot_preempt", "slow_gpu")


def generate_schedule(rng: np.random.Generator, engines: Sequence[str], *, duration_s: float,
                      every_s: float, kinds: Sequence[str] = GENERATED_KINDS, notice_s: float = 30.0,
                      replace_after_s: float | None = None, slow_factor: tuple[float, float] = (2.0, 8.0),
                      slow_duration_s: tuple[float, float] = (5.0, 30.0), keep_alive: int = 1,
                      name: str = "generated") -> FaultSchedule:
    """Draw a schedule: events at Poisson times of mean gap ``every_s`` over ``[0, duration_s)``, each of
    a kind drawn uniformly from ``kinds`` against an engine drawn uniformly from those free at that time.

    An engine is free when no earlier event on it is still in effect (a slowdown, a notice, a kill until
    its replacement joins; forever after a kill without replacement). A kill or preemption is only drawn
    while more than ``keep_alive`` engines are up (so the cluster can still serve); otherwise that draw
    becomes a slowdown (when ``slow_gpu`` is among ``kinds``) or nothing. Same ``rng`` state, same schedule.
    """
    unknown = [k for k in kinds if k not in GENERATED_KINDS]
    if unknown or not kinds:
        raise ValueError(f"kinds must be a non-empty subset of {GENERATED_KINDS}, got {list(kinds)}")
    if every_s <= 0 or duration_s <= 0:
        raise ValueError("every_s and duration_s must be positive")
    if not engines:
        raise ValueError("no engine to inject faults into")
    busy_until = dict.fromkeys(engines, 0.0)
    down: dict[str, tuple[float, float]] = {}
    """Engine -> (from, until) of its latest kill or preemption (until: inf without replacement)."""
    events: list[dict[str, Any]] = []
    t = float(rng.exponential(every_s))
    while t < duration_s:
        kind = kinds[int(rng.integers(len(kinds)))]
        free = [e for e in engines if busy_until[e] <= t]
        up = sum(1 for e in engines if not (e in down and down[e][0] <= t < down[e][1]))
        if kind in ("kill_engine", "spot_preempt") and up <= keep_alive:
            kind = "slow_gpu" if "slow_gpu" in kinds else ""
        if free and kind:
            target = free[int(rng.integers(len(free)))]
            at = round(t, 3)
            event: dict[str, Any] = {"kind": kind, "at_s": at, "engine": target}
            if kind in ("kill_engine", "spot_preempt"):
                killed_at = at + (notice_s if kind == "spot_preempt" else 0.0)
                event["replace_after_s"] = replace_after_s
                if kind == "spot_preempt":
                    event["notice_s"] = notice_s
                until = killed_at + replace_after_s if replace_after_s is not None else float("inf")
                down[target] = (at, until)
                busy_until[target] = until
            else:
                event["factor"] = round(float(rng.uniform(*slow_factor)), 3)
                event["duration_s"] = round(float(rng.uniform(*slow_duration_s)), 3)
                busy_until[target] = at + event["duration_s"]
            events.append(event)
        t += float(rng.exponential(every_s))
    return parse_schedule({"name": name, "events": events})


def summarize(schedule: FaultSchedule) -> list[Mapping[str, Any]]:
    """The events as JSON-ready dicts (for the run folder's timeline)."""
    return [e.model_dump(mode="json") for e in schedule.events]

"""Injectors: how each kind of fault event is carried out against a running cluster.

An injector turns one schedule event into timed ``Action``s (emulated seconds from the run's start):
``slow_gpu`` is two actions (slow down, restore), ``spot_preempt`` two (stop admitting, kill), a kill one.
``INJECTORS`` maps an event kind to its injector (a registry: a new kind is a new entry); ``plan_actions``
flattens a schedule into one time-ordered list (ties keep the schedule's order, so a replay is
deterministic). Actions act through ``ClusterControl``, a narrow face of the launched cluster
(``cluster.launch.ClusterHandle``): kill the actor hosting an engine, drain an engine, set its slowdown.
Ray control calls are blocking and cost about a millisecond: the runner calls them off its event loop.

What each implemented kind does:

- ``kill_engine``: ``ray.kill`` of the actor hosting the engine (no restart). With ``gpus_per_actor`` > 1
  the engines sharing that actor die with it (reported in ``dead``).
- ``kill_node``: every actor hosting an engine of that emulated node, killed.
- ``spot_preempt`` (no migration yet): at the notice the engine stops admitting (``draining``: its
  ``/health`` and new requests answer 503, its feed says so and the router stops choosing it); its
  running requests go on; at ``at_s + notice_s`` the actor is killed and the router continues every
  stream still running there on another engine (``cluster.router.relay.continue_on``).
- ``slow_gpu``: the engine's step times multiplied by ``factor`` for ``duration_s``, then restored.

Failure behaviour: ``plan_actions`` raises ``UnsupportedEvent`` (naming the event's index and kind)
for a kind with no injector yet or an option not supported yet (``replace_after_s``), before the run
starts; an action that fails while running is logged with its error and the run goes on.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Protocol

from cluster.chaos.schedule import Event, FaultSchedule, KillEngine, KillNode, SlowGpu, SpotPreempt


class UnsupportedEvent(ValueError):
    """An event this build cannot inject; the message names the event and what is missing."""


class ClusterControl(Protocol):
    """What injectors may do to a cluster (``RayClusterControl`` is the real one)."""

    def kill_engine(self, engine: str) -> list[str]:
        """Kill the actor hosting ``engine``; the engines that died with it."""
        ...

    def engines_on_node(self, node: str) -> list[str]: ...

    def drain(self, engine: str) -> None: ...

    def set_slowdown(self, engine: str, factor: float) -> None: ...


@dataclass(frozen=True)
class Action:
    at_s: float
    event_index: int
    kind: str
    what: str
    do: Callable[[ClusterControl], list[str]]
    """Carries the action out; returns the engines it killed (empty when none)."""


Injector = Callable[[Event, int], list[Action]]


def _kill_engine(e: Event, i: int) -> list[Action]:
    assert isinstance(e, KillEngine)
    return [Action(e.at_s, i, e.kind, f"kill {e.engine}", lambda c: c.kill_engine(e.engine))]


def _kill_node(e: Event, i: int) -> list[Action]:
    assert isinstance(e, KillNode)

    def do(c: ClusterControl) -> list[str]:
        dead: list[str] = []
        for name in c.engines_on_node(e.node):
            if name not in dead:
                dead.extend(c.kill_engine(name))
        return dead

    return [Action(e.at_s, i, e.kind, f"kill every engine of node {e.node}", do)]


def _spot_preempt(e: Event, i: int) -> list[Action]:
    assert isinstance(e, SpotPreempt)
    if e.replace_after_s is not None:
        raise UnsupportedEvent(f"events[{i}].spot_preempt.replace_after_s: bringing a fresh engine back is not "
                               f"implemented yet; remove the field")

    def notice(c: ClusterControl) -> list[str]:
        c.drain(e.engine)
        return []

    return [Action(e.at_s, i, e.kind, f"notice to {e.engine} ({e.notice_s:g} s): stop admitting", notice),
            Action(e.at_s + e.notice_s, i, e.kind, f"preempt {e.engine}", lambda c: c.kill_engine(e.engine))]


def _slow_gpu(e: Event, i: int) -> list[Action]:
    assert isinstance(e, SlowGpu)

    def slow(factor: float) -> Callable[[ClusterControl], list[str]]:
        def do(c: ClusterControl) -> list[str]:
            c.set_slowdown(e.engine, factor)
            return []
        return do

    return [Action(e.at_s, i, e.kind, f"{e.engine} steps x{e.factor:g}", slow(e.factor)),
            Action(e.end_s(), i, e.kind, f"{e.engine} steps back to x1", slow(1.0))]


INJECTORS: dict[str, Injector] = {
    "kill_engine": _kill_engine,
    "kill_node": _kill_node,
    "spot_preempt": _spot_preempt,
    "slow_gpu": _slow_gpu,
}


def plan_actions(schedule: FaultSchedule, injectors: Mapping[str, Injector] = INJECTORS) -> list[Action]:
    """Every event's actions, in time order (stable); UnsupportedEvent for a kind without injector."""
    actions: list[Action] = []
    for i, e in enumerate(schedule.events):
        injector = injectors.get(e.kind)
        if injector is None:
            raise UnsupportedEvent(f"events[{i}]: {e.kind} events cannot be injected yet (implemented: "
                                   f"{', '.join(sorted(injectors))})")
        actions.extend(injector(e, i))
    return sorted(actions, key=lambda a: a.at_s)


class RayClusterControl:
    """``ClusterControl`` over a launched cluster (``cluster.launch.ClusterHandle``); remembers the dead."""

    def __init__(self, handle: Any, timeout_s: float = 30.0) -> None:
        self.handle = handle
        self.timeout_s = timeout_s
        self.dead: set[str] = set()

    def _actor(self, engine: str) -> Any:
        if engine not in self.handle.engine_actor:
            raise KeyError(f"no engine {engine!r} in the cluster")
        return self.handle.workers[self.handle.engine_actor[engine]]

    def kill_engine(self, engine: str) -> list[str]:
        import ray

        index = self.handle.engine_actor[engine]
        ray.kill(self._actor(engine), no_restart=True)
        gone = sorted(n for n, a in self.handle.engine_actor.items() if a == index and n not in self.dead)
        self.dead.update(gone)
        return gone

    def engines_on_node(self, node: str) -> list[str]:
        return sorted(n for n, d in self.handle.engines.items() if d.get("node") == node and n not in self.dead)

    def drain(self, engine: str) -> None:
        import ray

        ray.get(self._actor(engine).drain.remote([engine]), timeout=self.timeout_s)

    def set_slowdown(self, engine: str, factor: float) -> None:
        import ray

        ray.get(self._actor(engine).set_slowdown.remote([engine], factor), timeout=self.timeout_s)

    def alive_loads(self) -> dict[str, dict[str, Any]]:
        """Each surviving engine's load (free/total blocks, running)."""
        import ray

        alive = sorted({self.handle.engine_actor[n] for n in self.handle.engines if n not in self.dead})
        out: dict[str, dict[str, Any]] = {}
        for part in ray.get([self.handle.workers[i].load.remote() for i in alive], timeout=self.timeout_s):
            out.update(part)
        return out

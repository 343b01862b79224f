"""Injectors: how each kind of fault event is carried out against a running cluster.

An injector turns one schedule event into timed ``Action``s (emulated seconds from the run's start):
``slow_gpu`` is two actions (slow down, restore), ``spot_preempt`` two or three (stop admitting, kill,
replace), a period (``partition``, ``kv_events``, ``transfer_faults``) two (on, off). ``INJECTORS`` maps an
event kind to its injector (a registry: a new kind is a new entry); ``plan_actions`` flattens a schedule into
one time-ordered list (ties keep the schedule's order, so a replay is deterministic). Actions act through
``ClusterControl``, a narrow face of the launched cluster (``cluster.chaos.control.RayClusterControl`` is the
real one). Ray control calls are blocking and cost about a millisecond: the runner calls them off its loop.

What each kind does:

- ``kill_engine``: that engine alone dies, whatever the density: its actor is killed (``ray.kill``) when it
  was the last live engine there, else the actor ends the engine inside (connections dropped, feed gone,
  KV transport closed) and its other engines go on. ``replace_after_s``: a fresh actor hosting a fresh
  engine of the same name starts then and joins every router (``POST /workers``), cache empty.
- ``kill_node``: every actor hosting an engine of that emulated node, killed; on the hosts harness
  (a control that is a ``HostControl``, ``cluster.hosts.faults``) the whole host the node runs on is
  killed instead: its raylet and every actor on it.
- ``spot_preempt``: at the notice the engine stops admitting (``draining``: its ``/health`` and new
  requests answer 503, its feed says so and the router stops choosing it); its running requests go on; at
  ``at_s + notice_s`` the actor is killed and the router continues every stream still running there on
  another engine (``cluster.router.relay.continue_on``); ``replace_after_s`` as for ``kill_engine``.
- ``slow_gpu``: the engine's step times multiplied by ``factor`` for ``duration_s``, then restored.
- ``partition`` with ``host``: that host's link down for ``duration_s``, then up (``HostControl``; on a
  cluster without one the action fails with ``UnsupportedEvent``, and ``run_chaos`` refuses it before the run).
- ``partition`` (``between: router``): the engines' HTTP servers drop every connection, open or new, and
  their feeds tell the routers they are gone, for ``duration_s``; then a fresh snapshot reconnects them.
  (``between: engines``): their KV transports refuse each other (``PeerGone``) for ``duration_s``.
- ``kv_events``: the engines' KV event batches lost, duplicated or reordered (seeded) for ``duration_s``.
- ``router_restart``: every router stopped (``graceful``: told to stop, it ends each open stream with an
  error event and ``[DONE]`` first; ``crash``: killed) and its actor killed; after ``down_s`` a new one starts
  on the same port with the live engines and rebuilds its view and index from their feeds' snapshots.
- ``transfer_faults``: every KV transport's fault wrapper switched to ``plan`` for ``duration_s``.
- ``kill_store``: the region's KV store actors (or one replica) killed (``ray.kill``); the engines' gets fail
  over to a live replica or fail, and a failed get is recompute (``actors.kvstore``), so no request is lost.

Failure behaviour: ``plan_actions`` raises ``UnsupportedEvent`` (naming the event's index and kind) for a
kind with no injector, before the run starts; an action that fails while running is logged with its error
and the run goes on.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

from cluster.chaos.schedule import (
    Event,
    FaultSchedule,
    KillEngine,
    KillNode,
    KillStore,
    KvEvents,
    Partition,
    RouterRestart,
    SlowGpu,
    SpotPreempt,
    TransferFaults,
)


class UnsupportedEvent(ValueError):
    """An event this build cannot inject; the message names the event and what is missing."""


@runtime_checkable
class HostControl(Protocol):
    """A cluster whose nodes run on hosts it can fault as a whole (``cluster.hosts.faults``)."""

    def kill_host_of(self, node: str) -> list[str]:
        """Kill the host ``node`` runs on (its raylet and every actor on it); the engines that died."""
        ...

    def partition_host(self, host: str, on: bool) -> None:
        """Bring ``host``'s network link down (``on``) or up again."""
        ...


class ClusterControl(Protocol):
    """What injectors may do to a cluster (``cluster.chaos.control.RayClusterControl`` is the real one)."""

    def kill_engine(self, engine: str) -> list[str]:
        """Kill the actor hosting ``engine``; the engines that died with it."""
        ...

    def replace_engine(self, engine: str) -> None:
        """Start a fresh engine named ``engine`` (a killed one) and add it to every router."""
        ...

    def engines_on_node(self, node: str) -> list[str]: ...

    def drain(self, engine: str) -> None: ...

    def set_slowdown(self, engine: str, factor: float) -> None: ...

    def partition(self, engines: Sequence[str], between: str, on: bool) -> None:
        """Cut (``on``) or heal ``engines`` from the router (``between="router"``) or from each other."""
        ...

    def disturb_kv_events(self, event: KvEvents, on: bool) -> None: ...

    def restart_router(self, down_s: float, graceful: bool = True) -> None: ...

    def set_transfer_faults(self, plan: Mapping[str, Any] | None) -> None: ...

    def kill_store(self, region: str | None, replica: int | None) -> list[str]:
        """Kill the shared KV store actors of ``region`` (None: every region), one ``replica`` or all; what died."""
        ...


@dataclass(frozen=True)
class Action:
    at_s: float
    event_index: int
    kind: str
    what: str
    do: Callable[[ClusterControl], list[str]]
    """Carries the action out; returns the engines it killed (empty when none)."""


Injector = Callable[[Event, int], list[Action]]


def _none(step: Callable[[ClusterControl], object]) -> Callable[[ClusterControl], list[str]]:
    """An action that kills nothing."""
    def do(c: ClusterControl) -> list[str]:
        step(c)
        return []
    return do


def _replacement(e: KillEngine | SpotPreempt, i: int, killed_at: float) -> list[Action]:
    if e.replace_after_s is None:
        return []
    return [Action(killed_at + e.replace_after_s, i, e.kind, f"replace {e.engine} with a fresh engine",
                   _none(lambda c: c.replace_engine(e.engine)))]


def _kill_engine(e: Event, i: int) -> list[Action]:
    assert isinstance(e, KillEngine)
    return [Action(e.at_s, i, e.kind, f"kill {e.engine}", lambda c: c.kill_engine(e.engine)),
            *_replacement(e, i, e.at_s)]


def _kill_node(e: Event, i: int) -> list[Action]:
    assert isinstance(e, KillNode)

    def do(c: ClusterControl) -> list[str]:
        if isinstance(c, HostControl):  # on real hosts the whole machine goes, Ray's node with it
            return c.kill_host_of(e.node)
        dead: list[str] = []
        for name in c.engines_on_node(e.node):
            if name not in dead:
                dead.extend(c.kill_engine(name))
        return dead

    return [Action(e.at_s, i, e.kind, f"kill every engine of node {e.node}", do)]


def _spot_preempt(e: Event, i: int) -> list[Action]:
    assert isinstance(e, SpotPreempt)
    kill_at = e.at_s + e.notice_s
    return [Action(e.at_s, i, e.kind, f"notice to {e.engine} ({e.notice_s:g} s): stop admitting",
                   _none(lambda c: c.drain(e.engine))),
            Action(kill_at, i, e.kind, f"preempt {e.engine}", lambda c: c.kill_engine(e.engine)),
            *_replacement(e, i, kill_at)]


def _slow_gpu(e: Event, i: int) -> list[Action]:
    assert isinstance(e, SlowGpu)

    def slow(factor: float) -> Callable[[ClusterControl], list[str]]:
        return _none(lambda c: c.set_slowdown(e.engine, factor))

    return [Action(e.at_s, i, e.kind, f"{e.engine} steps x{e.factor:g}", slow(e.factor)),
            Action(e.end_s(), i, e.kind, f"{e.engine} steps back to x1", slow(1.0))]


def _host_control(c: ClusterControl, what: str) -> HostControl:
    if not isinstance(c, HostControl):
        raise UnsupportedEvent(f"{what} needs a cluster whose hosts the driver controls (the hosts harness: "
                               f"run_cluster.py chaos --hosts-run-dir DIR)")
    return c


def _partition(e: Event, i: int) -> list[Action]:
    assert isinstance(e, Partition)
    if e.host is not None:
        host = e.host

        def link(on: bool) -> Callable[[ClusterControl], list[str]]:
            return _none(lambda c: _host_control(c, f"partition of host {host}").partition_host(host, on))

        return [Action(e.at_s, i, e.kind, f"host {host}: link down", link(True)),
                Action(e.end_s(), i, e.kind, f"host {host}: link up", link(False))]
    names = ", ".join(e.engines)
    side = "the router" if e.between == "router" else "each other"
    return [Action(e.at_s, i, e.kind, f"cut {names} from {side}",
                   _none(lambda c: c.partition(e.engines, e.between, True))),
            Action(e.end_s(), i, e.kind, f"heal {names} with {side}",
                   _none(lambda c: c.partition(e.engines, e.between, False)))]


def _kv_events(e: Event, i: int) -> list[Action]:
    assert isinstance(e, KvEvents)
    who = ", ".join(e.engines) or "every engine"
    how = f"loss {e.loss:g}, duplicate {e.duplicate:g}, reorder {e.reorder:g}"
    return [Action(e.at_s, i, e.kind, f"disturb KV events of {who} ({how})",
                   _none(lambda c: c.disturb_kv_events(e, True))),
            Action(e.end_s(), i, e.kind, f"KV events of {who} undisturbed",
                   _none(lambda c: c.disturb_kv_events(e, False)))]


def _router_restart(e: Event, i: int) -> list[Action]:
    assert isinstance(e, RouterRestart)
    how = "stop the router (open streams end with an error event)" if e.mode == "graceful" else "kill the router"
    return [Action(e.at_s, i, e.kind, f"{how}, start a new one after {e.down_s:g} s",
                   _none(lambda c: c.restart_router(e.down_s, e.mode == "graceful")))]


def _transfer_faults(e: Event, i: int) -> list[Action]:
    assert isinstance(e, TransferFaults)
    return [Action(e.at_s, i, e.kind, f"transfer faults on: {e.plan}", _none(lambda c: c.set_transfer_faults(e.plan))),
            Action(e.end_s(), i, e.kind, "transfer faults off", _none(lambda c: c.set_transfer_faults(None)))]


def _kill_store(e: Event, i: int) -> list[Action]:
    assert isinstance(e, KillStore)
    which = f"replica {e.replica}" if e.replica is not None else "every store"
    return [Action(e.at_s, i, e.kind, f"kill {which} of region {e.region or '(all)'}",
                   _none(lambda c: c.kill_store(e.region, e.replica)))]


INJECTORS: dict[str, Injector] = {
    "kill_engine": _kill_engine,
    "kill_node": _kill_node,
    "spot_preempt": _spot_preempt,
    "slow_gpu": _slow_gpu,
    "partition": _partition,
    "kv_events": _kv_events,
    "router_restart": _router_restart,
    "transfer_faults": _transfer_faults,
    "kill_store": _kill_store,
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

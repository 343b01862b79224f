"""Backends by registry key (``TransportSpec.backend``), and the one call that builds a transport from config.

Built-in keys load their module only when first used, so ``ucx`` (an optional extra) is imported only
by a cluster that asks for it. ``register`` adds a backend (tests use it for fakes).
"""

from __future__ import annotations

import importlib
from collections.abc import Callable

from config.cluster import TransportSpec
from transport.base import ClockLike, KVTransport, Site, TransportOptions
from transport.faulty import FaultPlan, FaultyTransport
from transport.link import LinkModel, ShapedTransport, Topology

BackendFactory = Callable[[Site, ClockLike, TransportOptions], KVTransport]

_BUILTIN: dict[str, str] = {
    "inproc": "transport.inproc:InprocTransport",
    "tcp": "transport.tcp:TcpTransport",
    "ucx": "transport.ucx:UcxTransport",
}
_REGISTRY: dict[str, BackendFactory] = {}


def register(key: str, factory: BackendFactory) -> None:
    """Make ``key`` name ``factory`` (replacing a previous registration)."""
    _REGISTRY[key] = factory


def backends() -> list[str]:
    return sorted(set(_BUILTIN) | set(_REGISTRY))


def backend_factory(key: str) -> BackendFactory:
    """The factory registered under ``key``; an unknown key lists the known ones."""
    found = _REGISTRY.get(key)
    if found is not None:
        return found
    target = _BUILTIN.get(key)
    if target is None:
        raise KeyError(f"unknown transport backend {key!r} (known: {', '.join(backends())})")
    module, _, attr = target.partition(":")
    factory: BackendFactory = getattr(importlib.import_module(module), attr)
    _REGISTRY[key] = factory
    return factory


def make_transport(spec: TransportSpec, *, site: Site, clock: ClockLike, topology: Topology | None = None,
                   options: TransportOptions | None = None, faults: FaultPlan | None = None) -> KVTransport:
    """The transport a cluster spec asks for, at ``site``.

    With a ``topology`` every transfer is shaped to the emulated link (``ShapedTransport`` at
    ``spec.kv_payload_scale``); with ``faults`` the backend is wrapped in ``FaultyTransport`` (under the
    shaping, so injected faults hit the real bytes).
    """
    transport: KVTransport = backend_factory(spec.backend)(site, clock, options or TransportOptions())
    if faults is not None:
        transport = FaultyTransport(transport, faults)
    if topology is not None:
        transport = ShapedTransport(transport, LinkModel(topology, clock, spec.kv_payload_scale))
    return transport

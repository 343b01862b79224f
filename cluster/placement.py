"""Placement of a cluster's actors on the hosts of a (possibly multi-node) Ray cluster.

A host is a Ray node carrying the custom resource ``kvmesh_host:<name>`` (``ray start --resources``; the
namespace harness in ``cluster.hosts`` sets it), whose amount is the number of emulated GPUs it takes.
A worker actor asks for its engines' GPUs of its host's resource, the router for ``ROUTER_SHARE`` of its
host's: Ray can then run each actor on that node and nowhere else, never by luck.

``plan_placement`` is pure (it takes the nodes as ``RayNode`` rows, so it is tested without Ray): it
checks the whole demand against what the alive nodes offer and raises ``PlacementError`` naming every
missing host and every short one before anything starts; otherwise it returns each host's node address,
which the launcher uses as that host's bind address when the cluster spans hosts. ``ray_nodes`` reads
the rows from a connected Ray.

Regions: a host that declares its region (``HostSpec.region``: where that machine really is; nodes' own
regions alone only shape emulated links) is checked against its Ray node's region label,
``ray.io/availability-region`` (Ray sets it from the cloud or from ``RAY_NODE_REGION`` at ``ray start``) or
else a custom ``region`` label (``ray start --labels region=...``); a host placed on a node labelled with
another region is a ``PlacementError`` naming both, before anything starts. A node with no region label is not
checked (a one-machine harness has no geography), and ``Placement.unchecked_regions`` lists those hosts so the
launcher can say so.

Bind addresses (``Placement.bind_for``): ``placement.bind_host`` when it is an address; with ``auto``, 127.0.0.1
on one host and the host's node address when the cluster spans hosts. A wildcard bind (``0.0.0.0``) is
advertised to peers as the node's address (``advertised``). Attached to a Ray cluster of several
nodes with no hosts declared, placement would be luck: ``plan_placement`` refuses it.
"""

from __future__ import annotations

import ipaddress
from collections import defaultdict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, NewType

from config.cluster import ClusterSpec

HostName = NewType("HostName", str)

HOST_RESOURCE_PREFIX = "kvmesh_host:"
REGION_LABELS = ("ray.io/availability-region", "region")
"""Ray node labels that say a node's region, in order of precedence."""
ROUTER_SHARE = 0.01
"""Amount of its host's resource a router actor takes (it runs no emulated GPU)."""
LOOPBACK = "127.0.0.1"


def host_resource(host: str) -> str:
    """The Ray custom resource naming ``host``."""
    return f"{HOST_RESOURCE_PREFIX}{host}"


class PlacementError(RuntimeError):
    """The Ray cluster cannot hold the spec; the message names each missing or short host."""


@dataclass(frozen=True)
class RayNode:
    """One row of ``ray.nodes()``: the part placement reads."""

    node_id: str
    address: str
    alive: bool
    resources: Mapping[str, float]
    labels: Mapping[str, str] = field(default_factory=dict)

    def region(self) -> tuple[str, str] | None:
        """(label, region) from the first of ``REGION_LABELS`` the node carries; None without one."""
        for key in REGION_LABELS:
            if self.labels.get(key):
                return key, self.labels[key]
        return None


@dataclass(frozen=True)
class Placement:
    """Each declared host's node address (empty on one host) and the bind address of each host."""

    addresses: Mapping[HostName, str]
    bind: Mapping[HostName, str]
    default_bind: str
    unchecked_regions: tuple[HostName, ...] = ()
    """Hosts with a region in the spec whose Ray node carries no region label (not checked)."""

    def bind_for(self, host: str | None) -> str:
        return self.bind.get(HostName(host), self.default_bind) if host is not None else self.default_bind

    def address_for(self, host: str | None) -> str:
        """Where peers reach ``host``: its node's address (127.0.0.1 on one host)."""
        return self.addresses.get(HostName(host), LOOPBACK) if host is not None else LOOPBACK


def host_demand(spec: ClusterSpec) -> dict[HostName, float]:
    """Emulated GPUs each host must offer: its nodes' engines' TP, plus the routers' share on the router host."""
    demand: dict[HostName, float] = defaultdict(float)
    for node in spec.nodes:
        if node.host is not None:
            demand[HostName(node.host)] += sum(g.tp * g.replicas for g in node.engines)
    if spec.placement.router_host is not None:
        routers = len(spec.regions) if spec.router.partition_by_residency else 1
        demand[HostName(spec.placement.router_host)] += ROUTER_SHARE * routers
    return dict(demand)


def host_regions(spec: ClusterSpec) -> dict[HostName, str]:
    """The region each host declares (``HostSpec.region``); hosts without one are absent."""
    return {HostName(h.name): h.region for h in spec.placement.hosts if h.region is not None}


def plan_placement(spec: ClusterSpec, nodes: Sequence[RayNode]) -> Placement:
    """Where each host is, or ``PlacementError`` naming everything missing (see the module docstring)."""
    alive = [n for n in nodes if n.alive]
    bind_host = spec.placement.bind_host
    if not spec.placement.hosts:
        if len(alive) > 1 and bind_host == "auto":
            raise PlacementError(
                f"the Ray cluster has {len(alive)} nodes but the spec declares no placement.hosts: engines would "
                f"land wherever Ray puts them and bind 127.0.0.1. Declare placement.hosts (each node started with "
                f"--resources '{{\"{HOST_RESOURCE_PREFIX}<name>\": <gpus>}}') and name a host per node")
        return Placement({}, {}, LOOPBACK if bind_host == "auto" else bind_host)
    problems: list[str] = []
    addresses: dict[HostName, str] = {}
    found: dict[HostName, RayNode] = {}
    for host, need in sorted(host_demand(spec).items()):
        res = host_resource(host)
        offering = [n for n in alive if n.resources.get(res, 0.0) > 0]
        if not offering:
            problems.append(f"host {host!r}: no alive Ray node has resource {res!r} (needs {need:g})")
            continue
        if len(offering) > 1:
            problems.append(f"host {host!r}: {len(offering)} Ray nodes carry {res!r} "
                            f"({', '.join(n.address for n in offering)}); a host must be one node")
            continue
        have = offering[0].resources[res]
        if have + 1e-9 < need:
            problems.append(f"host {host!r}: the spec needs {need:g} of {res!r} (emulated GPUs) but node "
                            f"{offering[0].address} offers {have:g}")
            continue
        addresses[host] = offering[0].address
        found[host] = offering[0]
    regions = host_regions(spec)
    unchecked: list[HostName] = []
    for host, node in sorted(found.items()):
        want, label = regions.get(host), node.region()
        if want is None:
            continue
        if label is None:
            unchecked.append(host)
        elif label[1] != want:
            problems.append(f"host {host!r}: the spec puts it in region {want!r} but its Ray "
                            f"node {node.address} is labelled {label[0]}={label[1]}")
    if problems:
        known = sorted({k[len(HOST_RESOURCE_PREFIX):] for n in alive for k in n.resources
                        if k.startswith(HOST_RESOURCE_PREFIX)})
        raise PlacementError("the Ray cluster cannot hold this spec: " + "; ".join(problems)
                             + f" (hosts the cluster has: {', '.join(known) or 'none'})")
    if bind_host != "auto":
        bind = dict.fromkeys(addresses, bind_host)
        default = bind_host
    elif spec.placement.multi_host:
        bind, default = dict(addresses), LOOPBACK
    else:
        bind, default = dict.fromkeys(addresses, LOOPBACK), LOOPBACK
    return Placement(addresses, bind, default, tuple(unchecked))


def advertised(meta: Mapping[str, Any], bind: str, address: str) -> dict[str, Any]:
    """An engine's URLs and KV address as other hosts reach it.

    A server bound to a wildcard (``0.0.0.0``, ``::``) reports that wildcard in its URLs; peers must dial
    the node's ``address`` instead. Other binds are returned unchanged.
    """
    out = dict(meta)
    if not ipaddress.ip_address(bind).is_unspecified:
        return out
    for key in ("url", "feed_url"):
        if isinstance(out.get(key), str):
            out[key] = out[key].replace(f"//{bind}:", f"//{address}:", 1)
    kv = out.get("kv_address")
    if isinstance(kv, dict) and str(kv.get("location", "")).startswith(f"{bind}:"):
        out["kv_address"] = {**kv, "location": address + kv["location"][len(bind):]}
    return out


def actor_resources(host: str | None, amount: float) -> dict[str, Any]:
    """Ray actor options pinning it to ``host`` (none on one host)."""
    return {"resources": {host_resource(host): amount}} if host is not None else {}


def ray_nodes() -> list[RayNode]:
    """The nodes of the connected Ray cluster."""
    import ray

    return [RayNode(str(n["NodeID"]), str(n["NodeManagerAddress"]), bool(n["Alive"]),
                    {str(k): float(v) for k, v in n.get("Resources", {}).items()},
                    {str(k): str(v) for k, v in (n.get("Labels") or {}).items()}) for n in ray.nodes()]

"""Host-level faults for the chaos schedule, on a cluster running on the namespace harness.

``HostFaultControl`` is the chaos ``ClusterControl`` (``cluster.chaos.control.RayClusterControl``) plus
``kill_host_of``, which ``cluster.chaos.injectors``'s ``kill_node`` uses when the control has it
(``HostControl``): instead of killing the node's actors one by one through Ray, the whole host the node
runs on is lost at once (``Harness.kill_host``: its raylet and every process on it SIGKILLed, as a
machine that loses power), so every engine of every emulated node on that host dies, and Ray itself sees
a node die. ``partition_host`` brings the host's link down or up (its Ray node, feeds, HTTP and KV all cut).

The driver running the schedule must live on a host the schedule does not fault: killing or cutting its own
host would end or strand the run. Both faults refuse such a host (``ValueError`` naming it) before acting.

Failure behaviour: a node with no host in the spec (``NodeSpec.host``) raises ``KeyError`` naming it; a host
the harness does not have, ``KeyError``; the driver's own host, ``ValueError``.
"""

from __future__ import annotations

import os
from typing import Any

from cluster.chaos.control import RayClusterControl
from cluster.hosts.harness import Harness
from cluster.hosts.network import netns_pids


class HostFaultControl(RayClusterControl):
    def __init__(self, handle: Any, harness: Harness, timeout_s: float = 60.0) -> None:
        super().__init__(handle, timeout_s)
        self.harness = harness
        self.killed_pids: dict[str, list[int]] = {}

    def host_of(self, node: str) -> str:
        for n in self.handle.spec.nodes:
            if n.name == node and n.host is not None:
                return str(n.host)
        raise KeyError(f"node {node!r} has no host in the spec (nodes.host), so it cannot be killed as a host")

    def _not_mine(self, host: str, what: str) -> None:
        if os.getpid() in netns_pids(self.harness.run, self.harness.state().host(host).netns):
            raise ValueError(f"cannot {what} {host}: this driver runs on it (run the chaos driver on another host, "
                             f"e.g. run_cluster.py hosts exec HOST -- ...)")

    def kill_host_of(self, node: str) -> list[str]:
        """Kill the host ``node`` runs on; the engines that died with it (every engine on that host)."""
        host = self.host_of(node)
        self._not_mine(host, "kill")
        self.killed_pids[host] = self.harness.kill_host(host)
        gone = sorted(n for n, d in self.handle.engines.items() if d.get("host") == host and n not in self.dead)
        self.dead.update(gone)
        return gone

    def partition_host(self, host: str, on: bool) -> None:
        """Cut ``host`` off every other host (``on``) or join it back."""
        self._not_mine(host, "partition")
        self.harness.partition(host, connected=not on)

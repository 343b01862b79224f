"""Hosts as network namespaces on one machine: the plumbing (``ip``, ``tc``) and its names.

Layout of a harness called ``<name>`` with N hosts (``HostLayout``):

- a bridge ``<name>-br`` in the root namespace holding the subnet's first address (the gateway; the
  machine itself reaches every host through it, and so does a driver or a load generator run outside);
- per host ``host<i>``: a namespace ``<name>-host<i>``, a veth pair whose root side ``<name>-h<i>`` is a
  port of the bridge and whose other side is ``eth0`` inside the namespace with address ``.<i+1>``, plus
  ``lo`` up and a default route through the bridge;
- each host's link capped with ``tc tbf`` in both directions (``eth0``'s egress is what the host sends,
  the root side's egress what it receives) at the link preset's bandwidth. This kernel has no netem:
  latency stays emulated in the application.

Every command goes through a ``Runner`` (the real one runs ``ip``/``tc``; tests pass a recorder), and the
functions here never decide what to tear down: the harness records what it made and deletes exactly that.
"""

from __future__ import annotations

import ipaddress
import subprocess
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

MAX_NAME = 8
"""Harness names are short: interface names are at most 15 characters (``<name>-h<i>``)."""
TBF_MIN_BURST = 256 * 1024
"""Bytes: a veth hands tbf GSO packets of up to 64 KiB; a smaller bucket would drop them."""
TBF_BURST_S = 0.001
"""The bucket holds a millisecond of the rate when that is more than ``TBF_MIN_BURST``."""
TBF_LATENCY_MS = 200


class Runner(Protocol):
    """Runs one command (argv, no shell); raises ``CommandError`` when ``check`` and it fails."""

    def __call__(self, argv: Sequence[str], *, check: bool = True) -> str: ...


class CommandError(RuntimeError):
    """A plumbing command failed; the message carries the command and its stderr."""


def run_command(argv: Sequence[str], *, check: bool = True) -> str:
    """The real ``Runner``."""
    p = subprocess.run(list(argv), capture_output=True, text=True, check=False)
    if check and p.returncode != 0:
        raise CommandError(f"{' '.join(argv)} failed ({p.returncode}): {p.stderr.strip() or p.stdout.strip()}")
    return p.stdout


@dataclass(frozen=True)
class HostLayout:
    """Names and address of one host (see the module docstring)."""

    name: str
    netns: str
    veth: str
    address: str
    prefix_len: int


@dataclass(frozen=True)
class NetworkLayout:
    harness: str
    bridge: str
    gateway: str
    prefix_len: int
    hosts: tuple[HostLayout, ...]


def layout(harness: str, count: int, subnet: str) -> NetworkLayout:
    """The names and addresses for ``count`` hosts of harness ``harness`` in ``subnet`` (ValueError if bad)."""
    if not (1 <= len(harness) <= MAX_NAME and harness.replace("-", "").isalnum() and harness[0].isalpha()):
        raise ValueError(f"harness name {harness!r}: 1-{MAX_NAME} letters, digits or '-', starting with a letter")
    if count < 1:
        raise ValueError(f"a harness needs at least one host, got {count}")
    net = ipaddress.ip_network(subnet)
    if net.version != 4 or net.num_addresses < count + 3:
        raise ValueError(f"subnet {subnet} is not an IPv4 network with room for {count} hosts and a gateway")
    base = net.network_address
    hosts = tuple(HostLayout(f"host{i}", f"{harness}-host{i}", f"{harness}-h{i}", str(base + 1 + i), net.prefixlen)
                  for i in range(1, count + 1))
    return NetworkLayout(harness, f"{harness}-br", str(base + 1), net.prefixlen, hosts)


def tbf_args(rate_bytes_s: float) -> list[str]:
    """``tc qdisc ... tbf`` arguments for a cap of ``rate_bytes_s`` bytes per second."""
    burst = max(TBF_MIN_BURST, int(rate_bytes_s * TBF_BURST_S))
    return ["tbf", "rate", f"{int(rate_bytes_s * 8)}bit", "burst", str(burst), "latency", f"{TBF_LATENCY_MS}ms"]


def create_bridge(run: Runner, net: NetworkLayout) -> None:
    run(["ip", "link", "add", net.bridge, "type", "bridge"])
    run(["ip", "addr", "add", f"{net.gateway}/{net.prefix_len}", "dev", net.bridge])
    run(["ip", "link", "set", net.bridge, "up"])


def create_netns(run: Runner, host: HostLayout) -> None:
    run(["ip", "netns", "add", host.netns])


def create_link(run: Runner, net: NetworkLayout, host: HostLayout) -> None:
    """The host's veth pair, its address, ``lo`` and the default route through the bridge."""
    ns = ["ip", "-n", host.netns]
    run(["ip", "link", "add", host.veth, "type", "veth", "peer", "name", "eth0", "netns", host.netns])
    run(["ip", "link", "set", host.veth, "master", net.bridge, "up"])
    run([*ns, "addr", "add", f"{host.address}/{host.prefix_len}", "dev", "eth0"])
    run([*ns, "link", "set", "eth0", "up"])
    run([*ns, "link", "set", "lo", "up"])
    run([*ns, "route", "add", "default", "via", net.gateway])


def cap_link(run: Runner, host: HostLayout, rate_bytes_s: float) -> None:
    """``tc tbf`` on both directions of the host's link."""
    run(["ip", "netns", "exec", host.netns, "tc", "qdisc", "replace", "dev", "eth0", "root", *tbf_args(rate_bytes_s)])
    run(["tc", "qdisc", "replace", "dev", host.veth, "root", *tbf_args(rate_bytes_s)])


def set_link_up(run: Runner, host: HostLayout, up: bool) -> None:
    """Partition (``up=False``) or heal the host: its side of the veth down or up."""
    run(["ip", "-n", host.netns, "link", "set", "eth0", "up" if up else "down"])


def netns_pids(run: Runner, netns: str) -> list[int]:
    """Every process in the namespace (empty when it is gone)."""
    out = run(["ip", "netns", "pids", netns], check=False)
    return sorted(int(p) for p in out.split() if p.isdigit())


def netns_exists(run: Runner, netns: str) -> bool:
    return netns in {line.split()[0] for line in run(["ip", "netns", "list"], check=False).splitlines() if line}


def link_exists(run: Runner, ifname: str) -> bool:
    return bool(run(["ip", "-o", "link", "show", "dev", ifname], check=False).strip())


def delete_netns(run: Runner, netns: str) -> None:
    run(["ip", "netns", "del", netns], check=False)


def delete_link(run: Runner, ifname: str) -> None:
    run(["ip", "link", "del", ifname], check=False)

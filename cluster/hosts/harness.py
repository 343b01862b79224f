"""The multi-host harness: N network namespaces on one machine, each a Ray node of one token-auth cluster.

``Harness(run_dir).up(count, link)`` builds the network of ``cluster.hosts.network`` (bridge, one
namespace and capped veth per host), writes a fresh auth token (0600) to the run dir, starts the Ray head
in ``host1`` and ``ray start --address`` workers in the others (all with ``RAY_AUTH_MODE=token`` and the
token file), each node carrying the custom resource ``kvmesh_host:<host>`` with ``gpus_per_host`` units
(``cluster.placement``). ``down()`` ends every process in the harness's namespaces (SIGTERM, then SIGKILL
after ``grace_s``), deletes the namespaces, veths and bridge, and removes the state.

Invariants: the state file (``state.json``) lists every object *before* it is created, so ``down()`` after
a crash at any point deletes exactly what exists of it and nothing else; processes are found by namespace
(``ip netns pids``), so only processes inside namespaces this harness made are ever signalled (the Ray
nodes, the actors they forked and drivers run by ``exec_argv``), never by name. A second ``up`` on a run
dir whose state exists is refused. Without root (no CAP_NET_ADMIN) ``HarnessUnavailable`` says so before
anything is made.

Host-level faults: ``kill_host`` SIGKILLs every process of a host (its raylet and every actor on it: a
machine lost); ``partition`` brings the host's link down or up.
"""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import shutil
import signal
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path

from pydantic import BaseModel, Field

from cluster.hosts.network import (
    HostLayout,
    NetworkLayout,
    Runner,
    cap_link,
    create_bridge,
    create_link,
    create_netns,
    delete_link,
    delete_netns,
    layout,
    link_exists,
    netns_exists,
    netns_pids,
    run_command,
    set_link_up,
)
from cluster.placement import host_resource
from config.catalog import default_catalog

RAY_PORT = 6379
DEFAULT_SUBNET = "10.213.0.0/24"
DEFAULT_RUN_DIR = Path("/tmp/kvmesh-hosts")


class HarnessUnavailable(RuntimeError):
    """The harness cannot run here (not root, no ``ip``/``tc``); the message says what is missing."""


class HarnessError(RuntimeError):
    """Bringing the harness up or down failed; the message says which step."""


class Made(BaseModel):
    """One object the harness creates: ``bridge``, ``netns`` or ``veth`` (recorded before it is made)."""

    kind: str
    name: str


class HostState(BaseModel):
    name: str
    netns: str
    veth: str
    address: str
    prefix_len: int
    gpus: float
    pids: list[int] = Field(default_factory=list)
    """Processes seen in the namespace when its Ray node had started (for the record; kills go by namespace)."""

    def layout(self) -> HostLayout:
        return HostLayout(self.name, self.netns, self.veth, self.address, self.prefix_len)


class HarnessState(BaseModel):
    name: str
    subnet: str
    bridge: str
    gateway: str
    link: str
    rate_bytes_s: float
    token_path: str
    ray_temp_dir: str
    python: str
    hosts: list[HostState] = Field(default_factory=list)
    made: list[Made] = Field(default_factory=list)
    startup_s: float = 0.0

    @property
    def head_address(self) -> str:
        return f"{self.hosts[0].address}:{RAY_PORT}"

    def host(self, name: str) -> HostState:
        for h in self.hosts:
            if h.name == name:
                return h
        raise KeyError(f"no host {name!r} in harness {self.name} (hosts: {', '.join(h.name for h in self.hosts)})")


def check_available(which: Callable[[str], str | None] = shutil.which, euid: int | None = None) -> None:
    """``HarnessUnavailable`` unless this process may create namespaces and has ``ip`` and ``tc``."""
    uid = os.geteuid() if euid is None else euid
    if uid != 0:
        raise HarnessUnavailable("the hosts harness needs root (CAP_NET_ADMIN) to create network namespaces, veth "
                                 "pairs and tc qdiscs; run it as root, or use a real multi-host Ray cluster")
    missing = [t for t in ("ip", "tc") if which(t) is None]
    if missing:
        raise HarnessUnavailable(f"the hosts harness needs {' and '.join(missing)} (iproute2) on PATH")


class Harness:
    """See the module docstring. ``run`` runs plumbing commands (tests record them instead)."""

    def __init__(self, run_dir: Path = DEFAULT_RUN_DIR, *, run: Runner = run_command,
                 kill: Callable[[int, signal.Signals], None] | None = None, grace_s: float = 5.0) -> None:
        self.run_dir = run_dir
        self.run = run
        self.kill = kill or _signal
        self.grace_s = grace_s

    @property
    def state_path(self) -> Path:
        return self.run_dir / "state.json"

    def state(self) -> HarnessState:
        if not self.state_path.exists():
            raise HarnessError(f"no harness is up in {self.run_dir} (no {self.state_path.name})")
        return HarnessState.model_validate_json(self.state_path.read_text())

    def _save(self, st: HarnessState) -> None:
        tmp = self.state_path.with_suffix(".tmp")
        tmp.write_text(st.model_dump_json(indent=1))
        tmp.replace(self.state_path)

    # -- up ----------------------------------------------------------------------------------------
    def up(self, count: int, link: str = "tcp-25g", *, name: str = "kvmesh", subnet: str = DEFAULT_SUBNET,
           gpus_per_host: float = 64.0, cpus_per_host: int = 2, progress: Callable[[str], None] | None = None,
           ) -> HarnessState:
        """Build the hosts and start their Ray nodes; on any failure everything made so far is torn down."""
        say = progress or (lambda m: None)
        check_available()
        links = default_catalog().links
        if link not in links:
            raise ValueError(f"unknown link preset {link!r} (known: {', '.join(links.names())})")
        net = layout(name, count, subnet)
        if self.state_path.exists():
            raise HarnessError(f"a harness is already up in {self.run_dir}: run 'hosts down' first")
        clash = [n for n in (net.bridge, *(h.veth for h in net.hosts)) if link_exists(self.run, n)]
        clash += [h.netns for h in net.hosts if netns_exists(self.run, h.netns)]
        if clash:
            raise HarnessError(f"{', '.join(clash)} already exist (another harness named {name!r}?): "
                               f"pick another --name, or remove them")
        t0 = time.monotonic()
        self.run_dir.mkdir(parents=True, exist_ok=True)
        token_path = self.run_dir / "token"
        token_path.touch(mode=0o600)
        token_path.write_text(secrets.token_hex(32))
        st = HarnessState(name=name, subnet=subnet, bridge=net.bridge, gateway=net.gateway, link=link,
                          rate_bytes_s=links.get(link).bandwidth_gbps * 1e9, token_path=str(token_path),
                          ray_temp_dir=str(self.run_dir / "ray"), python=sys.executable,
                          hosts=[HostState(name=h.name, netns=h.netns, veth=h.veth, address=h.address,
                                           prefix_len=h.prefix_len, gpus=gpus_per_host) for h in net.hosts])
        self._save(st)
        try:
            self._build_network(st, net, say)
            self._start_ray(st, cpus_per_host, say)
        except BaseException:
            self.down()
            raise
        st.startup_s = time.monotonic() - t0
        self._save(st)
        say(f"{count} hosts up in {st.startup_s:.1f} s; Ray head at {st.head_address}")
        return st

    def _record(self, st: HarnessState, kind: str, name: str) -> None:
        st.made.append(Made(kind=kind, name=name))
        self._save(st)

    def _build_network(self, st: HarnessState, net: NetworkLayout, say: Callable[[str], None]) -> None:
        say(f"bridge {net.bridge} ({net.gateway}/{net.prefix_len}), {len(net.hosts)} namespaces, "
            f"links capped at {st.rate_bytes_s / 1e9:g} GB/s ({st.link})")
        self._record(st, "bridge", net.bridge)
        create_bridge(self.run, net)
        for h in net.hosts:
            self._record(st, "netns", h.netns)
            create_netns(self.run, h)
            self._record(st, "veth", h.veth)
            create_link(self.run, net, h)
            cap_link(self.run, h, st.rate_bytes_s)

    def env(self, st: HarnessState) -> dict[str, str]:
        """What a process on a host needs to join the cluster: token auth and the head's address."""
        return {"RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN_PATH": st.token_path, "RAY_ADDRESS": st.head_address,
                "RAY_worker_niceness": "0"}

    def exec_argv(self, st: HarnessState, host: str, argv: Sequence[str]) -> list[str]:
        """``argv`` run on ``host``: inside its namespace, with the cluster's environment."""
        h = st.host(host)
        return ["ip", "netns", "exec", h.netns, "env", *(f"{k}={v}" for k, v in self.env(st).items()), *argv]

    def _ray_start(self, st: HarnessState, h: HostState, cpus: int, head: bool) -> list[str]:
        ray_bin = str(Path(st.python).with_name("ray"))
        where = ["--head", f"--port={RAY_PORT}", "--include-dashboard=false"] if head else [
            f"--address={st.head_address}"]
        return self.exec_argv(st, h.name, [
            ray_bin, "start", *where, f"--node-ip-address={h.address}", f"--num-cpus={cpus}",
            f"--resources={json.dumps({host_resource(h.name): h.gpus})}", "--object-store-memory=100000000",
            f"--temp-dir={st.ray_temp_dir}", "--disable-usage-stats"])

    def _start_ray(self, st: HarnessState, cpus: int, say: Callable[[str], None]) -> None:
        import subprocess

        say(f"Ray head on {st.hosts[0].name} ({st.head_address}), token auth")
        self.run(self._ray_start(st, st.hosts[0], cpus, head=True))
        # One at a time: nodes of one machine share the session dir, and two `ray start`s at once pick the
        # same socket and log file names (measured: the second raylet never came up).
        for h in st.hosts[1:]:
            say(f"Ray worker node on {h.name} ({h.address})")
            p = subprocess.run(self._ray_start(st, h, cpus, head=False), capture_output=True, text=True, check=False)
            if p.returncode != 0:
                raise HarnessError(f"ray start on {h.name} failed ({p.returncode}): {(p.stderr or p.stdout)[-2000:]}")
        for h in st.hosts:
            h.pids = netns_pids(self.run, h.netns)
        self._save(st)

    # -- faults ------------------------------------------------------------------------------------
    def kill_host(self, host: str) -> list[int]:
        """SIGKILL every process on ``host`` (its raylet and every actor on it); the PIDs signalled."""
        st = self.state()
        pids = netns_pids(self.run, st.host(host).netns)
        for pid in pids:
            self.kill(pid, signal.SIGKILL)
        return pids

    def partition(self, host: str, *, connected: bool) -> None:
        """Cut ``host`` off the bridge (``connected=False``) or join it back."""
        set_link_up(self.run, self.state().host(host).layout(), connected)

    # -- down --------------------------------------------------------------------------------------
    def down(self) -> list[str]:
        """Tear down exactly what the state records (see the module docstring); what was removed."""
        if not self.state_path.exists():
            return []
        st = self.state()
        namespaces = [m.name for m in st.made if m.kind == "netns"]
        self._end_processes(namespaces)
        removed: list[str] = []
        for m in reversed(st.made):
            if m.kind == "netns" and netns_exists(self.run, m.name):
                delete_netns(self.run, m.name)
                removed.append(f"netns {m.name}")
            elif m.kind in ("veth", "bridge") and link_exists(self.run, m.name):
                delete_link(self.run, m.name)
                removed.append(f"{m.kind} {m.name}")
        shutil.rmtree(st.ray_temp_dir, ignore_errors=True)
        Path(st.token_path).unlink(missing_ok=True)
        self.state_path.unlink(missing_ok=True)
        return removed

    def _end_processes(self, namespaces: list[str]) -> None:
        def alive() -> list[int]:
            return [p for ns in namespaces for p in netns_pids(self.run, ns)]

        for pid in alive():
            self.kill(pid, signal.SIGTERM)
        deadline = time.monotonic() + self.grace_s
        while alive() and time.monotonic() < deadline:
            time.sleep(0.2)
        for pid in alive():
            self.kill(pid, signal.SIGKILL)
        deadline = time.monotonic() + self.grace_s
        while alive() and time.monotonic() < deadline:  # a killed process leaves its namespace once reaped
            time.sleep(0.1)


def _signal(pid: int, sig: signal.Signals) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, sig)

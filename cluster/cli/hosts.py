"""``hosts``: the network-namespace harness (``cluster.hosts``): several Ray hosts on one machine.

``hosts up N [--link PRESET]`` builds N hosts (a namespace, a veth on a bridge capped at the preset's
bandwidth, a Ray node with token auth each) and prints how to use them; ``hosts exec HOST -- CMD`` runs a
command on a host with the cluster's environment (e.g. ``run_cluster.py up --config ... --address ...``);
``hosts kill HOST`` and ``hosts partition HOST [--heal]`` are host-level faults; ``hosts down`` tears down
exactly what ``up`` made, also after a crash. Needs root.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from cluster.cli import Command, register
from cluster.cli.output import console, print_json

if TYPE_CHECKING:
    from cluster.hosts.harness import Harness


def configure(p: argparse.ArgumentParser) -> None:
    from cluster.hosts.harness import DEFAULT_RUN_DIR, DEFAULT_SUBNET

    p.add_argument("--run-dir", type=Path, default=DEFAULT_RUN_DIR, help="harness state, token and Ray logs")
    sub = p.add_subparsers(dest="action", required=True, metavar="ACTION")
    up = sub.add_parser("up", help="create N hosts and start a Ray node in each")
    up.add_argument("count", type=int, help="number of hosts (the Ray head runs on host1)")
    up.add_argument("--link", default="tcp-25g", help="link preset capping each host's veth (presets/links.yaml)")
    up.add_argument("--name", default="kvmesh", help="prefix of the namespaces and interfaces (at most 8 characters)")
    up.add_argument("--subnet", default=DEFAULT_SUBNET, help="IPv4 subnet of the bridge (its first address: gateway)")
    up.add_argument("--gpus-per-host", type=float, default=64.0, help="emulated GPUs each host offers")
    up.add_argument("--cpus-per-host", type=int, default=2, help="Ray CPUs each node advertises")
    up.add_argument("--json", action="store_true", help="print the harness state as JSON")
    sub.add_parser("down", help="stop every process on the hosts and delete what 'up' made")
    st = sub.add_parser("status", help="the hosts, their addresses and the Ray head")
    st.add_argument("--json", action="store_true")
    ex = sub.add_parser("exec", help="run a command on a host, e.g. hosts exec host1 -- python run_cluster.py ...")
    ex.add_argument("host")
    ex.add_argument("argv", nargs=argparse.REMAINDER, help="the command (after --)")
    kill = sub.add_parser("kill", help="host-level fault: SIGKILL the host's raylet and every actor on it")
    kill.add_argument("host")
    part = sub.add_parser("partition", help="host-level fault: bring the host's link down (--heal: up)")
    part.add_argument("host")
    part.add_argument("--heal", action="store_true")


def run(args: argparse.Namespace) -> int:
    from cluster.hosts.harness import Harness, HarnessError, HarnessUnavailable

    out = console()
    h = Harness(args.run_dir)
    try:
        if args.action == "up":
            st = h.up(args.count, args.link, name=args.name, subnet=args.subnet, gpus_per_host=args.gpus_per_host,
                      cpus_per_host=args.cpus_per_host, progress=lambda m: out.print(f"[dim]{m}[/dim]"))
            if args.json:
                print_json(st.model_dump())
            else:
                _print_status(h)
        elif args.action == "down":
            removed = h.down()
            out.print(f"removed: {', '.join(removed) or 'nothing (no harness was up)'}")
        elif args.action == "status":
            if args.json:
                print_json(h.state().model_dump())
            else:
                _print_status(h)
        elif args.action == "exec":
            argv = args.argv[1:] if args.argv[:1] == ["--"] else args.argv
            if not argv:
                raise SystemExit("error: hosts exec HOST -- COMMAND...")
            return subprocess.run(h.exec_argv(h.state(), args.host, argv), check=False).returncode
        elif args.action == "kill":
            pids = h.kill_host(args.host)
            out.print(f"killed {len(pids)} processes on {args.host}: {' '.join(map(str, pids))}")
        elif args.action == "partition":
            h.partition(args.host, connected=args.heal)
            out.print(f"{args.host}: link {'up' if args.heal else 'down'}")
    except (HarnessUnavailable, HarnessError, KeyError, ValueError) as e:
        raise SystemExit(f"error: {e}") from None
    return 0


def _print_status(h: Harness) -> None:
    st = h.state()
    out = console()
    for host in st.hosts:
        out.print(f"{host.name}: {host.address}  netns {host.netns}  {host.gpus:g} GPUs  "
                  f"(resource kvmesh_host:{host.name})")
    out.print(f"Ray head {st.head_address} (token in {st.token_path}); links {st.link} "
              f"({st.rate_bytes_s / 1e9:g} GB/s each way); up in {st.startup_s:.1f} s")
    me = Path(sys.argv[0]).name if sys.argv else "run_cluster.py"
    out.print(f"try: {me} hosts exec host1 -- python run_cluster.py up --config SPEC --address {st.head_address}")


register(Command("hosts", "multi-host harness: Ray hosts as network namespaces on this machine (needs root)",
                 configure, run))

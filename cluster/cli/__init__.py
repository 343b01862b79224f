"""``run_cluster.py`` subcommands: one module each, registered by name."""

from __future__ import annotations

import argparse
from collections.abc import Callable
from dataclasses import dataclass


@dataclass(frozen=True)
class Command:
    name: str
    help: str
    configure: Callable[[argparse.ArgumentParser], None]
    run: Callable[[argparse.Namespace], int]


COMMANDS: dict[str, Command] = {}


def register(cmd: Command) -> Command:
    if COMMANDS.get(cmd.name, cmd) is not cmd:
        raise ValueError(f"command {cmd.name!r} registered twice")
    COMMANDS[cmd.name] = cmd
    return cmd


def build_parser() -> argparse.ArgumentParser:
    # Importing every module of this package registers its command.
    import importlib
    import pkgutil

    import cluster.cli as pkg

    for info in pkgutil.iter_modules(pkg.__path__):
        if not info.name.startswith("_") and info.name != "output":
            importlib.import_module(f"cluster.cli.{info.name}")

    parser = argparse.ArgumentParser(
        prog="run_cluster.py",
        description="kvmesh: emulate a disaggregated LLM serving fleet on Ray (everything real but the GPU math).",
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for cmd in COMMANDS.values():
        p = sub.add_parser(cmd.name, help=cmd.help, description=cmd.help)
        cmd.configure(p)
        p.set_defaults(_run=cmd.run)
    return parser

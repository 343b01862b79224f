#!/usr/bin/env python3
"""kvmesh command line: ``python run_cluster.py COMMAND --help``."""

from __future__ import annotations

import sys


def main(argv: list[str] | None = None) -> int:
    from cluster.cli import build_parser

    parser = build_parser()
    args = parser.parse_args(argv)
    return int(args._run(args))


if __name__ == "__main__":
    sys.exit(main())

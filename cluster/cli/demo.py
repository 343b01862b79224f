"""``demo``: the README's main job."""

from __future__ import annotations

import argparse

from cluster.cli import Command, register
from cluster.cli import estimate as estimate_cmd


def configure(p: argparse.ArgumentParser) -> None:
    p.add_argument("--json", action="store_true", help="print the result as one JSON object on the last line")


def run(args: argparse.Namespace) -> int:
    # Until emulated engines exist, the demo is the lessons card's estimate and a calibrated counterpart.
    for argv in (["--profile", "lesson-70b-fp8"], ["--model", "llama-3.1-70b", "--hardware", "h100-80g-sxm",
                                                     "--tp", "4"]):
        ns = argparse.Namespace(profile=None, model=None, hardware=None, decode_hardware=None, tp=1,
                                prompt=4096, output=500, chunk=8192, rdma_link="rdma-ib-ndr400",
                                tcp_link="tcp-25g", json=False)
        for k, v in zip(argv[::2], argv[1::2], strict=True):
            setattr(ns, k.lstrip("-").replace("-", "_"), int(v) if k == "--tp" else v)
        ns.json = args.json and argv[1] == "lesson-70b-fp8"
        estimate_cmd.run(ns)
    return 0


register(Command("demo", "the main job: launch a small cluster, drive it, print what happened", configure, run))

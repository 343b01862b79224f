"""``tokenizer export DIR``: kvmesh's built-in tokenizer in Hugging Face format (for AIPerf, guidellm, vLLM's
benchmark run offline against kvmesh: they count the same tokens kvmesh does)."""

from __future__ import annotations

import argparse
from pathlib import Path

from cluster.cli import Command, register
from cluster.cli.output import console


def configure(p: argparse.ArgumentParser) -> None:
    sub = p.add_subparsers(dest="action", required=True, metavar="ACTION")
    e = sub.add_parser("export", help="write tokenizer.json, tokenizer_config.json, ... into DIR")
    e.add_argument("dir", type=Path)
    e.add_argument("--vocab-size", type=int, default=32000, help="the served model's vocabulary size")
    e.add_argument("--hf-home", type=Path, default=None,
                   help="also install it in this Hugging Face cache (HF_HOME) as --repo, for tools that only "
                        "load tokenizers through the Hub cache offline")
    e.add_argument("--repo", default="kvmesh/builtin-tokenizer", help="the repo name under --hf-home")


def run(args: argparse.Namespace) -> int:
    from actors.engine.hf_export import export_hf, install_in_hf_cache

    paths = export_hf(args.dir, args.vocab_size)
    console().print("wrote " + ", ".join(str(p) for p in paths))
    if args.hf_home is not None:
        snap = install_in_hf_cache(args.dir, args.hf_home, args.repo)
        console().print(f"cached as {args.repo} in {snap} (use HF_HOME={args.hf_home} HF_HUB_OFFLINE=1)")
    return 0


register(Command("tokenizer", "export kvmesh's built-in tokenizer in Hugging Face format (tokenizer export DIR)",
                 configure, run))

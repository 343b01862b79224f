"""``estimate``: one isolated request, colocated against disaggregated over RDMA and over TCP."""

from __future__ import annotations

import argparse

from rich.table import Table

from cluster.cli import Command, register
from cluster.cli.output import console, fmt_ms, print_json
from cluster.estimate import DEFAULT_CHUNK, DEFAULT_RDMA, DEFAULT_TCP, estimate_profile, estimate_roofline
from config.catalog import default_catalog


def configure(p: argparse.ArgumentParser) -> None:
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--profile", help="an empirical profile, e.g. lesson-70b-fp8")
    src.add_argument("--model", help="a model preset, e.g. llama-3.1-70b (needs --hardware)")
    p.add_argument("--hardware", help="a hardware preset, e.g. h100-80g-sxm")
    p.add_argument("--decode-hardware", help="hardware of the decode engine when disaggregated (default: same)")
    p.add_argument("--tp", type=int, default=1, help="tensor-parallel degree (default 1)")
    p.add_argument("--prompt", type=int, required=True, help="prompt tokens")
    p.add_argument("--output", type=int, required=True, help="output tokens")
    p.add_argument("--chunk", type=int, default=DEFAULT_CHUNK, help="prefill chunk (max_num_batched_tokens)")
    p.add_argument("--rdma-link", default=DEFAULT_RDMA, help="link preset for the RDMA case (roofline only)")
    p.add_argument("--tcp-link", default=DEFAULT_TCP, help="link preset for the TCP case (roofline only)")
    p.add_argument("--handoff", choices=["pull", "push"], default="pull",
                   help="pull: the KV moves after the prefill; push: each chunk's KV overlaps the next chunk "
                        "(roofline only; the lessons card's closed form is sequential)")
    p.add_argument("--json", action="store_true", help="print the result as one JSON object on the last line")


def run(args: argparse.Namespace) -> int:
    if args.prompt < 1 or args.output < 1:
        raise SystemExit("error: --prompt and --output must be at least 1")
    cat = default_catalog()
    try:
        if args.profile:
            est = estimate_profile(cat, args.profile, args.prompt, args.output)
        else:
            if not args.hardware:
                raise SystemExit("error: --model needs --hardware")
            est = estimate_roofline(cat, args.model, args.hardware, args.tp, args.prompt, args.output,
                                    decode_hardware=args.decode_hardware, chunk=args.chunk,
                                    rdma_link=args.rdma_link, tcp_link=args.tcp_link, handoff=args.handoff)
    except KeyError as e:
        raise SystemExit(f"error: {e.args[0]}") from None
    out = console()
    t = Table(title=f"{est.name}: prompt {est.prompt}, output {est.output} tokens "
                    f"(KV {est.kv_bytes / 1e6:,.1f} MB)")
    for col in ("mode", "TTFT ms", "TPOT ms", "prefill ms", "KV transfer ms", "decode ms", "end-to-end ms"):
        t.add_column(col, justify="right" if col != "mode" else "left")
    for label, r in (("colocated", est.colocated), (f"disaggregated, RDMA ({est.rdma_link})", est.rdma),
                     (f"disaggregated, TCP ({est.tcp_link})", est.tcp)):
        t.add_row(label, fmt_ms(r.ttft_ms), f"{r.tpot_ms:.3f}", fmt_ms(r.prefill_ms), f"{r.transfer_ms:.2f}",
                  fmt_ms(r.decode_ms), fmt_ms(r.e2e_ms))
    out.print(t)
    for label, x in (("RDMA", est.crossover_rdma), ("TCP", est.crossover_tcp)):
        if x is None:
            verdict = ("disaggregated wins at every prompt length" if est.disagg_wins_short
                       else "colocated wins at every prompt length (an isolated request sees no prefill "
                            "interference; run a loaded scenario to see what disaggregation buys)")
            out.print(f"crossover over {label}: none up to the model's context: {verdict}")
        else:
            side = "shorter" if est.disagg_wins_short else "longer"
            out.print(f"crossover over {label}: {x:,} prompt tokens (disaggregated wins for {side} prompts)")
    if args.json:
        print_json(est.to_json())
    return 0


register(Command("estimate", "closed-form time of one request: colocated vs disaggregated (RDMA, TCP)",
                 configure, run))

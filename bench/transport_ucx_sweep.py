"""UCX tuning sweep: kvmesh's ucx throughput under each in-flight window and verification placement,
beside ``ucx_perftest -t tag_bw`` over the same transports, measured in the same run.

For each UCX transport set (``sm,self`` and ``tcp,self``): ``ucx_perftest`` (before and after the
trials; the better run is the baseline), and 64 MiB pushes
(1 MiB blocks, 4 per push, all at once) into a receiver in another process, for every combination of
the sender's window (``ucx_inflight_bytes``) and where checksums are computed (sender) and verified
(receiver): on a thread of their own, or on the event loop's thread (ucx's default); trials alternating
between combinations so load from elsewhere on the host hits each alike. Each figure is the best trial
and the median, in GB/s, with its ratio to perftest. Every payload is verified before delivery in every combination.
"""

from __future__ import annotations

import asyncio
import itertools
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import uvloop

from actors.clock import Clock
from bench._common import emit, parser
from bench._transport_baselines import (
    SENDER,
    UCX_TRANSPORTS,
    Child,
    MiB,
    ucx_address,
    ucx_env,
    ucx_environment,
    ucx_perftest,
    ucx_unavailable,
)
from bench.transport import gbps, push_throughput, ratio
from transport import TransportOptions
from transport.verify import VERIFY_THREAD_MIN

WINDOWS_MIB = (4, 8)
RECEIVERS = {"verify_thread": "ucx-sink-thread", "verify_on_loop": "ucx-sink-inline"}


async def sweep_over(tls: str, trials: int, perftest_iters: int, total: int) -> dict[str, Any]:
    from transport.ucx import UcxTransport

    env = ucx_env(tls)
    perfs = [await asyncio.to_thread(ucx_perftest, tls, MiB, perftest_iters)]
    combos = list(itertools.product(WINDOWS_MIB, RECEIVERS))
    seconds: dict[tuple[int, str], list[float]] = {c: [] for c in combos}
    with ucx_environment(env):
        sinks = {name: Child(kind, env) for name, kind in RECEIVERS.items()}
        senders = {(w, name): UcxTransport(SENDER, Clock(), TransportOptions(
            ucx_same_host="worker_address", ucx_inflight_bytes=w * MiB,
            verify_thread_min_bytes=VERIFY_THREAD_MIN if name == "verify_thread" else 0)) for w, name in combos}
        try:
            addrs = {name: ucx_address(s.location) for name, s in sinks.items()}
            for w, name in combos:  # warm every connection and receiver pool once
                await push_throughput(senders[(w, name)], addrs[name], total, 1)
            for _ in range(trials):
                for w, name in combos:
                    seconds[(w, name)].append(await push_throughput(senders[(w, name)], addrs[name], total, 1))
        finally:
            for t in senders.values():
                await t.close()
            for s in sinks.values():
                s.close()
    perfs.append(await asyncio.to_thread(ucx_perftest, tls, MiB, perftest_iters))  # perftest spreads too
    perf = max(perfs, key=lambda p: p.get("gbps") or 0.0)  # the best the host did
    out: dict[str, Any] = {"tls": tls, "ucx_perftest": perf, "ucx_perftest_gbps_runs": [p.get("gbps") for p in perfs]}
    for (w, name), secs in seconds.items():
        best, median = gbps(total, min(secs)), gbps(total, statistics.median(secs))
        out[f"window_{w}MiB_{name}"] = {"best_gbps": best, "median_gbps": median,
                                        "ratio_best_vs_perftest": ratio(best, perf.get("gbps") or 0.0),
                                        "ratio_median_vs_perftest": ratio(median, perf.get("gbps") or 0.0)}
        print(f"ucx {tls} window {w} MiB, {name}: best {best} GB/s, median {median} GB/s "
              f"(perftest {perf.get('gbps')} GB/s)")
    return out


async def run(quick: bool) -> dict[str, Any]:
    result: dict[str, Any] = {"bench": "transport_ucx_sweep", "quick": quick, "load_before": os.getloadavg()[0]}
    skip = ucx_unavailable()
    if skip:
        result["skipped"] = skip
        return result
    t0 = time.perf_counter()
    for name, tls in UCX_TRANSPORTS.items():
        result[name] = await sweep_over(tls, 3 if quick else 7, 2000 if quick else 10_000, 64 * MiB)
    result["seconds"] = round(time.perf_counter() - t0, 1)
    result["load_after"] = os.getloadavg()[0]
    return result


def main() -> None:
    args = parser(__doc__).parse_args()
    emit(uvloop.run(run(args.quick)))


if __name__ == "__main__":
    main()

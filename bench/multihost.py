"""Multi-host figures on the namespace harness (needs root), each beside a baseline from the same run.

1. Start-up: ``hosts up 3 --link tcp-10g`` (namespaces, capped veths, three Ray nodes with token auth), and
   the 3-host cluster's launch (``hosts-3-pd``: 1P on host1, 1D on host2, router on host3) against the
   same spec's launch on one embedded Ray.
2. Latency: one trace (synthetic, ``cluster.hosts.trial``'s) on the 3 hosts and on one host (same spec,
   placement dropped): TTFT/TPOT/ITL side by side. Time is emulated, so they should agree within noise.
3. Cross-host KV throughput against the tbf cap: prompts one at a time with a quarter of the real KV
   bytes (``kv_payload_scale`` 0.25; 2048-token prompts of the 70B model move ~84 MB each from host1 to
   host2), real bytes over the transfers' wall time, against the cap the harness set (1.25 GB/s).
4. A host killed mid-run: host2 (the decode engine's) loses its raylet and every actor 2 s into a replay;
   what the requests and the router did.

The trials run as drivers on host1 (``Harness.exec_argv``); the 1-host baseline runs here on an embedded Ray.
The last stdout line is one JSON object.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from bench._common import emit, parser
from cluster.hosts.harness import Harness, HarnessState, HarnessUnavailable, check_available

REPO = Path(__file__).resolve().parents[1]
SPEC = REPO / "config" / "presets" / "hosts-3-pd.yaml"
LINK = "tcp-10g"


def trial(argv: list[str], timeout_s: float = 300.0) -> dict[str, Any]:
    p = subprocess.run(argv, cwd=REPO, capture_output=True, text=True, timeout=timeout_s, check=False)
    if p.returncode != 0:
        raise RuntimeError(f"trial failed ({p.returncode}): {p.stderr[-3000:]}")
    out: dict[str, Any] = json.loads(p.stdout.strip().splitlines()[-1])
    return out


def on_host1(h: Harness, st: HarnessState, *args: str) -> dict[str, Any]:
    return trial(h.exec_argv(st, "host1", [sys.executable, "-m", "cluster.hosts.trial", "--config", str(SPEC),
                                           "--address", st.head_address, "--run-dir", str(h.run_dir), *args]))


def latency(r: dict[str, Any]) -> dict[str, Any]:
    return {k: {q: round(r[k][q], 2) for q in ("mean", "p50", "p99")} for k in ("ttft_ms", "tpot_ms", "itl_ms")}


def run(quick: bool) -> dict[str, Any]:
    load = ["--requests", "12" if quick else "32", "--rate", "6"]
    run_dir = Path(tempfile.mkdtemp(prefix="kvb-", dir="/tmp"))
    h = Harness(run_dir)
    t0 = time.monotonic()
    try:
        st = h.up(3, LINK, name="kvbench", subnet="10.215.0.0/24")
        harness_up_s = time.monotonic() - t0
        three = on_host1(h, st, *load)
        one = trial([sys.executable, "-m", "cluster.hosts.trial", "--config", str(SPEC), "--one-host", *load])
        bulk = on_host1(h, st, "--requests", "3" if quick else "6", "--concurrency", "1", "--input-len", "2048",
                        "--output-len", "4", "--payload-scale", "0.25", "--transfer-timeout-ms", "10000")
        killed = on_host1(h, st, "--requests", "24", "--rate", "6", "--output-len", "64",
                          "--kill-host", "host2", "--kill-at", "2")
    finally:
        removed = h.down()
        shutil.rmtree(run_dir, ignore_errors=True)
    cap = st.rate_bytes_s / 1e9
    p_bulk = bulk["transfers"].get("p", {})
    return {
        "startup": {"harness_3_hosts_s": round(harness_up_s, 2), "cluster_3_hosts_s": three["startup_s"],
                    "baseline_cluster_1_host_s": one["startup_s"]},
        "latency_3_hosts": latency(three), "latency_1_host_baseline": latency(one),
        "checks": {"3_hosts": {"completed": three["completed"], "failed": three["failed"],
                               "tokens_ok": three["tokens_ok"], "blocks_returned": three["blocks_returned"],
                               "kv_transfers": three["transfers"].get("p")},
                   "1_host": {"completed": one["completed"], "failed": one["failed"], "tokens_ok": one["tokens_ok"],
                              "blocks_returned": one["blocks_returned"], "kv_transfers": one["transfers"].get("p")}},
        "kv_throughput": {"cross_host_gb_s": bulk["kv_throughput_gb_s"], "tbf_cap_gb_s": cap,
                          "ratio": round(bulk["kv_throughput_gb_s"] / cap, 3) if bulk["kv_throughput_gb_s"] else None,
                          "transfers": p_bulk.get("transfers"), "bytes_real": p_bulk.get("bytes_real"),
                          "failures": p_bulk.get("failures"), "tokens_ok": bulk["tokens_ok"]},
        "host_killed": {"killed": killed.get("killed"), "requests": killed["requests"],
                        "completed": killed["completed"], "failed": killed["failed"],
                        "errors": sorted({s["error"] for s in killed["short"] if s["error"]})[:5],
                        "short": killed["short"][:8],
                        "router_view_after": [{k: w.get(k) for k in ("name", "healthy", "eligible", "breaker", "feed")}
                                              for w in killed["workers_after"]]},
        "teardown_removed": removed,
    }


def main() -> None:
    args = parser(__doc__ or "").parse_args()
    try:
        check_available()
    except HarnessUnavailable as e:
        emit({"skipped": str(e)})
        return
    result = run(args.quick)
    for k, v in result.items():
        print(f"{k}: {json.dumps(v)}")
    emit(result)


if __name__ == "__main__":
    main()

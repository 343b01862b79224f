"""Multi-host figures on the namespace harness (needs root), each beside a baseline from the same run.

1. Start-up: ``hosts up 3 --link tcp-10g`` (namespaces, capped veths, three Ray nodes with token auth), and
   the 3-host cluster's launch (``hosts-3-pd``: 1P on host1, 1D on host2, router on host3) against the
   same spec's launch on one embedded Ray.
2. Latency: one trace (synthetic, ``cluster.hosts.trial``'s) on the 3 hosts and on one host (same spec,
   placement dropped): TTFT/TPOT/ITL side by side. Time is emulated, so they should agree within noise.
3. Cross-host KV throughput against the tbf cap: prompts one at a time with a quarter of the real KV
   bytes (``kv_payload_scale`` 0.25; 2048-token prompts of the 70B model move ~84 MB each from host1 to
   host2), real bytes over the transfers' wall time, against the cap the harness set (1.25 GB/s).
4. Host-level faults through the chaos schedule (``run_cluster.py chaos --hosts-run-dir`` on host1): host2
   (the decode engine's) cut off for 3 s at 2 s and healed, then lost (its raylet and every actor) at 12 s;
   per event: requests failed, the errors they got, latency before/during/after, recovery, and the history
   checker's verdict on the whole run.

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
from collections import Counter
from pathlib import Path
from typing import Any

from bench._common import emit, parser
from cluster.hosts.harness import Harness, HarnessState, HarnessUnavailable, check_available
from cluster.hosts.trial import host_chaos

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
                                           "--address", st.head_address, *args]))


def health(r: dict[str, Any]) -> dict[str, Any]:
    """A trial's checks: tokens and blocks, KV transfers and their fallbacks, engines' step lag, load."""
    return {"completed": r["completed"], "failed": r["failed"], "tokens_ok": r["tokens_ok"],
            "blocks_returned": r["blocks_returned"], "kv_transfers": r["transfers"],
            "kv_fallbacks": r["kv_fallbacks"], "loadavg_1m_at_replay": round(r["loadavg_1m_at_replay"], 2),
            "engine_lag_max_ms": {n: v.get("lag_max_ms") for n, v in r["load"].items()}}


def latency(r: dict[str, Any]) -> dict[str, Any]:
    return {k: {q: round(r[k][q], 2) for q in ("mean", "p50", "p99")} for k in ("ttft_ms", "tpot_ms", "itl_ms")}


FAULTS = """name: host-faults
events:
- {kind: partition, at_s: 2.0, host: host2, duration_s: 3.0}
- {kind: kill_node, at_s: 12.0, node: decode-node}
"""


def fault_figures(run: dict[str, Any]) -> dict[str, Any]:
    """What each host-level event did to the requests, and the checker's verdict."""
    s, records = run["summary"], run["records"]
    by_id = {r["request_id"]: r for r in records}
    events = []
    for imp in s["impact"]:
        failed = [by_id[i] for i in imp["failed_ids"] if i in by_id]
        events.append({"kind": imp["kind"], "at_s": imp["at_s"], "end_s": imp["end_s"], "failed": imp["failed"],
                       "errors": sorted({f"{r['status']} {r['http_status']}: {r['error'][:80]}" for r in failed}),
                       "ttft_p50_ms_before_during_after": [imp[w]["ttft_ms"]["p50"] for w in ("before", "during",
                                                                                             "after")],
                       "recovery_s": imp["recovery_s"]})
    log = [{k: e.get(k) for k in ("kind", "what", "at_s", "actual_s", "done_s", "outcome", "killed", "error")}
           for e in s["events"]]
    not_ok = Counter(f"{r['status']} {r['http_status']}: {r['error'][:60]}" for r in records if r["status"] != "ok")
    return {"requests": len(records), "ok": sum(r["status"] == "ok" for r in records), "not_ok": dict(not_ok),
            "events": events, "actions": log, "dead_engines": s["dead_engines"],
            "router_view_after": s.get("router_view_after"),
            "checker": {k: s["checker"][k] for k in ("ok", "requests", "tokens_checked", "violations_by_rule")}}


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
        faults = host_chaos(h, st, SPEC, FAULTS, run_dir / "chaos", requests=48, rate=3)
    finally:
        removed = h.down()
        shutil.rmtree(run_dir, ignore_errors=True)
    cap = st.rate_bytes_s / 1e9
    p_bulk = bulk["transfers"].get("p", {})
    return {
        "startup": {"harness_3_hosts_s": round(harness_up_s, 2), "cluster_3_hosts_s": three["startup_s"],
                    "baseline_cluster_1_host_s": one["startup_s"]},
        "latency_3_hosts": latency(three), "latency_1_host_baseline": latency(one),
        "checks": {"3_hosts": health(three), "1_host": health(one)},
        "kv_throughput": {"cross_host_gb_s": bulk["kv_throughput_gb_s"], "tbf_cap_gb_s": cap,
                          "ratio": round(bulk["kv_throughput_gb_s"] / cap, 3) if bulk["kv_throughput_gb_s"] else None,
                          "transfers": p_bulk.get("transfers"), "bytes_real": p_bulk.get("bytes_real"),
                          "failures": p_bulk.get("failures"), "tokens_ok": bulk["tokens_ok"]},
        "host_faults": fault_figures(faults),
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

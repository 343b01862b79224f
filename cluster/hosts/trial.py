"""A trial run on a cluster (one host, or hosts of the harness): launch a spec, replay a trace, check it all.

``python -m cluster.hosts.trial --config SPEC [--address HOST:PORT] [--json]`` is the driver the multi-host
test and ``bench/multihost.py`` run (on the harness: inside host1, ``Harness.exec_argv``). It launches the
spec (attached when ``--address`` is given), replays a small synthetic trace through the router, and reports:

- every request's tokens against what it asked for (the client sends ``ignore_eos``: exactly
  ``max_tokens`` must come back), and whether every engine got every KV block back afterwards;
- where each engine ran (its URL's address) and its host, the KV transfers each engine made (count,
  real bytes, wall ms; throughput = real bytes over wall time of transfers one at a time);
- TTFT/TPOT/ITL (emulated ms) from the load test's summary, and the router's view of each worker.

The last stdout line is one JSON object. Exit status 0 whenever the trial ran (the caller judges).

``host_chaos`` runs ``run_cluster.py chaos --hosts-run-dir`` on a harness host instead (host-level faults
through the chaos schedule: a host's link down and up, a host lost) with the same synthetic workload, and
returns its ``chaos.json`` and the requests' records.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import urllib.request
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from cluster.hosts.harness import Harness, HarnessState

REPO = Path(__file__).resolve().parents[2]

WORKLOAD = """format: synthetic
num_requests: {n}
rate: {rate}
block_size: 16
input_len: {{kind: uniform, mean: {input_len}, spread: {spread}}}
output_len: {{kind: uniform, mean: {output_len}, spread: 8, min: 4}}
prefixes: {{num_prefixes: 2, prefix_len: 256, share_ratio: 0.5}}
seed: 7
"""


def host_chaos(h: Harness, st: HarnessState, config: Path, schedule: str, folder: Path, *, requests: int,
               rate: float, input_len: int = 512, output_len: int = 24, driver: str = "host1",
               timeout_s: float = 300.0) -> dict[str, Any]:
    """``run_cluster.py chaos`` on ``driver`` (a host the schedule leaves alone) against the harness's cluster,
    with ``schedule`` (YAML text) and the trial's workload; ``{"summary": chaos.json, "records": [...]}``.
    RuntimeError (with the driver's stderr) when the run did not finish (exit status other than 0 or 1)."""
    folder.mkdir(parents=True)
    (folder / "schedule.yaml").write_text(schedule)
    (folder / "trace.yaml").write_text(WORKLOAD.format(n=requests, rate=rate, input_len=input_len,
                                                       spread=input_len // 2, output_len=output_len))
    out = folder / "run"
    argv = h.exec_argv(st, driver, [
        sys.executable, "run_cluster.py", "chaos", "--config", str(config), "--address", st.head_address,
        "--hosts-run-dir", str(h.run_dir), "--schedule", str(folder / "schedule.yaml"),
        "--trace", str(folder / "trace.yaml"), "--request-timeout", "120", "--window", "2", "--out", str(out),
        "--no-plots", "--no-progress", "--json"])
    p = subprocess.run(argv, cwd=REPO, capture_output=True, text=True, timeout=timeout_s, check=False)
    if p.returncode not in (0, 1):  # 1: the checker found violations (the caller judges)
        raise RuntimeError(f"chaos on {driver} failed ({p.returncode}): {p.stderr[-3000:]}")
    summary: dict[str, Any] = json.loads(p.stdout.strip().splitlines()[-1])
    records = [json.loads(line) for line in (out / "requests.jsonl").read_text().splitlines() if line]
    return {"summary": summary, "records": records}


def _fallbacks(router_url: str) -> dict[str, float]:
    """The router's KV hand-off fallbacks so far, by ``target/cause`` (a transfer that missed its deadline)."""
    from prometheus_client.parser import text_string_to_metric_families

    with urllib.request.urlopen(router_url + "/metrics", timeout=10) as r:
        text = r.read().decode()
    return {f"{s.labels['target']}/{s.labels['cause']}": s.value for f in text_string_to_metric_families(text)
            if f.name == "kvmesh_router_kv_fallbacks" for s in f.samples if s.name.endswith("_total")}


def _workers(router_url: str) -> list[dict[str, Any]]:
    with urllib.request.urlopen(router_url + "/workers", timeout=10) as r:
        out: list[dict[str, Any]] = json.loads(r.read())
        return out


def run_trial(args: argparse.Namespace) -> dict[str, Any]:
    import ray

    from cluster.launch import launch
    from cluster.loadtest import ClientConfig, LoadTestConfig, ReplayConfig, read_trace, run_loadtest, run_sync
    from config import load_cluster

    spec = load_cluster(args.config)
    if args.one_host:
        spec = spec.model_copy(update={
            "placement": spec.placement.model_copy(update={"hosts": [], "router_host": None}),
            "nodes": [n.model_copy(update={"host": None}) for n in spec.nodes]})
    if args.payload_scale is not None:
        spec = spec.model_copy(update={"transport": spec.transport.model_copy(
            update={"kv_payload_scale": args.payload_scale})})
    if args.bind_host is not None:
        spec = spec.model_copy(update={"placement": spec.placement.model_copy(update={"bind_host": args.bind_host})})
    if args.backend is not None:
        spec = spec.model_copy(update={"transport": spec.transport.model_copy(update={"backend": args.backend})})
    if args.transfer_timeout_ms is not None:
        spec = spec.model_copy(update={"disagg": spec.disagg.model_copy(
            update={"transfer_timeout_ms": args.transfer_timeout_ms})})
    with tempfile.TemporaryDirectory() as tmp:
        trace_path = Path(tmp) / "trace.yaml"
        trace_path.write_text(WORKLOAD.format(n=args.requests, rate=args.rate, input_len=args.input_len,
                                              spread=args.input_len // 2, output_len=args.output_len))
        trace = read_trace(trace_path)
    handle = launch(spec, address=args.address)
    try:
        report: dict[str, Any] = {"spec": spec.name, "address": args.address, "startup_s": round(handle.startup_s, 2),
                                  "router_url": handle.router_url,
                                  "engines": {n: {"url": d["url"], "host": d.get("host"), "role": d["role"]}
                                              for n, d in handle.engines.items()},
                                  "workers_before": _workers(handle.router_url)}
        config = LoadTestConfig(name="trial", replay=ReplayConfig(concurrency=args.concurrency),
                                client=ClientConfig(time_scale=spec.time_scale, request_timeout_s=120.0),
                                progress=False, plots=False)
        report["loadavg_1m_at_replay"] = os.getloadavg()[0]  # the launch's CPU storm, if any, still going
        result = run_sync(run_loadtest(handle.router_url, trace, config, out_root=None))
        records = result.runs[0].result.records
        short = [{"id": r.request_id, "want": r.expected_output_len, "got": r.output_tokens, "error": r.error[:200]}
                 for r in records if r.error or r.output_tokens != r.expected_output_len]
        s = result.summary
        report.update({
            "requests": len(records), "completed": s.get("completed"), "failed": s.get("failed"),
            "tokens_ok": not short, "short": short[:20],
            "output_tokens": sum(r.output_tokens for r in records),
            "ttft_ms": s.get("ttft_ms"), "tpot_ms": s.get("tpot_ms"), "itl_ms": s.get("itl_ms"),
            "workers_after": _workers(handle.router_url), "kv_fallbacks": _fallbacks(handle.router_url),
        })
        transfers: dict[str, Any] = {}
        for part in ray.get([w.transfers.remote() for w in handle.workers], timeout=30):
            transfers.update(part)
        report["transfers"] = transfers
        moved = [t for t in transfers.values() if t.get("bytes_real")]
        real = sum(t["bytes_real"] for t in moved)
        wall_s = sum(t["wall_ms"] for t in moved) / 1000.0
        report["kv_throughput_gb_s"] = round(real / wall_s / 1e9, 4) if wall_s > 0 else None
        report["blocks_returned"] = handle.blocks_returned(timeout_s=20.0)
        report["load"] = handle.load()
        return report
    finally:
        handle.shutdown()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m cluster.hosts.trial", description=__doc__.split("\n")[0])
    p.add_argument("--config", type=Path, required=True)
    p.add_argument("--address", default=None, help="Ray cluster to attach to (default: an embedded one)")
    p.add_argument("--one-host", action="store_true", help="drop the spec's placement (run it all on one host)")
    p.add_argument("--payload-scale", type=float, default=None, help="override transport.kv_payload_scale")
    p.add_argument("--bind-host", default=None, help="override placement.bind_host (e.g. 0.0.0.0)")
    p.add_argument("--backend", default=None, help="override transport.backend (tcp, ucx)")
    p.add_argument("--transfer-timeout-ms", type=float, default=None, help="override disagg.transfer_timeout_ms")
    p.add_argument("--requests", type=int, default=16)
    p.add_argument("--rate", type=float, default=8.0)
    p.add_argument("--concurrency", type=int, default=None, help="closed loop instead of the trace's arrivals")
    p.add_argument("--input-len", type=int, default=1024)
    p.add_argument("--output-len", type=int, default=24)
    args = p.parse_args(argv)
    print(json.dumps(run_trial(args), default=str))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

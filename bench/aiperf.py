"""NVIDIA AIPerf against kvmesh, offline, beside kvmesh's own load test on the same Mooncake slice.

kvmesh's built-in tokenizer is exported in Hugging Face format (``run_cluster.py tokenizer export``), so
AIPerf synthesizes prompts of the trace's lengths that kvmesh counts as the same number of tokens, with
no download. The first ``--requests`` rows of a Mooncake-format trace (the ShareGPT-derived Llama-3.1-8B
trace in ``../shared/traces``, 16-token blocks, times rebased to 0) are replayed twice, each against a
freshly launched cluster (two Llama-3.1-8B engines on H100, time scale 1: emulated ms are wall ms):
kvmesh's ``loadtest`` (open loop at the trace's times) and ``aiperf profile --fixed-schedule``
(``--use-server-token-count``, ``ignore_eos``). Figures: each tool's TTFT and TPOT means and their ratio
(AIPerf / kvmesh); the goal is agreement within 5%.

AIPerf runs from its own virtualenv, ``.venv-aiperf`` (created with ``pip install aiperf`` when missing,
unless ``--no-install``). The last stdout line is one JSON object.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
AIPERF_VENV = ROOT / ".venv-aiperf"
TRACE = ROOT.parent / "shared" / "traces" / "llmservingsim_vllm_runs" / "derived" / \
    "sharegpt-llama-3.1-8b-300-sps10.blk16.jsonl"
MODEL = "llama-3.1-8b"


def aiperf_bin(install: bool) -> Path | None:
    exe = AIPERF_VENV / "bin" / "aiperf"
    if not exe.exists() and install:
        subprocess.run([sys.executable, "-m", "venv", str(AIPERF_VENV)], check=True)
        subprocess.run([str(AIPERF_VENV / "bin" / "python"), "-m", "pip", "install", "--quiet", "aiperf"], check=False)
    return exe if exe.exists() else None


def write_slice(src: Path, dst: Path, n: int) -> int:
    rows = []
    with src.open() as f:
        for line in f:
            if line.strip():
                rows.append(json.loads(line))
            if len(rows) == n:
                break
    t0 = rows[0]["timestamp"]
    with dst.open("w") as f:
        for r in rows:
            f.write(json.dumps({"timestamp": int(r["timestamp"] - t0), "input_length": r["input_length"],
                                "output_length": r["output_length"], "hash_ids": r["hash_ids"]}) + "\n")
    return len(rows)


def spec() -> Any:
    from config import ClusterSpec

    return ClusterSpec.model_validate({
        "name": "aiperf-compare", "time_scale": 1.0,
        "nodes": [{"name": "n0", "region": "local", "hardware": "h100-80g-sxm", "gpus": 2,
                   "engines": [{"name": "e", "model": MODEL, "replicas": 2}]}],
        "router": {"policy": "least_loaded"}})


def kvmesh_run(trace: Path) -> dict[str, Any]:
    from cluster.launch import launch
    from cluster.loadtest import ReadOptions, read_trace, run_loadtest, run_sync
    from cluster.loadtest.client import ClientConfig
    from cluster.loadtest.session import LoadTestConfig

    data = read_trace(trace, "mooncake", ReadOptions(block_size=16))
    with launch(spec()) as h:
        cfg = LoadTestConfig(name="kvmesh", client=ClientConfig(time_scale=1.0), progress=False, plots=False)
        res = run_sync(run_loadtest(h.router_url, data, cfg, out_root=None))
    s = res.summary
    done = max(1, int(s["completed"]))
    return {"ttft_ms": s["ttft_ms"]["mean"], "tpot_ms": s["tpot_ms"]["mean"], "completed": s["completed"],
            "input_tokens_mean": s["total_input_tokens"] / done, "output_tokens_mean": s["total_output_tokens"] / done,
            "step_lag_p99_ms": (s.get("step_lag_ms") or {}).get("p99")}


def aiperf_run(exe: Path, trace: Path, tokenizer: Path, out: Path) -> dict[str, Any]:
    """AIPerf with the exported tokenizer installed in a private Hub cache (its prompt workers load
    tokenizers through the cache only, offline), against a fresh cluster."""
    import os

    from actors.engine.hf_export import install_in_hf_cache
    from cluster.launch import launch

    repo = "kvmesh/builtin-tokenizer"
    install_in_hf_cache(tokenizer, out.parent / "hf", repo)
    env = {**os.environ, "HF_HOME": str(out.parent / "hf"), "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}

    with launch(spec()) as h:
        cmd = [str(exe), "profile", "--model", MODEL, "--url", h.router_url, "--endpoint-type", "completions",
               "--streaming", "--input-file", str(trace), "--custom-dataset-type", "mooncake_trace",
               "--fixed-schedule", "--tokenizer", repo, "--use-server-token-count",
               "--prompt-input-tokens-block-size", "16", "--extra-inputs", "ignore_eos:true",
               "--output-artifact-dir", str(out), "--random-seed", "0", "--ui-type", "none"]
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=900, cwd=out.parent, env=env)
    found = sorted(out.rglob("profile_export_aiperf.json"))
    if r.returncode != 0 or not found:
        raise RuntimeError(f"aiperf failed (rc {r.returncode}): {(r.stdout + r.stderr)[-2000:]}")
    doc = json.loads(found[0].read_text())
    def mean(key: str) -> float:
        v = doc[key]
        return float(v["avg"] if isinstance(v, dict) else v)
    return {"ttft_ms": mean("time_to_first_token"), "tpot_ms": mean("inter_token_latency"),
            "completed": int(mean("request_count")) if "request_count" in doc else None,
            "input_tokens_mean": mean("input_sequence_length") if "input_sequence_length" in doc else None,
            "output_tokens_mean": mean("output_sequence_length") if "output_sequence_length" in doc else None}


def compare(requests: int, install: bool = True) -> dict[str, Any]:
    from actors.engine.hf_export import export_hf
    from cluster.launch import start_local_ray

    exe = aiperf_bin(install)
    if exe is None:
        return {"skipped": "aiperf is not installed (.venv-aiperf/bin/aiperf) and could not be installed"}
    if not TRACE.exists():
        return {"skipped": f"{TRACE} is absent (the shared traces are not next to this checkout)"}
    import ray

    owns = not ray.is_initialized()
    if owns:
        start_local_ray(num_cpus=4, configure_logging=False)
    try:
        with tempfile.TemporaryDirectory(prefix="kvmesh-aiperf-") as tmp:
            d = Path(tmp)
            n = write_slice(TRACE, d / "slice.jsonl", requests)
            export_hf(d / "tokenizer")
            ours = kvmesh_run(d / "slice.jsonl")
            theirs = aiperf_run(exe, d / "slice.jsonl", d / "tokenizer", d / "aiperf")
    finally:
        if owns:
            ray.shutdown()
    return {"requests": n, "kvmesh": ours, "aiperf": theirs,
            "ttft_ratio": round(theirs["ttft_ms"] / ours["ttft_ms"], 4),
            "tpot_ratio": round(theirs["tpot_ms"] / ours["tpot_ms"], 4)}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--quick", action="store_true", help="12 requests instead of 40")
    p.add_argument("--requests", type=int, default=None)
    p.add_argument("--no-install", action="store_true", help="do not pip install aiperf when missing")
    a = p.parse_args()
    res = compare(a.requests or (12 if a.quick else 40), install=not a.no_install)
    print(json.dumps(res, separators=(",", ":")))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

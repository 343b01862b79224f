"""A real Prometheus server scrapes the router and the engines.

The Debian package ``prometheus`` is installed by this test's set-up when it is missing (as root, with
apt-get); where that is impossible the test is skipped and says why.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import tempfile
import time
import urllib.parse
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from cluster.launch import ClusterHandle, launch
from config import ClusterSpec


def ensure_prometheus() -> str:
    exe = shutil.which("prometheus")
    if exe:
        return exe
    if os.geteuid() != 0 or not shutil.which("apt-get"):
        pytest.skip("the 'prometheus' binary is missing and cannot be installed here (needs root and apt-get)")
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    r = subprocess.run(["apt-get", "install", "-y", "--no-install-recommends", "prometheus"], env=env,
                       capture_output=True, text=True, timeout=600)
    if r.returncode != 0:
        r = subprocess.run("apt-get update && apt-get install -y --no-install-recommends prometheus", shell=True,
                           env=env, capture_output=True, text=True, timeout=900)
    exe = shutil.which("prometheus")
    if not exe:
        pytest.skip(f"could not install prometheus with apt-get: {r.stderr[-300:]}")
    return exe


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def hostport(url: str) -> str:
    return urllib.parse.urlparse(url).netloc


@pytest.fixture(scope="module")
def cluster(ray_cluster: object) -> Iterator[ClusterHandle]:
    h = launch(ClusterSpec.model_validate({
        "name": "prom", "nodes": [{"name": "n0", "region": "local", "hardware": "h100-80g-sxm", "gpus": 2,
                                   "engines": [{"name": "e", "model": "llama-3.1-8b", "replicas": 2}]}],
        "router": {"policy": "kv_aware"}}))
    try:
        yield h
    finally:
        h.shutdown()


def query(base: str, promql: str) -> list[dict[str, Any]]:
    with urllib.request.urlopen(f"{base}/api/v1/query?query={urllib.parse.quote(promql)}", timeout=5) as r:
        out = json.loads(r.read())
    assert out["status"] == "success"
    return list(out["data"]["result"])


def test_prometheus_scrapes_router_and_engines(cluster: ClusterHandle) -> None:
    exe = ensure_prometheus()
    port = free_port()
    with tempfile.TemporaryDirectory(prefix="kvprom-") as tmp:
        cfg = Path(tmp) / "prometheus.yml"
        cfg.write_text(json.dumps({  # JSON is YAML
            "global": {"scrape_interval": "1s", "scrape_timeout": "1s"},
            "scrape_configs": [
                {"job_name": "router", "static_configs": [{"targets": [hostport(cluster.router_url)]}]},
                # engines of one process share its server, each under its own path (/e/<engine>/metrics)
                *({"job_name": f"engine-{name}", "metrics_path": urllib.parse.urlparse(u).path + "/metrics",
                   "static_configs": [{"targets": [hostport(u)]}]} for name, u in cluster.engine_urls.items())]}))
        proc = subprocess.Popen([exe, f"--config.file={cfg}", f"--storage.tsdb.path={tmp}/data",
                                 f"--web.listen-address=127.0.0.1:{port}"],
                                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        base = f"http://127.0.0.1:{port}"
        try:
            body = json.dumps({"prompt": "scrape me " * 30, "max_tokens": 4, "ignore_eos": True}).encode()
            for _ in range(4):
                urllib.request.urlopen(urllib.request.Request(cluster.router_url + "/v1/completions", data=body,
                                                              headers={"Content-Type": "application/json"}))
            deadline = time.monotonic() + 60
            while True:
                try:
                    up = query(base, "up")
                    decisions = query(base, "sum(kvmesh_router_decisions_total)")
                    prompts = query(base, "sum(vllm:prompt_tokens_total)")
                    if (len(up) == 3 and all(s["value"][1] == "1" for s in up) and decisions and prompts
                            and float(decisions[0]["value"][1]) >= 4):
                        break
                except OSError:
                    pass
                assert time.monotonic() < deadline, "prometheus never saw every target up with the traffic"
                time.sleep(0.5)
            assert float(prompts[0]["value"][1]) >= 4 * 30
            assert query(base, "vllm:kv_cache_usage_perc")
            ttft = query(base, "sum(vllm:time_to_first_token_seconds_count)")
            assert ttft and float(ttft[0]["value"][1]) >= 4
        finally:
            proc.terminate()
            proc.wait(timeout=20)

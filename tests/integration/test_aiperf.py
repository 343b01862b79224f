"""AIPerf (NVIDIA's load tester, pip) replays a short Mooncake slice against kvmesh's router offline with
``--fixed-schedule`` and kvmesh's exported tokenizer; its TTFT and TPOT means are set beside kvmesh's own
load test on the same slice (bench/aiperf.py). Skipped with the reason when AIPerf is not installed."""

from __future__ import annotations

import importlib.util
import subprocess
from pathlib import Path

import pytest

from actors.engine.tokenizer import Tokenizer
from tests.conftest import REPO_ROOT, shared_path

_spec = importlib.util.spec_from_file_location("bench_aiperf", REPO_ROOT / "bench" / "aiperf.py")
assert _spec is not None and _spec.loader is not None
bench_aiperf = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(bench_aiperf)

PY = REPO_ROOT / ".venv-aiperf" / "bin" / "python"


def needs_aiperf() -> Path:
    exe = bench_aiperf.aiperf_bin(install=False)
    if exe is None:
        pytest.skip("aiperf is not installed: python -m venv .venv-aiperf && .venv-aiperf/bin/pip install aiperf")
    return exe


def test_exported_tokenizer_counts_as_kvmesh_does(tmp_path: Path) -> None:
    needs_aiperf()
    from actors.engine.hf_export import export_hf

    export_hf(tmp_path / "tok")
    texts = ["Hello world, this is  a test.\n\nNew   para", " the cat sat", "x", "tab\tseparated\twords ok",
             "ünïcödé wörds and 1234567 digits", "   leading spaces"]
    code = ("import json,sys\nfrom transformers import AutoTokenizer\n"
            f"t=AutoTokenizer.from_pretrained({str(tmp_path / 'tok')!r})\n"
            "texts=json.loads(sys.stdin.read())\n"
            "ids=t.encode(' the cat sat on the mat', add_special_tokens=False)\n"
            "print(json.dumps({'counts':[len(t.encode(s, add_special_tokens=False)) for s in texts],"
            "'decoded':t.decode(ids),'n':len(ids)}))\n")
    import json

    r = subprocess.run([str(PY), "-c", code], input=json.dumps(texts), capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-1000:]
    out = json.loads(r.stdout.strip().splitlines()[-1])
    tok = Tokenizer(32000)
    assert out["counts"] == [len(tok.encode(s)) for s in texts]
    assert len(tok.encode(out["decoded"])) == out["n"]  # decoded ids re-encode to as many tokens in kvmesh


def test_aiperf_agrees_with_kvmesh_load_test(ray_cluster: object) -> None:
    needs_aiperf()
    shared_path("traces")
    res = bench_aiperf.compare(12, install=False)
    assert "skipped" not in res, res
    assert res["kvmesh"]["completed"] == res["requests"]
    # Both tools counted the same tokens on the same requests.
    assert res["aiperf"]["completed"] == res["requests"]
    assert res["aiperf"]["input_tokens_mean"] == res["kvmesh"]["input_tokens_mean"]
    assert res["aiperf"]["output_tokens_mean"] == res["kvmesh"]["output_tokens_mean"]
    # TPOT is set by the emulated decode steps and agrees to 0.01%. TTFT (~35 ms) carries each client's own
    # scheduling on this 2-core host: 12-request runs spread 1.00-1.13 on one commit (0.92-1.13 over 8 runs), so
    # the 5% is a benchmark figure (bench/aiperf.py prints ttft_ratio), not an assertion here.
    assert abs(res["tpot_ratio"] - 1) <= 0.05, res

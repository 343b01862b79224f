"""The code as it stood when issue 20 was filed, run beside today's in the same benchmark run.

Issue 20's capacity goal is "at least 3x today's tokens/s at 4 GPUs", where today's was what
``bench/engine.py`` sustained then (about 3,500 tok/s through the router before the step lag's p99 passed 5 ms).
``bench/density.py``'s ``old`` layout rebuilds that layout's shape (an actor per GPU, the old feed, spinning
clocks) inside today's code, so it also carries every per-token cut made since (SSE framing, the relay, the step
loop: the issue's third point), and cannot say how far the whole issue moved the figure. This module measures
the filed code itself: ``FILED_COMMIT`` is extracted from this repository's history (``git archive``) into
``.venv-filed/src``, installed into ``.venv-filed`` with its own dependency pins, and its cluster is launched
by its own ``launch`` with its own ``bench/engine.py`` spec (4 H100s, Llama-3.1-8B, least-loaded router) in a
child process (``bench/_filed_cluster.py``). The ladder, the load generator and the CPU accounting are today's
``bench.engine.capacity``, the same for every layout.

One difference is kept and stated: the filed workers report each engine's step-lag percentiles but no samples,
so the filed fleet's ``p99`` is its worst engine's p99 (as the filed ``bench/engine.py`` bounded it), stricter
than today's pooled p99. ``bench/density.py`` therefore also gives today's layout's rate under that same
worst-engine bound.
"""

from __future__ import annotations

import io
import json
import subprocess
import sys
import tarfile
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
FILED_COMMIT = "82cea8700960ceab0b4a965c4b568f6b641ba435"
"""main when issue 20 was filed (2026-11-29 17:05, "Router: one error helper"); the next commit is the
2026-11-30 session that took the issue up."""
VENV = ROOT / ".venv-filed"
TREE = VENV / "src"
PY = VENV / "bin" / "python"


def run(cmd: list[str], **kw: Any) -> subprocess.CompletedProcess[bytes]:
    return subprocess.run(cmd, capture_output=True, timeout=900, check=False, **kw)


def ensure_filed() -> str | None:
    """Build ``.venv-filed`` (the filed tree and its interpreter) when missing. None when ready, else why not."""
    stamp = VENV / ".installed"
    if stamp.exists() and (TREE / "bench" / "engine.py").exists():
        return None
    tar = run(["git", "-C", str(ROOT), "archive", "--format=tar", FILED_COMMIT])
    if tar.returncode != 0:
        return (f"commit {FILED_COMMIT[:12]} is not in this checkout's history "
                f"({tar.stderr.decode(errors='replace').strip()[:200]})")
    TREE.mkdir(parents=True, exist_ok=True)
    with tarfile.open(fileobj=io.BytesIO(tar.stdout)) as t:
        t.extractall(TREE, filter="data")
    steps = [[sys.executable, "-m", "venv", str(VENV)],
             [str(PY), "-m", "pip", "install", "--quiet", "-e", str(TREE), "--config-settings",
              "editable_mode=compat"]]
    for cmd in steps:
        r = run(cmd)
        if r.returncode != 0:
            return f"{' '.join(cmd[:4])} failed: {(r.stdout + r.stderr).decode(errors='replace')[-400:]}"
    stamp.touch()
    return None


class FiledFleet:
    """A cluster of the filed code, driven through ``bench/_filed_cluster.py``'s line protocol (a ``bench.engine``
    ``Fleet``). Use as a context manager: the child is told to quit, then killed if it does not."""

    def __init__(self, gpus: int) -> None:
        self.proc = subprocess.Popen(
            [str(PY), str(ROOT / "bench" / "_filed_cluster.py"), "--tree", str(TREE), "--gpus", str(gpus)],
            cwd=TREE, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
        self.info = self._read()
        if "router_url" not in self.info:
            self.close()
            raise RuntimeError(f"the filed cluster did not start: {self.info}")

    def _read(self) -> dict[str, Any]:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:  # Ray's own lines may come first
            if line.startswith("{"):
                out: dict[str, Any] = json.loads(line)
                if "error" in out:
                    raise RuntimeError(f"filed cluster: {out['error']}")
                return out
        raise RuntimeError(f"the filed cluster exited (rc {self.proc.wait(30)})")

    def _ask(self, cmd: str) -> dict[str, Any]:
        assert self.proc.stdin is not None
        self.proc.stdin.write(cmd + "\n")
        self.proc.stdin.flush()
        return self._read()

    @property
    def router_url(self) -> str:
        return str(self.info["router_url"])

    def process_groups(self) -> dict[str, list[int]]:
        return {"engines": list(self.info["engines"]), "router": list(self.info["router"])}

    def reset_lag(self) -> None:
        self._ask("reset")

    def lag(self) -> dict[str, float]:
        return {k: float(v) for k, v in self._ask("lag").items()}

    def close(self) -> None:
        if self.proc.poll() is None and self.proc.stdin is not None:
            try:
                self.proc.stdin.write("quit\n")
                self.proc.stdin.close()
                self.proc.wait(60)
            except (OSError, subprocess.TimeoutExpired):
                self.proc.kill()
                self.proc.wait()

    def __enter__(self) -> FiledFleet:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

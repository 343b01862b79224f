"""``restore_priority``: every thread of the process gets the niceness (Linux keeps one per thread), and a
value the process may not take falls back to 0. Run in a child process: a niceness once raised cannot be
lowered again without privilege, so the test process itself is never touched."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from config import ClusterSpec

ROOT = Path(__file__).resolve().parents[2]

CHILD = """
import json, os, sys, threading
from actors.worker import restore_priority
ready, done = threading.Event(), threading.Event()
def other():
    ready.set()
    done.wait()
t = threading.Thread(target=other)
t.start()
ready.wait()
restore_priority(int(sys.argv[1]))
nices = {tid: os.getpriority(os.PRIO_PROCESS, int(tid)) for tid in os.listdir("/proc/self/task")}
done.set()
t.join()
print(json.dumps(nices))
"""


def niceness_of_threads(nice: int) -> dict[str, int]:
    out = subprocess.run([sys.executable, "-c", CHILD, str(nice)], cwd=ROOT, capture_output=True, text=True,
                         check=True, timeout=120)
    return {k: int(v) for k, v in json.loads(out.stdout.strip().splitlines()[-1]).items()}


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="per-thread niceness is Linux's")
def test_every_thread_gets_the_niceness() -> None:
    base = os.getpriority(os.PRIO_PROCESS, 0)
    want = min(19, base + 3)  # raising the niceness needs no privilege
    nices = niceness_of_threads(want)
    assert len(nices) >= 2
    assert set(nices.values()) == {want}


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="per-thread niceness is Linux's")
def test_a_niceness_the_process_may_not_take_falls_back_to_zero() -> None:
    if os.geteuid() == 0:
        pytest.skip("root may take any niceness: nothing to fall back from")
    if os.getpriority(os.PRIO_PROCESS, 0) != 0:
        pytest.skip("this test process is not at niceness 0: 0 is not reachable without privilege either")
    assert set(niceness_of_threads(-5).values()) == {0}


def test_engine_nice_is_bounded() -> None:
    spec = {"name": "c", "nodes": [{"name": "n", "region": "local", "hardware": "h100-80g-sxm", "gpus": 1,
                                    "engines": [{"name": "e", "model": "llama-3.1-8b"}]}]}
    assert ClusterSpec.model_validate({**spec, "engine_nice": -5}).engine_nice == -5
    with pytest.raises(ValueError, match="engine_nice"):
        ClusterSpec.model_validate({**spec, "engine_nice": -21})

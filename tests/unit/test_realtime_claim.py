"""``engine_realtime``: every thread of the process goes under SCHED_RR where the host allows it, else none does."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

PROBE = """
import os, threading
from actors.worker import claim_realtime
early = threading.Thread(target=threading.Event().wait, daemon=True)
early.start()
ok = claim_realtime()
late = threading.Thread(target=threading.Event().wait, daemon=True)
late.start()
print(ok, sorted({os.sched_getscheduler(int(t)) for t in os.listdir("/proc/self/task")}))
"""


def test_claim_realtime_sets_every_thread_or_none() -> None:
    # In a child process: the test process itself must not run real-time.
    out = subprocess.run([sys.executable, "-c", PROBE], cwd=ROOT, capture_output=True, text=True, timeout=120,
                         check=True).stdout.split(maxsplit=1)
    ok, policies = out[0] == "True", out[1].strip()
    assert policies == (f"[{os.SCHED_RR}]" if ok else f"[{os.SCHED_OTHER}]")

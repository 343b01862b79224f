"""``set_request_slice``: every thread of the process asks for the slice, threads started later inherit it, the
niceness is kept, and a slice outside the kernel's range is refused. Run in a child process so the test
process keeps the kernel's default."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from actors.sched_slice import MAX_SLICE_MS, request_slice_ms, set_request_slice

ROOT = Path(__file__).resolve().parents[2]

CHILD = """
import json, os, threading
from actors.sched_slice import request_slice_ms, set_request_slice
ready, done = threading.Event(), threading.Event()
def other():
    ready.set()
    done.wait()
t = threading.Thread(target=other)
t.start()
ready.wait()
nice_before = os.getpriority(os.PRIO_PROCESS, 0)
ok = set_request_slice(0.3)
later = []
t2 = threading.Thread(target=lambda: later.append(request_slice_ms()))
t2.start()
t2.join()
slices = [request_slice_ms(int(tid)) for tid in os.listdir("/proc/self/task")]
done.set()
t.join()
nice = [nice_before, os.getpriority(os.PRIO_PROCESS, 0)]
print(json.dumps({"ok": ok, "slices": slices, "later": later[0], "nice": nice}))
"""


@pytest.mark.skipif(request_slice_ms() is None, reason="no sched_getattr here (not Linux, or an unknown machine)")
def test_every_thread_and_later_threads_get_the_slice() -> None:
    out = subprocess.run([sys.executable, "-c", CHILD], cwd=ROOT, capture_output=True, text=True, check=True,
                         timeout=120)
    got = json.loads(out.stdout.strip().splitlines()[-1])
    assert got["ok"] is True
    assert len(got["slices"]) >= 2 and set(got["slices"]) == {0.3}
    assert got["later"] == 0.3
    assert got["nice"][0] == got["nice"][1]


@pytest.mark.parametrize("bad", [0.0, 0.05, MAX_SLICE_MS + 1])
def test_a_slice_outside_the_kernels_range_is_refused(bad: float) -> None:
    with pytest.raises(ValueError, match="slice_ms"):
        set_request_slice(bad)

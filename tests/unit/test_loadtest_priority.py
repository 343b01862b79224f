"""The load generator's niceness (``cluster.loadtest.priority``): only the replay's thread takes it, for the run;
a niceness the host refuses is kept with a note, and the summary carries both. Each claim runs on a thread of
its own, so the test process's main thread is never touched (a niceness once raised cannot be lowered again
without privilege)."""

from __future__ import annotations

import dataclasses
import os
import sys
import threading

import pytest

from cluster.loadtest import LoadTestConfig, ReplayConfig
from cluster.loadtest.priority import NiceClaim, generator_priority
from cluster.loadtest.session import build_summary
from tests.unit.test_loadtest_report import result, trace

LINUX = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="per-thread niceness is Linux's")


def nice_of(tid: int) -> int:
    return os.getpriority(os.PRIO_PROCESS, tid)


@LINUX
def test_only_the_calling_thread_takes_the_niceness_for_the_run() -> None:
    seen: dict[str, object] = {}

    def generator() -> None:
        tid = threading.get_native_id()
        base = nice_of(tid)
        # raising a niceness needs no privilege; at 19 already, root lowers it instead
        want = base + 3 if base <= 16 else base - 3 if os.geteuid() == 0 else base
        with generator_priority(want) as claim:
            seen.update(base=base, want=want, inside=nice_of(tid), main=nice_of(main_tid), claim=claim)
        seen["after"] = nice_of(tid)

    main_tid = threading.get_native_id()
    main_before = nice_of(main_tid)
    t = threading.Thread(target=generator)
    t.start()
    t.join()
    claim = seen["claim"]
    assert isinstance(claim, NiceClaim)
    assert seen["inside"] == seen["want"] == claim.nice == claim.wanted and claim.before == seen["base"]
    assert seen["main"] == main_before == nice_of(main_tid)  # the other threads are left alone
    if seen["base"] == seen["want"]:
        pytest.skip("an unprivileged thread at niceness 17-19 already: no other niceness to take and leave")
    if os.geteuid() == 0 or seen["want"] < seen["base"]:
        assert seen["after"] == seen["base"] and claim.note is None  # set back on exit
    else:
        assert seen["after"] == seen["want"] and "stays at niceness" in (claim.note or "")


def refuse(which: int, who: int, nice: int) -> None:
    """``os.setpriority`` as an unprivileged host answers a lower niceness."""
    raise PermissionError(13, "Permission denied")


@LINUX
def test_a_niceness_the_host_refuses_is_kept_with_a_note() -> None:
    seen: dict[str, object] = {}

    def generator() -> None:
        tid = threading.get_native_id()
        base = nice_of(tid)
        with generator_priority(base - 1, setpriority=refuse) as claim:
            seen.update(base=base, inside=nice_of(tid), claim=claim)

    t = threading.Thread(target=generator)
    t.start()
    t.join()
    claim = seen["claim"]
    assert isinstance(claim, NiceClaim)
    assert seen["inside"] == seen["base"] == claim.nice == claim.before and claim.wanted == claim.before - 1
    assert "CAP_SYS_NICE" in (claim.note or "")


def test_the_summary_names_the_generator_niceness_and_why_it_fell_behind() -> None:
    tr = trace()
    late = result()
    late.records = [dataclasses.replace(r, send_lag_wall_ms=30.0) for r in late.records]
    late.priority = NiceClaim(wanted=-5, before=0, nice=0, note="the load generator stayed at niceness 0: ...")
    s = build_summary("t", "http://x", tr, tr.requests, late, LoadTestConfig(), None)
    assert s["load_generator"] == {"nice": 0, "wanted": -5, "before": 0, "note": late.priority.note}
    behind = [n for n in s["notes"] if "fell behind its schedule" in n]
    assert s["trustworthy"] is False and len(behind) == 1 and late.priority.note in behind[0]
    on_time = result()
    on_time.priority = NiceClaim(wanted=-5, before=0, nice=-5)
    s = build_summary("t", "http://x", tr, tr.requests, on_time, LoadTestConfig(), None)
    assert s["load_generator"]["nice"] == -5 and not any("fell behind" in n for n in s["notes"])


def test_generator_nice_is_a_niceness() -> None:
    assert ReplayConfig().generator_nice == -5  # the engines' default (``ClusterSpec.engine_nice``)
    assert ReplayConfig(generator_nice=None).generator_nice is None
    for bad in (-21, 20):
        with pytest.raises(ValueError, match="generator_nice"):
            ReplayConfig(generator_nice=bad)
    with pytest.raises(ValueError, match="niceness"), generator_priority(42):
        pass

"""A chaos run: replay a trace against a launched cluster while a fault schedule plays, then check it.

``run_chaos`` starts the load test (``cluster.loadtest.session.run_loadtest``, with token recording on)
and, once the replay has fixed its origin (emulated time 0), carries out the schedule's actions
(``cluster.chaos.injectors.plan_actions``) at their emulated times on that same timeline, each Ray call
off the event loop. Every action is logged with its planned and actual emulated time and when it was done
(``events.jsonl``).
After the replay it waits (bounded) for the surviving engines to go idle and for every router's prefix index
to equal the engines' caches (``index_agreement``, ``index_converged``), writes ``chaos_context.json``
(what the history checker needs: ids sent, vocabulary, regions, loads after, dead engines), runs the
checker (``checker.json``), measures each event's impact (``cluster.chaos.impact``, plus the requests
migrated off and resumed from checkpoints of its engines, ``cluster.chaos.kv_moves``) and writes
``chaos.json``: the load test's summary, the event log, the per-event figures, the checker's verdict and
``kv_migration`` (live migrations, checkpoint resumes, their measured times) and ``router_view_after`` (each
router's view of its workers at the end: healthy, eligible, breaker, feed).

Failure behaviour: an unsupported event or one naming an unknown engine/node fails before the replay
starts; an action that raises is logged with its error and the run goes on (the checker then judges
what happened); actions due after the replay ended are logged as ``not_reached``.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import time
import urllib.request
from pathlib import Path
from typing import Any

from cluster.chaos import kv_moves
from cluster.chaos.checker import CONTEXT_FILE, check_folder
from cluster.chaos.control import RayClusterControl
from cluster.chaos.impact import event_impact
from cluster.chaos.injectors import Action, HostControl, UnsupportedEvent, plan_actions
from cluster.chaos.schedule import FaultSchedule, Partition
from cluster.loadtest.report import write_json
from cluster.loadtest.session import LoadTestConfig, run_loadtest
from cluster.loadtest.spec import TraceData

EVENTS_FILE = "events.jsonl"
CHECKER_FILE = "checker.json"
CHAOS_FILE = "chaos.json"


async def _play(actions: list[Action], control: RayClusterControl, origin: asyncio.Future[float],
                time_scale: float, log: list[dict[str, Any]], done: asyncio.Event) -> None:
    t0 = await origin
    for a in actions:
        due = t0 + a.at_s * time_scale
        delay = due - time.monotonic()
        if delay > 0:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(done.wait(), delay)
        entry: dict[str, Any] = {"at_s": a.at_s, "event_index": a.event_index, "kind": a.kind, "what": a.what}
        if done.is_set():
            log.append({**entry, "outcome": "not_reached"})
            continue
        entry["actual_s"] = round((time.monotonic() - t0) / time_scale, 4)
        try:
            dead = await asyncio.to_thread(a.do, control)
            done_s = round((time.monotonic() - t0) / time_scale, 4)  # a replacement or restart takes a while
            log.append({**entry, "outcome": "done", "done_s": done_s, "killed": dead})
        except Exception as e:  # a failed injection is data for the report, not the end of the run
            log.append({**entry, "outcome": "error", "error": f"{type(e).__name__}: {e}"})


def _index_agreement(control: RayClusterControl, timeout_s: float) -> dict[str, dict[str, Any]]:
    """Routers' prefix index against the engines' caches, once equal or at the timeout (the last events
    and resync snapshots may still be on the wire when the engines go idle)."""
    deadline = time.monotonic() + timeout_s
    while True:
        agreement = control.index_agreement()
        if all(v["equal"] for v in agreement.values()) or time.monotonic() >= deadline:
            return agreement
        time.sleep(0.2)


def _settle(control: RayClusterControl, timeout_s: float) -> dict[str, dict[str, Any]]:
    """Surviving engines' loads once idle with every block free, or the last loads seen at the timeout."""
    deadline = time.monotonic() + timeout_s
    while True:
        loads = control.alive_loads()
        if all(v["free_blocks"] == v["num_blocks"] and v["running"] == 0 for v in loads.values()):
            return loads
        if time.monotonic() >= deadline:
            return loads
        time.sleep(0.1)


ROUTER_VIEW_KEYS = ("name", "healthy", "eligible", "breaker", "feed")


def _router_views(router_urls: dict[str, str]) -> dict[str, Any]:
    """What each router thinks of its workers after the run (``/workers``), or why it did not answer."""
    out: dict[str, Any] = {}
    for zone, url in router_urls.items():
        try:
            with urllib.request.urlopen(url + "/workers", timeout=10) as r:
                out[zone] = [{k: w.get(k) for k in ROUTER_VIEW_KEYS} for w in json.loads(r.read())]
        except (OSError, ValueError) as e:
            out[zone] = {"error": f"{type(e).__name__}: {e}"}
    return out


async def run_chaos(handle: Any, schedule: FaultSchedule, trace: TraceData, config: LoadTestConfig,
                    folder: Path, *, window_s: float = 10.0, settle_s: float = 10.0,
                    control: RayClusterControl | None = None) -> dict[str, Any]:
    """Run the load test with the schedule playing against ``handle``'s cluster; return ``chaos.json``.

    ``control``: how actions reach the cluster (default ``RayClusterControl(handle)``); a host-level one
    (``cluster.hosts.faults.HostFaultControl``) makes ``kill_node`` lose whole hosts and allows ``partition``
    of a host, which is refused before the run without one."""
    actions = plan_actions(schedule)
    nodes = {str(d.get("node")) for d in handle.engines.values()}
    schedule.check_against(handle.engines, nodes, hosts=[h.name for h in handle.spec.placement.hosts])
    control = control or RayClusterControl(handle)
    host_events = [f"events[{i}]" for i, e in enumerate(schedule.events) if isinstance(e, Partition) and e.host]
    if host_events and not isinstance(control, HostControl):
        raise UnsupportedEvent(f"{', '.join(host_events)}: a host partition needs a cluster whose hosts the driver "
                               f"controls (the hosts harness: run_cluster.py chaos --hosts-run-dir DIR)")
    folder.mkdir(parents=True, exist_ok=True)
    origin: asyncio.Future[float] = asyncio.get_running_loop().create_future()

    def on_origin(t: float) -> None:  # called on this loop by the replay
        if not origin.done():
            origin.set_result(t)

    config = dataclasses.replace(
        config, replay=dataclasses.replace(config.replay, on_origin=on_origin),
        client=dataclasses.replace(config.client, record_tokens=True), rates=())
    log: list[dict[str, Any]] = []
    done = asyncio.Event()
    player = asyncio.create_task(_play(actions, control, origin, config.client.time_scale, log, done))
    try:
        result = await run_loadtest(handle.router_url, trace, config, out_root=None, folder=folder)
    finally:
        done.set()
        if not origin.done():
            origin.set_result(time.monotonic())
        await player
    (folder / EVENTS_FILE).write_text("".join(json.dumps(e) + "\n" for e in log))
    after = await asyncio.to_thread(_settle, control, settle_s)
    index = await asyncio.to_thread(_index_agreement, control, settle_s)
    routers = await asyncio.to_thread(_router_views, dict(handle.router_urls))
    run = result.runs[0]
    vocab = sorted({int(d["vocab_size"]) for d in handle.engines.values() if "vocab_size" in d})
    context = {"sent_ids": [str(s.request_id) for s in run.specs], "vocab_size": vocab[0] if len(vocab) == 1 else None,
               "seed": 0, "engine_regions": {n: d.get("region") for n, d in handle.engines.items()},
               "engines_after": after, "dead_engines": sorted(control.dead)}
    write_json(folder / CONTEXT_FILE, context)
    report = check_folder(folder)
    write_json(folder / CHECKER_FILE, report.to_json())
    moves = await asyncio.to_thread(kv_moves.collect, handle, [n for n in handle.engines if n not in control.dead])
    by_node: dict[str, list[str]] = {}
    for n, d in handle.engines.items():
        by_node.setdefault(str(d.get("node")), []).append(n)
    impacts = [event_impact(e, i, run.result.records, window_s=window_s) | kv_moves.event_moves(e, moves, by_node)
               for i, e in enumerate(schedule.events)]
    summary = {"chaos": True, "schedule": schedule.name, "events": log, "impact": impacts,
               "checker": {k: v for k, v in report.to_json().items() if k != "violations"}
               | {"violations": report.to_json()["violations"][:50]},
               "dead_engines": sorted(control.dead), "replaced_engines": control.replaced,
               "engine_step_lag_ms": {n: {k: v[k] for k in ("lag_p50_ms", "lag_p99_ms", "lag_max_ms") if k in v}
                                      for n, v in after.items()},
               "router_view_after": routers,
               "index_agreement": index, "index_converged": all(v["equal"] for v in index.values()),
               "kv_events_disturbed": control.kv_disturbed, "kv_migration": moves, "loadtest": result.summary,
               "folder": str(folder)}
    write_json(folder / CHAOS_FILE, summary)
    return summary

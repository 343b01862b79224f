"""What live migration and checkpoints did in a chaos run: counts by source engine, and measured times.

Read after the run from two places that outlive the faults: the router's ``/metrics``
(``kvmesh_router_kv_migrations{source, outcome}``, ``kvmesh_router_kv_resumes{source, kind, outcome}``,
``kvmesh_router_kv_migration_seconds``: emulated seconds per migration at its source; and the plain stream
counters ``kvmesh_router_migrations{outcome}``, every stream cut mid-way, continued or failed, and
``kvmesh_router_retries{reason}``, attempts moved on before a byte reached the client) and the surviving
engines' ``migration_stats`` (a Ray control call, once: the checkpoint transfer times per 32 tokens and the
tokens recomputed per checkpoint resume are recorded by the receiving peer, so a killed source loses none).

``event_moves`` attributes the counts to a fault event by its engines (``Event.targets()``, or every engine
of a ``kill_node``'s node): counts are per source engine over the whole run, so two events naming the same
engine each see the engine's total.

Failure behaviour: a router that cannot be scraped, or a worker that does not answer, leaves its part
empty and says so in ``notes``; nothing here fails the run.
"""

from __future__ import annotations

import urllib.request
from collections.abc import Iterable, Mapping
from typing import Any

import numpy as np

from cluster.chaos.schedule import Event, KillNode
from cluster.loadtest.scrape import MetricsText, parse_metrics

MOVES = "kvmesh_router_kv_migrations"
RESUMES = "kvmesh_router_kv_resumes"
MOVE_SECONDS = "kvmesh_router_kv_migration_seconds"
STREAM_MIGRATIONS = "kvmesh_router_migrations"
RETRIES = "kvmesh_router_retries"


def _stats(values: Iterable[float]) -> dict[str, float] | None:
    arr = np.asarray(list(values), dtype=float)
    if arr.size == 0:
        return None
    return {"n": int(arr.size), "mean": float(arr.mean()), "p50": float(np.percentile(arr, 50)),
            "p99": float(np.percentile(arr, 99)), "max": float(arr.max())}


def summarize(page: MetricsText | None, engines: Mapping[str, Mapping[str, Any]],
              notes: list[str] | None = None) -> dict[str, Any]:
    """The run's figures from the router's parsed metrics and the engines' ``migration_stats``."""
    by_source: dict[str, dict[str, float]] = {}
    if page is not None:
        for key, v in page.series(MOVES).items():
            labels = dict(key)
            row = by_source.setdefault(labels.get("source", "?"), {})
            row[f"migrations_{labels.get('outcome', '?')}"] = row.get(f"migrations_{labels.get('outcome', '?')}", 0) + v
        for key, v in page.series(RESUMES).items():
            labels = dict(key)
            name = f"resumed_{labels.get('kind', '?')}_{labels.get('outcome', '?')}"
            row = by_source.setdefault(labels.get("source", "?"), {})
            row[name] = row.get(name, 0) + v
    count = page.total(f"{MOVE_SECONDS}_count") if page is not None else None
    total = page.total(f"{MOVE_SECONDS}_sum") if page is not None else None
    per32 = [x for s in engines.values() for x in s.get("checkpoint_ms_per_32_tokens", ())]
    modelled = [x for s in engines.values() for x in s.get("checkpoint_modelled_ms_per_32_tokens", ())]
    prompt_ck = [x for s in engines.values() for x in s.get("prompt_checkpoint_ms", ())]
    recomputed = [x for s in engines.values() for x in s.get("recomputed_tokens", ())]
    def by_label(name: str, label: str) -> dict[str, int]:
        out: dict[str, int] = {}
        for key, v in (page.series(name) if page is not None else {}).items():
            k = dict(key).get(label, "?")
            out[k] = out.get(k, 0) + int(v)
        return out

    return {
        "by_source": by_source,
        "stream_migrations": by_label(STREAM_MIGRATIONS, "outcome"),
        "retries": by_label(RETRIES, "reason"),
        "migrated": int(sum(r.get("migrations_ok", 0) for r in by_source.values())),
        "resumed_from_checkpoint": int(sum(r.get("resumed_checkpoint_ok", 0) for r in by_source.values())),
        "migration_ms_mean": (1000.0 * total / count) if count and total is not None else None,
        "checkpoint_ms_per_32_tokens": _stats(per32),
        "checkpoint_modelled_ms_per_32_tokens": _stats(modelled),
        "checkpoint_real_bottleneck": int(sum(s.get("checkpoint_real_bottleneck", 0) for s in engines.values())),
        "prompt_checkpoint_ms": _stats(prompt_ck),
        "recomputed_tokens_per_resume": _stats(recomputed),
        "engines": {n: {k: v for k, v in s.items() if not isinstance(v, list)} for n, s in engines.items()},
        "notes": notes or [],
    }


def collect(handle: Any, alive: Iterable[str], timeout_s: float = 30.0) -> dict[str, Any]:
    """Scrape the router and ask the surviving engines' actors (blocking: run it off the event loop)."""
    import ray

    notes: list[str] = []
    page: MetricsText | None = None
    try:
        with urllib.request.urlopen(handle.router_url + "/metrics", timeout=timeout_s) as r:
            page = parse_metrics(r.read().decode())
    except (OSError, ValueError) as e:
        notes.append(f"router metrics unreadable: {type(e).__name__}: {e}")
    names = set(alive)
    engines: dict[str, Any] = {}
    for i in sorted({handle.engine_actor[n] for n in names}):
        try:
            part = ray.get(handle.workers[i].migration_stats.remote(), timeout=timeout_s)
        except Exception as e:  # a worker that cannot answer loses its figures, not the run
            notes.append(f"worker {i}: migration_stats failed: {type(e).__name__}: {e}")
            continue
        engines.update({n: v for n, v in part.items() if n in names})
    return summarize(page, engines, notes)


def event_moves(event: Event, figures: Mapping[str, Any], engines_on_node: Mapping[str, list[str]]) -> dict[str, int]:
    """``migrated`` and ``resumed_from_checkpoint`` counts of the requests that left ``event``'s engines."""
    names = list(engines_on_node.get(event.node, [])) if isinstance(event, KillNode) else list(event.targets())
    rows = [figures.get("by_source", {}).get(n, {}) for n in names]
    return {"migrated": int(sum(r.get("migrations_ok", 0) for r in rows)),
            "resumed_from_checkpoint": int(sum(r.get("resumed_checkpoint_ok", 0) for r in rows))}

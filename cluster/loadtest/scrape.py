"""What the target says about itself: Prometheus ``/metrics`` before, during and after a run.

- Prefix cache: vLLM's counters ``vllm:prefix_cache_queries`` and ``vllm:prefix_cache_hits`` (tokens;
  exposed as ``..._total``); the run's hit ratio is the delta of hits over the delta of queries.
- Step lag: kvmesh's histogram ``kvmesh:step_lag_ms`` (how late engine steps really ended against their
  deadlines, in wall ms as the engines export it); the run's p50 / p99 come from the delta of its
  buckets, interpolated inside a bucket as Prometheus' ``histogram_quantile`` does, and its max is the
  upper bound of the highest bucket the run touched (or the gauge ``kvmesh:step_lag_ms_max`` when the
  target exports one).
- KV transfers: ``kvmesh:kv_transfers`` and ``kvmesh:kv_transfer_real_bottleneck`` (transfers where the
  real transport was slower than the emulated link); the run's share is the delta of one over the other.
- Queue depth: the gauges ``vllm:num_requests_running`` and ``vllm:num_requests_waiting``, polled every
  ``interval_s`` during the run, summed and per series (per worker when the router lists its workers at
  ``GET /workers``, else per label set of the target's own gauges).

Samples are read flat by name with prometheus_client's text parser; label sets are summed. When the
target does not export a metric (a server that is not kvmesh, or vLLM without prefix caching), the figure
is None and a note says so. When the target itself lacks the counters but lists workers, the workers'
counters are summed instead. Scrape failures are never fatal: a failed scrape is a missing snapshot.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import math
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import aiohttp
from prometheus_client.parser import text_string_to_metric_families

PREFIX_QUERIES = "vllm:prefix_cache_queries"
PREFIX_HITS = "vllm:prefix_cache_hits"
STEP_LAG = "kvmesh:step_lag_ms"
STEP_LAG_MAX = "kvmesh:step_lag_ms_max"
STEP_TIME = "kvmesh:step_time_ms"
KV_TRANSFERS = "kvmesh:kv_transfers"
KV_REAL_BOTTLENECK = "kvmesh:kv_transfer_real_bottleneck"
RUNNING = "vllm:num_requests_running"
WAITING = "vllm:num_requests_waiting"
IGNORED_SERIES_LABELS = frozenset({"model_name", "le"})

LabelKey = tuple[tuple[str, str], ...]


def _key(labels: Mapping[str, str]) -> LabelKey:
    return tuple(sorted((k, v) for k, v in labels.items() if k not in IGNORED_SERIES_LABELS))


@dataclass(frozen=True)
class MetricsText:
    """A parsed ``/metrics`` page: every sample by name (``_total`` stripped from counters' names),
    then by label set (without ``le`` and ``model_name``), and histogram buckets by upper bound."""

    samples: dict[str, dict[LabelKey, float]]
    buckets: dict[str, dict[float, float]]

    def has(self, name: str) -> bool:
        return name in self.samples or name in self.buckets

    def total(self, name: str) -> float | None:
        series = self.samples.get(name)
        return None if series is None else sum(series.values())

    def series(self, name: str) -> dict[LabelKey, float]:
        return dict(self.samples.get(name, {}))


def only_metrics(text: str, names: tuple[str, ...]) -> str:
    """The lines of a ``/metrics`` page that belong to the metrics ``names`` (their samples, ``# HELP`` and
    ``# TYPE``): a page of a few hundred lines cut to a few before ``parse_metrics`` (a worker's full page
    takes ~6 ms to parse, on the load generator's loop)."""
    heads = tuple(f"{n}{c}" for n in names for c in ("{", " "))
    meta = tuple(f"# {kind} {n} " for n in names for kind in ("HELP", "TYPE"))
    return "".join(line for line in text.splitlines(keepends=True) if line.startswith(heads) or line.startswith(meta))


def parse_metrics(text: str) -> MetricsText:
    """Parse Prometheus text exposition. Raises ValueError on text that is not in that format."""
    samples: dict[str, dict[LabelKey, float]] = {}
    buckets: dict[str, dict[float, float]] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            name = s.name
            if name.endswith("_bucket") and "le" in s.labels:
                base = name[: -len("_bucket")]
                le = float(s.labels["le"])
                per = buckets.setdefault(base, {})
                per[le] = per.get(le, 0.0) + float(s.value)
                continue
            if name.endswith("_total"):
                name = name[: -len("_total")]
            elif name.endswith("_created"):
                continue
            per_series = samples.setdefault(name, {})
            k = _key(s.labels)
            per_series[k] = per_series.get(k, 0.0) + float(s.value)
    return MetricsText(samples, buckets)


def merge(pages: list[MetricsText]) -> MetricsText:
    """Sum several pages (workers' pages into one)."""
    samples: dict[str, dict[LabelKey, float]] = {}
    buckets: dict[str, dict[float, float]] = {}
    for p in pages:
        for name, series in p.samples.items():
            dst = samples.setdefault(name, {})
            for k, v in series.items():
                dst[k] = dst.get(k, 0.0) + v
        for name, bs in p.buckets.items():
            bdst = buckets.setdefault(name, {})
            for le, v in bs.items():
                bdst[le] = bdst.get(le, 0.0) + v
    return MetricsText(samples, buckets)


def counter_delta(before: MetricsText | None, after: MetricsText | None, name: str) -> float | None:
    if before is None or after is None:
        return None
    a, b = after.total(name), before.total(name)
    if a is None:
        return None
    return a - (b or 0.0)


ENGINE_TTFT = "vllm:time_to_first_token_seconds"


def engine_ttft_mean_ms(before_workers: Mapping[str, MetricsText],
                        after_workers: Mapping[str, MetricsText]) -> float | None:
    """The engines' own mean TTFT over the run, in emulated ms: from each engine's arrival stamp to the step that
    made the first token (their ``vllm:time_to_first_token_seconds``, every worker's page summed). What the
    emulation decided, without the router, the HTTP hops or a process's wait for a core that the client's TTFT
    also holds; None when the workers' pages lack it or nothing finished a first token."""
    if not before_workers or not after_workers:
        return None
    before, after = merge(list(before_workers.values())), merge(list(after_workers.values()))
    total = counter_delta(before, after, f"{ENGINE_TTFT}_sum")
    count = counter_delta(before, after, f"{ENGINE_TTFT}_count")
    return total / count * 1000.0 if total is not None and count else None


def prefix_hit_ratio(before: MetricsText | None, after: MetricsText | None) -> float | None:
    """Hits over queries during the run; None when the counters are absent or nothing was queried."""
    q = counter_delta(before, after, PREFIX_QUERIES)
    h = counter_delta(before, after, PREFIX_HITS)
    if q is None or h is None or q <= 0:
        return None
    return h / q


def transfer_bottleneck(before: MetricsText | None, after: MetricsText | None) -> dict[str, float] | None:
    """KV transfers during the run and how many the real transport (not the emulated link) slowed.

    From kvmesh's counters ``kvmesh:kv_transfers`` (every outcome) and
    ``kvmesh:kv_transfer_real_bottleneck``; None when the target exports them not or moved no KV.
    """
    n = counter_delta(before, after, KV_TRANSFERS)
    slow = counter_delta(before, after, KV_REAL_BOTTLENECK)
    if n is None or slow is None or n <= 0:
        return None
    return {"transfers": n, "real_bottleneck": slow, "share": slow / n}


def histogram_quantile(q: float, cumulative: Mapping[float, float]) -> float | None:
    """Prometheus' ``histogram_quantile`` over cumulative bucket counts by upper bound (``inf`` last):
    linear inside the bucket that holds rank ``q * count``; the largest finite bound when that bucket is
    the ``+Inf`` one; None for an empty histogram."""
    bounds = sorted(cumulative)
    if not bounds:
        return None
    total = cumulative[bounds[-1]]
    if total <= 0:
        return None
    rank = q * total
    lower, below = 0.0, 0.0
    for le in bounds:
        c = cumulative[le]
        if c >= rank:
            if math.isinf(le):
                finite = [b for b in bounds if not math.isinf(b)]
                return finite[-1] if finite else None
            if c == below:
                return le
            return lower + (le - lower) * (rank - below) / (c - below)
        lower, below = le, c
    return None


def step_lag(before: MetricsText | None, after: MetricsText | None) -> dict[str, float | None] | None:
    """p50 / p99 / max of the step-lag histogram's growth during the run, the number of steps, and how
    many of them lagged beyond the largest finite bucket (their lag is unknown, and a quantile that lands
    there reads as that bucket's bound: a lower bound); None when the target does not export it."""
    if after is None or STEP_LAG not in after.buckets:
        return None
    prev = before.buckets.get(STEP_LAG, {}) if before is not None else {}
    delta = {le: c - prev.get(le, 0.0) for le, c in after.buckets[STEP_LAG].items()}
    bounds = sorted(delta)
    count = delta[bounds[-1]] if bounds else 0.0
    top: float | None = None
    below = 0.0
    for le in bounds:
        if delta[le] > below:
            top = le
        below = delta[le]
    if top is not None and math.isinf(top):
        finite = [b for b in bounds if not math.isinf(b)]
        top = finite[-1] if finite else None
    finite = [b for b in bounds if not math.isinf(b)]
    over = count - delta[finite[-1]] if finite else 0.0
    gauge = after.total(STEP_LAG_MAX)
    return {"p50": histogram_quantile(0.5, delta), "p99": histogram_quantile(0.99, delta),
            "max": gauge if gauge is not None else top, "steps": count, "steps_over_top_bucket": over}


@dataclass
class DepthSample:
    t_ms: float
    running: float | None
    waiting: float | None
    per_series: dict[str, tuple[float, float]] = field(default_factory=dict)
    router_inflight: float | None = None
    """Requests the router holds open (sum of ``inflight`` in ``GET /workers``), when it says."""

    @property
    def idle(self) -> bool | None:
        """True when the target reports nothing running, waiting or held; None when it cannot tell."""
        if self.running is None or self.waiting is None:
            return None
        return self.running + self.waiting + (self.router_inflight or 0.0) == 0


def _series_name(k: LabelKey) -> str:
    return ",".join(f"{a}={b}" for a, b in k) or "all"


def router_inflight(payload: Any) -> float | None:
    """Sum of the ``inflight`` counts in a ``GET /workers`` answer; None when it carries none."""
    items = payload.get("workers") if isinstance(payload, dict) else payload
    if not isinstance(items, list):
        return None
    counts = [w["inflight"] for w in items if isinstance(w, dict) and isinstance(w.get("inflight"), int | float)]
    return float(sum(counts)) if counts else None


def parse_processes(payload: Any) -> dict[str, str]:
    """Worker name -> hosting process from a ``GET /workers`` answer (its ``process`` fields; kvmesh's router
    names an actor by its feed URL); empty when the answer carries none."""
    items = payload.get("workers") if isinstance(payload, dict) else payload
    if not isinstance(items, list):
        return {}
    return {str(w["name"]): str(w["process"]) for w in items
            if isinstance(w, dict) and "name" in w and isinstance(w.get("process"), str)}


def mean_step_ms(before: MetricsText | None, after: MetricsText | None) -> float | None:
    """Mean emulated duration of the engine steps taken during the run (``kvmesh:step_time_ms``)."""
    n = counter_delta(before, after, STEP_TIME + "_count")
    total = counter_delta(before, after, STEP_TIME + "_sum")
    if n is None or total is None or n <= 0:
        return None
    return total / n


def lag_by_group(before: Mapping[str, MetricsText], after: Mapping[str, MetricsText],
                 group: Mapping[str, str] | None = None) -> dict[str, dict[str, float | None]]:
    """Step lag during the run per worker (``group`` None) or per group of workers (name -> group, e.g. the
    hosting process: their pages summed); groups whose pages carry no step-lag histogram are left out."""
    pages_after: dict[str, list[MetricsText]] = {}
    pages_before: dict[str, list[MetricsText]] = {}
    for name, page in after.items():
        key = name if group is None else group.get(name, name)
        pages_after.setdefault(key, []).append(page)
        if name in before:
            pages_before.setdefault(key, []).append(before[name])
    out: dict[str, dict[str, float | None]] = {}
    for key in sorted(pages_after):
        prev = pages_before.get(key)
        lag = step_lag(merge(prev) if prev else None, merge(pages_after[key]))
        if lag is not None and lag.get("steps"):
            out[key] = lag
    return out


def suggest_time_scale(time_scale: float, lag_p99_wall_ms: float, step_ms: float | None) -> float | None:
    """A time scale at which the run's steps would likely have kept up (an estimate, not a guarantee).

    A step of ``T`` emulated ms lasts ``time_scale * T`` wall ms; the host added ``L`` (the p99 lag) on top.
    Stretching every step's wall time by that lag, ``time_scale' = time_scale + L / T``, gives the host the
    wall time it took. None without a mean step time."""
    if step_ms is None or step_ms <= 0:
        return None
    return time_scale + lag_p99_wall_ms / step_ms


def parse_workers(payload: Any) -> list[tuple[str, str]]:
    """(name, base URL) of each worker in a ``GET /workers`` answer: a list of URLs, of objects with
    ``url`` (and ``name``/``id``), or an object holding such a list under ``workers``. Unknown shapes
    give an empty list."""
    items = payload.get("workers") if isinstance(payload, dict) else payload
    out: list[tuple[str, str]] = []
    if not isinstance(items, list):
        return out
    for i, w in enumerate(items):
        if isinstance(w, str) and w.startswith("http"):
            out.append((w, w.rstrip("/")))
        elif isinstance(w, dict):
            url = w.get("url") or w.get("base_url") or w.get("address")
            if isinstance(url, str) and url.startswith("http"):
                name = str(w.get("name") or w.get("id") or w.get("worker_id") or f"worker-{i}")
                out.append((name, url.rstrip("/")))
    return out


class TargetProbe:
    """Scrapes a target's ``/metrics`` (and its workers', when listed) on one aiohttp session.

    Times are emulated ms since ``origin`` (a ``time.monotonic()`` value) divided by ``time_scale``.
    Every network or parse error is swallowed into a missing result and counted in ``errors``.
    """

    def __init__(self, session: aiohttp.ClientSession, base_url: str, *, time_scale: float = 1.0,
                 timeout_s: float = 5.0) -> None:
        self.session = session
        self.base_url = base_url.rstrip("/")
        self.time_scale = time_scale
        self.timeout = aiohttp.ClientTimeout(total=timeout_s)
        self.workers: list[tuple[str, str]] = []
        self.processes: dict[str, str] = {}
        """Worker name -> the process hosting it (engines packed in one actor share one)."""
        self.errors = 0
        self.samples: list[DepthSample] = []
        self.origin = time.monotonic()
        self._idle_since: float | None = None

    async def _get(self, url: str, params: list[tuple[str, str]] | None = None) -> str | None:
        try:
            async with self.session.get(url, params=params, timeout=self.timeout) as resp:
                if resp.status != 200:
                    return None
                return await resp.text()
        except (TimeoutError, aiohttp.ClientError, UnicodeDecodeError):
            self.errors += 1
            return None

    async def _workers_payload(self) -> Any:
        text = await self._get(f"{self.base_url}/workers")
        if text is None:
            return None
        try:
            return json.loads(text)
        except ValueError:
            return None

    async def discover_workers(self) -> list[tuple[str, str]]:
        payload = await self._workers_payload()
        self.workers = parse_workers(payload)
        self.processes = parse_processes(payload)
        return self.workers

    def idle_for(self) -> float:
        """Wall seconds the target has continuously reported nothing in flight (0 when busy or unknown)."""
        return 0.0 if self._idle_since is None else time.monotonic() - self._idle_since

    async def page(self, base: str, only: tuple[str, ...] | None = None) -> MetricsText | None:
        """``base``'s ``/metrics``; ``only``: asked for those metrics alone (Prometheus' ``name[]`` query, which
        kvmesh's engines and ``prometheus_client``'s handlers, vLLM's among them, honour: the server renders two
        gauges, not a page of histograms) and cut to them here too, for a server that sends the whole page."""
        params = None if only is None else [("name[]", n) for n in only]
        text = await self._get(f"{base}/metrics", params)
        if text is None:
            return None
        try:
            return parse_metrics(text if only is None else only_metrics(text, only))
        except ValueError:
            self.errors += 1
            return None

    async def snapshot(self, only: tuple[str, ...] | None = None) -> tuple[MetricsText | None, dict[str, MetricsText]]:
        """The target's page and each listed worker's page (those that answered); ``only``: just these metrics."""
        tasks = [self.page(self.base_url, only), *(self.page(url, only) for _, url in self.workers)]
        pages = await asyncio.gather(*tasks)
        per_worker = {name: p for (name, _), p in zip(self.workers, pages[1:], strict=True) if p is not None}
        return pages[0], per_worker

    @staticmethod
    def combined(target: MetricsText | None, workers: Mapping[str, MetricsText]) -> MetricsText | None:
        """The target's page, completed with the workers' sum for every metric the target lacks."""
        if not workers:
            return target
        summed = merge(list(workers.values()))
        if target is None:
            return summed
        samples = dict(summed.samples)
        samples.update(target.samples)
        buckets = dict(summed.buckets)
        buckets.update(target.buckets)
        return MetricsText(samples, buckets)

    def now_ms(self) -> float:
        return (time.monotonic() - self.origin) / self.time_scale * 1000.0

    async def poll(self, interval_s: float, stop: asyncio.Event) -> None:
        """Record queue depth every ``interval_s`` wall seconds until ``stop`` is set."""
        while not stop.is_set():
            t = self.now_ms()
            # Only the two gauges a sample needs: the full pages (~25 ms to parse for 4 engines) blocked the
            # loop every interval and made sends due meanwhile late (send lag p99 43 ms over 400 s); asked for by
            # name, so the engines render them alone too (their whole pages, ~2 ms each on the engines' loop,
            # made steps late: Mooncake 60 s step lag p99 12.3 ms polled, 1.6 ms unpolled).
            target, workers = await self.snapshot(only=(RUNNING, WAITING))
            page = self.combined(target, workers)
            if page is not None:
                per: dict[str, tuple[float, float]] = {}
                if workers:
                    for name, p in workers.items():
                        per[name] = (p.total(RUNNING) or 0.0, p.total(WAITING) or 0.0)
                else:
                    running, waiting = page.series(RUNNING), page.series(WAITING)
                    if len(running) > 1 or len(waiting) > 1:
                        for k in sorted(set(running) | set(waiting)):
                            per[_series_name(k)] = (running.get(k, 0.0), waiting.get(k, 0.0))
                held = router_inflight(await self._workers_payload()) if self.workers else None
                sample = DepthSample(t, page.total(RUNNING), page.total(WAITING), per, held)
                self.samples.append(sample)
                if sample.idle:
                    if self._idle_since is None:
                        self._idle_since = time.monotonic()
                else:
                    self._idle_since = None
            else:
                self._idle_since = None
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(stop.wait(), timeout=interval_s)

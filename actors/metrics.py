"""Prometheus metrics of one engine, under vLLM's names, plus the emulator's own (step lag, step time).

Each engine owns a ``CollectorRegistry`` (several engines can share a process). Times in histograms
are emulated seconds, as a real vLLM on the emulated hardware would report them; step lag is wall ms.
"""

from __future__ import annotations

from bisect import bisect_left
from collections.abc import Iterable, Iterator
from itertools import accumulate
from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import HistogramMetricFamily
from prometheus_client.utils import floatToGoString

from actors.cost_model import StepTime
from actors.engine.scheduler import ScheduledStep, TokenOutput
from actors.engine.sequence import FinishReason, Sequence
from transport import TransferRecord

if TYPE_CHECKING:
    from actors.engine.engine import Engine

TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
               40.0, 80.0)
E2E_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0,
               480.0, 960.0, 1920.0, 7680.0)
LAG_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1.0, 2.0, 5.0, 10.0, 20.0, 50.0, 100.0, 250.0, 1000.0)
STEP_BUCKETS = (1.0, 2.0, 5.0, 10.0, 15.0, 20.0, 30.0, 50.0, 75.0, 100.0, 200.0, 500.0, 1000.0, 5000.0)
TIER_BUCKETS = (0.0001, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0)


class CountedHistogram:
    """A one-series Prometheus histogram that takes ``n`` equal observations in one call, for per-token series.

    The engine emits a step's tokens together, and every decode of a step has the same inter-token gap (the
    previous step's end to this one's): ``observe(gap, n)`` counts them at once, where ``Histogram.observe``
    (1.4 us, a lock and a bucket scan per call) ran twice per output token. Plain ints per bucket (one event
    loop writes them; the exposition reads them on the same loop), exposed by ``collect`` exactly as
    ``prometheus_client``'s histogram is: cumulative ``_bucket`` series with ``le`` up to ``+Inf``, ``_count``,
    ``_sum``. A value equal to a bound counts in that bound's bucket (``le``), as Prometheus defines it.
    """

    def __init__(self, name: str, documentation: str, labels: Iterable[str], values: Iterable[str],
                 buckets: Iterable[float], registry: CollectorRegistry) -> None:
        self.name, self.documentation = name, documentation
        self.labels, self.values = list(labels), list(values)
        self.bounds = [*sorted(float(b) for b in buckets), float("inf")]
        self.counts = [0] * len(self.bounds)
        self.sum = 0.0
        registry.register(self)

    def observe(self, value: float, n: int = 1) -> None:
        self.counts[bisect_left(self.bounds, value)] += n
        self.sum += value * n

    def describe(self) -> Iterator[HistogramMetricFamily]:
        yield HistogramMetricFamily(self.name, self.documentation, labels=self.labels)

    def collect(self) -> Iterator[HistogramMetricFamily]:
        fam = HistogramMetricFamily(self.name, self.documentation, labels=self.labels)
        fam.add_metric(self.values, [(floatToGoString(b), c) for b, c in zip(self.bounds, accumulate(self.counts),
                                                                               strict=True)], self.sum)
        yield fam


class EngineMetrics:
    """An ``EngineObserver`` that keeps the engine's Prometheus metrics."""

    def __init__(self, model_name: str, engine_name: str) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        labels = ["model_name", "engine"]
        lv = (model_name, engine_name)
        self.running = Gauge("vllm:num_requests_running", "Number of requests in model execution batches.",
                             labels, registry=r).labels(*lv)
        self.waiting = Gauge("vllm:num_requests_waiting", "Number of requests waiting to be processed.",
                             labels, registry=r).labels(*lv)
        self.kv_usage = Gauge("vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.",
                              labels, registry=r).labels(*lv)
        self.gpu_cache = Gauge("vllm:gpu_cache_usage_perc", "GPU KV-cache usage (older name).",
                               labels, registry=r).labels(*lv)
        self.prefix_queries = Counter("vllm:prefix_cache_queries",
                                      "Prefix cache queries, in terms of number of queried tokens.",
                                      labels, registry=r).labels(*lv)
        self.prefix_hits = Counter("vllm:prefix_cache_hits", "Prefix cache hits, in terms of number of cached "
                                   "tokens.", labels, registry=r).labels(*lv)
        self.preemptions = Counter("vllm:num_preemptions", "Cumulative number of preemptions.",
                                   labels, registry=r).labels(*lv)
        self.prompt_tokens = Counter("vllm:prompt_tokens", "Number of prefill tokens processed.",
                                     labels, registry=r).labels(*lv)
        self.generation_tokens = Counter("vllm:generation_tokens", "Number of generation tokens processed.",
                                         labels, registry=r).labels(*lv)
        self.success = Counter("vllm:request_success", "Count of successfully processed requests.",
                               [*labels, "finished_reason"], registry=r)
        self._lv = lv
        self.ttft = Histogram("vllm:time_to_first_token_seconds", "Histogram of time to first token in seconds.",
                              labels, buckets=TTFT_BUCKETS, registry=r).labels(*lv)
        self.itl = CountedHistogram("vllm:inter_token_latency_seconds", "Histogram of inter-token latency in "
                                    "seconds.", labels, lv, ITL_BUCKETS, r)
        self.tpot = CountedHistogram("vllm:time_per_output_token_seconds", "Histogram of time per output token "
                                     "in seconds.", labels, lv, ITL_BUCKETS, r)
        self.e2e = Histogram("vllm:e2e_request_latency_seconds", "Histogram of end to end request latency in "
                             "seconds.", labels, buckets=E2E_BUCKETS, registry=r).labels(*lv)
        self.queue_time = Histogram("vllm:request_queue_time_seconds", "Histogram of time spent in WAITING "
                                    "phase for request.", labels, buckets=E2E_BUCKETS, registry=r).labels(*lv)
        self.step_lag = CountedHistogram("kvmesh:step_lag_ms", "How late each engine step really ended against "
                                         "its emulated deadline (wall milliseconds).", labels, lv, LAG_BUCKETS, r)
        self.step_time = CountedHistogram("kvmesh:step_time_ms", "Emulated duration of each engine step (ms).",
                                          labels, lv, STEP_BUCKETS, r)
        self.step_tokens = Counter("kvmesh:step_tokens", "Tokens computed by engine steps.", labels,
                                   registry=r).labels(*lv)
        self.kv_transfers = Counter("kvmesh:kv_transfers", "KV transfers by operation and outcome.",
                                    [*labels, "op", "outcome"], registry=r)
        self.kv_transfer_ms = Histogram("kvmesh:kv_transfer_ms", "Emulated duration of KV transfers (ms).",
                                        [*labels, "op"], buckets=STEP_BUCKETS, registry=r)
        self.kv_transfer_bytes = Counter("kvmesh:kv_transfer_bytes", "Emulated KV bytes moved.", labels,
                                         registry=r).labels(*lv)
        self.kv_real_bottleneck = Counter("kvmesh:kv_transfer_real_bottleneck",
                                          "Transfers where the real transport, not the emulated link, was slower.",
                                          labels, registry=r).labels(*lv)
        self._tier_metrics(labels)
        self._last_queries = 0
        self._last_hits = 0
        self._last_preempt = 0
        self._last_prompt = 0
        self._steps_tokens = 0
        """Tokens of the steps so far (``on_step``); the counter catches up at ``sync``."""
        self._last_step_tokens = 0
        self._engine: Engine | None = None

    def _tier_metrics(self, labels: list[str]) -> None:
        """KV tiers (``actors.engine.tiers``), per medium: vLLM's offloading and external-prefix-cache names,
        LMCache's retrieve/store latency histograms, and the emulator's hits, misses, evictions, fallbacks."""
        r, lv = self.registry, self._lv
        ml = [*labels, "medium"]
        self.offload_load_bytes = Counter("vllm:kv_offload_load_bytes", "Total bytes loaded from offload storage "
                                          "to GPU (emulated bytes).", ml, registry=r)
        self.offload_load_time = Counter("vllm:kv_offload_load_time", "Total load time from offload storage to "
                                         "GPU, in (emulated) seconds.", ml, registry=r)
        self.offload_store_bytes = Counter("vllm:kv_offload_store_bytes", "Total bytes stored from GPU to offload "
                                           "storage (emulated bytes).", ml, registry=r)
        self.offload_store_time = Counter("vllm:kv_offload_store_time", "Total store time from GPU to offload "
                                          "storage, in (emulated) seconds.", ml, registry=r)
        self.time_to_retrieve = Histogram("lmcache:time_to_retrieve", "Time to retrieve KV from a tier (emulated "
                                          "seconds).", ml, buckets=TIER_BUCKETS, registry=r)
        self.time_to_store = Histogram("lmcache:time_to_store", "Time to store KV into a tier (emulated seconds).",
                                       ml, buckets=TIER_BUCKETS, registry=r)
        self.tier_queried = Counter("kvmesh:kv_tier_queried_blocks", "Blocks looked up in a tier (past the levels "
                                    "above it).", ml, registry=r)
        self.tier_hits = Counter("kvmesh:kv_tier_hit_blocks", "Blocks a tier lookup found.", ml, registry=r)
        self.tier_misses = Counter("kvmesh:kv_tier_miss_blocks", "Blocks a tier lookup did not find.", ml,
                                   registry=r)
        self.tier_evictions = Counter("kvmesh:kv_tier_evictions", "Blocks a tier evicted to make room.", ml,
                                      registry=r)
        self.tier_fallbacks = Counter("kvmesh:kv_tier_fallbacks", "Tier loads that failed and fell back to "
                                      "recompute.", [*ml, "reason"], registry=r)
        self.tier_usage = Gauge("kvmesh:kv_tier_usage_blocks", "Blocks a tier holds.", ml, registry=r)
        self.external_queries = Counter("vllm:external_prefix_cache_queries", "External prefix cache queries "
                                        "(KV tiers below the GPU), in tokens.", labels, registry=r).labels(*lv)
        self.external_hits = Counter("vllm:external_prefix_cache_hits", "External prefix cache hits (tokens "
                                     "loaded from KV tiers).", labels, registry=r).labels(*lv)
        self.swaps = Counter("kvmesh:kv_swaps", "Sequences swapped out to the CPU tier at preemption and back in.",
                             [*labels, "direction"], registry=r)
        self._last_tiers = (0, 0, 0, 0)

    # -- TierObserver (the engine's tier chain reports here) -------------------------------------------
    def on_tier_lookup(self, medium: str, queried_blocks: int, hit_blocks: int) -> None:
        self.tier_queried.labels(*self._lv, medium).inc(queried_blocks)
        self.tier_hits.labels(*self._lv, medium).inc(hit_blocks)
        self.tier_misses.labels(*self._lv, medium).inc(queried_blocks - hit_blocks)

    def on_tier_load(self, medium: str, blocks: int, nbytes: float, seconds: float) -> None:
        self.offload_load_bytes.labels(*self._lv, medium).inc(nbytes)
        self.offload_load_time.labels(*self._lv, medium).inc(seconds)
        self.time_to_retrieve.labels(*self._lv, medium).observe(seconds)

    def on_tier_store(self, medium: str, blocks: int, nbytes: float, seconds: float) -> None:
        self.offload_store_bytes.labels(*self._lv, medium).inc(nbytes)
        self.offload_store_time.labels(*self._lv, medium).inc(seconds)
        self.time_to_store.labels(*self._lv, medium).observe(seconds)

    def on_tier_evict(self, medium: str, blocks: int) -> None:
        self.tier_evictions.labels(*self._lv, medium).inc(blocks)

    def on_tier_fallback(self, medium: str, reason: str) -> None:
        self.tier_fallbacks.labels(*self._lv, medium, reason).inc()

    def _sync_tiers(self, engine: Engine) -> None:
        if engine.tiers is None:
            return
        c = engine.tiers.counters
        now = (c.external_queries, c.external_hits, c.swaps_out, c.swaps_in)
        q, h, so, si = (a - b for a, b in zip(now, self._last_tiers, strict=True))
        self._last_tiers = now
        self.external_queries.inc(q)
        self.external_hits.inc(h)
        self.swaps.labels(*self._lv, "out").inc(so)
        self.swaps.labels(*self._lv, "in").inc(si)
        for tier in engine.tiers.chain.tiers:
            self.tier_usage.labels(*self._lv, tier.medium).set(tier.usage().blocks)

    # -- EngineObserver ----------------------------------------------------------------------------
    def on_step(self, engine: Engine, step: ScheduledStep, cost: StepTime, lag_wall_ms: float) -> None:
        """Per step only what a step alone knows (its lag, its time, its tokens); the counters and gauges that
        follow the engine's own statistics catch up at ``sync`` (every scrape): ~20 Prometheus calls a step
        were a quarter of an idle-batch engine's CPU per token at 64 engines in a process."""
        self._engine = engine
        self.step_lag.observe(lag_wall_ms)
        self.step_time.observe(cost.total_ms)
        self._steps_tokens += step.num_tokens

    def sync(self, engine: Engine) -> None:
        """Bring the counters and gauges that follow the engine's statistics up to date (before a scrape)."""
        self._engine = engine
        st = engine.scheduler.stats
        self.prefix_queries.inc(st.prefix_queries - self._last_queries)
        self.prefix_hits.inc(st.prefix_hits - self._last_hits)
        self.preemptions.inc(st.preemptions - self._last_preempt)
        self.prompt_tokens.inc(st.prompt_tokens - self._last_prompt)
        self._last_queries, self._last_hits = st.prefix_queries, st.prefix_hits
        self._last_preempt, self._last_prompt = st.preemptions, st.prompt_tokens
        self.step_tokens.inc(self._steps_tokens - self._last_step_tokens)
        self._last_step_tokens = self._steps_tokens
        self._sync_tiers(engine)
        self.refresh(engine)

    def refresh(self, engine: Engine) -> None:
        self.running.set(engine.num_running)
        self.waiting.set(engine.num_waiting)
        usage = engine.kv_usage()
        self.kv_usage.set(usage)
        self.gpu_cache.set(usage)

    def on_tokens(self, engine: Engine, outputs: list[TokenOutput], end_ms: float) -> None:
        if not outputs:
            return
        self.generation_tokens.inc(len(outputs))
        gaps: dict[float, int] = {}  # a step's decodes mostly share one gap: counted once per distinct gap
        for out in outputs:
            seq = out.seq
            if len(seq.output_ids) == 1:
                self.ttft.observe((end_ms - seq.arrival_ms) / 1000.0)
                if seq.first_scheduled_ms is not None:
                    self.queue_time.observe(max(0.0, seq.first_scheduled_ms - seq.arrival_ms) / 1000.0)
            elif seq.prev_token_ms is not None:
                gaps[seq.prev_token_ms] = gaps.get(seq.prev_token_ms, 0) + 1
        for prev, n in gaps.items():
            gap = (end_ms - prev) / 1000.0
            self.itl.observe(gap, n)
            self.tpot.observe(gap, n)

    def on_finish(self, engine: Engine, seq: Sequence) -> None:
        self._engine = engine
        reason = (seq.finish_reason or FinishReason.ABORT).value
        self.success.labels(*self._lv, reason).inc()
        if seq.last_token_ms is not None and reason != "abort":
            self.e2e.observe((seq.last_token_ms - seq.arrival_ms) / 1000.0)

    def on_transfer(self, rec: TransferRecord, outcome: str) -> None:
        self.kv_transfers.labels(*self._lv, rec.op, outcome).inc()
        self.kv_transfer_ms.labels(*self._lv, rec.op).observe(rec.emulated_ms)
        self.kv_transfer_bytes.inc(rec.emulated_bytes)
        if rec.real_bottleneck:
            self.kv_real_bottleneck.inc()

    def on_transfer_failed(self, op: str) -> None:
        self.kv_transfers.labels(*self._lv, op, "failed").inc()

    def exposition(self, names: Iterable[str] = (), engine: Engine | None = None) -> bytes:
        """The text page: every metric, or only the samples named in ``names`` (Prometheus' ``name[]`` query, as
        ``prometheus_client``'s own handlers take it: only the collectors of those names are collected).

        The page is synced once (``sync``) with ``engine``, or with the engine last seen (a step, a finish) when
        none is given; an engine's ``/metrics`` handler passes its engine, so a page scraped before the first
        step shows it too.

        Why filtered: a load test polls every engine for its two queue gauges every 0.5 s. A whole page is ~2 ms
        of the engine process's loop (four engines' pages back to back: ~8 ms), time in which every engine of the
        process missed its step deadline; in the 60 s Mooncake slice the poll alone took step lag p99 from 1.6 to
        12.3 ms (``bench/density.py``).
        """
        engine = engine if engine is not None else self._engine
        if engine is not None:
            self.sync(engine)
        wanted = set(names)
        return generate_latest(self.registry.restricted_registry(wanted) if wanted else self.registry)

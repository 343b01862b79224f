"""Prometheus metrics of one engine, under vLLM's names, plus the emulator's own (step lag, step time).

Each engine owns a ``CollectorRegistry`` (several engines can share a process). Times in histograms
are emulated seconds, as a real vLLM on the emulated hardware would report them; step lag is wall ms.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

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
        self.itl = Histogram("vllm:inter_token_latency_seconds", "Histogram of inter-token latency in seconds.",
                             labels, buckets=ITL_BUCKETS, registry=r).labels(*lv)
        self.tpot = Histogram("vllm:time_per_output_token_seconds", "Histogram of time per output token in "
                              "seconds.", labels, buckets=ITL_BUCKETS, registry=r).labels(*lv)
        self.e2e = Histogram("vllm:e2e_request_latency_seconds", "Histogram of end to end request latency in "
                             "seconds.", labels, buckets=E2E_BUCKETS, registry=r).labels(*lv)
        self.queue_time = Histogram("vllm:request_queue_time_seconds", "Histogram of time spent in WAITING "
                                    "phase for request.", labels, buckets=E2E_BUCKETS, registry=r).labels(*lv)
        self.step_lag = Histogram("kvmesh:step_lag_ms", "How late each engine step really ended against its "
                                  "emulated deadline (wall milliseconds).", labels, buckets=LAG_BUCKETS,
                                  registry=r).labels(*lv)
        self.step_time = Histogram("kvmesh:step_time_ms", "Emulated duration of each engine step (ms).",
                                   labels, buckets=STEP_BUCKETS, registry=r).labels(*lv)
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
        self._last_queries = 0
        self._last_hits = 0
        self._last_preempt = 0
        self._last_prompt = 0

    # -- EngineObserver ----------------------------------------------------------------------------
    def on_step(self, engine: Engine, step: ScheduledStep, cost: StepTime, lag_wall_ms: float) -> None:
        st = engine.scheduler.stats
        self.prefix_queries.inc(st.prefix_queries - self._last_queries)
        self.prefix_hits.inc(st.prefix_hits - self._last_hits)
        self.preemptions.inc(st.preemptions - self._last_preempt)
        self.prompt_tokens.inc(st.prompt_tokens - self._last_prompt)
        self._last_queries, self._last_hits = st.prefix_queries, st.prefix_hits
        self._last_preempt, self._last_prompt = st.preemptions, st.prompt_tokens
        self.step_lag.observe(lag_wall_ms)
        self.step_time.observe(cost.total_ms)
        self.step_tokens.inc(step.num_tokens)
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
        for out in outputs:
            seq = out.seq
            if len(seq.output_ids) == 1:
                self.ttft.observe((end_ms - seq.arrival_ms) / 1000.0)
                if seq.first_scheduled_ms is not None:
                    self.queue_time.observe(max(0.0, seq.first_scheduled_ms - seq.arrival_ms) / 1000.0)
            elif seq.prev_token_ms is not None:
                gap = (end_ms - seq.prev_token_ms) / 1000.0
                self.itl.observe(gap)
                self.tpot.observe(gap)

    def on_finish(self, engine: Engine, seq: Sequence) -> None:
        reason = (seq.finish_reason or FinishReason.ABORT).value
        self.success.labels(*self._lv, reason).inc()
        if seq.last_token_ms is not None and reason != "abort":
            self.e2e.observe((seq.last_token_ms - seq.arrival_ms) / 1000.0)
        self.refresh(engine)

    def on_transfer(self, rec: TransferRecord, outcome: str) -> None:
        self.kv_transfers.labels(*self._lv, rec.op, outcome).inc()
        self.kv_transfer_ms.labels(*self._lv, rec.op).observe(rec.emulated_ms)
        self.kv_transfer_bytes.inc(rec.emulated_bytes)
        if rec.real_bottleneck:
            self.kv_real_bottleneck.inc()

    def on_transfer_failed(self, op: str) -> None:
        self.kv_transfers.labels(*self._lv, op, "failed").inc()

    def exposition(self) -> bytes:
        return generate_latest(self.registry)

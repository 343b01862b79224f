"""How the benchmark clients behind ``silicon_sample.csv`` ran, as far as a replay needs it.

A measured serving run's mean TTFT depends on the client as much as on the server: how many requests,
whether a warm-up ran first, and whether prompts repeat (with vLLM's prefix caching, on by default in
v1, a repeated prompt that is still cached is prefilled in one block). ``BenchmarkProtocol`` says this
per harness; ``cluster.validation`` builds each row's ``ClosedLoop`` from it and averages the replayed
means over its ``seeds``.

The harnesses (``PROTOCOLS``, keyed by ``SiliconRow.harness``):

- ``aiconfigurator``: the Llama-3.1-70B rows, measured 2025-10-29 (``silicon_data_source``). They match
  aiconfigurator's evaluation runner of that time (github.com/ai-dynamo/aiconfigurator at 4361371a,
  2025-10-14, ``src/aiconfigurator/eval/benchmarks/genai_perf_runner.py``; removed in c0c44d91):
  ``aiperf profile --concurrency C --request-count 10C --warmup-request-count 2C --num-dataset-entries
  12C`` with exact lengths (stddev 0, ``ignore_eos``), streaming, no ``--random-seed``. aiperf (its
  ``DatasetManager`` at db4f6397, Oct 2025) draws every request's prompt with ``random.choice`` from the
  12C synthetic entries, so about 43% of the measured requests repeat a prompt sent before; the server
  (no flag against it) kept vLLM's default prefix caching. The vLLM of that date (0.11.0, 2025-10-02)
  scheduled synchronously unless ``--async-scheduling`` was given (on by default from later releases;
  vLLM's recipes still called it opt-in in Dec 2025), so these rows replay without it. Evidence in the
  rows, 70B fp8 on H200, C 8 and 16 (24 rows, TTFT median |error|): distinct prompts and no cache, 47%
  (the prefill convoy: clients that finish together come back together); this protocol, 24% (seeds 1-3);
  the later aiperf default (100 entries for 20C requests, the 2026 ``bench_run.sh.j2``) predicts the C 64
  rows 63% fast: the 2026 script did not make these rows.
- ``vllm-0.12-gap-analysis``: the vLLM 0.12.0 rows (another harness, Jan 2026, Dynamo 0.8.0 images),
  whose client the table does not give: replayed with distinct prompts, no prefix caching, the 2026
  script's 20 rounds, until the loop's steady state (no warm-up: without a cache it changes nothing).
  Their ``source_file`` is a private project (``aic-auto-gap-analysis``); aiconfigurator's public runners of
  that time were the 2025 eval runner above (still in the tree on 2026-02-15, 96c5c0a9) and, from
  2026-02-11 on, ``bench_run.sh.j2`` (50C requests, seed 100, 100 entries). Replayed as the eval runner
  (10C/2C/12C, cache, synchronous), or with distinct prompts and synchronous scheduling (vLLM 0.12's
  default), no group gets better on both TTFT and TPOT (median |error| %, TTFT / TPOT, this protocol ->
  eval runner -> synchronous: Qwen3-235B-FP8 H200 31.0/47.7 -> 29.9/48.7 -> 28.5/45.6; Qwen3-32B H100
  17.8/14.6 -> 28.1/20.4 -> 28.4/10.5; 8B-FP8 H200 44.5/75.7 -> 43.1/24.4 -> 35.4/85.0), so it stays as it was.

The client's own work (``actors.engine.client_workers``, ``BenchmarkProtocol.client``): aiperf's workers
serialize and re-parse every streamed chunk of a finished request before its credit goes back (13 us per
output token, measured with aiperf's own code), and hand credits round-robin to min(C, 32) processes. Replayed
literally on the 70B rows it makes the 1024-in / 8192-out rows far slower (H100 TP2 C16/C32: +80/+64% ->
+222/+232%; C4 +17 -> +10%): with a 110 ms turnaround every pair of a convoy finishes before the first one
comes back, so nothing spreads it. The measured runs were not that slow, so it is not enabled here; what
spreads the real runs' arrivals is not found (see the README).

A replay cannot reproduce the measured run's own draws (aiperf was not seeded), so each row is replayed
with several seeds and the means averaged; the measured figure is one draw, and its sampling noise is part
of each row's error (70B fp8 H200 C 8, seeds 1-3: predicted TTFT spreads up to 17% on one row).
"""

from __future__ import annotations

import statistics
from collections import defaultdict
from dataclasses import dataclass

from actors.engine.client_workers import ClientWorkers
from actors.engine.virtual import ClosedLoop, RequestRecord

BURST_GAP_MS = 1.0
"""Spacing of the opening burst's arrivals at the engine. aiperf's C clients send at once, but vLLM's API
server parses, tokenizes and forwards them one after another, so an idle engine core starts its first step
with the first request alone. With exact lengths that first step decides which requests stay in lockstep
for the whole run (all arriving at one instant, 1024-token prompts with a 2528-token budget are prefilled
in pairs forever: 70B fp8 H200 TP1 C4 TTFT 360 ms against 203 measured; spaced, 266 ms). Any gap from
0.2 to 5 ms gives the same figures within 1 ms on the 70B rows: the order matters, not the value."""
CLIENT_TURNAROUND_MS = 1.0
"""The last token's way to the client (engine core -> API server -> SSE) and the next request's way in (HTTP,
chat template, tokenization, -> engine core): at least a millisecond, less than a decode step (8-50 ms on
the replayed rows). What matters is that it is above 0 (``ClosedLoop.turnaround_ms``)."""
STEADY_TOLERANCE = 0.01
"""Two consecutive rounds whose mean TTFT and TPOT differ by less than this are the steady state."""


@dataclass(frozen=True)
class BenchmarkProtocol:
    """One harness's client (module docstring). Counts are per client (x the concurrency C)."""

    name: str
    rounds: int
    """Measured requests = ``rounds`` x C (aiperf ``--request-count``)."""
    warmup_rounds: int
    """Warm-up requests = ``warmup_rounds`` x C, run to completion first, not measured."""
    dataset_rounds: int
    """Distinct prompts = ``dataset_rounds`` x C, each request drawing one at random (aiperf
    ``--num-dataset-entries``); 0: every request has its own prompt."""
    prefix_caching: bool
    """The server's prefix caching (vLLM's ``enable_prefix_caching``)."""
    async_scheduling: bool
    """The server's async scheduling (``--async-scheduling``: opt-in in vLLM 0.11, on by default in 0.19)."""
    seeds: tuple[int, ...]
    """Seeds of the prompt draws replayed; the figures are the mean over them (one is enough without draws)."""
    steady_state: bool
    """Stop a replay at the loop's steady state (``SteadyState``) and fill the rounds not simulated with the
    last one: only valid when nothing drifts from round to round, so never with drawn prompts."""
    burst_gap_ms: float = BURST_GAP_MS
    """Spacing of the measured phase's opening burst at the engine."""
    turnaround_ms: float = CLIENT_TURNAROUND_MS
    """From a request's last token to its client's next request at the engine (``ClosedLoop``)."""
    client: ClientWorkers | None = None
    """The client's worker processes and their work per finished request (``ClosedLoop.client``)."""

    def __post_init__(self) -> None:
        if self.rounds < 1 or self.warmup_rounds < 0 or self.dataset_rounds < 0 or not self.seeds:
            raise ValueError(f"protocol {self.name}: rounds >= 1, warm-up and dataset rounds >= 0, a seed")
        if self.steady_state and self.dataset_rounds:
            raise ValueError(f"protocol {self.name}: drawn prompts drift from round to round: no steady state")

    def load(self, concurrency: int, input_len: int, output_len: int, seed: int,
             rounds: int | None = None) -> ClosedLoop:
        """The client load of one replay (``rounds`` overrides the protocol's measured rounds)."""
        return ClosedLoop(concurrency, (rounds or self.rounds) * concurrency, input_len, output_len,
                          self.burst_gap_ms, self.turnaround_ms, warmup_requests=self.warmup_rounds * concurrency,
                          prompt_pool=self.dataset_rounds * concurrency, pool_seed=seed, client=self.client)


AIC_EVAL_2025 = BenchmarkProtocol("aiconfigurator-eval-2025 (aiperf, 10C requests, 2C warm-up, 12C prompts)",
                                  rounds=10, warmup_rounds=2, dataset_rounds=12, prefix_caching=True,
                                  async_scheduling=False, seeds=(1, 2, 3), steady_state=False)
DISTINCT_PROMPTS = BenchmarkProtocol("distinct prompts, no prefix caching, 20C requests (to the steady state)",
                                     rounds=20, warmup_rounds=0, dataset_rounds=0, prefix_caching=False,
                                     async_scheduling=True, seeds=(0,), steady_state=True)
PROTOCOLS: dict[str, BenchmarkProtocol] = {
    "aiconfigurator": AIC_EVAL_2025,
    "vllm-0.12-gap-analysis": DISTINCT_PROMPTS,
}
"""``SiliconRow.harness`` -> how its client ran (module docstring)."""


def aiperf_mean(values: list[float], concurrency: int, rounds: int) -> float:
    """Mean over aiperf's ``rounds`` x C requests from the simulated complete rounds.

    ``values`` are per request in send order: round k is ``values[k C : (k + 1) C]``, round 0 the burst.
    A trailing incomplete round is ignored; rounds not simulated take the last complete round's mean.
    """
    complete = max(1, len(values) // concurrency)
    means = [statistics.fmean(values[k * concurrency:(k + 1) * concurrency]) for k in range(complete)][:rounds]
    return (sum(means) + (rounds - len(means)) * means[-1]) / rounds


class SteadyState:
    """``VirtualDriver.run``'s ``enough``: True once two consecutive complete rounds after the burst have
    mean TTFT and TPOT within ``tolerance`` of each other.

    Incremental: each call reads only the records finished since the last one (the driver appends them
    in finish order), so a run of n requests costs O(n) here.
    """

    def __init__(self, concurrency: int, tolerance: float = STEADY_TOLERANCE) -> None:
        self.concurrency = concurrency
        self.tolerance = tolerance
        self._seen = 0
        self._count: dict[int, int] = defaultdict(int)
        self._sums: dict[int, list[float]] = defaultdict(lambda: [0.0, 0.0])
        self._complete: list[tuple[float, float]] = []
        """(mean TTFT, mean TPOT) of rounds 0, 1, ... while each is complete, in order."""

    def __call__(self, records: list[RequestRecord]) -> bool:
        for r in records[self._seen:]:
            k = r.index // self.concurrency
            self._count[k] += 1
            sums = self._sums[k]
            sums[0] += r.ttft_ms
            sums[1] += r.tpot_ms
        self._seen = len(records)
        while self._count.get(len(self._complete), 0) == self.concurrency:
            ttft, tpot = self._sums[len(self._complete)]
            self._complete.append((ttft / self.concurrency, tpot / self.concurrency))
        if len(self._complete) < 3:  # the burst and two rounds after it
            return False
        (t0, p0), (t1, p1) = self._complete[-2], self._complete[-1]
        return abs(t1 - t0) <= self.tolerance * t0 and abs(p1 - p0) <= self.tolerance * max(p0, 1e-9)

"""A benchmark client's worker processes, as the virtual driver replays them (aiperf's, Oct 2025).

aiperf (github.com/ai-dynamo/aiperf at db4f6397, 2025-10-10, the version the 2025-10-29 rows were measured
with) does not run one client per concurrency slot. Its timing manager holds a semaphore of C credits and
pushes each credit over a ZMQ PUSH socket, which hands messages round-robin to ``min(C, 0.75 x CPUs - 1,
32)`` worker processes (``WorkerManager``; 32 on any GPU server with 44 or more CPUs). A worker runs one
asyncio loop for all its requests. When a request's stream ends (``Worker._process_credit_drop_internal``)
the worker, on that loop and before it returns the credit, serializes the whole record with every SSE chunk
(``InferenceResultsMessage.model_dump_json``) and parses every chunk's JSON again
(``OpenAIResponseExtractor.extract_response_data``): CPU work proportional to the output length. Only then
does the credit go back, the timing manager release the semaphore and push the next credit to the next
worker in turn, which sends the next request when its own loop is free.

So three things follow, each kept here:

- a client's turnaround grows with the output length (``post_ms``): ~14 ms at 1024 output tokens, ~110 ms
  at 8192, about a decode step and five of them on the replayed rows;
- the next request goes to another worker (credit ``n`` to worker ``n mod workers``), which may itself be
  busy post-processing: its send waits until that worker's loop is free (``pickup_ms``);
- a chunk that reaches a busy worker is read, and timestamped, only when the loop is free (``seen_ms``):
  a first token that arrives while its worker post-processes another request counts late in TTFT.

Requests that finish on the same step (two prompts prefilled together run in lockstep to the end) therefore
come back at different times, as the measured runs' TTFTs say they did, instead of queuing behind each
other's prefill round after round.

Invariants: a worker's busy periods never overlap (one loop); a busy period is registered when it starts
or earlier, never after (the driver registers post-processing at the finish it follows, in time order), so
``seen_ms`` and ``pickup_ms`` asked at time t know every busy period that covers t.
"""

from __future__ import annotations

from dataclasses import dataclass

AIPERF_MAX_WORKERS = 32
"""aiperf's ``DEFAULT_MAX_WORKERS_CAP`` (``min(concurrency, 0.75 x CPUs - 1)`` below it)."""
AIPERF_POST_BASE_MS = 0.4
AIPERF_POST_MS_PER_TOKEN = 0.0133
"""CPU time of aiperf's post-processing of one finished streaming chat request (serialize the record, parse
every chunk), measured by running aiperf's own code at db4f6397 (``InferenceResultsMessage.model_dump_json``
+ ``OpenAIResponseExtractor.extract_response_data``) on records of vLLM 0.11-shaped chat chunks, minimum
CPU time of 5 runs on this project's AMD EPYC host: 2.13 / 13.35 / 27.1 / 111.0 ms for 128 / 1024 / 2048 /
8192 output tokens (13.0-13.6 us per token from 1024 on). The measured runs' host CPU is not known."""


@dataclass(frozen=True)
class ClientWorkers:
    """How many worker processes a benchmark client runs and what a finished request costs one of them."""

    max_workers: int = AIPERF_MAX_WORKERS
    post_base_ms: float = AIPERF_POST_BASE_MS
    post_ms_per_token: float = AIPERF_POST_MS_PER_TOKEN

    def __post_init__(self) -> None:
        if self.max_workers < 1 or self.post_base_ms < 0 or self.post_ms_per_token < 0:
            raise ValueError("client workers: max_workers >= 1, post-processing costs >= 0")

    def post_ms(self, output_tokens: int) -> float:
        """A worker's blocking work after a request's last chunk (module docstring)."""
        return self.post_base_ms + self.post_ms_per_token * output_tokens

    def pool(self, concurrency: int) -> WorkerPool:
        return WorkerPool(self, min(concurrency, self.max_workers))


class WorkerPool:
    """The workers of one run: which worker holds each credit, and when each worker's loop is busy.

    Each worker keeps only its latest busy run ``[start, end)`` (back-to-back periods merge): a query at
    time t is never older than the last period registered (module docstring's invariant).
    """

    def __init__(self, spec: ClientWorkers, workers: int) -> None:
        self.spec = spec
        self.workers = workers
        self._start = [0.0] * workers
        self._end = [0.0] * workers

    def worker_of(self, credit: int) -> int:
        """ZMQ PUSH's round-robin: credit ``n`` (0-based in send order, warm-up included) to worker n mod W."""
        return credit % self.workers

    def seen_ms(self, worker: int, at_ms: float) -> float:
        """When ``worker`` reads a chunk that reached it at ``at_ms``: at once, or when its loop is free."""
        return self._end[worker] if self._start[worker] < at_ms < self._end[worker] else at_ms

    def pickup_ms(self, worker: int, at_ms: float) -> float:
        """When ``worker`` sends the request of a credit pushed to it at ``at_ms``."""
        return self._end[worker] if self._start[worker] <= at_ms < self._end[worker] else at_ms

    def post(self, worker: int, last_seen_ms: float, output_tokens: int) -> float:
        """Post-process a request whose last chunk the worker read at ``last_seen_ms``; returns when its credit
        is back (the end of the work, after any earlier work queued on the same loop)."""
        start = max(last_seen_ms, self._end[worker])
        end = start + self.spec.post_ms(output_tokens)
        if start > self._end[worker]:
            self._start[worker] = start
        self._end[worker] = end
        return end

"""The cost model: how long one engine step takes on the emulated hardware.

Roofline form, per step over a mixed batch (prefill chunks with their context, decode sequences with
theirs)::

    step = max(compute, memory) + all-reduce + overhead
    compute   = (2 x active params x tokens + attention FLOPs) / (TP x peak x eff_compute)
    memory    = (weights read + KV read + KV written) / (TP x HBM bandwidth x eff_memory)
    all-reduce = 2 per layer of tokens x hidden x 2 bytes, ring over TP GPUs on the node link
    overhead  = layers x (per-layer overhead + per-sequence overhead x sequences)

MoE models count active parameters for compute and the expected distinct experts a step touches for
weight reads. KV bytes per token follow the architecture (GQA or MLA). The free parameters (the
hardware profile's ``efficiency``) are fitted on measured step times by ``actors.calibration``.

An ``EmpiricalCostModel`` takes fixed rates instead (the lessons card's ``lesson-70b-fp8``); the card's
closed forms for one request are ``ms_colocated`` and ``ms_disaggregated``.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Protocol

from config.hardware import Efficiency, HardwareProfile
from config.link import LinkProfile
from config.model import ModelProfile
from config.profile import EmpiricalProfile

ACTIVATION_BYTES = 2  # all-reduce payloads are bf16 activations


@dataclass(frozen=True, slots=True)
class StepShape:
    """Aggregates of one step's batch, all the cost model needs.

    ``prefill_pairs`` counts (query, key) pairs of the prefill chunks: a chunk of ``n`` tokens after ``c``
    cached ones attends ``n x c + n (n + 1) / 2`` pairs (causal). ``kv_read_tokens`` is the cached KV the
    step reads: every decode's context plus every chunk's prior context.
    """

    prefill_tokens: int = 0
    prefill_seqs: int = 0
    prefill_pairs: float = 0.0
    decode_seqs: int = 0
    decode_context: int = 0
    kv_read_tokens: int = 0

    @staticmethod
    def of(prefills: Iterable[tuple[int, int]] = (), decodes: Iterable[int] = ()) -> StepShape:
        """``prefills``: (new tokens, tokens already cached) per chunk; ``decodes``: context length per seq."""
        pt = ps = 0
        pairs = 0.0
        kv_read = 0
        for n, c in prefills:
            pt += n
            ps += 1
            pairs += n * c + n * (n + 1) / 2.0
            kv_read += c
        dc = list(decodes)
        dctx = sum(dc)
        return StepShape(pt, ps, pairs, len(dc), dctx, kv_read + dctx)

    @property
    def tokens(self) -> int:
        return self.prefill_tokens + self.decode_seqs

    @property
    def seqs(self) -> int:
        return self.prefill_seqs + self.decode_seqs

    @property
    def empty(self) -> bool:
        return self.tokens == 0


@dataclass(frozen=True, slots=True)
class StepTime:
    """One step's predicted duration (emulated ms) and its parts."""

    total_ms: float
    compute_ms: float = 0.0
    memory_ms: float = 0.0
    comm_ms: float = 0.0
    overhead_ms: float = 0.0

    @property
    def bound(self) -> str:
        return "compute" if self.compute_ms >= self.memory_ms else "memory"


class CostModel(Protocol):
    """What an engine needs from a cost model."""

    name: str
    kv_bytes_per_token: int
    max_context: int

    def step(self, shape: StepShape) -> StepTime: ...


class RooflineCostModel:
    """Roofline step time for ``model`` on ``tp`` GPUs of ``hardware`` (see the module docstring).

    Invariants: a step's time never decreases when tokens, sequences or contexts grow; an empty step
    takes zero time.
    """

    def __init__(self, hardware: HardwareProfile, model: ModelProfile, tp: int = 1,
                 efficiency: Efficiency | None = None) -> None:
        if tp < 1:
            raise ValueError("tp must be at least 1")
        self.hardware = hardware
        self.model = model
        self.tp = tp
        self.name = f"{model.name}@{hardware.name}xTP{tp}"
        self.kv_bytes_per_token = model.kv_bytes_per_token
        self.max_context = model.max_context
        eff = efficiency or hardware.efficiency
        self.eff = eff
        # Rates per emulated millisecond for the whole TP group.
        self._flops_per_ms = tp * hardware.tflops(model.gemm_dtype) * 1e12 * eff.compute / 1e3
        self._bytes_per_ms = tp * hardware.hbm_bandwidth_gbps * 1e9 * eff.memory / 1e3
        self._flops_per_token = 2.0 * model.active_params_b * 1e9
        self._attn_flops_per_pair = model.attention_flops_per_token_per_context
        self._dense_weight_bytes = model.dense_weight_bytes
        self._link_bytes_per_ms = hardware.intra_node_link_gbps * 1e9 * eff.link / 1e3
        self._link_large_bytes_per_ms = hardware.intra_node_link_gbps * 1e9 * eff.link_large / 1e3
        self._knee_tokens = eff.knee_tokens
        self._layer_overhead_ms = eff.layer_overhead_us * model.num_layers / 1e3
        self._seq_overhead_ms = eff.seq_layer_overhead_us * model.num_layers / 1e3
        self._allreduce_calls = 2 * model.num_layers
        self._allreduce_bytes_per_token = model.hidden_size * ACTIVATION_BYTES

    def allreduce_ms(self, tokens: int) -> float:
        """Ring all-reduce of every layer's activations over the TP group: 2 (tp-1) hops per call.

        Tokens beyond the hardware's ``knee_tokens`` move at the lower ``link_large`` efficiency.
        """
        if self.tp == 1 or tokens == 0:
            return 0.0
        small = min(tokens, self._knee_tokens)
        large = tokens - small
        ring = 2.0 * (self.tp - 1) / self.tp * self._allreduce_bytes_per_token
        per_call = (ring * (small / self._link_bytes_per_ms + large / self._link_large_bytes_per_ms)
                    + 2 * (self.tp - 1) * self.eff.allreduce_latency_us / 1e3)
        return self._allreduce_calls * per_call

    def step(self, shape: StepShape) -> StepTime:
        tokens = shape.tokens
        if tokens == 0:
            return StepTime(0.0)
        flops = self._flops_per_token * tokens + self._attn_flops_per_pair * (
            shape.prefill_pairs + shape.decode_context)
        compute = flops / self._flops_per_ms
        weight_bytes = self._dense_weight_bytes + self.model.expert_weight_bytes_read(tokens)
        kv_bytes = self.kv_bytes_per_token * (shape.kv_read_tokens + tokens)
        memory = (weight_bytes + kv_bytes) / self._bytes_per_ms
        comm = self.allreduce_ms(tokens)
        overhead = self._layer_overhead_ms + self._seq_overhead_ms * shape.seqs
        return StepTime(max(compute, memory) + comm + overhead, compute, memory, comm, overhead)


class EmpiricalCostModel:
    """Fixed rates: prefill ``n`` tokens in ``n / prefill rate``; one decode step in ``1 / decode rate``.

    ``role`` picks the decode rate: a decode-only GPU decodes faster than a colocated one (no prefill
    interference), as the lessons card assumes. A step that holds both prefill and decode work pays both.
    """

    def __init__(self, profile: EmpiricalProfile, role: str = "colocated") -> None:
        self.profile = profile
        self.name = f"{profile.name}[{role}]"
        self.kv_bytes_per_token = profile.kv_bytes_per_token
        self.max_context = profile.max_context
        rate = profile.decode_tokens_per_ms_decode if role == "decode" else profile.decode_tokens_per_ms_colocated
        self._decode_step_ms = 1.0 / rate
        self._prefill_ms_per_token = 1.0 / profile.prefill_tokens_per_ms

    def step(self, shape: StepShape) -> StepTime:
        prefill = shape.prefill_tokens * self._prefill_ms_per_token
        decode = self._decode_step_ms if shape.decode_seqs else 0.0
        return StepTime(prefill + decode, compute_ms=prefill, memory_ms=decode)


# -- the lessons card's closed forms -------------------------------------------------------------------
def ms_colocated(profile: EmpiricalProfile, prompt: int, output: int) -> float:
    """``prompt / PREFILL_TOK_PER_MS + output / DECODE_TOK_PER_MS_COLOCATED``."""
    return prompt / profile.prefill_tokens_per_ms + output / profile.decode_tokens_per_ms_colocated


def ms_disaggregated(profile: EmpiricalProfile, prompt: int, output: int, link: LinkProfile) -> float:
    """Prefill, then the transfer tax for the prompt's KV, then decode on the faster decode pool."""
    prefill_ms = prompt / profile.prefill_tokens_per_ms
    transfer_ms = link.transfer_ms(prompt * profile.kv_bytes_per_token)
    decode_ms = output / profile.decode_tokens_per_ms_decode
    return prefill_ms + transfer_ms + decode_ms


# -- one isolated request through an engine's step loop --------------------------------------------------
@dataclass(frozen=True)
class RequestTimes:
    ttft_ms: float
    tpot_ms: float
    e2e_ms: float
    prefill_ms: float
    transfer_ms: float
    decode_ms: float


def prefill_ms(cost: CostModel, prompt: int, chunk: int, cached: int = 0) -> float:
    """Prefill of ``prompt`` tokens (``cached`` of them already in the KV cache) in chunks of ``chunk``."""
    done = cached
    total = 0.0
    while done < prompt:
        n = min(chunk, prompt - done)
        total += cost.step(StepShape.of(prefills=[(n, done)])).total_ms
        done += n
    return total


def decode_ms(cost: CostModel, prompt: int, steps: int) -> float:
    """``steps`` decode steps of one sequence whose context starts at ``prompt + 1`` tokens."""
    return sum(cost.step(StepShape.of(decodes=[prompt + i])).total_ms for i in range(1, steps + 1))


def request_colocated(cost: CostModel, prompt: int, output: int, chunk: int) -> RequestTimes:
    """An isolated request on one engine, as its step loop runs it: the last prefill chunk emits token 1."""
    p = prefill_ms(cost, prompt, chunk)
    d = decode_ms(cost, prompt, output - 1)
    return RequestTimes(p, d / max(1, output - 1), p + d, p, 0.0, d)


def request_disaggregated(prefill_cost: CostModel, decode_cost: CostModel, link: LinkProfile, prompt: int,
                          output: int, chunk: int, handoff: str = "pull") -> RequestTimes:
    """Prefill engine emits token 1, the prompt's KV crosses ``link`` (one link per engine), the decode
    engine makes the rest.

    ``pull``: the transfer starts when the prefill is done. ``push``: each chunk's KV leaves as soon as the
    chunk is computed, overlapping the next chunk's compute; the decode can start when the last chunk's
    KV has landed. ``transfer_ms`` is the transfer time the request waits for after its prefill.
    """
    kv = prefill_cost.kv_bytes_per_token
    done = 0
    compute_end = 0.0
    wire_free = 0.0
    steps: list[tuple[int, float]] = []
    while done < prompt:
        n = min(chunk, prompt - done)
        compute_end += prefill_cost.step(StepShape.of(prefills=[(n, done)])).total_ms
        steps.append((n, compute_end))
        done += n
    p = compute_end
    if handoff == "push":
        for n, end in steps:
            wire_free = max(wire_free, end) + link.transfer_ms(n * kv)
        t = max(0.0, wire_free - p)
    else:
        t = link.transfer_ms(prompt * kv)
    d = decode_ms(decode_cost, prompt, output - 1)
    return RequestTimes(p, (t + d) / max(1, output - 1), p + t + d, p, t, d)


def crossover(diff: Callable[[int], float], lo: int = 1, hi: int = 1 << 24) -> int | None:
    """Smallest prompt length in [lo, hi] where ``diff`` changes sign from its value at ``lo``; None if never.

    ``diff(p)`` is disaggregated minus colocated time. Scans powers of two, then bisects on integers.
    """
    sign0 = diff(lo) < 0
    prev = lo
    p = lo
    while p < hi:
        p = min(hi, p * 2)
        if (diff(p) < 0) != sign0:
            a, b = prev, p
            while b - a > 1:
                m = (a + b) // 2
                if (diff(m) < 0) == sign0:
                    a = m
                else:
                    b = m
            return b
        prev = p
    return None

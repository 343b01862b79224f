"""Closed-form estimate of one isolated request: colocated against disaggregated over RDMA and TCP."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any

from actors.cost_model import (
    CostModel,
    RequestTimes,
    RooflineCostModel,
    crossover,
    ms_colocated,
    ms_disaggregated,
    request_colocated,
    request_disaggregated,
)
from config.catalog import Catalog
from config.link import LinkProfile

DEFAULT_CHUNK = 8192
DEFAULT_RDMA = "rdma-ib-ndr400"
DEFAULT_TCP = "tcp-25g"


@dataclass(frozen=True)
class Estimate:
    name: str
    prompt: int
    output: int
    kv_bytes: float
    rdma_link: str
    tcp_link: str
    colocated: RequestTimes
    rdma: RequestTimes
    tcp: RequestTimes
    crossover_rdma: int | None
    crossover_tcp: int | None
    disagg_wins_short: bool
    """Disaggregation wins below the crossover (True) or above it (False)."""

    def to_json(self) -> dict[str, Any]:
        return {
            "profile": self.name,
            "prompt_tokens": self.prompt,
            "output_tokens": self.output,
            "colocated_ms": round(self.colocated.e2e_ms, 3),
            "disaggregated_rdma_ms": round(self.rdma.e2e_ms, 3),
            "disaggregated_tcp_ms": round(self.tcp.e2e_ms, 3),
            "ttft_ms": round(self.colocated.ttft_ms, 3),
            "tpot_ms": round(self.colocated.tpot_ms, 3),
            "crossover_prompt_tokens": self.crossover_rdma,
            "crossover_prompt_tokens_tcp": self.crossover_tcp,
            "disaggregation_wins_below_crossover": self.disagg_wins_short,
            "kv_bytes": self.kv_bytes,
            "links": {"rdma": self.rdma_link, "tcp": self.tcp_link},
            "modes": {
                "colocated": _rounded(self.colocated),
                "disaggregated_rdma": _rounded(self.rdma),
                "disaggregated_tcp": _rounded(self.tcp),
            },
        }


def _rounded(t: RequestTimes) -> dict[str, float]:
    return {k: round(v, 3) for k, v in asdict(t).items()}


def estimate_profile(cat: Catalog, name: str, prompt: int, output: int) -> Estimate:
    """The lessons card's closed forms on an empirical profile."""
    prof = cat.profiles.get(name)
    rdma, tcp = cat.links.get(prof.rdma_link), cat.links.get(prof.tcp_link)
    prefill = prompt / prof.prefill_tokens_per_ms

    def times(link: LinkProfile | None) -> RequestTimes:
        if link is None:
            e2e = ms_colocated(prof, prompt, output)
            return RequestTimes(prefill, 1.0 / prof.decode_tokens_per_ms_colocated, e2e, prefill, 0.0, e2e - prefill)
        e2e = ms_disaggregated(prof, prompt, output, link)
        transfer = link.transfer_ms(prompt * prof.kv_bytes_per_token)
        return RequestTimes(prefill, 1.0 / prof.decode_tokens_per_ms_decode, e2e, prefill, transfer,
                            e2e - prefill - transfer)

    def diff(link: LinkProfile) -> Callable[[int], float]:
        return lambda p: ms_disaggregated(prof, p, output, link) - ms_colocated(prof, p, output)

    return Estimate(name, prompt, output, float(prompt * prof.kv_bytes_per_token), rdma.name, tcp.name,
                    times(None), times(rdma), times(tcp), crossover(diff(rdma)), crossover(diff(tcp)),
                    diff(rdma)(1) < 0)


def estimate_roofline(cat: Catalog, model: str, hardware: str, tp: int, prompt: int, output: int, *,
                      decode_hardware: str | None = None, chunk: int = DEFAULT_CHUNK,
                      rdma_link: str = DEFAULT_RDMA, tcp_link: str = DEFAULT_TCP, handoff: str = "pull") -> Estimate:
    """The same questions answered by the roofline cost model, as an engine's step loop would run them.

    Colocated: chunked prefill then ``output - 1`` decode steps on one engine. Disaggregated: prefill on
    ``hardware``, the KV over the link (one link per engine; ``push`` overlaps it with later chunks),
    decode on ``decode_hardware``.
    """
    m = cat.models.get(model)
    pre: CostModel = RooflineCostModel(cat.hardware.get(hardware), m, tp)
    dec: CostModel = RooflineCostModel(cat.hardware.get(decode_hardware or hardware), m, tp)
    rdma, tcp = cat.links.get(rdma_link), cat.links.get(tcp_link)

    def diff(link: LinkProfile) -> Callable[[int], float]:
        def f(p: int) -> float:
            c = request_colocated(pre, p, output, chunk).e2e_ms
            return request_disaggregated(pre, dec, link, p, output, chunk, handoff).e2e_ms - c
        return f

    hi = m.max_context
    name = f"{model} on {hardware} TP{tp}" + (f" (decode on {decode_hardware})" if decode_hardware else "")
    return Estimate(
        name, prompt, output, float(prompt * m.kv_bytes_per_token), rdma.name, tcp.name,
        request_colocated(pre, prompt, output, chunk),
        request_disaggregated(pre, dec, rdma, prompt, output, chunk, handoff),
        request_disaggregated(pre, dec, tcp, prompt, output, chunk, handoff),
        crossover(diff(rdma), 16, hi), crossover(diff(tcp), 16, hi), diff(rdma)(16) < 0,
    )

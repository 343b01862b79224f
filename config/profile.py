"""Empirical profile: a model-on-hardware described by measured rates instead of an architecture."""

from __future__ import annotations

from pydantic import Field

from config.base import Frozen, Name, PositiveFloat, PositiveInt


class EmpiricalProfile(Frozen):
    """Rates per GPU, as in the lessons card (``lesson-70b-fp8``).

    A prefill step over ``n`` tokens takes ``n / prefill_tokens_per_ms``; a decode step takes
    ``1 / decode_tokens_per_ms`` (colocated, where prefills interfere) or ``1 / decode_tokens_per_ms_decode``
    (on a decode-only GPU), whatever the batch size up to ``max_decode_batch``.
    """

    name: Name
    source: str = Field(min_length=1)
    prefill_tokens_per_ms: PositiveFloat
    decode_tokens_per_ms_colocated: PositiveFloat
    decode_tokens_per_ms_decode: PositiveFloat
    kv_bytes_per_token: PositiveInt
    block_tokens: PositiveInt = 16
    rdma_link: Name
    tcp_link: Name
    max_context: PositiveInt = 131072
    kv_capacity_tokens: PositiveInt = 400_000
    """KV tokens one GPU holds (sets the engine's block count)."""

"""Model profile: the architecture figures the cost model and the KV cache need."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from config.base import Frozen, Name, PositiveFloat, PositiveInt
from config.dtypes import DType, dtype_bytes


class MoESpec(Frozen):
    """Routed experts. ``routed_params_b`` is the parameter count of all routed experts of all layers."""

    num_experts: PositiveInt
    experts_per_token: PositiveInt
    routed_params_b: PositiveFloat
    moe_layers: PositiveInt

    @model_validator(mode="after")
    def _top_k_fits(self) -> MoESpec:
        if self.experts_per_token > self.num_experts:
            raise ValueError(
                f"experts_per_token ({self.experts_per_token}) exceeds num_experts ({self.num_experts})"
            )
        return self


class MLASpec(Frozen):
    """Multi-head latent attention (DeepSeek-V2/V3): the cache holds one compressed latent per token."""

    kv_lora_rank: PositiveInt
    qk_rope_head_dim: PositiveInt


class ModelProfile(Frozen):
    """A transformer as the cost model sees it.

    Derived: weight bytes, active parameters (MoE), KV bytes per token
    (``2 x layers x kv_heads x head_dim x kv_dtype_bytes``, or ``layers x (latent + rope) x bytes`` for MLA).
    """

    name: Name
    source: str = Field(min_length=1)
    num_layers: PositiveInt
    hidden_size: PositiveInt
    num_heads: PositiveInt
    num_kv_heads: PositiveInt
    head_dim: PositiveInt
    vocab_size: PositiveInt
    params_b: PositiveFloat
    """Total parameters, billions."""
    max_context: PositiveInt
    weight_dtype: DType = "bf16"
    kv_dtype: DType = "bf16"
    compute_dtype: DType | None = None
    """Operand type of the GEMMs; defaults to the weight type (fp8 weights run fp8 GEMMs)."""
    attention: Literal["gqa", "mla"] = "gqa"
    mla: MLASpec | None = None
    moe: MoESpec | None = None

    @model_validator(mode="after")
    def _consistent(self) -> ModelProfile:
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"num_kv_heads ({self.num_kv_heads}) must divide num_heads ({self.num_heads})"
            )
        if (self.attention == "mla") != (self.mla is not None):
            raise ValueError("attention 'mla' needs an 'mla' section, and only it may have one")
        if self.moe is not None:
            if self.moe.routed_params_b >= self.params_b:
                raise ValueError("moe.routed_params_b must be smaller than params_b")
            if self.moe.moe_layers > self.num_layers:
                raise ValueError("moe.moe_layers exceeds num_layers")
        return self

    # -- derived figures ---------------------------------------------------------------------------
    @property
    def gemm_dtype(self) -> str:
        return self.compute_dtype or self.weight_dtype

    @property
    def active_params_b(self) -> float:
        """Parameters that touch one token: all dense ones plus top-k of the routed experts."""
        if self.moe is None:
            return self.params_b
        m = self.moe
        return self.params_b - m.routed_params_b * (1.0 - m.experts_per_token / m.num_experts)

    @property
    def weight_bytes(self) -> float:
        return self.params_b * 1e9 * dtype_bytes(self.weight_dtype)

    @property
    def dense_weight_bytes(self) -> float:
        """Weights every step reads whatever the batch: all but the routed experts."""
        routed = self.moe.routed_params_b if self.moe else 0.0
        return (self.params_b - routed) * 1e9 * dtype_bytes(self.weight_dtype)

    def expert_weight_bytes_read(self, tokens: int) -> float:
        """Routed-expert bytes a step over ``tokens`` tokens reads: the expected experts touched per layer.

        With uniform routing a layer's expert is missed by one token with probability ``1 - k/E``, so
        ``E x (1 - (1 - k/E)^tokens)`` distinct experts are read per MoE layer.
        """
        if self.moe is None or tokens <= 0:
            return 0.0
        m = self.moe
        touched = m.num_experts * (1.0 - (1.0 - m.experts_per_token / m.num_experts) ** tokens)
        per_expert_bytes = m.routed_params_b * 1e9 * dtype_bytes(self.weight_dtype) / m.num_experts
        return touched * per_expert_bytes

    @property
    def kv_bytes_per_token(self) -> int:
        b = dtype_bytes(self.kv_dtype)
        if self.mla is not None:
            return int(self.num_layers * (self.mla.kv_lora_rank + self.mla.qk_rope_head_dim) * b)
        return int(2 * self.num_layers * self.num_kv_heads * self.head_dim * b)

    @property
    def attention_flops_per_token_per_context(self) -> float:
        """FLOPs of attention for one query token against one cached token (QK^T and AV), all layers."""
        if self.mla is not None:
            # Absorbed MLA: scores over (latent + rope) dims, values over the latent, per head.
            per_head = 2 * (2 * self.mla.kv_lora_rank + self.mla.qk_rope_head_dim)
            return float(self.num_layers * self.num_heads * per_head)
        return float(4 * self.num_layers * self.num_heads * self.head_dim)

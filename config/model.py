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
    intermediate_size: PositiveInt | None = None
    """Hidden width of one expert's MLP (``moe_intermediate_size``); derived from ``routed_params_b`` if
    absent (``routed / (moe_layers x experts x 3 x hidden)``)."""
    shared_intermediate_size: int = Field(default=0, ge=0)
    """Width of the always-active shared expert(s) of a MoE layer (DeepSeek), 0 if none."""

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
    intermediate_size: PositiveInt | None = None
    """Hidden width of a dense layer's MLP; derived from ``params_b`` if absent (see ``mlp_width``)."""
    mlp_gated: bool = True
    """SwiGLU (gate and up projections, 3 matrices) or a plain 2-matrix MLP (BLOOM's GELU)."""
    tied_embeddings: bool = False

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

    # -- per-layer shapes (the cost model's GEMMs) ----------------------------------------------------
    @property
    def q_width(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def attention_params_per_layer(self) -> int:
        if self.mla is not None:  # DeepSeek-V3's q/kv down and up projections, approximated by its parameter share
            return int(self.hidden_size * (self.mla.kv_lora_rank + self.mla.qk_rope_head_dim)
                       + self.mla.kv_lora_rank * self.num_heads * 2 * self.head_dim
                       + self.hidden_size * self.q_width * 2)
        kv = 2 * self.num_kv_heads * self.head_dim
        return self.hidden_size * (self.q_width + kv) + self.q_width * self.hidden_size

    @property
    def dense_layers(self) -> int:
        return self.num_layers - (self.moe.moe_layers if self.moe else 0)

    @property
    def mlp_width(self) -> int:
        """A dense layer's MLP width: given, or what the parameter count leaves after attention and embeddings."""
        if self.intermediate_size is not None:
            return self.intermediate_size
        if self.dense_layers == 0:
            return 0
        embed = self.vocab_size * self.hidden_size * (1 if self.tied_embeddings else 2)
        routed = self.moe.routed_params_b * 1e9 if self.moe else 0.0
        mlp_params = (self.params_b * 1e9 - embed - routed) / self.num_layers - self.attention_params_per_layer
        return max(1, int(mlp_params / ((3 if self.mlp_gated else 2) * self.hidden_size)))

    @property
    def expert_width(self) -> int:
        """One routed expert's MLP width."""
        if self.moe is None:
            return 0
        if self.moe.intermediate_size is not None:
            return self.moe.intermediate_size
        return max(1, int(self.moe.routed_params_b * 1e9 / (self.moe.moe_layers * self.moe.num_experts * 3
                                                           * self.hidden_size)))

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

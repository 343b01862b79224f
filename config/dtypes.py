"""Numeric formats the cost model knows, and their sizes."""

from __future__ import annotations

from typing import Literal

DType = Literal["fp32", "tf32", "bf16", "fp16", "fp8", "int8", "fp4", "int4"]

DTYPE_BYTES: dict[str, float] = {
    "fp32": 4.0,
    "tf32": 4.0,
    "bf16": 2.0,
    "fp16": 2.0,
    "fp8": 1.0,
    "int8": 1.0,
    "fp4": 0.5,
    "int4": 0.5,
}


def dtype_bytes(dtype: str) -> float:
    return DTYPE_BYTES[dtype]

"""Shared base for every config object: frozen, strict about unknown keys."""

from __future__ import annotations

from typing import Annotated

from pydantic import BaseModel, ConfigDict, Field

# A name used as a registry key or a reference from another object.
Name = Annotated[str, Field(min_length=1, max_length=128, pattern=r"^[A-Za-z0-9][A-Za-z0-9_.\-]*$")]
PositiveFloat = Annotated[float, Field(gt=0)]
NonNegativeFloat = Annotated[float, Field(ge=0)]
Fraction = Annotated[float, Field(gt=0, le=1)]
PositiveInt = Annotated[int, Field(gt=0)]


class Frozen(BaseModel):
    """Immutable, validated on assignment of every field, unknown keys rejected."""

    model_config = ConfigDict(frozen=True, extra="forbid", strict=False, validate_default=True)

"""A cost model that interpolates a measured step-time table (``config.step_profile``) instead of the roofline.

- A step without prefill tokens is a decode step: the decode grid at (decode sequences, mean context
  per sequence).
- A step with prefill tokens: the prefill grid at (all tokens of the step, mean cached context of its
  chunks, per chunk); decodes riding along count as tokens (their attention over their
  own contexts is not added: the table measured whole steps).

Interpolation is linear on the grid (``scipy.interpolate.RegularGridInterpolator``) and linear
extrapolation beyond it, along each axis that has at least two measured values; an axis measured at
one value only is constant. A result is never below the table's smallest time of that kind times the
fraction of it the step needs (so extrapolating to tiny steps cannot go negative or to zero), and an
empty step takes zero time.
"""

from __future__ import annotations

import numpy as np
from scipy.interpolate import RegularGridInterpolator

from actors.cost_model import StepShape, StepTime
from config.step_profile import Grid, StepProfile


class _Surface:
    """``ms(tokens, context)`` over one kind's grid (see the module docstring)."""

    def __init__(self, grid: Grid) -> None:
        self._axes: list[np.ndarray] = []
        self._use: list[int] = []
        values = np.asarray(grid.ms, dtype=float)
        for i, axis in enumerate((grid.tokens, grid.contexts)):
            if len(axis) >= 2:
                self._axes.append(np.asarray(axis, dtype=float))
                self._use.append(i)
            else:
                values = values.take(0, axis=len(self._use))
        self._const = float(values) if not self._use else None
        self._interp = (RegularGridInterpolator(tuple(self._axes), values, method="linear", bounds_error=False,
                                                fill_value=None) if self._use else None)
        self._floor = float(np.min(grid.ms))
        self._min_tokens = grid.tokens[0]

    def __call__(self, tokens: float, context: float) -> float:
        if self._interp is None:
            assert self._const is not None
            ms = self._const
        else:
            point = [(tokens, context)[i] for i in self._use]
            ms = float(self._interp([point])[0])
        floor = self._floor * min(1.0, tokens / self._min_tokens)
        return max(ms, floor)


class ProfileCostModel:
    """Step times interpolated from a measured table; ``kv_bytes_per_token`` and ``max_context`` come
    from the model the engine serves (the table replaces only the step time)."""

    def __init__(self, profile: StepProfile, *, name: str, kv_bytes_per_token: int, max_context: int) -> None:
        self.profile = profile
        self.name = f"{name}[profile {profile.source}]"
        self.kv_bytes_per_token = kv_bytes_per_token
        self.max_context = max_context
        self._decode = _Surface(profile.decode)
        self._prefill = _Surface(profile.prefill)

    def step(self, shape: StepShape) -> StepTime:
        if shape.empty:
            return StepTime(0.0)
        if shape.prefill_tokens == 0:
            ms = self._decode(shape.decode_seqs, shape.decode_context / shape.decode_seqs)
            return StepTime(ms, memory_ms=ms)
        # kv_read_tokens = every decode's context + every chunk's cached context.
        prefill_context = (shape.kv_read_tokens - shape.decode_context) / max(1, shape.prefill_seqs)
        ms = self._prefill(shape.tokens, prefill_context)
        return StepTime(ms, compute_ms=ms)

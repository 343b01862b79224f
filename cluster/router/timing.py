"""What the router knows of its workers' speed: a prefill block's and a decode step's emulated time.

Policies that price a choice in time (``kv_aware``'s wait behind a busy engine's current step) read
``ClusterView.timing``. ``CostModelTiming`` answers from the roofline cost model of the worker's catalog
model and hardware (the preset the engines' own cost model is built from), cached per
worker type, decode batch size and context bucket so a decision costs dictionary lookups, not cost-model
calls. A worker type the catalog does not know has no timing (``None``): a policy then leaves time out.
"""

from __future__ import annotations

from actors.cost_model import RooflineCostModel, StepShape
from cluster.router.view import WorkerInfo, WorkerTiming

__all__ = ["CostModelTiming", "WorkerTiming"]

CONTEXT_BUCKET = 4096
"""Tokens: a decode step's context is rounded up to this (its time moves by under 1% per bucket at 8B/H100)."""
PREFILL_PROBE_TOKENS = 2048
"""Tokens of the prefill whose time per block stands for any prompt's (attention grows it slowly)."""


class CostModelTiming:
    """``view.WorkerTiming`` from the catalog's roofline cost models, memoised (see the module docstring)."""

    def __init__(self) -> None:
        from config.catalog import default_catalog

        self._catalog = default_catalog()
        self._models: dict[tuple[str, str, int], RooflineCostModel | None] = {}
        self._block: dict[tuple[str, str, int, int], float | None] = {}
        self._decode: dict[tuple[str, str, int, int, int], float | None] = {}

    def _model(self, w: WorkerInfo) -> RooflineCostModel | None:
        key = (w.model, w.hardware, w.tp)
        if key not in self._models:
            cat = self._catalog
            ok = w.model in cat.models and w.hardware in cat.hardware
            self._models[key] = RooflineCostModel(cat.hardware.get(w.hardware), cat.models.get(w.model), w.tp) \
                if ok else None
        return self._models[key]

    def prefill_ms(self, w: WorkerInfo, new: int, cached: int) -> float | None:
        """Emulated ms to prefill ``new`` tokens after ``cached`` ones on ``w`` in one step (None: unknown)."""
        cm = self._model(w)
        return None if cm is None else cm.step(StepShape.of(prefills=[(new, cached)])).total_ms

    def block_ms(self, w: WorkerInfo) -> float | None:
        key = (w.model, w.hardware, w.tp, w.block_size)
        if key not in self._block:
            cm = self._model(w)
            blocks = max(1, PREFILL_PROBE_TOKENS // max(1, w.block_size))
            self._block[key] = None if cm is None else \
                cm.step(StepShape.of(prefills=[(blocks * w.block_size, 0)])).total_ms / blocks
        return self._block[key]

    def decode_step_ms(self, w: WorkerInfo, seqs: int, context_tokens: int) -> float | None:
        seqs = max(1, seqs)
        bucket = -(-max(0, context_tokens) // CONTEXT_BUCKET)
        key = (w.model, w.hardware, w.tp, seqs, bucket)
        if key not in self._decode:
            cm = self._model(w)
            per_seq = max(1, bucket * CONTEXT_BUCKET // seqs)
            self._decode[key] = None if cm is None else \
                cm.step(StepShape.of(decodes=[per_seq] * seqs)).total_ms
        return self._decode[key]

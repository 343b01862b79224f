"""The Splitwise DGX report: the cost model, with the presets' efficiencies, against Splitwise's measured
step times (2023 serving stack, eager). Shown by ``calibrate``, not bounded: the software it measured is
two generations old. Data: ``../shared/calibration/splitwise_dgx/perf_model.csv`` (medians per point)."""

from __future__ import annotations

import csv
import statistics
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from actors.calibration import REPO_ROOT
from actors.cost_model import RooflineCostModel, StepShape
from config.catalog import Catalog

DEFAULT_DATA = REPO_ROOT.parent / "shared" / "calibration" / "splitwise_dgx" / "perf_model.csv"
MODEL_NAMES = {"llama2-70b": "llama-2-70b", "bloom-176b": "bloom-176b"}
HARDWARE_NAMES = {"a100-80gb": "a100-80g-sxm", "h100-80gb": "h100-80g-sxm", "h100-80gb-pcap": "h100-80g-sxm-pcap"}


@dataclass(frozen=True)
class Point:
    """One measured point: the median over its repeats."""

    kind: str  # "prefill" or "decode"
    prompt: int
    batch: int
    tokens: int  # generated tokens (decode points)
    measured_ms: float

    def shape(self) -> StepShape:
        if self.kind == "prefill":
            return StepShape.of(prefills=[(self.prompt, 0)] * self.batch)
        # A decode point is the mean step over generating `tokens` tokens: mean context prompt + tokens/2.
        ctx = self.prompt + self.tokens // 2
        return StepShape.of(decodes=[ctx] * self.batch)


@dataclass
class Group:
    model: str
    hardware: str
    tp: int
    points: list[Point] = field(default_factory=list)


def load_points(path: Path = DEFAULT_DATA) -> list[Group]:
    """Medians per measured point, grouped by (model, hardware, TP)."""
    raw: dict[tuple[str, str, int], dict[tuple[str, int, int, int], list[float]]] = defaultdict(
        lambda: defaultdict(list))
    with open(path, newline="") as f:
        for row in csv.DictReader(f):
            model = MODEL_NAMES.get(row["model"])
            hw = HARDWARE_NAMES.get(row["hardware"])
            if model is None or hw is None:
                continue
            key = (model, hw, int(row["tensor_parallel"]))
            p, b, t = int(row["prompt_size"]), int(row["batch_size"]), int(row["token_size"])
            raw[key][("prefill", p, b, 0)].append(float(row["prompt_time"]))
            raw[key][("decode", p, b, t)].append(float(row["token_time"]))
    return [Group(model, hw, tp, [Point(kind, p, b, t, statistics.median(vals))
                                  for (kind, p, b, t), vals in sorted(pts.items())])
            for (model, hw, tp), pts in sorted(raw.items())]


@dataclass(frozen=True)
class GroupError:
    model: str
    hardware: str
    tp: int
    prefill_median: float
    decode_median: float
    prefill_bias: float
    """Median of predicted / measured - 1 (negative: the model is faster than the 2023 stack)."""
    decode_bias: float
    points: int


def splitwise_report(cat: Catalog, groups: Sequence[Group]) -> list[GroupError]:
    """The new model (eager, as 2023's stack ran) against Splitwise's step times, per group."""
    out = []
    for g in groups:
        cm = RooflineCostModel(cat.hardware.get(g.hardware), cat.models.get(g.model), g.tp, cudagraphs=False)
        pred = np.array([cm.step(p.shape()).total_ms for p in g.points])
        meas = np.array([p.measured_ms for p in g.points])
        ratio = pred / meas - 1.0
        kinds = np.array([p.kind for p in g.points])
        pre, dec = ratio[kinds == "prefill"], ratio[kinds == "decode"]
        out.append(GroupError(g.model, g.hardware, g.tp, float(np.median(np.abs(pre))), float(np.median(np.abs(dec))),
                              float(np.median(pre)), float(np.median(dec)), len(g.points)))
    return out

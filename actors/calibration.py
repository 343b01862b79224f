"""Fit the roofline cost model's free parameters on measured step times, and report the fit error.

Data: Splitwise's ``perf_model.csv`` (prefill and decode step times of llama2-70b and bloom-176b on DGX
A100 / DGX H100 / power-capped DGX H100 at TP 2, 4, 8). For each hardware profile one set of six
physical parameters (compute, memory and link efficiency; step, per-sequence and all-reduce-hop
overheads) is fitted across every model and TP degree measured on it, so the model stays a model and
can predict parts and sizes that are not in the file.

The residual is the log ratio predicted / measured of each measured point's median, with a Huber
loss so that a few anomalous points (Splitwise's A100 TP2 batch-64 prefill, for one) do not drag the fit.
"""

from __future__ import annotations

import csv
import json
import re
import statistics
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import yaml
from scipy.optimize import least_squares

from actors.cost_model import RooflineCostModel, StepShape
from config.catalog import PRESETS_DIR, Catalog
from config.hardware import Efficiency, HardwareProfile
from config.model import ModelProfile

REPO_ROOT = Path(__file__).resolve().parents[1]
DEFAULT_DATA = REPO_ROOT.parent / "shared" / "calibration" / "splitwise_dgx" / "perf_model.csv"

# Names in the measurement file -> our presets.
MODEL_NAMES = {"llama2-70b": "llama-2-70b", "bloom-176b": "bloom-176b"}
HARDWARE_NAMES = {"a100-80gb": "a100-80g-sxm", "h100-80gb": "h100-80g-sxm", "h100-80gb-pcap": "h100-80g-sxm-pcap"}

PARAMS = ("compute", "memory", "link", "link_large", "layer_overhead_us", "seq_layer_overhead_us",
          "allreduce_latency_us")
# Physical ranges: no GPU sustains its full tensor peak, HBM or link bandwidth in a real step.
LOWER = np.array([0.02, 0.02, 0.02, 0.005, 0.0, 0.0, 0.0])
UPPER = np.array([0.95, 0.92, 0.95, 0.95, 2000.0, 100.0, 1000.0])
STARTS = ([0.5, 0.7, 0.5, 0.1, 120.0, 2.0, 20.0], [0.3, 0.4, 0.9, 0.05, 250.0, 4.0, 5.0],
          [0.8, 0.9, 0.3, 0.2, 25.0, 0.5, 5.0])
KNEE_GRID = (1024, 1536, 2048, 2560, 3072, 4096)


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
    excluded: list[Point] = field(default_factory=list)
    """Points that break monotonicity (more work measured faster than less): left out, and reported."""


def split_inconsistent(points: Sequence[Point]) -> tuple[list[Point], list[Point]]:
    """Separate points whose time is below that of a smaller batch of the same prompt (and output).

    A batch of 64 prompts cannot prefill faster than a batch of 32; such rows (Splitwise's TP2 batch-64
    runs, whose batch was evidently capped) measure something else and would only teach the fit noise.
    """
    keep, drop = [], []
    for pt in points:
        smaller = [q for q in points if q.kind == pt.kind and q.prompt == pt.prompt and q.tokens == pt.tokens
                   and q.batch < pt.batch]
        if any(q.measured_ms > pt.measured_ms * 1.05 for q in smaller):
            drop.append(pt)
        else:
            keep.append(pt)
    return keep, drop


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
    groups = []
    for (model, hw, tp), pts in sorted(raw.items()):
        medians = [Point(kind, p, b, t, statistics.median(vals)) for (kind, p, b, t), vals in sorted(pts.items())]
        keep, drop = split_inconsistent(medians)
        groups.append(Group(model, hw, tp, keep, drop))
    return groups


def _efficiency(theta: Sequence[float], knee: int, fitted_on: str) -> Efficiency:
    values = dict(zip(PARAMS, (float(x) for x in theta), strict=True))
    return Efficiency(**values, knee_tokens=knee, fitted_on=fitted_on)


def predict(hw: HardwareProfile, model: ModelProfile, tp: int, eff: Efficiency, pts: Sequence[Point]) -> np.ndarray:
    cm = RooflineCostModel(hw, model, tp, efficiency=eff)
    return np.array([cm.step(pt.shape()).total_ms for pt in pts])


@dataclass(frozen=True)
class GroupError:
    model: str
    hardware: str
    tp: int
    prefill_median: float
    prefill_p90: float
    decode_median: float
    decode_p90: float
    points: int
    excluded: int = 0

    def within(self, median: float = 0.12, p90: float = 0.30) -> bool:
        return (self.prefill_median <= median and self.decode_median <= median
                and self.prefill_p90 <= p90 and self.decode_p90 <= p90)


def group_error(cat: Catalog, g: Group, eff: Efficiency) -> GroupError:
    hw, model = cat.hardware.get(g.hardware), cat.models.get(g.model)
    pred = predict(hw, model, g.tp, eff, g.points)
    meas = np.array([p.measured_ms for p in g.points])
    ape = np.abs(pred - meas) / meas
    kinds = np.array([p.kind for p in g.points])
    pre, dec = ape[kinds == "prefill"], ape[kinds == "decode"]
    return GroupError(g.model, g.hardware, g.tp, float(np.median(pre)), float(np.percentile(pre, 90)),
                      float(np.median(dec)), float(np.percentile(dec, 90)), len(g.points), len(g.excluded))


@dataclass(frozen=True)
class FitResult:
    hardware: str
    efficiency: Efficiency
    errors: list[GroupError]


def fit_hardware(cat: Catalog, hw_name: str, groups: Sequence[Group]) -> FitResult:
    """One efficiency set for ``hw_name`` over all its measured (model, TP) groups."""
    hw = cat.hardware.get(hw_name)
    mine = [g for g in groups if g.hardware == hw_name]
    if not mine:
        raise ValueError(f"no measurements for hardware {hw_name!r}")
    label = "; ".join(f"{g.model} TP{g.tp}" for g in mine)
    fitted_on = f"splitwise_dgx perf_model.csv: {label}"

    measured = [np.array([p.measured_ms for p in g.points]) for g in mine]

    def residuals(theta: np.ndarray, knee: int) -> np.ndarray:
        eff = _efficiency(theta.tolist(), knee, fitted_on)
        out = [np.log(predict(hw, cat.models.get(g.model), g.tp, eff, g.points) / meas)
               for g, meas in zip(mine, measured, strict=True)]
        return np.concatenate(out)

    best: tuple[float, np.ndarray, int] | None = None
    for knee in KNEE_GRID:
        for start in STARTS:
            res = least_squares(residuals, np.array(start), bounds=(LOWER, UPPER), loss="huber",
                                f_scale=0.1, args=(knee,))
            if best is None or res.cost < best[0]:
                best = (float(res.cost), res.x, knee)
    assert best is not None
    eff = _efficiency(_round(best[1]), best[2], fitted_on)
    return FitResult(hw_name, eff, [group_error(cat, g, eff) for g in mine])


def _round(theta: np.ndarray) -> list[float]:
    return [float(f"{x:.4g}") for x in theta]


def fit_all(cat: Catalog, groups: Sequence[Group]) -> list[FitResult]:
    return [fit_hardware(cat, hw, groups) for hw in sorted({g.hardware for g in groups})]


def current_errors(cat: Catalog, groups: Sequence[Group]) -> list[GroupError]:
    """Errors of the efficiencies now in the presets (no fitting)."""
    return [group_error(cat, g, cat.hardware.get(g.hardware).efficiency) for g in groups]


def write_presets(fits: Sequence[FitResult], path: Path = PRESETS_DIR / "hardware.yaml") -> None:
    """Replace the ``efficiency`` block of each fitted profile in the hardware preset file, in place.

    Edits the file's text (not a YAML round trip) so that comments and key order survive.
    """
    lines = path.read_text().splitlines()
    by_name = {f.hardware: f.efficiency for f in fits}
    out: list[str] = []
    current: str | None = None
    i = 0
    while i < len(lines):
        line = lines[i]
        if line.startswith("- name: "):
            current = line.split(":", 1)[1].strip()
        if current in by_name and line.startswith("  efficiency:"):
            i += 1
            while i < len(lines) and not re.match(r"^(- |#|  [A-Za-z_]+:)", lines[i]):
                i += 1
            out.extend(_efficiency_block(by_name.pop(current)))
            continue
        if current in by_name and (i + 1 == len(lines) or lines[i + 1].startswith("- name: ")):
            out.append(line)
            out.extend(_efficiency_block(by_name.pop(current)))
            i += 1
            continue
        out.append(line)
        i += 1
    text = "\n".join(out) + "\n"
    yaml.safe_load(text)  # never write a file we could not read back
    path.write_text(text)


def _efficiency_block(eff: Efficiency) -> list[str]:
    lines = ["  efficiency:"]
    for k in (*PARAMS, "knee_tokens"):
        lines.append(f"    {k}: {getattr(eff, k)}")
    lines.append(f"    fitted_on: {json.dumps(eff.fitted_on)}")
    return lines


def mape_summary(errors: Sequence[GroupError]) -> dict[str, float]:
    return {
        "worst_prefill_median": max(e.prefill_median for e in errors),
        "worst_prefill_p90": max(e.prefill_p90 for e in errors),
        "worst_decode_median": max(e.decode_median for e in errors),
        "worst_decode_p90": max(e.decode_p90 for e in errors),
    }


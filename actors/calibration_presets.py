"""Write fitted efficiencies into the hardware preset file (``run_cluster.py calibrate --write``), editing its text
so that comments and key order survive (moved out of ``actors.calibration``, which re-exports ``write_presets``)."""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

import yaml

from config.catalog import PRESETS_DIR
from config.hardware import Efficiency, OpFit

if TYPE_CHECKING:
    from actors.calibration import OpFitResult

FITTED_FAMILIES = ("gemm", "gemm_fp8", "attention_prefill", "attention_decode", "attention_decode_fp8", "moe",
                   "moe_fp8")
"""``Efficiency`` fields fitted on op tables (the all-reduce fits by GPU count besides)."""
OPTIONAL_FIELDS = ("depth", "output_ns", "m_tiles", "moe_block_m", "moe_block_tokens")
"""``OpFit`` fields written only where fitted (non-empty, non-zero)."""


def write_presets(fits: Sequence[OpFitResult], path: Path = PRESETS_DIR / "hardware.yaml") -> None:
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


def _fit_line(key: str, fit: OpFit, indent: str) -> str:
    dump = {k: v for k, v in fit.model_dump().items() if k not in OPTIONAL_FIELDS or v}  # fitted only
    body = json.dumps(dump, separators=(", ", ": "))
    return f"{indent}{key}: {body}"


def _efficiency_block(eff: Efficiency) -> list[str]:
    lines = ["  efficiency:"]
    for fam in FITTED_FAMILIES:
        fit = getattr(eff, fam)
        if fit is not None:
            lines.append(_fit_line(fam, fit, "    "))
    lines.append("    allreduce:")
    for n, fit in sorted(eff.allreduce.items()):
        lines.append(_fit_line(str(n), fit, "      "))
    for k in ("step_overhead_us", "request_overhead_us", "layer_overhead_us"):
        lines.append(f"    {k}: {getattr(eff, k)}")
    if eff.gemm_fp8_bf16_bound:
        lines.append("    gemm_fp8_bf16_bound: true")
    lines.append(f"    fitted_on: {json.dumps(eff.fitted_on)}")
    return lines


__all__ = ["FITTED_FAMILIES", "OPTIONAL_FIELDS", "write_presets"]

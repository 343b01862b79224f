"""A measured step-time table: how a user who profiled their own GPU hands kvmesh its step times.

Format (CSV, UTF-8; lines starting with ``#`` are comments; one header line, then one row per
measured step)::

    kind,tokens,context,ms
    decode,1,1024,7.9
    decode,64,1024,11.2
    prefill,512,0,38.0
    prefill,2048,0,121.5

- ``kind``: ``decode`` for a step in which every sequence decodes one token, ``prefill`` for a step
  that computes a prefill chunk (decodes riding along count as tokens, as in vLLM's mixed batches);
- ``tokens``: ``decode``: the batch size (sequences); ``prefill``: the tokens of the step;
- ``context``: ``decode``: the mean context length per sequence; ``prefill``: the tokens already in
  the KV cache before the chunk (0 for a fresh prompt);
- ``ms``: the measured step time in milliseconds (a median over repetitions, say), of the whole
  engine (its TP group), as a CUDA-graph replay or eager run, whatever the deployment does.

Each kind's rows form a full grid: every ``tokens`` value measured at every ``context`` value of that
kind (one context value alone is allowed: then time depends on ``tokens`` only). Vidur's profiles
are per operator (``mlp.csv``, ``attention.csv``: one row per shape, ``time_stats.<op>.median``
columns); this table is a step-level summary, which is what a user can take from a running server
(vLLM's per-step timings, or a ``bench serve`` sweep at fixed batch sizes and lengths).

A bad file raises ``ConfigError`` naming the line and column (or the missing grid point).
"""

from __future__ import annotations

import csv
import io
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from config.errors import ConfigError

COLUMNS = ("kind", "tokens", "context", "ms")
StepKind = Literal["decode", "prefill"]


class StepProfileRow(BaseModel):
    """One measured step."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    kind: StepKind
    tokens: int = Field(ge=1)
    context: int = Field(ge=0)
    ms: float = Field(gt=0, allow_inf_nan=False)


@dataclass(frozen=True)
class Grid:
    """One kind's measurements on a grid: ``ms[i][j]`` at ``tokens[i]``, ``contexts[j]``."""

    tokens: tuple[int, ...]
    contexts: tuple[int, ...]
    ms: tuple[tuple[float, ...], ...]


@dataclass(frozen=True)
class StepProfile:
    source: str
    decode: Grid
    prefill: Grid


def _grid(kind: str, rows: list[tuple[int, StepProfileRow]], source: str) -> Grid:
    if not rows:
        raise ConfigError(source, [(f"kind {kind}", f"no '{kind}' rows: the table needs both kinds")])
    problems: list[tuple[str, str]] = []
    points: dict[tuple[int, int], float] = {}
    for line, r in rows:
        key = (r.tokens, r.context)
        if key in points:
            problems.append((f"line {line}", f"duplicate {kind} point tokens={r.tokens}, context={r.context}"))
        points[key] = r.ms
    tokens = tuple(sorted({t for t, _ in points}))
    contexts = tuple(sorted({c for _, c in points}))
    for t in tokens:
        for c in contexts:
            if (t, c) not in points:
                problems.append((f"kind {kind}", f"grid point tokens={t}, context={c} is missing (every tokens "
                                                  "value must be measured at every context value)"))
    if problems:
        raise ConfigError(source, problems)
    return Grid(tokens, contexts, tuple(tuple(points[(t, c)] for c in contexts) for t in tokens))


def parse_step_profile(text: str, source: str = "<step profile>") -> StepProfile:
    """Parse the CSV text (module docstring); ``source`` names it in errors."""
    lines = [(n, ln) for n, ln in enumerate(text.splitlines(), start=1)
             if ln.strip() and not ln.lstrip().startswith("#")]
    if not lines:
        raise ConfigError(source, [("header", f"empty table: expected the header {','.join(COLUMNS)}")])
    header_line, header = lines[0]
    names = [h.strip() for h in next(csv.reader([header]))]
    if names != list(COLUMNS):
        raise ConfigError(source, [(f"line {header_line}", f"header must be {','.join(COLUMNS)}, got {header!r}")])
    problems: list[tuple[str, str]] = []
    by_kind: dict[str, list[tuple[int, StepProfileRow]]] = {"decode": [], "prefill": []}
    reader = csv.reader(io.StringIO("\n".join(ln for _, ln in lines[1:])))
    for (line, _), cells in zip(lines[1:], reader, strict=True):
        if len(cells) != len(COLUMNS):
            problems.append((f"line {line}", f"expected {len(COLUMNS)} columns, got {len(cells)}"))
            continue
        try:
            row = StepProfileRow.model_validate(dict(zip(COLUMNS, (c.strip() for c in cells), strict=True)))
        except ValidationError as err:
            for e in err.errors():
                col = ".".join(str(p) for p in e["loc"])
                problems.append((f"line {line}, column {col}", e["msg"]))
            continue
        by_kind[row.kind].append((line, row))
    if problems:
        raise ConfigError(source, problems)
    return StepProfile(source, _grid("decode", by_kind["decode"], source), _grid("prefill", by_kind["prefill"], source))


def load_step_profile(path: Path | str) -> StepProfile:
    p = Path(path)
    try:
        text = p.read_text(encoding="utf-8")
    except OSError as e:
        raise ConfigError(str(p), [("file", f"cannot read the step profile: {e.strerror or e}")]) from None
    return parse_step_profile(text, str(p))

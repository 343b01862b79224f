"""The one request type every trace reader produces, and the result of reading a trace.

A ``RequestSpec`` says when a request arrives (trace milliseconds, emulated time), how long its prompt
and its answer are, and which prompt blocks it shares with other requests (``hash_ids``: chained block
hashes, ``block_size`` tokens each; equal id at position k means equal prompt up to and including
block k). The prompt itself is either given (``prompt_token_ids``) or built on demand from the hash ids
by ``cluster.loadtest.synthesis`` — the lazy path, so a 12,000-request trace does not hold 150 million
token ids in memory.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import NewType

RequestId = NewType("RequestId", str)
HashId = NewType("HashId", int)

MAX_EXAMPLES = 20
"""Malformed lines kept verbatim (with their reasons) in a ``TraceData``; the rest are only counted."""


class TraceError(ValueError):
    """A trace cannot be read: the file is missing or unreadable, its format is unknown, or (``strict``)
    a line is malformed. The message names the file, the line and what to do."""


@dataclass(frozen=True)
class RequestSpec:
    """One request of a workload.

    Invariants (checked at construction; readers count violations as malformed lines instead of raising):
    ``input_len >= 1``, ``output_len >= 1``, ``arrival_ms >= 0``, ``block_size >= 1``, and when hash ids
    are given, ``len(hash_ids) == ceil(input_len / block_size)`` so every prompt token belongs to one block.
    """

    request_id: RequestId
    arrival_ms: float
    input_len: int
    output_len: int
    hash_ids: tuple[int, ...] = ()
    block_size: int = 16
    prompt_token_ids: tuple[int, ...] | None = None
    """Explicit prompt; when None the prompt is synthesized from ``hash_ids`` (see synthesis.py)."""
    origin_region: str | None = None
    residency_region: str | None = None
    session_id: str | None = None
    priority: int | None = None

    def __post_init__(self) -> None:
        problem = spec_problem(self.input_len, self.output_len, self.arrival_ms, self.block_size, self.hash_ids)
        if problem is not None:
            raise ValueError(f"request {self.request_id}: {problem}")
        if self.prompt_token_ids is not None and len(self.prompt_token_ids) != self.input_len:
            raise ValueError(f"request {self.request_id}: prompt has {len(self.prompt_token_ids)} tokens, "
                             f"input_len says {self.input_len}")

    @property
    def num_blocks(self) -> int:
        return -(-self.input_len // self.block_size)


def spec_problem(input_len: int, output_len: int, arrival_ms: float, block_size: int,
                 hash_ids: Sequence[int]) -> str | None:
    """Why these fields cannot make a ``RequestSpec``, or None when they can."""
    if input_len < 1:
        return f"input length must be at least 1 (got {input_len})"
    if output_len < 1:
        return f"output length must be at least 1 (got {output_len})"
    if arrival_ms < 0:
        return f"arrival time must not be negative (got {arrival_ms})"
    if block_size < 1:
        return f"block size must be at least 1 (got {block_size})"
    if hash_ids:
        need = -(-input_len // block_size)
        if len(hash_ids) != need:
            return (f"{len(hash_ids)} hash_ids but ceil(input_length / block_size) = ceil({input_len} / "
                    f"{block_size}) = {need} (wrong --block-size?)")
    return None


@dataclass(frozen=True)
class Malformed:
    """A line that did not make a request: its 1-based line number, the reason, and the text (clipped)."""

    line: int
    reason: str
    text: str = ""


@dataclass(frozen=True)
class TraceData:
    """What a reader produced: requests sorted by arrival, and every line it could not use.

    ``malformed_count`` counts all bad lines; ``malformed`` keeps the first ``MAX_EXAMPLES`` of them.
    ``resorted`` is true when the file's arrivals were not in order and the reader sorted them (stably).
    """

    source: str
    format: str
    requests: tuple[RequestSpec, ...]
    malformed_count: int = 0
    malformed: tuple[Malformed, ...] = ()
    block_size: int | None = None
    resorted: bool = False
    notes: tuple[str, ...] = field(default_factory=tuple)

    def __len__(self) -> int:
        return len(self.requests)

    def describe(self) -> dict[str, object]:
        """A JSON-ready account of the read: counts, the malformed examples, notes."""
        return {
            "source": self.source, "format": self.format, "requests": len(self.requests),
            "block_size": self.block_size, "malformed_lines": self.malformed_count,
            "malformed_examples": [{"line": m.line, "reason": m.reason} for m in self.malformed],
            "resorted": self.resorted, "notes": list(self.notes),
        }


class MalformedLog:
    """Collects malformed lines while a reader runs; in strict mode the first one raises ``TraceError``."""

    def __init__(self, source: Path | str, strict: bool) -> None:
        self.source = str(source)
        self.strict = strict
        self.count = 0
        self.examples: list[Malformed] = []

    def add(self, line: int, reason: str, text: str = "") -> None:
        if self.strict:
            raise TraceError(f"{self.source}, line {line}: {reason} (strict mode; drop --strict to count and "
                             f"skip malformed lines instead)")
        self.count += 1
        if len(self.examples) < MAX_EXAMPLES:
            self.examples.append(Malformed(line, reason, text[:200]))


def finish(source: Path | str, fmt: str, requests: list[RequestSpec], log: MalformedLog,
           block_size: int | None, notes: Sequence[str] = ()) -> TraceData:
    """Sort by arrival (stably, noting it if the file was out of order) and freeze the result."""
    ordered = all(a.arrival_ms <= b.arrival_ms for a, b in itertools.pairwise(requests))
    out = requests if ordered else sorted(requests, key=lambda r: r.arrival_ms)
    all_notes = list(notes)
    if not ordered:
        all_notes.append("arrivals were not in time order in the file; sorted them (stable)")
    if log.count:
        all_notes.append(f"{log.count} malformed line(s) skipped (use --strict to fail instead)")
    return TraceData(source=str(source), format=fmt, requests=tuple(out), malformed_count=log.count,
                     malformed=tuple(log.examples), block_size=block_size, resorted=not ordered,
                     notes=tuple(all_notes))

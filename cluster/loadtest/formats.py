"""Registry of trace readers, keyed by format name, and format detection.

Each trace format lives in its own module (``mooncake.py``, ``azure.py``, ``synthetic.py``) which
registers one reader here on import. ``read_trace`` picks the reader by name, or, for ``"auto"``, by the
file's extension when exactly one reader claims it, else by sniffing the first non-empty line; when
neither settles it the call fails with ``TraceError`` asking for ``--format``.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

from cluster.loadtest.spec import MalformedLog, TraceData, TraceError

READER_MODULES = ("cluster.loadtest.mooncake", "cluster.loadtest.azure", "cluster.loadtest.synthetic")


@dataclass(frozen=True)
class ReadOptions:
    """How to read a trace. ``block_size`` None lets the reader infer it (Mooncake) or use its default."""

    block_size: int | None = None
    strict: bool = False
    seed: int = 0
    """Seed of generated workloads (synthetic format); readers of recorded traces ignore it."""


class TraceReader(Protocol):
    """One trace format: a name, the file extensions it claims, a content sniffer and the reader."""

    name: str
    extensions: tuple[str, ...]

    def sniff(self, head: str) -> bool:
        """True when ``head`` (the first non-empty line of a file) looks like this format."""
        ...

    def read(self, path: Path, options: ReadOptions, log: MalformedLog) -> TraceData:
        """Read the whole file; report bad lines to ``log`` (which raises in strict mode)."""
        ...


READERS: dict[str, TraceReader] = {}


def register_reader(reader: TraceReader) -> TraceReader:
    if READERS.get(reader.name, reader) is not reader:
        raise ValueError(f"trace format {reader.name!r} registered twice")
    READERS[reader.name] = reader
    return reader


def _load_readers() -> None:
    for mod in READER_MODULES:
        importlib.import_module(mod)


def format_names() -> list[str]:
    _load_readers()
    return sorted(READERS)


def _first_line(path: Path) -> str:
    with path.open("r", encoding="utf-8", errors="replace") as f:
        for line in f:
            if line.strip():
                return line.strip()
    return ""


def detect_format(path: Path) -> str:
    """The format of ``path``: the only reader claiming its extension, else the only one whose sniffer
    accepts its first line. Raises ``TraceError`` when none or several fit."""
    _load_readers()
    suffix = path.suffix.lower()
    by_ext = [r.name for r in READERS.values() if suffix in r.extensions]
    if len(by_ext) == 1:
        return by_ext[0]
    head = _first_line(path)
    candidates = by_ext or list(READERS)
    sniffed = [name for name in candidates if READERS[name].sniff(head)]
    if len(sniffed) == 1:
        return sniffed[0]
    what = "no known format" if not sniffed else f"several formats ({', '.join(sniffed)})"
    raise TraceError(f"{path}: cannot tell the trace format, it matches {what}; pass --format "
                     f"({'|'.join(format_names())})")


def read_trace(path: Path | str, fmt: str = "auto", options: ReadOptions | None = None) -> TraceData:
    """Read a trace file into request specs with the reader registered as ``fmt`` (or detected).

    Malformed lines are counted and reported in the result (``malformed_count``, ``malformed``), never
    silently dropped; with ``options.strict`` the first one raises ``TraceError`` naming the line.
    """
    p = Path(path)
    if not p.is_file():
        raise TraceError(f"{p}: no such trace file")
    _load_readers()
    name = detect_format(p) if fmt == "auto" else fmt
    reader = READERS.get(name)
    if reader is None:
        raise TraceError(f"unknown trace format {name!r} (known: {', '.join(format_names())})")
    opts = options or ReadOptions()
    return reader.read(p, opts, MalformedLog(p, opts.strict))

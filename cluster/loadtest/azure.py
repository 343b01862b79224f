"""Azure LLM inference traces (Splitwise 2023): CSV ``TIMESTAMP,ContextTokens,GeneratedTokens``.

``TIMESTAMP`` is wall-clock text with up to 100 ns resolution (``2023-11-16 18:17:03.9799600``) or a
number of seconds; arrivals are made relative to the earliest valid row. Vidur's processed copies
(``arrived_at,num_prefill_tokens,num_decode_tokens``, seconds) are read too. Optional columns:
``origin_region``, ``residency_region``, ``session_id``, ``priority``. The trace has no prefix
information, so requests carry no hash ids and their synthesized prompts share nothing.

A row with the wrong number of cells, an unparsable time, or a token count that is not a positive
integer is malformed: counted and reported, or fatal with ``strict``. A file without the required
header columns fails outright (``TraceError``).
"""

from __future__ import annotations

import csv
from datetime import UTC, datetime
from decimal import Decimal, InvalidOperation
from pathlib import Path
from typing import Any

from cluster.loadtest.formats import ReadOptions, register_reader
from cluster.loadtest.spec import MalformedLog, RequestId, RequestSpec, TraceData, TraceError, finish

DEFAULT_BLOCK_SIZE = 16
COLUMN_ALIASES: dict[str, tuple[str, ...]] = {
    "time": ("timestamp", "arrived_at"),
    "input": ("contexttokens", "num_prefill_tokens"),
    "output": ("generatedtokens", "num_decode_tokens"),
}
OPTIONAL_COLUMNS = ("origin_region", "residency_region", "session_id", "priority")


def parse_timestamp(text: str) -> int:
    """Nanoseconds of a TIMESTAMP cell: ``YYYY-MM-DD HH:MM:SS[.fraction]`` (any number of fraction digits,
    naive time read as UTC) or a plain number of seconds. Integer arithmetic, so the trace's 100 ns
    resolution survives. Raises ValueError."""
    s = text.strip()
    try:
        number = Decimal(s)
    except InvalidOperation:
        number = None
    if number is not None:
        if not number.is_finite():
            raise ValueError(f"timestamp {s!r} is not a finite number")
        return int(number * 1_000_000_000)
    whole, _, frac = s.partition(".")
    base = datetime.strptime(whole, "%Y-%m-%d %H:%M:%S") if " " in whole else datetime.fromisoformat(whole)
    if frac and not frac.isdigit():
        raise ValueError(f"bad fraction of a second {frac!r}")
    seconds = int(base.replace(tzinfo=UTC).timestamp())
    return seconds * 1_000_000_000 + (int(frac.ljust(9, "0")[:9]) if frac else 0)


def _positive_int(cell: str, what: str) -> int:
    try:
        v = int(cell.strip())
    except ValueError:
        raise ValueError(f"{what} {cell.strip()!r} is not an integer") from None
    if v < 1:
        raise ValueError(f"{what} must be at least 1 (got {v})")
    return v


class AzureReader:
    name = "azure"
    extensions: tuple[str, ...] = (".csv",)

    def sniff(self, head: str) -> bool:
        cols = {c.strip().lower() for c in head.split(",")}
        return any(a in cols for a in COLUMN_ALIASES["input"]) and any(a in cols for a in COLUMN_ALIASES["time"])

    def read(self, path: Path, options: ReadOptions, log: MalformedLog) -> TraceData:
        block_size = options.block_size or DEFAULT_BLOCK_SIZE
        rows: list[tuple[int, int, int, int, dict[str, Any]]] = []
        with path.open("r", encoding="utf-8", errors="replace", newline="") as f:
            reader = csv.reader(f)
            header = next(reader, None)
            if header is None:
                raise TraceError(f"{path}: empty file, expected a header TIMESTAMP,ContextTokens,GeneratedTokens")
            index = {c.strip().lower(): i for i, c in enumerate(header)}
            cols: dict[str, int] = {}
            for role, aliases in COLUMN_ALIASES.items():
                found = [index[a] for a in aliases if a in index]
                if not found:
                    raise TraceError(f"{path}: header lacks a {'/'.join(aliases)} column "
                                     f"(found: {', '.join(header)})")
                cols[role] = found[0]
            optional = {k: index[k] for k in OPTIONAL_COLUMNS if k in index}
            for row in reader:
                line_no = reader.line_num
                if not row or all(not c.strip() for c in row):
                    continue
                text = ",".join(row)
                if len(row) != len(header):
                    log.add(line_no, f"{len(row)} cells, the header has {len(header)}", text)
                    continue
                try:
                    t = parse_timestamp(row[cols["time"]])
                    n_in = _positive_int(row[cols["input"]], "ContextTokens")
                    n_out = _positive_int(row[cols["output"]], "GeneratedTokens")
                    extra = self._optional(row, optional)
                except ValueError as e:
                    log.add(line_no, str(e), text)
                    continue
                rows.append((line_no, t, n_in, n_out, extra))
        t0 = min((r[1] for r in rows), default=0)
        requests = [
            RequestSpec(request_id=RequestId(f"L{line_no}"), arrival_ms=(t - t0) / 1_000_000,
                        input_len=n_in, output_len=n_out, block_size=block_size, **extra)
            for line_no, t, n_in, n_out, extra in rows
        ]
        return finish(path, self.name, requests, log, block_size,
                      ["no prefix information in this format: synthesized prompts share no blocks"])

    @staticmethod
    def _optional(row: list[str], optional: dict[str, int]) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for key, i in optional.items():
            cell = row[i].strip()
            if not cell:
                continue
            if key == "priority":
                try:
                    out[key] = int(cell)
                except ValueError:
                    raise ValueError(f"priority {cell!r} is not an integer") from None
            else:
                out[key] = cell
        return out


READER = register_reader(AzureReader())

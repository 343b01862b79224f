"""Mooncake JSONL traces: one JSON object per line.

``{"timestamp": ms, "input_length": tokens, "output_length": tokens, "hash_ids": [int, ...]}``; the
hash ids are chained prefix-block hashes, ``block_size`` tokens per block (512 in the Mooncake FAST'25
files, 16 in the derived ShareGPT files), so ``len(hash_ids) == ceil(input_length / block_size)``.
Optional keys: ``origin_region``, ``residency_region``, ``session_id`` (string or int), ``priority``
(int), ``request_id``.

The block size is an argument; when it is not given it is inferred from the first rows as the one power
of two from 1 to 65,536 that makes every sampled row's hash-id count match (a trace of short prompts,
one block each, is ambiguous and then fails asking for ``--block-size``). A line that is not a JSON
object, lacks a field, has a field of the wrong type or a hash-id count that does not match is
malformed: counted and reported, or fatal with ``strict``.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from cluster.loadtest.formats import ReadOptions, register_reader
from cluster.loadtest.spec import MalformedLog, RequestId, RequestSpec, TraceData, TraceError, finish, spec_problem

BLOCK_SIZE_CANDIDATES = tuple(2**k for k in range(17))
INFER_SAMPLE_ROWS = 2000


def _is_int(x: object) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _is_number(x: object) -> bool:
    return isinstance(x, int | float) and not isinstance(x, bool)


def infer_block_size(rows: list[tuple[int, int]]) -> int | None:
    """The only candidate block size consistent with every (input_length, number of hash ids) row.

    A row with n ids and L tokens needs (n - 1) * B < L <= n * B. Returns None when no candidate or
    more than one fits.
    """
    fits = [b for b in BLOCK_SIZE_CANDIDATES if all((n - 1) * b < length <= n * b for length, n in rows)]
    return fits[0] if len(fits) == 1 else None


def _optional(obj: dict[str, Any]) -> tuple[dict[str, Any], str | None]:
    """The optional per-request fields of one row, or the reason one of them is wrong."""
    out: dict[str, Any] = {}
    for key in ("origin_region", "residency_region"):
        v = obj.get(key)
        if v is not None:
            if not isinstance(v, str) or not v:
                return {}, f"{key} must be a non-empty string"
            out[key] = v
    sid = obj.get("session_id")
    if sid is not None:
        if not (isinstance(sid, str) or _is_int(sid)):
            return {}, "session_id must be a string or an integer"
        out["session_id"] = str(sid)
    prio = obj.get("priority")
    if prio is not None:
        if not _is_int(prio):
            return {}, "priority must be an integer"
        out["priority"] = prio
    return out, None


class MooncakeReader:
    name = "mooncake"
    extensions: tuple[str, ...] = (".jsonl",)

    def sniff(self, head: str) -> bool:
        try:
            obj = json.loads(head)
        except ValueError:
            return False
        return isinstance(obj, dict) and "input_length" in obj and "output_length" in obj

    def read(self, path: Path, options: ReadOptions, log: MalformedLog) -> TraceData:
        parsed: list[tuple[int, str, dict[str, Any]]] = []
        with path.open("r", encoding="utf-8", errors="replace") as f:
            for line_no, raw in enumerate(f, start=1):
                text = raw.strip()
                if not text:
                    continue
                try:
                    obj = json.loads(text)
                except json.JSONDecodeError as e:
                    log.add(line_no, f"not valid JSON ({e.msg})", text)
                    continue
                if not isinstance(obj, dict):
                    log.add(line_no, "not a JSON object", text)
                    continue
                reason = self._field_problem(obj)
                if reason is not None:
                    log.add(line_no, reason, text)
                    continue
                parsed.append((line_no, text, obj))

        notes: list[str] = []
        block_size = options.block_size
        if block_size is None:
            sample = [(o["input_length"], len(o["hash_ids"])) for _, _, o in parsed[:INFER_SAMPLE_ROWS]
                      if o.get("hash_ids")]
            if not sample:
                block_size = 16
                notes.append("no hash_ids in the trace: no prefix sharing; block size 16 for synthesis")
            else:
                inferred = infer_block_size(sample)
                if inferred is None:
                    raise TraceError(f"{path}: cannot infer the block size from the hash_ids (no single power "
                                     f"of two fits every row); pass --block-size (512 for the Mooncake "
                                     f"files, 16 for the derived ShareGPT files)")
                block_size = inferred
                notes.append(f"block size inferred from hash_ids: {block_size}")

        requests: list[RequestSpec] = []
        for line_no, text, obj in parsed:
            hash_ids = tuple(obj.get("hash_ids") or ())
            problem = spec_problem(obj["input_length"], obj["output_length"], float(obj["timestamp"]),
                                   block_size, hash_ids)
            if problem is not None:
                log.add(line_no, problem, text)
                continue
            extra, _ = _optional(obj)
            rid = obj.get("request_id")
            requests.append(RequestSpec(
                request_id=RequestId(str(rid) if rid is not None else f"L{line_no}"),
                arrival_ms=float(obj["timestamp"]), input_len=obj["input_length"],
                output_len=obj["output_length"], hash_ids=hash_ids, block_size=block_size, **extra))
        return finish(path, self.name, requests, log, block_size, notes)

    @staticmethod
    def _field_problem(obj: dict[str, Any]) -> str | None:
        for key in ("timestamp", "input_length", "output_length"):
            if key not in obj:
                return f"missing field {key!r}"
        if not _is_number(obj["timestamp"]):
            return "timestamp must be a number (ms since trace start)"
        for key in ("input_length", "output_length"):
            if not _is_int(obj[key]):
                return f"{key} must be an integer"
        h = obj.get("hash_ids")
        if h is not None and not (isinstance(h, list) and all(_is_int(x) for x in h)):
            return "hash_ids must be a list of integers"
        rid = obj.get("request_id")
        if rid is not None and not (isinstance(rid, str) or _is_int(rid)):
            return "request_id must be a string or an integer"
        _, reason = _optional(obj)
        return reason


READER = register_reader(MooncakeReader())

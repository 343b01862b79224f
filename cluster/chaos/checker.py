"""The history checker: proves, from a run folder, that no request was lost, duplicated or garbled.

A history is what the load test wrote (``requests.jsonl``: one record per terminal state the client saw,
with the token ids it received and the prompt it sent when ``ClientConfig.record_tokens`` was on) plus
what the chaos run wrote about the cluster (``chaos_context.json``: the request ids it sent, each
engine's region, the engines' vocabulary size, and every engine's load after the run with the engines
that were killed). Every check is a function from the history to violations, kept in ``CHECKS`` (a
registry: adding a rule adds an entry); each violation names the request id (or the engine) and the rule.

Rules:

- ``terminal_once``: every request sent reaches exactly one terminal state (one record, whatever its
  status): none missing, none twice.
- ``tokens``: each client's token stream equals what the engines generated for it, in order, none lost
  or repeated. Engines' outputs are a pure function of (prompt ids, seed, position) (``OutputModel``), so
  the checker regenerates them: the stream must split into segments, each the engine output of the
  prompt plus every token before the segment (a stream continued elsewhere after a failure is an
  ordinary completion of exactly that prompt, see ``cluster.router.relay.continue_on``). The first
  position that fits no segment is the violation, named as a repeated token (it equals the one expected
  just before), a dropped token (it equals the one expected just after) or a foreign token. A
  successful stream must also carry every token asked for (``ignore_eos``) and as many as its usage
  block says.
- ``deadline``: no terminal state later than the request's deadline (plus ``deadline_slack_ms``).
- ``residency``: a request tagged with a residency region was served by an engine of that region.
- ``kv_baseline``: every engine still alive at the end is idle with all its KV blocks free.

Failure behaviour: a folder without ``requests.jsonl`` or with an unreadable line raises
``HistoryError`` naming the file and line; a history without recorded tokens, context or loads skips
those rules and says so in ``skipped``; nothing is silently passed.
"""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from actors.engine.tokenizer import OutputModel
from cluster.loadtest.record import RequestRecord
from cluster.loadtest.report import REQUESTS_FILE

CONTEXT_FILE = "chaos_context.json"


class HistoryError(ValueError):
    """A run folder cannot be read as a history; the message names the file and the line."""


@dataclass(frozen=True)
class Violation:
    rule: str
    subject: str
    """The request id, or ``engine:<name>`` for an engine-level rule."""
    detail: str

    def to_json(self) -> dict[str, str]:
        return {"rule": self.rule, "subject": self.subject, "detail": self.detail}


@dataclass(frozen=True)
class History:
    """Everything the rules look at; see the module docstring for where each part comes from."""

    records: Sequence[RequestRecord]
    sent_ids: Sequence[str] | None = None
    """Every request id the load generator sent; None: only the records' own ids are known."""
    vocab_size: int | None = None
    seed: int = 0
    engine_regions: Mapping[str, str] = field(default_factory=dict)
    engines_after: Mapping[str, Mapping[str, Any]] | None = None
    """Each engine's load (``free_blocks``, ``num_blocks``, ``running``) after the run, when it settled."""
    dead_engines: frozenset[str] = frozenset()
    deadline_slack_ms: float = 0.0


@dataclass
class CheckReport:
    violations: list[Violation]
    requests: int
    tokens_checked: int
    skipped: list[str]

    @property
    def ok(self) -> bool:
        return not self.violations

    def by_rule(self) -> dict[str, int]:
        return dict(Counter(v.rule for v in self.violations))

    def to_json(self) -> dict[str, Any]:
        return {"ok": self.ok, "requests": self.requests, "tokens_checked": self.tokens_checked,
                "violations_by_rule": self.by_rule(), "violations": [v.to_json() for v in self.violations],
                "skipped": self.skipped}


@dataclass
class _Tally:
    tokens: int = 0
    skipped: list[str] = field(default_factory=list)


Check = Callable[[History, _Tally], Iterable[Violation]]


def _terminal_once(h: History, tally: _Tally) -> Iterable[Violation]:
    counts = Counter(str(r.request_id) for r in h.records)
    for rid, n in counts.items():
        if n > 1:
            statuses = ", ".join(r.status for r in h.records if r.request_id == rid)
            yield Violation("terminal_once", rid, f"{n} terminal states ({statuses})")
    if h.sent_ids is None:
        tally.skipped.append("terminal_once: the ids sent are unknown; only duplicates were checked")
        return
    for rid in h.sent_ids:
        if rid not in counts:
            yield Violation("terminal_once", rid, "sent but never reached a terminal state")


def _describe(tokens: Sequence[int], i: int, expected: int, after: int) -> str:
    got = tokens[i]
    if i > 0 and got == tokens[i - 1]:
        return f"token {i} repeats token {i - 1} ({got})"
    if got == after:
        return f"token {i} missing (expected {expected}, got the next one, {got})"
    return f"token {i} is {got}, which no engine generated there (expected {expected})"


def stream_violation(model: OutputModel, prompt: Sequence[int], tokens: Sequence[int], seed: int = 0) -> str | None:
    """Why ``tokens`` is not a stream the engines generated for ``prompt`` (see ``tokens`` in the module
    docstring), or None when it is."""
    start, base = 0, model.seed_of(prompt, seed)
    for i, t in enumerate(tokens):
        if t == model.token(base, i - start):
            continue
        fresh = model.seed_of([*prompt, *tokens[:i]], seed)
        if t == model.token(fresh, 0):
            start, base = i, fresh  # continued elsewhere from here
            continue
        return _describe(tokens, i, model.token(base, i - start), model.token(base, i - start + 1))
    return None


def _tokens(h: History, tally: _Tally) -> Iterable[Violation]:
    if h.vocab_size is None:
        tally.skipped.append("tokens: no vocab_size in the context; streams not regenerated")
        return
    model = OutputModel(h.vocab_size)
    unrecorded = 0
    for r in h.records:
        if not r.prompt_ids:
            unrecorded += 1
            continue
        tally.tokens += len(r.token_ids)
        why = stream_violation(model, r.prompt_ids, r.token_ids, h.seed)
        if why is not None:
            yield Violation("tokens", str(r.request_id), why)
            continue
        if r.success:
            if len(r.token_ids) != r.expected_output_len:
                yield Violation("tokens", str(r.request_id),
                                f"stream ended after {len(r.token_ids)} of {r.expected_output_len} tokens")
            elif r.output_tokens != len(r.token_ids):
                yield Violation("tokens", str(r.request_id),
                                f"usage says {r.output_tokens} tokens, the stream carried {len(r.token_ids)}")
    if unrecorded:
        tally.skipped.append(f"tokens: {unrecorded} record(s) without a recorded prompt (record_tokens off)")


def _deadline(h: History, tally: _Tally) -> Iterable[Violation]:
    for r in h.records:
        if r.finished_ms is None or r.deadline_ms is None:
            continue
        if r.finished_ms > r.deadline_ms + h.deadline_slack_ms:
            yield Violation("deadline", str(r.request_id),
                            f"ended at {r.finished_ms:.1f} ms, {r.finished_ms - r.deadline_ms:.1f} ms past "
                            f"its deadline {r.deadline_ms:.1f} ms")


def _residency(h: History, tally: _Tally) -> Iterable[Violation]:
    for r in h.records:
        if r.residency is None or r.worker is None:
            continue
        region = h.engine_regions.get(r.worker)
        if region is None:
            continue
        if region != r.residency:
            yield Violation("residency", str(r.request_id),
                            f"must stay in {r.residency} but was served by {r.worker} in {region}")


def _kv_baseline(h: History, tally: _Tally) -> Iterable[Violation]:
    if h.engines_after is None:
        tally.skipped.append("kv_baseline: no engine loads after the run in the context")
        return
    for name, load in sorted(h.engines_after.items()):
        if name in h.dead_engines:
            continue
        free, total, running = load.get("free_blocks"), load.get("num_blocks"), load.get("running")
        if free != total or running:
            yield Violation("kv_baseline", f"engine:{name}",
                            f"{free} of {total} KV blocks free, {running} running after the run")


CHECKS: dict[str, Check] = {
    "terminal_once": _terminal_once,
    "tokens": _tokens,
    "deadline": _deadline,
    "residency": _residency,
    "kv_baseline": _kv_baseline,
}


def check_history(h: History) -> CheckReport:
    """Run every rule of ``CHECKS`` on ``h``."""
    tally = _Tally()
    violations = [v for check in CHECKS.values() for v in check(h, tally)]
    return CheckReport(violations, len({r.request_id for r in h.records}), tally.tokens, tally.skipped)


def read_records(path: Path) -> list[RequestRecord]:
    if not path.is_file():
        raise HistoryError(f"{path}: no such file (is this a load-test run folder?)")
    out: list[RequestRecord] = []
    for n, line in enumerate(path.read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            out.append(RequestRecord.from_json(json.loads(line)))
        except (ValueError, TypeError, KeyError) as e:
            raise HistoryError(f"{path}:{n}: not a request record ({type(e).__name__}: {e})") from None
    return out


def load_history(folder: Path | str, deadline_slack_ms: float = 0.0) -> History:
    """Read a run folder's ``requests.jsonl`` and, when present, its ``chaos_context.json``."""
    root = Path(folder)
    records = read_records(root / REQUESTS_FILE)
    ctx_path = root / CONTEXT_FILE
    ctx: dict[str, Any] = {}
    if ctx_path.is_file():
        try:
            ctx = json.loads(ctx_path.read_text())
        except ValueError as e:
            raise HistoryError(f"{ctx_path}: not JSON ({e})") from None
    sent = ctx.get("sent_ids")
    return History(records, sent_ids=None if sent is None else [str(x) for x in sent],
                   vocab_size=ctx.get("vocab_size"), seed=int(ctx.get("seed", 0)),
                   engine_regions=dict(ctx.get("engine_regions") or {}), engines_after=ctx.get("engines_after"),
                   dead_engines=frozenset(ctx.get("dead_engines") or ()), deadline_slack_ms=deadline_slack_ms)


def check_folder(folder: Path | str, deadline_slack_ms: float = 0.0) -> CheckReport:
    """``check_history(load_history(folder))``."""
    return check_history(load_history(folder, deadline_slack_ms))

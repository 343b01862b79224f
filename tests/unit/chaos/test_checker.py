"""The history checker catches each kind of broken history and passes a sound one."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest

from actors.engine.tokenizer import OutputModel
from cluster.chaos.checker import (
    CONTEXT_FILE,
    History,
    HistoryError,
    check_folder,
    check_history,
    stream_violation,
)
from cluster.loadtest.record import RequestRecord
from cluster.loadtest.spec import RequestId

VOCAB = 32000
MODEL = OutputModel(VOCAB)
PROMPT = tuple(range(100, 140))


def generated(prompt: tuple[int, ...], n: int, start: int = 0) -> list[int]:
    base = MODEL.seed_of(prompt, 0)
    return [MODEL.token(base, start + i) for i in range(n)]


def record(rid: str, tokens: list[int], *, status: str = "ok", expected: int | None = None,
           **kw: object) -> RequestRecord:
    fields: dict[str, object] = dict(
        request_id=RequestId(rid), status=status, scheduled_ms=0.0, sent_ms=0.0, input_len=len(PROMPT),
        expected_output_len=len(tokens) if expected is None else expected, ttft_ms=1.0, e2e_ms=10.0,
        output_tokens=len(tokens), token_ids=tuple(tokens), prompt_ids=PROMPT, finished_ms=10.0,
        deadline_ms=1000.0)
    fields.update(kw)
    return RequestRecord(**fields)  # type: ignore[arg-type]


def history(*records: RequestRecord, **kw: object) -> History:
    base: dict[str, object] = dict(sent_ids=[str(r.request_id) for r in records], vocab_size=VOCAB,
                                   engines_after={"e0": {"free_blocks": 10, "num_blocks": 10, "running": 0}})
    base.update(kw)
    return History(list(records), **base)  # type: ignore[arg-type]


def continued(n_first: int, n_total: int) -> list[int]:
    """A stream that moved to another engine after ``n_first`` tokens (the router's continue_on)."""
    first = generated(PROMPT, n_first)
    rest = generated((*PROMPT, *first), n_total - n_first)
    return first + rest


def test_sound_history_passes_including_a_continued_stream() -> None:
    h = history(record("a", generated(PROMPT, 20)), record("b", continued(7, 20)),
                record("c", generated(PROMPT, 3), status="connection_error", expected=20, ttft_ms=None,
                       e2e_ms=None, output_tokens=0))
    report = check_history(h)
    assert report.ok, report.violations
    assert report.tokens_checked == 43
    assert report.skipped == []


@pytest.mark.parametrize(("tokens", "words"), [
    ([*generated(PROMPT, 5), generated(PROMPT, 5)[-1], *generated(PROMPT, 20, 5)[:14]], "token 5 repeats token 4"),
    ([*generated(PROMPT, 5), *generated(PROMPT, 15, 6)], "token 5 missing"),
    ([*generated(PROMPT, 5), 17, *generated(PROMPT, 14, 6)], "which no engine generated"),
    (continued(7, 20)[:7] + continued(7, 20)[6:19], "token 7 repeats token 6"),  # repeat across a migration
])
def test_a_garbled_stream_is_caught_and_named(tokens: list[int], words: str) -> None:
    report = check_history(history(record("bad", tokens, expected=20), record("good", generated(PROMPT, 20))))
    assert [(v.rule, v.subject) for v in report.violations] == [("tokens", "bad")]
    assert words in report.violations[0].detail


def test_a_short_successful_stream_loses_tokens() -> None:
    report = check_history(history(record("short", generated(PROMPT, 12), expected=20)))
    assert [(v.rule, v.subject) for v in report.violations] == [("tokens", "short")]
    assert "after 12 of 20" in report.violations[0].detail


def test_usage_disagreeing_with_the_stream_is_caught() -> None:
    report = check_history(history(record("u", generated(PROMPT, 20), output_tokens=21)))
    assert [v.rule for v in report.violations] == ["tokens"]


def test_two_terminal_states_and_a_missing_one() -> None:
    a = record("a", generated(PROMPT, 4))
    a_again = dataclasses.replace(a, status="timeout")
    h = history(a, a_again, sent_ids=["a", "lost"])
    report = check_history(h)
    assert sorted((v.rule, v.subject) for v in report.violations) == [("terminal_once", "a"),
                                                                      ("terminal_once", "lost")]
    assert "2 terminal states (ok, timeout)" in next(v.detail for v in report.violations if v.subject == "a")


def test_deadline_residency_and_kv_baseline() -> None:
    late = record("late", generated(PROMPT, 4), finished_ms=1500.0, deadline_ms=1000.0)
    moved = record("moved", generated(PROMPT, 4), residency="eu", worker="e1")
    home = record("home", generated(PROMPT, 4), residency="eu", worker="e0")
    h = history(late, moved, home, engine_regions={"e0": "eu", "e1": "us"},
                engines_after={"e0": {"free_blocks": 9, "num_blocks": 10, "running": 1},
                               "e1": {"free_blocks": 10, "num_blocks": 10, "running": 0},
                               "dead": {"free_blocks": 0, "num_blocks": 10, "running": 3}},
                dead_engines=frozenset({"dead"}))
    report = check_history(h)
    assert sorted((v.rule, v.subject) for v in report.violations) == [
        ("deadline", "late"), ("kv_baseline", "engine:e0"), ("residency", "moved")]
    assert check_history(dataclasses.replace(h, deadline_slack_ms=600.0)).by_rule().get("deadline") is None


def test_missing_context_is_reported_as_skipped_not_passed(tmp_path: Path) -> None:
    (tmp_path / "requests.jsonl").write_text(json.dumps(record("a", generated(PROMPT, 3)).to_json()) + "\n")
    report = check_folder(tmp_path)
    assert report.ok
    assert any(s.startswith("terminal_once") for s in report.skipped)
    assert any(s.startswith("tokens") for s in report.skipped)
    assert any(s.startswith("kv_baseline") for s in report.skipped)


def test_a_folder_round_trip_catches_a_repeat(tmp_path: Path) -> None:
    toks = generated(PROMPT, 6)
    bad = record("r1", [*toks[:3], toks[2], *toks[3:5]], expected=6)
    (tmp_path / "requests.jsonl").write_text(json.dumps(bad.to_json()) + "\n")
    (tmp_path / CONTEXT_FILE).write_text(json.dumps({"vocab_size": VOCAB, "sent_ids": ["r1"],
                                                     "engines_after": {}}))
    report = check_folder(tmp_path)
    assert report.to_json()["violations"] == [
        {"rule": "tokens", "subject": "r1", "detail": f"token 3 repeats token 2 ({toks[2]})"}]


def test_unreadable_folder_is_a_clear_error(tmp_path: Path) -> None:
    with pytest.raises(HistoryError, match="no such file"):
        check_folder(tmp_path)
    (tmp_path / "requests.jsonl").write_text("{not json\n")
    with pytest.raises(HistoryError, match=r"requests\.jsonl:1"):
        check_folder(tmp_path)


def test_stream_violation_of_an_empty_stream_is_none() -> None:
    assert stream_violation(MODEL, PROMPT, []) is None

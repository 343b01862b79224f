"""The capacity ladder's refinement (``bench.engine.refine``): bisection between the last sustained level and the
first that broke the lag bound, down to a gap of an eighth of the sustained level (at least 4 streams); and the
load generator's count of text events (``bench.engine.text_events``) however its reads cut the stream."""

from __future__ import annotations

import itertools

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from bench.engine import refine, text_events


def bisect_to_end(sustained: int, broke: int, holds: int) -> tuple[int, list[int]]:
    """The ladder's refinement against a host that sustains up to ``holds`` streams: the result and the levels tried."""
    tried = []
    while (c := refine(sustained, broke)) is not None:
        tried.append(c)
        if c <= holds:
            sustained = c
        else:
            broke = c
    return sustained, tried


@pytest.mark.parametrize(("holds", "found", "tried"), [
    (100, 96, [112, 104]), (110, 104, [112, 104]), (125, 120, [112, 120]), (96, 96, [112, 104])])
def test_the_top_between_96_and_128_is_found_within_an_eighth(holds: int, found: int, tried: list[int]) -> None:
    assert bisect_to_end(96, 128, holds) == (found, tried)


def test_close_levels_are_not_refined() -> None:
    assert refine(96, 108) is None  # 12 streams apart: within an eighth of 96
    assert refine(8, 12) is None  # 4 streams apart: the least gap refined is more than 4
    assert refine(8, 16) == 12
    assert refine(48, 64) == 56


def test_the_level_that_broke_must_lie_above() -> None:
    with pytest.raises(ValueError, match="must be above"):
        refine(64, 64)


TEXT = b'data: {"id":"c","choices":[{"index":0,"text":"a","token_ids":[5]}]}\n\n'
OTHER = [b'data: {"id":"c","choices":[],"usage":{"completion_tokens":3}}\n\n', b"data: [DONE]\n\n", b": ping\n\n"]


@settings(max_examples=200, deadline=None)
@given(kinds=st.lists(st.integers(0, len(OTHER)), max_size=12), cuts=st.lists(st.integers(0, 2000), max_size=16))
def test_the_load_generator_counts_each_text_event_once_however_the_reads_cut_the_stream(
        kinds: list[int], cuts: list[int]) -> None:
    stream = b"".join(TEXT if k == len(OTHER) else OTHER[k] for k in kinds)
    points = sorted({c % (len(stream) + 1) for c in cuts} | {0, len(stream)})
    buf, counted = b"", 0
    for a, b in itertools.pairwise(points):
        if b > a:
            k, buf = text_events(buf, stream[a:b])
            counted += k
    assert counted == kinds.count(len(OTHER)) and buf == b""


def level(conc: int, rate: float, worst_ms: float) -> dict[str, float]:
    return {"concurrency": conc, "rate_tok_s": rate, "lag_p99_ms": 1.0, "lag_p99_worst_engine_ms": worst_ms}


def test_the_rate_under_the_worst_engine_bound_stops_at_the_first_level_that_passed_it() -> None:
    """The filed code's bound (its worst engine's p99) read back from a ladder bounded on the pooled p99: levels
    sorted by streams (refined levels come last in the order measured), the first over 5 ms ends it even where a
    higher level happened to stay under."""
    from bench.density import sustained_under_worst_engine

    cap = {"levels": [level(32, 3000.0, 2.0), level(64, 6000.0, 4.0), level(128, 11000.0, 9.0),
                      level(96, 9000.0, 5.5), level(80, 7600.0, 4.9)]}
    assert sustained_under_worst_engine(cap) == 7600.0
    cap["levels"][4]["lag_p99_worst_engine_ms"] = 5.1
    assert sustained_under_worst_engine(cap) == 6000.0
    assert sustained_under_worst_engine({"levels": [level(2, 200.0, 6.0)]}) == 0.0

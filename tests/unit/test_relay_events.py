"""The relay's reading of one engine event (``Relay._on_event``): token ids found by searching the bytes as they
came, a resumed stream's repeated tokens dropped, and what is not a list of integers left untracked. Pure: no
loop, no sockets (the hypothesis test of every cut of a stream is tests/unit/router/test_relay_bytes.py)."""

from __future__ import annotations

import json

from cluster.router.metrics import RouterMetrics
from cluster.router.relay import Relay, StreamState


def _event(ids: str, text: str = "t", finish: str | None = None) -> bytes:
    head = json.dumps({"id": "cmpl-e", "object": "text_completion", "created": 7, "model": "m"},
                      separators=(",", ":"))[:-1]
    reason = "null" if finish is None else f'"{finish}"'
    return (f'data: {head},"choices":[{{"index":0,"text":{json.dumps(text)},"logprobs":null,'
            f'"finish_reason":{reason},"token_ids":[{ids}]}}]}}\n\n').encode()


def _state() -> StreamState:
    return StreamState(chat=False, client_usage=False, max_tokens=None)


RELAY = Relay(None, None, RouterMetrics())  # type: ignore[arg-type]


def test_an_event_is_passed_on_as_it_came_and_its_ids_tracked() -> None:
    st = _state()
    for ids in ("5", "6,7", "8, 9"):
        ev = _event(ids)
        assert RELAY._on_event(ev, st, False, True) is ev  # the same bytes, not a copy
    assert st.token_ids == [5, 6, 7, 8, 9] and not st.finished
    RELAY._on_event(_event("10", finish="length"), st, False, True)
    assert st.token_ids[-1] == 10 and st.finished


def test_a_resumed_streams_repeated_tokens_are_dropped_by_index() -> None:
    st = _state()
    st.skip = 3
    assert RELAY._on_event(_event("1"), st, False, True) == b""
    assert RELAY._on_event(_event("2,3"), st, False, True) == b""
    ev = _event("4")
    assert RELAY._on_event(ev, st, False, True) is ev
    assert st.token_ids == [4] and st.deduped == 3 and st.skip == 0


def test_a_skip_that_ends_inside_an_event_keeps_the_rest_of_its_ids() -> None:
    st = _state()
    st.skip = 1
    assert RELAY._on_event(_event("1,2,3"), st, False, True)
    assert st.token_ids == [2, 3] and st.deduped == 1


def test_text_that_spells_token_ids_is_not_taken_for_them() -> None:
    st = _state()
    RELAY._on_event(_event("42", text='"token_ids":[1,2]'), st, False, True)
    assert st.token_ids == [42]


def test_ids_that_are_no_integers_or_none_are_not_tracked_and_the_event_still_passes() -> None:
    st = _state()
    for ids in ("", "null", "1,x"):
        ev = _event(ids)
        assert RELAY._on_event(ev, st, False, True) is ev
    assert st.token_ids == []

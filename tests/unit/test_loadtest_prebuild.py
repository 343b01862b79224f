"""Request bodies built ahead of their send time (cluster/loadtest/prebuild.py), the body encoding and the
replay's frozen heap (no sockets)."""

from __future__ import annotations

import gc
import json

import pytest

from cluster.loadtest import ClientConfig, PromptSynthesizer, RequestId, RequestSpec
from cluster.loadtest.client import CompletionClient, PreparedRequest, build_headers, build_payload
from cluster.loadtest.prebuild import REFILL_MARGIN_S, Prebuilder
from cluster.loadtest.replay import frozen_heap


class FakeTime:
    """A monotonic clock that only the test moves; each build costs ``build_s`` of it."""

    def __init__(self, build_s: float = 0.001) -> None:
        self.now = 100.0
        self.build_s = build_s

    def __call__(self) -> float:
        return self.now


def specs(n: int, body_bytes: int = 10) -> list[RequestSpec]:
    return [RequestSpec(RequestId(f"r{i}"), float(i), body_bytes, 1) for i in range(n)]


def builder(items: list[RequestSpec], budget: int, clock: FakeTime, built: list[str]) -> Prebuilder:
    def prepare(spec: RequestSpec) -> PreparedRequest:
        clock.now += clock.build_s
        built.append(spec.request_id)
        return PreparedRequest(spec, b"x" * spec.input_len, {})
    return Prebuilder(prepare, items, budget, monotonic=clock)


async def test_take_hands_out_every_request_once_in_order_whether_built_ahead_or_not() -> None:
    clock, built = FakeTime(), list[str]()
    b = builder(specs(6), budget=25, clock=clock, built=built)
    assert await b.fill() == 3  # 10 + 10 + 10: the third starts below the 25-byte budget, a fourth would not
    assert b.held_bytes == 30 and b.ready == 3
    taken = [b.take().spec.request_id for _ in range(6)]
    assert taken == [f"r{i}" for i in range(6)] and built == taken
    assert (b.built_ahead, b.built_late) == (3, 3)
    assert b.held_bytes == 0
    with pytest.raises(IndexError):
        b.take()


async def test_one_body_larger_than_the_budget_still_goes_ahead() -> None:
    b = builder(specs(2, body_bytes=100), budget=10, clock=FakeTime(), built=[])
    assert await b.fill() == 1
    assert b.take().spec.request_id == "r0" and b.built_ahead == 1


async def test_fill_stops_while_a_build_could_make_the_next_send_late() -> None:
    clock, built = FakeTime(build_s=0.004), list[str]()
    b = builder(specs(100), budget=10**9, clock=clock, built=built)
    deadline = clock.now + 0.05
    n = await b.fill(before=deadline)
    # Builds run while more than max(margin, twice the longest build) is left, so the last one started
    # with time to spare and finished before the deadline.
    assert n > 0 and clock.now < deadline
    assert deadline - clock.now <= max(REFILL_MARGIN_S, 2 * b.longest_build_s)
    assert await b.fill(before=clock.now + 0.001) == 0  # no time left: nothing built


async def test_prepared_bodies_are_the_same_bytes_as_a_list_prompt() -> None:
    """The body carries the synthesized prompt (orjson writes the numpy array) exactly as the JSON of a
    list of ints, so servers see the same request whichever way it was built."""
    synth = PromptSynthesizer(seed=3)
    client = CompletionClient(None, "http://unused", ClientConfig(model="m"), synth)  # type: ignore[arg-type]
    spec = RequestSpec(RequestId("r1"), 0.0, 1000, 5, (11, 12), 512, priority=1)
    prepared = client.prepare(spec)
    expected = build_payload(spec, "m", synth.prompt(spec))
    assert json.loads(prepared.body) == expected
    assert prepared.headers == build_headers(spec)
    recording = CompletionClient(None, "http://unused", ClientConfig(model="m", record_tokens=True), synth)  # type: ignore[arg-type]
    ids = recording.prepare(spec).prompt_ids
    assert ids == tuple(synth.prompt(spec)) and all(type(t) is int for t in ids)


def test_the_heap_is_frozen_for_the_run_and_handed_back() -> None:
    before = gc.get_freeze_count()
    with frozen_heap():
        assert gc.get_freeze_count() > before  # what was alive is out of collection's way
        garbage: list[object] = []
        garbage.append(garbage)  # a cycle made during the run is still collected
        del garbage
        assert gc.collect() >= 1
    assert gc.get_freeze_count() == 0

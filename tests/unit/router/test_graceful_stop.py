"""A graceful stop of the router (a chaos ``router_restart``), against fake engines on the virtual clock:
every request in flight ends at once with a 503, an OpenAI-style error event then ``[DONE]`` on a begun
stream, its engine's connection closed (aborting it there); requests arriving afterwards are refused."""

from __future__ import annotations

import asyncio

from cluster.router.app import SHUTTING_DOWN
from cluster.router.exchange import Whole
from tests.unit.router.conftest import workers
from tests.unit.router.fakes import STALL, Answer, FakeClient, FakeUpstream, token_events
from tests.unit.router.test_flows import MakeRouter, call, error_of, streamed
from tests.virtual_clock import VirtualClock


async def test_a_graceful_stop_ends_every_open_stream_with_an_error_event_and_refuses_new_requests(
        make_router: MakeRouter, upstream: FakeUpstream, vclock: VirtualClock) -> None:
    r = await make_router(workers(2), policy="round_robin")
    upstream.engine("http://w0", lambda s: Answer(200, [*token_events([3, 4], finish=False), STALL]))
    upstream.engine("http://w1", lambda s: Answer(200, [STALL], {"Content-Type": "application/json"}))
    streaming, whole = FakeClient(), FakeClient()

    async def scenario() -> tuple[int, list[Whole | None]]:
        tasks = [asyncio.ensure_future(r.completions(call(streamed([1, 2], 8)), streaming)),
                 asyncio.ensure_future(r.completions(call({"model": "m", "prompt": [5, 6]}), whole))]
        while len(upstream.answered) < 2 or streaming.writes < 1:
            await vclock.sleep_for(1.0)
        ended = await r.end_requests()
        return ended, list(await asyncio.gather(*tasks))

    ended, answers = await vclock.run(scenario())
    assert ended == 2
    events = streaming.events()
    assert streaming.token_ids() == [3, 4]
    err = events[-2]["error"]
    assert err["code"] == 503 and err["message"] == SHUTTING_DOWN and events[-1] == "[DONE]"
    assert answers[0] is None  # the stream was answered in place
    refused = answers[1]
    assert refused is not None and refused.status == 503 and refused.headers["Retry-After"] == "1"
    assert all(a.aborted for a in upstream.answered)  # both engines' requests were aborted
    assert r.metrics.responses.value("503") == 2
    late = await vclock.run(r.completions(call(streamed([7])), FakeClient()))
    assert late is not None and late.status == 503 and error_of(late)["message"] == SHUTTING_DOWN
    assert len(upstream.answered) == 2  # nothing more reached an engine

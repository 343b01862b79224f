"""The router's prefill/decode flow against fake engines: reserve, prefill's first token, decode's rest,
and the fallbacks when the hand-off fails (no Ray, no sockets)."""

from __future__ import annotations

import json
from collections.abc import Awaitable, Callable
from typing import Any

from multidict import CIMultiDict

from cluster.router.app import RouterServer, RouterSite
from cluster.router.exchange import Call
from config.cluster import DisaggSpec
from tests.unit.router.conftest import workers
from tests.unit.router.fakes import Answer, FakeClient, FakeUpstream, Sent, token_events
from tests.virtual_clock import VirtualClock

MakeRouter = Callable[..., Awaitable[RouterServer]]
PROMPT = list(range(16, 16 + 600))


def call(stream: bool = True, max_tokens: int = 4) -> Call:
    body = {"model": "m", "prompt": PROMPT, "max_tokens": max_tokens, "stream": stream,
            "stream_options": {"include_usage": True}}
    return Call("/v1/completions", CIMultiDict({"X-Request-Id": "req-1"}), json.dumps(body).encode())


def json_answer(obj: Any, status: int = 200) -> Answer:
    return Answer(status, [json.dumps(obj).encode()], {"Content-Type": "application/json"})


def pd_engines(upstream: FakeUpstream, decode_answer: Callable[[Sent], Answer]) -> None:
    def decode(s: Sent) -> Answer:
        if s.path == "/kvmesh/reserve":
            return json_answer({"address": "tcp://d0", "cached_blocks": 0})
        if s.path.startswith("/kvmesh/reserve/"):
            return json_answer({"cancelled": True})
        return decode_answer(s)

    def prefill(s: Sent) -> Answer:
        if s.path.startswith("/kvmesh/release/"):
            return json_answer({"released": True})
        if s.body.get("kv_transfer_params"):
            return Answer(200, token_events([100], finish=True, usage=len(PROMPT)))
        return Answer(200, token_events(list(range(101, 101 + s.body["max_tokens"])), usage=len(s.body["prompt"])))

    upstream.engine("http://d0", decode)
    upstream.engine("http://p0", prefill)


def pd_workers() -> list[Any]:
    return workers(1, role="prefill", prefix="p") + workers(1, role="decode", prefix="d")


async def test_prefill_then_decode_streams_every_token_once_in_one_identity(
        make_router: MakeRouter, upstream: FakeUpstream, vclock: VirtualClock) -> None:
    pd_engines(upstream, lambda s: Answer(200, token_events([201, 202, 203], usage=600)))
    r = await make_router(pd_workers(), site=RouterSite(disagg=DisaggSpec()))
    out = FakeClient()
    assert await vclock.run(r.completions(call(), out)) is None
    assert out.token_ids() == [100, 201, 202, 203] and out.events()[-1] == "[DONE]"
    pre = upstream.to("http://p0")[0].body
    assert pre["max_tokens"] == 1 and pre["kv_transfer_params"]["decode_address"] == "tcp://d0"
    dec = upstream.to("http://d0")[0].body
    assert dec["kv_transfer_params"]["first_token"] == 100 and dec["kv_transfer_params"]["request_id"] == "req-1"
    assert len({e["id"] for e in out.events() if isinstance(e, dict)}) == 1
    usage = next(e for e in out.events() if isinstance(e, dict) and e.get("usage"))["usage"]
    assert (usage["prompt_tokens"], usage["completion_tokens"]) == (600, 4)
    assert out.headers["X-Served-By"] == "d0"


async def test_a_failed_transfer_continues_on_the_prefill_engine_when_so_configured(
        make_router: MakeRouter, upstream: FakeUpstream, vclock: VirtualClock) -> None:
    pd_engines(upstream, lambda s: json_answer({"error": {"message": "KV transfer timed out"}}, 504))
    r = await make_router(pd_workers(), site=RouterSite(disagg=DisaggSpec(on_transfer_failure="prefill")))
    out = FakeClient()
    await vclock.run(r.completions(call(), out))
    assert out.token_ids() == [100, 101, 102, 103]
    cont = upstream.to("http://p0")[1].body
    assert cont["prompt"] == [*PROMPT, 100] and cont["max_tokens"] == 3 and "kv_transfer_params" not in cont
    fallbacks = {tuple(s.labels.values()): s.value for m in r.disagg.metrics.fallbacks.collect()  # type: ignore[union-attr]
                 for s in m.samples if s.name.endswith("_total")}
    assert fallbacks == {("prefill", "transfer_failed"): 1.0}


async def test_a_non_streamed_request_gets_one_whole_answer(
        make_router: MakeRouter, upstream: FakeUpstream, vclock: VirtualClock) -> None:
    pd_engines(upstream, lambda s: Answer(200, token_events([201, 202, 203], usage=600)))
    r = await make_router(pd_workers(), site=RouterSite(disagg=DisaggSpec()))
    answer = await vclock.run(r.completions(call(stream=False), FakeClient()))
    assert answer is not None and answer.status == 200
    body = json.loads(answer.body)
    assert body["choices"][0]["text"] == "t100 t201 t202 t203 " and body["usage"]["completion_tokens"] == 4


async def test_a_short_prompt_is_served_on_the_decode_engine_alone(
        make_router: MakeRouter, upstream: FakeUpstream, vclock: VirtualClock) -> None:
    pd_engines(upstream, lambda s: Answer(200, token_events([7, 8])))
    r = await make_router(pd_workers(), site=RouterSite(disagg=DisaggSpec(min_uncached_tokens=10_000)))
    out = FakeClient()
    await vclock.run(r.completions(call(max_tokens=2), out))
    assert out.token_ids() == [7, 8] and not upstream.to("http://p0")
    assert not upstream.to("http://d0", "/kvmesh/reserve")


async def test_no_decode_room_within_the_wait_is_a_503(
        make_router: MakeRouter, upstream: FakeUpstream, vclock: VirtualClock) -> None:
    upstream.engine("http://d0", lambda s: json_answer({"error": "full"}, 409))
    upstream.engine("http://p0", lambda s: json_answer({}))
    r = await make_router(pd_workers(), site=RouterSite(disagg=DisaggSpec(reserve_wait_ms=1000)))
    answer = await vclock.run(r.completions(call(), FakeClient()))
    assert answer is not None and answer.status == 503 and answer.headers["Retry-After"] == "1"
    assert 900 <= vclock.now_ms() <= 1000 and len(upstream.to("http://d0", "/kvmesh/reserve")) > 3

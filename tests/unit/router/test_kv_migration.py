"""The router's half of live KV migration and checkpoint resumes, against fake engines on the virtual clock
(no Ray, no sockets): following a ``kvmesh_migrated`` event to the named peer, resuming a broken stream on
its checkpoint peer, deduping a resumed stream by token index, and moving tracked streams off a worker
whose feed says it drains."""

from __future__ import annotations

import asyncio
import json
from typing import Any

from cluster.router.migration import Tracked
from cluster.router.upstream import UpstreamError
from tests.unit.router.conftest import workers
from tests.unit.router.fakes import STALL, Answer, FakeClient, FakeUpstream, Sent, event, token_events
from tests.unit.router.test_flows import MakeRouter, call, streamed
from tests.virtual_clock import VirtualClock

ADDRESS = {"backend": "tcp", "location": "127.0.0.1:1", "node": "n", "region": "local", "extra": []}
LIVE = {"live": True, "checkpoints": True, "checkpoint_every_tokens": 32}


def kv_workers(n: int) -> list[Any]:
    ws = workers(n)
    for w in ws:
        w.extra["kv_address"] = ADDRESS
    return ws


def resumed(ids: list[int], index: int) -> Answer:
    return Answer(200, token_events(ids, usage=3), {"Content-Type": "text/event-stream",
                                                    "X-Kvmesh-Token-Index": str(index)})


async def test_a_migrated_stream_goes_on_from_the_named_peer_with_no_token_repeated(
        make_router: MakeRouter, upstream: FakeUpstream, vclock: VirtualClock) -> None:
    r = await make_router(kv_workers(2), policy="round_robin", kv_migration=LIVE)
    moved = [*token_events([5, 6], finish=False), event({"kvmesh_migrated": {"to": "w1", "token_index": 2}}),
             b"data: [DONE]\n\n"]
    upstream.engine("http://w0", lambda s: Answer(200, moved))
    upstream.engine("http://w1", lambda s: resumed([6, 7, 8], 1))  # index 1: token 6 again, dropped
    out = FakeClient()
    assert await vclock.run(r.completions(call(streamed([1, 2, 3], 4)), out)) is None
    assert out.token_ids() == [5, 6, 7, 8] and out.events()[-1] == "[DONE]"
    first, = upstream.to("http://w0")
    ck = first.body["kv_transfer_params"]["checkpoint"]
    assert ck["name"] == "w1" and ck["every"] == 32  # checkpoints go to the other worker
    resume, = upstream.to("http://w1")
    params = resume.body["kv_transfer_params"]
    assert params["resume"] == "migrated" and params["request_id"] == first.headers["X-Request-Id"]
    assert resume.headers["X-Request-Id"] == first.headers["X-Request-Id"]
    assert r.kv_migrator.metrics.resumes.value("w0", "migrated", "ok") == 1
    assert r.kv_migrator.metrics.skipped.value() == 1
    assert r.metrics.migrations.value("ok") == 0  # nothing was re-prefilled
    assert not r.kv_migrator.streams.get("w0") and not r.kv_migrator.streams.get("w1")


async def test_a_broken_stream_resumes_on_its_checkpoint_peer_with_the_tokens_the_client_holds(
        make_router: MakeRouter, upstream: FakeUpstream, vclock: VirtualClock) -> None:
    r = await make_router(kv_workers(2), policy="round_robin", kv_migration=LIVE)
    upstream.engine("http://w0", lambda s: Answer(200, [*token_events([5, 6], finish=False),
                                                        UpstreamError("connection reset")]))
    upstream.engine("http://w1", lambda s: resumed([7, 8], 2))
    out = FakeClient()
    assert await vclock.run(r.completions(call(streamed([1, 2, 3], 4)), out)) is None
    assert out.token_ids() == [5, 6, 7, 8] and out.events()[-1] == "[DONE]"
    resume, = upstream.to("http://w1")
    params = resume.body["kv_transfer_params"]
    assert params["resume"] == "checkpoint" and params["output_ids"] == [5, 6] and params["source"] == "w0"
    assert r.kv_migrator.metrics.resumes.value("w0", "checkpoint", "ok") == 1


async def test_with_migrate_off_a_broken_stream_is_not_resumed_from_its_checkpoint(
        make_router: MakeRouter, upstream: FakeUpstream, vclock: VirtualClock) -> None:
    r = await make_router(kv_workers(2), policy="round_robin", kv_migration=LIVE, migrate=False)
    upstream.engine("http://w0", lambda s: Answer(200, [*token_events([5, 6], finish=False),
                                                        UpstreamError("connection reset")]))
    upstream.engine("http://w1", lambda s: resumed([7, 8], 2))
    out = FakeClient()
    assert await vclock.run(r.completions(call(streamed([1, 2, 3], 4)), out)) is None
    assert out.token_ids() == [5, 6]
    assert "error" in out.events()[-2] and out.events()[-1] == "[DONE]"
    assert not upstream.to("http://w1")  # neither resumed nor re-prefilled there
    assert r.metrics.migrations.value("failed") == 1


async def test_a_refused_resume_falls_back_to_re_prefilling_elsewhere(
        make_router: MakeRouter, upstream: FakeUpstream, vclock: VirtualClock) -> None:
    r = await make_router(kv_workers(2), policy="round_robin", kv_migration=LIVE)
    upstream.engine("http://w0", lambda s: Answer(200, [*token_events([5], finish=False),
                                                        UpstreamError("connection reset")]))

    def w1(sent: Sent) -> Answer:
        if "kv_transfer_params" in sent.body:  # no checkpoint here: 404, then a plain continuation
            return Answer(404, [b'{"error": {"message": "no checkpoint"}}'], {"Content-Type": "application/json"})
        assert sent.body["prompt"] == [1, 2, 3, 5]
        return Answer(200, token_events([9, 10, 11], usage=4))

    upstream.engine("http://w1", w1)
    out = FakeClient()
    assert await vclock.run(r.completions(call(streamed([1, 2, 3], 4)), out)) is None
    assert out.token_ids() == [5, 9, 10, 11]
    assert r.kv_migrator.metrics.resumes.value("w0", "checkpoint", "http_404") == 1
    assert r.metrics.migrations.value("ok") == 1


async def test_a_resume_that_would_leave_a_gap_is_refused(
        make_router: MakeRouter, upstream: FakeUpstream, vclock: VirtualClock) -> None:
    r = await make_router(kv_workers(2), policy="round_robin", kv_migration=LIVE)
    upstream.engine("http://w0", lambda s: Answer(200, [*token_events([5], finish=False),
                                                        UpstreamError("connection reset")]))
    upstream.engine("http://w1", lambda s: resumed([7], 2) if "kv_transfer_params" in s.body
                    else Answer(200, token_events([6, 7, 8], usage=4)))
    out = FakeClient()
    await vclock.run(r.completions(call(streamed([1, 2, 3], 4)), out))
    assert out.token_ids() == [5, 6, 7, 8]  # the peer started at index 2 while the client held 1 token
    assert r.kv_migrator.metrics.resumes.value("w0", "checkpoint", "gap") == 1


async def test_a_drain_notice_asks_the_worker_to_move_each_stream_to_the_peer_the_policy_ranks_first(
        make_router: MakeRouter, upstream: FakeUpstream, vclock: VirtualClock) -> None:
    ws = kv_workers(3)
    r = await make_router(ws, policy="least_loaded", kv_migration={"live": True})
    ws[1].running = 5  # w2 is the less loaded peer

    def w0(sent: Sent) -> Answer:
        if sent.path.startswith("/kvmesh/migrate/"):
            return Answer(200, [json.dumps({"ok": True, "migration_ms": 4.0}).encode()],
                          {"Content-Type": "application/json"})
        return Answer(200, [*token_events([5], finish=False), STALL])

    upstream.engine("http://w0", w0)
    ws[0].running = -10  # the policy sends the request to w0
    task = asyncio.ensure_future(r.completions(call(streamed([1, 2, 3], 4)), FakeClient()))
    for _ in range(20):
        await asyncio.sleep(0)
    tracked = list(r.kv_migrator.streams["w0"].values())
    assert len(tracked) == 1 and isinstance(tracked[0], Tracked)
    r.kv_migrator.on_frame(ws[0], {"t": "load", "draining": True})
    r.kv_migrator.on_frame(ws[0], {"t": "load", "draining": True})  # one evacuation per drain
    async def evacuated() -> None:
        await asyncio.gather(*r.kv_migrator._tasks)

    await vclock.run(evacuated())
    moves = upstream.to("http://w0", f"/kvmesh/migrate/{tracked[0].rid}")
    assert len(moves) == 1 and moves[0].body["peer"]["name"] == "w2"
    assert r.kv_migrator.metrics.moves.value("w0", "ok") == 1
    assert r.kv_migrator.metrics.move_seconds.sum == 0.004
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)


async def test_a_decode_engine_of_a_pd_pair_hands_its_request_to_another_decode_engine(
        make_router: MakeRouter, upstream: FakeUpstream, vclock: VirtualClock) -> None:
    from cluster.router.app import RouterSite
    from config.cluster import DisaggSpec
    from tests.unit.router.test_disagg_flow import PROMPT, call, json_answer

    ws = workers(1, role="prefill", prefix="p") + workers(2, role="decode", prefix="d")
    for w in ws:
        w.extra["kv_address"] = ADDRESS
    moved = [*token_events([201], finish=False), event({"kvmesh_migrated": {"to": "d1", "token_index": 2}}),
             b"data: [DONE]\n\n"]

    def decode(name: str) -> Any:
        def answer(s: Sent) -> Answer:
            if s.path == "/kvmesh/reserve":
                return json_answer({"address": ADDRESS, "cached_blocks": 0})
            if s.path.startswith("/kvmesh/reserve/"):
                return json_answer({"cancelled": True})
            if name == "d0":
                return Answer(200, moved)
            assert s.body["kv_transfer_params"]["resume"] == "migrated"
            return resumed([202, 203], 2)
        return answer

    upstream.engine("http://d0", decode("d0"))
    upstream.engine("http://d1", decode("d1"))
    upstream.engine("http://p0", lambda s: Answer(200, token_events([100], usage=len(PROMPT))))
    ws[2].running = 3  # the policy picks d0 to decode
    r = await make_router(ws, site=RouterSite(disagg=DisaggSpec()), policy="least_loaded", kv_migration=LIVE)
    out = FakeClient()
    assert await vclock.run(r.completions(call(), out)) is None
    assert out.token_ids() == [100, 201, 202, 203] and out.events()[-1] == "[DONE]"
    dec = upstream.to("http://d0")[0].body["kv_transfer_params"]
    assert dec["do_remote_prefill"] and dec["checkpoint"]["name"] == "d1"  # decode checkpoints go to a decode peer
    assert r.kv_migrator.metrics.resumes.value("d0", "migrated", "ok") == 1

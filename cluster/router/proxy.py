"""The colocated flow: forward a request to the ranked workers in turn, relay the answer, migrate on failure.

1. Forward to the best worker (``Attempts.on``: emulated round trip, inflight/sent bookkeeping). A connect
   failure, a read timeout or a retryable status (5xx) before any byte reached the client counts a failure
   on the worker's breaker and moves to the next (up to ``max_attempts``); none left: 502.
2. A whole (non-streamed) answer is passed back as it is. A stream is begun for the client on the worker's
   first answer and relayed event by event (``Relay``).
3. If the worker dies mid-stream (or stalls past the read timeout), the client already holds part of the
   answer: the stream migrates (``Relay.continue_on``) to other eligible workers, least loaded first, in the
   request's residency region only; none can continue it: an error event and ``[DONE]``.
4. A client that disconnects raises ``ConnectionResetError`` out of a write, or cancels the handler:
   leaving the upstream's ``async with`` closes the engine's connection, which aborts its request.
"""

from __future__ import annotations

import asyncio
import json
import re
from dataclasses import dataclass
from typing import Any

from cluster.router.attempt import Attempts
from cluster.router.choice import Chooser, RoutedRequest
from cluster.router.exchange import SSE_HEADERS, Call, ClientStream, Whole, json_error
from cluster.router.metrics import RouterMetrics
from cluster.router.migration import KVMigrator, Tracked
from cluster.router.policies import RoutingPolicy
from cluster.router.relay import MIGRATED, Relay, StreamState
from cluster.router.upstream import Upstream, UpstreamError
from cluster.router.view import RequestContext, WorkerInfo

RETRYABLE_STATUS = frozenset({500, 502, 503, 504})
DISCONNECTS = (ConnectionResetError, ConnectionAbortedError, BrokenPipeError)
PROMPT_TOKENS = re.compile(rb'"prompt_tokens":\s*([0-9]+)')
CACHED_TOKENS = re.compile(rb'"cached_tokens":\s*([0-9]+)')


def splice_json(raw: bytes, extra: dict[str, Any] | bytes) -> bytes:
    """``raw`` (a JSON object) with ``extra``'s keys appended; later keys override earlier ones. ``extra`` may be
    given encoded already: a JSON object's members and its closing brace (``splice_members``)."""
    end = raw.rstrip().rfind(b"}")
    head = raw[:end].rstrip()
    sep = b"" if head.endswith(b"{") else b","
    return head + sep + (extra if isinstance(extra, bytes) else splice_members(extra))


def splice_members(extra: dict[str, Any]) -> bytes:
    """``extra`` as ``splice_json`` appends it: its compact JSON without the opening brace."""
    return json.dumps(extra, separators=(",", ":"))[1:].encode()


_STREAM_EXTRA = splice_members({"output_token_ids": True, "stream_options": {"include_usage": True}})
"""What the router adds to a streamed request whose ``stream_options`` hold no other key (most do), encoded."""


def stream_payload(raw: bytes, body: dict[str, Any]) -> bytes:
    """A streamed request's bytes (``raw``, parsed as ``body``) with what the router needs of the engine's
    stream: token ids, and usage whatever the client asked (the client's other ``stream_options`` kept). The
    common case's addition is encoded once (``_STREAM_EXTRA``: ~8 us a request)."""
    opts = body.get("stream_options")
    if not isinstance(opts, dict) or not opts.keys() - {"include_usage"}:
        return splice_json(raw, _STREAM_EXTRA)
    return splice_json(raw, {"output_token_ids": True, "stream_options": {**opts, "include_usage": True}})


def first_token(st: StreamState) -> asyncio.Future[None]:
    """Done once what the stream's worker owes is settled (``StreamState.settle``: its first token came back, or
    its attempt ended), or at once where it owes nothing."""
    done: asyncio.Future[None] = asyncio.get_running_loop().create_future()

    def settled() -> None:
        st.on_settle = None
        if not done.done():
            done.set_result(None)

    if st.owed_to is None:
        settled()
    else:
        st.on_settle = settled
    return done


class _Failed(Exception):
    """A worker failed before any byte reached the client."""


@dataclass
class Proxied:
    """One request on its way through the colocated flow."""

    call: Call
    req: RoutedRequest
    ctx: RequestContext
    st: StreamState
    out: ClientStream
    policy: RoutingPolicy


class ColocatedFlow:
    def __init__(self, chooser: Chooser, attempts: Attempts, relay: Relay, upstream: Upstream,
                 metrics: RouterMetrics, *, max_attempts: int, migrate: bool, kv: KVMigrator | None = None) -> None:
        self.kv = kv if kv is not None and kv.enabled else None
        """Live KV migration and checkpoints (``cluster.router.migration``), when the spec enables them."""
        self.chooser = chooser
        self.attempts = attempts
        self.relay = relay
        self.upstream = upstream
        self.metrics = metrics
        self.max_attempts = max_attempts
        self.migrate_enabled = migrate

    def payload(self, p: Proxied) -> bytes:
        if not p.req.stream:
            return p.call.body
        # Append the router's needs to the client's own bytes (a later duplicate key wins in JSON parsers),
        # rather than re-encoding a body that may hold a hundred thousand token ids.
        return stream_payload(p.call.body, p.req.body)

    async def serve(self, p: Proxied, ranked: list[WorkerInfo]) -> Whole | None:
        payload = self.payload(p)
        headers = {"Content-Type": "application/json"}
        rid = p.call.headers.get("X-Request-Id")
        if not rid and self.kv is not None and p.req.stream:
            rid = self.kv.new_request_id()  # the router must name the request to move it
        if rid:
            headers["X-Request-Id"] = rid
        last_error = "no attempt made"
        for attempt, worker in enumerate(ranked[: self.max_attempts]):
            if attempt:
                self.metrics.retries.inc_labels("upstream_failure")
            try:
                return await self._attempt(p, worker, payload, headers)
            except _Failed as e:
                last_error = str(e)
                self.attempts.failed(worker)
                self.chooser.failed(p.ctx)
        self.metrics.responses.inc_labels("502")
        return json_error(502, f"every attempt failed; last: {last_error}")

    def _note_routed(self, worker: WorkerInfo, ctx: RequestContext) -> None:
        if ctx.origin_region is not None and worker.region != ctx.origin_region:
            self.metrics.cross_region.inc_labels(ctx.origin_region, worker.region)
        if ctx.num_blocks:
            hit = ctx.overlap.get(worker.name, 0) * worker.block_size
            self.metrics.predicted_hit_tokens.inc(min(hit, max(0, ctx.num_tokens - 1)))

    async def _attempt(self, p: Proxied, worker: WorkerInfo, payload: bytes, headers: dict[str, str]) -> Whole | None:
        """One worker's answer relayed to the client; raises _Failed before any byte was sent.

        The attempt's bookkeeping (the policy's and the index's record of the choice, the routing metrics, the
        blocks the worker owes) is done by ``sent``, which the upstream calls once the request is on its way and
        before any other task runs (``Upstream.request``): every later decision sees it, as when it was done
        before the send, and the engine has the request that much sooner (``bench/router_miss``). Where the
        attempt first waits an emulated round trip (``Attempt.waits``), the choice is recorded before that wait,
        as before."""
        st = p.st
        failure: str | None = None
        tracked = self._tracked(p, worker, headers)
        if tracked is not None and self.kv is not None:
            extra = self.kv.checkpoint_params(tracked)
            if extra is not None:
                payload = splice_json(payload, {"kv_transfer_params": extra})
        recorded = False

        def record() -> None:
            nonlocal recorded
            if not recorded:
                recorded = True
                self.chooser.routed(p.policy, worker, p.ctx)
                self._note_routed(worker, p.ctx)

        def sent() -> None:
            record()
            st.owe(worker, max(0, p.ctx.num_blocks - p.ctx.overlap.get(worker.name, 0)))

        attempt = self.attempts.on(worker, p.ctx.origin_region)
        if attempt.waits:
            record()
        async with attempt:
            try:
                try:
                    up = await self.upstream.request("POST", worker.url, p.call.path, payload, headers, sent)
                except BaseException as e:
                    self.chooser.complete(p.ctx)  # (its record goes with the attempt: ``Chooser.failed``)
                    if isinstance(e, UpstreamError):
                        raise _Failed(f"{worker.name}: {e}") from None
                    raise
                async with up:
                    # The request is on its way: a miss's tail (tokenizing what ranking skipped) runs a slice per
                    # loop pass beside the relay, which need not wait for it, once the worker's first token came
                    # back on a stream (``Chooser.tail_meanwhile``, ``first_token``).
                    tail = self.chooser.tail_meanwhile(p.ctx, (lambda: first_token(st)) if p.req.stream else None)
                    try:
                        if up.status in RETRYABLE_STATUS:
                            try:
                                text = (await up.read()).decode("utf-8", "replace")
                            except UpstreamError as e:
                                text = str(e)
                            raise _Failed(f"{worker.name}: HTTP {up.status}: {text[:200]}")
                        ctype = up.headers.get("Content-Type", "application/json")
                        served = {"X-Served-By": worker.name, "X-Served-Region": worker.region}
                        if not p.req.stream or not ctype.startswith("text/event-stream"):
                            try:
                                data = await up.read()
                            except UpstreamError as e:
                                raise _Failed(f"{worker.name}: {e}") from None
                            self._count_usage(data)
                            self.attempts.succeeded(worker)
                            self.metrics.responses.inc_labels(str(up.status))
                            return Whole(up.status, data, {"Content-Type": ctype, **served})
                        try:
                            await p.out.start({**SSE_HEADERS, **served})
                            if tracked is not None and self.kv is not None:
                                with self.kv.tracking(tracked):
                                    failure = await self.relay.relay(up, p.out, st)
                            else:
                                failure = await self.relay.relay(up, p.out, st)
                            if failure is None:
                                self.attempts.succeeded(worker)
                                await self.relay.finish(p.out, st)
                                self.metrics.responses.inc_labels("200")
                                await up.drain()  # the client has it all; keep the engine's connection pooled
                                return None
                        except DISCONNECTS:
                            # The client left: leaving this block closes the upstream connection, which aborts
                            # the request on the engine.
                            self.metrics.responses.inc_labels("499")
                            return None
                    finally:
                        self.chooser.end_tail(tail, p.ctx)  # (before a failed attempt's record is dropped)
            finally:
                st.settle()
        # The worker moved the request (live migration) or died mid-stream: the client holds part of the
        # answer, so continue it where its KV is (the peer, a checkpoint), else re-prefill it elsewhere.
        try:
            # A planned move (MIGRATED) is followed whatever ``migrate`` says; resuming a broken stream from
            # its checkpoint is a migration, so ``migrate: false`` turns it off as it turns off re-prefilling.
            if tracked is not None and self.kv is not None and failure is not None \
                    and (self.migrate_enabled or failure == MIGRATED):
                if failure != MIGRATED:
                    self.attempts.failed(worker)
                if await self.kv.carry_on(tracked, failure, p.out, p.req.ignore_eos,
                                          checkpoints=self.migrate_enabled):
                    await self.relay.finish(p.out, st)
                    self.metrics.responses.inc_labels("200")
                    return None
                worker = tracked.worker
            elif failure != MIGRATED:
                self.attempts.failed(worker)
        except DISCONNECTS:
            self.metrics.responses.inc_labels("499")
            return None
        try:
            await self.migrate(p, worker, failure or "stream broke")
        except DISCONNECTS:
            self.metrics.responses.inc_labels("499")
        return None

    def _tracked(self, p: Proxied, worker: WorkerInfo, headers: dict[str, str]) -> Tracked | None:
        rid = headers.get("X-Request-Id")
        if self.kv is None or not p.req.stream or not rid:
            return None
        return Tracked(rid, worker, p.st, p.req, p.ctx, p.policy)

    async def migrate(self, p: Proxied, failed: WorkerInfo, why: str) -> None:
        """Continue a broken stream on other eligible workers: prompt + streamed tokens, remaining budget.

        Up to ``max_attempts`` workers, each the least loaded one eligible at that moment (not one already
        tried): a stream cut again on its second worker goes on where the cluster stands then (a worker
        killed or draining meanwhile is no longer eligible, a replacement that joined is)."""
        st, req, ctx = p.st, p.req, p.ctx
        tried = {failed.name}
        candidates = self.chooser.eligible(req.model, ctx.residency, tried)
        if not self.migrate_enabled or not candidates:
            self.metrics.migrations.inc_labels("failed")
            await self.relay.fail(p.out, 502, f"worker failed mid-stream ({why}) and no other eligible worker "
                                              "could continue it")
            return
        self.chooser.fill_prompt(ctx, req, candidates)
        st.prompt_ids = ctx.prompt_ids
        st.prompt_tokens = len(ctx.prompt_ids)
        done_before = st.remaining is not None and st.remaining <= 0
        for _ in range(self.max_attempts):
            if not candidates:
                break
            w = min(candidates, key=lambda c: (c.load, c.name))
            if await self.relay.continue_on([w], st, model=req.model, ignore_eos=req.ignore_eos,
                                            origin=ctx.origin_region, sink=p.out):
                self.metrics.migrations.inc_labels("already_complete" if done_before else "ok")
                await self.relay.finish(p.out, st)
                self.metrics.responses.inc_labels("200")
                return
            tried.add(w.name)
            candidates = self.chooser.eligible(req.model, ctx.residency, tried)
        self.metrics.migrations.inc_labels("failed")
        await self.relay.fail(p.out, 502, f"worker failed mid-stream ({why}); migration failed too")

    def _count_usage(self, data: bytes) -> None:
        """Count a whole answer's prompt and cached tokens (read from its usage, without parsing it all)."""
        m = PROMPT_TOKENS.search(data)
        if m:
            self.metrics.prompt_tokens.inc(int(m.group(1)))
        m = CACHED_TOKENS.search(data)
        if m and m.group(1) != b"0":
            self.metrics.realized_hit_tokens.inc(int(m.group(1)))

"""Disaggregated serving through the router: a decode engine first, then a prefill engine, KV between them.

For one request (the mechanism; the policy still ranks each pool):
1. Tokenize; rank the decode pool (a decode engine's prefix overlap counts). Conditional disaggregation
   serves on the decode engine alone, counting the reason, when the prompt's uncached part is shorter
   than ``min_uncached_tokens``, when the decode engine holds ``decode_prefix_fraction`` of the prompt,
   when no prefill engine is eligible, or when every prefill engine has ``max_prefill_waiting`` queued.
2. Reserve the prompt's KV blocks on the decode engine. No room: wait (the wait is measured) and retry,
   up to ``reserve_wait_ms`` (emulated); decode memory is never double-booked.
3. Send the prompt to the best prefill engine with ``max_tokens`` 1 and the decode engine's transport
   address (push) or a request to publish (pull). Its first token goes to the client at once: TTFT is
   the prefill's, as in vLLM.
4. Send the decode engine the request with the first token; it waits for the KV (push: arrival; pull:
   it reads), admits the request and streams the rest, relayed in the client's stream shape.
5. A transfer that fails or outlives its timeout comes back as a 504: the request is continued on the
   prefill engine (which still holds its KV, so it re-prefills almost nothing) or re-prefilled on the
   decode engine, as configured; a decode engine that is gone sends it to the prefill engine. Pull
   mode releases the prefill's held blocks once the decode engine has them (or gave up).

Everything it does per worker goes through ``Attempts`` (bookkeeping), ``Relay`` (streaming, continuing)
and ``Upstream`` (HTTP), so it runs against fake engines in unit tests.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Histogram

from actors.openai_api import error_body, sse
from cluster.router.attempt import Attempts
from cluster.router.choice import Chooser, RoutedRequest
from cluster.router.exchange import SSE_HEADERS, ClientStream, Whole, json_error, json_whole
from cluster.router.migration import KVMigrator, Tracked
from cluster.router.policies import RoutingPolicy
from cluster.router.relay import MIGRATED, Collector, Relay, Sink, StreamState
from cluster.router.upstream import Upstream, UpstreamError, post_json, read_json
from cluster.router.view import RequestContext, WorkerInfo
from config.cluster import DisaggSpec


class DisaggMetrics:
    def __init__(self, registry: CollectorRegistry) -> None:
        self.decisions = Counter("kvmesh_router_disagg_decisions", "How requests were served in a P/D cluster.",
                                 ["reason"], registry=registry)
        self.reserve_wait = Histogram("kvmesh_router_decode_reserve_wait_seconds",
                                      "Emulated seconds a request waited for decode KV room.",
                                      buckets=(0.0, 0.001, 0.01, 0.05, 0.1, 0.5, 1, 5, 30, 120), registry=registry)
        self.reserve_rejections = Counter("kvmesh_router_decode_reserve_rejections",
                                          "Reservations refused for lack of decode KV room (then retried).",
                                          registry=registry)
        self.fallbacks = Counter("kvmesh_router_kv_fallbacks", "Requests finished elsewhere after a failed "
                                 "KV hand-off.", ["target", "cause"], registry=registry)


@dataclass(frozen=True)
class Plan:
    reason: str
    """'disaggregated', or why the request is served on a decode engine alone."""
    decodes: list[WorkerInfo]
    prefills: list[WorkerInfo]


class DisaggFlow:
    def __init__(self, spec: DisaggSpec, chooser: Chooser, attempts: Attempts, relay: Relay, upstream: Upstream,
                 registry: CollectorRegistry, *, max_attempts: int, kv: KVMigrator | None = None) -> None:
        self.kv = kv if kv is not None and kv.enabled else None
        """Live migration and checkpoints of the decode phase (``cluster.router.migration``), when enabled."""
        self.spec = spec
        self.chooser = chooser
        self.attempts = attempts
        self.relay = relay
        self.upstream = upstream
        self.max_attempts = max_attempts
        self.metrics = DisaggMetrics(registry)

    # -- choosing ------------------------------------------------------------------------------------
    def plan(self, policy: RoutingPolicy, req: RoutedRequest, ctx: RequestContext) -> Plan:
        c = self.chooser
        decodes = c.eligible(req.model, ctx.residency, roles=("decode",))
        if not decodes:
            return Plan("no_decode", [], [])
        c.fill_prompt(ctx, req, decodes)
        ctx.overlap = c.overlap(ctx, decodes)
        ranked_d = c.rank(policy, decodes, ctx)
        best = ranked_d[0]
        n = len(ctx.prompt_ids)
        held = min(n, ctx.overlap.get(best.name, 0) * best.block_size)
        prefills = c.eligible(req.model, ctx.residency, roles=("prefill",))
        if n - held < self.spec.min_uncached_tokens:
            return Plan("short_uncached", ranked_d, [])
        if n and held >= self.spec.decode_prefix_fraction * n:
            return Plan("decode_holds_prefix", ranked_d, [])
        if not prefills:
            return Plan("no_prefill", ranked_d, [])
        if all(w.waiting >= self.spec.max_prefill_waiting for w in prefills):
            return Plan("prefill_queue", ranked_d, [])
        pctx = RequestContext(ctx.body, ctx.session_id, ctx.origin_region, ctx.residency, ctx.prompt_ids,
                              ctx.block_hashes, {}, text=ctx.text)
        pctx.overlap = c.overlap(pctx, prefills)
        return Plan("disaggregated", ranked_d, c.rank(policy, prefills, pctx))

    # -- serving -------------------------------------------------------------------------------------
    def decide(self, policy: RoutingPolicy, req: RoutedRequest, ctx: RequestContext) -> Plan:
        """The plan, counted by its reason."""
        plan = self.plan(policy, req, ctx)
        self.metrics.decisions.labels(plan.reason).inc()
        return plan

    async def serve(self, plan: Plan, rid: str | None, req: RoutedRequest, ctx: RequestContext,
                    st: StreamState, out: ClientStream) -> Whole | None:
        """Serve ``req`` disaggregated by ``plan`` (reason 'disaggregated'): a whole answer, or None once
        streamed to ``out``."""
        rid = rid or f"pd-{uuid.uuid4().hex}"
        decode, reservation = await self._reserve(plan.decodes, rid, ctx, req)
        if decode is None or reservation is None:
            return json_error(503, "no decode engine had KV room for this request within "
                                   f"{self.spec.reserve_wait_ms:.0f} ms", {"Retry-After": "1"})
        st.identify(None, None, req.model or decode.model)
        st.prompt_ids, st.prompt_tokens = ctx.prompt_ids, len(ctx.prompt_ids)
        sink: Sink
        if req.stream:
            await out.start({**SSE_HEADERS, "X-Served-By": decode.name, "X-Served-Region": decode.region})
            sink = out
        else:
            sink = Collector()
        first = st.identify(None, None, None).first_chunk()
        if first is not None:
            await sink.write(sse(first))
        prefill = await self._prefill(plan.prefills, rid, ctx, req, decode, reservation, sink, st)
        if prefill is None:
            # No prefill engine answered: the decode engine computes the prompt itself.
            await self._cancel(decode, rid)
            self.metrics.fallbacks.labels("decode", "prefill_unavailable").inc()
            await self._continue(decode, ctx, req, sink, st)
        elif not st.finished:
            await self._decode(decode, prefill, rid, ctx, req, reservation, sink, st)
        await self.relay.finish(sink, st)
        if isinstance(sink, Collector):
            return json_whole(sink.full_response(st), headers={"X-Served-By": decode.name,
                                                                "X-Served-Region": decode.region})
        return None

    async def _reserve(self, decodes: list[WorkerInfo], rid: str, ctx: RequestContext,
                       req: RoutedRequest) -> tuple[WorkerInfo | None, dict[str, Any] | None]:
        clock = self.attempts.clock
        t0 = clock.now_ms()
        deadline = t0 + self.spec.reserve_wait_ms
        body = {"request_id": rid, "prompt": ctx.prompt_ids, "max_tokens": req.max_tokens,
                "lease_ms": self.spec.lease_ms}
        delay_ms = 5.0
        while True:
            for w in decodes:
                try:
                    async with await post_json(self.upstream, w.url, "/kvmesh/reserve", body) as r:
                        if r.status == 200:
                            self.metrics.reserve_wait.observe((clock.now_ms() - t0) / 1000.0)
                            return w, await read_json(r)
                        await r.read()  # the connection stays reusable
                        if r.status == 409:
                            self.metrics.reserve_rejections.inc()
                except UpstreamError:
                    self.attempts.failed(w)
            if clock.now_ms() + delay_ms > deadline:
                return None, None
            await clock.sleep_for(delay_ms)
            delay_ms = min(100.0, delay_ms * 2)

    async def _quietly(self, method: str, w: WorkerInfo, path: str) -> None:
        """A best-effort control call (cancel a reservation, release held blocks)."""
        try:
            async with await self.upstream.request(method, w.url, path, b"{}" if method == "POST" else b"",
                                                   {"Content-Type": "application/json"}) as r:
                await r.read()
        except UpstreamError:
            pass

    async def _cancel(self, decode: WorkerInfo, rid: str) -> None:
        await self._quietly("DELETE", decode, f"/kvmesh/reserve/{rid}")

    async def _release(self, prefill: WorkerInfo, rid: str) -> None:
        await self._quietly("POST", prefill, f"/kvmesh/release/{rid}")

    async def _prefill(self, prefills: list[WorkerInfo], rid: str, ctx: RequestContext, req: RoutedRequest,
                       decode: WorkerInfo, reservation: dict[str, Any], sink: Sink,
                       st: StreamState) -> WorkerInfo | None:
        """Run the prompt on the first prefill engine that answers; relay its first token. None if none did."""
        mode = self.spec.hand_off
        params: dict[str, Any] = {"do_remote_decode": True, "mode": mode, "request_id": rid,
                                  "skip_blocks": int(reservation.get("cached_blocks", 0)),
                                  "lease_ms": self.spec.lease_ms}
        if mode == "push":
            params["decode_address"] = reservation["address"]
        body: dict[str, Any] = {"prompt": ctx.prompt_ids, "max_tokens": 1, "stream": True,
                                "output_token_ids": True, "stream_options": {"include_usage": True},
                                "kv_transfer_params": params}
        if req.model:
            body["model"] = req.model
        for w in prefills[: self.max_attempts]:
            async with self.attempts.on(w, ctx.origin_region):
                try:
                    async with await post_json(self.upstream, w.url, "/v1/completions", body,
                                               {"X-Request-Id": rid}) as up:
                        if up.status == 200:
                            before = len(st.token_ids)
                            failure = await self.relay.relay(up, sink, st, rewrite=True,
                                                             final=req.max_tokens == 1)
                            if failure is None or len(st.token_ids) > before:
                                self.attempts.succeeded(w)
                                st.finished = req.max_tokens == 1
                                return w
                except UpstreamError:
                    pass
                self.attempts.failed(w)
        return None

    async def _decode(self, decode: WorkerInfo, prefill: WorkerInfo, rid: str, ctx: RequestContext,
                      req: RoutedRequest, reservation: dict[str, Any], sink: Sink, st: StreamState) -> None:
        mode = self.spec.hand_off
        params: dict[str, Any] = {"do_remote_prefill": True, "mode": mode, "request_id": rid,
                                  "first_token": st.token_ids[-1], "timeout_ms": self.spec.transfer_timeout_ms}
        if mode == "pull":
            params["prefill_address"] = prefill.extra.get("kv_address")
        tracked = Tracked(rid, decode, st, req, ctx, self.chooser.policy) if self.kv is not None else None
        if tracked is not None and self.kv is not None:
            params.update(self.kv.checkpoint_params(tracked) or {})
        body: dict[str, Any] = {"prompt": ctx.prompt_ids, "max_tokens": req.max_tokens, "stream": True,
                                "output_token_ids": True, "ignore_eos": req.ignore_eos,
                                "stream_options": {"include_usage": True}, "kv_transfer_params": params}
        if req.model:
            body["model"] = req.model
        async with self.attempts.on(decode, None):
            try:
                async with await post_json(self.upstream, decode.url, "/v1/completions", body,
                                           {"X-Request-Id": rid}) as up:
                    if mode == "pull":
                        await self._release(prefill, rid)
                    if up.status == 200:
                        if tracked is not None and self.kv is not None:
                            with self.kv.tracking(tracked):
                                failure = await self.relay.relay(up, sink, st, rewrite=True)
                        else:
                            failure = await self.relay.relay(up, sink, st, rewrite=True)
                        if failure is None:
                            self.attempts.succeeded(decode)
                            return
                        cause, target = "decode_failed", prefill
                    elif up.status == 504:
                        cause = "transfer_failed"
                        target = prefill if self.spec.on_transfer_failure == "prefill" else decode
                    else:
                        cause, target = f"decode_http_{up.status}", prefill
            except UpstreamError:
                cause, target = "decode_unreachable", prefill
        if cause == "decode_failed" and tracked is not None and self.kv is not None and failure is not None:
            # the decode engine moved the request (live migration) or died: go on where its KV is
            if failure != MIGRATED:
                self.attempts.failed(decode)
            if mode == "pull":
                await self._release(prefill, rid)
            if await self.kv.carry_on(tracked, failure, sink, req.ignore_eos):
                return
            self.metrics.fallbacks.labels("prefill", "decode_failed").inc()
            await self._continue(prefill, ctx, req, sink, st)
            return
        if cause != "transfer_failed":
            self.attempts.failed(decode)
            await self._cancel(decode, rid)
        if mode == "pull":
            await self._release(prefill, rid)
        self.metrics.fallbacks.labels("prefill" if target is prefill else "decode", cause).inc()
        await self._continue(target, ctx, req, sink, st)

    async def _continue(self, w: WorkerInfo, ctx: RequestContext, req: RoutedRequest, sink: Sink,
                        st: StreamState) -> None:
        """Finish the request on ``w`` as an ordinary request: prompt plus the tokens already sent."""
        if not await self.relay.continue_on([w], st, model=req.model, ignore_eos=req.ignore_eos,
                                            origin=ctx.origin_region, sink=sink):
            await sink.write(sse(error_body(502, f"the request could not be finished on {w.name}")))

"""Disaggregated serving through the router: a decode engine first, then a prefill engine, KV between them.

For one request (the mechanism; the policy still ranks each pool):
1. Tokenize; rank the decode pool (a decode engine's prefix overlap counts). Conditional disaggregation
   serves on the decode engine alone, counting the reason, when the prompt's uncached part is shorter
   than ``min_uncached_tokens``, when the decode engine holds ``decode_prefix_fraction`` of the prompt,
   when no prefill engine is eligible, or when every prefill engine has ``max_prefill_waiting`` queued.
2. Reserve the prompt's KV blocks on the decode engine. No room: wait (the wait is measured) and retry,
   up to ``reserve_wait_ms``; decode memory is never double-booked.
3. Send the prompt to the best prefill engine with ``max_tokens`` 1 and the decode engine's transport
   address (push) or a request to publish (pull). Its first token goes to the client at once: TTFT is
   the prefill's, as in vLLM.
4. Send the decode engine the request with the first token; it waits for the KV (push: arrival; pull:
   it reads), admits the request and streams the rest, relayed in the client's stream shape.
5. A transfer that fails or outlives its timeout comes back as a 504: the request is continued on the
   prefill engine (which still holds its KV, so it re-prefills almost nothing) or re-prefilled on the
   decode engine, as configured; a decode engine that is gone sends it to the prefill engine. Pull
   mode releases the prefill's held blocks once the decode engine has them (or gave up).
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from typing import TYPE_CHECKING, Any

from prometheus_client import Counter, Histogram

from actors.openai_api import error_body, sse
from cluster.router.http_server import Answer, Request, Response, StreamResponse, json_error, json_response
from cluster.router.upstream import UpstreamError, UpstreamResponse
from cluster.router.view import STREAM_KEY, RequestContext, WorkerId, WorkerInfo
from config.cluster import DisaggSpec

if TYPE_CHECKING:
    from cluster.router.app import RoutedRequest, RouterServer, _Stream
    from cluster.router.policies.base import RoutingPolicy


class DisaggMetrics:
    def __init__(self, registry: Any) -> None:
        self.decisions = Counter("kvmesh_router_disagg_decisions", "How requests were served in a P/D cluster.",
                                 ["reason"], registry=registry)
        self.reserve_wait = Histogram("kvmesh_router_decode_reserve_wait_seconds",
                                      "Wall time a request waited for decode KV room.",
                                      buckets=(0.0, 0.001, 0.01, 0.05, 0.1, 0.5, 1, 5, 30, 120), registry=registry)
        self.reserve_rejections = Counter("kvmesh_router_decode_reserve_rejections",
                                          "Reservations refused for lack of decode KV room (then retried).",
                                          registry=registry)
        self.fallbacks = Counter("kvmesh_router_kv_fallbacks", "Requests finished elsewhere after a failed "
                                 "KV hand-off.", ["target", "cause"], registry=registry)


class _Collector:
    """A stand-in for a client stream: collects the SSE bytes of a non-streaming disaggregated request."""

    def __init__(self) -> None:
        self.parts: list[bytes] = []

    async def write(self, data: bytes) -> None:
        self.parts.append(data)

    async def write_eof(self, data: bytes = b"") -> None:
        return None

    def events(self) -> list[dict[str, Any]]:
        out = []
        for ev in b"".join(self.parts).split(b"\n\n"):
            if ev.startswith(b"data: {"):
                out.append(json.loads(ev[6:]))
        return out


class DisaggFlow:
    def __init__(self, server: RouterServer, spec: DisaggSpec) -> None:
        self.server = server
        self.spec = spec
        self.metrics = DisaggMetrics(server.metrics.registry)

    # -- choosing ------------------------------------------------------------------------------------
    def pool(self, role: str, model: str | None, residency: str | None,
             exclude: set[WorkerId] | None = None) -> list[WorkerInfo]:
        return self.server.eligible(model, residency, exclude, roles=(role,))

    def plan(self, policy: RoutingPolicy, req: RoutedRequest, ctx: RequestContext,
             residency: str | None) -> tuple[str, list[WorkerInfo], list[WorkerInfo]]:
        """(reason, ranked decode engines, ranked prefill engines); reason 'disaggregated' or why not."""
        s = self.server
        decodes = self.pool("decode", req.model, residency)
        if not decodes:
            return "no_decode", [], []
        s._fill_prompt(ctx, req, decodes)
        s._overlap(ctx, decodes)
        ranked_d = s.rank(policy, decodes, ctx)
        best = ranked_d[0]
        n = len(ctx.prompt_ids)
        held = min(n, ctx.overlap.get(best.name, 0) * best.block_size)
        prefills = self.pool("prefill", req.model, residency)
        if n - held < self.spec.min_uncached_tokens:
            return "short_uncached", ranked_d, []
        if n and held >= self.spec.decode_prefix_fraction * n:
            return "decode_holds_prefix", ranked_d, []
        if not prefills:
            return "no_prefill", ranked_d, []
        if all(w.waiting >= self.spec.max_prefill_waiting for w in prefills):
            return "prefill_queue", ranked_d, []
        pctx = RequestContext(ctx.body, ctx.session_id, ctx.origin_region, ctx.residency, ctx.prompt_ids,
                              ctx.block_hashes, {}, ctx.text)
        s._overlap(pctx, prefills)
        return "disaggregated", ranked_d, s.rank(policy, prefills, pctx)

    # -- serving -------------------------------------------------------------------------------------
    async def serve(self, request: Request, req: RoutedRequest, ctx: RequestContext, policy: RoutingPolicy,
                    st: _Stream) -> Answer | None:
        """Serve ``req`` disaggregated; None when it should be served on a decode engine alone instead."""
        reason, decodes, prefills = self.plan(policy, req, ctx, ctx.residency)
        self.metrics.decisions.labels(reason).inc()
        if reason != "disaggregated":
            return None
        rid = request.headers.get("X-Request-Id") or f"pd-{uuid.uuid4().hex}"
        decode, reservation = await self._reserve(decodes, rid, ctx, req)
        if decode is None or reservation is None:
            self.server.metrics.responses.inc_labels("503")
            return json_error(503, "no decode engine had KV room for this request within "
                                   f"{self.spec.reserve_wait_ms:.0f} ms", {"Retry-After": "1"})
        st.first_id = ("chatcmpl-" if st.chat else "cmpl-") + uuid.uuid4().hex
        st.created, st.model = int(time.time()), req.model or decode.model
        st.prompt_ids, st.prompt_tokens = ctx.prompt_ids, len(ctx.prompt_ids)
        sink: StreamResponse | _Collector
        if req.stream:
            sink = StreamResponse(status=200, headers={"Content-Type": "text/event-stream",
                                                       "Cache-Control": "no-cache",
                                                       "X-Served-By": decode.name,
                                                       "X-Served-Region": decode.region})
            await sink.prepare(request)
            request[STREAM_KEY] = sink
        else:
            sink = _Collector()
        if st.chat:
            await sink.write(sse({"id": st.first_id, "object": "chat.completion.chunk", "created": st.created,
                                  "model": st.model, "choices": [{"index": 0, "delta": {"role": "assistant",
                                                                                         "content": ""},
                                                                  "logprobs": None, "finish_reason": None}]}))
        prefill = await self._prefill(prefills, rid, ctx, req, decode, reservation, sink, st)
        if prefill is None:
            # No prefill engine answered: the decode engine computes the prompt itself.
            await self._cancel(decode, rid)
            self.metrics.fallbacks.labels("decode", "prefill_unavailable").inc()
            await self._continue(decode, ctx, req, sink, st)
        elif not st.finished:
            await self._decode(decode, prefill, rid, ctx, req, reservation, sink, st)
        await self.server._finish_stream(sink, st)
        if isinstance(sink, _Collector):
            return self._full_response(sink, st, decode)
        self.server.metrics.responses.inc_labels("200")
        return sink

    async def _post(self, w: WorkerInfo, path: str, body: dict[str, Any],
                    headers: dict[str, str] | None = None) -> UpstreamResponse:
        return await self.server.upstream.post(w.url, path, json.dumps(body).encode(),
                                               {"Content-Type": "application/json", **(headers or {})})

    async def _reserve(self, decodes: list[WorkerInfo], rid: str, ctx: RequestContext,
                       req: RoutedRequest) -> tuple[WorkerInfo | None, dict[str, Any] | None]:
        t0 = time.monotonic()
        deadline = t0 + self.spec.reserve_wait_ms / 1000.0 * self.server.settings.time_scale
        body = {"request_id": rid, "prompt": ctx.prompt_ids, "max_tokens": req.max_tokens,
                "lease_ms": self.spec.lease_ms}
        delay = 0.005
        while True:
            for w in decodes:
                try:
                    async with await self._post(w, "/kvmesh/reserve", body) as r:
                        if r.status == 200:
                            self.metrics.reserve_wait.observe(time.monotonic() - t0)
                            return w, await r.json()
                        await r.read()  # the connection stays reusable
                        if r.status == 409:
                            self.metrics.reserve_rejections.inc()
                            continue
                except UpstreamError:
                    self.server._failed(w)
            if time.monotonic() + delay > deadline:
                return None, None
            await asyncio.sleep(delay)
            delay = min(0.1, delay * 2)

    async def _cancel(self, decode: WorkerInfo, rid: str) -> None:
        try:
            async with await self.server.upstream.request("DELETE", decode.url, f"/kvmesh/reserve/{rid}") as r:
                await r.read()
        except UpstreamError:
            pass

    async def _release(self, prefill: WorkerInfo, rid: str) -> None:
        try:
            async with await self._post(prefill, f"/kvmesh/release/{rid}", {}) as r:
                await r.read()
        except UpstreamError:
            pass

    async def _prefill(self, prefills: list[WorkerInfo], rid: str, ctx: RequestContext, req: RoutedRequest,
                       decode: WorkerInfo, reservation: dict[str, Any], sink: Any, st: _Stream) -> WorkerInfo | None:
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
        for w in prefills[: self.server.settings.max_attempts]:
            await self.server._remote_wait(w, ctx)
            w.inflight += 1
            w.sent += 1
            self.server.metrics.selected.inc_labels(w.name)
            try:
                async with await self._post(w, "/v1/completions", body, {"X-Request-Id": rid}) as up:
                    if up.status != 200:
                        self.server._failed(w)
                        continue
                    before = len(st.token_ids)
                    failure = await self.server._relay(up, sink, st, rewrite=True, final=req.max_tokens == 1)
                    if failure is None or len(st.token_ids) > before:
                        w.breaker.success()
                        st.finished = req.max_tokens == 1
                        return w
                    self.server._failed(w)
            except UpstreamError:
                self.server._failed(w)
            finally:
                w.inflight -= 1
        return None

    async def _decode(self, decode: WorkerInfo, prefill: WorkerInfo, rid: str, ctx: RequestContext,
                      req: RoutedRequest, reservation: dict[str, Any], sink: Any, st: _Stream) -> None:
        mode = self.spec.hand_off
        params: dict[str, Any] = {"do_remote_prefill": True, "mode": mode, "request_id": rid,
                                  "first_token": st.token_ids[-1], "timeout_ms": self.spec.transfer_timeout_ms}
        if mode == "pull":
            params["prefill_address"] = prefill.extra.get("kv_address")
        body: dict[str, Any] = {"prompt": ctx.prompt_ids, "max_tokens": req.max_tokens, "stream": True,
                                "output_token_ids": True, "ignore_eos": req.ignore_eos,
                                "stream_options": {"include_usage": True}, "kv_transfer_params": params}
        if req.model:
            body["model"] = req.model
        cause = None
        decode.inflight += 1
        decode.sent += 1
        try:
            async with await self._post(decode, "/v1/completions", body, {"X-Request-Id": rid}) as up:
                if mode == "pull":
                    await self._release(prefill, rid)
                if up.status == 200:
                    failure = await self.server._relay(up, sink, st, rewrite=True)
                    if failure is None:
                        decode.breaker.success()
                        return
                    cause, target = "decode_failed", prefill
                elif up.status == 504:
                    cause = "transfer_failed"
                    target = prefill if self.spec.on_transfer_failure == "prefill" else decode
                else:
                    cause, target = f"decode_http_{up.status}", prefill
        except UpstreamError:
            cause, target = "decode_unreachable", prefill
        finally:
            decode.inflight -= 1
        if cause != "transfer_failed":
            self.server._failed(decode)
            await self._cancel(decode, rid)
        if mode == "pull":
            await self._release(prefill, rid)
        self.metrics.fallbacks.labels("prefill" if target is prefill else "decode", cause).inc()
        await self._continue(target, ctx, req, sink, st)

    async def _continue(self, w: WorkerInfo, ctx: RequestContext, req: RoutedRequest, sink: Any,
                        st: _Stream) -> None:
        """Finish the request on ``w`` as an ordinary request: prompt plus the tokens already sent."""
        remaining = None if req.max_tokens is None else req.max_tokens - len(st.token_ids)
        if remaining is not None and remaining <= 0:
            st.finished = True
            return
        body: dict[str, Any] = {"prompt": ctx.prompt_ids + st.token_ids, "stream": True, "output_token_ids": True,
                                "ignore_eos": req.ignore_eos, "stream_options": {"include_usage": True}}
        if remaining is not None:
            body["max_tokens"] = remaining
        if req.model:
            body["model"] = req.model
        w.inflight += 1
        w.sent += 1
        try:
            async with await self._post(w, "/v1/completions", body) as up:
                if up.status == 200 and await self.server._relay(up, sink, st, rewrite=True) is None:
                    return
        except UpstreamError:
            pass
        finally:
            w.inflight -= 1
        await sink.write(sse(error_body(502, f"the request could not be finished on {w.name}")))

    def _full_response(self, sink: _Collector, st: _Stream, decode: WorkerInfo) -> Response:
        events = sink.events()
        text = ""
        finish = None
        for ev in events:
            for c in ev.get("choices") or []:
                text += c.get("text") or (c.get("delta") or {}).get("content") or ""
                finish = c.get("finish_reason") or finish
        prompt = len(st.prompt_ids)
        usage = {"prompt_tokens": prompt, "total_tokens": prompt + len(st.token_ids),
                 "completion_tokens": len(st.token_ids)}
        choice: dict[str, Any] = ({"index": 0, "message": {"role": "assistant", "content": text},
                                   "logprobs": None, "finish_reason": finish} if st.chat else
                                  {"index": 0, "text": text, "logprobs": None, "finish_reason": finish,
                                   "stop_reason": None})
        body = {"id": st.first_id, "object": "chat.completion" if st.chat else "text_completion",
                "created": st.created, "model": st.model, "choices": [choice], "usage": usage}
        self.server.metrics.responses.inc_labels("200")
        return json_response(body, headers={"X-Served-By": decode.name, "X-Served-Region": decode.region})



"""The router: OpenAI API in, the chosen engine's response streamed straight back out.

Per request the mechanism (this module) owns everything but the choice itself:
1. parse and validate the body (the same 400s an engine gives, without bothering one);
2. eligible workers: healthy (feed alive), breaker closed, serving the model, and, when the request
   names a residency region (header ``X-Residency`` or body ``residency``), *only* that region's: a hard
   filter on the first try, on retries and on migration. None left: a 503 that says why;
3. when every eligible worker is saturated (``max_waiting`` queued), a 429 with ``Retry-After``;
4. the region strategy picks the pool and the policy ranks it (``X-Route-Policy`` may override);
5. forward to the best; a remote region first pays the emulated round trip; on a connect failure or a
   5xx before any byte reached the client, try the next (``max_attempts``); the breaker counts failures;
6. stream SSE events through as they arrive; if the worker dies mid-stream, migrate: send the prompt
   plus every token already streamed to another eligible worker and continue the same stream, so the
   client sees no token missing or repeated;
7. a client that disconnects closes the upstream connection, which aborts the request on the engine.
Everything is counted in Prometheus metrics.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import random
import re
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import aiohttp
from prometheus_client import generate_latest

from actors.cost_model import RooflineCostModel, StepShape
from actors.engine.kv_blocks import hash_request_blocks
from actors.engine.tokenizer import Tokenizer
from actors.openai_api import (
    MAX_BODY_BYTES,
    SSE_DONE,
    ApiError,
    ChatCompletionRequest,
    error_body,
    parse_json_object,
    sse,
    validate_request,
)
from cluster.router.disagg import DisaggFlow
from cluster.router.feed import FeedClient
from cluster.router.http_server import (
    Answer,
    HTTPServer,
    Request,
    Response,
    StreamResponse,
    json_error,
    json_response,
)
from cluster.router.metrics import RouterMetrics
from cluster.router.policies import POLICIES, RoutingPolicy, make_policy
from cluster.router.prefix_index import ApproximateIndex, PrefixIndex
from cluster.router.regions import Topology, global_rank, regional_split
from cluster.router.upstream import UpstreamError, UpstreamPool, UpstreamResponse
from cluster.router.view import STREAM_KEY, ClusterView, RequestContext, RoutingConfig, WorkerId, WorkerInfo
from config.cluster import DisaggSpec

RETRYABLE_STATUS = {500, 502, 503, 504}
JSON_HEADERS = {"Content-Type": "application/json"}
DISCONNECTS = (ConnectionResetError, ConnectionAbortedError, BrokenPipeError)
TOKEN_IDS = re.compile(rb'"token_ids":\[([0-9,]*)\]')
PROMPT_TOKENS = re.compile(rb'"prompt_tokens":\s*([0-9]+)')
CACHED_TOKENS = re.compile(rb'"cached_tokens":\s*([0-9]+)')
PREFIX_POLICIES = {"kv_aware", "prefix_hash"}


@dataclass(frozen=True)
class RouterSettings:
    policy: str = "round_robin"
    policy_params: dict[str, Any] = field(default_factory=dict)
    region_strategy: str = "REGIONAL"
    region: str | None = None
    """The router's own region: requests that name no origin come from here."""
    residency_zone: str | None = None
    """A router partitioned to one residency zone sees only that region's workers."""
    max_attempts: int = 3
    request_timeout_s: float = 600.0
    time_scale: float = 1.0
    rtt_ms: dict[tuple[str, str], float] = field(default_factory=dict)
    max_waiting: int | None = None
    """Saturation: a worker with this many queued requests takes no more (429 when all are)."""
    index_mode: str = "events"
    """``events`` (engines' KV events) or ``approximate`` (what the router sent where, with a TTL)."""
    approx_ttl_ms: float = 120_000.0
    health_timeout_s: float = 2.0
    migrate: bool = True
    seed: int = 0
    disagg: DisaggSpec | None = None
    """How to serve through prefill and decode engines, when the cluster has them."""


class _UpstreamFailed(Exception):
    """A worker failed; ``sent_bytes`` says whether the client already received part of the answer."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


@dataclass(frozen=True)
class RoutedRequest:
    """The few fields the router reads; the engine validates the whole request."""

    body: dict[str, Any]
    chat: bool
    model: str | None
    stream: bool
    include_usage: bool
    max_tokens: int | None
    ignore_eos: bool

    @staticmethod
    def of(body: dict[str, Any], chat: bool) -> RoutedRequest:
        model = body.get("model")
        if model is not None and not isinstance(model, str):
            raise ApiError(400, "invalid field 'model': Input should be a valid string", "model")
        opts = body.get("stream_options")
        limit = body.get("max_completion_tokens", body.get("max_tokens")) if chat else body.get("max_tokens", 16)
        return RoutedRequest(body, chat, model, body.get("stream") is True,
                             isinstance(opts, dict) and opts.get("include_usage") is True,
                             limit if isinstance(limit, int) else None, body.get("ignore_eos") is True)


def splice_json(raw: bytes, extra: dict[str, Any]) -> bytes:
    """``raw`` (a JSON object) with ``extra``'s keys appended; later keys override earlier ones."""
    end = raw.rstrip().rfind(b"}")
    head = raw[:end].rstrip()
    sep = b"" if head.endswith(b"{") else b","
    return head + sep + json.dumps(extra, separators=(",", ":"))[1:].encode()


@dataclass
class _Stream:
    """State of one streamed answer, kept to migrate it if its worker dies."""

    chat: bool
    client_usage: bool
    max_tokens: int | None
    prompt_ids: list[int] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)
    first_id: str | None = None
    created: int | None = None
    model: str | None = None
    finished: bool = False
    cached_tokens: int | None = None
    prompt_tokens: int | None = None
    owed_to: WorkerInfo | None = None
    prefill_owed: int = 0

    def owe(self, worker: WorkerInfo, blocks: int) -> None:
        """``worker`` has ``blocks`` of this prompt to prefill until its first token comes back."""
        self.settle()
        self.owed_to, self.prefill_owed = worker, blocks
        worker.prefilling_blocks += blocks

    def settle(self) -> None:
        if self.owed_to is not None:
            self.owed_to.prefilling_blocks -= self.prefill_owed
            self.owed_to, self.prefill_owed = None, 0


class RouterServer:
    def __init__(self, workers: list[WorkerInfo], settings: RouterSettings | None = None, *,
                 host: str = "127.0.0.1", port: int = 0,
                 prefill_ms: Callable[[WorkerInfo, int, int], float] | None = None,
                 now: Callable[[], float] = time.monotonic) -> None:
        self.settings = settings or RouterSettings()
        s = self.settings
        if s.residency_zone is not None:
            workers = [w for w in workers if w.region == s.residency_zone]
        self.view = ClusterView(workers, RoutingConfig(health_timeout_s=s.health_timeout_s,
                                                       require_feed=s.index_mode == "events"), now)
        self.rng = random.Random(s.seed)
        self.policy = make_policy(s.policy, self.rng, s.policy_params)
        self._policies: dict[str, RoutingPolicy] = {s.policy: self.policy}
        self.topology = Topology(s.rtt_ms)
        self.index = PrefixIndex()
        self.approx = ApproximateIndex(s.approx_ttl_ms)
        self.prefill_estimate = prefill_ms or default_prefill_estimate()
        self.host = host
        self.port = port
        self.timeout = aiohttp.ClientTimeout(total=None, sock_connect=5.0)
        self.metrics = RouterMetrics()
        self.feeds: dict[WorkerId, FeedClient] = {}
        self._tokenizers: dict[int, Tokenizer] = {}
        self._http: HTTPServer | None = None
        self._session: aiohttp.ClientSession | None = None
        self.upstream = UpstreamPool(connect_timeout_s=5.0)
        self._deadlines: dict[asyncio.Task[Any], float] = {}
        self._expired: set[asyncio.Task[Any]] = set()
        self._sweeper: asyncio.Task[None] | None = None
        self.url = ""
        roles = {w.role for w in self.view.workers.values()}
        self.disagg = DisaggFlow(self, s.disagg) if s.disagg is not None and {"prefill", "decode"} <= roles else None
        self.whole_request_roles: tuple[str, ...] = ("colocated", "decode")

    # -- lifecycle ---------------------------------------------------------------------------------
    def http_server(self) -> HTTPServer:
        srv = HTTPServer(max_body=MAX_BODY_BYTES)
        srv.add("POST", "/v1/completions", self.completions)
        srv.add("POST", "/v1/chat/completions", self.chat_completions)
        srv.add("GET", "/v1/models", self.models)
        srv.add("GET", "/health", self.health)
        srv.add("GET", "/metrics", self.prometheus)
        srv.add("GET", "/workers", self.list_workers)
        srv.add("POST", "/workers", self.add_worker)
        srv.add("DELETE", "/workers/{name}", self.remove_worker)
        return srv

    async def start(self) -> str:
        self._session = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0, keepalive_timeout=60),
                                              timeout=self.timeout, auto_decompress=False)
        if self.settings.index_mode == "events":
            for w in self.view.workers.values():
                self._start_feed(w)
        self._http = self.http_server()
        self.port = await self._http.start(self.host, self.port)
        self._sweeper = asyncio.get_running_loop().create_task(self._sweep_deadlines())
        self.url = f"http://{self.host}:{self.port}"
        return self.url

    async def stop(self) -> None:
        if self._sweeper is not None:
            self._sweeper.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._sweeper
            self._sweeper = None
        for f in list(self.feeds.values()):
            await f.stop()
        self.feeds.clear()
        if self._http is not None:
            await self._http.stop()
            self._http = None
        if self._session is not None:
            await self._session.close()
            self._session = None
        self.upstream.close()

    def _start_feed(self, w: WorkerInfo) -> None:
        assert self._session is not None
        feed = FeedClient(w, self.index, self._session, self.view.now)
        self.feeds[w.name] = feed
        feed.start()

    # -- membership --------------------------------------------------------------------------------
    async def add_worker(self, request: Request) -> Response:
        try:
            d = await request.json()
            w = WorkerInfo.from_launch(str(d["name"]), d)
        except (ValueError, KeyError, TypeError) as e:
            return json_error(400, f"a worker needs at least 'name' and 'url': {e}")
        if self.settings.residency_zone is not None and w.region != self.settings.residency_zone:
            return json_error(400, f"this router serves residency zone {self.settings.residency_zone!r} only")
        old = self.view.workers.get(w.name)
        if old is not None:
            await self._drop(old.name)
        self.view.add(w)
        if self.settings.index_mode == "events":
            self._start_feed(w)
        return json_response({"added": w.name})

    async def remove_worker(self, request: Request) -> Response:
        name = WorkerId(request.match_info["name"])
        if name not in self.view.workers:
            return json_error(404, f"no worker {name!r}")
        await self._drop(name)
        return json_response({"removed": name})

    async def _drop(self, name: WorkerId) -> None:
        feed = self.feeds.pop(name, None)
        if feed is not None:
            await feed.stop()
        self.view.remove(name)
        self.index.drop_worker(name)
        self.approx.drop_worker(name)

    # -- simple endpoints --------------------------------------------------------------------------
    async def health(self, request: Request) -> Response:
        if not any(self.view.eligible(w) for w in self.view.workers.values()):
            return json_error(503, "no eligible worker")
        return Response(status=200)

    async def models(self, request: Request) -> Response:
        now = int(time.time())
        return json_response({"object": "list", "data": [
            {"id": m, "object": "model", "created": now, "owned_by": "kvmesh", "root": m, "parent": None}
            for m in self.view.models()]})

    async def list_workers(self, request: Request) -> Response:
        return json_response([{
            "name": w.name, "url": w.url, "role": w.role, "region": w.region, "node": w.node, "model": w.model,
            "hardware": w.hardware, "inflight": w.inflight, "sent": w.sent, "running": w.running,
            "waiting": w.waiting, "kv_usage": w.kv_usage, "free_blocks": w.free_blocks,
            "num_blocks": w.num_blocks, "prefill_backlog_tokens": w.prefill_backlog_tokens,
            "prefilling_blocks": w.prefilling_blocks, "lag_p99_ms": w.lag_p99_ms, "healthy": self.view.healthy(w),
            "eligible": self.view.eligible(w), "breaker": w.breaker.state, "feed": w.feed_connected,
            "indexed_blocks": self.index.blocks_of(w.name)} for w in self.view.workers.values()])

    async def prometheus(self, request: Request) -> Response:
        m = self.metrics
        for w in self.view.workers.values():
            lv = (w.name, w.region)
            m.w_inflight.labels(*lv).set(w.inflight)
            m.w_running.labels(*lv).set(w.running)
            m.w_waiting.labels(*lv).set(w.waiting)
            m.w_kv.labels(*lv).set(w.kv_usage)
            m.w_healthy.labels(*lv).set(1 if self.view.eligible(w) else 0)
        return Response(body=generate_latest(m.registry),
                        headers={"Content-Type": "text/plain; version=0.0.4; charset=utf-8"})

    # -- routing -----------------------------------------------------------------------------------
    def _tokenizer(self, vocab: int) -> Tokenizer:
        tok = self._tokenizers.get(vocab)
        if tok is None:
            tok = self._tokenizers[vocab] = Tokenizer(vocab)
        return tok

    def _policy(self, name: str | None) -> RoutingPolicy:
        if not name:
            return self.policy
        if name not in POLICIES:
            raise ApiError(400, f"unknown routing policy {name!r} in X-Route-Policy "
                                f"(known: {', '.join(sorted(POLICIES))})")
        p = self._policies.get(name)
        if p is None:
            p = self._policies[name] = make_policy(name, self.rng, self.settings.policy_params)
        return p

    def _fill_prompt(self, ctx: RequestContext, req: RoutedRequest, workers: list[WorkerInfo]) -> None:
        """Token ids and block hashes as the engines will compute them (same tokenizer, same hashing).

        The engine validates the request; here a prompt that is not one of the accepted shapes just
        yields no ids (the engine's 400 will reach the client).
        """
        if ctx.prompt_ids or not workers:
            return
        tok = self._tokenizer(workers[0].vocab_size)
        try:
            if req.chat:
                chat = validate_request(req.body, ChatCompletionRequest)
                pairs = [(m.role, m.text()) for m in chat.messages]
                ctx.prompt_ids = tok.chat_prompt(pairs)
                ctx.text = "".join(t for _, t in pairs)
            else:
                p = req.body.get("prompt")
                if isinstance(p, list) and len(p) == 1 and isinstance(p[0], str | list):
                    p = p[0]
                if isinstance(p, str):
                    ctx.prompt_ids, ctx.text = tok.encode(p), p
                elif isinstance(p, list) and all(isinstance(x, int) for x in p):
                    ctx.prompt_ids = p
        except ApiError:
            return
        ctx.block_hashes = [int(h) for h in hash_request_blocks(ctx.prompt_ids, workers[0].block_size)]

    def _overlap(self, ctx: RequestContext, workers: list[WorkerInfo]) -> None:
        names = [w.name for w in workers]
        if self.settings.index_mode == "events":
            ctx.overlap = self.index.overlap(ctx.block_hashes, names)
        else:
            ctx.overlap = self.approx.overlap(ctx.block_hashes, names, self.view.now() * 1000.0)

    def eligible(self, model: str | None, residency: str | None, exclude: set[WorkerId] | None = None,
                 roles: tuple[str, ...] | None = None) -> list[WorkerInfo]:
        """Workers that may serve: healthy, breaker closed, the model, the residency region, the roles
        (by default those that serve a whole request: colocated engines, and decode engines in a P/D
        cluster)."""
        skip = exclude or set()
        allowed = roles or self.whole_request_roles
        out = [w for w in self.view.workers.values()
               if w.role in allowed and w.name not in skip and self.view.eligible(w)
               and (model is None or not w.model or w.model == model)
               and (residency is None or w.region == residency)]
        return sorted(out, key=lambda w: w.name)

    def rank(self, policy: RoutingPolicy, pool: list[WorkerInfo], ctx: RequestContext) -> list[WorkerInfo]:
        strategy = self.settings.region_strategy
        if strategy == "ROUND_ROBIN":
            return self._policy("round_robin").rank(pool, ctx, self.view)
        if strategy == "GLOBAL":
            return global_rank(pool, ctx, self.topology, self.prefill_estimate)
        local, rest = regional_split(pool, ctx, self.topology)
        if not local:
            return rest
        return policy.rank(local, ctx, self.view) + rest

    async def completions(self, request: Request) -> Answer:
        return await self._route(request, chat=False)

    async def chat_completions(self, request: Request) -> Answer:
        return await self._route(request, chat=True)

    async def _route(self, request: Request, chat: bool) -> Answer:
        """Route one request within its deadline (emulated seconds, so a slowed-down cluster keeps it).

        A request past its deadline ends: with a 504 when nothing was sent yet, else with an error event
        and ``[DONE]`` on the stream it already began, so the client is never left waiting.
        """
        task = asyncio.current_task()
        assert task is not None
        limit_s = self.settings.request_timeout_s * self.settings.time_scale
        self._deadlines[task] = asyncio.get_running_loop().time() + limit_s
        try:
            return await self._route_inner(request, chat)
        except asyncio.CancelledError:
            if task not in self._expired:
                raise
            task.uncancel()
            self.metrics.responses.inc_labels("504")
            msg = f"request exceeded the router's deadline of {self.settings.request_timeout_s:g} emulated s"
            resp = request.get(STREAM_KEY)
            if isinstance(resp, StreamResponse) and resp.prepared:
                try:
                    await resp.write(sse(error_body(504, msg)))
                    await resp.write(SSE_DONE)
                    await resp.write_eof()
                except DISCONNECTS:
                    pass
                return resp
            return json_error(504, msg)
        finally:
            del self._deadlines[task]
            self._expired.discard(task)

    async def _sweep_deadlines(self) -> None:
        """Cancel the requests past their deadline: one timer for all requests rather than one each
        (per-request timers cost the hot path more than this sweep does)."""
        loop = asyncio.get_running_loop()
        limit_s = self.settings.request_timeout_s * self.settings.time_scale
        period = min(0.25, max(0.002, limit_s / 100.0))
        while True:
            await asyncio.sleep(period)
            now = loop.time()
            for task, deadline in list(self._deadlines.items()):
                if deadline <= now and task not in self._expired:
                    self._expired.add(task)
                    task.cancel()

    async def _route_inner(self, request: Request, chat: bool) -> Answer:
        raw = await request.read()
        t0 = time.perf_counter()
        try:
            body: dict[str, Any] = parse_json_object(raw)
            policy = self._policy(request.headers.get("X-Route-Policy"))
            req = RoutedRequest.of(body, chat)
        except ApiError as e:
            self.metrics.responses.inc_labels(str(e.status))
            return json_error(e.status, e.message)
        residency = request.headers.get("X-Residency") or body.get("residency")
        origin = request.headers.get("X-Region") or body.get("region") or self.settings.region
        session = request.headers.get("X-Session-Id") or body.get("session_id")
        if residency is not None and not isinstance(residency, str):
            return json_error(400, "'residency' must be a region name")
        model = req.model
        if model is not None and model not in self.view.model_set():
            return json_error(404, f"The model `{model}` does not exist.")
        pool = self.eligible(model, residency)
        if not pool:
            if residency is not None:
                self.metrics.residency_rejections.inc_labels(residency)
                self.metrics.responses.inc_labels("503")
                return json_error(503, f"no eligible worker in residency region {residency!r}; data residency "
                                       "forbids serving this request anywhere else", {"Retry-After": "1"})
            self.metrics.responses.inc_labels("503")
            return json_error(503, "no healthy worker can serve this request", {"Retry-After": "1"})
        limit = self.settings.max_waiting
        if limit is not None and all(w.waiting >= limit for w in pool):
            self.metrics.saturated.inc()
            self.metrics.responses.inc_labels("429")
            return json_error(429, f"every eligible worker has {limit} or more requests waiting",
                              {"Retry-After": "1"})
        ctx = RequestContext(body, session if isinstance(session, str) else None,
                             origin if isinstance(origin, str) else None, residency)
        needs_prefix = (policy.name in PREFIX_POLICIES or self.settings.region_strategy == "GLOBAL"
                        or policy.name == "sglang_cache_aware")
        if needs_prefix:
            self._fill_prompt(ctx, req, pool)
            self._overlap(ctx, pool)
        ranked = self.rank(policy, pool, ctx)
        self.metrics.latency.observe(time.perf_counter() - t0)
        self.metrics.decisions.inc_labels(policy.name, policy.reason)

        stream_state = _Stream(chat, req.include_usage, req.max_tokens)
        if self.disagg is not None:
            served = await self.disagg.serve(request, req, ctx, policy, stream_state)
            if served is not None:
                return served
        payload = raw
        if req.stream:
            # Append the router's needs to the client's own bytes (a later duplicate key wins in JSON
            # parsers), rather than re-encoding a body that may hold a hundred thousand token ids.
            opts = body.get("stream_options")
            extra = {"output_token_ids": True,
                     "stream_options": {**(opts if isinstance(opts, dict) else {}), "include_usage": True}}
            payload = splice_json(raw, extra)
        headers = {"Content-Type": "application/json"}
        if "X-Request-Id" in request.headers:
            headers["X-Request-Id"] = request.headers["X-Request-Id"]
        last_error = "no attempt made"
        tried: set[WorkerId] = set()
        for attempt, worker in enumerate(ranked[: self.settings.max_attempts]):
            if attempt:
                self.metrics.retries.inc_labels("upstream_failure")
            tried.add(worker.name)
            policy.on_routed(worker, ctx)
            self._note_routed(worker, ctx)
            try:
                return await self._attempt(request, worker, payload, headers, req.stream, stream_state, ctx, req)
            except _UpstreamFailed as e:
                last_error = e.reason
                self._failed(worker)
        self.metrics.responses.inc_labels("502")
        return json_error(502, f"every attempt failed; last: {last_error}")

    def _note_routed(self, worker: WorkerInfo, ctx: RequestContext) -> None:
        self.metrics.selected.inc_labels(worker.name)
        if ctx.origin_region is not None and worker.region != ctx.origin_region:
            self.metrics.cross_region.inc_labels(ctx.origin_region, worker.region)
        if ctx.block_hashes:
            hit = ctx.overlap.get(worker.name, 0) * worker.block_size
            self.metrics.predicted_hit_tokens.inc(min(hit, max(0, len(ctx.prompt_ids) - 1)))
            if self.settings.index_mode == "approximate":
                self.approx.record(worker.name, ctx.block_hashes, self.view.now() * 1000.0)

    def _failed(self, worker: WorkerInfo) -> None:
        if worker.breaker.failure(self.view.now()):
            self.metrics.breaker_opened.inc_labels(worker.name)

    async def _remote_wait(self, worker: WorkerInfo, ctx: RequestContext) -> None:
        rtt = self.topology.rtt_ms(ctx.origin_region, worker.region)
        if rtt > 0:
            await asyncio.sleep(rtt / 1000.0 * self.settings.time_scale)

    async def _attempt(self, request: Request, worker: WorkerInfo, payload: bytes, headers: dict[str, str],
                       stream: bool, st: _Stream, ctx: RequestContext,
                       req: RoutedRequest) -> Answer:
        """One worker's answer relayed to the client; raises _UpstreamFailed before any byte was sent."""
        await self._remote_wait(worker, ctx)
        worker.inflight += 1
        worker.sent += 1
        st.owe(worker, max(0, ctx.num_blocks - ctx.overlap.get(worker.name, 0)))
        try:
            try:
                upstream = await self.upstream.post(worker.url, request.path, payload, headers)
            except UpstreamError as e:
                raise _UpstreamFailed(f"{worker.name}: {e}") from None
            async with upstream:
                if upstream.status in RETRYABLE_STATUS:
                    try:
                        text = await upstream.text()
                    except UpstreamError as e:
                        text = str(e)
                    raise _UpstreamFailed(f"{worker.name}: HTTP {upstream.status}: {text[:200]}")
                ctype = upstream.headers.get("content-type", "application/json")
                if not stream or not ctype.startswith("text/event-stream"):
                    try:
                        data = await upstream.read()
                    except UpstreamError as e:
                        raise _UpstreamFailed(f"{worker.name}: {e}") from None
                    self._realized_from_body(data)
                    worker.breaker.success()
                    self.metrics.responses.inc_labels(str(upstream.status))
                    return Response(body=data, status=upstream.status,
                                    headers={"Content-Type": ctype, "X-Served-By": worker.name,
                                             "X-Served-Region": worker.region})
                resp = StreamResponse(status=200, headers={"Content-Type": "text/event-stream",
                                                           "Cache-Control": "no-cache",
                                                           "X-Served-By": worker.name,
                                                           "X-Served-Region": worker.region})
                try:
                    await resp.prepare(request)
                    request[STREAM_KEY] = resp
                    failure = await self._relay(upstream, resp, st)
                    if failure is None:
                        worker.breaker.success()
                        await self._finish_stream(resp, st)
                        self.metrics.responses.inc_labels("200")
                        return resp
                except DISCONNECTS:
                    # The client left: leaving this block closes the upstream connection, which aborts
                    # the request on the engine.
                    self.metrics.responses.inc_labels("499")
                    return resp
        finally:
            worker.inflight -= 1
            st.settle()
        # The worker died mid-stream: the client holds part of the answer, so continue it elsewhere.
        self._failed(worker)
        try:
            await self._migrate(request, resp, st, ctx, req, {worker.name}, failure)
        except DISCONNECTS:
            self.metrics.responses.inc_labels("499")
        return resp

    async def _relay(self, upstream: UpstreamResponse, resp: Any, st: _Stream, rewrite: bool = False,
                     final: bool = True) -> str | None:
        """Relay SSE events until the upstream's [DONE]; return why the stream broke, or None when it
        completed. ``final`` False: this upstream answers only part of the request (a prefill's first
        token), so its finish is not the client's. A client that went away raises (``DISCONNECTS``)."""
        buf = b""
        while True:
            try:
                chunk = await upstream.chunk()
            except UpstreamError as e:
                return str(e)
            if not chunk:
                break
            buf += chunk
            while b"\n\n" in buf:
                event, buf = buf.split(b"\n\n", 1)
                if event == b"data: [DONE]":
                    return None if st.finished or not final else "the stream ended before its last token"
                out = self._on_event(event, st, rewrite, final)
                if out:
                    await resp.write(out)
        return None if st.finished else "the stream ended before its last token"

    def _on_event(self, event: bytes, st: _Stream, rewrite: bool, final: bool = True) -> bytes:
        """Track one SSE event (token ids, finish, usage) and return the bytes to send the client."""
        if not event.startswith(b"data: "):
            return b""
        data = event[6:]
        if b'"error"' in data[:12]:
            return b""  # an aborting engine's last words; migration decides what the client sees
        if b'"usage"' in data and b'"choices":[]' in data:
            obj = json.loads(data)
            u = obj.get("usage") or {}
            st.cached_tokens = (u.get("prompt_tokens_details") or {}).get("cached_tokens")
            st.prompt_tokens = st.prompt_tokens or u.get("prompt_tokens")
            if st.cached_tokens:
                self.metrics.realized_hit_tokens.inc(st.cached_tokens)
            if st.prompt_tokens:
                self.metrics.prompt_tokens.inc(u.get("prompt_tokens", 0))
            return b""  # re-emitted with the whole stream's counts by _finish_stream
        m = TOKEN_IDS.search(data)
        if m and m.group(1):
            st.settle()
            st.token_ids.extend(int(x) for x in m.group(1).split(b","))
        if b'"finish_reason":"' in data and final:
            st.finished = True
        if not rewrite:
            if st.first_id is None:
                obj = json.loads(data)
                st.first_id, st.created, st.model = obj.get("id"), obj.get("created"), obj.get("model")
            return event + b"\n\n"
        out = self._reshape(json.loads(data), st)
        if not final:
            out["choices"][0]["finish_reason"] = None
        return sse(out)

    def _reshape(self, obj: dict[str, Any], st: _Stream) -> dict[str, Any]:
        """A continuation's completion chunk in the original stream's shape and identity."""
        choice = (obj.get("choices") or [{}])[0]
        out_choice: dict[str, Any]
        if st.chat:
            text = choice.get("text", "")
            out_choice = {"index": 0, "delta": {"content": text} if text else {}, "logprobs": None,
                          "finish_reason": choice.get("finish_reason")}
        else:
            out_choice = {k: v for k, v in choice.items() if k != "prompt_token_ids"}
        if "token_ids" in choice:
            out_choice["token_ids"] = choice["token_ids"]
        return {"id": st.first_id or obj.get("id"), "object": "chat.completion.chunk" if st.chat else "text_completion",
                "created": st.created or obj.get("created"), "model": st.model or obj.get("model"),
                "choices": [out_choice]}

    async def _finish_stream(self, resp: Any, st: _Stream) -> None:
        if st.client_usage:
            prompt = st.prompt_tokens if st.prompt_tokens is not None else len(st.prompt_ids)
            u: dict[str, Any] = {"prompt_tokens": prompt, "total_tokens": prompt + len(st.token_ids),
                                 "completion_tokens": len(st.token_ids)}
            if st.cached_tokens is not None:
                u["prompt_tokens_details"] = {"cached_tokens": st.cached_tokens}
            await resp.write(sse({"id": st.first_id, "object": "chat.completion.chunk" if st.chat
                                  else "text_completion", "created": st.created, "model": st.model,
                                  "choices": [], "usage": u}))
        await resp.write(SSE_DONE)
        await resp.write_eof()

    async def _migrate(self, request: Request, resp: StreamResponse, st: _Stream, ctx: RequestContext,
                       req: RoutedRequest, exclude: set[WorkerId], why: str) -> None:
        """Continue a broken stream on another eligible worker: prompt + streamed tokens, remaining budget."""
        candidates = self.eligible(req.model, ctx.residency, exclude)
        if not self.settings.migrate or not candidates:
            self.metrics.migrations.inc_labels("failed")
            await resp.write(sse(error_body(502, f"worker failed mid-stream ({why}) and no other eligible "
                                                 "worker could continue it")))
            await resp.write(SSE_DONE)
            await resp.write_eof()
            return
        self._fill_prompt(ctx, req, candidates)
        st.prompt_ids = ctx.prompt_ids
        st.prompt_tokens = len(ctx.prompt_ids)
        remaining = None if st.max_tokens is None else st.max_tokens - len(st.token_ids)
        if remaining is not None and remaining <= 0:
            st.finished = True
            await self._finish_stream(resp, st)
            self.metrics.migrations.inc_labels("already_complete")
            return
        body: dict[str, Any] = {"prompt": ctx.prompt_ids + st.token_ids, "stream": True, "output_token_ids": True,
                                "ignore_eos": req.ignore_eos,
                                "stream_options": {"include_usage": True}}
        if remaining is not None:
            body["max_tokens"] = remaining
        if req.model:
            body["model"] = req.model
        payload = json.dumps(body).encode()
        for worker in self.by_load(candidates)[: self.settings.max_attempts]:
            await self._remote_wait(worker, ctx)
            worker.inflight += 1
            worker.sent += 1
            self.metrics.selected.inc_labels(worker.name)
            try:
                async with await self.upstream.post(worker.url, "/v1/completions", payload, JSON_HEADERS) as up:
                    if up.status != 200:
                        self._failed(worker)
                        continue
                    before_prompt = st.prompt_tokens
                    failure = await self._relay(up, resp, st, rewrite=True)
                    st.prompt_tokens = before_prompt
                    if failure is None:
                        worker.breaker.success()
                        self.metrics.migrations.inc_labels("ok")
                        await self._finish_stream(resp, st)
                        return
                    self._failed(worker)
            except UpstreamError:
                self._failed(worker)
            finally:
                worker.inflight -= 1
            body["prompt"] = ctx.prompt_ids + st.token_ids
            if remaining is not None:
                body["max_tokens"] = st.max_tokens - len(st.token_ids)  # type: ignore[operator]
            payload = json.dumps(body).encode()
        self.metrics.migrations.inc_labels("failed")
        await resp.write(sse(error_body(502, f"worker failed mid-stream ({why}); migration failed too")))
        await resp.write(SSE_DONE)
        await resp.write_eof()

    @staticmethod
    def by_load(ws: list[WorkerInfo]) -> list[WorkerInfo]:
        return sorted(ws, key=lambda w: (w.load, w.name))

    def _realized_from_body(self, data: bytes) -> None:
        """Count a whole answer's prompt and cached tokens (read from its usage, without parsing it all)."""
        m = PROMPT_TOKENS.search(data)
        if m:
            self.metrics.prompt_tokens.inc(int(m.group(1)))
        m = CACHED_TOKENS.search(data)
        if m and m.group(1) != b"0":
            self.metrics.realized_hit_tokens.inc(int(m.group(1)))

    def stats(self) -> dict[str, Any]:
        return {w.name: {"inflight": w.inflight, "sent": w.sent} for w in self.view.workers.values()}


def default_prefill_estimate() -> Callable[[WorkerInfo, int, int], float]:
    """Prefill time of a worker from its roofline cost model (catalog presets), cached per worker type."""
    from config.catalog import default_catalog

    cat = default_catalog()
    models: dict[tuple[str, str, int], RooflineCostModel | None] = {}

    def est(w: WorkerInfo, new: int, cached: int) -> float:
        key = (w.model, w.hardware, w.tp)
        if key not in models:
            ok = w.model in cat.models and w.hardware in cat.hardware
            models[key] = RooflineCostModel(cat.hardware.get(w.hardware), cat.models.get(w.model), w.tp) if ok \
                else None
        cm = models[key]
        if cm is None:
            return new / 10_000.0  # unknown engine: a nominal 10k tokens per ms so distance dominates
        return cm.step(StepShape.of(prefills=[(new, cached)])).total_ms

    return est

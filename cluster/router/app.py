"""The router's HTTP server: OpenAI API in, the chosen engine's response streamed straight back out.

Per request: parse the body (a 400 for malformed JSON, the engines validate the rest), let the policy
rank the eligible workers, send to the best; if connecting fails or the worker answers 5xx before any
byte reached the client, try the next one (up to ``max_attempts``). SSE is relayed chunk by chunk as it
arrives, never buffered. A client that disconnects closes the upstream connection, which aborts the
request on the engine.
"""

from __future__ import annotations

import json
import time
from typing import Any

import aiohttp
from aiohttp import web
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from actors.openai_api import MAX_BODY_BYTES, ApiError, error_body, parse_json_object
from cluster.router.policies import make_policy
from cluster.router.view import ClusterView, RequestContext, WorkerInfo

RETRYABLE_STATUS = {500, 502, 503, 504}
DISCONNECTS = (ConnectionResetError, ConnectionAbortedError, BrokenPipeError)


def json_error(status: int, message: str, headers: dict[str, str] | None = None) -> web.Response:
    return web.json_response(error_body(status, message), status=status, headers=headers)


class RouterMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        self.decisions = Counter("kvmesh_router_decisions", "Routing decisions by policy and chosen worker.",
                                 ["policy", "worker"], registry=r)
        self.responses = Counter("kvmesh_router_responses", "Responses by status code.", ["status"], registry=r)
        self.retries = Counter("kvmesh_router_retries", "Attempts that moved to another worker.",
                               ["reason"], registry=r)
        self.latency = Histogram("kvmesh_router_routing_seconds", "Time to pick a worker (wall seconds).",
                                 buckets=(1e-5, 3e-5, 1e-4, 3e-4, 1e-3, 3e-3, 1e-2), registry=r)
        self.inflight = Gauge("kvmesh_router_worker_inflight", "Requests open on each worker.", ["worker"],
                              registry=r)


class RouterServer:
    def __init__(self, workers: list[WorkerInfo], policy: str = "round_robin", *, host: str = "127.0.0.1",
                 port: int = 0, max_attempts: int = 3, request_timeout_s: float = 600.0) -> None:
        self.view = ClusterView(workers)
        self.policy_name = policy
        self.policy = make_policy(policy)
        self.host = host
        self.port = port
        self.max_attempts = max_attempts
        self.timeout = aiohttp.ClientTimeout(total=request_timeout_s, sock_connect=5.0)
        self.metrics = RouterMetrics()
        self._runner: web.AppRunner | None = None
        self._session: aiohttp.ClientSession | None = None
        self.url = ""

    def app(self) -> web.Application:
        app = web.Application(client_max_size=MAX_BODY_BYTES)
        app.router.add_post("/v1/completions", self.proxy)
        app.router.add_post("/v1/chat/completions", self.proxy)
        app.router.add_get("/v1/models", self.models)
        app.router.add_get("/health", self.health)
        app.router.add_get("/metrics", self.prometheus)
        app.router.add_get("/workers", self.workers)
        return app

    async def start(self) -> str:
        self._session = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0, keepalive_timeout=60),
                                              timeout=self.timeout, auto_decompress=False)
        self._runner = web.AppRunner(self.app(), handler_cancellation=True, access_log=None)
        await self._runner.setup()
        site = web.TCPSite(self._runner, self.host, self.port, reuse_address=True)
        await site.start()
        server = site._server
        assert server is not None
        self.port = server.sockets[0].getsockname()[1]  # type: ignore[attr-defined]
        self.url = f"http://{self.host}:{self.port}"
        return self.url

    async def stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None
        if self._session is not None:
            await self._session.close()
            self._session = None

    # -- simple endpoints --------------------------------------------------------------------------
    async def health(self, request: web.Request) -> web.Response:
        if not any(w.healthy for w in self.view.workers.values()):
            return json_error(503, "no healthy worker")
        return web.Response(status=200)

    async def models(self, request: web.Request) -> web.Response:
        now = int(time.time())
        return web.json_response({"object": "list", "data": [
            {"id": m, "object": "model", "created": now, "owned_by": "kvmesh", "root": m, "parent": None}
            for m in self.view.models()]})

    async def workers(self, request: web.Request) -> web.Response:
        return web.json_response([{"name": w.name, "url": w.url, "role": w.role, "region": w.region,
                                   "node": w.node, "model": w.model, "inflight": w.inflight, "sent": w.sent,
                                   "healthy": w.healthy} for w in self.view.workers.values()])

    async def prometheus(self, request: web.Request) -> web.Response:
        for w in self.view.workers.values():
            self.metrics.inflight.labels(w.name).set(w.inflight)
        return web.Response(body=generate_latest(self.metrics.registry),
                            headers={"Content-Type": "text/plain; version=0.0.4; charset=utf-8"})

    # -- the proxy ---------------------------------------------------------------------------------
    async def proxy(self, request: web.Request) -> web.StreamResponse:
        raw = await request.read()
        try:
            body = parse_json_object(raw)
        except ApiError as e:
            return json_error(e.status, e.message)
        model = body.get("model") if isinstance(body.get("model"), str) else None
        t0 = time.perf_counter()
        candidates = self.view.candidates(model)
        if not candidates:
            if model is not None and model not in self.view.models():
                return json_error(404, f"The model `{model}` does not exist.")
            return json_error(503, "no healthy worker can serve this request", {"Retry-After": "1"})
        ctx = RequestContext(body, request.headers.get("X-Session-Id"), request.headers.get("X-Region"))
        ranked = self.policy.rank(candidates, ctx, self.view)
        self.metrics.latency.observe(time.perf_counter() - t0)
        headers = {"Content-Type": "application/json"}
        if "X-Request-Id" in request.headers:
            headers["X-Request-Id"] = request.headers["X-Request-Id"]
        last_error = "no attempt made"
        for attempt, worker in enumerate(ranked[: self.max_attempts]):
            if attempt:
                self.metrics.retries.labels("upstream_failure").inc()
            result = await self._forward(request, worker, raw, headers)
            if isinstance(result, web.StreamResponse):
                return result
            last_error = result
        self.metrics.responses.labels("502").inc()
        return json_error(502, f"every attempt failed: {last_error}")

    async def _forward(self, request: web.Request, worker: WorkerInfo, raw: bytes,
                       headers: dict[str, str]) -> web.StreamResponse | str:
        """Send to one worker. Returns the response given to the client, or why this worker failed."""
        assert self._session is not None
        worker.inflight += 1
        worker.sent += 1
        self.metrics.decisions.labels(self.policy_name, worker.name).inc()
        try:
            try:
                upstream = await self._session.post(worker.url + request.path, data=raw, headers=headers)
            except (TimeoutError, aiohttp.ClientConnectionError) as e:
                return f"{worker.name}: {type(e).__name__}: {e}"
            async with upstream:
                if upstream.status in RETRYABLE_STATUS:
                    text = await upstream.text()
                    return f"{worker.name}: HTTP {upstream.status}: {text[:200]}"
                ctype = upstream.headers.get("Content-Type", "application/json")
                if not ctype.startswith("text/event-stream"):
                    data = await upstream.read()
                    self.metrics.responses.labels(str(upstream.status)).inc()
                    return web.Response(body=data, status=upstream.status, headers={"Content-Type": ctype})
                resp = web.StreamResponse(status=upstream.status,
                                          headers={"Content-Type": ctype, "Cache-Control": "no-cache"})
                await resp.prepare(request)
                try:
                    async for chunk in upstream.content.iter_any():
                        await resp.write(chunk)
                    await resp.write_eof()
                except (aiohttp.ClientPayloadError, aiohttp.ClientConnectionError) as e:
                    # The worker died mid-stream; bytes already reached the client, so end the stream
                    # with an error event rather than retrying (migration comes with the full router).
                    msg = json.dumps(error_body(502, f"worker {worker.name} failed mid-stream: {e}"))
                    await resp.write(f"data: {msg}\n\n".encode())
                    await resp.write_eof()
                self.metrics.responses.labels(str(upstream.status)).inc()
                return resp
        finally:
            worker.inflight -= 1

    def stats(self) -> dict[str, Any]:
        return {w.name: {"inflight": w.inflight, "sent": w.sent} for w in self.view.workers.values()}

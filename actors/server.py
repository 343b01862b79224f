"""One engine's HTTP server: the OpenAI API (completions, chat, models), health, metrics, load.

Bad input never crashes the server or disturbs other requests: malformed JSON, missing or mistyped
fields and prompts longer than the context get a 400, an unknown model a 404, a draining engine a 503,
all as OpenAI-shaped JSON. A client that disconnects (the handler is cancelled, or a write fails)
aborts its request in the engine, which frees its sequence and blocks at once.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

from aiohttp import web

from actors.engine.engine import Engine, EngineError, RequestStream
from actors.engine.sequence import FinishReason
from actors.engine.tokenizer import Tokenizer
from actors.feed import FeedPublisher
from actors.metrics import EngineMetrics
from actors.openai_api import (
    MAX_BODY_BYTES,
    SSE_DONE,
    ApiError,
    ChatCompletionRequest,
    CompletionRequest,
    ResponseShapes,
    error_body,
    parse_body,
    sse,
)

DISCONNECTS = (ConnectionResetError, ConnectionAbortedError, BrokenPipeError)


def json_error(status: int, message: str, param: str | None = None) -> web.Response:
    return web.json_response(error_body(status, message, param), status=status)


class EngineServer:
    """Serves one engine on ``host`` (127.0.0.1 unless told otherwise), port chosen at start."""

    def __init__(self, engine: Engine, metrics: EngineMetrics, *, host: str = "127.0.0.1", port: int = 0,
                 meta: dict[str, Any] | None = None) -> None:
        self.engine = engine
        self.metrics = metrics
        self.tokenizer = Tokenizer(engine.cfg.vocab_size)
        self.host = host
        self.port = port
        self.meta = dict(meta or {})
        self.draining = False
        self.inflight = 0
        self._runner: web.AppRunner | None = None
        self.url = ""
        self.feed = FeedPublisher(engine, self.load_report)

    def app(self) -> web.Application:
        app = web.Application(client_max_size=MAX_BODY_BYTES)
        app.router.add_post("/v1/completions", self.completions)
        app.router.add_post("/v1/chat/completions", self.chat_completions)
        app.router.add_get("/v1/models", self.models)
        app.router.add_get("/health", self.health)
        app.router.add_get("/metrics", self.prometheus)
        app.router.add_get("/load", self.load)
        # SGLang-compatible discovery, so SGLang's router (and tools built for it) can front an engine.
        for path in ("/get_model_info", "/model_info"):
            app.router.add_get(path, self.model_info)
        for path in ("/get_server_info", "/server_info"):
            app.router.add_get(path, self.server_info)
        app.router.add_get("/kvmesh/feed", self.feed.handler)
        return app

    async def start(self) -> str:
        self._runner = web.AppRunner(self.app(), handler_cancellation=True, access_log=None)
        await self._runner.setup()
        site = web.TCPSite(self._runner, self.host, self.port, reuse_address=True)
        await site.start()
        server = site._server
        assert server is not None
        sock = server.sockets[0]  # type: ignore[attr-defined]
        self.port = sock.getsockname()[1]
        self.url = f"http://{self.host}:{self.port}"
        return self.url

    async def stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None

    # -- plain endpoints ---------------------------------------------------------------------------
    async def health(self, request: web.Request) -> web.Response:
        if self.draining:
            return json_error(503, "engine is draining")
        return web.Response(status=200)

    async def models(self, request: web.Request) -> web.Response:
        cfg = self.engine.cfg
        return web.json_response({"object": "list", "data": [{
            "id": cfg.model_name, "object": "model", "created": int(time.time()), "owned_by": "kvmesh",
            "root": cfg.model_name, "parent": None, "max_model_len": cfg.limits.max_context}]})

    async def model_info(self, request: web.Request) -> web.Response:
        name = self.engine.cfg.model_name
        return web.json_response({"model_path": name, "tokenizer_path": None, "is_generation": True})

    async def server_info(self, request: web.Request) -> web.Response:
        cfg = self.engine.cfg
        return web.json_response({"model_path": cfg.model_name, "served_model_name": cfg.model_name,
                                  "max_total_num_tokens": cfg.num_blocks * cfg.block_size,
                                  "max_running_requests": cfg.limits.max_num_seqs,
                                  "chunked_prefill_size": cfg.limits.max_num_batched_tokens,
                                  "page_size": cfg.block_size, "tp_size": int(self.meta.get("tp", 1)),
                                  "dp_size": 1, "version": "kvmesh"})

    async def prometheus(self, request: web.Request) -> web.Response:
        self.metrics.refresh(self.engine)
        return web.Response(body=self.metrics.exposition(),
                            headers={"Content-Type": "text/plain; version=0.0.4; charset=utf-8"})

    def load_report(self) -> dict[str, Any]:
        return {**self.engine.load(), **self.meta, "name": self.engine.cfg.name, "draining": self.draining,
                "inflight": self.inflight}

    async def load(self, request: web.Request) -> web.Response:
        return web.json_response(self.load_report())

    # -- generation --------------------------------------------------------------------------------
    async def completions(self, request: web.Request) -> web.StreamResponse:
        return await self._generate(request, chat=False)

    async def chat_completions(self, request: web.Request) -> web.StreamResponse:
        return await self._generate(request, chat=True)

    def _prompt_ids(self, req: CompletionRequest | ChatCompletionRequest) -> list[int]:
        if isinstance(req, ChatCompletionRequest):
            return self.tokenizer.chat_prompt([(m.role, m.text()) for m in req.messages])
        p = req.prompt
        if isinstance(p, str):
            return self.tokenizer.encode(p)
        if not p:
            raise ApiError(400, "the prompt is empty", "prompt")
        if isinstance(p[0], int):
            ids = [int(x) for x in p]
            if not self.tokenizer.valid_ids(ids):
                raise ApiError(400, f"prompt token ids must lie in [0, {self.tokenizer.vocab_size})", "prompt")
            return ids
        if len(p) != 1:
            raise ApiError(400, "only one prompt per request is supported", "prompt")
        one = p[0]
        if isinstance(one, str):
            return self.tokenizer.encode(one)
        ids = list(one)
        if not self.tokenizer.valid_ids(ids):
            raise ApiError(400, f"prompt token ids must lie in [0, {self.tokenizer.vocab_size})", "prompt")
        return ids

    async def _generate(self, request: web.Request, chat: bool) -> web.StreamResponse:
        arrival_ms = self.engine.clock.now_ms()
        if self.draining:
            return json_error(503, "engine is draining: send the request elsewhere")
        try:
            raw = await request.read()
            req = parse_body(raw, ChatCompletionRequest if chat else CompletionRequest)
            if req.model is not None and req.model != self.engine.cfg.model_name:
                return json_error(404, f"The model `{req.model}` does not exist.", "model")
            prompt_ids = self._prompt_ids(req)
            limit = req.limit() if isinstance(req, ChatCompletionRequest) else req.max_tokens
            stream = self.engine.submit(prompt_ids, limit, ignore_eos=req.ignore_eos, seed=req.seed or 0,
                                        request_id=request.headers.get("X-Request-Id"), arrival_ms=arrival_ms)
        except ApiError as e:
            return json_error(e.status, e.message, e.param)
        except EngineError as e:
            return json_error(e.status, e.message, e.param)
        except web.HTTPRequestEntityTooLarge as e:
            return json_error(413, str(e))
        shapes = ResponseShapes(chat, self.engine.cfg.model_name, request.headers.get("X-Request-Id"))
        self.inflight += 1
        try:
            if req.stream:
                include_usage = bool(req.stream_options and req.stream_options.include_usage)
                return await self._stream(request, stream, shapes, prompt_ids, include_usage,
                                          req.return_token_ids)
            return await self._full(stream, shapes, len(prompt_ids), req.return_token_ids)
        finally:
            self.inflight -= 1

    async def _full(self, stream: RequestStream, shapes: ResponseShapes, n_prompt: int,
                    return_ids: bool) -> web.Response:
        ids: list[int] = []
        reason = FinishReason.LENGTH
        try:
            async for ev in stream:
                ids.extend(ev.token_ids)
                if ev.finish_reason is not None:
                    reason = ev.finish_reason
        except asyncio.CancelledError:
            stream.abort()
            raise
        if reason is FinishReason.ABORT:
            return json_error(503, "request aborted: the engine is stopping")
        text = self.tokenizer.decode(ids)
        return web.json_response(shapes.full(text, reason.value, n_prompt, len(ids),
                                             stream.seq.num_cached_prompt_tokens, ids if return_ids else None))

    async def _stream(self, request: web.Request, stream: RequestStream, shapes: ResponseShapes,
                      prompt_ids: list[int], include_usage: bool, return_ids: bool) -> web.StreamResponse:
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
        finished = False
        n_out = 0
        pending_prompt_ids = prompt_ids if return_ids else None
        try:
            await resp.prepare(request)
            first = shapes.first_chunk()
            if first is not None:
                await resp.write(sse(first))
            decode = self.tokenizer.decode_one
            async for ev in stream:
                reason = ev.finish_reason
                if reason is FinishReason.ABORT:
                    await resp.write(sse(error_body(503, "request aborted: the engine is stopping")))
                    finished = True
                    break
                n_out += len(ev.token_ids)
                text = "".join(decode(t) for t in ev.token_ids)
                await resp.write(sse(shapes.chunk(text, reason.value if reason else None,
                                                  list(ev.token_ids) if return_ids else None, pending_prompt_ids)))
                pending_prompt_ids = None
                if reason is not None:
                    finished = True
            if include_usage:
                await resp.write(sse(shapes.usage_chunk(len(prompt_ids), n_out,
                                                        stream.seq.num_cached_prompt_tokens)))
            await resp.write(SSE_DONE)
            await resp.write_eof()
        except DISCONNECTS:
            stream.abort()  # the client is gone: free its sequence and blocks now
        except asyncio.CancelledError:
            stream.abort()
            raise
        finally:
            if not finished:
                stream.abort()
        return resp


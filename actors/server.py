"""One engine's HTTP server: the OpenAI API (completions, chat, models), health, metrics, load.

Bad input never crashes the server or disturbs other requests: malformed JSON, missing or mistyped
fields and prompts longer than the context get a 400, an unknown model a 404, a draining engine a 503,
all as OpenAI-shaped JSON. A client that disconnects (the handler is cancelled, or a write fails)
aborts its request in the engine, which frees its sequence and blocks at once.

Fault injection: ``partition(True)`` makes the server unreachable as a network partition would: the
connections of its open requests are dropped (their requests abort) and new requests lose their connection
before any answer, until ``partition(False)``. The feed is cut separately, per engine, in the ``FeedHub``.
"""

from __future__ import annotations

import asyncio
import json
import time
from typing import Any

from aiohttp import web

from actors.engine.api import StreamEvent
from actors.engine.engine import Engine, EngineError, RequestStream
from actors.engine.kv_blocks import BlockHash, hash_request_blocks
from actors.engine.sequence import FinishReason, RequestId
from actors.engine.tokenizer import Tokenizer
from actors.feed import FeedHub
from actors.http import serve_app, write_now
from actors.kv_connector import KVConnector, address_from_json, address_to_json
from actors.metrics import EngineMetrics
from actors.migration import TOKEN_INDEX_HEADER, MigrationAgent, MigrationError
from actors.openai_api import (
    MAX_BODY_BYTES,
    SSE_DONE,
    ApiError,
    ChatCompletionRequest,
    CompletionRequest,
    ResponseShapes,
    error_body,
    parse_json_object,
    sse,
    validate_request,
)
from config.cluster import DisaggSpec

DISCONNECTS = (ConnectionResetError, ConnectionAbortedError, BrokenPipeError)
YIELD_AFTER_BODY_BYTES = 64 * 1024
"""A body this large (about 10k prompt tokens) takes milliseconds to parse, validate and admit: the handler
lets the loop run once between each, so the engines of the process keep their step deadlines."""


async def let_loop_run(turns: int = 3) -> None:
    """Give the loop ``turns`` turns: a wake-up that is a chain of callbacks (the clock's thread waker posts
    ``fire``, which resolves a step's future, which schedules the engine's task) runs its whole chain before
    this coroutine goes on; one ``sleep(0)`` would let only the first link run, the rest queued behind it."""
    for _ in range(turns):
        await asyncio.sleep(0)


HASH_SLICE_BLOCKS = 1024
"""Blocks of a long prompt hashed between two loop turns (16k tokens at 16 a block: about a millisecond)."""


async def hash_prompt_in_slices(prompt_ids: list[int], block_size: int,
                                slice_blocks: int = HASH_SLICE_BLOCKS) -> list[BlockHash]:
    """The chained hashes of every full block of ``prompt_ids`` (``hash_request_blocks``'s, bit for bit),
    ``slice_blocks`` at a time with the loop let run between slices.

    A long prompt's blocks are hashed sooner or later anyway when prefix caching is on (the prefix lookup at
    admission hashes as far as the prefix hits, then each prefilled chunk's blocks as they are cached), but
    there in one piece inside a step's planning: a 90k-token prompt whose prefix is cached hashed ~3,000
    blocks in one go, milliseconds for which every other engine of the process missed its step deadline.
    """
    if slice_blocks < 1:
        raise ValueError(f"slice_blocks must be >= 1 (got {slice_blocks})")
    n = len(prompt_ids) // block_size
    hashes: list[BlockHash] = []
    while len(hashes) < n:
        hashes = hash_request_blocks(prompt_ids, block_size, start=hashes, limit=len(hashes) + slice_blocks)
        await let_loop_run()
    return hashes


def json_error(status: int, message: str, param: str | None = None) -> web.Response:
    return web.json_response(error_body(status, message, param), status=status)


class TextChunk:
    """The SSE bytes of a mid-stream chunk (text, and the token ids when asked: no finish), from a template made
    once per stream.

    Byte for byte what ``sse(shapes.chunk(text, None, ids))`` gives, without building and encoding a dict per
    token (0.4 instead of 4.8 us a token): the stream's constant fields are encoded once around markers. The
    router always asks for the ids (``output_token_ids``), so its streams take this path too.
    """

    def __init__(self, shapes: ResponseShapes, with_ids: bool = False, tokenizer: Tokenizer | None = None) -> None:
        marker: Any = ["\x01"] if with_ids else None  # stands for the ids in the template
        self.head, rest = sse(shapes.chunk("\x00", None, marker)).split(b'"\\u0000"')
        self.mid, self.tail = rest.split(b'["\\u0001"]') if with_ids else (b"", rest)
        self.with_ids = with_ids
        self.tokenizer = tokenizer or Tokenizer()

    def token(self, token_id: int) -> bytes | None:
        """The chunk of one token, ``self(decode_one(token_id), [token_id])``'s bytes, from the tokenizer's JSON
        word table (no text decoded, no JSON encoder, no join over the ids); None when the token has no text."""
        word = self.tokenizer.json_word(token_id)
        if word is None:
            return None
        if not self.with_ids:
            return self.head + word + self.tail
        return b"%b%b%b[%d]%b" % (self.head, word, self.mid, token_id, self.tail)

    def __call__(self, text: str, ids: list[int] | tuple[int, ...] = ()) -> bytes:
        if not self.with_ids:
            return self.head + json.dumps(text).encode() + self.tail
        return b"".join((self.head, json.dumps(text).encode(), self.mid,
                         ("[" + ",".join(map(str, ids)) + "]").encode(), self.tail))


class EngineServer:
    """Serves one engine on ``host`` (127.0.0.1 unless told otherwise), port chosen at start."""

    def __init__(self, engine: Engine, metrics: EngineMetrics, *, host: str = "127.0.0.1", port: int = 0,
                 meta: dict[str, Any] | None = None, connector: KVConnector | None = None,
                 disagg: DisaggSpec | None = None, hub: FeedHub | None = None,
                 migration: MigrationAgent | None = None, stream_interval: int = 1) -> None:
        if stream_interval < 1:
            raise ValueError("stream_interval must be at least 1")
        self.engine = engine
        self.stream_interval = stream_interval
        """Tokens per SSE event after the first (vLLM's ``--stream-interval``); 1: one event per token."""
        self.migration = migration
        """Live migration and checkpoints (``actors.migration``), when the cluster enables them."""
        self.connector = connector
        self.disagg = disagg or DisaggSpec()
        self.metrics = metrics
        self.tokenizer = Tokenizer(engine.cfg.vocab_size)
        self.host = host
        self.port = port
        self.meta = dict(meta or {})
        self._draining = False
        self.inflight = 0
        self.partitioned = False
        self._open: dict[int, web.Request] = {}
        """Requests being answered (their connections are dropped by a partition)."""
        self._runner: web.AppRunner | None = None
        self.url = ""
        self.hub = hub or FeedHub()
        """The process's feed (``actors.feed``): a connection to this server may carry every engine in it."""
        self.hub.add(engine.cfg.name, engine, self.load_report)

    @property
    def draining(self) -> bool:
        return self._draining

    @draining.setter
    def draining(self, value: bool) -> None:
        self._draining = value
        self.hub.changed(self.engine.cfg.name)  # routers learn of a drain on the feed at once

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
        app.router.add_get("/kvmesh/feed", self.feed)
        app.router.add_post("/kvmesh/reserve", self.reserve)
        app.router.add_delete("/kvmesh/reserve/{rid}", self.cancel_reservation)
        app.router.add_post("/kvmesh/release/{rid}", self.release)
        if self.migration is not None:
            self.migration.add_routes(app)
        return app

    async def feed(self, request: web.Request) -> web.WebSocketResponse:
        """The feed of this engine, or (``?engines=``) of any engines in this process."""
        return await self.hub.serve(request, default=(self.engine.cfg.name,))

    async def start(self) -> str:
        self._runner, self.port = await serve_app(self.app(), self.host, self.port)
        self.url = f"http://{self.host}:{self.port}"
        return self.url

    async def stop(self) -> None:
        self.hub.remove(self.engine.cfg.name)
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None

    def partition(self, on: bool) -> None:
        """Cut this server off (``on``) or reconnect it (see the module docstring)."""
        self.partitioned = on
        if on:
            for request in list(self._open.values()):
                if request.transport is not None:
                    request.transport.close()

    @staticmethod
    def _unreachable(request: web.Request) -> web.Response:
        """A request that arrives during a partition: its connection dropped before any answer."""
        if request.transport is not None:
            request.transport.close()
        return web.Response(status=503)

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

    # -- disaggregation ----------------------------------------------------------------------------
    async def reserve(self, request: web.Request) -> web.Response:
        """Decode side: set aside KV blocks for a prompt a prefill engine will send (409: no room now)."""
        if self.partitioned:
            return self._unreachable(request)
        if self.connector is None or self.connector.address is None:
            return json_error(400, "this engine has no KV transport (it is not a prefill or decode engine)")
        if self.draining:
            return json_error(503, "engine is draining")
        try:
            body = parse_json_object(await request.read())
            rid = body["request_id"]
            prompt = body["prompt"]
            if not isinstance(rid, str) or not isinstance(prompt, list) or not self.tokenizer.valid_ids(prompt):
                raise ApiError(400, "reserve needs 'request_id' (a string) and 'prompt' (token ids)")
            max_tokens = body.get("max_tokens")
            res = self.engine.reserve([int(x) for x in prompt], max_tokens if isinstance(max_tokens, int) else None,
                                      request_id=rid, lease_ms=float(body.get("lease_ms", self.disagg.lease_ms)))
        except KeyError as e:
            return json_error(400, f"reserve needs the field {e.args[0]!r}")
        except ApiError as e:
            return json_error(e.status, e.message, e.param)
        except EngineError as e:
            return json_error(e.status, e.message, e.param)
        return web.json_response({"request_id": res.request_id, "address": address_to_json(self.connector.address),
                                  "cached_blocks": res.cached_blocks, "total_blocks": res.total_blocks,
                                  "prompt_blocks": -(-res.prompt_tokens // self.engine.cfg.block_size)})

    async def cancel_reservation(self, request: web.Request) -> web.Response:
        ok = self.engine.cancel_reservation(RequestId(request.match_info["rid"]))
        return web.json_response({"cancelled": ok})

    async def release(self, request: web.Request) -> web.Response:
        """Prefill side (pull mode): the decode engine has the KV, or gave up: free the held blocks."""
        rid = RequestId(request.match_info["rid"])
        ok = self.connector.release(rid) if self.connector is not None else self.engine.release(rid)
        return web.json_response({"released": ok})

    def _transfer_params(self, req: CompletionRequest | ChatCompletionRequest) -> dict[str, Any] | None:
        params = (req.model_extra or {}).get("kv_transfer_params")
        if params is None:
            return None
        if not isinstance(params, dict):
            raise ApiError(400, "kv_transfer_params must be an object", "kv_transfer_params")
        if self.connector is None:
            raise ApiError(400, "this engine has no KV transport (it is not a prefill or decode engine)",
                           "kv_transfer_params")
        if params.get("mode", "push") not in ("push", "pull"):
            raise ApiError(400, "kv_transfer_params.mode must be 'push' or 'pull'", "kv_transfer_params")
        return params

    async def _remote_prefill(self, params: dict[str, Any], req: CompletionRequest | ChatCompletionRequest,
                              arrival_ms: float) -> RequestStream:
        """Decode side: wait for the prompt's KV from the prefill engine, then decode from its first token."""
        assert self.connector is not None
        try:
            rid = RequestId(str(params["request_id"]))
            first = int(params["first_token"])
            mode = str(params.get("mode", "push"))
            prefill = address_from_json(params["prefill_address"]) if mode == "pull" else None
        except (KeyError, TypeError, ValueError) as e:
            raise ApiError(400, f"kv_transfer_params for a remote prefill are incomplete: {e}",
                           "kv_transfer_params") from None
        entry = self.engine.reserved.get(rid)
        if entry is None:
            raise EngineError(404, f"no reservation for request {rid!r} (expired or never made)")
        res = entry[1]
        outcome = await self.connector.fetch(rid, mode=mode, first_block=res.cached_blocks,
                                             num_blocks=-(-res.prompt_tokens // self.engine.cfg.block_size),
                                             prefill=prefill, timeout_ms=float(params.get("timeout_ms",
                                                                                          self.disagg.transfer_timeout_ms)))
        if not outcome.ok:
            self.engine.cancel_reservation(rid)
            self.metrics.on_transfer_failed(mode)
            raise EngineError(504, f"kv_transfer_failed: {outcome.error}")
        return self.engine.admit_preloaded(rid, first, ignore_eos=req.ignore_eos, seed=req.seed or 0)

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
        return web.Response(body=self.metrics.exposition(request.query.getall("name[]", ()), engine=self.engine),
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
            ids = list(p)  # StrictInt: already ints (no per-token int() over a 100k-token prompt)
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
        if self.partitioned:
            return self._unreachable(request)
        if self.draining:
            return json_error(503, "engine is draining: send the request elsewhere")
        try:
            raw = await request.read()
            big = len(raw) >= YIELD_AFTER_BODY_BYTES
            data = parse_json_object(raw)
            if big:  # steps due now run between parsing, validating and admitting a long prompt
                await let_loop_run()
            req = validate_request(data, ChatCompletionRequest if chat else CompletionRequest)
            if big:
                await let_loop_run()
            if req.model is not None and req.model != self.engine.cfg.model_name:
                return json_error(404, f"The model `{req.model}` does not exist.", "model")
            prompt_ids = self._prompt_ids(req)
            hashes = None
            if big and self.engine.kv.enable_caching:
                await let_loop_run()
                hashes = await hash_prompt_in_slices(prompt_ids, self.engine.cfg.block_size)
            limit = req.limit() if isinstance(req, ChatCompletionRequest) else req.max_tokens
            params = self._transfer_params(req)
            rid = request.headers.get("X-Request-Id")
            headers: dict[str, str] = {}
            ck = None
            if params is not None and params.get("checkpoint") and self.migration is not None:
                ck = self.migration.checkpoint_target(params["checkpoint"])
            if params is not None and params.get("resume"):
                stream = await self._resume(params, headers)
            elif params is not None and params.get("do_remote_prefill"):
                stream = await self._remote_prefill(params, req, arrival_ms)
            elif params is not None and params.get("do_remote_decode"):
                stream = self._prefill_for_remote_decode(params, prompt_ids, req, rid, arrival_ms)
            else:
                stream = self.engine.submit(prompt_ids, limit, ignore_eos=req.ignore_eos, seed=req.seed or 0,
                                            request_id=rid, arrival_ms=arrival_ms, block_hashes=hashes)
            if ck is not None and self.migration is not None:
                self.migration.watch(stream.request_id, ck)  # a resumed request too
        except MigrationError as e:
            return json_error(e.status, str(e), "kv_transfer_params")
        except ApiError as e:
            return json_error(e.status, e.message, e.param)
        except EngineError as e:
            return json_error(e.status, e.message, e.param)
        except web.HTTPRequestEntityTooLarge as e:
            return json_error(413, str(e))
        shapes = ResponseShapes(chat, self.engine.cfg.model_name, request.headers.get("X-Request-Id"))
        self.inflight += 1
        self._open[id(request)] = request  # by id: aiohttp requests are not hashable
        try:
            if req.stream:
                include_usage = bool(req.stream_options and req.stream_options.include_usage)
                return await self._stream(request, stream, shapes, prompt_ids, include_usage,
                                          req.return_token_ids or req.output_token_ids, req.return_token_ids,
                                          headers)
            return await self._full(stream, shapes, len(prompt_ids), req.return_token_ids)
        finally:
            self.inflight -= 1
            self._open.pop(id(request), None)
            self.hub.changed(self.engine.cfg.name)

    async def _resume(self, params: dict[str, Any], headers: dict[str, str]) -> RequestStream:
        """Continue a request that moved here (live migration or a checkpoint); ``headers`` gets the output
        index of the stream's first token."""
        if self.migration is None:
            raise ApiError(400, "this engine takes no migrated requests (kv_migration is off)", "kv_transfer_params")
        stream, index = await self.migration.resume(params)
        headers[TOKEN_INDEX_HEADER] = str(index)
        return stream

    def _prefill_for_remote_decode(self, params: dict[str, Any], prompt_ids: list[int],
                                   req: CompletionRequest | ChatCompletionRequest, rid: str | None,
                                   arrival_ms: float) -> RequestStream:
        """Prefill side: compute the prompt and its first token, hold the KV and hand it to the decode engine."""
        assert self.connector is not None
        mode = str(params.get("mode", "push"))
        try:
            skip = int(params.get("skip_blocks", 0))
            decode = address_from_json(params["decode_address"]) if mode == "push" else None
            rid = str(params.get("request_id") or rid)
        except (KeyError, TypeError, ValueError) as e:
            raise ApiError(400, f"kv_transfer_params for a remote decode are incomplete: {e}",
                           "kv_transfer_params") from None
        stream = self.engine.submit(prompt_ids, 1, ignore_eos=True, seed=req.seed or 0, request_id=rid,
                                    arrival_ms=arrival_ms, hold_blocks_ms=float(params.get("lease_ms",
                                                                                         self.disagg.lease_ms)))
        if decode is not None:
            self.connector.start_push(stream.request_id, decode, skip)
        else:
            self.connector.publish_when_done(stream.request_id, skip)
        return stream

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
        if reason in (FinishReason.ABORT, FinishReason.MIGRATED):
            return json_error(503, "request aborted: the engine is stopping")
        text = self.tokenizer.decode(ids)
        return web.json_response(shapes.full(text, reason.value, n_prompt, len(ids),
                                             stream.seq.num_cached_prompt_tokens, ids if return_ids else None))

    async def _stream(self, request: web.Request, stream: RequestStream, shapes: ResponseShapes,
                      prompt_ids: list[int], include_usage: bool, return_ids: bool,
                      return_prompt_ids: bool, headers: dict[str, str] | None = None) -> web.StreamResponse:
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache",
                                           **(headers or {})})
        finished = False
        n_out = 0
        pending_prompt_ids = prompt_ids if return_prompt_ids else None
        try:
            await resp.prepare(request)
            first = shapes.first_chunk()
            if first is not None:
                await resp.write(sse(first))
            decode = self.tokenizer.decode_one
            interval = self.stream_interval
            held: list[int] = []
            plain = TextChunk(shapes, with_ids=return_ids, tokenizer=self.tokenizer)
            queue = stream.queue

            def direct(ev: StreamEvent) -> bool:
                """A steady decode's token, written from the engine's step (``EventQueue.direct``): the same
                bytes as the loop below writes for it; anything else is left to the loop."""
                nonlocal n_out
                if ev.finish_reason is not None or len(ev.token_ids) != 1:
                    return False
                data = plain.token(ev.token_ids[0])
                if data is None:
                    return False
                n_out += 1
                queue.held = write_now(resp.write(data))
                return True

            if interval == 1 and pending_prompt_ids is None:
                queue.direct = direct
            while True:  # the stream's events, awaited on the queue directly (``EventQueue.arrival``)
                left = queue.held
                if left is not None:  # a direct write to finish (or its error) comes before any later event
                    queue.held = None
                    if isinstance(left, BaseException):
                        raise left
                    await left
                    continue
                ev = queue.pop()
                if ev is None:
                    await queue.arrival()
                    continue
                reason = ev.finish_reason
                if reason is FinishReason.ABORT:
                    await resp.write(sse(error_body(503, "request aborted: the engine is stopping")))
                    finished = True
                    break
                if reason is FinishReason.MIGRATED:  # it goes on elsewhere: say where, end this stream
                    moved = self.migration.moved_to.pop(stream.request_id, {}) if self.migration else {}
                    await resp.write(sse({"kvmesh_migrated": moved}))
                    await resp.write(SSE_DONE)
                    await resp.write_eof()
                    finished = True
                    return resp
                first_event = n_out == 0
                n_out += len(ev.token_ids)
                ids: list[int] | tuple[int, ...] = ev.token_ids
                if interval > 1:  # the first token at once, then every ``interval`` tokens, and the last
                    held.extend(ids)
                    if reason is None and not first_event and len(held) < interval:
                        continue
                    ids, held = held, []
                if reason is None and pending_prompt_ids is None and len(ids) == 1:
                    data = plain.token(ids[0])  # a steady decode's token: its chunk from the templates
                    if data is not None:
                        await resp.write(data)
                        continue
                text = decode(ids[0]) if len(ids) == 1 else "".join(decode(t) for t in ids)
                if reason is None and pending_prompt_ids is None and text:
                    await resp.write(plain(text, ids))
                else:
                    await resp.write(sse(shapes.chunk(text, reason.value if reason else None,
                                                      list(ids) if return_ids else None, pending_prompt_ids)))
                if pending_prompt_ids is not None and interval == 1:
                    queue.direct = direct  # the prompt's ids went with the first token: the rest may go direct
                pending_prompt_ids = None
                if reason is not None:
                    finished = True
                    break
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
            stream.queue.direct = None  # nothing more is written from the engine's step to this response
            if not finished:
                stream.abort()
        return resp


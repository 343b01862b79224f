"""The stream relay: engines' SSE answers to the client, reshaped when needed, continued elsewhere on failure.

Both flows call it through this interface: the colocated flow (``proxy``) and the disaggregated one
(``disagg``).

- ``relay`` forwards one engine's events until its ``[DONE]``, tracking the stream's state
  (:class:`StreamState`: token ids so far, identity, finish, usage). Passed through as they are when the
  engine answers the client's own request; reshaped (``rewrite``) into the client's stream shape and
  identity when the engine answers a continuation (a completion with token ids standing in for a chat
  request, after a migration or a P/D hand-off). An engine's usage chunk is withheld: ``finish`` emits one
  for the whole stream. An engine's error event (its last words when aborted) is dropped: the flow decides
  what the client sees. It returns why the stream broke, or None when it completed.
- ``continue_on`` finishes a stream on another worker: the prompt plus every token already streamed, the
  remaining budget, so the client sees no token missing or repeated.
- Chunks are built by ``actors.openai_api.ResponseShapes``, the one place (engines use it too) that knows
  the OpenAI shapes.

Failure behaviour: an engine that fails mid-relay yields a reason (never an exception); a client that goes
away raises ``ConnectionResetError`` out of the sink's ``write`` (the caller's ``async with`` on the upstream
then closes the engine's connection, aborting its request).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

from actors.openai_api import SSE_DONE, ResponseShapes, error_body, sse
from cluster.router.attempt import Attempts
from cluster.router.metrics import RouterMetrics
from cluster.router.upstream import Upstream, UpstreamError, UpstreamResponse, post_json
from cluster.router.view import WorkerInfo

DONE_EVENT = b"data: [DONE]\n\n"
ENDED_EARLY = "the stream ended before its last token"
MIGRATED = "the engine moved the request to another engine"
"""``relay``'s answer when the engine ended its stream with a ``kvmesh_migrated`` event (live migration):
``StreamState.moved`` names the peer (``cluster.router.migration`` relays the rest from there)."""
MIGRATED_EVENT = b'{"kvmesh_migrated"'


class Sink(Protocol):
    async def write(self, data: bytes) -> None: ...


@dataclass
class StreamState:
    """One answer being streamed: what a continuation needs, and the prefill blocks the router counts as
    owed by the worker until its first token (``owe``/``settle``: ``WorkerInfo.prefilling_blocks``)."""

    chat: bool
    client_usage: bool
    max_tokens: int | None
    prompt_ids: list[int] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)
    shapes: ResponseShapes | None = None
    finished: bool = False
    cached_tokens: int | None = None
    prompt_tokens: int | None = None
    owed_to: WorkerInfo | None = None
    prefill_owed: int = 0
    moved: dict[str, Any] | None = None
    """The engine's ``kvmesh_migrated`` event: the peer the request went on to (live migration)."""
    first_event: bytes | None = None
    """The first relayed event's JSON, kept as it came: the stream's identity is parsed from it when first needed
    (``identify``: the usage chunk, a continuation), not before the first token's write."""
    skip: int = 0
    """Tokens at the start of a resumed stream that the client already holds: dropped (dedupe by index)."""
    deduped: int = 0
    on_settle: Callable[[], None] | None = None
    """Called when what a worker owes is settled: its first token came back, or its attempt ended (what a miss's
    tail waits for: ``ColocatedFlow``)."""

    def owe(self, worker: WorkerInfo, blocks: int) -> None:
        """``worker`` has ``blocks`` of this prompt to prefill until its first token comes back."""
        self.settle()
        self.owed_to, self.prefill_owed = worker, blocks
        worker.prefilling_blocks += blocks

    def settle(self) -> None:
        if self.owed_to is not None:
            self.owed_to.prefilling_blocks -= self.prefill_owed
            self.owed_to, self.prefill_owed = None, 0
            if self.on_settle is not None:
                self.on_settle()

    def identify(self, ident: str | None, created: int | None, model: str | None) -> ResponseShapes:
        """The stream's identity (id, created, model), taken from its first chunk or made up front."""
        if self.shapes is None:
            if self.first_event is not None:
                try:
                    obj = json.loads(self.first_event)
                except ValueError:
                    obj = None
                if not isinstance(obj, dict):
                    obj = {}
                ident, created, model = obj.get("id"), obj.get("created"), obj.get("model")
            self.shapes = ResponseShapes(self.chat, model or "", ident)
            if created is not None:
                self.shapes.created = created
        return self.shapes

    @property
    def remaining(self) -> int | None:
        return None if self.max_tokens is None else self.max_tokens - len(self.token_ids)


class Collector:
    """A sink standing in for a client stream: collects the SSE of a non-streamed request, to answer whole."""

    def __init__(self) -> None:
        self.parts: list[bytes] = []

    async def write(self, data: bytes) -> None:
        self.parts.append(data)

    def full_response(self, st: StreamState) -> dict[str, Any]:
        text, finish = "", None
        for ev in b"".join(self.parts).split(b"\n\n"):
            if not ev.startswith(b"data: {"):
                continue
            for c in json.loads(ev[6:]).get("choices") or []:
                text += c.get("text") or (c.get("delta") or {}).get("content") or ""
                finish = c.get("finish_reason") or finish
        shapes = st.identify(None, None, None)
        return shapes.full(text, finish or "length", len(st.prompt_ids), len(st.token_ids))


class Relay:
    def __init__(self, upstream: Upstream, attempts: Attempts, metrics: RouterMetrics) -> None:
        self.upstream = upstream
        self.attempts = attempts
        self.metrics = metrics

    async def relay(self, upstream: UpstreamResponse, sink: Sink, st: StreamState, *, rewrite: bool = False,
                    final: bool = True) -> str | None:
        """Relay SSE events until the upstream's [DONE]; why the stream broke, or None when it completed.
        ``final`` False: this upstream answers only part of the request (a prefill's first token), so its
        finish is not the client's."""
        buf = b""
        while True:
            try:
                chunk = await upstream.chunk()
            except UpstreamError as e:
                return str(e)
            if not chunk:
                break
            buf = buf + chunk if buf else chunk
            end = buf.find(b"\n\n")
            if end < 0:
                continue
            if end == len(buf) - 2:  # one whole event, the engines' usual read: passed on without a copy
                event, buf = buf, b""
                if event == DONE_EVENT:
                    return self._done(st, final)
                out = self._on_event(event, st, rewrite, final)
                if out:
                    await sink.write(out)
                continue
            # Every event the read completed goes to the client in one write (one syscall).
            outs: list[bytes] = []
            start = 0
            while end >= 0:
                event = buf[start:end + 2]
                start = end + 2
                if event == DONE_EVENT:
                    if outs:
                        await sink.write(b"".join(outs))
                    return self._done(st, final)
                out = self._on_event(event, st, rewrite, final)
                if out:
                    outs.append(out)
                end = buf.find(b"\n\n", start)
            buf = buf[start:]
            if outs:
                await sink.write(outs[0] if len(outs) == 1 else b"".join(outs))
        return None if st.finished else ENDED_EARLY

    @staticmethod
    def _done(st: StreamState, final: bool) -> str | None:
        """Why a stream that reached its ``[DONE]`` broke, or None when it completed."""
        if st.moved is not None and not st.finished:
            return MIGRATED
        return None if st.finished or not final else ENDED_EARLY

    def _on_event(self, event: bytes, st: StreamState, rewrite: bool, final: bool) -> bytes:
        """Track one SSE event, its ``\\n\\n`` included (token ids, finish, usage), and return the bytes to send
        the client: the event itself when passed through (no copy).

        Every token's event takes this path, so it is a few searches of the bytes as they came, no regex and no
        JSON: every pattern below starts with a quote (or is matched from offset 6), so none can match inside
        ``data: ``, and none can match inside a JSON string (a quote in one is escaped). A token event's ids are
        found first (``"token_ids":[``): an event with ids is neither an error, a usage chunk nor a migration
        notice (their ``choices`` are absent or empty), so those checks are made only for events without."""
        if not event.startswith(b"data: "):
            return b""
        i = event.find(b'"token_ids":[', 6)
        if i < 0:
            if event.find(b'"error"', 6, 18) >= 0:
                return b""  # an aborting engine's last words; the flow decides what the client sees
            if event.startswith(MIGRATED_EVENT, 6):
                moved = json.loads(event[6:]).get("kvmesh_migrated")
                st.moved = moved if isinstance(moved, dict) else {}
                return b""
            if b'"usage"' in event and b'"choices":[]' in event:
                u = json.loads(event[6:]).get("usage") or {}
                st.cached_tokens = (u.get("prompt_tokens_details") or {}).get("cached_tokens")
                st.prompt_tokens = st.prompt_tokens or u.get("prompt_tokens")
                if st.cached_tokens:
                    self.metrics.realized_hit_tokens.inc(st.cached_tokens)
                if st.prompt_tokens:
                    self.metrics.prompt_tokens.inc(u.get("prompt_tokens", 0))
                return b""  # re-emitted with the whole stream's counts by finish()
        else:
            i += 13
            j = event.find(b"]", i)
            if j > i:
                if st.owed_to is not None:
                    st.settle()
                ids = event[i:j]
                if ids.isdigit() and not st.skip:
                    st.token_ids.append(int(ids))  # one token an event, as engines stream
                elif not self._track_ids(st, ids):
                    return b""
        if b'"finish_reason":"' in event and final:
            st.finished = True
        if not rewrite:
            if st.first_event is None and st.shapes is None:
                st.first_event = event[6:]  # (parsed by ``identify`` if ever needed)
            return event
        obj = json.loads(event[6:])
        choice = (obj.get("choices") or [{}])[0]
        shapes = st.identify(obj.get("id"), obj.get("created"), obj.get("model"))
        finish = choice.get("finish_reason") if final else None
        return sse(shapes.chunk(choice.get("text", ""), finish, choice.get("token_ids")))

    @staticmethod
    def _track_ids(st: StreamState, listed: bytes) -> bool:
        """Add an event's token ids (``listed``: what stands between the brackets) to the stream, less those a
        resumed stream's client already holds (dedupe by index: engines send one per event); False when none is
        left (the event is dropped). A list that is not of integers is no token ids (the event passes as is)."""
        try:
            ids = [int(x) for x in listed.split(b",")]
        except ValueError:
            return True
        if st.skip:
            dup = min(st.skip, len(ids))
            st.skip -= dup
            st.deduped += dup
            ids = ids[dup:]
            if not ids:
                return False
        st.token_ids.extend(ids)
        return True

    async def finish(self, sink: Sink, st: StreamState) -> None:
        """The whole stream's usage (when the client asked for it), then ``[DONE]``, in one write (one syscall
        and one chunk of the client's chunked body, not two)."""
        if st.client_usage:
            prompt = st.prompt_tokens if st.prompt_tokens is not None else len(st.prompt_ids)
            shapes = st.identify(None, None, None)
            await sink.write(sse(shapes.usage_chunk(prompt, len(st.token_ids), st.cached_tokens)) + SSE_DONE)
            return
        await sink.write(SSE_DONE)

    @staticmethod
    async def fail(sink: Sink, status: int, message: str) -> None:
        """End a begun stream with an error event and ``[DONE]`` in one write (the client is never left waiting)."""
        await sink.write(sse(error_body(status, message)) + SSE_DONE)

    async def continue_on(self, workers: list[WorkerInfo], st: StreamState, *, model: str | None,
                          ignore_eos: bool, origin: str | None, sink: Sink) -> bool:
        """Finish the stream on the first of ``workers`` that completes it, as an ordinary completion of the
        prompt plus the tokens already sent; True when the stream completed (or had nothing left to do)."""
        for w in workers:
            remaining = st.remaining
            if remaining is not None and remaining <= 0:
                st.finished = True
                return True
            body: dict[str, Any] = {"prompt": st.prompt_ids + st.token_ids, "stream": True,
                                    "output_token_ids": True, "ignore_eos": ignore_eos,
                                    "stream_options": {"include_usage": True}}
            if remaining is not None:
                body["max_tokens"] = remaining
            if model:
                body["model"] = model
            async with self.attempts.on(w, origin):
                try:
                    async with await post_json(self.upstream, w.url, "/v1/completions", body) as up:
                        if up.status == 200:
                            before = st.prompt_tokens
                            failure = await self.relay(up, sink, st, rewrite=True)
                            st.prompt_tokens = before
                            if failure is None:
                                self.attempts.succeeded(w)
                                await up.drain()  # keep the connection pooled (Upstream's docstring)
                                return True
                except UpstreamError:
                    pass
                self.attempts.failed(w)
        return False

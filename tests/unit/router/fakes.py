"""Fake engines behind the router's ``Upstream`` interface, and a fake client stream: no sockets, no Ray.

An engine is a script: a function from the request it receives to the answer it gives (status, headers,
body parts). A part may be bytes, an exception to raise while reading (a broken connection, a read
timeout), ``STALL`` (the engine goes silent forever) or an ``asyncio.Event`` (silent until the test sets it: a
prefill). The upstream records every request and every
answer still open, so a test can assert the router left no connection behind and aborted what it should.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from types import TracebackType
from typing import Any, Self

from cluster.router.upstream import UpstreamError

STALL = object()


@dataclass
class Sent:
    """A request as a fake engine received it."""

    engine: str
    method: str
    path: str
    body: Any
    headers: Mapping[str, str]


@dataclass
class Answer:
    status: int = 200
    parts: list[Any] = field(default_factory=list)
    headers: dict[str, str] = field(default_factory=lambda: {"Content-Type": "text/event-stream"})
    stall_head: bool = False
    """Never send the status line (an engine that accepted the connection and hangs)."""


def event(obj: dict[str, Any]) -> bytes:
    return b"data: " + json.dumps(obj, separators=(",", ":")).encode() + b"\n\n"


def token_events(ids: list[int], *, rid: str = "cmpl-e", finish: bool = True, usage: int | None = None,
                 cached: int = 0) -> list[bytes]:
    """An engine's completion stream (``output_token_ids``): one event per token, usage, [DONE]."""
    out = []
    for k, t in enumerate(ids):
        last = finish and k == len(ids) - 1
        out.append(event({"id": rid, "object": "text_completion", "created": 7, "model": "m",
                          "choices": [{"index": 0, "text": f"t{t} ", "logprobs": None,
                                       "finish_reason": "length" if last else None, "stop_reason": None,
                                       "token_ids": [t]}]}))
    if finish:
        if usage is not None:
            out.append(event({"id": rid, "object": "text_completion", "created": 7, "model": "m", "choices": [],
                              "usage": {"prompt_tokens": usage, "completion_tokens": len(ids),
                                        "total_tokens": usage + len(ids),
                                        "prompt_tokens_details": {"cached_tokens": cached}}}))
        out.append(b"data: [DONE]\n\n")
    return out


Script = Callable[[Sent], Answer]


class FakeResponse:
    def __init__(self, owner: FakeUpstream, answer: Answer) -> None:
        self.owner = owner
        self.status = answer.status
        self.headers: Mapping[str, str] = answer.headers
        self._parts = list(answer.parts)
        self.eof = False
        self.closed = False
        self.aborted = False
        self.drained = False

    async def chunk(self) -> bytes:
        if self.closed:
            raise UpstreamError("read after close")
        if not self._parts:
            self.eof = True
            return b""
        p = self._parts.pop(0)
        if isinstance(p, BaseException):
            raise p
        if p is STALL:
            await asyncio.get_running_loop().create_future()  # silent until cancelled
        if isinstance(p, asyncio.Event):
            await p.wait()
            return await self.chunk()
        return bytes(p)

    async def read(self) -> bytes:
        out = b""
        while data := await self.chunk():
            out += data
        return out

    async def drain(self, wait_s: float = 0.05) -> bool:
        """What is left of the answer, read up to its end unless it stalls or fails (then not ended)."""
        self.drained = True
        while self._parts and self._parts[0] is not STALL and not isinstance(self._parts[0], BaseException):
            self._parts.pop(0)
        if not self._parts:
            self.eof = True
        return self.eof

    def close(self) -> None:
        if not self.closed:
            self.closed = True
            self.aborted = not self.eof
            self.owner.open.discard(self)

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(self, t: type[BaseException] | None, e: BaseException | None,
                        tb: TracebackType | None) -> None:
        self.close()


class FakeUpstream:
    """Engines by base URL; an engine absent or marked down refuses connections."""

    def __init__(self) -> None:
        self.engines: dict[str, Script] = {}
        self.down: set[str] = set()
        self.sent: list[Sent] = []
        self.open: set[FakeResponse] = set()
        self.answered: list[FakeResponse] = []
        self.warmed: list[tuple[str, int]] = []
        """``warm`` calls: (engine, connections)."""
        self.closed = False

    def engine(self, url: str, script: Script) -> None:
        self.engines[url] = script

    async def request(self, method: str, base_url: str, path: str, body: bytes = b"",
                      headers: Mapping[str, str] | None = None,
                      sent: Callable[[], None] | None = None) -> FakeResponse:
        if sent is not None:
            sent()  # (on its way: before any other task runs, as AiohttpUpstream calls it)
        await asyncio.sleep(0)
        if base_url in self.down or base_url not in self.engines:
            raise UpstreamError(f"cannot connect to {base_url}: connection refused")
        got = Sent(base_url, method, path, json.loads(body) if body else None, dict(headers or {}))
        self.sent.append(got)
        answer = self.engines[base_url](got)
        if answer.stall_head:
            await asyncio.get_running_loop().create_future()
        resp = FakeResponse(self, answer)
        self.open.add(resp)
        self.answered.append(resp)
        return resp

    async def warm(self, base_url: str, connections: int) -> int:
        self.warmed.append((base_url, connections))
        return 0 if base_url in self.down or base_url not in self.engines else connections

    def to(self, url: str, path: str = "/v1/completions") -> list[Sent]:
        return [s for s in self.sent if s.engine == url and s.path == path]

    async def close(self) -> None:
        self.closed = True


class FakeClient:
    """The client's end of a stream; ``leave_after`` writes, it disconnects (writes raise)."""

    def __init__(self, leave_after: int | None = None) -> None:
        self.headers: dict[str, str] = {}
        self.data = b""
        self.writes = 0
        self.leave_after = leave_after
        self._started = False

    @property
    def started(self) -> bool:
        return self._started

    async def start(self, headers: Mapping[str, str]) -> None:
        self._started = True
        self.headers = dict(headers)

    async def write(self, data: bytes) -> None:
        if self.leave_after is not None and self.writes >= self.leave_after:
            raise ConnectionResetError("the client closed the connection")
        self.writes += 1
        self.data += data

    def events(self) -> list[Any]:
        out: list[Any] = []
        for ev in self.data.split(b"\n\n"):
            if ev == b"data: [DONE]":
                out.append("[DONE]")
            elif ev.startswith(b"data: "):
                out.append(json.loads(ev[6:]))
        return out

    def token_ids(self) -> list[int]:
        return [t for ev in self.events() if isinstance(ev, dict)
                for c in ev.get("choices") or [] for t in c.get("token_ids") or []]

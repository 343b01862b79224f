"""What the router's mechanism sees of HTTP: a call in, a whole answer or a stream out.

The mechanism (admission, attempts, relay, P/D flow) is written against these few types so its unit tests
run without sockets; ``cluster.router.web`` adapts them to aiohttp's server. A handler either returns a
:class:`Whole` answer or writes a stream through the :class:`ClientStream` it was given and returns None.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol

from actors.openai_api import error_body

JSON = "application/json; charset=utf-8"
SSE_HEADERS = {"Content-Type": "text/event-stream", "Cache-Control": "no-cache"}


@dataclass(frozen=True)
class Call:
    """One request as the mechanism reads it: path, headers (case-insensitive mapping), whole body."""

    path: str
    headers: Mapping[str, str]
    body: bytes = b""
    match: Mapping[str, str] = field(default_factory=dict)
    """Values of the path's ``{name}`` parts."""


@dataclass(frozen=True)
class Whole:
    """An answer sent in one piece, with its length."""

    status: int
    body: bytes = b""
    headers: Mapping[str, str] = field(default_factory=dict)


class ClientStream(Protocol):
    """The client's end of a streamed answer (Server-Sent Events)."""

    @property
    def started(self) -> bool: ...

    async def start(self, headers: Mapping[str, str]) -> None:
        """Send status 200 and ``headers``; the body follows with ``write``."""
        ...

    async def write(self, data: bytes) -> None:
        """Send ``data`` at once; raises ``ConnectionResetError`` once the client is gone."""
        ...


def json_whole(data: Any, status: int = 200, headers: Mapping[str, str] | None = None) -> Whole:
    return Whole(status, json.dumps(data).encode(), {"Content-Type": JSON, **(headers or {})})


def json_error(status: int, message: str, headers: Mapping[str, str] | None = None) -> Whole:
    """An error in OpenAI's shape, which the official client parses."""
    return json_whole(error_body(status, message), status, headers)

"""Streaming OpenAI-completions client that times every chunk, as vLLM's benchmark client does.

Each request is a POST to ``/v1/completions`` with a token-id prompt (the ``prompt`` field as a list of
ints), ``max_tokens = output_len``, ``ignore_eos = true``, ``stream = true`` and
``stream_options.include_usage = true``. The client reads the SSE stream as it arrives (lines of any
length) and stamps each ``data:`` event with the ``time.monotonic()`` of the read that completed it: an
event whose ``choices`` list is non-empty is a content chunk (the first one gives TTFT, each later one an
inter-token gap, the last one E2E); an event with ``usage`` gives the token counts
(``completion_tokens``, ``prompt_tokens``, ``prompt_tokens_details.cached_tokens``). Wall durations
become emulated ms by dividing by ``time_scale``.

Per-request tags travel as headers (``X-Request-Id``, ``X-Region`` for the origin region, as the router
reads it, ``X-Residency``, ``X-Session-Id``) and ``priority`` as a body field (vLLM's name for
it), only when set, so any OpenAI-compatible server accepts the request. The worker that served a
request is read from the router's ``X-Served-By`` response header when there is one.

Failure behaviour: no exception escapes ``send``; a non-200 answer, a timeout, a dropped connection, an
unparsable event or a stream without any content chunk becomes a record with that status and the error
text (clipped), so a bad server never loses a request from the report. ``abandon_open`` ends the streams
still open (the replayer calls it when the server has reported nothing in flight for a while, i.e. a
stream the server forgot to end); each becomes a ``stalled`` record.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

import aiohttp
import numpy as np
import orjson

from cluster.loadtest.record import RequestRecord, Status
from cluster.loadtest.spec import RequestSpec
from cluster.loadtest.synthesis import PromptSynthesizer

COMPLETIONS_PATH = "/v1/completions"
MODELS_PATH = "/v1/models"
HEADER_REQUEST_ID = "X-Request-Id"
HEADER_ORIGIN = "X-Region"
HEADER_RESIDENCY = "X-Residency"
HEADER_SESSION = "X-Session-Id"
HEADER_WORKER = "X-Served-By"
MAX_ERROR_CHARS = 300


class TargetError(RuntimeError):
    """The target cannot be used at all (no model list, not reachable); the message says what to check."""


@dataclass(frozen=True)
class ClientConfig:
    """How requests are sent. ``model`` None asks the target (``GET /v1/models``, first entry)."""

    model: str | None = None
    time_scale: float = 1.0
    """Wall seconds per emulated second of the target (from the cluster spec, or --time-scale)."""
    request_timeout_s: float = 3600.0
    """Wall seconds one request may take from send to last byte."""
    extra_body: Mapping[str, Any] = field(default_factory=dict)
    request_id_prefix: str = ""
    """Prepended to every ``X-Request-Id`` so concurrent runs against one server never reuse an id."""
    prompt_format: Literal["ids", "text"] = "ids"
    """``text`` sends each synthesized prompt as words (see ``ids_to_text``), for servers and routers
    that take only text prompts (SGLang's router); prefix sharing is kept block for block."""
    record_tokens: bool = False
    """Ask for the token ids of every chunk (kvmesh's ``output_token_ids``) and keep them and the prompt
    in each record, for the history checker (``cluster.chaos.checker``)."""


def ids_to_text(ids: Sequence[int]) -> str:
    """One short word per token id, each a single token of kvmesh's built-in tokenizer (a space and three
    letters), so the text has exactly ``len(ids)`` tokens and equal id prefixes give equal text prefixes."""
    out = []
    for t in ids:
        t %= 17576
        out.append(" " + chr(97 + t // 676) + chr(97 + (t // 26) % 26) + chr(97 + t % 26))
    return "".join(out)


def build_payload(spec: RequestSpec, model: str, prompt: Sequence[int] | np.ndarray | str,
                  extra: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """The JSON body of one completions request."""
    body: dict[str, Any] = {
        "model": model, "prompt": prompt, "max_tokens": spec.output_len, "ignore_eos": True,
        "stream": True, "stream_options": {"include_usage": True}, "temperature": 0.0,
    }
    if spec.priority is not None:
        body["priority"] = spec.priority
    if extra:
        body.update(extra)
    return body


def build_headers(spec: RequestSpec, id_prefix: str = "") -> dict[str, str]:
    h = {"Content-Type": "application/json", HEADER_REQUEST_ID: f"{id_prefix}{spec.request_id}"}
    if spec.origin_region:
        h[HEADER_ORIGIN] = spec.origin_region
    if spec.residency_region:
        h[HEADER_RESIDENCY] = spec.residency_region
    if spec.session_id:
        h[HEADER_SESSION] = spec.session_id
    return h


def is_plain_content(data: bytes) -> bool:
    """Whether an event's JSON is a mid-stream content chunk (a choice, no finish, no usage, no error), told
    from its bytes alone: the load generator need not parse the events that only mark a token's arrival."""
    return (data[:1] == b"{" and data[-1:] == b"}" and b'"choices":[{' in data and b'"finish_reason":null' in data
            and b'"usage"' not in data and b'"error"' not in data)


class SSELines:
    """Splits a byte stream into lines of any length (``\n`` or ``\r\n`` ended).

    aiohttp's ``readline`` refuses lines over 512 KiB, and a server may legitimately send one (vLLM's
    ``return_token_ids`` puts the whole prompt's ids in the first chunk: 700 KB for a 120k-token prompt).
    Only data that brings a newline triggers a split, so a long line arriving in many pieces costs one.
    """

    def __init__(self) -> None:
        self._buf = bytearray()

    def feed(self, data: bytes) -> list[bytes]:
        """The lines completed by ``data`` (without their line ends)."""
        self._buf += data
        if b"\n" not in data:
            return []
        *lines, rest = self._buf.split(b"\n")
        self._buf = bytearray(rest)
        return [bytes(line[:-1]) if line.endswith(b"\r") else bytes(line) for line in lines]

    def rest(self) -> bytes:
        """What is left after the last newline (a stream may end without one)."""
        return bytes(self._buf)


@dataclass(frozen=True)
class PreparedRequest:
    """A request ready to go: its spec, encoded body and headers (built before its send time)."""

    spec: RequestSpec
    body: bytes
    headers: dict[str, str]
    prompt_ids: tuple[int, ...] = ()
    """Kept only with ``ClientConfig.record_tokens``."""


class CompletionClient:
    """Sends prepared requests to one base URL on a shared aiohttp session; see the module docstring."""

    def __init__(self, session: aiohttp.ClientSession, base_url: str, config: ClientConfig,
                 synthesizer: PromptSynthesizer, origin: float | None = None) -> None:
        self.session = session
        self.base_url = base_url.rstrip("/")
        self.config = config
        self.synthesizer = synthesizer
        self.origin = time.monotonic() if origin is None else origin
        self.model: str | None = config.model
        self._timeout = aiohttp.ClientTimeout(total=config.request_timeout_s, sock_connect=30.0)
        self._open: dict[asyncio.Task[Any], float] = {}
        self._abandoned: dict[asyncio.Task[Any], str] = {}

    @property
    def open_count(self) -> int:
        """Requests sent and not finished yet."""
        return len(self._open)

    def abandon_open(self, reason: str, older_than_s: float = 0.0) -> int:
        """End every request open for at least ``older_than_s`` wall seconds now, as ``stalled`` with
        ``reason``; returns how many."""
        now = time.monotonic()
        tasks = [task for task, since in self._open.items() if now - since >= older_than_s]
        for task in tasks:
            self._abandoned[task] = reason
            task.cancel()
        return len(tasks)

    def emulated_ms(self, wall: float) -> float:
        """Emulated ms since the origin of a ``time.monotonic()`` value."""
        return (wall - self.origin) / self.config.time_scale * 1000.0

    async def resolve_model(self, wait_s: float = 30.0) -> str:
        """The model to name in requests: the configured one, else the target's first listed model.
        Retries for ``wait_s`` wall seconds while the target is starting; raises ``TargetError``."""
        if self.model is not None:
            return self.model
        deadline = time.monotonic() + wait_s
        last = "no answer"
        while True:
            try:
                async with self.session.get(f"{self.base_url}{MODELS_PATH}",
                                            timeout=aiohttp.ClientTimeout(total=10.0)) as resp:
                    if resp.status == 200:
                        data = await resp.json(content_type=None)
                        models = data.get("data") if isinstance(data, dict) else None
                        if isinstance(models, list) and models and isinstance(models[0], dict) \
                                and isinstance(models[0].get("id"), str):
                            self.model = str(models[0]["id"])
                            return self.model
                        raise TargetError(f"{self.base_url}{MODELS_PATH} lists no model; pass --model")
                    last = f"HTTP {resp.status}"
            except (TimeoutError, aiohttp.ClientError, ValueError) as e:
                last = f"{type(e).__name__}: {e}"
            if time.monotonic() >= deadline:
                raise TargetError(f"cannot read the model list at {self.base_url}{MODELS_PATH} ({last}); "
                                  f"is the server up? (or pass --model)")
            await asyncio.sleep(0.5)

    def prepare(self, spec: RequestSpec) -> PreparedRequest:
        """Synthesize the prompt and encode the body (CPU work done ahead of the send time)."""
        if self.model is None:
            raise TargetError("model not resolved: call resolve_model() first")
        ids = self.synthesizer.prompt_array(spec)
        prompt: np.ndarray | str = ids_to_text(ids.tolist()) if self.config.prompt_format == "text" else ids
        extra = {**self.config.extra_body, "output_token_ids": True} if self.config.record_tokens \
            else self.config.extra_body
        payload = build_payload(spec, self.model, prompt, extra)
        # orjson writes the int64 array itself: the same bytes as a list of ints, without building one
        # (a 123k-token body: 1.5 ms, not 3.8; json's would be ~10).
        body = orjson.dumps(payload, option=orjson.OPT_SERIALIZE_NUMPY)
        return PreparedRequest(spec, body, build_headers(spec, self.config.request_id_prefix),
                               tuple(ids.tolist()) if self.config.record_tokens else ())

    async def send(self, req: PreparedRequest, scheduled_wall: float) -> RequestRecord:
        """Send one request now and time its stream; never raises (see the module docstring)."""
        spec = req.spec
        st = time.monotonic()
        first: float | None = None
        last = st
        gaps: list[float] = []
        chunks = 0
        tokens: list[int] = []
        usage: dict[str, Any] = {}
        status: Status = "ok"
        http_status: int | None = None
        error = ""
        worker: str | None = None
        me = asyncio.current_task()
        if me is not None:
            self._open[me] = st
        try:
            async with self.session.post(f"{self.base_url}{COMPLETIONS_PATH}", data=req.body,
                                         headers=req.headers, timeout=self._timeout) as resp:
                http_status = resp.status
                worker = resp.headers.get(HEADER_WORKER)
                if resp.status != 200:
                    status = "http_error"
                    error = (await resp.text(errors="replace"))[:MAX_ERROR_CHARS]
                else:
                    lines = SSELines()
                    done = False
                    fast = not self.config.record_tokens
                    async for piece in resp.content.iter_any():
                        now = time.monotonic()
                        for line in lines.feed(piece):
                            if not line.startswith(b"data:"):
                                continue
                            data = line[5:].strip()
                            if data == b"[DONE]":
                                done = True
                                break
                            if fast and is_plain_content(data):
                                # A mid-stream content chunk: only its arrival matters here, no parse.
                                if first is None:
                                    first = now
                                else:
                                    gaps.append(now - last)
                                last = now
                                chunks += 1
                                continue
                            event = orjson.loads(data)
                            if not isinstance(event, dict):
                                raise ValueError(f"event is not a JSON object: {data[:80]!r}")
                            if event.get("choices"):
                                if self.config.record_tokens:
                                    choice = event["choices"][0]
                                    ids = choice.get("token_ids") if isinstance(choice, dict) else None
                                    if isinstance(ids, list):
                                        tokens.extend(int(t) for t in ids)
                                if first is None:
                                    first = now
                                else:
                                    gaps.append(now - last)
                                last = now
                                chunks += 1
                            if isinstance(event.get("usage"), dict):
                                usage = event["usage"]
                            if isinstance(event.get("error"), dict | str):
                                raise ValueError(f"error event: {str(event['error'])[:MAX_ERROR_CHARS]}")
                        if done:
                            break
                    if first is None:
                        status = "no_content"
                        error = "the stream carried no content chunk"
        except TimeoutError:
            status, error = "timeout", f"no complete answer within {self.config.request_timeout_s} s"
        except (aiohttp.ClientConnectionError, aiohttp.ClientPayloadError) as e:
            status, error = "connection_error", f"{type(e).__name__}: {e}"[:MAX_ERROR_CHARS]
        except (ValueError, aiohttp.ClientError) as e:
            status, error = "protocol_error", f"{type(e).__name__}: {e}"[:MAX_ERROR_CHARS]
        except Exception as e:  # never lose a request from the report, whatever the server did
            status, error = "protocol_error", f"{type(e).__name__}: {e}"[:MAX_ERROR_CHARS]
        except asyncio.CancelledError:
            if me is None or me not in self._abandoned:
                raise
            me.uncancel()
            status, error = "stalled", self._abandoned.pop(me)[:MAX_ERROR_CHARS]
        finally:
            if me is not None:
                self._open.pop(me, None)
        finished = time.monotonic()
        scale = 1000.0 / self.config.time_scale
        ok = status == "ok" and first is not None
        completion = usage.get("completion_tokens")
        prompt_tokens = usage.get("prompt_tokens")
        details = usage.get("prompt_tokens_details")
        cached = details.get("cached_tokens") if isinstance(details, dict) else None
        return RequestRecord(
            request_id=spec.request_id, status=status, scheduled_ms=self.emulated_ms(scheduled_wall),
            sent_ms=self.emulated_ms(st), input_len=spec.input_len, expected_output_len=spec.output_len,
            ttft_ms=(first - st) * scale if ok and first is not None else None,
            e2e_ms=(last - st) * scale if ok else None,
            itl_ms=tuple(g * scale for g in gaps) if ok else (),
            output_tokens=(int(completion) if isinstance(completion, int) else chunks) if ok else 0,
            prompt_tokens=prompt_tokens if isinstance(prompt_tokens, int) else None,
            cached_tokens=cached if isinstance(cached, int) else None,
            http_status=http_status, error=error, worker=worker, session_id=spec.session_id,
            send_lag_wall_ms=(st - scheduled_wall) * 1000.0,
            finished_ms=self.emulated_ms(finished),
            deadline_ms=self.emulated_ms(st + self.config.request_timeout_s),
            residency=spec.residency_region, token_ids=tuple(tokens), prompt_ids=req.prompt_ids,
        )

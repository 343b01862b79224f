"""The OpenAI API as vLLM serves it: request validation, response and SSE chunk shapes, error bodies."""

from __future__ import annotations

import json
import time
import uuid
from typing import Any, Literal

import orjson
from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictInt, StrictStr, ValidationError

MAX_BODY_BYTES = 64 * 1024 * 1024


class ApiError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param


ERROR_TYPES = {400: "BadRequestError", 404: "NotFoundError", 413: "RequestTooLargeError", 429: "RateLimitError",
               500: "InternalServerError", 503: "ServiceUnavailableError"}


def error_body(status: int, message: str, param: str | None = None) -> dict[str, Any]:
    """OpenAI's error shape (``{"error": {...}}``), which the official client parses."""
    return {"error": {"message": message, "type": ERROR_TYPES.get(status, "Error"), "param": param,
                      "code": status}}


class _Lenient(BaseModel):
    # Unknown sampling fields (temperature, top_p, stop, ...) are accepted and ignored, as vLLM does.
    model_config = ConfigDict(extra="allow")


class StreamOptions(_Lenient):
    include_usage: StrictBool = False
    continuous_usage_stats: StrictBool = False


class _Common(_Lenient):
    model: StrictStr | None = None
    n: StrictInt = 1
    stream: StrictBool = False
    stream_options: StreamOptions | None = None
    ignore_eos: StrictBool = False
    seed: StrictInt | None = None
    user: StrictStr | None = None
    return_token_ids: StrictBool = False
    """vLLM's extension: put ``prompt_token_ids`` in the first chunk and ``token_ids`` in every choice."""
    output_token_ids: StrictBool = False
    """kvmesh's (what its router asks for): ``token_ids`` in every choice, but no prompt ids."""


class CompletionRequest(_Common):
    prompt: StrictStr | list[StrictInt] | list[StrictStr] | list[list[StrictInt]]
    max_tokens: StrictInt | None = 16


class ContentPart(_Lenient):
    type: StrictStr
    text: StrictStr | None = None


class ChatMessage(_Lenient):
    role: Literal["system", "user", "assistant", "tool", "developer"]
    content: StrictStr | list[ContentPart] | None = None

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(p.text or "" for p in self.content if p.type == "text")


class ChatCompletionRequest(_Common):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: StrictInt | None = None
    max_completion_tokens: StrictInt | None = None

    def limit(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens


def parse_json_object(raw: bytes) -> dict[str, Any]:
    """The request body as a JSON object, or a 400 saying why it is not one.

    orjson: an 87k-token prompt's 580 kB body parses in 2 ms instead of the standard library's 9 ms, which
    is time the engine's (or router's) event loop stands still. It differs from ``json`` only on what is not
    JSON (NaN, Infinity: refused here as invalid) and on integers beyond 64 bits (floats, which the request
    models refuse where they want integers).
    """
    try:
        data = orjson.loads(raw)
    except orjson.JSONDecodeError as e:
        raise ApiError(400, f"request body is not valid JSON: {e}") from None
    if not isinstance(data, dict):
        raise ApiError(400, "request body must be a JSON object")
    return data


def parse_body(raw: bytes, cls: type[BaseModel]) -> Any:
    """JSON body to a request model; any defect is a 400 that says which field and why."""
    return validate_request(parse_json_object(raw), cls)


def validate_request(data: dict[str, Any], cls: type[BaseModel]) -> Any:
    """A parsed JSON object as a request model (a 400 naming the field on any defect)."""
    try:
        req = cls.model_validate(data)
    except ValidationError as e:
        first = e.errors()[0]
        loc = ".".join(str(x) for x in first["loc"])
        raise ApiError(400, f"invalid field '{loc}': {first['msg']}", loc or None) from None
    if getattr(req, "n", 1) != 1:
        raise ApiError(400, "only n=1 is supported", "n")
    return req


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def usage(prompt: int, completion: int, cached: int | None = None) -> dict[str, Any]:
    out: dict[str, Any] = {"prompt_tokens": prompt, "total_tokens": prompt + completion,
                           "completion_tokens": completion}
    if cached is not None:
        out["prompt_tokens_details"] = {"cached_tokens": cached}
    return out


def sse(obj: dict[str, Any]) -> bytes:
    return b"data: " + json.dumps(obj, separators=(",", ":")).encode() + b"\n\n"


SSE_DONE = b"data: [DONE]\n\n"


class ResponseShapes:
    """Builds vLLM-shaped bodies for one request (completion or chat)."""

    def __init__(self, chat: bool, model: str, request_id: str | None = None) -> None:
        self.chat = chat
        self.model = model
        self.id = request_id or new_id("chatcmpl" if chat else "cmpl")
        self.created = int(time.time())
        self.object_full = "chat.completion" if chat else "text_completion"
        self.object_chunk = "chat.completion.chunk" if chat else "text_completion"

    def _head(self, obj: str) -> dict[str, Any]:
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model}

    def first_chunk(self) -> dict[str, Any] | None:
        if not self.chat:
            return None
        return {**self._head(self.object_chunk),
                "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                             "finish_reason": None}]}

    def chunk(self, text: str, finish_reason: str | None, token_ids: list[int] | None = None,
              prompt_token_ids: list[int] | None = None) -> dict[str, Any]:
        choice: dict[str, Any]
        if self.chat:
            choice = {"index": 0, "delta": {"content": text} if text else {}, "logprobs": None,
                      "finish_reason": finish_reason}
        else:
            choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": finish_reason,
                      "stop_reason": None}
        if token_ids is not None:
            choice["token_ids"] = token_ids
        if prompt_token_ids is not None:
            choice["prompt_token_ids"] = prompt_token_ids
        return {**self._head(self.object_chunk), "choices": [choice]}

    def usage_chunk(self, prompt: int, completion: int, cached: int | None = None) -> dict[str, Any]:
        return {**self._head(self.object_chunk), "choices": [], "usage": usage(prompt, completion, cached)}

    def full(self, text: str, finish_reason: str, prompt: int, completion: int, cached: int | None = None,
             token_ids: list[int] | None = None) -> dict[str, Any]:
        choice: dict[str, Any]
        if self.chat:
            choice = {"index": 0, "message": {"role": "assistant", "content": text}, "logprobs": None,
                      "finish_reason": finish_reason}
        else:
            choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": finish_reason,
                      "stop_reason": None}
        if token_ids is not None:
            choice["token_ids"] = token_ids
        return {**self._head(self.object_full), "choices": [choice], "usage": usage(prompt, completion, cached)}

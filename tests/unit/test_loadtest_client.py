"""The client's request shape, SSE line splitting and stall handling (no sockets)."""

from __future__ import annotations

import asyncio
import json

import pytest

from cluster.loadtest import ClientConfig, PromptSynthesizer, RequestId, RequestSpec
from cluster.loadtest.client import CompletionClient, SSELines, build_headers, build_payload
from cluster.loadtest.scrape import DepthSample, router_inflight


def test_payload_is_a_streaming_token_id_completion() -> None:
    spec = RequestSpec(RequestId("r1"), 0.0, 3, 7, (), 16, priority=2)
    body = build_payload(spec, "m", [5, 6, 7], {"seed": 1})
    assert body == {"model": "m", "prompt": [5, 6, 7], "max_tokens": 7, "ignore_eos": True, "stream": True,
                    "stream_options": {"include_usage": True}, "temperature": 0.0, "priority": 2, "seed": 1}
    assert "priority" not in build_payload(RequestSpec(RequestId("r"), 0.0, 1, 1), "m", [5])


def test_headers_carry_the_tags_only_when_set() -> None:
    bare = build_headers(RequestSpec(RequestId("r1"), 0.0, 1, 1), "run7-")
    assert bare == {"Content-Type": "application/json", "X-Request-Id": "run7-r1"}
    tagged = build_headers(RequestSpec(RequestId("r2"), 0.0, 1, 1, origin_region="us-east-1",
                                       residency_region="eu-west-1", session_id="s9"))
    assert (tagged["X-Region"], tagged["X-Residency"], tagged["X-Session-Id"]) == ("us-east-1", "eu-west-1", "s9")


def test_sse_lines_of_any_length_split_across_reads() -> None:
    big = b"data: " + json.dumps({"choices": [{"prompt_token_ids": list(range(200_000))}]}).encode()
    stream = b"data: {\"a\":1}\r\n\r\n" + big + b"\n\ndata: [DONE]\n\n"
    lines = SSELines()
    out: list[bytes] = []
    for i in range(0, len(stream), 4096):
        out.extend(lines.feed(stream[i:i + 4096]))
    assert out == [b'data: {"a":1}', b"", big, b"", b"data: [DONE]", b""]
    assert lines.rest() == b""
    tail = SSELines()
    assert tail.feed(b"data: x") == [] and tail.rest() == b"data: x"


class _NeverAnswers:
    """An aiohttp-session stand-in whose POST never completes (the client's stall handling, no sockets)."""

    def post(self, *args: object, **kwargs: object) -> _NeverAnswers:
        return self

    async def __aenter__(self) -> None:
        await asyncio.Event().wait()

    async def __aexit__(self, *exc: object) -> None:
        return None


async def test_abandoned_requests_become_stalled_records_and_others_are_untouched() -> None:
    client = CompletionClient(_NeverAnswers(), "http://x", ClientConfig(model="m"),  # type: ignore[arg-type]
                              PromptSynthesizer(0))
    old = asyncio.create_task(client.send(client.prepare(RequestSpec(RequestId("old"), 0.0, 4, 2)), 0.0))
    await asyncio.sleep(0.05)
    young = asyncio.create_task(client.send(client.prepare(RequestSpec(RequestId("young"), 0.0, 4, 2)), 0.0))
    await asyncio.sleep(0)
    assert client.open_count == 2
    assert client.abandon_open("forgotten", older_than_s=0.04) == 1
    rec = await old
    assert (rec.request_id, rec.status, rec.error, rec.success) == ("old", "stalled", "forgotten", False)
    assert client.open_count == 1 and not young.done()
    young.cancel()  # a cancellation that is not an abandonment propagates
    with pytest.raises(asyncio.CancelledError):
        await young
    assert client.open_count == 0


def test_idle_needs_gauges_and_counts_router_held_requests() -> None:
    assert DepthSample(0.0, 0.0, 0.0).idle is True
    assert DepthSample(0.0, 0.0, 0.0, router_inflight=2).idle is False
    assert DepthSample(0.0, 1.0, 0.0).idle is False
    assert DepthSample(0.0, None, None).idle is None
    assert router_inflight([{"name": "a", "inflight": 2}, {"name": "b", "inflight": 1}]) == 3.0
    assert router_inflight([{"name": "a"}]) is None and router_inflight(None) is None


def test_plain_content_chunks_are_told_from_their_bytes() -> None:
    from actors.openai_api import ResponseShapes, error_body, sse
    from cluster.loadtest.client import is_plain_content

    shapes = ResponseShapes(False, "m", "cmpl-1")
    body = sse(shapes.chunk(" hi", None))[6:-2]
    assert is_plain_content(body)
    assert not is_plain_content(sse(shapes.chunk(" hi", "length"))[6:-2])  # the last one: parsed
    assert not is_plain_content(sse(shapes.usage_chunk(3, 2))[6:-2])
    assert not is_plain_content(sse(error_body(503, "gone"))[6:-2])
    assert not is_plain_content(body[:-1])  # truncated: parsed, and refused there

"""The client's request shape and its SSE line splitting (no sockets)."""

from __future__ import annotations

import json

from cluster.loadtest import RequestId, RequestSpec
from cluster.loadtest.client import SSELines, build_headers, build_payload


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

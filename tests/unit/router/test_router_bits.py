"""Small pure helpers of the router mechanism."""

from __future__ import annotations

import json

from cluster.router.choice import RoutedRequest
from cluster.router.proxy import splice_json, stream_payload


def test_splice_json_appends_and_overrides() -> None:
    raw = b'{"prompt": [1, 2], "stream_options": {"include_usage": false}}\n'
    out = json.loads(splice_json(raw, {"return_token_ids": True, "stream_options": {"include_usage": True}}))
    assert out == {"prompt": [1, 2], "return_token_ids": True, "stream_options": {"include_usage": True}}
    assert json.loads(splice_json(b"{}", {"a": 1})) == {"a": 1}


def test_stream_payload_asks_for_token_ids_and_usage_and_keeps_the_clients_other_options() -> None:
    # The common shapes take an addition encoded once; each gives the bytes the general splice gives.
    for opts in (None, "bad", {}, {"include_usage": False}, {"include_usage": True},
                 {"include_usage": False, "continuous_usage_stats": True}, {"continuous_usage_stats": True}):
        body: dict[str, object] = {"prompt": "a b", "stream": True}
        if opts is not None:
            body["stream_options"] = opts
        raw = json.dumps(body).encode()
        merged = {**(opts if isinstance(opts, dict) else {}), "include_usage": True}
        assert stream_payload(raw, body) == splice_json(raw, {"output_token_ids": True, "stream_options": merged})
        sent = json.loads(stream_payload(raw, body))
        assert sent["output_token_ids"] is True and sent["stream_options"] == merged and sent["prompt"] == "a b"


def test_routed_request_reads_only_what_it_needs() -> None:
    r = RoutedRequest.of({"messages": [], "max_completion_tokens": 7, "stream": True,
                          "stream_options": {"include_usage": True}}, chat=True)
    assert (r.stream, r.include_usage, r.max_tokens, r.model) == (True, True, 7, None)
    c = RoutedRequest.of({"prompt": "x"}, chat=False)
    assert c.max_tokens == 16 and not c.stream

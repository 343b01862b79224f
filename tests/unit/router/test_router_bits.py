"""Small pure helpers of the router mechanism."""

from __future__ import annotations

import json

from cluster.router.choice import RoutedRequest
from cluster.router.proxy import splice_json


def test_splice_json_appends_and_overrides() -> None:
    raw = b'{"prompt": [1, 2], "stream_options": {"include_usage": false}}\n'
    out = json.loads(splice_json(raw, {"return_token_ids": True, "stream_options": {"include_usage": True}}))
    assert out == {"prompt": [1, 2], "return_token_ids": True, "stream_options": {"include_usage": True}}
    assert json.loads(splice_json(b"{}", {"a": 1})) == {"a": 1}


def test_routed_request_reads_only_what_it_needs() -> None:
    r = RoutedRequest.of({"messages": [], "max_completion_tokens": 7, "stream": True,
                          "stream_options": {"include_usage": True}}, chat=True)
    assert (r.stream, r.include_usage, r.max_tokens, r.model) == (True, True, 7, None)
    c = RoutedRequest.of({"prompt": "x"}, chat=False)
    assert c.max_tokens == 16 and not c.stream

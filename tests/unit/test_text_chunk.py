"""The engine's per-token SSE template gives the same bytes as building and encoding the chunk."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from actors.openai_api import ResponseShapes, sse
from actors.server import TextChunk


@pytest.mark.parametrize("chat", [False, True])
@given(text=st.text(min_size=1, max_size=40))
def test_template_bytes_equal_the_encoded_chunk(chat: bool, text: str) -> None:
    shapes = ResponseShapes(chat, "llama-3.1-8b", "cmpl-1")
    assert TextChunk(shapes)(text) == sse(shapes.chunk(text, None))

"""The engine's per-token SSE template gives the same bytes as building and encoding the chunk."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from actors.engine.tokenizer import Tokenizer
from actors.openai_api import ResponseShapes, sse
from actors.server import TextChunk


@pytest.mark.parametrize("chat", [False, True])
@settings(deadline=None)  # a loaded CI host: no per-example time limit
@given(text=st.text(min_size=1, max_size=40))
def test_template_bytes_equal_the_encoded_chunk(chat: bool, text: str) -> None:
    shapes = ResponseShapes(chat, "llama-3.1-8b", "cmpl-1")
    assert TextChunk(shapes)(text) == sse(shapes.chunk(text, None))


@pytest.mark.parametrize("chat", [False, True])
@settings(deadline=None)  # a loaded CI host: no per-example time limit
@given(text=st.text(min_size=1, max_size=40), ids=st.lists(st.integers(0, 200_000), min_size=1, max_size=8))
def test_template_with_token_ids_equals_the_encoded_chunk(chat: bool, text: str, ids: list[int]) -> None:
    """The router's streams (``output_token_ids``) carry the ids in every chunk: the same bytes by template."""
    shapes = ResponseShapes(chat, "llama-3.1-8b", "cmpl-1")
    assert TextChunk(shapes, with_ids=True)(text, ids) == sse(shapes.chunk(text, None, ids))


@pytest.mark.parametrize("chat", [False, True])
@pytest.mark.parametrize("with_ids", [False, True])
@settings(deadline=None)
@given(token_id=st.integers(0, 300_000))
def test_one_token_chunk_from_the_word_table_equals_the_encoded_chunk(chat: bool, with_ids: bool,
                                                                      token_id: int) -> None:
    """A steady decode's chunk comes from the tokenizer's JSON word table: the same bytes as decoding the id and
    encoding the chunk, and no chunk for a special id (it has no text: the handler's general path sends it)."""
    shapes = ResponseShapes(chat, "llama-3.1-8b", "cmpl-1")
    tok = Tokenizer(128_256)
    text = tok.decode_one(token_id)
    want = sse(shapes.chunk(text, None, [token_id] if with_ids else None)) if text else None
    assert TextChunk(shapes, with_ids, tok).token(token_id) == want

"""Text prompts keep the token count and the prefix sharing of the synthesized ids."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from actors.engine.tokenizer import Tokenizer
from cluster.loadtest.client import ids_to_text

TOK = Tokenizer(128256)


@given(st.lists(st.integers(0, 200_000), min_size=1, max_size=300), st.lists(st.integers(0, 200_000), max_size=50),
       st.lists(st.integers(0, 200_000), max_size=50))
def test_one_token_per_id_and_shared_prefixes(prefix: list[int], a: list[int], b: list[int]) -> None:
    ta, tb = TOK.encode(ids_to_text(prefix + a)), TOK.encode(ids_to_text(prefix + b))
    assert len(ta) == len(prefix) + len(a) and len(tb) == len(prefix) + len(b)
    assert ta[: len(prefix)] == tb[: len(prefix)]

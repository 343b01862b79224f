"""The built-in tokenizer and the emulated model's outputs."""

from __future__ import annotations

import hashlib

import pytest
from hypothesis import given
from hypothesis import strategies as st

from actors.engine.tokenizer import RESERVED, OutputModel, Tokenizer

TOK = Tokenizer(32000)


def test_same_text_same_ids_and_in_vocabulary() -> None:
    text = "The quick brown fox jumps over the lazy dog, twice!"
    assert TOK.encode(text) == Tokenizer(32000).encode(text)
    assert all(RESERVED <= t < 32000 for t in TOK.encode(text))
    assert len(TOK.encode("hello")) == 2  # pieces of at most four characters


@given(st.text(min_size=1, max_size=200), st.text(max_size=100), st.text(max_size=100))
def test_shared_text_prefix_gives_shared_token_prefix(prefix: str, a: str, b: str) -> None:
    # Cut at a whitespace boundary, the prefix's pieces are whole in both texts.
    p = prefix + " "
    ea, eb, ep = TOK.encode(p + "x" + a), TOK.encode(p + "x" + b), TOK.encode(p)
    assert ea[: len(ep) - 1] == eb[: len(ep) - 1] == ep[:-1]


@given(st.lists(st.text(max_size=40), max_size=20))
def test_word_cache_gives_the_ids_of_pieces_cut_one_by_one(texts: list[str]) -> None:
    from actors.engine.tokenizer import _PIECE, MAX_PIECE, blake2b_64

    for text in texts:  # one tokenizer across texts: later ones hit the cache of words seen before
        expect = [RESERVED + blake2b_64(w[i:i + MAX_PIECE].encode()) % (32000 - RESERVED)
                  for w in _PIECE.findall(text) for i in range(0, len(w), MAX_PIECE)]
        assert TOK.encode(text) == expect


WORD = st.text(st.characters(blacklist_categories=("Zs", "Zl", "Zp", "Cc", "Cs")), min_size=1, max_size=9)


@given(st.lists(st.tuples(st.booleans(), st.lists(WORD, max_size=30)), max_size=8))
def test_spaced_words_take_the_fast_cut_with_the_regex_ids(texts: list[tuple[bool, list[str]]]) -> None:
    # Words joined by single spaces (the load generator's prompts), with or without a leading space; one fresh
    # tokenizer, so later texts meet words of one piece the earlier ones taught it.
    from actors.engine.tokenizer import _PIECE, MAX_PIECE, blake2b_64

    tok = Tokenizer(32000)
    for lead, words in texts:
        text = (" " if lead else "") + " ".join(words)
        expect = [RESERVED + blake2b_64(w[i:i + MAX_PIECE].encode()) % (32000 - RESERVED)
                  for w in _PIECE.findall(text) for i in range(0, len(w), MAX_PIECE)]
        assert tok.encode(text) == expect


def test_words_past_the_cache_limit_are_still_encoded() -> None:
    tok = Tokenizer(32000)
    tok._after_space.update((f"w{i}", (100,)) for i in range(400_000))  # the cache is full: nothing more is kept
    text = " fresh ab words of two or more pieces"
    assert tok.encode(text) == Tokenizer(32000).encode(text)
    assert "ab" not in tok._after_space and "fresh" not in tok._after_space
    short = " new ab cd e fg"  # (words of one piece, hashed together: Tokenizer._learn_short)
    assert tok.encode(short) == Tokenizer(32000).encode(short) and "fg" not in tok._after_space


def test_only_the_ascii_space_is_both_whitespace_and_printable() -> None:
    # Why encode's fast path may cut printable text at " " alone: no other character the regex's \s matches
    # passes str.isprintable.
    import re
    import sys

    space = re.compile(r"\s")
    assert [c for c in map(chr, range(sys.maxunicode + 1)) if c.isprintable() and space.match(c)] == [" "]


def test_output_model_is_deterministic_and_in_range() -> None:
    m = OutputModel(1000)
    base = m.seed_of([1, 2, 3], 7)
    assert base == m.seed_of([1, 2, 3], 7) != m.seed_of([1, 2, 3], 8)
    toks = [m.token(base, i) for i in range(100)]
    assert all(RESERVED <= t < 1000 for t in toks)
    assert len(set(toks)) > 50
    assert 16 <= m.natural_length(base) <= 512


def test_chat_template_shares_the_system_prefix() -> None:
    a = TOK.chat_prompt([("system", "You are terse."), ("user", "hi")])
    b = TOK.chat_prompt([("system", "You are terse."), ("user", "bye")])
    n = len(TOK.encode("<|system|>\nYou are terse.\n"))
    assert a[:n] == b[:n]


def test_output_model_tokens_in_bulk_are_the_tokens_one_by_one() -> None:
    out = OutputModel(128256)
    for base in (0, 1, 2**63 + 12345, 2**64 - 1):
        assert out.tokens(base, 5, 300) == [out.token(base, p) for p in range(5, 305)]
    assert out.tokens(7, 0, 0) == []


ASCII_WORD = st.text(st.characters(min_codepoint=0x21, max_codepoint=0x7E), min_size=1, max_size=9)


@given(st.booleans(), st.lists(ASCII_WORD, min_size=1, max_size=60), st.integers(0, 40))
def test_an_ascii_rest_counts_the_ids_past_the_head(lead: bool, words: list[str], head: int) -> None:
    # ASCII text is counted from its bytes (count_after_head's fast path): the count tokenizing it gives.
    text = (" " if lead else "") + " ".join(words)
    got = TOK.split_head(text, head)
    assert got is not None
    ids, rest = got
    assert len(ids) + TOK.count_after_head(rest) == len(TOK.encode(text))


@given(st.text(st.sampled_from([chr(c) for c in range(0x80)] + ["\u00e9", "\u00a0", "\u2028", "\u4e00"]),
               max_size=12))
def test_spaced_is_printable_with_single_spaces_and_no_trailing_space(text: str) -> None:
    # ASCII text is checked from its bytes (0x20..0x7e), other text by str.isprintable: both the definition.
    assert TOK.spaced(text) == (text.isprintable() and "  " not in text and not text.endswith(" "))


def test_ids_are_blake2b_of_each_piece() -> None:
    # A piece's id is 64 bits of blake2b over its UTF-8, into the vocabulary past the reserved ids (the tokenizer
    # digests from a copied empty state: the same bytes as hashing from scratch), fresh words and known ones alike.
    def piece_id(piece: str) -> int:
        return RESERVED + int.from_bytes(hashlib.blake2b(piece.encode(), digest_size=8).digest(), "little") \
            % (32000 - RESERVED)

    text = "ab cde fghij kl\u00e9mno p"
    want = [piece_id(p) for p in ("ab", " cde", " fgh", "ij", " kl\u00e9", "mno", " p")]
    tok = Tokenizer(32000)
    assert tok.encode(text) == want and tok.encode(text) == want  # (learnt, then known)
    assert Tokenizer(32000).encode("x\ty") == [piece_id("x"), piece_id("\ty")]  # (the regex's cut)


@pytest.mark.parametrize("vocab", [RESERVED + 2, 32000, 128256])
def test_fresh_short_words_learnt_together_have_the_ids_of_blake2b_from_scratch(vocab: int) -> None:
    # Words of up to three characters are learnt in bulk (one blake2b state per word copied from one that hashed
    # the space, the ids taken mod the vocabulary in numpy): each must be its piece's id from scratch, whatever
    # the vocabulary, ASCII or not, beside longer words learnt piece by piece.
    def piece_id(piece: str) -> int:
        return RESERVED + int.from_bytes(hashlib.blake2b(piece.encode(), digest_size=8).digest(), "little") \
            % (vocab - RESERVED)

    words = [f"{a}{b}{c}" for a in "aZ9\u00e9" for b in "q\u4e2d" for c in "x7"] + ["z", "\u00df", "longer", "abcd"]
    many = [f"{a}{b}" for a in "klmnopqrstuvwxyz" for b in "ABCDEFGHIJ"]  # (160 words: the numpy path, NUMPY_WORDS)
    for ws in (words, many, words + many):
        text = " " + " ".join(ws)
        want = [piece_id((" " + w)[i:i + 4]) for w in ws for i in range(0, len(w) + 1, 4)]
        assert Tokenizer(vocab).encode(text) == want


def test_a_text_whose_first_words_are_known_learns_the_new_rest_in_order(monkeypatch: pytest.MonkeyPatch) -> None:
    # A miss ranked from its head (``Chooser._head_only``) has its first block's words known when its whole prompt
    # is tokenized at once (by a request that shares it, or when its answer ended first): the rest, new, is learnt
    # in order (``_learn_short``), not by the set difference meant for a few new words among known ones (a hit's
    # new ending), which ``encode`` of a 2176-word prompt took ~0.8 ms longer. The same ids either way.
    words = [f"{a}{b}{c}" for a in "abcdefgh" for b in "ijklmnop" for c in "qrstuvwx"]  # 512 words
    text = " " + " ".join(words)
    tok = Tokenizer(32000)
    tok.encode(" " + " ".join(words[:16]))  # the head's words
    by_set: list[int] = []
    learn = tok._learn

    def spy(new: set[str]) -> None:
        by_set.append(len(new))
        learn(new)
    monkeypatch.setattr(tok, "_learn", spy)
    assert tok.encode(text) == Tokenizer(32000).encode(text)
    assert by_set == []
    hit = " " + " ".join(words[:400] + ["yz" + w for w in words[:8]])  # a known prefix, a few new words at its end
    assert tok.encode(hit) == Tokenizer(32000).encode(hit)
    assert by_set == [8]  # (those alone learnt)

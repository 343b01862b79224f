"""A deterministic built-in tokenizer and the emulated model's output tokens (no downloads).

Text is cut into pieces of at most ``MAX_PIECE`` characters, each word carrying its leading
whitespace (so ``" hello"`` and ``"hello"`` differ, as in BPE vocabularies); a piece's id is a stable
hash into the vocabulary. The same text always gives the same ids, and two texts that share a prefix
share the token ids of every piece wholly inside it (a cut in the middle of a word changes only
that word's pieces). Output tokens are a pure function of (prompt ids, seed, position); ids decode to
stable pseudo-words.
"""

from __future__ import annotations

import array
import re
import struct
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from hashlib import blake2b
from itertools import chain, islice, repeat
from operator import methodcaller
from typing import Literal, cast

import numpy as np

RESERVED = 16  # ids below this are special (0 = pad, 1 = bos, 2 = eos, ...)
MAX_PIECE = 4
_PRINTABLE = bytes(range(0x20, 0x7F))
_WORD_BYTES = bytes(0x20 if c == 0x20 else 0x61 if 0x20 < c < 0x7F else 0 for c in range(256))
"""A ``bytes.translate`` table: a space stays, every other printable ASCII byte becomes ``a``, any other byte 0
(``head_and_count``: one pass that both checks the text is printable and marks its words)."""
_RUN = b"a" * MAX_PIECE
_PIECE = re.compile(r"\s*\S+|\s+")
_SYLLABLES = [c + v for c in "bcdfghjklmnprstvz" for v in "aeiou"]
_PAIRS = len(_SYLLABLES) ** 2
_JSON_WORDS = [b'" ' + (_SYLLABLES[r % len(_SYLLABLES)] + _SYLLABLES[r // len(_SYLLABLES)]).encode() + b'"'
               for r in range(_PAIRS)]
"""``json.dumps(decode_one(i))`` as bytes for every id ``i >= RESERVED``, indexed by ``i % _PAIRS``: a word is
two syllables picked by ``i % n`` and ``(i // n) % n`` (both fixed by ``i % n**2``), plain ASCII letters after a
space, so its JSON is the word in quotes. 7,225 entries; the SSE path of every streamed token reads it."""


_BLAKE2B_8 = blake2b(digest_size=8)
"""An empty 8-byte blake2b state: ``copy()`` then ``update(data)`` digests as ``blake2b(data, digest_size=8)``,
without parsing the constructor's arguments each time (a fresh word's id: ~20% less CPU, ``_learn``; a block hash
1.36 -> 0.87 us per 64 bytes)."""
_COPY = methodcaller("copy")
_UPDATE = type(_BLAKE2B_8).update
_DIGEST = type(_BLAKE2B_8).digest
"""A copy of a blake2b state, its update and its digest, as functions for ``map`` (``Tokenizer._learn``)."""
_LITTLE: Literal["little"] = "little"
NUMPY_WORDS = 128
"""Words from which ``Tokenizer._learn_short`` reads its digests with numpy: below, a head's few words before a
send (a cache miss's first blocks, a hit's next block), numpy's calls, cold in the router's loop, cost more than
mapping ``int.from_bytes`` (``bench/router_miss --hit``: a hit's ranking ~200 us more of CPU with numpy for its
16 words; for 256 words numpy is ~1.5x faster hot)."""
_BLAKE2B_SPACE = blake2b(b" ", digest_size=8)
"""The 8-byte blake2b state after a space: a copy updated with a word's UTF-8 digests as ``blake2b_64`` of the
space and the word (``Tokenizer._learn``)."""


def blake2b_64(data: bytes) -> int:
    """Stable 64-bit hash (the same in every process and run, unlike ``hash()``): piece ids, the output model's
    seeds, and every KV block hash (``actors.engine.kv_blocks``)."""
    h = _BLAKE2B_8.copy()
    h.update(data)
    return int.from_bytes(h.digest(), "little")


_U32 = next(code for code in "IL" if array.array(code).itemsize == 4)


def ids_as_uint32(ids: Sequence[int]) -> array.array[int]:
    """Token ids as a C array of native ``uint32`` (the bytes ``np.asarray(ids, dtype=np.uint32)`` has), built
    about 3x faster from a list; OverflowError for an id below 0 or past 32 bits, TypeError for a non-int."""
    return ids if isinstance(ids, array.array) and ids.typecode == _U32 else array.array(_U32, ids)


class Tokenizer:
    def __init__(self, vocab_size: int = 32000) -> None:
        if vocab_size <= RESERVED + 1:
            raise ValueError("vocabulary too small")
        self.vocab_size = vocab_size
        self._span = vocab_size - RESERVED
        self._cache: dict[str, int] = {}
        self._words: dict[str, tuple[int, ...]] = {}
        """Ids of whole words (a regex match: leading whitespace and the word), so a repeated word costs one
        lookup instead of one per piece: a 2176-token prompt 3.2 -> 0.9 ms, on the router's path per request."""
        self._after_space: dict[str, tuple[int, ...]] = {}
        """The ids of a word after one space (one piece or more), by the word without the space
        (``_encode_spaced``)."""

    def _piece_id(self, piece: str) -> int:
        tid = self._cache.get(piece)
        if tid is None:
            tid = RESERVED + blake2b_64(piece.encode()) % self._span
            if len(self._cache) < 200_000:
                self._cache[piece] = tid
        return tid

    def _word_ids(self, word: str) -> tuple[int, ...]:
        wid = self._words.get(word)
        if wid is None:
            wid = tuple(self._piece_id(word[i:i + MAX_PIECE]) for i in range(0, len(word), MAX_PIECE))
            if len(self._words) < 200_000:
                self._words[word] = wid
        return wid

    def encode(self, text: str) -> list[int]:
        """Ids of ``text``'s pieces. Text whose only whitespace is single ASCII spaces between words (what the
        load generator writes, and most prose on one line) is cut with ``str.split`` and its words of one
        piece looked up in one C loop (``map``): the regex's cut exactly, in less time (a 2176-word prompt of
        known words: 0.36 -> 0.2 ms; the router pays it per request). ``isprintable`` rules out every other
        whitespace character (all are Unicode separators or controls), so both paths see the same words."""
        if self.spaced(text):
            return self._encode_spaced(text)
        ids: list[int] = []
        words = self._words
        for word in _PIECE.findall(text):
            wid = words.get(word)
            ids += wid if wid is not None else self._word_ids(word)
        return ids

    @staticmethod
    def spaced(text: str) -> bool:
        """Whether ``encode`` cuts ``text`` with ``str.split``: printable, single spaces, no trailing space. Then
        each word's ids depend on the word and its leading space alone, so ``encode(a + b) == encode(a) +
        encode(b)`` whenever ``b`` starts with the space before a word (``cluster.router.prompt_memo``)."""
        if "  " in text or text.endswith(" "):
            return False
        if text.isascii():  # (a flag CPython keeps: O(1)) printable ASCII is 0x20..0x7e: nothing is left once
            # those bytes are deleted (one C loop; numpy's min and max cost ~60 us cold in the router's loop, ~8
            # this way, and ``isprintable`` walks the characters: ~40 hot on an 8.7k-character prompt)
            return not text.encode("ascii").translate(None, _PRINTABLE)
        return text.isprintable()

    def _encode_spaced(self, text: str) -> list[int]:
        """``encode`` of spaced text: each word after a space is one lookup of its ids (a tuple, one piece or
        more), and the tuples are joined in C (``chain.from_iterable`` over ``map``): no Python per word once
        the words are known. A word not known yet makes the join raise TypeError (None is not iterable); the
        new words are learnt and the join runs again. Before, words of more than one piece (four letters or
        more) went through a Python loop. A 2176-word prompt of known words drawn from 5,000 of 1-9 letters
        (``timeit`` of ``encode``, old and new alternated, on a host under other work):
        1,240-1,270 -> 357-641 us; a fresh tokenizer on it 11.5-12.9 -> 6.8-11.1 ms. The router pays it per
        miss after the send (``Chooser.complete``), the engines per prompt."""
        parts = text.split(" ")
        first = parts[0]
        ids = self._ids_after_space(parts, 1, None)
        return [*self._word_ids(first), *ids] if first else ids

    def _ids_after_space(self, parts: list[str], start: int, stop: int | None) -> list[int]:
        """The ids of ``parts[start:stop]``, each word after a space (``_encode_spaced``'s join, learning the words
        it does not know yet)."""
        # (None for a word not known: the join's TypeError below, which is how unknown words are found)
        get = cast(Callable[[str], tuple[int, ...]], self._after_space.get)
        try:
            return list(chain.from_iterable(map(get, islice(parts, start, stop))))
        except TypeError:  # words not seen yet
            words = parts[start:stop]
            known = self._after_space
            # A new prefix's words, likely all new: hashed in order. Its first word new, or its middle and last ones:
            # a miss ranked from its head (``Chooser._head_only``) knows its first block's words when it is
            # tokenized whole, and a hit's new ending (a few new words past a known middle) keeps the set below.
            if (parts[start] not in known or (words[len(words) // 2] not in known and words[-1] not in known)) \
                    and max(map(len, words)) < MAX_PIECE:
                return self._learn_short(words)
            self._learn(set(islice(parts, start, stop)).difference(self._after_space))
            try:
                return list(chain.from_iterable(map(get, islice(parts, start, stop))))
            except TypeError:  # the cache is full: a word not kept is computed again
                return [i for word in islice(parts, start, stop) for i in (get(word) or self._word_ids(" " + word))]

    def encode_pieces(self, text: str, words: int) -> Iterator[list[int]]:
        """``encode(text)`` in consecutive pieces of ``words`` words or fewer (joined, they are ``encode(text)``),
        for a caller that lets other work run between pieces: a prompt of words the tokenizer has not met costs
        ~1-2 us a word to learn (``Chooser.complete_soon``). Text ``encode`` does not cut with ``str.split`` is one
        piece."""
        if words <= 0:
            raise ValueError("words must be positive")
        if not self.spaced(text):
            yield self.encode(text)
            return
        parts = text.split(" ")
        if parts[0]:
            yield list(self._word_ids(parts[0]))
        for i in range(1, len(parts), words):
            yield self._ids_after_space(parts[i:i + words], 0, None)  # (a copy: islice would walk from the start)

    def split_head(self, text: str, head_tokens: int) -> tuple[list[int], str] | None:
        """The ids of ``text``'s first words, at least ``head_tokens`` of them (all when fewer), and the text
        after them (empty, or starting with the space before the next word), without tokenizing that rest.
        For text ``encode`` cuts with ``str.split`` (else None): ``head == encode(text)[:len(head)]`` and
        ``len(head) + count_after_head(rest) == len(encode(text))``. What a router needs to rank a prompt that
        misses every cache before it has tokenized all of it (a new prefix: words never met, ~1 us each)."""
        if not self.spaced(text):
            return None
        parts = text.split(" ", head_tokens + 1)  # each word is one piece or more: enough for the head
        rest = " " + parts.pop() if len(parts) > head_tokens + 1 else ""
        return self._encode_spaced(" ".join(parts)), rest

    def head_and_count(self, text: str, head_tokens: int) -> tuple[list[int], int] | None:
        """``split_head``'s head ids and the whole text's token count (``len(head) + count_after_head(rest)``),
        or None where ``split_head`` gives None. ASCII text is checked and counted with a few C loops over its
        bytes, no numpy: one ``translate`` maps a space to itself, every other byte of 0x21..0x7e to one letter
        and any other byte to 0, so the text is printable where the result holds no 0 (a ``memchr``; before, a
        second ``translate`` deleted the printable bytes: ~19 us hot of ~97 for the checks and count of a
        2176-word prompt); no double or trailing space; each word of the rest follows a space and is
        ``1 + n // MAX_PIECE`` pieces, and the words' ``n // MAX_PIECE`` summed is how many non-overlapping runs of
        ``MAX_PIECE`` letters the rest holds (``bytes.count``: a run never spans a space). On a cache
        miss's path before its send, where the router's loop meets each numpy call cold: in ``bench/router_miss``'s
        router (200 misses, contended host, CPU medians) one pass of numpy's checks and count took ~175 us, these
        ~85 (the head's own tokenizing ~60 more)."""
        if not text.isascii():
            got = self.split_head(text, head_tokens)
            return None if got is None else (got[0], len(got[0]) + self.count_after_head(got[1]))
        marks = text.encode("ascii").translate(_WORD_BYTES)  # (printable: no 0 in it; searching for one is memchr)
        if b"\0" in marks or b"  " in marks or marks.endswith(b" "):
            return None
        parts = text.split(" ", head_tokens + 1)  # split_head's cut
        if len(parts) <= head_tokens + 1:
            ids = self._encode_spaced(text)
            return ids, len(ids)
        cut = len(text) - len(parts[-1]) - 1  # split_head's rest: the space before the last part, and that part
        head = self._encode_spaced(text[:cut])
        return head, len(head) + marks.count(b" ", cut) + marks.count(_RUN, cut)

    @staticmethod
    def count_after_head(rest: str) -> int:
        """Tokens of ``split_head``'s rest, measured, not tokenized: a word of ``n`` characters after its space is
        ``ceil((n + 1) / MAX_PIECE) = 1 + n // MAX_PIECE`` pieces: one per space, plus each word's length (the gap
        to the next space, over the text as UTF-32 code points) over ``MAX_PIECE``, vectorized (a 2143-word rest:
        ~126 -> ~60 us, on a cache miss's path before its send). ASCII text (``isascii``: O(1)) is scanned as
        its bytes, one per code point, and the gaps taken without ``np.diff``'s concatenation: ~70 -> ~45 us."""
        if not rest:
            return 0
        if rest.isascii():
            chars: np.ndarray = np.frombuffer(rest.encode("ascii"), dtype=np.uint8)
        else:
            chars = np.frombuffer(rest.encode("utf-32-le"), dtype=np.uint32)
        spaces = np.flatnonzero(chars == 32)
        if not spaces.size:
            return 0  # (split_head's rest is empty or starts with a space)
        ends = np.empty_like(spaces)
        ends[:-1] = spaces[1:]
        ends[-1] = chars.size
        return int(spaces.size + ((ends - spaces - 1) // MAX_PIECE).sum())

    def _learn(self, words: set[str]) -> None:
        """Keep the ids of words not seen yet (each after one space). A prompt of fresh words (the first request
        of a new prefix: a cache miss) pays this in its router and in its engine. Words of up to three characters
        (one piece with its space: every word the load generator writes) are hashed together
        (``_learn_short``); longer words go piece by piece (``_word_ids``)."""
        after = self._after_space
        if len(after) >= 400_000:
            return
        short = [w for w in words if len(w) < MAX_PIECE]
        if len(short) < len(words):
            for word in words:
                if len(word) >= MAX_PIECE:
                    after[word] = self._word_ids(" " + word)
        if short:
            self._learn_short(short)

    def _learn_short(self, words: list[str]) -> list[int]:
        """The ids of ``words`` of up to three characters, each after a space (one piece each), in order, kept (a
        word met twice is stored twice, with its one id). ``_ids_after_space`` hands it a slice whose first word is
        new and whose words are all short, as is, without first finding which of them are new (a set built and
        diffed against the cache, then a second join): a new prefix's words are all new, and a known word hashed
        again costs about what finding it costs. C loops, no Python per word: the words' UTF-8 from one join,
        encode and split (no word holds a space, and no UTF-8 sequence holds byte 0x20), one copy each of the
        blake2b state that has hashed a space (blake2b is a stream: the same digest as the space and the word at
        once), updated and digested (``map`` over the unbound methods, the update's Nones consumed by a
        zero-length ``deque``), the digests read as little-endian ``uint64`` (numpy: the id is the digest mod the
        span, exact in ``uint64``; fewer than ``NUMPY_WORDS`` words: ``int.from_bytes``, the mod and the offset
        mapped, as numpy's calls cost the router's loop more than they save on a few words), the pairs stored by
        ``dict.update`` (``zip`` of the ids alone makes the 1-tuples). The same ids as ``_piece_id``'s."""
        states = list(map(_COPY, repeat(_BLAKE2B_SPACE, len(words))))
        deque(map(_UPDATE, states, " ".join(words).encode().split(b" ")), maxlen=0)
        if len(words) < NUMPY_WORDS:
            ids = list(map(RESERVED.__add__, map(self._span.__rmod__, map(int.from_bytes, map(_DIGEST, states),
                                                                             repeat(_LITTLE)))))
        else:
            digests = np.frombuffer(b"".join(map(_DIGEST, states)), dtype="<u8")
            ids = (digests % np.uint64(self._span) + np.uint64(RESERVED)).tolist()
        if len(self._after_space) < 400_000:
            self._after_space.update(zip(words, zip(ids), strict=True))
        return ids

    def decode_one(self, token_id: int) -> str:
        """A stable pseudo-word for an id (the emulated model's text)."""
        if token_id < RESERVED:
            return ""
        a = _SYLLABLES[token_id % len(_SYLLABLES)]
        b = _SYLLABLES[(token_id // len(_SYLLABLES)) % len(_SYLLABLES)]
        return " " + a + b

    def json_word(self, token_id: int) -> bytes | None:
        """``json.dumps(decode_one(token_id)).encode()`` from a table (no string building, no JSON encoder: the
        streamed SSE chunk of every token needs it); None for a special id, which decodes to no text."""
        return None if token_id < RESERVED else _JSON_WORDS[token_id % _PAIRS]

    def decode(self, ids: Sequence[int]) -> str:
        return "".join(self.decode_one(i) for i in ids)

    def chat_prompt(self, messages: Sequence[tuple[str, str]]) -> list[int]:
        """Token ids of a chat under a fixed template: a role header per message, then the assistant's."""
        text = "".join(f"<|{role}|>\n{content}\n" for role, content in messages) + "<|assistant|>\n"
        return self.encode(text)

    def valid_ids(self, ids: Sequence[int]) -> bool:
        """Every id an int in ``[0, vocab_size)`` (through a C ``uint32`` array: 0.7 ms for 87k ids, not 2)."""
        if not ids:
            return True
        try:
            arr = ids_as_uint32(ids)
        except (OverflowError, TypeError):  # negative, beyond 32 bits, or not an int
            return False
        return int(np.frombuffer(arr, dtype=np.uint32).max()) < self.vocab_size


class OutputModel:
    """The emulated model's choices: the token at each position and where it would stop on its own."""

    def __init__(self, vocab_size: int, min_natural: int = 16, max_natural: int = 512) -> None:
        self.vocab_size = vocab_size
        self.min_natural = min_natural
        self.max_natural = max_natural

    def seed_of(self, prompt_ids: Sequence[int], seed: int) -> int:
        return blake2b_64(struct.pack("<q", seed) + ids_as_uint32(prompt_ids).tobytes())

    def token(self, base: int, position: int) -> int:
        x = (base ^ (position * 0x9E3779B97F4A7C15)) & 0xFFFFFFFFFFFFFFFF
        x = ((x ^ (x >> 31)) * 0xBF58476D1CE4E5B9) & 0xFFFFFFFFFFFFFFFF
        x ^= x >> 29
        return RESERVED + x % (self.vocab_size - RESERVED)

    def tokens(self, base: int, start: int, count: int) -> list[int]:
        """``token(base, p)`` for ``p`` in ``start .. start + count - 1``, vectorized (same 64-bit mixing)."""
        pos = np.arange(start, start + count, dtype=np.uint64)
        x = np.uint64(base) ^ (pos * np.uint64(0x9E3779B97F4A7C15))
        x = (x ^ (x >> np.uint64(31))) * np.uint64(0xBF58476D1CE4E5B9)
        x ^= x >> np.uint64(29)
        out: list[int] = (np.uint64(RESERVED) + x % np.uint64(self.vocab_size - RESERVED)).tolist()
        return out

    def natural_length(self, base: int) -> int:
        """Where the emulated model emits EOS when ``ignore_eos`` is false."""
        return self.min_natural + (base >> 7) % (self.max_natural - self.min_natural + 1)

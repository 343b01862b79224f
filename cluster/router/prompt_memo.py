"""Token ids and block hashes of the text prompts the router met, by text prefix: a hit pays for its new part only.

A prompt that shares a cached prefix with an earlier one (a prefix-cache hit, the next turn of a conversation)
repeats thousands of words the router already tokenized and hashed: ~0.2 ms of tokenizing and ~0.15 ms of hashing
for a 2176-token prompt, per request. ``PromptMemo`` keeps, for a bounded number of prompts, their text, ids and
block hashes with *checkpoints*: ``(chars, tokens)`` every ``stride`` blocks (and at the last full block), each at
a word boundary (the last one at or before the block's end). A new prompt that starts with an entry's text up to
a checkpoint, and continues there with a space or ends there, has the entry's ids up to it and its hashes for
the blocks wholly inside it; only the rest is tokenized and hashed.

Why it is exact: the memo serves only text the tokenizer cuts with ``str.split`` (``Tokenizer.spaced``:
printable, single spaces, no trailing space), where each word's ids are a function of the word and its leading
space alone, so ``encode(a + b) == encode(a) + encode(b)`` whenever ``b`` starts with the space before a word;
a checkpoint's token count is the tokenizer's own piece count (``Tokenizer.count_after_head``'s rule), checked
against the ids when the entry is made (an entry that disagrees is not kept). Block hashes chain from the start,
so a block wholly inside the shared prefix has the same hash. The hash function and block size are the memo's
own (one memo per tokenizer and block size). Tests compare against tokenizing from scratch (hypothesis).

Bounds: entries are bucketed by their first ``KEY_CHARS`` characters, at most ``per_key`` per bucket (most
recent first), ``max_keys`` buckets and ``max_chars`` characters of text in all (least recently used buckets
dropped first). An entry is made only for a prompt whose
memo match left at least ``stride`` full blocks unmatched (a new prefix), so hits do not churn it.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

import numpy as np

from actors.engine.kv_blocks import BlockHash, hash_request_blocks
from actors.engine.tokenizer import MAX_PIECE, Tokenizer

Encoded = tuple[list[int], list[BlockHash]]
"""A prompt's token ids and its full blocks' hashes."""
KEY_CHARS = 64
"""Characters of a prompt's start that name its bucket (a shared prefix of one stride is longer than this)."""


@dataclass(frozen=True)
class MemoEntry:
    text: str
    ids: list[int]
    hashes: list[BlockHash]
    chars: list[int]
    """Checkpoints' character offsets, ascending; ``tokens[k]`` ids come before ``chars[k]``."""
    tokens: list[int]


class PromptMemo:
    """See the module docstring. Not thread-safe (the router's loop is its only user)."""

    def __init__(self, tokenizer: Tokenizer, block_size: int, *, stride: int = 16, max_keys: int = 64,
                 per_key: int = 4, max_chars: int = 8_000_000) -> None:
        if min(block_size, stride, max_keys, per_key, max_chars) <= 0:
            raise ValueError("block_size, stride, max_keys, per_key and max_chars must be positive")
        self.max_chars = max_chars
        self._chars = 0
        """Characters of every entry's text (with its ids and hashes, ~10x as many bytes), at most ``max_chars``."""
        self.tok = tokenizer
        self.block_size = block_size
        self.stride = stride
        self.max_keys = max_keys
        self.per_key = per_key
        self._buckets: OrderedDict[str, list[MemoEntry]] = OrderedDict()
        self.hits = 0
        self.misses = 0

    def encode(self, text: str, known: Encoded | None = None) -> Encoded:
        """``text``'s ids and full-block hashes, as ``Tokenizer.encode`` and ``hash_request_blocks`` give them.
        ``known``: those two, computed already by the caller (``Chooser.complete_soon``, a slice at a time): they
        are returned, and the memo learns the text as it would have."""
        if not self.tok.spaced(text):
            if known is not None:
                return known
            ids = self.tok.encode(text)
            return ids, hash_request_blocks(ids, self.block_size)
        chars, tokens, entry = self._match(text)
        if known is not None:
            ids, hashes = known
            self.hits += entry is not None
            self.misses += entry is None
        elif entry is None:
            self.misses += 1
            ids = self.tok.encode(text)
            hashes = hash_request_blocks(ids, self.block_size)
        else:
            self.hits += 1
            ids = entry.ids[:tokens] + self.tok.encode(text[chars:]) if chars < len(text) else entry.ids[:tokens]
            hashes = hash_request_blocks(ids, self.block_size, start=entry.hashes[:tokens // self.block_size])
        if len(hashes) - tokens // self.block_size >= self.stride:
            self._remember(text, ids, hashes)
        return ids, hashes

    def match(self, text: str) -> tuple[int, int, MemoEntry | None]:
        """The longest checkpoint of an entry that ``text`` extends: (chars, tokens, entry), where ``text[:chars]``
        tokenizes to ``entry.ids[:tokens]``, its full blocks hash to ``entry.hashes[:tokens // block_size]`` and
        ``text[chars:]`` is empty or starts with the space before a word; (0, 0, None): none. Read-only for the
        caller (the entry's lists are the memo's own)."""
        return self._match(text)

    def _match(self, text: str) -> tuple[int, int, MemoEntry | None]:
        """The longest checkpoint of an entry that ``text`` extends: (chars, tokens, entry); (0, 0, None): none."""
        bucket = self._buckets.get(text[:KEY_CHARS])
        if bucket is None:
            return 0, 0, None
        self._buckets.move_to_end(text[:KEY_CHARS])
        best: tuple[int, int, MemoEntry | None] = (0, 0, None)
        n = len(text)
        for e in bucket:
            # Checkpoints that match form a prefix of the list (each lies inside the next): binary search.
            lo, hi = 0, len(e.chars)
            while lo < hi:
                mid = (lo + hi) // 2
                c = e.chars[mid]
                if c <= n and (c == n or text[c] == " ") and text.startswith(e.text[:c]):
                    lo = mid + 1
                else:
                    hi = mid
            if lo and e.tokens[lo - 1] > best[1]:
                best = (e.chars[lo - 1], e.tokens[lo - 1], e)
        return best

    def _remember(self, text: str, ids: list[int], hashes: list[BlockHash]) -> None:
        # Word ends from the text's code points as one array (ASCII: its bytes), not ``str.split`` and a length per
        # word: ~175 -> ~25 us on a 2176-word prompt, in the tail of every new prefix's request (``Chooser.complete``).
        if text.isascii():
            points: np.ndarray = np.frombuffer(text.encode("ascii"), dtype=np.uint8)
        else:
            points = np.frombuffer(text.encode("utf-32-le"), dtype=np.uint32)
        spaces = np.flatnonzero(points == 32)
        ends = np.empty(spaces.size + 1, dtype=np.int64)  # the character after each word (its space, or the end)
        ends[:-1] = spaces
        ends[-1] = points.size
        lengths = ends.copy()
        lengths[1:] -= spaces + 1  # each word after a space starts past it (what ``text.split(" ")`` cuts)
        pieces = (lengths + MAX_PIECE) // MAX_PIECE  # a word after its space: ceil((n + 1) / MAX_PIECE)
        pieces[0] = -(-lengths[0] // MAX_PIECE)  # the first word has no space before it
        cum = np.cumsum(pieces)
        if int(cum[-1]) != len(ids):
            return  # not the tokenizer's count: keep nothing rather than something wrong
        bs = self.block_size
        targets = list(range(self.stride * bs, len(hashes) * bs + 1, self.stride * bs))
        if not targets or targets[-1] != len(hashes) * bs:
            targets.append(len(hashes) * bs)
        found = np.searchsorted(cum, targets, side="right") - 1  # the last word that ends at or before each target
        found = found[found >= 0]  # (none: the first word is longer than the target)
        chars: list[int] = []
        tokens: list[int] = []
        for c, t in zip(ends[found].tolist(), cum[found].tolist(), strict=True):
            if tokens and t <= tokens[-1]:
                continue
            chars.append(c)
            tokens.append(t)
        if not chars:
            return
        entry = MemoEntry(text, list(ids), hashes[:tokens[-1] // bs], chars, tokens)  # the caller keeps ``ids``
        if len(text) > self.max_chars:
            return
        key = text[:KEY_CHARS]
        bucket = self._buckets.get(key)
        if bucket is None:
            bucket = self._buckets[key] = []
        else:
            self._buckets.move_to_end(key)
        bucket.insert(0, entry)
        self._chars += len(text) - sum(len(e.text) for e in bucket[self.per_key:])
        del bucket[self.per_key:]
        while len(self._buckets) > self.max_keys or self._chars > self.max_chars:
            _, gone = self._buckets.popitem(last=False)
            self._chars -= sum(len(e.text) for e in gone)

    @property
    def chars(self) -> int:
        return self._chars

    def __len__(self) -> int:
        return sum(len(b) for b in self._buckets.values())


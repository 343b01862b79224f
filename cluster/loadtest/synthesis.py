"""Token-id prompts built from hash ids, so that requests share exactly the blocks their hash ids share.

Algorithm. Block k of a request (``block_size`` tokens, the last one possibly shorter) is a pure function
of ``(seed, hash_ids[k], k, length if the block is partial)``:

    key   = mix(mix(mix(seed) ^ hash_id) ^ (k + 1) * C) ^ salt,   salt = 0 for a full block,
                                                                   mix(length + 2^40) for a partial one
    tok_j = low + mix(key + (j + 1) * GOLDEN) mod (high - low),   j = 0 .. length - 1

with ``mix`` the splitmix64 finalizer on 64-bit words. Because Mooncake hash ids are chained (an equal id
at position k implies an equal prefix through block k), equal ids give equal token blocks and therefore
equal prefixes; different ids give different blocks (up to a 64-bit collision). A partial last block is
salted with its length, so two requests that share hash id k but differ in length share exactly their
full blocks, and two requests with the same ids and the same length share everything. Token ids lie in
``[low, high)`` — by default 1,000 to 31,999 — inside every common vocabulary and clear of the special
ids at its ends (Llama-2 0-2, Llama-3 >= 128,000, Qwen >= 151,643).

A request without hash ids (Azure traces) gets unique ids derived from its request id, tagged with the
top bit so they never meet a trace's ids: its prompt shares nothing with any other request.

All arithmetic is vectorized numpy over the whole prompt; a 10,000-token prompt takes well under a
millisecond.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable
from dataclasses import dataclass

import numpy as np

from cluster.loadtest.spec import RequestSpec

MASK64 = (1 << 64) - 1
GOLDEN = np.uint64(0x9E3779B97F4A7C15)
POSITION_MULT = np.uint64(0xD1B54A32D192ED03)
PARTIAL_TAG = np.uint64(1 << 40)
UNIQUE_TAG = 1 << 63
_M1 = np.uint64(0xBF58476D1CE4E5B9)
_M2 = np.uint64(0x94D049BB133111EB)
_S30, _S27, _S31 = np.uint64(30), np.uint64(27), np.uint64(31)


def mix64(z: np.ndarray) -> np.ndarray:
    """splitmix64's finalizer, elementwise on a uint64 array (wrapping arithmetic)."""
    z = z ^ (z >> _S30)
    z = z * _M1
    z = z ^ (z >> _S27)
    z = z * _M2
    return z ^ (z >> _S31)


@dataclass(frozen=True)
class Vocabulary:
    """Token ids are drawn from ``[low, high)``."""

    low: int = 1000
    high: int = 32000

    def __post_init__(self) -> None:
        if not 0 <= self.low < self.high:
            raise ValueError(f"empty vocabulary range [{self.low}, {self.high})")


class PromptSynthesizer:
    """Builds the token ids of a request's prompt from its hash ids; deterministic per ``seed``.

    Pure: the same (seed, vocabulary, spec) always gives the same prompt, in any process. A spec that
    carries ``prompt_token_ids`` is returned as is.
    """

    def __init__(self, seed: int = 0, vocab: Vocabulary | None = None) -> None:
        self.seed = seed
        self.vocab = vocab or Vocabulary()
        self._seed_key = mix64(np.array([seed & MASK64], dtype=np.uint64))[0]

    def effective_hash_ids(self, spec: RequestSpec) -> np.ndarray:
        """The spec's hash ids as uint64, or unique ones derived from its request id when it has none."""
        if spec.hash_ids:
            return np.array([h & MASK64 for h in spec.hash_ids], dtype=np.uint64)
        digest = hashlib.blake2b(spec.request_id.encode(), digest_size=8).digest()
        base = np.uint64(int.from_bytes(digest, "little") | UNIQUE_TAG)
        ks = np.arange(spec.num_blocks, dtype=np.uint64)
        return mix64(ks + base) | np.uint64(UNIQUE_TAG)

    def block_keys(self, hash_ids: np.ndarray, input_len: int, block_size: int) -> np.ndarray:
        """One 64-bit key per block (see the module docstring)."""
        n = hash_ids.size
        pos = np.arange(1, n + 1, dtype=np.uint64)
        keys = mix64(mix64(np.full(n, self._seed_key, dtype=np.uint64) ^ hash_ids) ^ (pos * POSITION_MULT))
        last = input_len - (n - 1) * block_size
        if n and last < block_size:
            salt = mix64(np.array([last], dtype=np.uint64) + PARTIAL_TAG)
            keys[-1] = keys[-1] ^ salt[0]
        return keys

    def tokens(self, hash_ids: np.ndarray, input_len: int, block_size: int) -> np.ndarray:
        """The prompt (int64 array of ``input_len`` token ids) of these block hashes."""
        keys = self.block_keys(hash_ids, input_len, block_size)
        idx = np.arange(input_len, dtype=np.int64)
        block_of = idx // block_size
        within = (idx - block_of * block_size + 1).astype(np.uint64)
        words = mix64(keys[block_of] + within * GOLDEN)
        span = np.uint64(self.vocab.high - self.vocab.low)
        return (words % span).astype(np.int64) + self.vocab.low

    def prompt_array(self, spec: RequestSpec) -> np.ndarray:
        if spec.prompt_token_ids is not None:
            return np.asarray(spec.prompt_token_ids, dtype=np.int64)
        return self.tokens(self.effective_hash_ids(spec), spec.input_len, spec.block_size)

    def prompt(self, spec: RequestSpec) -> list[int]:
        """The prompt as a list of ints, ready for the OpenAI ``prompt`` field."""
        out: list[int] = self.prompt_array(spec).tolist()
        return out


def ideal_block_hit_ratio(prompts: Iterable[np.ndarray], block_size: int) -> float:
    """Fraction of blocks an unbounded prefix cache would hit, from the token ids themselves.

    Each prompt is cut into ``block_size`` blocks (the last may be partial); block k's key is a hash of
    block k-1's key and block k's tokens (a chained hash, as vLLM's prefix cache keys blocks), so a block
    hits exactly when an earlier prompt had the same whole prefix through it. Returns 0.0 for no blocks.
    """
    seen: set[bytes] = set()
    total = hits = 0
    for p in prompts:
        arr = np.ascontiguousarray(p, dtype=np.int64)
        parent = b""
        for start in range(0, arr.size, block_size):
            h = hashlib.blake2b(parent, digest_size=16)
            h.update(arr[start:start + block_size].tobytes())
            key = h.digest()
            total += 1
            if key in seen:
                hits += 1
            else:
                seen.add(key)
            parent = key
    return hits / total if total else 0.0


def ideal_block_hit_ratio_of_ids(specs: Iterable[RequestSpec]) -> float | None:
    """The same ratio read straight from the hash ids (an id seen before is a hit); None without ids."""
    seen: set[int] = set()
    total = hits = 0
    for s in specs:
        for h in s.hash_ids:
            total += 1
            if h in seen:
                hits += 1
            else:
                seen.add(h)
    return hits / total if total else None

"""The real bytes of an emulated KV block: deterministic per key, so any copy can be checked byte-exact.

The emulated GPU holds no real KV; when a block leaves it (eviction write-back, swap) the tiers receive
``payload(key)``: the key's 8 bytes followed by a window of a fixed random buffer chosen by the key, of
``block_bytes`` in all (emulated block bytes x ``kv_payload_scale``, at least 8). Making one is a slice
copy, not a random draw. A block loaded back is compared with ``payload(key)``: a tier that returned the
wrong block, a truncated or a corrupted one fails the check (and the load falls back to recompute).
"""

from __future__ import annotations

import math

import numpy as np

from actors.engine.kv_blocks import BlockHash

KEY_BYTES = 8


class BlockPayloads:
    """Maker and checker of block payloads of one engine (see the module docstring)."""

    def __init__(self, emulated_block_bytes: float, payload_scale: float, seed: int = 0) -> None:
        if emulated_block_bytes <= 0 or not 0 < payload_scale <= 1:
            raise ValueError("block bytes must be positive and the payload scale in (0, 1]")
        self.emulated_block_bytes = emulated_block_bytes
        self.block_bytes = max(KEY_BYTES, math.ceil(emulated_block_bytes * payload_scale))
        body = self.block_bytes - KEY_BYTES
        self._noise = np.random.default_rng(seed).integers(0, 256, 2 * body + 1, dtype=np.uint8).tobytes()
        self._span = body + 1

    def payload(self, key: BlockHash) -> bytes:
        off = int(key) % self._span
        return int(key).to_bytes(KEY_BYTES, "little") + self._noise[off:off + self.block_bytes - KEY_BYTES]

    def matches(self, key: BlockHash, data: bytes) -> bool:
        return len(data) == self.block_bytes and data == self.payload(key)

"""The KV connector: moves a request's prompt KV from a prefill engine to a decode engine.

Push (prefill side): as each prefill chunk completes, the blocks it filled are pushed to the decode
engine's transport address, one push after another on a per-request sender task, so the transfer of
chunk i overlaps the compute of chunk i + 1; the last (partial) block goes when the prompt is done. The
prefill engine holds the request's blocks until every push landed, then frees them.

Pull (prefill side): when the prompt is done its blocks are published under the request id and held
under a lease; the decode engine pulls them after the router's notice, and the router (or the lease)
releases them.

Decode side: ``fetch`` waits for the pushed blocks (or pulls them) within the transfer timeout. Blocks
the decode engine already held (a prefix hit at reservation) are never sent.

Payloads are real bytes: ``block_tokens x KV bytes per token x kv_payload_scale`` per KV block, views
into one random buffer (a distinct window per group), checksummed by the transport. KV blocks travel in
groups of ``group`` consecutive blocks (the largest power of two that fits 1 MiB of real bytes, at least
one; group j holds KV blocks [j x group, (j + 1) x group)), because a transport frame per 16-token block
would cost more than the bytes themselves; a push sends only whole groups until the prompt is done.
Every transfer is recorded (emulated and wall time, bytes, whether the real transport was the
bottleneck).
"""

from __future__ import annotations

import asyncio
import contextlib
import math
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from actors.engine.engine import Engine
from actors.engine.sequence import RequestId, Sequence
from transport import Address, Block, Site, TransferRecord, TransportError
from transport import RequestId as TxId
from transport.base import BlockId, KVTransport


def address_to_json(a: Address) -> dict[str, Any]:
    return {"backend": a.backend, "location": a.location, "node": a.site.node, "region": a.site.region,
            "extra": [[k, v.hex()] for k, v in a.extra]}


def address_from_json(d: dict[str, Any]) -> Address:
    try:
        return Address(str(d["backend"]), str(d["location"]), Site(str(d["node"]), str(d["region"])),
                       tuple((str(k), bytes.fromhex(v)) for k, v in d.get("extra", [])))
    except (KeyError, TypeError, ValueError) as e:
        raise ValueError(f"not a transport address: {e}") from None


@dataclass(frozen=True, slots=True)
class TransferOutcome:
    ok: bool
    blocks: int
    records: tuple[TransferRecord, ...] = ()
    error: str | None = None

    @property
    def emulated_ms(self) -> float:
        return sum(r.emulated_ms for r in self.records)


GROUP_BYTES = 1 << 20


def group_blocks(block_bytes: int) -> int:
    """KV blocks per group: the largest power of two whose real bytes fit ``GROUP_BYTES``.

    A power of two, so that prefill chunks of the usual power-of-two token budgets (2,048 ... 16,384) end on
    group boundaries and each chunk's blocks go as soon as it is computed: a group a little larger than a
    chunk would hold every push back by one chunk. Prefill and decode derive it alike from the block size.
    """
    fit = max(1, GROUP_BYTES // block_bytes)
    return 1 << (fit.bit_length() - 1)


@dataclass
class _PushJob:
    rid: RequestId
    address: Address
    skip: int
    next_group: int
    queue: asyncio.Queue[tuple[int, int, int] | None] = field(default_factory=asyncio.Queue)
    task: asyncio.Task[None] | None = None
    error: str | None = None


class KVConnector:
    def __init__(self, engine: Engine, transport: KVTransport, payload_scale: float, timeout_ms: float = 500.0,
                 on_record: Callable[[TransferRecord, str], None] | None = None) -> None:
        self.engine = engine
        self.transport = transport
        self.bs = engine.cfg.block_size
        self.block_bytes = max(1, math.ceil(self.bs * engine.cost.kv_bytes_per_token * payload_scale))
        self.group = group_blocks(self.block_bytes)
        self._noise = np.random.default_rng(0).integers(0, 256, (self.group + 1) * self.block_bytes, dtype=np.uint8)
        self.timeout_ms = timeout_ms
        self.on_record = on_record
        self.address: Address | None = None
        self.pushes: dict[RequestId, _PushJob] = {}
        self.published: set[RequestId] = set()
        self._pull_skip: dict[RequestId, int] = {}
        self.records: deque[TransferRecord] = deque(maxlen=4096)
        self.failures = 0
        engine.chunk_listeners.append(self._on_progress)

    async def start(self) -> Address:
        self.address = await self.transport.serve()
        return self.address

    async def close(self) -> None:
        for job in list(self.pushes.values()):
            if job.task is not None:
                job.task.cancel()
                with contextlib.suppress(asyncio.CancelledError, Exception):
                    await job.task
        self.pushes.clear()
        await self.transport.close()

    # -- payloads ----------------------------------------------------------------------------------
    def groups(self, first_block: int, end_block: int) -> range:
        """The groups holding KV blocks ``first_block .. end_block - 1``."""
        if end_block <= first_block:
            return range(0)
        return range(first_block // self.group, -(-end_block // self.group))

    def group_block(self, rid: RequestId, j: int, first_block: int, end_block: int) -> Block:
        """Group ``j``'s payload: its KV blocks within ``[first_block, end_block)``."""
        lo, hi = max(first_block, j * self.group), min(end_block, (j + 1) * self.group)
        off = (hash((rid, j)) & 0x7FFFFFFF) % self.block_bytes
        return Block.of(j, self._noise[off:off + (hi - lo) * self.block_bytes])

    def prompt_blocks(self, seq: Sequence) -> int:
        return -(-seq.num_prompt_tokens // self.bs)

    # -- prefill side ------------------------------------------------------------------------------
    def start_push(self, rid: RequestId, address: Address, skip_blocks: int) -> None:
        """Stream ``rid``'s prompt blocks (from ``skip_blocks`` on) to ``address`` as they are computed."""
        job = _PushJob(rid, address, skip_blocks, skip_blocks // self.group)
        job.task = asyncio.get_running_loop().create_task(self._sender(job), name=f"kv-push-{rid}")
        self.pushes[rid] = job

    def _on_progress(self, seq: Sequence, finished: bool) -> None:
        job = self.pushes.get(seq.request_id)
        n = self.prompt_blocks(seq)
        if job is not None:
            computed = min(seq.num_computed_tokens, seq.num_prompt_tokens)
            # Whole groups of computed blocks go now; the rest when the prompt is done.
            upto = self.groups(job.skip, n).stop if finished else computed // self.bs // self.group
            if upto > job.next_group:
                job.queue.put_nowait((job.next_group, upto, n))
                job.next_group = upto
            if finished:
                job.queue.put_nowait(None)
        elif finished and seq.request_id in self.published:
            skip = self._pull_skip.pop(seq.request_id, 0)
            rid = seq.request_id
            self.transport.publish(TxId(rid), [self.group_block(rid, j, skip, n) for j in self.groups(skip, n)])

    async def _sender(self, job: _PushJob) -> None:
        try:
            while True:
                item = await job.queue.get()
                if item is None:
                    return
                lo, hi, n = item
                blocks = [self.group_block(job.rid, j, job.skip, n) for j in range(lo, hi)]
                try:
                    rec = await self.transport.push(job.address, TxId(job.rid), blocks,
                                                    deadline_ms=self.engine.clock.now_ms() + self.timeout_ms)
                except TransportError as e:
                    job.error = f"{type(e).__name__}: {e}"
                    self.failures += 1
                    return
                self._record(rec, "ok")
        finally:
            self.pushes.pop(job.rid, None)
            self.engine.release(job.rid)

    def publish_when_done(self, rid: RequestId, skip_blocks: int) -> None:
        """Pull mode: offer ``rid``'s prompt blocks once its prefill is done (held until ``release``)."""
        self.published.add(rid)
        self._pull_skip[rid] = skip_blocks

    def release(self, rid: RequestId) -> bool:
        """Pull mode: the decode engine has the blocks (or gave up): withdraw and free them."""
        if rid in self.published:
            self.published.discard(rid)
            self.transport.withdraw(TxId(rid))
        return self.engine.release(rid)

    # -- decode side -------------------------------------------------------------------------------
    async def fetch(self, rid: RequestId, *, mode: str, first_block: int, num_blocks: int,
                    prefill: Address | None, timeout_ms: float | None = None) -> TransferOutcome:
        """Wait for (push) or read (pull) blocks ``first_block .. num_blocks - 1`` of ``rid``."""
        groups = self.groups(first_block, num_blocks)
        count = len(groups)
        if count <= 0:
            return TransferOutcome(True, 0)
        deadline = self.engine.clock.now_ms() + (timeout_ms or self.timeout_ms)
        try:
            if mode == "push":
                delivery = await self.transport.receive(TxId(rid), count=count, deadline_ms=deadline)
            else:
                if prefill is None:
                    raise ValueError("pull mode needs the prefill engine's address")
                ids = [BlockId(j) for j in groups]
                delivery = await self.transport.pull(prefill, TxId(rid), ids, deadline_ms=deadline)
        except (TransportError, ValueError) as e:
            self.failures += 1
            self.transport.discard(TxId(rid))
            return TransferOutcome(False, count, error=f"{type(e).__name__}: {e}")
        with delivery:
            got = len(delivery.blocks)
            record = delivery.record
        if record is not None:
            self._record(record, "ok")
        return TransferOutcome(got >= count, got, (record,) if record is not None else ())

    def _record(self, rec: TransferRecord, outcome: str) -> None:
        self.records.append(rec)
        if self.on_record is not None:
            self.on_record(rec, outcome)

    def summary(self) -> dict[str, float]:
        recs = list(self.records)
        return {"transfers": len(recs), "failures": self.failures,
                "bytes_emulated": sum(r.emulated_bytes for r in recs),
                "bytes_real": sum(r.real_bytes for r in recs), "wall_ms": sum(r.wall_ms for r in recs),
                "real_bottleneck": sum(1 for r in recs if r.real_bottleneck)}

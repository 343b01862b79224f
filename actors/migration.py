"""Live KV migration and decode checkpoints, engine side: one ``MigrationAgent`` per engine server.

Live migration (the router asks the source engine, ``POST /kvmesh/migrate/{rid}``, naming the peer its
policy picked):

1. source: ``Engine.pause`` takes the request out of the step loop, keeping its blocks and its stream;
2. source -> peer ``POST /kvmesh/adopt`` with the request's state (:class:`SeqState`: prompt, tokens
   generated, budget, the sampling base and natural stop, how many tokens have KV); the peer reserves
   blocks for all of it (``Engine.reserve`` with the outputs; a prefix hit there needs no transfer) and
   answers how many leading blocks it already holds; it then waits for the rest on its transport;
3. source: pushes KV blocks ``[cached, ceil(computed / block))`` over the KV transport (the P->D path's
   connector: the link model charges the emulated fabric), then ``Engine.hand_off`` ends its stream of
   the request with ``MIGRATED`` (the server writes a ``kvmesh_migrated`` event naming the peer) and
   frees the blocks;
4. the router relays on from the peer (``POST /v1/completions`` with ``kv_transfer_params.resume =
   "migrated"``): ``Engine.admit_resumed`` continues at token ``len(output_ids)`` with the same base,
   so the client's stream has no token missing or repeated and nothing is recomputed.

A failure before the hand-off (the peer refuses or is gone, the transfer fails) ``unpause``s the request
on the source, which goes on serving it; the router then keeps the stream where it is.

Checkpoints (the router asks for them per request with ``kv_transfer_params.checkpoint = {peer, every}``):
after the first token, and then every ``every`` generated tokens, the source pushes the full blocks
computed since the last checkpoint to the peer and posts the state (``POST /kvmesh/checkpoint``). The
peer keeps the latest state per request in host memory (no GPU blocks) for ``lease_ms``. When the source
dies, the router resumes there (``resume = "checkpoint"`` with the tokens the client holds): the peer
reserves blocks, takes the checkpoint's KV, recomputes only the tokens after it (one prefill-like step)
and streams on from the client's next token. A finished request's checkpoint is dropped
(``DELETE /kvmesh/checkpoint/{rid}``). At most one checkpoint per request is in flight; a late one
covers everything since the last that landed.

Measured (emulated ms; ``/metrics`` and ``summary``): migration time per request (pause to hand-off),
checkpoint transfer time (the prompt's, and per increment normalised to 32 tokens), tokens recomputed
on resume. Checkpoint figures are recorded by the peer (the source may be dead when they are read).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import math
from collections import deque
from dataclasses import dataclass, field
from typing import Any

import aiohttp
from aiohttp import web
from prometheus_client import CollectorRegistry, Counter, Histogram
from pydantic import BaseModel, ConfigDict, StrictInt, StrictStr, ValidationError

from actors.engine.engine import Engine, EngineError, RequestStream, StreamEvent
from actors.engine.scheduler import TokenOutput
from actors.engine.sequence import RequestId, Sequence
from actors.kv_connector import KVConnector, address_from_json
from transport import Address, TransferRecord, TransportError
from transport import RequestId as TxId

TOKEN_INDEX_HEADER = "X-Kvmesh-Token-Index"
"""Response header of a resumed stream: the output index of its first token (the router dedupes by it)."""
MS_BUCKETS = (0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.0, 5.0, 10.0, 25.0, 50.0, 100.0, 250.0, 1000.0, 5000.0)


class SeqState(BaseModel):
    """What a request needs to go on elsewhere exactly: tokens so far and the sampling state."""

    model_config = ConfigDict(frozen=True, extra="forbid")
    request_id: StrictStr
    prompt_ids: list[StrictInt]
    output_ids: list[StrictInt]
    max_tokens: StrictInt
    base: StrictInt
    """The emulated model's sampling seed for this request (``OutputModel.seed_of``): token i is a pure
    function of (base, i)."""
    stop_after: StrictInt | None
    computed_tokens: StrictInt
    """Leading tokens (prompt, then outputs) whose KV exists and travels with the state."""

    @staticmethod
    def of(seq: Sequence, base: int, computed_tokens: int | None = None) -> SeqState:
        return SeqState(request_id=seq.request_id, prompt_ids=list(seq.prompt_ids), output_ids=list(seq.output_ids),
                        max_tokens=seq.max_tokens, base=base, stop_after=seq.stop_after,
                        computed_tokens=seq.num_computed_tokens if computed_tokens is None else computed_tokens)


class MigrationError(Exception):
    """A move that did not happen; ``status`` is the HTTP status to answer with."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


class MigrationMetrics:
    def __init__(self, registry: CollectorRegistry, engine: str) -> None:
        self.migrations = Counter("kvmesh_kv_migrations", "Live migrations by side (out: this engine was "
                                  "the source) and outcome.", ["engine", "side", "outcome"], registry=registry)
        self.migration_s = Histogram("kvmesh_kv_migration_seconds", "Emulated seconds from pausing a request "
                                     "to handing it off (its KV transferred), per migrated request.", ["engine"],
                                     buckets=tuple(b / 1000 for b in MS_BUCKETS), registry=registry)
        self.checkpoints = Counter("kvmesh_kv_checkpoints", "Checkpoints received from a source engine.",
                                   ["engine", "kind"], registry=registry)
        self.checkpoint_s = Histogram("kvmesh_kv_checkpoint_seconds_per_32_tokens", "Emulated transfer seconds "
                                      "of an incremental checkpoint, per 32 tokens of KV.", ["engine"],
                                      buckets=tuple(b / 1000 for b in MS_BUCKETS), registry=registry)
        self.resumes = Counter("kvmesh_kv_resumes", "Requests resumed here from another engine.",
                               ["engine", "source"], registry=registry)
        self.recomputed = Counter("kvmesh_kv_recomputed_tokens", "Tokens recomputed on resuming from a "
                                  "checkpoint (those after it).", ["engine"], registry=registry)
        self.engine = engine


@dataclass
class _Incoming:
    """A migration this engine accepted: its state and the transfer of its blocks."""

    state: SeqState
    txid: str
    first_block: int
    end_block: int
    expires_ms: float


@dataclass
class _Checkpoint:
    state: SeqState
    covered_tokens: int
    expires_ms: float


@dataclass(frozen=True)
class CheckpointTarget:
    url: str
    address: Address
    every: int


@dataclass
class _Watch:
    """A request this engine checkpoints to ``peer``."""

    peer_url: str
    address: Address
    every: int
    last_outputs: int = 0
    covered_blocks: int = 0
    index: int = 0
    task: asyncio.Task[None] | None = None


@dataclass
class Figures:
    """Raw figures of this engine, for ``summary`` (bounded)."""

    migration_ms: deque[float] = field(default_factory=lambda: deque(maxlen=4096))
    checkpoint_ms_per_32: deque[float] = field(default_factory=lambda: deque(maxlen=4096))
    checkpoint_modelled_ms_per_32: deque[float] = field(default_factory=lambda: deque(maxlen=4096))
    """What the link model alone charges (the measured figure adds the real transport when it is slower)."""
    checkpoint_real_bottleneck: int = 0
    prompt_checkpoint_ms: deque[float] = field(default_factory=lambda: deque(maxlen=4096))
    recomputed: deque[int] = field(default_factory=lambda: deque(maxlen=4096))
    migrated_out: int = 0
    migrated_in: int = 0
    resumed_from_checkpoint: int = 0
    failed: int = 0


class MigrationAgent:
    """The engine's side of live migration and checkpoints (see the module docstring).

    Invariants: a paused request is either handed off (stream ended ``MIGRATED``, blocks freed) or
    unpaused, never both; an accepted migration's blocks are reserved under a lease, so a router that
    never resumes it leaks nothing; checkpoints hold no GPU blocks. Every HTTP body is JSON and every
    KV byte goes over the transport.
    """

    def __init__(self, engine: Engine, connector: KVConnector, registry: CollectorRegistry, *,
                 lease_ms: float, timeout_ms: float) -> None:
        self.engine = engine
        self.connector = connector
        self.lease_ms = lease_ms
        self.timeout_ms = timeout_ms
        self.metrics = MigrationMetrics(registry, engine.cfg.name)
        self.figures = Figures()
        self.incoming: dict[RequestId, _Incoming] = {}
        self.checkpoints: dict[RequestId, _Checkpoint] = {}
        self.watching: dict[RequestId, _Watch] = {}
        self.moved_to: dict[RequestId, dict[str, Any]] = {}
        """The peer each handed-off request went to (the server's ``kvmesh_migrated`` event names it)."""
        self._session: aiohttp.ClientSession | None = None
        self._tasks: set[asyncio.Task[Any]] = set()
        engine.observers.append(self)

    def add_routes(self, app: web.Application) -> None:
        app.router.add_post("/kvmesh/migrate/{rid}", self.handle_migrate)
        app.router.add_post("/kvmesh/adopt", self.handle_adopt)
        app.router.add_post("/kvmesh/checkpoint", self.handle_checkpoint)
        app.router.add_delete("/kvmesh/checkpoint/{rid}", self.handle_drop_checkpoint)

    async def close(self) -> None:
        for t in list(self._tasks):
            t.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        if self._session is not None:
            await self._session.close()
            self._session = None

    # -- plumbing ----------------------------------------------------------------------------------
    def _spawn(self, coro: Any) -> asyncio.Task[Any]:
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task

    async def _http(self, method: str, url: str, path: str, body: dict[str, Any] | None = None,
                    ) -> tuple[int, dict[str, Any]]:
        if self._session is None:
            self._session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=60.0))
        data = json.dumps(body or {}).encode()
        async with self._session.request(method, url + path, data=data,
                                         headers={"Content-Type": "application/json"}) as r:
            raw = await r.read()
        try:
            reply = json.loads(raw) if raw else {}
        except ValueError:
            reply = {"error": raw[:200].decode("utf-8", "replace")}
        return r.status, reply if isinstance(reply, dict) else {}

    def _blocks_of(self, computed_tokens: int) -> int:
        return math.ceil(computed_tokens / self.connector.bs)

    async def _push(self, address: Address, txid: str, rid: RequestId, first: int, end: int,
                    ) -> TransferRecord | None:
        """Push KV blocks ``[first, end)`` of ``rid`` (in the connector's groups); None when there are none."""
        c = self.connector
        blocks = [c.group_block(rid, j, first, end) for j in c.groups(first, end)]
        if not blocks:
            return None
        rec = await c.transport.push(address, TxId(txid), blocks,
                                     deadline_ms=self.engine.clock.now_ms() + self.timeout_ms)
        c._record(rec, "ok")
        return rec

    async def _receive(self, txid: str, first: int, end: int) -> None:
        """Take the pushed blocks ``[first, end)`` of a transfer; raises MigrationError when they do not come."""
        count = len(self.connector.groups(first, end))
        if count == 0:
            return
        try:
            delivery = await self.connector.transport.receive(
                TxId(txid), count=count, deadline_ms=self.engine.clock.now_ms() + self.timeout_ms)
        except TransportError as e:
            self.connector.transport.discard(TxId(txid))
            raise MigrationError(504, f"kv_transfer_failed: {type(e).__name__}: {e}") from None
        delivery.release()  # the bytes arrived (checksummed); the emulated KV is the block table

    def _sweep(self) -> None:
        now = self.engine.clock.now_ms()
        for rid in [r for r, c in self.checkpoints.items() if c.expires_ms <= now]:
            del self.checkpoints[rid]
        for rid in [r for r, i in self.incoming.items() if i.expires_ms <= now]:
            inc = self.incoming.pop(rid)
            self.connector.transport.discard(TxId(inc.txid))
            self.engine.cancel_reservation(rid)

    # -- live migration, source side ---------------------------------------------------------------
    async def handle_migrate(self, request: web.Request) -> web.Response:
        rid = RequestId(request.match_info["rid"])
        try:
            body = await request.json()
            peer = body["peer"]
            reply = await self.migrate(rid, str(peer["name"]), str(peer["url"]), address_from_json(peer["address"]))
        except (KeyError, TypeError, ValueError) as e:
            return web.json_response({"error": f"migrate needs peer.name, peer.url, peer.address: {e}"}, status=400)
        except MigrationError as e:
            return web.json_response({"error": str(e)}, status=e.status)
        return web.json_response(reply)

    async def migrate(self, rid: RequestId, peer_name: str, peer_url: str, address: Address) -> dict[str, Any]:
        """Move ``rid`` with its KV to the peer (steps 1-3 of the module docstring)."""
        clock = self.engine.clock
        t0 = clock.now_ms()
        got = self.engine.pause(rid)
        if got is None:
            raise MigrationError(404, f"request {rid!r} is not running here")
        seq, base = got
        state = SeqState.of(seq, base)
        end = self._blocks_of(state.computed_tokens)
        try:
            status, reply = await self._http("POST", peer_url, "/kvmesh/adopt",
                                             {"state": state.model_dump(), "lease_ms": self.lease_ms})
            if status != 200:
                raise MigrationError(502 if status >= 500 else status,
                                     f"{peer_name} refused the request: {reply.get('error', status)}")
            first = int(reply["cached_blocks"])
            try:
                rec = await self._push(address, f"{rid}@mig", rid, first, end)
            except TransportError as e:
                with contextlib.suppress(aiohttp.ClientError, OSError):
                    await self._http("DELETE", peer_url, f"/kvmesh/reserve/{rid}")
                raise MigrationError(504, f"kv_transfer_failed: {type(e).__name__}: {e}") from None
        except (aiohttp.ClientError, OSError, KeyError, ValueError, MigrationError) as e:
            self.engine.unpause(rid)
            self.metrics.migrations.labels(self.metrics.engine, "out", "failed").inc()
            self.figures.failed += 1
            if isinstance(e, MigrationError):
                raise
            raise MigrationError(502, f"migration to {peer_name} failed: {type(e).__name__}: {e}") from None
        self.moved_to[rid] = {"to": peer_name, "token_index": len(state.output_ids)}
        self._stop_watch(rid, drop=True)
        self.engine.hand_off(rid)
        ms = clock.now_ms() - t0
        self.metrics.migrations.labels(self.metrics.engine, "out", "ok").inc()
        self.metrics.migration_s.labels(self.metrics.engine).observe(ms / 1000.0)
        self.figures.migration_ms.append(ms)
        self.figures.migrated_out += 1
        return {"ok": True, "to": peer_name, "migration_ms": ms, "blocks": max(0, end - first),
                "transfer_ms": rec.emulated_ms if rec is not None else 0.0,
                "transfer_modelled_ms": rec.modelled_ms if rec is not None else 0.0,
                "token_index": len(state.output_ids)}

    # -- live migration, target side ---------------------------------------------------------------
    async def handle_adopt(self, request: web.Request) -> web.Response:
        """Reserve blocks for a migrating request; its KV then arrives on the transport."""
        self._sweep()
        try:
            body = await request.json()
            state = SeqState.model_validate(body["state"])
            lease = float(body.get("lease_ms", self.lease_ms))
        except (KeyError, TypeError, ValueError, ValidationError) as e:
            return web.json_response({"error": f"adopt needs a valid 'state': {e}"}, status=400)
        rid = RequestId(state.request_id)
        try:
            res = self.engine.reserve(state.prompt_ids, state.max_tokens, request_id=rid, lease_ms=lease,
                                      output_ids=state.output_ids)
        except EngineError as e:
            return web.json_response({"error": e.message}, status=e.status)
        end = self._blocks_of(state.computed_tokens)
        self.incoming[rid] = _Incoming(state, f"{rid}@mig", min(res.cached_blocks, end), end,
                                       res.expires_ms)
        return web.json_response({"cached_blocks": min(res.cached_blocks, end)})

    async def resume(self, params: dict[str, Any]) -> tuple[RequestStream, int]:
        """Continue a request that moved here (``params['resume']``: ``migrated`` or ``checkpoint``); the
        stream and the output index of its first token."""
        try:
            rid = RequestId(str(params["request_id"]))
            kind = str(params["resume"])
        except KeyError as e:
            raise MigrationError(400, f"kv_transfer_params for a resume need {e.args[0]!r}") from None
        if kind == "migrated":
            return await self._resume_migrated(rid)
        if kind == "checkpoint":
            have = params.get("output_ids")
            if not isinstance(have, list) or not all(isinstance(t, int) for t in have):
                raise MigrationError(400, "a checkpoint resume needs 'output_ids' (the tokens the client holds)")
            return self._resume_checkpoint(rid, [int(t) for t in have], str(params.get("source", "")))
        raise MigrationError(400, f"kv_transfer_params.resume must be 'migrated' or 'checkpoint', not {kind!r}")

    async def _resume_migrated(self, rid: RequestId) -> tuple[RequestStream, int]:
        inc = self.incoming.pop(rid, None)
        if inc is None:
            raise MigrationError(404, f"no migration of {rid!r} was accepted here (expired or never made)")
        try:
            await self._receive(inc.txid, inc.first_block, inc.end_block)
        except MigrationError:
            self.engine.cancel_reservation(rid)
            raise
        st = inc.state
        try:
            stream = self.engine.admit_resumed(rid, st.computed_tokens, st.base, st.stop_after)
        except EngineError as e:
            raise MigrationError(e.status, e.message) from None
        self.metrics.migrations.labels(self.metrics.engine, "in", "ok").inc()
        self.metrics.resumes.labels(self.metrics.engine, "migration").inc()
        self.figures.migrated_in += 1
        return stream, len(st.output_ids)

    # -- checkpoints, source side ------------------------------------------------------------------
    @staticmethod
    def checkpoint_target(spec: Any) -> CheckpointTarget:
        """The peer ``kv_transfer_params.checkpoint`` names (``{"url", "address", "every"}``); MigrationError
        (400) when it is malformed, checked before the request is admitted."""
        try:
            return CheckpointTarget(str(spec["url"]), address_from_json(spec["address"]),
                                    max(1, int(spec.get("every", 32))))
        except (KeyError, TypeError, ValueError) as e:
            raise MigrationError(400, f"kv_transfer_params.checkpoint needs url, address, every: {e}") from None

    def watch(self, rid: RequestId, target: CheckpointTarget) -> None:
        """Checkpoint ``rid`` to ``target`` as it decodes."""
        self.watching[rid] = _Watch(target.url, target.address, target.every)

    def _stop_watch(self, rid: RequestId, *, drop: bool) -> None:
        w = self.watching.pop(rid, None)
        if w is not None and drop and w.index > 0:
            self._spawn(self._quiet("DELETE", w.peer_url, f"/kvmesh/checkpoint/{rid}"))

    async def _quiet(self, method: str, url: str, path: str) -> None:
        with contextlib.suppress(aiohttp.ClientError, OSError, TimeoutError):
            await self._http(method, url, path)

    def on_step(self, engine: Engine, step: Any, cost: Any, lag_wall_ms: float) -> None:
        pass

    def on_tokens(self, engine: Engine, outputs: list[TokenOutput], end_ms: float) -> None:
        if not self.watching:
            return
        for out in outputs:
            rid = out.seq.request_id
            w = self.watching.get(rid)
            if w is None or out.finish_reason is not None:
                continue
            n = len(out.seq.output_ids)
            due = n == 1 or n - w.last_outputs >= w.every
            if due and (w.task is None or w.task.done()):
                seq = out.seq
                full = seq.num_computed_tokens // self.connector.bs
                state = SeqState.of(seq, engine.sampling_base(rid), full * self.connector.bs)
                w.last_outputs = n
                w.task = self._spawn(self._checkpoint(rid, w, state, full))

    def on_finish(self, engine: Engine, seq: Sequence) -> None:
        self._stop_watch(seq.request_id, drop=True)

    async def _checkpoint(self, rid: RequestId, w: _Watch, state: SeqState, full: int) -> None:
        first = w.covered_blocks
        kind = "prompt" if w.index == 0 else "increment"
        txid = f"{rid}@ckpt{w.index}"
        try:
            rec = await self._push(w.address, txid, rid, first, full)
            ms = rec.emulated_ms if rec is not None else 0.0
            status, _ = await self._http("POST", w.peer_url, "/kvmesh/checkpoint", {
                "state": state.model_dump(), "txid": txid, "first_block": first, "end_block": full,
                "transfer_ms": ms, "modelled_ms": rec.modelled_ms if rec is not None else 0.0,
                "real_bottleneck": bool(rec is not None and rec.real_bottleneck), "kind": kind,
                "tokens": (full - first) * self.connector.bs})
        except (TimeoutError, TransportError, aiohttp.ClientError, OSError):
            self.figures.failed += 1
            return  # the next checkpoint sends these blocks again
        if status == 200:
            w.covered_blocks = full
            w.index += 1

    # -- checkpoints, peer side --------------------------------------------------------------------
    async def handle_checkpoint(self, request: web.Request) -> web.Response:
        self._sweep()
        try:
            body = await request.json()
            state = SeqState.model_validate(body["state"])
            first, end = int(body["first_block"]), int(body["end_block"])
            txid, kind = str(body["txid"]), str(body.get("kind", "increment"))
            ms, tokens = float(body.get("transfer_ms", 0.0)), int(body.get("tokens", 0))
            modelled, slow = float(body.get("modelled_ms", 0.0)), bool(body.get("real_bottleneck", False))
        except (KeyError, TypeError, ValueError, ValidationError) as e:
            return web.json_response({"error": f"checkpoint needs state, txid, first_block, end_block: {e}"},
                                     status=400)
        try:
            await self._receive(txid, first, end)
        except MigrationError as e:
            return web.json_response({"error": str(e)}, status=e.status)
        rid = RequestId(state.request_id)
        self.checkpoints[rid] = _Checkpoint(state, state.computed_tokens, self.engine.clock.now_ms() + self.lease_ms)
        self.metrics.checkpoints.labels(self.metrics.engine, kind).inc()
        if kind == "increment" and tokens > 0:
            per32 = ms * 32.0 / tokens
            self.metrics.checkpoint_s.labels(self.metrics.engine).observe(per32 / 1000.0)
            self.figures.checkpoint_ms_per_32.append(per32)
            self.figures.checkpoint_modelled_ms_per_32.append(modelled * 32.0 / tokens)
            self.figures.checkpoint_real_bottleneck += int(slow)
        elif kind == "prompt":
            self.figures.prompt_checkpoint_ms.append(ms)
        return web.json_response({"ok": True})

    async def handle_drop_checkpoint(self, request: web.Request) -> web.Response:
        return web.json_response({"dropped": self.checkpoints.pop(RequestId(request.match_info["rid"]), None)
                                  is not None})

    def _resume_checkpoint(self, rid: RequestId, have: list[int], source: str) -> tuple[RequestStream, int]:
        """Reserve, take the checkpoint's KV, recompute the tokens after it; the stream goes on at ``len(have)``."""
        ck = self.checkpoints.pop(rid, None)
        if ck is None:
            raise MigrationError(404, f"no checkpoint of {rid!r} here")
        st = ck.state
        common = min(len(have), len(st.output_ids))
        if have[:common] != st.output_ids[:common]:
            raise MigrationError(409, f"the checkpoint of {rid!r} disagrees with the tokens the client holds")
        outputs = have if len(have) >= len(st.output_ids) else list(st.output_ids)
        try:
            self.engine.reserve(st.prompt_ids, st.max_tokens, request_id=rid, lease_ms=self.lease_ms,
                                output_ids=outputs)
            stream = self.engine.admit_resumed(rid, ck.covered_tokens, st.base, st.stop_after)
        except EngineError as e:
            self.engine.cancel_reservation(rid)
            raise MigrationError(e.status, e.message) from None
        seq = stream.seq
        recomputed = max(0, seq.num_tokens - 1 - seq.num_computed_tokens)
        now = self.engine.clock.now_ms()
        for i in range(len(have), len(outputs)):  # tokens the checkpoint holds that the client has not seen
            stream.queue.put_nowait(StreamEvent((outputs[i],), now))
        self.metrics.resumes.labels(self.metrics.engine, "checkpoint").inc()
        self.metrics.recomputed.labels(self.metrics.engine).inc(recomputed)
        self.figures.resumed_from_checkpoint += 1
        self.figures.recomputed.append(recomputed)
        return stream, len(have)

    def summary(self) -> dict[str, Any]:
        f = self.figures
        return {"migrated_out": f.migrated_out, "migrated_in": f.migrated_in,
                "resumed_from_checkpoint": f.resumed_from_checkpoint, "failed": f.failed,
                "migration_ms": list(f.migration_ms), "checkpoint_ms_per_32_tokens": list(f.checkpoint_ms_per_32),
                "checkpoint_modelled_ms_per_32_tokens": list(f.checkpoint_modelled_ms_per_32),
                "checkpoint_real_bottleneck": f.checkpoint_real_bottleneck,
                "prompt_checkpoint_ms": list(f.prompt_checkpoint_ms), "recomputed_tokens": list(f.recomputed)}

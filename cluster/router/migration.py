"""Live KV migration and checkpoint resumes, router side (the engine side is ``actors.migration``).

The router knows every stream it relays (``track``: worker, request id, stream state). Then:

- Drain notice (a spot preemption: the worker's feed says ``draining``): for each stream on that worker,
  the policy ranks the eligible peers (prefix overlap included, so a peer already holding the prompt
  needs fewer blocks) and the router asks the draining engine to move the request there
  (``POST /kvmesh/migrate/{rid}``); the engine pushes the KV over the KV transport and ends its stream
  with a ``kvmesh_migrated`` event naming the peer. A peer that refuses is followed by the next one; when
  none takes it the stream stays until the kill, and then the ordinary failure path (a checkpoint, or a
  re-prefill elsewhere) continues it.
- Checkpoints: a streamed request sent to a worker carries ``kv_transfer_params.checkpoint``, naming a
  peer (the least loaded other eligible worker with a transport) and the interval; the engine copies its
  KV there as it decodes.
- ``carry_on``, after a relay ended without finishing: a ``kvmesh_migrated`` event sends the rest of the
  stream to the named peer (``resume = "migrated"``); a broken stream with a checkpoint peer resumes there
  (``resume = "checkpoint"``, with the tokens the client holds). The resumed engine says at which output
  index its stream starts (``X-Kvmesh-Token-Index``) and the relay drops the tokens the client already
  has (``StreamState.skip``), so no token is repeated; a start past what the client holds would be a gap
  and is refused. A resumed stream is tracked again (it may move again).

Failure behaviour: every step is best effort; ``carry_on`` returns False when it could not finish the
stream, and the caller's plain migration (re-prefill of prompt plus tokens) takes over. Counted in
``kvmesh_router_kv_*`` metrics by source engine and outcome.
"""

from __future__ import annotations

import asyncio
import contextlib
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from prometheus_client import CollectorRegistry

from actors.migration import TOKEN_INDEX_HEADER
from cluster.router.attempt import Attempts
from cluster.router.choice import Chooser, RoutedRequest
from cluster.router.metrics import LoopCounter, LoopHistogram
from cluster.router.policies import RoutingPolicy
from cluster.router.relay import MIGRATED, Relay, Sink, StreamState
from cluster.router.upstream import Upstream, UpstreamError, post_json, read_json
from cluster.router.view import RequestContext, WorkerId, WorkerInfo
from config.cluster import MigrationSpec

MAX_HOPS = 8
"""A stream moves at most this many times (each move must make progress or fail)."""


class KVMigrationMetrics:
    def __init__(self, registry: CollectorRegistry) -> None:
        self.moves = LoopCounter("kvmesh_router_kv_migrations", "Live migrations asked of a draining engine, by "
                                 "source engine and outcome.", ["source", "outcome"], registry=registry)
        self.move_seconds = LoopHistogram("kvmesh_router_kv_migration_seconds", "Emulated seconds a live "
                                          "migration took at the source (pause to hand-off, KV transfer included).",
                                          (0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.25, 1.0),
                                          registry=registry)
        self.resumes = LoopCounter("kvmesh_router_kv_resumes", "Streams resumed on another engine, by source "
                                   "engine, kind (migrated, checkpoint) and outcome.", ["source", "kind", "outcome"],
                                   registry=registry)
        self.skipped = LoopCounter("kvmesh_router_kv_deduped_tokens", "Tokens a resumed engine sent again that the "
                                   "client already had (dropped by index).", registry=registry)


@dataclass
class Tracked:
    """A stream the router relays, with what moving it needs."""

    rid: str
    worker: WorkerInfo
    st: StreamState
    req: RoutedRequest
    ctx: RequestContext
    policy: RoutingPolicy
    checkpoint_peer: WorkerInfo | None = None


def peer_json(w: WorkerInfo) -> dict[str, Any]:
    return {"name": w.name, "url": w.url, "address": w.extra["kv_address"]}


class KVMigrator:
    """The router's half of live migration and checkpoints (see the module docstring)."""

    def __init__(self, spec: MigrationSpec, chooser: Chooser, attempts: Attempts, relay: Relay, upstream: Upstream,
                 registry: CollectorRegistry) -> None:
        self.spec = spec
        self.chooser = chooser
        self.attempts = attempts
        self.relay = relay
        self.upstream = upstream
        self.metrics = KVMigrationMetrics(registry)
        self.streams: dict[str, dict[str, Tracked]] = {}
        self._draining: set[str] = set()
        self._tasks: set[asyncio.Task[None]] = set()

    @property
    def enabled(self) -> bool:
        return self.spec.enabled

    @staticmethod
    def new_request_id() -> str:
        return f"kvm-{uuid.uuid4().hex}"

    # -- tracking ------------------------------------------------------------------------------------
    @contextlib.contextmanager
    def tracking(self, t: Tracked) -> Iterator[Tracked]:
        """Know ``t`` as running on ``t.worker`` while the block runs."""
        on = self.streams.setdefault(t.worker.name, {})
        on[t.rid] = t
        try:
            yield t
        finally:
            if on.get(t.rid) is t:
                del on[t.rid]

    def peers(self, t: Tracked, exclude: set[WorkerId]) -> list[WorkerInfo]:
        return [w for w in self.chooser.eligible(t.req.model, t.ctx.residency, exclude) if "kv_address" in w.extra]

    def checkpoint_params(self, t: Tracked) -> dict[str, Any] | None:
        """``kv_transfer_params`` asking ``t.worker`` to checkpoint ``t`` to the least loaded other peer."""
        if not self.spec.checkpoints:
            t.checkpoint_peer = None
            return None
        peers = self.peers(t, {t.worker.name})
        if not peers:
            t.checkpoint_peer = None
            return None
        peer = min(peers, key=lambda w: (w.load, w.name))
        t.checkpoint_peer = peer
        return {"checkpoint": {**peer_json(peer), "every": self.spec.checkpoint_every_tokens}}

    # -- drain notice: move every stream off the worker ------------------------------------------------
    def on_frame(self, w: WorkerInfo, frame: dict[str, Any]) -> None:
        """A feed frame of ``w`` (the feed's ``on_frame`` hook): a new drain starts the evacuation."""
        if not self.spec.live:
            return
        load = frame.get("load", frame) if frame.get("t") == "snapshot" else frame
        if frame.get("t") not in ("load", "snapshot") or not isinstance(load, dict):
            return
        if not load.get("draining"):
            self._draining.discard(w.name)
            return
        if w.name in self._draining:
            return
        self._draining.add(w.name)
        task = asyncio.get_running_loop().create_task(self.evacuate(w))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def evacuate(self, w: WorkerInfo) -> None:
        await asyncio.gather(*(self.move(t) for t in list(self.streams.get(w.name, {}).values())))

    async def move(self, t: Tracked) -> bool:
        """Ask ``t``'s worker to move it to the best peer that takes it; True when it moved."""
        source = t.worker
        peers = self.peers(t, {source.name})
        if not peers:
            self.metrics.moves.inc_labels(source.name, "no_peer")
            return False
        self.chooser.fill_prompt(t.ctx, t.req, peers)
        t.ctx.overlap = self.chooser.overlap(t.ctx, peers)
        for peer in self.chooser.rank(t.policy, peers, t.ctx)[: self.chooser.spec.max_attempts]:
            try:
                async with await post_json(self.upstream, source.url, f"/kvmesh/migrate/{t.rid}",
                                           {"peer": peer_json(peer)}) as r:
                    status = r.status
                    reply = await read_json(r)
            except UpstreamError:
                self.metrics.moves.inc_labels(source.name, "source_unreachable")
                return False
            if status == 200:
                self.metrics.moves.inc_labels(source.name, "ok")
                self.metrics.move_seconds.observe(float(reply.get("migration_ms", 0.0)) / 1000.0)
                return True
            if status == 404:  # it finished (or was never there) meanwhile: nothing to move
                self.metrics.moves.inc_labels(source.name, "gone")
                return False
        self.metrics.moves.inc_labels(source.name, "refused")
        return False

    # -- after a relay ended early -------------------------------------------------------------------
    async def carry_on(self, t: Tracked, failure: str, sink: Sink, ignore_eos: bool, *,
                       checkpoints: bool = True) -> bool:
        """Finish ``t``'s stream after its relay from ``t.worker`` ended with ``failure``: on the peer it
        migrated to, or from its checkpoint (unless ``checkpoints`` is False: the router's ``migrate`` is off).
        True when the stream completed; False: nothing more to try."""
        st = t.st
        for _ in range(MAX_HOPS):
            source = t.worker
            if failure == MIGRATED and st.moved is not None:
                target = self.chooser.view.workers.get(WorkerId(str(st.moved.get("to"))))
                kind = "migrated"
            elif failure != MIGRATED and t.checkpoint_peer is not None and checkpoints:
                target, kind = t.checkpoint_peer, "checkpoint"
            else:
                return False
            st.moved = None
            if target is None:
                self.metrics.resumes.inc_labels(source.name, kind, "unknown_target")
                return False
            failure_next = await self._resume_on(t, target, kind, sink, ignore_eos)
            if failure_next is None:
                return True
            if failure_next == "refused":
                return False
            failure = failure_next
        return False

    async def _resume_on(self, t: Tracked, target: WorkerInfo, kind: str, sink: Sink,
                         ignore_eos: bool) -> str | None:
        """Relay the rest of ``t`` from ``target``: None when completed, 'refused', or why it broke."""
        st, source = t.st, t.worker
        self.chooser.fill_prompt(t.ctx, t.req, [target])
        params: dict[str, Any] = {"resume": kind, "request_id": t.rid, "source": source.name}
        if kind == "checkpoint":
            params["output_ids"] = list(st.token_ids)
        before = t.checkpoint_peer
        t.worker = target
        more = self.checkpoint_params(t)
        if more is not None:
            params.update(more)
        body: dict[str, Any] = {"prompt": t.ctx.prompt_ids or [0], "stream": True, "output_token_ids": True,
                                "ignore_eos": ignore_eos, "stream_options": {"include_usage": True},
                                "kv_transfer_params": params}
        if t.req.model:
            body["model"] = t.req.model
        async with self.attempts.on(target, t.ctx.origin_region):
            try:
                async with await post_json(self.upstream, target.url, "/v1/completions", body,
                                           {"X-Request-Id": t.rid}) as up:
                    if up.status != 200:
                        await up.read()
                        outcome = f"http_{up.status}"
                    else:
                        start = int(up.headers.get(TOKEN_INDEX_HEADER, len(st.token_ids)))
                        outcome = "gap" if start > len(st.token_ids) else ""  # never relay a gap to the client
                    if outcome:
                        self.metrics.resumes.inc_labels(source.name, kind, outcome)
                        t.worker, t.checkpoint_peer = source, before  # still where it broke
                        return "refused"
                    st.skip = len(st.token_ids) - start
                    with self.tracking(t):
                        failure = await self.relay.relay(up, sink, st, rewrite=True)
                    self.metrics.skipped.inc(st.deduped)
                    st.deduped = 0
            except UpstreamError:  # it could not be reached: nothing was relayed from it
                self.metrics.resumes.inc_labels(source.name, kind, "unreachable")
                self.attempts.failed(target)
                t.worker, t.checkpoint_peer = source, before
                return "refused"
        self.metrics.resumes.inc_labels(source.name, kind, "ok" if failure is None else "broke")
        if failure is None:
            self.attempts.succeeded(target)
        return failure

    async def close(self) -> None:
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)

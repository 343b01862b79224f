"""The engines' push feed to routers: KV events and load over one WebSocket per process and router, msgpack.

Every engine in a process registers with the process's ``FeedHub``; every engine's HTTP server mounts the
hub at ``/kvmesh/feed``, so one connection to any of them can carry all of the process's engines. Which
engines a connection carries: without a query, the engine whose server it reached (one engine, the
compatible default); with ``?engines=a,b`` those; then ``{"t": "sub", "e": [names]}`` and
``{"t": "unsub", "e": [names]}`` from the client change the set at run time.

Frames (msgpack maps; ``t`` gives the type, ``e`` the engine):
- ``snapshot``: ``e``, ``seq`` (last KV event batch number), ``bs`` (block size), ``hashes`` (every block
  hash the engine's prefix cache holds), ``load``, and with KV tiers ``tiers`` ({medium: [hash, ...]}: what
  each tier below the GPU holds). Sent when an engine joins a connection and whenever the
  router asks ``{"t": "resync", "e": name}`` (after it saw a gap in ``seq``; without ``e``: every engine).
- ``kv``: ``e``, ``seq`` and ``events``: ``["stored", [hash, ...], parent | None]``,
  ``["removed", [hash, ...]]``, ``["cleared"]``. Batches are numbered 1, 2, 3 ... per engine without gaps.
  An event about a tier below the GPU carries its medium last (vLLM's ``medium``: ``"CPU"``, ``"DISK"``):
  ``["stored", [hash, ...], parent | None, "CPU"]``, ``["removed", [hash, ...], "CPU"]``; GPU events omit it.
- ``load``: ``loads``: {engine: its load report} for the engines whose report changed.
- ``beat``: nothing else; says the process (and so every engine on the connection) is alive.
- ``gone``: ``e``: that engine is not (or no longer) served here.
- ``batch``: ``f``: several of the above, in order (everything that was pending when the sender woke).

Algorithm (per connection): the sender sleeps on one event. An engine that changed (a step, an arrival,
an abort, a drain) marks itself dirty and sets it; a KV batch is queued and sets it. On waking the sender
sends the queued KV batches at once, and the load of the dirty engines whose report really changed, at
most one load frame per ``load_interval_ms`` (so a busy engine reports at the old 50 ms pace, an idle one
never). With nothing sent for ``heartbeat_ms`` a ``beat`` goes out: the router's liveness check rests on
it, so an idle process costs one small frame per heartbeat per router and no per-engine timer at all.
With ``only_changes`` off every heartbeat carries every engine's load (the old behaviour, kept as a
benchmark baseline).

Fault injection (``cluster.chaos``): ``cut``/``heal`` sever an engine's feed as a network partition would:
every connection carrying it is told it is ``gone`` and gets nothing more of it (nor do new connections)
until ``heal``, which sends a fresh snapshot. ``disturb`` loses, duplicates or reorders an engine's KV
batches (``FeedDisturbance``, seeded) until ``disturb(name, None)``; the router's gap detection and resync
must bring its index back to the engine's state.

Failure behaviour: removing an engine (its server stops) ends the connections that came in through that
server; the router reconnects to its feed URL. A slow router never slows the engines: each connection's
KV queue is bounded; when it overflows the batch is dropped for that connection only, whose router then
sees a gap and resyncs that engine from a snapshot. A frame that is not msgpack closes the connection
(1003).
"""

from __future__ import annotations

import asyncio
import contextlib
import random
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

import msgpack
from aiohttp import WSMsgType, web

from actors.engine.engine import Engine
from actors.engine.kv_blocks import MEDIUM_GPU, AllBlocksCleared, BlockRemoved, BlockStored, KVEvent
from config.cluster import FeedSpec

QUEUE_LIMIT = 4096
"""KV batches a connection may have queued per engine it carries before it drops one (and resyncs)."""

LoadFn = Callable[[], dict[str, Any]]


def encode_events(events: list[KVEvent]) -> list[list[Any]]:
    out: list[list[Any]] = []
    for ev in events:
        if isinstance(ev, BlockStored):
            out.append(["stored", list(ev.block_hashes), ev.parent_block_hash]
                       + ([ev.medium] if ev.medium != MEDIUM_GPU else []))
        elif isinstance(ev, BlockRemoved):
            out.append(["removed", list(ev.block_hashes)] + ([ev.medium] if ev.medium != MEDIUM_GPU else []))
        elif isinstance(ev, AllBlocksCleared):
            out.append(["cleared"])
    return out


@dataclass
class FeedDisturbance:
    """Per KV batch, with a seeded RNG: lose it (``loss``), send it twice (``duplicate``), or hold it back
    and send it after the next one (``reorder``); at most one of them per batch."""

    loss: float = 0.0
    duplicate: float = 0.0
    reorder: float = 0.0
    seed: int = 0
    held: dict[str, Any] | None = None
    counts: dict[str, int] = field(default_factory=lambda: {"lost": 0, "duplicated": 0, "reordered": 0})

    def __post_init__(self) -> None:
        self.rng = random.Random(self.seed)

    def pass_on(self, frame: dict[str, Any]) -> list[dict[str, Any]]:
        """The frames to send in place of ``frame``."""
        late = [self.held] if self.held is not None else []
        self.held = None
        x = self.rng.random()
        if x < self.loss:
            self.counts["lost"] += 1
            return late
        x -= self.loss
        if x < self.duplicate:
            self.counts["duplicated"] += 1
            return [frame, frame, *late]
        x -= self.duplicate
        if x < self.reorder and not late:
            self.counts["reordered"] += 1
            self.held = frame
            return []
        return [frame, *late]

    def flush(self) -> list[dict[str, Any]]:
        late, self.held = ([self.held] if self.held is not None else []), None
        return late


@dataclass
class _Source:
    name: str
    engine: Engine
    load: LoadFn


@dataclass(eq=False)
class _Connection:
    """One router's subscription: which engines, what is pending, what it was last told."""

    engines: set[str]
    limit: int
    via: tuple[str, ...] = ()
    """The engine(s) whose server the connection came in through: removing one closes it."""
    closing: bool = False
    wake: asyncio.Event = field(default_factory=asyncio.Event)
    kv: deque[dict[str, Any]] = field(default_factory=deque)
    dirty: set[str] = field(default_factory=set)
    snapshots: set[str] = field(default_factory=set)
    gone: set[str] = field(default_factory=set)
    severed: set[str] = field(default_factory=set)
    """Engines this connection would carry but for a partition (``FeedHub.cut``)."""
    sent_load: dict[str, dict[str, Any]] = field(default_factory=dict)
    dropped: int = 0


class FeedHub:
    """The feed of every engine in one process (see the module docstring)."""

    def __init__(self, cfg: FeedSpec | None = None, *,
                 now: Callable[[], float] | None = None) -> None:
        self.cfg = cfg or FeedSpec()
        self._now = now
        self._sources: dict[str, _Source] = {}
        self._conns: set[_Connection] = set()
        self._cut: set[str] = set()
        self._disturbed: dict[str, FeedDisturbance] = {}
        self.frames_sent = 0

    @property
    def subscribers(self) -> int:
        return len(self._conns)

    def now(self) -> float:
        return self._now() if self._now is not None else asyncio.get_running_loop().time()

    # -- engines -----------------------------------------------------------------------------------
    def add(self, name: str, engine: Engine, load: LoadFn) -> None:
        """Serve ``engine``'s feed under ``name``; its changes and KV batches reach every connection carrying it."""
        self._sources[name] = _Source(name, engine, load)
        engine.kv_subscribers.append(lambda seq, events: self._on_kv(name, seq, events))
        engine.change_listeners.append(lambda: self.changed(name))

    def remove(self, name: str) -> None:
        """Stop serving ``name``: connections carrying it are told it is gone."""
        if self._sources.pop(name, None) is None:
            return
        for c in self._conns:
            if name in c.via:
                c.closing = True  # its server is going away: end the connection now, not at shutdown's timeout
                c.wake.set()
            if name in c.engines:
                c.engines.discard(name)
                c.gone.add(name)
                c.wake.set()

    def changed(self, name: str) -> None:
        """``name``'s load report may have changed (a step, an arrival, a drain).

        Only an engine that becomes dirty wakes the sender: one already dirty is in the next load frame, which
        the sender is already sleeping towards. Waking it at every step of a busy engine, to find no load slot
        due and sleep again (a new ``wait_for`` each time), cost each step about as much as its token's SSE write.
        """
        for c in self._conns:
            if name in c.engines and name not in c.dirty:
                c.dirty.add(name)
                c.wake.set()

    # -- fault injection -----------------------------------------------------------------------------
    def cut(self, name: str) -> None:
        """Sever ``name``'s feed from every router (see the module docstring)."""
        self._cut.add(name)
        for c in self._conns:
            if name in c.engines:
                self._unsubscribe(c, [name])
                c.kv = deque(f for f in c.kv if f["e"] != name)
                c.severed.add(name)
                c.gone.add(name)
                c.wake.set()

    def heal(self, name: str) -> None:
        """End ``name``'s partition: the connections it was cut from get a fresh snapshot of it."""
        self._cut.discard(name)
        for c in self._conns:
            if name in c.severed:
                c.severed.discard(name)
                self._subscribe(c, [name])

    def disturb(self, name: str, disturbance: FeedDisturbance | None) -> dict[str, int]:
        """Disturb ``name``'s KV batches from now on (None: stop, sending a held batch); the counts so far."""
        old = self._disturbed.pop(name, None)
        if disturbance is not None:
            self._disturbed[name] = disturbance
        if old is None:
            return {}
        for frame in old.flush():
            self._fan_out(name, frame)
        return old.counts

    def _on_kv(self, name: str, seq: int, events: list[KVEvent]) -> None:
        if not self._conns:
            return
        frame = {"t": "kv", "e": name, "seq": seq, "events": encode_events(events)}
        disturbance = self._disturbed.get(name)
        for f in [frame] if disturbance is None else disturbance.pass_on(frame):
            self._fan_out(name, f)

    def _fan_out(self, name: str, frame: dict[str, Any]) -> None:
        for c in self._conns:
            if name not in c.engines:
                continue
            if len(c.kv) >= c.limit:
                c.dropped += 1  # the router sees the gap in seq and asks for a snapshot
                continue
            c.kv.append(frame)
            c.wake.set()

    def snapshot(self, name: str) -> dict[str, Any]:
        s = self._sources[name]
        snap = {"t": "snapshot", "e": name, "seq": s.engine.kv_event_seq, "bs": s.engine.cfg.block_size,
                "hashes": list(s.engine.kv.pool.cached.keys()), "load": s.load()}
        if s.engine.tiers is not None:
            snap["tiers"] = s.engine.tiers.chain.held()
        return snap

    # -- connections -------------------------------------------------------------------------------
    def _subscribe(self, c: _Connection, names: Iterable[str]) -> None:
        for n in names:
            if n in self._cut:
                c.severed.add(n)
                c.gone.add(n)
            elif n in self._sources:
                c.engines.add(n)
                c.snapshots.add(n)
            else:
                c.gone.add(n)
        c.limit = QUEUE_LIMIT * max(1, len(c.engines))
        c.wake.set()

    def _unsubscribe(self, c: _Connection, names: Iterable[str]) -> None:
        for n in names:
            c.engines.discard(n)
            c.severed.discard(n)
            c.snapshots.discard(n)
            c.dirty.discard(n)
            c.sent_load.pop(n, None)

    def _pending(self, c: _Connection, load_due: bool) -> list[dict[str, Any]]:
        """What to send now: snapshots, queued KV batches, gone notices, and changed loads when ``load_due``."""
        out: list[dict[str, Any]] = []
        if c.snapshots:
            names = sorted(c.snapshots)
            c.snapshots.clear()
            # A snapshot supersedes that engine's queued batches (it holds their effect).
            c.kv = deque(f for f in c.kv if f["e"] not in names)
            for n in names:
                if n in self._sources:
                    snap = self.snapshot(n)
                    c.sent_load[n] = snap["load"]
                    c.dirty.discard(n)
                    out.append(snap)
        while c.kv:
            out.append(c.kv.popleft())
        if c.gone:
            out.extend({"t": "gone", "e": n} for n in sorted(c.gone))
            c.gone.clear()
        if load_due and c.dirty:
            loads: dict[str, dict[str, Any]] = {}
            for n in c.dirty:
                src = self._sources.get(n)
                if src is None:
                    continue
                report = src.load()
                if report != c.sent_load.get(n):
                    loads[n] = c.sent_load[n] = report
            c.dirty.clear()
            if loads:
                out.append({"t": "load", "loads": loads})
        return out

    def _beat(self, c: _Connection) -> dict[str, Any]:
        if self.cfg.only_changes:
            return {"t": "beat"}
        loads = {n: self._sources[n].load() for n in c.engines if n in self._sources}
        c.sent_load.update(loads)
        return {"t": "load", "loads": loads}

    async def serve(self, request: web.Request, default: Iterable[str] = ()) -> web.WebSocketResponse:
        """The WebSocket handler (``default``: the engines a connection without ``?engines=`` carries)."""
        ws = web.WebSocketResponse(max_msg_size=1 << 20)
        await ws.prepare(request)
        query = request.query.get("engines")
        names = list(default) if query is None else [n for n in query.split(",") if n]
        c = _Connection(set(), QUEUE_LIMIT, tuple(default))
        self._conns.add(c)
        self._subscribe(c, names)
        reader = asyncio.get_running_loop().create_task(self._read(ws, c))
        pack = msgpack.packb
        interval = self.cfg.load_interval_ms / 1000.0
        heartbeat = self.cfg.heartbeat_ms / 1000.0
        last_load = last_sent = self.now() - interval
        try:
            while not ws.closed and not c.closing:
                now = self.now()
                load_due = now - last_load >= interval
                frames = self._pending(c, load_due)
                if load_due and any(f["t"] == "load" for f in frames):
                    last_load = now
                if not frames and now - last_sent >= heartbeat:
                    frames = [self._beat(c)]
                    if frames[0]["t"] == "load":
                        last_load = now
                if frames:
                    await ws.send_bytes(pack(frames[0] if len(frames) == 1 else {"t": "batch", "f": frames}))
                    self.frames_sent += 1
                    last_sent = self.now()
                    continue
                # Sleep until something happens, the next beat is due, or (dirty engines) the next load slot.
                c.wake.clear()
                until = last_sent + heartbeat
                if c.dirty:
                    until = min(until, last_load + interval)
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(c.wake.wait(), max(0.0, until - self.now()))
        except (ConnectionResetError, asyncio.CancelledError):
            pass
        finally:
            self._conns.discard(c)
            reader.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await reader
            await ws.close()
        return ws

    async def _read(self, ws: web.WebSocketResponse, c: _Connection) -> None:
        async for msg in ws:
            if msg.type != WSMsgType.BINARY:
                continue
            try:
                obj = msgpack.unpackb(msg.data)
            except (ValueError, msgpack.ExtraData, msgpack.FormatError, msgpack.StackError):
                await ws.close(code=1003, message=b"frames must be msgpack")
                return
            if not isinstance(obj, dict):
                continue
            kind, names = obj.get("t"), obj.get("e")
            if isinstance(names, str):
                names = [names]
            if not isinstance(names, list):
                names = None
            if kind == "resync":
                c.snapshots.update(n for n in (names or c.engines) if n in c.engines)
                c.wake.set()
            elif kind == "sub" and names is not None:
                self._subscribe(c, [str(n) for n in names])
            elif kind == "unsub" and names is not None:
                self._unsubscribe(c, [str(n) for n in names])

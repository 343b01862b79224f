"""The emulated fabric: topology, processor-sharing links, and the shaping wrapper around any backend.

Topology (:class:`Topology`). Endpoints name their :class:`~transport.base.Site` (node, region). Two
sites on one node talk over the node's GPU link (NVLink or PCIe, from the hardware profile); two
nodes of one region over their NICs (the node's ``nic`` preset or the cluster's
``transport.intra_region_link``; the slower of the two ends); two regions over the cluster's WAN link
(``ClusterSpec.wan_link``: half the round trip each way, the WAN bandwidth).

Sharing (:class:`ProcessorSharing`, :class:`SharedLink`). Each link an endpoint uses is one shared
resource: the node's GPU link, the node's NIC, or the WAN between two regions. Concurrent transfers
on a resource share its bandwidth equally (processor sharing): with ``n`` active transfers each drains
at ``bandwidth / n``; whenever one starts or finishes, the remaining bytes of the others are re-rated
from that instant. The model is an exact event-driven simulation in emulated milliseconds; the only
error is how late the waiting coroutines wake (the clock sleeps to absolute deadlines, so lateness
never accumulates).

Timing of one transfer of ``B`` emulated bytes started at ``t0``: a push joins its resource at ``t0``;
a pull first spends one one-way latency carrying its request, then joins. It completes at
``drained + latency + setup``, where ``drained`` is when its bytes finished draining. Alone on a link
that is ``link.transfer_ms(B)`` (plus one latency for a pull).

What is not modelled: contention at the *remote* end (each endpoint shapes its own calls; pushes from
many senders into one receiver NIC are not slowed by each other), and a WAN transfer's use of the
node NIC (the WAN is far slower).

Shaping (:class:`ShapedTransport`). Wraps any backend: the real bytes and the emulated transfer run
concurrently; a push's blocks become visible at the receiver at the emulated completion (the
backend's commit gate), and a pull returns no earlier than it. The commit itself costs a real round
trip, so the gate opens that much early: the lead, per peer, is the least delay from a planned
opening to the push's return among the recent pushes (wake-up lag plus the round trip). A push then
returns at its emulated completion plus only the jitter above that floor, never before it, and the
receiver sees the blocks about half a round trip before the completion. ``kv_payload_scale``
converts: emulated bytes = real bytes / scale. When the real bytes (with the commit's round trip)
took longer than the emulated transfer, the record says ``real_bottleneck``.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import itertools
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass

from config.catalog import Catalog, default_catalog
from config.cluster import ClusterSpec
from config.link import LinkProfile
from transport.base import (
    Abortable,
    Address,
    Block,
    BlockId,
    ClockLike,
    Delivery,
    Gate,
    KVTransport,
    RequestId,
    Site,
    SizeHook,
    TransferRecord,
    TransportStats,
)

GPU_LINK_LATENCY_US = {"nvlink": 2.0, "pcie": 5.0}
MAX_LEAD_S = 0.05
"""Cap on how early a commit gate opens (a sanity bound; real round trips are ~0.1-1 ms)."""
COMMIT_SAMPLES = 16
"""Recent commit delays kept per peer; the least of them is the lead."""
"""One-way latency of the intra-node GPU link by kind (the hardware profile gives only bandwidth)."""


# -- topology -------------------------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class Route:
    """The link between two sites and the shared resource a transfer on it occupies."""

    link: LinkProfile
    resource: tuple[str, ...]


@dataclass(frozen=True, slots=True)
class NodeLinks:
    region: str
    gpu_link: LinkProfile
    nic: LinkProfile


class Topology:
    """Which emulated link joins two sites (see the module docstring)."""

    def __init__(self, nodes: Mapping[str, NodeLinks], wan: Callable[[str, str], LinkProfile],
                 default: NodeLinks | None = None) -> None:
        self._nodes = dict(nodes)
        self._wan = wan
        self._default = default

    @staticmethod
    def from_cluster(spec: ClusterSpec, catalog: Catalog | None = None) -> Topology:
        """The topology of a cluster spec: GPU links from hardware, NICs from link presets, WAN from ``wan``."""
        cat = catalog or default_catalog()
        nodes: dict[str, NodeLinks] = {}
        for node in spec.nodes:
            hw = cat.hardware.get(node.hardware)
            kind = "pcie" if hw.intra_node_link == "pcie" else "nvlink"
            gpu = LinkProfile(name=f"{hw.name}-{kind}", source=f"hardware profile {hw.name}", kind=kind,
                              bandwidth_gbps=hw.intra_node_link_gbps, latency_us=GPU_LINK_LATENCY_US[kind])
            nic = cat.links.get(node.nic or spec.transport.intra_region_link)
            nodes[node.name] = NodeLinks(node.region, gpu, nic)
        return Topology(nodes, spec.wan_link)

    @staticmethod
    def flat(link: LinkProfile) -> Topology:
        """Every pair of distinct sites joined by ``link`` (same node included): for tests and benchmarks."""
        links = NodeLinks("", link, link)

        def no_wan(a: str, b: str) -> LinkProfile:
            return link

        return Topology({}, no_wan, default=links)

    def _node(self, site: Site) -> NodeLinks:
        found = self._nodes.get(site.node, self._default)
        if found is None:
            raise KeyError(f"node {site.node!r} is not in the topology (known: {', '.join(sorted(self._nodes))})")
        return found

    def route(self, a: Site, b: Site) -> Route:
        """The link from ``a`` to ``b`` and the resource of ``a`` it occupies."""
        na, nb = self._node(a), self._node(b)
        if a.region != b.region:
            return Route(self._wan(a.region, b.region), ("wan", *sorted((a.region, b.region))))
        if a.node == b.node:
            return Route(na.gpu_link, ("gpu-link", a.node))
        slow = na.nic if na.nic.bandwidth_gbps <= nb.nic.bandwidth_gbps else nb.nic
        if nb.nic.latency_us > slow.latency_us:
            slow = slow.model_copy(update={"latency_us": nb.nic.latency_us})
        return Route(slow, ("nic", a.node))


# -- processor sharing ----------------------------------------------------------------------------
FlowId = int


class ProcessorSharing:
    """Exact processor sharing of one link among flows (pure: no clock, no asyncio).

    Time is in emulated ms, sizes in bytes, ``rate`` in bytes per ms. ``add``/``remove``/``advance``
    take the current time, which must never go backwards; each returns the flows that finished
    at or before it, with their exact finishing times, in order.
    """

    EPS = 1e-6  # bytes: below this a flow counts as drained (floating-point slack)

    def __init__(self, rate_bytes_per_ms: float, t0: float = 0.0) -> None:
        if rate_bytes_per_ms <= 0:
            raise ValueError("rate must be positive")
        self.rate = rate_bytes_per_ms
        self.t = t0
        self.remaining: dict[FlowId, float] = {}

    @property
    def active(self) -> int:
        return len(self.remaining)

    def next_completion(self) -> float | None:
        """When the next flow finishes if no flow joins or leaves before then."""
        if not self.remaining:
            return None
        return self.t + min(self.remaining.values()) * len(self.remaining) / self.rate

    def predict(self, flow: FlowId) -> float | None:
        """When ``flow`` finishes if no flow joins or leaves before then (None if it is not active).

        Under processor sharing a flow with ``r`` bytes left finishes after every flow has drained
        ``min(its remaining, r)``: at ``t + sum(min(r_j, r)) / rate``.
        """
        r = self.remaining.get(flow)
        if r is None:
            return None
        return self.t + sum(min(x, r) for x in self.remaining.values()) / self.rate

    def advance(self, t: float) -> list[tuple[FlowId, float]]:
        done: list[tuple[FlowId, float]] = []
        t = max(t, self.t)
        while self.remaining:
            n = len(self.remaining)
            smallest = min(self.remaining.values())
            t_next = self.t + smallest * n / self.rate
            if t_next > t:
                drained = (t - self.t) * self.rate / n
                for f in self.remaining:
                    self.remaining[f] -= drained
                break
            for f in list(self.remaining):
                left = self.remaining[f] - smallest
                if left <= self.EPS:
                    del self.remaining[f]
                    done.append((f, t_next))
                else:
                    self.remaining[f] = left
            self.t = t_next
        self.t = t
        return done

    def add(self, t: float, flow: FlowId, nbytes: float) -> list[tuple[FlowId, float]]:
        done = self.advance(t)
        if nbytes <= self.EPS:
            done.append((flow, self.t))
        else:
            self.remaining[flow] = float(nbytes)
        return done

    def remove(self, t: float, flow: FlowId) -> list[tuple[FlowId, float]]:
        done = self.advance(t)
        self.remaining.pop(flow, None)
        return done


class Flow:
    """One transfer on a :class:`SharedLink`.

    ``done`` resolves with the exact time its bytes drained. ``ready`` resolves ``early_ms`` before
    that, as predicted when it fires (later joiners may still push the real drain time back; the
    flow keeps its share of the link until ``done`` either way).
    """

    __slots__ = ("done", "early_ms", "fid", "ready")

    def __init__(self, fid: FlowId, early_ms: float, loop: asyncio.AbstractEventLoop) -> None:
        self.fid = fid
        self.early_ms = early_ms
        self.done: asyncio.Future[float] = loop.create_future()
        self.ready: asyncio.Future[float] = loop.create_future()


class SharedLink:
    """One link resource shared by concurrent transfers, driven in emulated time by a clock.

    A driver task runs while flows are active: it sleeps to the next event (a predicted completion,
    or a flow's early signal) or until a flow joins or leaves, then advances the model and resolves
    finished flows with their exact finishing times. A closed flow leaves the link at once (the
    others are re-rated).
    """

    def __init__(self, link: LinkProfile, clock: ClockLike) -> None:
        self.link = link
        self.clock = clock
        self.model = ProcessorSharing(link.bandwidth_gbps * 1e6)  # GB/s = 1e6 bytes per ms
        self._flows: dict[FlowId, Flow] = {}
        self._ids = itertools.count()
        self._driver: asyncio.Task[None] | None = None
        self._kick: asyncio.Future[None] | None = None

    @property
    def active(self) -> int:
        return self.model.active

    def open(self, nbytes: float, start_ms: float | None = None, early_ms: float = 0.0) -> Flow:
        """Start draining ``nbytes`` from ``start_ms`` (default now; never before the model's time)."""
        flow = Flow(next(self._ids), max(0.0, early_ms), asyncio.get_running_loop())
        self._flows[flow.fid] = flow
        now = self.clock.now_ms()
        t = max(self.model.t, min(now, start_ms if start_ms is not None else now))
        self._resolve(self.model.add(t, flow.fid, nbytes))
        self._wake()
        return flow

    def close_flow(self, flow: Flow) -> None:
        """Leave the link (a cancelled or finished transfer); idempotent."""
        self._flows.pop(flow.fid, None)
        if flow.fid in self.model.remaining:
            self._resolve(self.model.remove(self.clock.now_ms(), flow.fid))
            self._wake()
        for fut in (flow.done, flow.ready):
            if not fut.done():
                fut.cancel()

    async def carry(self, nbytes: float, start_ms: float | None = None) -> float:
        """Drain ``nbytes`` through the link from ``start_ms`` (default now); return the drained time."""
        flow = self.open(nbytes, start_ms)
        try:
            return await flow.done
        finally:
            self.close_flow(flow)

    def _resolve(self, done: Iterable[tuple[FlowId, float]]) -> None:
        for fid, t in done:
            flow = self._flows.get(fid)
            if flow is not None:
                for fut in (flow.ready, flow.done):
                    if not fut.done():
                        fut.set_result(t)

    def _early_events(self) -> float | None:
        """Signal flows whose predicted drain is within their ``early_ms``; return the next such moment."""
        now = self.clock.now_ms()
        nxt: float | None = None
        for flow in self._flows.values():
            if flow.early_ms <= 0 or flow.ready.done():
                continue
            p = self.model.predict(flow.fid)
            if p is None:
                continue
            if p - flow.early_ms <= now:
                flow.ready.set_result(p)
            else:
                nxt = p - flow.early_ms if nxt is None else min(nxt, p - flow.early_ms)
        return nxt

    def _wake(self) -> None:
        if self._kick is not None and not self._kick.done():
            self._kick.set_result(None)
        if self.model.active and (self._driver is None or self._driver.done()):
            self._driver = asyncio.get_running_loop().create_task(self._drive(), name=f"link {self.link.name}")

    async def _drive(self) -> None:
        loop = asyncio.get_running_loop()
        while self.model.active:
            t_next = self.model.next_completion()
            assert t_next is not None
            early = self._early_events()
            if early is not None:
                t_next = min(t_next, early)
            self._kick = loop.create_future()
            sleeper = loop.create_task(self.clock.sleep_until(t_next))
            try:
                await asyncio.wait((sleeper, self._kick), return_when=asyncio.FIRST_COMPLETED)
            finally:
                if not sleeper.done():
                    sleeper.cancel()
                    with contextlib.suppress(asyncio.CancelledError):
                        await sleeper
            self._resolve(self.model.advance(self.clock.now_ms()))
        self._kick = None

    async def close(self) -> None:
        if self._driver is not None and not self._driver.done():
            self._driver.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._driver
        self._driver = None


@dataclass(frozen=True, slots=True)
class Modelled:
    """The emulated timing of one transfer: when it started, drained and completed, and over what."""

    link: LinkProfile
    start_ms: float
    drained_ms: float
    end_ms: float

    @property
    def duration_ms(self) -> float:
        return self.end_ms - self.start_ms


class LinkModel:
    """The emulated fabric as one endpoint sees it: a topology plus its shared link resources."""

    def __init__(self, topology: Topology, clock: ClockLike, payload_scale: float = 1.0) -> None:
        if not 0 < payload_scale <= 1:
            raise ValueError("payload_scale must be in (0, 1]")
        self.topology = topology
        self.clock = clock
        self.payload_scale = payload_scale
        self._links: dict[tuple[str, ...], SharedLink] = {}

    def emulated_bytes(self, real_bytes: int) -> float:
        return real_bytes / self.payload_scale

    def shared(self, route: Route) -> SharedLink:
        link = self._links.get(route.resource)
        if link is None:
            link = self._links[route.resource] = SharedLink(route.link, self.clock)
        return link

    async def transfer(self, src: Site, dst: Site, emulated_bytes: float, *, request_leg: bool = False,
                       start_ms: float | None = None) -> Modelled:
        """Carry ``emulated_bytes`` from ``src`` to ``dst``; return when it completes in emulated time.

        ``request_leg`` adds the one-way trip of a pull's request before the data flows.
        """
        route = self.topology.route(src, dst)
        link = route.link
        t0 = self.clock.now_ms() if start_ms is None else start_ms
        lat = link.latency_us / 1000.0
        join = t0 + (lat if request_leg else 0.0)
        if request_leg:
            await self.clock.sleep_until(join)
        drained = await self.shared(route).carry(emulated_bytes, start_ms=join)
        end = drained + lat + link.setup_us / 1000.0
        await self.clock.sleep_until(end)
        return Modelled(link, t0, drained, end)

    def open_push(self, src: Site, dst: Site, emulated_bytes: float, start_ms: float,
                  early_ms: float = 0.0) -> PushFlow:
        """Start a push's emulated transfer now; its ``arrival`` may be awaited ``early_ms`` ahead."""
        route = self.topology.route(src, dst)
        tail_ms = (route.link.latency_us + route.link.setup_us) / 1000.0
        shared = self.shared(route)
        flow = shared.open(emulated_bytes, start_ms, early_ms=max(0.0, early_ms - tail_ms))
        return PushFlow(self.clock, shared, flow, route.link, start_ms, tail_ms, early_ms)

    def active(self) -> int:
        return sum(link.active for link in self._links.values())

    async def close(self) -> None:
        for link in self._links.values():
            await link.close()


class PushFlow:
    """A push's emulated transfer: ``arrival()`` waits until ``early_ms`` before it completes (the
    caller's real commit round trip), ``result()`` gives its timing, ``close()`` leaves the link."""

    def __init__(self, clock: ClockLike, shared: SharedLink, flow: Flow, link: LinkProfile, start_ms: float,
                 tail_ms: float, early_ms: float) -> None:
        self.clock, self.shared, self.flow, self.link = clock, shared, flow, link
        self.start_ms, self.tail_ms, self.early_ms = start_ms, tail_ms, early_ms
        self.capped = False

    async def arrival(self) -> float:
        """Wait until ``early_ms`` before the (predicted) completion; return that planned moment."""
        predicted = await asyncio.shield(self.flow.ready)
        end = predicted + self.tail_ms
        half = (end - self.start_ms) / 2
        self.capped = self.early_ms > half  # a short transfer: never open before half its duration
        planned = end - min(self.early_ms, half)
        await self.clock.sleep_until(planned)
        return planned

    def result(self) -> Modelled:
        """The timing as known now: exact once drained, else the current prediction (the push is over)."""
        if self.flow.done.done() and not self.flow.done.cancelled():
            drained = self.flow.done.result()
        else:
            predicted = self.shared.model.predict(self.flow.fid)
            drained = predicted if predicted is not None else self.clock.now_ms()
        return Modelled(self.link, self.start_ms, drained, drained + self.tail_ms)

    def close(self) -> None:
        self.shared.close_flow(self.flow)


class ShapedTransport:
    """Any backend, with every transfer shaped to the emulated link between its two sites.

    Implements :class:`~transport.base.KVTransport` by delegation; only ``push`` and ``pull`` change.
    """

    def __init__(self, inner: KVTransport, model: LinkModel) -> None:
        self.inner = inner
        self.model = model
        self.name = inner.name
        self.site = inner.site
        self.clock = inner.clock
        self._commit_delays: dict[str, collections.deque[float]] = {}
        """Recent wall seconds from a commit gate's planned opening to its push's return, by peer."""

    def deadline(self, deadline_ms: float | None) -> float:
        return self.inner.deadline(deadline_ms)

    async def serve(self) -> Address:
        return await self.inner.serve()

    def abort_connections(self, address: Address) -> int:
        return self.inner.abort_connections(address) if isinstance(self.inner, Abortable) else 0

    async def push(self, address: Address, request_id: RequestId, blocks: Sequence[Block], *,
                   deadline_ms: float | None = None, gate: Gate | None = None) -> TransferRecord:
        start = self.clock.now_ms()
        self.model.topology.route(self.site, address.site)  # an unknown site fails here, before any byte moves
        real = sum(b.nbytes for b in blocks)
        emu = self.model.emulated_bytes(real)
        delays = self._commit_delays.setdefault(address.location, collections.deque(maxlen=COMMIT_SAMPLES))
        lead = min(delays, default=0.0)
        flow = self.model.open_push(self.site, address.site, emu, start, self.clock.to_emulated_ms(lead))
        opened = 0.0
        planned = 0.0
        on_time = False

        async def emulated_arrival() -> None:
            nonlocal opened, planned, on_time
            entered = self.clock.now_ms()
            planned = await flow.arrival()
            on_time = entered <= planned  # the bytes were staged before the gate was due
            if gate is not None:
                await gate()
            opened = time.perf_counter()

        try:
            rec = await self.inner.push(address, request_id, blocks, deadline_ms=deadline_ms, gate=emulated_arrival)
            modelled = flow.result()
        finally:
            flow.close()
        rtt = time.perf_counter() - opened if opened else 0.0
        if opened and on_time and not flow.capped:
            # From the planned opening to the return: wake-up lag plus the commit's round trip. The
            # lead is the least of the recent ones, so a push returns at its emulated arrival plus
            # only the jitter above that floor, and never before it.
            delays.append(min(MAX_LEAD_S, self.clock.to_wall_s(self.clock.now_ms() - planned)))
        return self._record(rec, modelled, emu, start, real_extra_s=rtt)

    async def pull(self, address: Address, request_id: RequestId, block_ids: Sequence[BlockId], *,
                   deadline_ms: float | None = None, on_size: SizeHook | None = None) -> Delivery:
        start = self.clock.now_ms()
        self.model.topology.route(address.site, self.site)
        loop = asyncio.get_running_loop()
        flow: asyncio.Task[Modelled] | None = None

        def sized(nbytes: int) -> None:
            nonlocal flow
            if flow is None:
                flow = loop.create_task(self.model.transfer(
                    address.site, self.site, self.model.emulated_bytes(nbytes), request_leg=True, start_ms=start))
            if on_size is not None:
                on_size(nbytes)

        try:
            delivery = await self.inner.pull(address, request_id, block_ids, deadline_ms=deadline_ms, on_size=sized)
            try:
                if flow is None:  # a backend that never reported the size: shape after the fact
                    sized(delivery.nbytes)
                assert flow is not None
                modelled = await flow
            except BaseException:
                delivery.release()
                raise
        finally:
            if flow is not None:
                await _cancel(flow)
        assert delivery.record is not None
        delivery.record = self._record(delivery.record, modelled, self.model.emulated_bytes(delivery.nbytes), start)
        return delivery

    def _record(self, rec: TransferRecord, modelled: Modelled, emu: float, start: float,
                real_extra_s: float = 0.0) -> TransferRecord:
        real_emulated_ms = self.clock.to_emulated_ms(rec.wall_ms / 1000.0 + real_extra_s)
        return TransferRecord(
            request_id=rec.request_id, op=rec.op, backend=rec.backend, peer=rec.peer, blocks=rec.blocks,
            real_bytes=rec.real_bytes, emulated_bytes=emu, started_ms=start,
            emulated_ms=self.clock.now_ms() - start, wall_ms=rec.wall_ms, link=modelled.link.name,
            modelled_ms=modelled.duration_ms, real_bottleneck=real_emulated_ms > modelled.duration_ms)

    def publish(self, request_id: RequestId, blocks: Iterable[Block]) -> None:
        self.inner.publish(request_id, blocks)

    def withdraw(self, request_id: RequestId) -> None:
        self.inner.withdraw(request_id)

    async def receive(self, request_id: RequestId, *, count: int = 1, deadline_ms: float | None = None) -> Delivery:
        return await self.inner.receive(request_id, count=count, deadline_ms=deadline_ms)

    def discard(self, request_id: RequestId) -> None:
        self.inner.discard(request_id)

    def stats(self) -> TransportStats:
        s = self.inner.stats()
        return TransportStats(connections=s.connections, pending=s.pending + self.model.active(), staged=s.staged,
                              inbox_blocks=s.inbox_blocks, pool_leases=s.pool_leases,
                              pool_in_use_bytes=s.pool_in_use_bytes, tasks=s.tasks)

    async def close(self) -> None:
        await self.model.close()
        await self.inner.close()


async def _cancel(task: asyncio.Task[Modelled]) -> None:
    if not task.done():
        task.cancel()
    with contextlib.suppress(asyncio.CancelledError, Exception):
        await task

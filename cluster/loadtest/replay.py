"""The replayer: open loop at the trace's timestamps, or closed loop at a fixed concurrency.

Open loop. Request i is due at emulated time ``arrival_ms[i] / speed`` after the run's origin; the wall
deadline is ``origin + due / 1000 * time_scale``. The bodies (prompt synthesis, JSON encoding) are built
ahead of their deadlines by a ``Prebuilder`` (``prebuild.py``): up to ``prebuild_bytes`` of them before the
origin is taken, the rest between deadlines while there is time. One dispatcher walks the requests in
arrival order: it sleeps to the absolute deadline with the project's ``Clock`` (a timer to just before the
deadline, then yielding to the loop until it passes), takes the ready body and starts the send as its own
task. Deadlines are absolute, so one late wake-up never delays the next, and the send never waits for
earlier answers: a slow server sees the trace's load regardless.

Bursts. Requests already due when the dispatcher reaches them (the rest of a burst sharing one timestamp) are
started without yielding to the loop in between, so the whole burst's sends run in the next loop pass, one
after the other, each up to its first wait (connection, headers and body written); the dispatcher yields once
before it builds bodies for, or sleeps to, a later deadline. Yielding after each send instead put a full loop
pass (every open stream's pending reads) between two sends of a burst: ~1.3 ms per send on the Mooncake slice,
so the 16th of a 16-request burst went out ~20 ms late. Started in one pass, two sends of a burst were
0.16-0.28 ms apart at p50 (0.15-0.24 ms of it the generator thread's CPU: aiohttp's request set-up and write),
against 0.58-0.68 ms (0.50 ms CPU) yielding, in the same bench alternated on a host under other work (direction
only); the last of a burst went out 2.9-3.0 ms late at p50 (6.4-6.6 before). Before the origin, ``warm.py``
opens as many keep-alive connections as the schedule can hold at once (``ReplayConfig.warm_connections``), so
a burst's sends do not each connect first.

Send lag is ``RequestRecord.send_lag_wall_ms``: the ``time.monotonic()`` taken as ``CompletionClient.send``
begins (before aiohttp builds the request, takes a connection and writes; the instant TTFT is measured from,
as vLLM's benchmark client stamps it) minus the request's wall deadline. A send's own set-up and write are
therefore outside its lag and inside the next one's of the same burst.

The heap is frozen for the run (``frozen_heap``: ``gc.freeze`` after one full collection, undone after): the
generator's process holds ~100k long-lived objects (the trace, Ray's and aiohttp's modules), and a full
collection over them stalled the loop ~47 ms now and then, late sends and late chunk timestamps alike; frozen,
a full collection scans only what the run itself made.

Closed loop. ``concurrency`` workers share the request list; each sends its next request as soon as its
previous one finished (the schedule time of a request is its real send time).

The replay's thread runs at ``generator_nice`` for the run (``priority.py``: the emulated engines' niceness,
-5 by default, where the host allows it), so on a host it shares with the engines it does not wait for a core
behind them.

Around the run the target's ``/metrics`` is scraped once before and once after (prefix cache counters,
step-lag histogram) and polled every ``metrics_interval_s`` for queue depth (see ``scrape.py``). A
watchdog ends requests still open after the target has reported nothing in flight for ``stall_grace_s``
(status ``stalled``), so a stream the server forgot to close cannot hold the run forever. The
run's duration is from the origin until the last request finished, in emulated seconds, as vLLM measures
its benchmark duration. Failures of single requests are records with a status; the replay itself raises
only ``TargetError`` when the target's model cannot be resolved.
"""

from __future__ import annotations

import asyncio
import gc
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field

import aiohttp

from actors.clock import Clock
from cluster.loadtest.client import ClientConfig, CompletionClient, PreparedRequest
from cluster.loadtest.prebuild import DEFAULT_BUDGET_BYTES, Prebuilder
from cluster.loadtest.priority import ENGINE_NICE_DEFAULT, NiceClaim, generator_priority
from cluster.loadtest.record import RequestRecord
from cluster.loadtest.scrape import DepthSample, MetricsText, TargetProbe
from cluster.loadtest.spec import RequestSpec
from cluster.loadtest.synthesis import PromptSynthesizer
from cluster.loadtest.warm import open_warm, warm_count

START_LEAD_S = 0.05
"""Wall seconds between taking the origin and the first deadline, so set-up never makes it late."""


@dataclass(frozen=True)
class ReplayConfig:
    """How the requests are paced. ``concurrency`` set means closed loop (timestamps ignored)."""

    speed: float = 1.0
    concurrency: int | None = None
    spin_ms: float = 1.0
    """Yield-polling before each deadline (see actors.clock): sub-ms send accuracy for a little CPU."""
    metrics_interval_s: float = 0.5
    scrape: bool = True
    ready_wait_s: float = 30.0
    prebuild_bytes: int = DEFAULT_BUDGET_BYTES
    """Open loop: request bodies held built ahead of their send time at most (see ``prebuild.py``)."""
    stall_grace_s: float = 30.0
    """Open requests are ended as ``stalled`` once the target has reported nothing running, waiting or
    held for this many wall seconds (a stream the server never closed); needs ``scrape``."""
    generator_nice: int | None = ENGINE_NICE_DEFAULT
    """Niceness of the replay's thread for the run (``priority.py``): the engines' (``ClusterSpec.engine_nice``)
    so neither waits behind the other on a shared host; None leaves it as it is. Where the host refuses (no root
    or CAP_SYS_NICE) the thread keeps its niceness and the summary says so."""
    warm_connections: int | None = None
    """Open loop: keep-alive connections to the target opened before the origin (``warm.py``). None: as many
    as the schedule holds at once (``warm_count``: requests due within any ``WARM_WINDOW_S`` wall seconds,
    at most ``WARM_CAP``); 0: none (each send connects when the pool has no idle connection)."""
    on_origin: Callable[[float], None] | None = field(default=None, compare=False)
    """Told the run's origin (``time.monotonic()`` of emulated time 0) once it is fixed, before the first
    send: how a fault schedule replays on the same timeline as the requests."""

    def __post_init__(self) -> None:
        if self.speed <= 0:
            raise ValueError(f"speed must be positive (got {self.speed})")
        if self.concurrency is not None and self.concurrency < 1:
            raise ValueError(f"concurrency must be at least 1 (got {self.concurrency})")
        if self.prebuild_bytes < 0:
            raise ValueError(f"prebuild_bytes must be >= 0 (got {self.prebuild_bytes})")
        if self.warm_connections is not None and self.warm_connections < 0:
            raise ValueError(f"warm_connections must be >= 0 (got {self.warm_connections})")
        if self.generator_nice is not None and not -20 <= self.generator_nice <= 19:
            raise ValueError(f"generator_nice is a niceness, between -20 and 19 (got {self.generator_nice})")

    @property
    def mode(self) -> str:
        return "closed" if self.concurrency is not None else "open"


@dataclass
class ReplayResult:
    """Everything one replay measured."""

    records: list[RequestRecord]
    duration_s: float
    """Emulated seconds from the origin until the last request finished."""
    wall_s: float
    model: str
    before: MetricsText | None = None
    after: MetricsText | None = None
    depth: list[DepthSample] = field(default_factory=list)
    workers: list[tuple[str, str]] = field(default_factory=list)
    scrape_errors: int = 0
    before_workers: dict[str, MetricsText] = field(default_factory=dict)
    after_workers: dict[str, MetricsText] = field(default_factory=dict)
    """Each worker's own page before and after (per-engine and per-process step lag)."""
    processes: dict[str, str] = field(default_factory=dict)
    """Worker name -> the process hosting it, when the router says (``GET /workers``' ``process``)."""
    priority: NiceClaim | None = None
    """The niceness the replay's thread asked for and ran at (``ReplayConfig.generator_nice``)."""
    warm_connections: tuple[int, int] = (0, 0)
    """Keep-alive connections to the target (asked for, opened) before the origin (``warm.py``)."""


OnDone = Callable[[RequestRecord], None]


async def replay(base_url: str, specs: Sequence[RequestSpec], config: ReplayConfig, client_config: ClientConfig,
                 synthesizer: PromptSynthesizer, *, on_done: OnDone | None = None,
                 session: aiohttp.ClientSession | None = None) -> ReplayResult:
    """Replay ``specs`` (arrivals in emulated ms from 0) against ``base_url``; see the module docstring."""
    own = session is None
    sess = session or aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0),
                                            timeout=aiohttp.ClientTimeout(total=None))
    try:
        with frozen_heap(), generator_priority(config.generator_nice) as claim:
            result = await _replay(base_url, specs, config, client_config, synthesizer, on_done, sess)
        result.priority = claim
        return result
    finally:
        if own:
            await sess.close()


@contextmanager
def frozen_heap() -> Iterator[None]:
    """Objects alive on entry are left out of garbage collection until exit (``gc.freeze``), so a full
    collection during the run never walks them; they are handed back on exit (``gc.unfreeze``). Nested or
    concurrent uses only lose the benefit: an exit unfreezes everything."""
    gc.collect()
    gc.freeze()
    try:
        yield
    finally:
        gc.unfreeze()


async def _replay(base_url: str, specs: Sequence[RequestSpec], config: ReplayConfig, client_config: ClientConfig,
                  synthesizer: PromptSynthesizer, on_done: OnDone | None,
                  session: aiohttp.ClientSession) -> ReplayResult:
    client = CompletionClient(session, base_url, client_config, synthesizer)
    model = await client.resolve_model(config.ready_wait_s)
    probe = TargetProbe(session, base_url, time_scale=client_config.time_scale)
    before: MetricsText | None = None
    before_workers: dict[str, MetricsText] = {}
    if config.scrape:
        await probe.discover_workers()
        target_before, before_workers = await probe.snapshot()
        before = probe.combined(target_before, before_workers)
    bodies: Prebuilder | None = None
    warm = (0, 0)
    if config.concurrency is None:
        bodies = Prebuilder(client.prepare, specs, config.prebuild_bytes)
        await bodies.fill()  # before the origin: the first bodies cost the schedule nothing
        wanted = config.warm_connections
        if wanted is None:
            wanted = warm_count([s.arrival_ms / config.speed / 1000.0 * client_config.time_scale for s in specs])
        warm = (wanted, await open_warm(session, base_url, wanted))

    origin = time.monotonic() + START_LEAD_S
    client.origin = origin
    probe.origin = origin
    clock = Clock(client_config.time_scale, spin_ms=config.spin_ms, origin=origin)
    if config.on_origin is not None:
        config.on_origin(origin)
    stop = asyncio.Event()
    poller = asyncio.create_task(probe.poll(config.metrics_interval_s, stop)) if config.scrape else None
    watchdog = asyncio.create_task(_watch_stalls(client, probe, config.stall_grace_s)) if config.scrape else None
    records: list[RequestRecord] = []

    def done(r: RequestRecord) -> None:
        records.append(r)
        if on_done is not None:
            on_done(r)

    try:
        if config.concurrency is not None:
            await _closed_loop(client, specs, config.concurrency, done)
        elif bodies is not None:
            await _open_loop(client, clock, specs, config.speed, bodies, done)
    finally:
        stop.set()
        if watchdog is not None:
            watchdog.cancel()
            await asyncio.gather(watchdog, return_exceptions=True)
        if poller is not None:
            await poller
    end = time.monotonic()
    after: MetricsText | None = None
    after_workers: dict[str, MetricsText] = {}
    if config.scrape:
        target_after, after_workers = await probe.snapshot()
        after = probe.combined(target_after, after_workers)
    order = {s.request_id: i for i, s in enumerate(specs)}
    records.sort(key=lambda r: order.get(r.request_id, len(order)))
    return ReplayResult(records=records, duration_s=max(1e-9, (end - origin) / client_config.time_scale),
                        wall_s=end - origin, model=model, before=before, after=after, depth=probe.samples,
                        workers=probe.workers, scrape_errors=probe.errors, before_workers=before_workers,
                        after_workers=after_workers, processes=dict(probe.processes), warm_connections=warm)


async def _watch_stalls(client: CompletionClient, probe: TargetProbe, grace_s: float) -> None:
    """End the requests open for ``grace_s`` or more while the target reported, for the last ``grace_s``,
    nothing running, waiting or held: the server has forgotten them. A request sent during an idle spell
    is younger than the grace, so it is never ended by a sample taken before the server saw it."""
    while True:
        await asyncio.sleep(1.0)
        idle = probe.idle_for()
        if client.open_count and idle >= grace_s:
            client.abandon_open(f"the server reported nothing running, waiting or held for {idle:.0f} s but "
                                f"this stream never ended (a server that forgot to close it)", grace_s)


async def _open_loop(client: CompletionClient, clock: Clock, specs: Sequence[RequestSpec], speed: float,
                     bodies: Prebuilder, done: OnDone) -> None:
    tasks: set[asyncio.Task[None]] = set()

    async def one(prepared: PreparedRequest, scheduled_wall: float) -> None:
        done(await client.send(prepared, scheduled_wall))

    try:
        for spec in specs:
            due = spec.arrival_ms / speed
            deadline = clock.wall_of(due)
            if clock.now_ms() < due:
                # Not due yet: the sends started so far go out first (one loop pass), then bodies are built
                # ahead while there is time, then the wait. A request already due (the rest of a burst that
                # shares a timestamp) skips all three, so a whole burst is started in one pass.
                await asyncio.sleep(0)
                await bodies.fill(before=deadline)
                await clock.sleep_until(due)
            task = asyncio.create_task(one(bodies.take(), deadline))
            tasks.add(task)
            task.add_done_callback(tasks.discard)
        while tasks:
            await asyncio.gather(*list(tasks))
    finally:
        for t in list(tasks):
            t.cancel()


async def _closed_loop(client: CompletionClient, specs: Sequence[RequestSpec], concurrency: int,
                       done: OnDone) -> None:
    queue = list(reversed(specs))

    async def worker() -> None:
        while queue:
            prepared = client.prepare(queue.pop())
            now = time.monotonic()
            done(await client.send(prepared, now))

    await asyncio.gather(*(worker() for _ in range(min(concurrency, len(specs)))))

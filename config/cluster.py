"""The cluster spec: regions, nodes, engines (role, hardware, model, TP), router, transport, time scale."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from itertools import combinations
from pathlib import Path
from typing import Any, Literal

from pydantic import Field, ValidationInfo, field_validator, model_validator

from config.base import Fraction, Frozen, Name, NonNegativeFloat, PositiveFloat, PositiveInt
from config.catalog import Catalog, catalog_from_context
from config.errors import ConfigError
from config.hardware import HardwareProfile
from config.kvstore import KVStoreSpec
from config.link import LinkProfile
from config.manifest import ManifestSpec
from config.model import ModelProfile
from config.profile import EmpiricalProfile
from config.step_profile import load_step_profile
from config.tiers import TiersSpec
from config.yamlio import SpecProblems, read_yaml, validate

Role = Literal["colocated", "prefill", "decode"]
ROLES: tuple[str, ...] = ("colocated", "prefill", "decode")

# Round-trip times between the default regions (issue: 65 ms east-west, 75 ms east-EU, 130 ms west-EU).
DEFAULT_RTT_MS: dict[frozenset[str], float] = {
    frozenset({"us-east-1", "us-west-2"}): 65.0,
    frozenset({"us-east-1", "eu-west-1"}): 75.0,
    frozenset({"us-west-2", "eu-west-1"}): 130.0,
}
DEFAULT_WAN_GBPS = 1.25  # 10 Gb/s of cross-region bandwidth per flow


class SchedulerSpec(Frozen):
    """vLLM-like scheduler and KV cache settings of one engine."""

    max_num_seqs: PositiveInt = 256
    max_num_batched_tokens: PositiveInt = 8192
    block_size: PositiveInt = 16
    gpu_memory_utilization: Fraction = 0.9
    num_gpu_blocks: PositiveInt | None = None
    """Explicit KV block count; otherwise derived from HBM left after weights."""
    activation_reserve_gb: NonNegativeFloat = 1.5
    """Memory the spec's load-time check keeps for activations and CUDA graphs, per GPU (a model that
    does not fit is refused). The engine's KV capacity itself is computed as vLLM does
    (``actors.engine.factory.kv_blocks_for``), unless ``num_gpu_blocks`` pins it."""
    enable_prefix_caching: bool = True
    enable_chunked_prefill: bool = True
    long_prefill_token_threshold: int = Field(default=0, ge=0)
    """A prefill chunk takes at most this many tokens of a step (0: no cap), as vLLM's setting."""
    policy: Literal["fcfs", "priority"] = "fcfs"
    """Waiting order and preemption victim: arrival order and the last running request, or
    (priority, arrival) and the lowest-priority running request (``actors.engine.scheduler``)."""
    async_scheduling: bool = True
    """vLLM's async scheduling (its default in 0.19): a step is planned while the previous one runs."""


class EngineGroupSpec(Frozen):
    """``replicas`` identical engines, each on ``tp`` GPUs of its node."""

    name: Name
    role: Role = "colocated"
    model: Name
    """A model preset (architecture, roofline cost) or an empirical profile."""
    hardware: Name | None = None
    """GPU type; defaults to the node's."""
    tp: PositiveInt = 1
    replicas: PositiveInt = 1
    ep: PositiveInt = 1
    """Expert-parallel degree of a MoE model (vLLM ``--enable-expert-parallel``): the experts are split over
    ``ep`` GPUs, ``tp`` of each engine times ``ep / tp`` data-parallel replicas of this group (set-up D:
    tp 1, replicas 2, ep 2), which exchange tokens by all-to-all in every MoE layer. As in vLLM, it changes
    nothing for a dense model."""
    scheduler: SchedulerSpec = SchedulerSpec()
    tiers: TiersSpec = TiersSpec()
    """KV tiers under the GPU cache (CPU DRAM, local disk) and swap preemption (``config.tiers``); off by default."""
    step_profile: str | None = None
    """A measured step-time table (``config.step_profile``'s CSV format) that replaces the model's
    roofline step times; the path is read where the engine starts (relative: to the working directory)."""

    @model_validator(mode="after")
    def _ep_fits(self) -> EngineGroupSpec:
        if self.ep > 1 and (self.ep % self.tp or self.replicas % (self.ep // self.tp)):
            raise ValueError(f"ep ({self.ep}) must be tp ({self.tp}) times a divisor of replicas ({self.replicas})")
        if self.tiers.enabled and not self.scheduler.enable_prefix_caching:
            raise ValueError("KV tiers key blocks by their prefix hashes: they need scheduler.enable_prefix_caching")
        return self

    @field_validator("step_profile")
    @classmethod
    def _step_profile_readable(cls, v: str | None) -> str | None:
        if v is not None:
            try:
                load_step_profile(v)
            except ConfigError as e:
                raise ValueError("; ".join(f"{path}: {why}" for path, why in e.problems)) from None
        return v


class NodeSpec(Frozen):
    name: Name
    region: Name
    hardware: Name
    gpus: PositiveInt | None = None
    """GPUs in the node; defaults to the hardware profile's gpus_per_node."""
    nic: Name | None = None
    """Link preset for traffic to other nodes of the region; defaults to the topology's."""
    host: Name | None = None
    """The Ray host (``placement.hosts``) this node's engines run on; required when hosts are declared."""
    engines: list[EngineGroupSpec] = Field(min_length=1)


class RegionSpec(Frozen):
    name: Name


class HostSpec(Frozen):
    """A Ray node of a multi-host cluster, found by its custom resource ``kvmesh_host:<name>``.

    The resource's amount is how many emulated GPUs the host takes (``ray start --resources``); each worker
    actor asks for its engines' GPUs of it and the router for a sliver, so placement is exact and a spec
    asking for more than a host offers fails before anything starts (``cluster.placement``).
    """

    name: Name
    region: Name | None = None
    """Region the host is in; when given, every node placed on it must be in that region."""


class PlacementSpec(Frozen):
    """Where the cluster's actors run and which address their servers bind.

    ``hosts`` empty: one host (the embedded Ray, or whichever node Ray picks on a one-node cluster).
    ``bind_host``: ``auto`` binds 127.0.0.1 on one host and each actor's own node address when the cluster
    spans hosts; ``0.0.0.0`` (every interface) or a literal address only when written here.
    """

    hosts: list[HostSpec] = Field(default_factory=list)
    router_host: Name | None = None
    """Host of the router(s); required when hosts are declared."""
    bind_host: str = "auto"

    @field_validator("bind_host")
    @classmethod
    def _address(cls, v: str) -> str:
        if v != "auto":
            import ipaddress

            try:
                ipaddress.ip_address(v)
            except ValueError:
                raise ValueError(f"bind_host must be 'auto' or an IP address (e.g. 0.0.0.0), got {v!r}") from None
        return v

    @property
    def multi_host(self) -> bool:
        return len(self.hosts) > 1


class WanLinkSpec(Frozen):
    a: Name
    b: Name
    rtt_ms: NonNegativeFloat
    bandwidth_gbps: PositiveFloat = DEFAULT_WAN_GBPS


class MigrationSpec(Frozen):
    """Moving running requests' KV off an engine that is going away (``actors.migration``,
    ``cluster.router.migration``). Either part gives every colocated and decode engine a KV transport."""

    live: bool = False
    """On a drain notice (spot preemption), the router moves each running stream's KV to a peer it picks
    (its policy ranks the peers); the peer resumes it without recomputing and the stream continues."""
    checkpoints: bool = False
    """Every ``checkpoint_every_tokens`` generated tokens an engine copies the sequence's new KV blocks to a
    peer the router picked, so a kill without notice resumes there from the last checkpoint."""
    checkpoint_every_tokens: PositiveInt = 32
    transfer_timeout_ms: PositiveFloat = 5_000.0
    """A migration's or checkpoint's KV transfer not done this long (emulated) after it began has failed."""
    lease_ms: PositiveFloat = 30_000.0
    """How long a peer keeps a migrated request's blocks, or a checkpoint, that nobody resumed."""

    @property
    def enabled(self) -> bool:
        return self.live or self.checkpoints


class RouterSpec(Frozen):
    """Everything the router takes (``cluster.router.app.RouterServer``); durations are emulated seconds.

    ``policy`` and ``region_strategy`` name entries of the router's registries and ``policy_params`` are
    validated by that policy's own parameter model: both are checked where they are used
    (``cluster.router.checks.check_router_spec``, which ``launch`` runs before starting anything), so this
    module imports nothing from the router.
    """

    host: str = "127.0.0.1"
    port: int = Field(default=0, ge=0, le=65535)
    """0 picks a free port at start."""
    policy: Name = "round_robin"
    policy_params: dict[str, float | int | str | bool] = Field(default_factory=dict)
    region_strategy: Name = "REGIONAL"
    """ROUND_ROBIN, REGIONAL or GLOBAL (``cluster.router.regions``)."""
    region: Name | None = None
    """Region the router runs in (requests originate there unless they say otherwise)."""
    partition_by_residency: bool = False
    """Run one router per region, each seeing only its region's workers (a residency zone)."""
    request_timeout_s: PositiveFloat = 3600.0
    """Deadline of one request at the router."""
    max_attempts: PositiveInt = 3
    max_waiting: PositiveInt | None = None
    """A worker with this many requests queued takes no more; when all are full the router answers 429."""
    index_mode: Literal["events", "approximate"] = "events"
    """``events``: the engines' KV events; ``approximate``: what the router sent where, for ``approx_ttl_s``."""
    approx_ttl_s: PositiveFloat = 120.0
    inflight_prefixes: bool = True
    """With ``events``: a request's blocks count as a provisional overlap on the worker it was sent to until
    the KV events confirm them (or ``inflight_ttl_s`` passes, or the attempt fails)."""
    inflight_ttl_s: PositiveFloat = 30.0
    migrate: bool = True
    """Continue a stream whose worker died mid-way on another worker."""
    health_timeout_s: PositiveFloat = 2.0
    """A worker whose feed is silent this long (wall seconds; it beats every ``feed.heartbeat_ms``) is unhealthy."""
    connect_timeout_s: PositiveFloat = 5.0
    """Connecting to an engine (wall seconds); past it the attempt fails and the next worker is tried."""
    read_timeout_s: PositiveFloat = 600.0
    """Longest silence of an engine mid-answer before the router gives up on it and retries elsewhere
    (or migrates the stream). A non-streamed answer is silent until it is whole: keep this above it."""
    breaker_threshold: PositiveInt = 3
    """Consecutive failures that open a worker's circuit breaker."""
    breaker_cooldown_s: PositiveFloat = 5.0
    """An open breaker lets one trial request through after this long (wall seconds)."""
    upstream_connections: PositiveInt = 4096
    """Connections the router may hold open to all engines together (``limit_per_host``: a quarter)."""
    kv_migration: MigrationSpec = MigrationSpec()
    """Live migration on a drain notice and decode checkpoints (off by default)."""


class TransportSpec(Frozen):
    backend: Literal["inproc", "tcp", "ucx"] = "tcp"
    kv_payload_scale: Fraction = 1.0
    """Real bytes moved per emulated KV byte (1.0 = full size)."""
    faults: dict[str, Any] | None = None
    """A seeded fault plan for every KV transfer (``transport.faulty.FaultPlan``: seed, rates per kind; the
    transport owns the fault kinds, so ``launch`` validates it there before starting anything)."""
    intra_region_link: Name = "rdma-ib-ndr400"
    """Default NIC link preset between nodes of one region."""


class DisaggSpec(Frozen):
    """Prefill/decode disaggregation: hand-off, conditional disaggregation, transfer failure handling."""

    hand_off: Literal["push", "pull"] = "push"
    """push: prefill streams each finished chunk's blocks to decode; pull: decode reads after a notice."""
    min_uncached_tokens: NonNegativeFloat = 512
    """Serve on the decode engine alone when the prompt's uncached part is shorter than this."""
    decode_prefix_fraction: Fraction = 0.8
    """... or when the decode engine already holds at least this fraction of the prompt."""
    max_prefill_waiting: PositiveInt = 16
    """... or when every prefill engine has this many requests queued."""
    transfer_timeout_ms: PositiveFloat = 500.0
    """A KV transfer not complete this long (emulated) after it could start counts as failed."""
    on_transfer_failure: Literal["prefill", "decode"] = "decode"
    """Finish the request on the prefill engine (which still holds its KV) or re-prefill on decode."""
    lease_ms: PositiveFloat = 30_000.0
    """How long a prefill holds blocks nobody came for, and a decode reservation nobody claimed."""
    reserve_wait_ms: PositiveFloat = 60_000.0
    """How long a request may wait for decode KV room before the router gives up (503)."""


class FeedSpec(Frozen):
    """How engines push their load to routers (``actors.feed``): on change, batched per process."""

    load_interval_ms: PositiveFloat = 50.0
    """Wall ms: at most one load report per connection this often while engines change."""
    heartbeat_ms: PositiveFloat = 500.0
    """Wall ms: a frame on every feed connection at least this often (the router's liveness check)."""
    per_actor: bool = True
    """One connection per actor and router carrying all its engines; False: one per engine (the old layout)."""
    only_changes: bool = True
    """Send an engine's load only when it changed; False: every heartbeat carries every engine's load
    (with ``heartbeat_ms`` 50 and ``per_actor`` off, the old behaviour, kept as a benchmark baseline)."""


class ClusterSpec(Frozen):
    """A whole emulated fleet. Cross-field rules are checked here, each reported with its field path."""

    name: Name
    description: str = ""
    time_scale: PositiveFloat = 1.0
    """Wall seconds per emulated second (0.2 runs five times faster than real time)."""
    gpus_per_actor: PositiveInt | None = None
    """Emulated GPUs hosted by one Ray actor (process); None (the default): one actor per emulated node, split
    further while the host has more cores than actors (``cluster.launch.pack_engines``)."""
    engine_server: Literal["shared", "per_engine"] = "shared"
    """``shared``: one HTTP server per actor, engines addressed by path (``/e/<engine>``); ``per_engine``:
    a server and port per engine (the old layout, a benchmark baseline)."""
    stream_interval: PositiveInt = 1
    """Tokens per SSE event after the first, as vLLM's ``--stream-interval``: fewer events per token for
    less CPU per token; 1 (the default) sends every token at once so per-token ITL stays exact."""
    engine_clock: Literal["thread", "spin", "timer", "timerfd"] = "thread"
    """How an actor's engines wake at their step deadlines (``actors.clock``): ``thread`` (one helper thread
    sleeps precisely off the loop), ``spin`` (the loop polls the last millisecond: least lag, most CPU),
    ``timer`` (the loop's own timers alone: least CPU, up to ~1 ms late), ``timerfd`` (Linux: the loop wakes on
    a timerfd armed at the deadline: one wake-up, no thread; Mooncake 60 s on 8 GPUs, one locked run: step-lag
    p99 16.4 -> 15.0 ms, the engines' wait for a core 16.6 -> 9.4 s: not enough yet to change the default)."""
    engine_nice: int = Field(default=-5, ge=-20, le=19)
    """Niceness of the actors hosting engines where the host lets a process lower it (root or CAP_SYS_NICE),
    else 0 (``actors.worker.restore_priority``). Below 0 an emulated GPU, which stands for hardware of its own,
    takes a core ahead of the router and the load generator on a host they share, so its steps end on time;
    their own delays still show, in TTFT and the load test's send lag. Measured (``bench/density.py``, Mooncake
    60 s on 8 GPUs at scale 1, a loaded 2-core host, two runs): step-lag p99 13.5 / 12.7 ms at 0, 7.8 / 8.1 ms
    at -5, TTFT p50 within run-to-run noise. (A short EEVDF scheduler slice for the engine threads, tried
    alongside, did not help: 15.5 ms.)"""
    engine_realtime: bool = False
    """Run the engine processes' threads under the round-robin real-time policy (``SCHED_RR``, priority 1) where
    the host allows it (root or CAP_SYS_NICE; else unchanged): a step that comes due preempts the router and the
    load generator at once instead of waiting for the fair scheduler to pick it. The kernel's real-time
    throttling (95% of the CPU by default) keeps the host usable when the engines saturate it. Off by default:
    it moves the wait for a core from the engines to the load generator. Measured (``bench/density.py``
    variant ``new_rt_timerfd``, Mooncake 60 s on 8 GPUs at scale 1, 2-core host, two locked runs against the
    default in the same run): step-lag p99 16.4 / 17.9 ms -> 1.2 / 2.5 ms, the engines' wait for a core
    16.6 / 14.2 s -> 0.3 / 0.4 s, but the generator's send lag p99 13.6 -> 24.2 ms and TTFT p50 290 -> 319 ms
    in the second run (a real-time engine admitting a long prompt holds its core through the loop yields that
    let other work run)."""
    seed: int = 0
    regions: list[RegionSpec] = Field(default_factory=lambda: [RegionSpec(name="local")], min_length=1)
    wan: list[WanLinkSpec] = Field(default_factory=list)
    nodes: list[NodeSpec] = Field(min_length=1)
    router: RouterSpec = RouterSpec()
    transport: TransportSpec = TransportSpec()
    disagg: DisaggSpec = DisaggSpec()
    feed: FeedSpec = FeedSpec()
    placement: PlacementSpec = PlacementSpec()
    kv_store: KVStoreSpec | None = None
    """A shared KV store per region (``actors.kvstore``), below every engine's tiers; None: no store."""
    manifest: ManifestSpec | None = None
    """The DR manifest (``config.manifest``): an engine starts only where its model's three files are."""

    @property
    def disaggregated(self) -> bool:
        """Whether the cluster has prefill and decode engines."""
        roles = {g.role for n in self.nodes for g in n.engines}
        return {"prefill", "decode"} <= roles

    @model_validator(mode="after")
    def _cross_checks(self, info: ValidationInfo) -> ClusterSpec:
        problems = cross_check(self, catalog_from_context(info.context))
        if problems:
            raise SpecProblems(problems)
        return self

    # -- views -------------------------------------------------------------------------------------
    def engines(self, catalog: Catalog | None = None) -> list[EngineInstance]:
        """Every engine replica, in spec order, with its profiles resolved."""
        cat = catalog or catalog_from_context(None)
        out: list[EngineInstance] = []
        for node in self.nodes:
            gpu_index = 0
            for group in node.engines:
                hw = cat.hardware.get(group.hardware or node.hardware)
                for r in range(group.replicas):
                    out.append(
                        EngineInstance(
                            name=f"{group.name}-{r}" if group.replicas > 1 else group.name,
                            group=group,
                            node=node.name,
                            region=node.region,
                            hardware=hw,
                            model=cat.models.items.get(group.model),
                            profile=cat.profiles.items.get(group.model),
                            gpu_indices=tuple(range(gpu_index, gpu_index + group.tp)),
                        )
                    )
                    gpu_index += group.tp
        return out

    def rtt_ms(self, a: str, b: str) -> float:
        if a == b:
            return 0.0
        for w in self.wan:
            if {w.a, w.b} == {a, b}:
                return w.rtt_ms
        return DEFAULT_RTT_MS[frozenset({a, b})]

    def wan_link(self, a: str, b: str) -> LinkProfile:
        """The emulated WAN between two regions: half the round-trip each way."""
        bw = DEFAULT_WAN_GBPS
        for w in self.wan:
            if {w.a, w.b} == {a, b}:
                bw = w.bandwidth_gbps
        return LinkProfile(
            name=f"wan-{min(a, b)}-{max(a, b)}", source="cluster topology", kind="wan",
            bandwidth_gbps=bw, latency_us=self.rtt_ms(a, b) * 1000.0 / 2.0,
        )


@dataclass(frozen=True)
class EngineInstance:
    name: str
    group: EngineGroupSpec
    node: str
    region: str
    hardware: HardwareProfile
    model: ModelProfile | None
    profile: EmpiricalProfile | None
    gpu_indices: tuple[int, ...]

    @property
    def role(self) -> str:
        return self.group.role

    @property
    def tp(self) -> int:
        return self.group.tp


def cross_check(spec: ClusterSpec, cat: Catalog) -> list[tuple[str, str]]:
    """Rules that span fields: references resolve, names are unique, GPUs and memory suffice."""
    problems: list[tuple[str, str]] = []
    if 2 * spec.feed.heartbeat_ms > 1000.0 * spec.router.health_timeout_s:
        problems.append(("feed.heartbeat_ms", f"{spec.feed.heartbeat_ms:g} ms beats too seldom for the router's "
                                              f"health_timeout_s {spec.router.health_timeout_s:g} s (at most half)"))
    region_names = [r.name for r in spec.regions]
    for name, n in Counter(region_names).items():
        if n > 1:
            problems.append(("regions", f"duplicate region name {name!r}"))
    for name, n in Counter(node.name for node in spec.nodes).items():
        if n > 1:
            problems.append(("nodes", f"duplicate node name {name!r}"))
    group_names = Counter(g.name for node in spec.nodes for g in node.engines)
    for name, n in group_names.items():
        if n > 1:
            problems.append(("nodes", f"duplicate engine group name {name!r} (names are cluster-wide)"))

    used_regions: set[str] = set()
    for i, node in enumerate(spec.nodes):
        at = f"nodes[{i}]"
        if node.region not in region_names:
            problems.append((f"{at}.region", f"region {node.region!r} is not declared in 'regions' "
                                             f"(declared: {', '.join(region_names)})"))
        used_regions.add(node.region)
        if node.hardware not in cat.hardware:
            problems.append((f"{at}.hardware", f"unknown hardware {node.hardware!r} "
                                               f"(known: {', '.join(cat.hardware.names())})"))
            continue
        node_hw = cat.hardware.get(node.hardware)
        gpus = node.gpus or node_hw.gpus_per_node
        nic = node.nic or spec.transport.intra_region_link
        if nic not in cat.links:
            problems.append((f"{at}.nic" if node.nic else "transport.intra_region_link",
                             f"unknown link {nic!r} (known: {', '.join(cat.links.names())})"))
        used = 0
        for j, g in enumerate(node.engines):
            gat = f"{at}.engines[{j}]"
            if not cat.has_model(g.model):
                problems.append((f"{gat}.model", f"unknown model {g.model!r} (known models: "
                                                 f"{', '.join(cat.models.names())}; empirical profiles: "
                                                 f"{', '.join(cat.profiles.names())})"))
            hw_name = g.hardware or node.hardware
            if hw_name not in cat.hardware:
                problems.append((f"{gat}.hardware", f"unknown hardware {hw_name!r}"))
                continue
            if g.tp > gpus:
                problems.append((f"{gat}.tp", f"TP degree {g.tp} is larger than node {node.name!r} "
                                              f"({gpus} GPUs)"))
            used += g.tp * g.replicas
            if g.model in cat.models and g.scheduler.num_gpu_blocks is None:
                problems.extend(_memory_problems(gat, cat.models.get(g.model), cat.hardware.get(hw_name), g))
        if used > gpus:
            problems.append((f"{at}.engines", f"engines need {used} GPUs but node {node.name!r} has {gpus}"))

    roles = {g.role for n in spec.nodes for g in n.engines}
    if "prefill" in roles and "decode" not in roles:
        problems.append(("nodes", "prefill engines need at least one decode engine to hand their KV to"))
    for name in region_names:
        if name not in used_regions:
            problems.append(("regions", f"region {name!r} has no node"))
    for k, w in enumerate(spec.wan):
        for side in ("a", "b"):
            r = getattr(w, side)
            if r not in region_names:
                problems.append((f"wan[{k}].{side}", f"region {r!r} is not declared in 'regions'"))
    declared_pairs = {frozenset({w.a, w.b}) for w in spec.wan}
    for a, b in combinations(sorted(used_regions & set(region_names)), 2):
        pair = frozenset({a, b})
        if pair not in declared_pairs and pair not in DEFAULT_RTT_MS:
            problems.append(("wan", f"no round-trip time for regions {a!r} and {b!r}: add a 'wan' entry"))
    if spec.router.region is not None and spec.router.region not in used_regions:
        problems.append(("router.region", f"region {spec.router.region!r} has no node"))
    problems.extend(_placement_problems(spec))
    return problems


def _placement_problems(spec: ClusterSpec) -> list[tuple[str, str]]:
    """Hosts are unique, every node names a declared host (never placed by luck), regions agree."""
    pl = spec.placement
    problems: list[tuple[str, str]] = []
    hosts = {h.name: h for h in pl.hosts}
    for name, n in Counter(h.name for h in pl.hosts).items():
        if n > 1:
            problems.append(("placement.hosts", f"duplicate host name {name!r}"))
    region_names = {r.name for r in spec.regions}
    for k, h in enumerate(pl.hosts):
        if h.region is not None and h.region not in region_names:
            problems.append((f"placement.hosts[{k}].region", f"region {h.region!r} is not declared in 'regions'"))
    for i, node in enumerate(spec.nodes):
        if node.host is None:
            if hosts:
                problems.append((f"nodes[{i}].host", f"node {node.name!r} names no host; with placement.hosts "
                                                     f"declared every node must ({', '.join(hosts)})"))
            continue
        host = hosts.get(node.host)
        if host is None:
            problems.append((f"nodes[{i}].host", f"host {node.host!r} is not declared in placement.hosts"
                                                 f" (declared: {', '.join(hosts) or 'none'})"))
        elif host.region is not None and host.region != node.region:
            problems.append((f"nodes[{i}].region", f"node {node.name!r} is in region {node.region!r} but its "
                                                   f"host {host.name!r} is in {host.region!r}"))
    if pl.router_host is not None and pl.router_host not in hosts:
        problems.append(("placement.router_host", f"host {pl.router_host!r} is not declared in placement.hosts"))
    if hosts and pl.router_host is None:
        problems.append(("placement.router_host", "with placement.hosts declared the router's host must be named"))
    return problems


def _memory_problems(at: str, model: ModelProfile, hw: HardwareProfile,
                     g: EngineGroupSpec) -> list[tuple[str, str]]:
    per_gpu_weights = model.weight_bytes / g.tp
    budget = hw.hbm_bytes * g.scheduler.gpu_memory_utilization - g.scheduler.activation_reserve_gb * 1e9
    if per_gpu_weights >= budget:
        return [(f"{at}.tp", f"{model.name} needs {per_gpu_weights / 1e9:.1f} GB of weights per GPU at TP {g.tp}, "
                             f"but {hw.name} leaves {budget / 1e9:.1f} GB (raise tp or use a larger GPU)")]
    kv_block_bytes = model.kv_bytes_per_token * g.scheduler.block_size / g.tp
    if (budget - per_gpu_weights) < kv_block_bytes:
        return [(f"{at}.scheduler", "no memory left for even one KV block")]
    return []


def load_cluster(path: Path | str, catalog: Catalog | None = None) -> ClusterSpec:
    """Load and validate a cluster spec file; a bad file raises ConfigError naming file, field, reason."""
    data = read_yaml(path)
    ctx = {"catalog": catalog} if catalog is not None else None
    return validate(ClusterSpec, data, source=str(path), context=ctx)

"""Replay measured vLLM serving runs (aiconfigurator's ``silicon_sample.csv``) on the emulator's engine.

Each vLLM row of the table is one measured benchmark: a model on ``tp_size`` GPUs of one system, a
closed loop of ``batch_size`` clients sending prompts of exactly ``isl`` tokens for exactly ``osl``
output tokens, with the mean TTFT and TPOT that the client measured. The client side (how many requests,
the warm-up, prompts repeating from aiperf's dataset, prefix caching) is the row's harness's
``cluster.benchmark_protocol.BenchmarkProtocol``; the server side, as read from aiconfigurator's generator
(github.com/ai-dynamo/aiconfigurator at 095f58a5, ``rule_plugin/benchmark/vllm.rule``): ``max-num-seqs`` =
the batch size, ``max-num-batched-tokens`` = batch size + isl + 1500, CUDA-graph capture sizes 1..batch
size (so a decode batch is never padded).

What this module assumes beyond that (the table does not say): the deployment's other settings are
vLLM's defaults (``gpu_memory_utilization`` 0.9, block size 16, async scheduling); no ramp-up; a client
sends its next request the instant its previous one ended (no client-side gap). Where the protocol has no
drawn prompts, aiperf's rounds of C requests are simulated until the loop reaches its steady state
(``SteadyState``: two consecutive complete rounds after the burst whose mean TTFT and TPOT agree within
1%); rounds not simulated take the last complete round's means. The transient after the burst lasts
several rounds (70B fp8 on 4 H200s, C 8, 8192/1024: round means 1630, 723, 619, 619 ... ms). With drawn
prompts every round is simulated (the cache's hits change from round to round), once per seed.

Not every row was made this way. The Llama-3.1-70B rows (``silicon_data_source`` ``source_file=<date>.csv``,
no vLLM version given, measured 2025-10-29) are aiconfigurator's own benchmark runs as above. The
Llama-3.1-8B-Instruct-FP8, Qwen3-32B and Qwen3-235B-A22B-FP8 rows are vLLM 0.12.0 runs from another harness
(``aic-auto-gap-analysis``) whose client and server settings the table does not give; they are replayed
with the same server settings, but their figures can contradict them: ``implied_tensor_share`` is the least share of
the GPUs' dense tensor peak a closed loop at a row's measured TTFT and TPOT needs, and the 8B-FP8 H200 rows
need a median 49% and up to 101% (2000/100 tokens, C 64, TP 1) of H200's fp8 peak, sustained, decode
steps included, which no H200 does; the 70B rows need at most 22-33%. Rows above ``IMPLAUSIBLE_SHARE`` are
counted per group (``GroupSummary.implausible``), never dropped. Their groups are reported apart, after the
primary harness's (``SiliconRow.harness``, ``OTHER_HARNESSES``); the bounds are judged on the primary groups.

Replay speed: the closed loop's long runs of pure decode steps are run at once
(``actors.engine.virtual``'s decode stretches, exact), rows run in worker processes (``jobs``).

A row runs when the presets can express it, resolved through the catalog at run time: its model (HF
id and precision, ``MODEL_NAMES`` or the derived name) and its system (``SYSTEM_PRESETS``) are presets,
its mode is aggregated, it has no data-parallel attention, and its expert parallelism (if any) can be
said in the engine spec (an ``ep`` field). A MoE row whose attention width (``tp_size x attention_dp_size``)
is not its expert width (``moe_tp_size x moe_ep_size``) does not say its deployment: aiconfigurator's own
model requires the two equal (``ModelConfig.resolve_moe_parallelism``, ``aic-core/src/aiconfigurator_core/
sdk/config.py`` at 095f58a5), so a blank ``attention_dp_size`` there stands for data-parallel attention over
the difference (``moe_width``). Such rows measured another deployment than the consistent rows of the same
engine TP: the 19 vLLM 0.12 Qwen3-235B-FP8 H200 rows with ``tp_size`` below the expert width have TTFT
2-10x the consistent rows' at like or lower load (2000/2000 tokens: C 9, tp 1, moe_tp 2, 3,225 ms; C 16,
tp 2, moe_tp 2, 418 ms), and replayed as TP = expert width their TTFT median |error| was 61% (bias -61%)
against 8% (+8%) on the 32 consistent rows. Every other row is listed as skipped, with the reason. The
engine is the emulator's own (``build_engine`` from a one-engine cluster spec, so KV capacity and cost model
are what ``up``/``loadtest`` would use), driven on virtual time by ``actors.engine.virtual``.
"""

from __future__ import annotations

import csv
import math
import os
import re
import statistics
import time
from collections import defaultdict
from collections.abc import Callable, Iterable
from concurrent.futures import ProcessPoolExecutor, as_completed
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, ValidationError, field_validator

from actors.cost_model import CostModel, RooflineCostModel
from actors.engine.factory import build_engine
from actors.engine.virtual import RunResult, VirtualDriver
from cluster.benchmark_protocol import PROTOCOLS, SteadyState, aiperf_mean
from config.catalog import Catalog
from config.cluster import ClusterSpec, EngineGroupSpec
from config.errors import ConfigError
from config.hardware import HardwareProfile
from config.model import ModelProfile

REPO_ROOT = Path(__file__).resolve().parents[1]
DEFAULT_CSV = REPO_ROOT.parent / "shared" / "calibration" / "aiconfigurator_vllm" / "silicon_sample.csv"

IMPLAUSIBLE_SHARE = 0.7
"""A row whose closed loop would need more than this share of the GPUs' dense tensor peak, sustained over
the whole run (``implied_tensor_share``), cannot have been measured as this module assumes (module doc)."""
QUICK_PER_GROUP = 5
PRIMARY_HARNESS = "aiconfigurator"
"""Rows made by aiconfigurator's own benchmark (the protocol above): the groups the bounds are judged on."""
OTHER_HARNESSES: dict[str, str] = {"0.12.0": "vllm-0.12-gap-analysis"}
"""``backend_version`` -> harness for rows from another benchmark (module docstring): reported apart."""
BATCHED_TOKENS_SLACK = 1500
"""aiconfigurator's vLLM benchmark rule: max_num_batched_tokens = batch size + isl + 1500."""

SYSTEM_PRESETS: dict[str, str] = {
    "a100_sxm": "a100-80g-sxm",
    "h100_sxm": "h100-80g-sxm",
    "h200_sxm": "h200-141g-sxm",
    "b200_sxm": "b200-180g-sxm",
    "b300_sxm": "b300-288g-sxm",
    "l40s": "l40s-48g",
}
"""aiconfigurator's system names -> hardware preset names (a preset missing from the catalog skips)."""

MODEL_NAMES: dict[tuple[str, str], str] = {
    # aiconfigurator's fp8 runs of the bf16 checkpoint also ran an fp8 KV cache: at 1024/8192 tokens and C 32
    # the H100 TP2, H200 TP1 and B200 TP1 rows show no queueing (TTFT 289, 474, 161-243 ms), which a bf16
    # cache (245k, 195k, 310k tokens for the 295k that C 32 x 9,216 needs) could not give, and at C 64
    # (590k) H100 TP2 and H200 TP1 queue (TTFT 30.8 s, 5.3 s) where an fp8 cache (490k, 390k) overflows
    # while B200 TP1 (620k) does not (382 ms). With the bf16 preset those rows preempted thousands of times.
    ("meta-llama/Llama-3.1-70B", "fp8"): "llama-3.1-70b-fp8-kv8",
}
"""(HF id, precision) -> model preset, where the derived name (``derived_model_name``) is wrong."""

PRECISION_SUFFIX: dict[str, str] = {"": "", "bf16": "", "fp16": "", "fp8": "-fp8", "fp4": "-fp4",
                                    "int4": "-int4"}


class SiliconRow(BaseModel):
    """One measured serving run (the columns this module reads)."""

    model_config = ConfigDict(extra="ignore", frozen=True)

    id: str
    backend: str
    backend_version: str = ""
    model_path: str
    system: str
    precision: str = ""
    mode: str
    isl: int
    osl: int
    batch_size: int | None = None
    """The concurrency of an aggregated run (blank in disaggregated rows, which say it per role)."""
    tp_size: int | None = None
    attention_dp_size: int | None = None
    moe_tp_size: int | None = None
    moe_ep_size: int | None = None
    silicon_ttft_ms: float
    silicon_tpot_ms: float

    @field_validator("batch_size", "tp_size", "attention_dp_size", "moe_tp_size", "moe_ep_size", mode="before")
    @classmethod
    def _blank_is_none(cls, v: Any) -> Any:
        return None if v == "" else v

    @field_validator("isl", "osl", "batch_size", "tp_size")
    @classmethod
    def _positive(cls, v: int | None) -> int | None:
        if v is not None and v < 1:
            raise ValueError("must be at least 1")
        return v

    @property
    def harness(self) -> str:
        """Which benchmark made the row: ``PRIMARY_HARNESS`` or one of ``OTHER_HARNESSES``."""
        return OTHER_HARNESSES.get(self.backend_version, PRIMARY_HARNESS)

    @property
    def group(self) -> tuple[str, str]:
        """(model with precision, system): the unit errors are summarized over."""
        return (f"{self.model_path} {self.precision or 'bf16'}", self.system)


def read_rows(path: Path, backend: str = "vllm") -> list[SiliconRow]:
    """The rows of ``backend``; a bad row raises ConfigError naming its line and column."""
    rows: list[SiliconRow] = []
    problems: list[tuple[str, str]] = []
    with path.open(newline="") as f:
        reader = csv.DictReader(f)
        missing = set(SiliconRow.model_fields) - set(reader.fieldnames or ())
        missing -= {k for k, v in SiliconRow.model_fields.items() if not v.is_required()}
        if missing:
            raise ConfigError(str(path), [("header", f"missing column(s): {', '.join(sorted(missing))}")])
        for line, raw in enumerate(reader, start=2):
            if raw.get("backend") != backend:
                continue
            try:
                rows.append(SiliconRow.model_validate(raw))
            except ValidationError as err:
                for e in err.errors():
                    col = ".".join(str(p) for p in e["loc"])
                    problems.append((f"line {line}, column {col}", e["msg"]))
    if problems:
        raise ConfigError(str(path), problems)
    return rows


def derived_model_name(row: SiliconRow) -> str:
    """``Qwen/Qwen3-32B`` at fp8 -> ``qwen3-32b-fp8`` (``-instruct`` dropped), unless ``MODEL_NAMES`` says."""
    explicit = MODEL_NAMES.get((row.model_path, row.precision))
    if explicit is not None:
        return explicit
    base = row.model_path.rsplit("/", 1)[-1].lower().replace("-instruct", "")
    suffix = PRECISION_SUFFIX.get(row.precision.lower(), f"-{row.precision.lower()}")
    return base if not suffix or base.endswith(suffix) else base + suffix


@dataclass(frozen=True)
class Case:
    """A row the presets express, with the one-engine cluster that replays it."""

    row: SiliconRow
    model: str
    hardware: str
    concurrency: int
    tp: int
    spec: ClusterSpec
    implied_share: float = 0.0
    """``implied_tensor_share`` of the row: above ``IMPLAUSIBLE_SHARE``, its measured figures contradict
    the protocol assumed here."""

    @property
    def implausible(self) -> bool:
        return self.implied_share > IMPLAUSIBLE_SHARE


def implied_tensor_share(row: SiliconRow, model: ModelProfile, hardware: HardwareProfile, tp: int) -> float:
    """The least share of the GPUs' dense tensor peak a closed loop at the row's measured figures needs.

    In a closed loop each of C clients completes one request per cycle of ``TTFT + (osl - 1) x TPOT``
    (the measured means); each request costs at least its GEMM FLOPs (2 x active parameters without the
    embedding, per prompt and output token, at the GEMM dtype's peak) and its causal attention (at the
    16-bit peak). A value near or above 1 says the row was not measured as assumed (fewer clients really
    busy, shared prefixes hit in the cache, other lengths): no cost model can be right on it.
    """
    gemm = 2.0 * (model.active_params_b * 1e9 - model.vocab_size * model.hidden_size) * (row.isl + row.osl - 1)
    pairs = row.isl * (row.isl + 1) / 2.0 + (row.osl - 1) * (row.isl + row.osl / 2.0)
    attention = model.attention_flops_per_token_per_context * pairs
    seconds = gemm / (hardware.tflops(model.gemm_dtype) * 1e12) + attention / (hardware.tflops("bf16") * 1e12)
    assert row.batch_size is not None
    cycle_s = (row.silicon_ttft_ms + (row.osl - 1) * row.silicon_tpot_ms) / 1e3
    return row.batch_size * seconds / (cycle_s * tp) if cycle_s > 0 else math.inf


@dataclass(frozen=True)
class Skip:
    row: SiliconRow
    reason: str


def cluster_for(row: SiliconRow, model: str, hardware: str, concurrency: int, tp: int,
                catalog: Catalog) -> ClusterSpec:
    """One engine on ``tp_size`` GPUs, configured as aiconfigurator's benchmark deployment (module doc)."""
    data = {
        "name": "validate",
        "nodes": [{"name": "node0", "region": "local", "hardware": hardware, "gpus": tp,
                   "engines": [{"name": "engine", "model": model, "tp": tp, **_ep(row), "scheduler": {
                       "max_num_seqs": concurrency,
                       "max_num_batched_tokens": concurrency + row.isl + BATCHED_TOKENS_SLACK,
                       "enable_prefix_caching": PROTOCOLS[row.harness].prefix_caching,
                       "async_scheduling": PROTOCOLS[row.harness].async_scheduling,
                   }}]}],
    }
    return ClusterSpec.model_validate(data, context={"catalog": catalog})


def moe_width(row: SiliconRow, model: ModelProfile) -> int | None:
    """GPUs a MoE row's experts span, ``moe_tp_size x moe_ep_size``; None for a dense model or a row that gives
    neither. ``resolve`` replays a MoE row only where this equals its attention width (module docstring)."""
    if model.moe is None or not (row.moe_tp_size or row.moe_ep_size):
        return None
    return (row.moe_tp_size or 1) * (row.moe_ep_size or 1)


def engine_tp(row: SiliconRow, moe: bool) -> int:
    """vLLM's tensor-parallel size for the row: ``tp_size``, except for MoE models, where vLLM runs one
    TP for attention and experts, ``moe_tp x moe_ep / dp`` (aiconfigurator's ``rule_plugin/vllm.rule``, from
    2026-04-14 on). On the rows ``resolve`` replays this is ``tp_size`` too: a MoE row whose attention and expert
    widths differ is skipped (``moe_width``)."""
    assert row.tp_size is not None
    if not moe or not row.moe_tp_size:
        return row.tp_size
    return max(1, row.moe_tp_size * (row.moe_ep_size or 1) // (row.attention_dp_size or 1))


def _ep(row: SiliconRow) -> dict[str, int]:
    """The row's expert parallelism, for an engine spec that can say it (``ep``)."""
    ep = row.moe_ep_size or 1
    return {"ep": ep} if ep > 1 and "ep" in EngineGroupSpec.model_fields else {}


def resolve(rows: Iterable[SiliconRow], catalog: Catalog) -> tuple[list[Case], list[Skip]]:
    """Split rows into those the presets express and those skipped, each skip with its reason."""
    cases: list[Case] = []
    skips: list[Skip] = []
    for row in rows:
        model = derived_model_name(row)
        hardware = SYSTEM_PRESETS.get(row.system)
        reason = None
        if row.mode != "agg":
            reason = f"mode {row.mode!r}: only aggregated runs are replayed"
        elif row.batch_size is None or row.tp_size is None:
            reason = "no batch_size or tp_size"
        elif hardware is None:
            reason = f"system {row.system!r} has no hardware preset mapping"
        elif hardware not in catalog.hardware:
            reason = f"no hardware preset {hardware!r} in the catalog"
        elif model not in catalog.models:
            reason = f"no model preset {model!r} in the catalog"
        elif (row.attention_dp_size or 1) > 1:
            reason = f"data-parallel attention (dp {row.attention_dp_size}) is not replayed"
        elif (width := moe_width(row, catalog.models.get(model))) not in (None, row.tp_size):
            reason = (f"MoE width {width} (moe_tp {row.moe_tp_size or 1} x moe_ep {row.moe_ep_size or 1}) is not the "
                      f"attention width {row.tp_size} (tp x attention dp): data-parallel attention is implied "
                      f"(aiconfigurator's ModelConfig.resolve_moe_parallelism) and not replayed")
        elif (row.moe_ep_size or 1) > 1 and "ep" not in EngineGroupSpec.model_fields:
            reason = f"expert parallelism (ep {row.moe_ep_size}): engine specs have no 'ep' field yet"
        if reason is not None:
            skips.append(Skip(row, reason))
            continue
        assert hardware is not None and row.batch_size is not None and row.tp_size is not None
        tp = engine_tp(row, catalog.models.get(model).moe is not None)
        try:
            spec = cluster_for(row, model, hardware, row.batch_size, tp, catalog)
        except (ConfigError, ValidationError, ValueError) as err:
            first = str(err).strip().splitlines()[-1].strip()
            skips.append(Skip(row, f"the presets reject it: {first}"))
            continue
        share = implied_tensor_share(row, catalog.models.get(model), catalog.hardware.get(hardware), tp)
        cases.append(Case(row, model, hardware, row.batch_size, tp, spec, share))
    return cases, skips


def sample(cases: list[Case], per_group: int = QUICK_PER_GROUP) -> list[Case]:
    """A few rows per group, spread over the group's (concurrency, isl, osl) order; deterministic.

    Among rows of equal rank the cheapest to simulate is kept (fewest decode steps x clients).
    """
    by_group: dict[tuple[str, str], list[Case]] = defaultdict(list)
    for c in cases:
        by_group[c.row.group].append(c)
    out: list[Case] = []
    for group in sorted(by_group):
        members = sorted(by_group[group], key=lambda c: (c.row.osl, c.concurrency, c.row.isl, c.tp))
        if len(members) <= per_group:
            out.extend(members)
            continue
        cheap = members[: max(per_group, len(members) // 2)]  # the cheaper half, spread over it
        step = (len(cheap) - 1) / max(1, per_group - 1)
        out.extend(cheap[round(i * step)] for i in range(per_group))
    return out


@dataclass(frozen=True)
class CaseResult:
    case: Case
    ttft_ms: float
    tpot_ms: float
    ttft_queue_ms: float
    """TTFT's part spent before the request was first scheduled (same weighting as ``ttft_ms``)."""
    steps: int
    preemptions: int
    num_blocks: int
    cost_model: str
    wall_s: float

    @property
    def ttft_error(self) -> float:
        return self.ttft_ms / self.case.row.silicon_ttft_ms - 1.0

    @property
    def tpot_error(self) -> float:
        return self.tpot_ms / self.case.row.silicon_tpot_ms - 1.0


def with_benchmark_graphs(cost: CostModel, concurrency: int) -> CostModel:
    """The benchmark server's CUDA graphs: ``cudagraph_capture_sizes`` 1..C (module docstring), so a decode
    batch is never padded and any step above C tokens runs eagerly. Only a roofline model has graphs."""
    if isinstance(cost, RooflineCostModel) and cost.capture:
        cost.capture = tuple(range(1, concurrency + 1))
    return cost


def run_case(case: Case, rounds: int | None = None, catalog: Catalog | None = None) -> CaseResult:
    """Replay ``case`` under its harness's protocol, once per seed; the figures are the mean over seeds."""
    protocol = PROTOCOLS[case.row.harness]
    n_rounds = rounds or protocol.rounds
    inst = case.spec.engines(catalog)[0]
    row = case.row
    ttft: list[float] = []
    tpot: list[float] = []
    queue: list[float] = []
    steps = preemptions = 0
    num_blocks = 0
    name = ""
    t0 = time.perf_counter()
    for seed in protocol.seeds:
        cfg, cost = build_engine(inst)
        cost = with_benchmark_graphs(cost, case.concurrency)
        num_blocks, name = cfg.num_blocks, cost.name
        load = protocol.load(case.concurrency, row.isl, row.osl, seed, n_rounds)
        enough = SteadyState(case.concurrency) if protocol.steady_state else None
        result: RunResult = VirtualDriver(cfg, cost).run(load, enough)
        recs = result.records
        ttft.append(aiperf_mean([r.ttft_ms for r in recs], case.concurrency, n_rounds))
        tpot.append(aiperf_mean([r.tpot_ms for r in recs], case.concurrency, n_rounds))
        queue.append(aiperf_mean([r.queue_ms for r in recs], case.concurrency, n_rounds))
        steps += result.steps
        preemptions += result.preemptions
    return CaseResult(case, statistics.fmean(ttft), statistics.fmean(tpot), statistics.fmean(queue), steps,
                      preemptions, num_blocks, name, time.perf_counter() - t0)


def _p(values: list[float], q: float) -> float:
    """Percentile with linear interpolation (numpy's default)."""
    data = sorted(values)
    if len(data) == 1:
        return data[0]
    k = (len(data) - 1) * q / 100.0
    lo = int(k)
    hi = min(lo + 1, len(data) - 1)
    return data[lo] + (data[hi] - data[lo]) * (k - lo)


@dataclass(frozen=True)
class GroupSummary:
    model: str
    system: str
    rows: int
    ttft_median: float
    ttft_p90: float
    tpot_median: float
    tpot_p90: float
    ttft_bias: float
    tpot_bias: float
    """Median signed error: positive when the emulator is slower than the measurement."""
    versions: str = ""
    """The vLLM versions the group's rows were measured with (blank: the table does not say)."""
    implausible: int = 0
    """Rows whose measured figures need more than ``IMPLAUSIBLE_SHARE`` of the tensor peak (``Case``)."""
    implied_share_median: float = 0.0
    harness: str = PRIMARY_HARNESS
    """The benchmark that made the group's rows (``SiliconRow.harness``)."""

    @property
    def primary(self) -> bool:
        return self.harness == PRIMARY_HARNESS

    def within(self, ttft_bound: float, tpot_bound: float) -> bool:
        return self.ttft_median <= ttft_bound and self.tpot_median <= tpot_bound


def summarize(results: list[CaseResult]) -> list[GroupSummary]:
    """Error per (harness, model, GPU) group: the primary harness's groups first, then the others'."""
    by_group: dict[tuple[bool, str, str, str], list[CaseResult]] = defaultdict(list)
    for r in results:
        row = r.case.row
        by_group[(row.harness != PRIMARY_HARNESS, row.harness, *row.group)].append(r)
    out = []
    for (_, harness, model, system), rs in sorted(by_group.items()):
        te = [abs(r.ttft_error) for r in rs]
        pe = [abs(r.tpot_error) for r in rs]
        versions = ", ".join(sorted({r.case.row.backend_version or "?" for r in rs}))
        out.append(GroupSummary(model, system, len(rs), _p(te, 50), _p(te, 90), _p(pe, 50), _p(pe, 90),
                                _p([r.ttft_error for r in rs], 50), _p([r.tpot_error for r in rs], 50),
                                versions, sum(r.case.implausible for r in rs),
                                _p([r.case.implied_share for r in rs], 50), harness))
    return out


@dataclass
class Validation:
    results: list[CaseResult] = field(default_factory=list)
    skipped: list[Skip] = field(default_factory=list)
    wall_s: float = 0.0

    @property
    def groups(self) -> list[GroupSummary]:
        return summarize(self.results)


_WORKER_CATALOG: Catalog | None = None


def _init_worker(catalog: Catalog) -> None:
    global _WORKER_CATALOG
    _WORKER_CATALOG = catalog


def _run_in_worker(index: int, case: Case, rounds: int | None) -> tuple[int, CaseResult]:
    return index, run_case(case, rounds, _WORKER_CATALOG)


def default_jobs() -> int:
    """Worker processes: one per core this process may use."""
    return max(1, len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1)


def _work(case: Case) -> int:
    """A row's simulation cost, to start the longest first: decode tokens of a round."""
    return case.concurrency * case.row.osl


def validate(path: Path, catalog: Catalog, *, quick: bool = False, rounds: int | None = None,
             per_group: int = QUICK_PER_GROUP, match: str | None = None,
             progress: Callable[[CaseResult], None] | None = None, jobs: int = 1) -> Validation:
    """Replay every row the presets express (a sample of each group with ``quick``).

    ``match``: a regular expression; only rows whose id, model or system it finds are read. ``jobs`` > 1
    runs rows in that many worker processes (each row is independent and deterministic, so the figures
    are the same; the longest rows start first); results come back in the table's order either way.
    """
    t0 = time.perf_counter()
    rows = read_rows(path)
    if match is not None:
        pattern = re.compile(match)
        rows = [r for r in rows if pattern.search(f"{r.id} {r.model_path} {r.system}")]
    cases, skips = resolve(rows, catalog)
    if quick:
        cases = sample(cases, per_group)
    n_rounds = rounds
    out = Validation(skipped=skips)
    if jobs <= 1 or len(cases) <= 1:
        for case in cases:
            res = run_case(case, n_rounds, catalog)
            out.results.append(res)
            if progress is not None:
                progress(res)
    else:
        done: dict[int, CaseResult] = {}
        order = sorted(range(len(cases)), key=lambda i: -_work(cases[i]))
        with ProcessPoolExecutor(min(jobs, len(cases)), initializer=_init_worker, initargs=(catalog,)) as pool:
            futures = [pool.submit(_run_in_worker, i, cases[i], n_rounds) for i in order]
            for fut in as_completed(futures):
                i, res = fut.result()
                done[i] = res
                if progress is not None:
                    progress(res)
        out.results = [done[i] for i in range(len(cases))]
    out.wall_s = time.perf_counter() - t0
    return out

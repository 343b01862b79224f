"""``validate``: reading the measured-runs table, resolving rows to presets, replaying them on virtual time."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from actors.cost_model import RooflineCostModel
from actors.engine.client_workers import ClientWorkers
from actors.engine.engine import EngineConfig
from actors.engine.factory import build_engine
from actors.engine.scheduler import SchedulerLimits
from actors.engine.virtual import ClosedLoop, RequestRecord, VirtualDriver
from cluster.benchmark_protocol import AIC_EVAL_2025, PROTOCOLS, BenchmarkProtocol, SteadyState, aiperf_mean
from cluster.validation import (
    SiliconRow,
    derived_model_name,
    engine_tp,
    read_rows,
    resolve,
    sample,
    validate,
    with_benchmark_graphs,
)
from config.catalog import default_catalog
from config.cluster import EngineGroupSpec
from config.errors import ConfigError
from run_cluster import main

HEADER = ("id,backend,backend_version,model_path,system,precision,mode,isl,osl,batch_size,tp_size,"
          "attention_dp_size,moe_tp_size,moe_ep_size,silicon_ttft_ms,silicon_tpot_ms\n")


def write_csv(path: Path, rows: list[str]) -> Path:
    path.write_text(HEADER + "".join(r + "\n" for r in rows))
    return path


ROWS = [
    "a,vllm,0.19.0,meta-llama/Llama-3.1-70B,h200_sxm,fp8,agg,256,16,4,2,1,2,1,100.0,20.0",
    "b,vllm,0.19.0,meta-llama/Llama-3.1-70B,h200_sxm,fp8,agg,512,8,2,4,1,4,1,80.0,15.0",
    "c,vllm,0.12.0,Qwen/Qwen3-32B,h100_sxm,,agg,128,8,2,2,,1,1,50.0,12.0",
    "d,vllm,0.19.0,Some/Unknown-Model,h100_sxm,fp8,agg,128,8,2,2,,1,1,50.0,12.0",
    "e,vllm,0.19.0,Qwen/Qwen3-32B,tpu_v9,,agg,128,8,2,2,,1,1,50.0,12.0",
    "f,vllm,0.12.0,Qwen/Qwen3-32B,h100_sxm,fp8,disagg,128,8,,,,,,50.0,12.0",
    "g,sglang,0.5,Qwen/Qwen3-32B,h100_sxm,,agg,128,8,2,2,,1,1,50.0,12.0",
]


def test_rows_resolve_to_presets_or_are_skipped_with_a_reason(tmp_path: Path) -> None:
    rows = read_rows(write_csv(tmp_path / "s.csv", ROWS))
    assert [r.id for r in rows] == ["a", "b", "c", "d", "e", "f"]  # other backends are not read
    cases, skips = resolve(rows, default_catalog())
    assert [(c.row.id, c.model, c.hardware, c.tp, c.concurrency) for c in cases] == [
        ("a", "llama-3.1-70b-fp8-kv8", "h200-141g-sxm", 2, 4),
        ("b", "llama-3.1-70b-fp8-kv8", "h200-141g-sxm", 4, 2),
        ("c", "qwen3-32b", "h100-80g-sxm", 2, 2),
    ]
    reasons = {s.row.id: s.reason for s in skips}
    assert "no model preset 'unknown-model-fp8'" in reasons["d"]
    assert "'tpu_v9' has no hardware preset" in reasons["e"]
    assert "only aggregated runs" in reasons["f"]
    sched = cases[0].spec.nodes[0].engines[0].scheduler
    assert sched.max_num_seqs == 4 and sched.max_num_batched_tokens == 4 + 256 + 1500
    # aiconfigurator's deployments kept vLLM's default prefix caching and (vLLM 0.11) synchronous scheduling;
    # the 0.12 harness's replay runs without the cache, with async scheduling.
    assert sched.enable_prefix_caching and not sched.async_scheduling
    assert cases[2].spec.nodes[0].engines[0].scheduler.async_scheduling
    assert not cases[2].spec.nodes[0].engines[0].scheduler.enable_prefix_caching


def test_expert_parallel_rows_run_only_where_the_spec_can_say_ep(tmp_path: Path) -> None:
    row = "h,vllm,0.19.0,meta-llama/Llama-3.1-70B,h200_sxm,fp8,agg,128,8,2,2,1,1,2,50.0,12.0"
    cases, skips = resolve(read_rows(write_csv(tmp_path / "s.csv", [row])), default_catalog())
    if "ep" in EngineGroupSpec.model_fields:
        assert cases[0].spec.nodes[0].engines[0].model_dump()["ep"] == 2
    else:
        assert not cases and "expert parallelism (ep 2)" in skips[0].reason


def test_moe_rows_run_only_where_attention_and_expert_widths_agree(tmp_path: Path) -> None:
    # m1/m2: tp_size below moe_tp x moe_ep with a blank attention_dp_size, which aiconfigurator's own model
    # rejects (tp x attention dp must equal moe_tp x moe_ep): data-parallel attention, skipped. A dense row's
    # moe columns say nothing (d1).
    rows = ["m1,vllm,0.19.0,Qwen/Qwen3-30B-A3B,h200_sxm,,agg,128,8,2,1,,2,1,50.0,12.0",
            "m2,vllm,0.19.0,Qwen/Qwen3-30B-A3B,h200_sxm,,agg,128,8,2,2,,4,1,50.0,12.0",
            "m3,vllm,0.19.0,Qwen/Qwen3-30B-A3B,h200_sxm,,agg,128,8,2,2,,2,1,50.0,12.0",
            "d1,vllm,0.19.0,Qwen/Qwen3-32B,h200_sxm,,agg,128,8,2,2,,1,1,50.0,12.0"]
    cases, skips = resolve(read_rows(write_csv(tmp_path / "s.csv", rows)), default_catalog())
    assert [(c.row.id, c.tp) for c in cases] == [("m3", 2), ("d1", 2)]
    reasons = {s.row.id: s.reason for s in skips}
    assert reasons.keys() == {"m1", "m2"}
    assert "MoE width 2" in reasons["m1"] and "attention width 1" in reasons["m1"]
    assert "MoE width 4" in reasons["m2"] and "data-parallel attention" in reasons["m2"]
    assert engine_tp(skips[0].row, moe=True) == 2 and engine_tp(skips[0].row, moe=False) == 1


def test_derived_model_names() -> None:
    def row(path: str, precision: str) -> SiliconRow:
        return SiliconRow(id="x", backend="vllm", model_path=path, system="h100_sxm", precision=precision,
                          mode="agg", isl=1, osl=1, silicon_ttft_ms=1, silicon_tpot_ms=1)

    assert derived_model_name(row("nvidia/Llama-3.1-8B-Instruct-FP8", "fp8")) == "llama-3.1-8b-fp8"
    assert derived_model_name(row("Qwen/Qwen3-32B", "")) == "qwen3-32b"
    assert derived_model_name(row("meta-llama/Llama-3.1-70B", "fp4")) == "llama-3.1-70b-fp4"
    assert derived_model_name(row("meta-llama/Llama-3.1-70B", "fp8")) == "llama-3.1-70b-fp8-kv8"  # fp8 KV too


def test_a_bad_cell_is_named_by_line_and_column(tmp_path: Path) -> None:
    bad = [*ROWS[:2], "z,vllm,0.19.0,Qwen/Qwen3-32B,h100_sxm,,agg,lots,8,2,2,,1,1,50.0,12.0"]
    with pytest.raises(ConfigError) as err:
        read_rows(write_csv(tmp_path / "s.csv", bad))
    assert err.value.problems[0][0] == "line 4, column isl"
    (tmp_path / "h.csv").write_text("id,backend\nx,vllm\n")
    with pytest.raises(ConfigError, match="missing column"):
        read_rows(tmp_path / "h.csv")


def test_aiperf_mean_weighs_the_burst_as_one_round_in_twenty() -> None:
    assert aiperf_mean([10.0, 10.0, 1.0, 1.0, 1.0, 1.0], 2, 20) == pytest.approx((10 + 19 * 1) / 20)
    assert aiperf_mean([4.0, 6.0], 2, 20) == pytest.approx(5.0)


def test_aiperf_mean_fills_unsimulated_rounds_with_the_last_complete_one() -> None:
    # Rounds: burst 10, then 4, then 2; a trailing half round (99) is ignored; 17 rounds take 2.
    assert aiperf_mean([10.0, 10.0, 4.0, 4.0, 2.0, 2.0, 99.0], 2, 20) == pytest.approx((10 + 4 + 2 + 17 * 2) / 20)
    assert aiperf_mean([1.0] * 2 + [3.0] * 40, 2, rounds=20) == pytest.approx((1 + 19 * 3) / 20)


def _rec(index: int, ttft: float, tpot: float) -> RequestRecord:
    return RequestRecord(index, 0.0, 0.0, ttft, ttft + tpot * 9, 10, 0)


def test_steady_state_needs_two_matching_rounds_after_the_burst() -> None:
    done: list[RequestRecord] = []
    steady = SteadyState(2)
    rounds = [(50.0, 5.0), (20.0, 5.0), (12.0, 5.0), (12.05, 5.0)]
    answers = []
    for k, (ttft, tpot) in enumerate(rounds):
        done.append(_rec(2 * k + 1, ttft, tpot))  # out of order within the round
        answers.append(steady(done))
        done.append(_rec(2 * k, ttft, tpot))
        answers.append(steady(done))
    # Not before round 3 is complete (burst 50, then 20 vs 12 differ); then 12 vs 12.05 is within 1%.
    assert answers == [False] * 7 + [True]


def test_quick_samples_a_few_rows_per_group(tmp_path: Path) -> None:
    rows = [f"r{i},vllm,0.19.0,meta-llama/Llama-3.1-70B,h200_sxm,fp8,agg,128,{8 + i},2,2,1,2,1,1.0,1.0"
            for i in range(10)]
    cases, _ = resolve(read_rows(write_csv(tmp_path / "s.csv", rows)), default_catalog())
    picked = sample(cases, 3)
    assert len(picked) == 3 and len({c.row.id for c in picked}) == 3
    assert sample(cases, 3) == picked  # deterministic


def test_validate_replays_rows_on_the_engine(tmp_path: Path) -> None:
    res = validate(write_csv(tmp_path / "s.csv", ROWS), default_catalog(), rounds=2)
    assert [r.case.row.id for r in res.results] == ["a", "b", "c"]
    for r in res.results:
        assert r.ttft_ms > 0 and r.tpot_ms > 0 and r.steps > 0
        assert r.ttft_error == pytest.approx(r.ttft_ms / r.case.row.silicon_ttft_ms - 1)
    # More GPUs for the same model and hardware: a decode step is no slower.
    a, b = res.results[0], res.results[1]
    assert b.tpot_ms <= a.tpot_ms * 1.05
    groups = res.groups
    # The primary harness's groups first; the vLLM 0.12 gap-analysis rows apart, after them.
    assert [(g.model, g.system, g.rows, g.primary) for g in groups] == [
        ("meta-llama/Llama-3.1-70B fp8", "h200_sxm", 2, True), ("Qwen/Qwen3-32B bf16", "h100_sxm", 1, False)]
    assert groups[1].harness == "vllm-0.12-gap-analysis"


def test_cli_prints_one_json_object_last(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = write_csv(tmp_path / "s.csv", ROWS)
    assert main(["validate", "--csv", str(path), "--quick", "--rounds", "2", "--json"]) == 0
    last = capsys.readouterr().out.strip().splitlines()[-1]
    doc = json.loads(last)
    assert doc["rows_replayed"] == 3 and doc["rows_skipped"] == 3
    assert {g["gpu"] for g in doc["groups"]} == {"h100_sxm", "h200_sxm"}
    assert {"ttft_median_ape", "ttft_p90_ape", "tpot_median_ape", "tpot_p90_ape"} <= set(doc["groups"][0])
    assert {s["id"] for s in doc["skipped"]} == {"d", "e", "f"}
    assert [g["harness"] for g in doc["groups"]] == ["aiconfigurator", "vllm-0.12-gap-analysis"]
    assert isinstance(doc["primary_within_bounds"], bool)


def test_match_keeps_only_the_rows_it_finds(tmp_path: Path) -> None:
    res = validate(write_csv(tmp_path / "s.csv", ROWS), default_catalog(), rounds=2, match="Qwen3-32B.*h100")
    assert [r.case.row.id for r in res.results] == ["c"]


def test_cli_skips_when_the_table_is_absent(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["validate", "--csv", str(tmp_path / "none.csv"), "--json"]) == 0
    doc = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert doc["skipped"] is True and "absent" in doc["reason"]


def test_rows_run_with_the_benchmarks_cuda_graph_sizes(tmp_path: Path) -> None:
    cases, _ = resolve(read_rows(write_csv(tmp_path / "s.csv", ROWS[:1])), default_catalog())
    _, cost = build_engine(cases[0].spec.engines(default_catalog())[0])
    assert isinstance(cost, RooflineCostModel)
    assert with_benchmark_graphs(cost, 5) is cost and cost.capture == (1, 2, 3, 4, 5)
    res = validate(write_csv(tmp_path / "s.csv", ROWS[:1]), default_catalog(), rounds=2)
    assert 0.0 <= res.results[0].ttft_queue_ms < res.results[0].ttft_ms


def _roofline_driver(fast: bool, blocks: int, seqs: int, budget: int, caching: bool, async_: bool,
                     ctx: int = 100_000) -> VirtualDriver:
    cat = default_catalog()
    cost = RooflineCostModel(cat.hardware.get("h200-141g-sxm"), cat.models.get("llama-3.1-70b-fp8"), 2,
                             max_num_seqs=seqs, max_num_batched_tokens=budget)
    limits = SchedulerLimits(seqs, budget, ctx, async_scheduling=async_)
    cfg = EngineConfig("v", "m", "colocated", blocks, 16, limits, enable_prefix_caching=caching)
    return VirtualDriver(cfg, cost, fast_forward=fast)


@pytest.mark.parametrize(("blocks", "seqs", "budget", "caching", "async_", "ctx", "load"), [
    (4000, 8, 600, False, True, 100_000, ClosedLoop(8, 40, 300, 57, burst_gap_ms=1.0)),
    (4000, 6, 256, True, False, 100_000, ClosedLoop(6, 24, 200, 40)),
    (60, 8, 512, True, True, 100_000, ClosedLoop(8, 24, 50, 90, burst_gap_ms=0.5)),  # KV-bound: preempts
    (4000, 16, 128, True, True, 100_000, ClosedLoop(16, 48, 300, 70)),  # chunked prefills amid decodes
    (4000, 4, 512, False, True, 100_000, ClosedLoop(8, 24, 100, 60)),  # more clients than max_num_seqs
    (70, 8, 512, False, True, 100_000, ClosedLoop(8, 32, 100, 150)),  # KV-bound: waiting head blocked, preempts
    (70, 8, 512, False, False, 100_000, ClosedLoop(8, 32, 100, 150, burst_gap_ms=0.3)),  # same, sync scheduling
    # aiperf's protocol: a warm-up, then prompts drawn from a pool and hit in the prefix cache
    (4000, 8, 600, True, True, 100_000, ClosedLoop(8, 40, 300, 57, 1.0, warmup_requests=16, prompt_pool=12,
                                                   pool_seed=3)),
    (90, 8, 512, True, True, 100_000, ClosedLoop(8, 32, 100, 150, warmup_requests=8, prompt_pool=10)),
    (4000, 8, 600, True, False, 100_000, ClosedLoop(8, 40, 300, 57, 1.0, 1.0, warmup_requests=16, prompt_pool=12)),
    (90, 8, 512, True, True, 100_000, ClosedLoop(8, 32, 100, 150, 1.0, 0.7, prompt_pool=10)),  # and a turnaround
    # aiperf's workers: sends and arrivals out of order, stretches cut at each one
    (4000, 8, 600, True, False, 100_000, ClosedLoop(8, 40, 300, 57, 1.0, 1.0, warmup_requests=16, prompt_pool=12,
                                                    client=ClientWorkers(3, 2.0, 0.05))),
])
def test_decode_stretches_give_the_step_by_step_run_exactly(blocks: int, seqs: int, budget: int, caching: bool,
                                                           async_: bool, ctx: int, load: ClosedLoop) -> None:
    slow = _roofline_driver(False, blocks, seqs, budget, caching, async_, ctx)
    fast = _roofline_driver(True, blocks, seqs, budget, caching, async_, ctx)
    a, b = slow.run(load), fast.run(load)
    assert fast.stretches > 0 and slow.stretches == 0
    assert a.preemptions > 0 or blocks > 100
    assert b.records == a.records  # every arrival, schedule, token time to the last bit
    assert (b.steps, b.end_ms, b.preemptions) == (a.steps, a.end_ms, a.preemptions)
    assert fast.engine.scheduler.stats == slow.engine.scheduler.stats
    assert fast.engine.busy_ms == pytest.approx(slow.engine.busy_ms, rel=1e-12)
    pa, pb = slow.engine.kv.pool, fast.engine.kv.pool
    assert list(pb.free) == list(pa.free) and set(pb.cached) == set(pa.cached)  # same blocks, same order


def test_worker_processes_give_the_same_table_in_the_same_order(tmp_path: Path) -> None:
    path = write_csv(tmp_path / "s.csv", ROWS)
    one = validate(path, default_catalog(), rounds=2)
    two = validate(path, default_catalog(), rounds=2, jobs=2)
    assert [(r.case.row.id, r.ttft_ms, r.tpot_ms, r.steps) for r in two.results] == [
        (r.case.row.id, r.ttft_ms, r.tpot_ms, r.steps) for r in one.results]


def test_implied_tensor_share_flags_rows_no_gpu_could_have_produced(tmp_path: Path) -> None:
    # Llama-3.1-8B fp8 on one H200, 64 clients of 2000 -> 100 tokens, measured TTFT 121.7 ms, TPOT 9.74 ms:
    # each client's cycle is 1.086 s, so 64 prefills of 2000 tokens a second, about the whole fp8 peak.
    rows = ["x,vllm,0.12.0,nvidia/Llama-3.1-8B-Instruct-FP8,h200_sxm,fp8,agg,2000,100,64,1,,1,1,121.7,9.74",
            "y,vllm,0.12.0,nvidia/Llama-3.1-8B-Instruct-FP8,h200_sxm,fp8,agg,2000,100,32,1,,1,1,121.7,9.74",
            "z,vllm,0.12.0,nvidia/Llama-3.1-8B-Instruct-FP8,h200_sxm,fp8,agg,2000,100,64,1,,1,1,243.4,19.48"]
    cases, _ = resolve(read_rows(write_csv(tmp_path / "s.csv", rows)), default_catalog())
    x, y, z = cases
    assert 0.9 < x.implied_share < 1.2 and x.implausible
    assert y.implied_share == pytest.approx(x.implied_share / 2)  # half the clients, same cycle
    assert z.implied_share == pytest.approx(x.implied_share / 2)  # same clients, twice the cycle
    a = resolve(read_rows(write_csv(tmp_path / "a.csv", ROWS[:1])), default_catalog())[0][0]
    assert 0 < a.implied_share < 0.1 and not a.implausible
    res = validate(write_csv(tmp_path / "s.csv", rows[:1]), default_catalog(), rounds=2)
    (g,) = res.groups
    assert g.implausible == 1 and g.versions == "0.12.0"


def test_the_aiconfigurator_rows_replay_the_2025_evaluation_runners_client() -> None:
    # aiperf --request-count 10C --warmup-request-count 2C --num-dataset-entries 12C, prefix caching on.
    assert PROTOCOLS["aiconfigurator"] is AIC_EVAL_2025
    load = AIC_EVAL_2025.load(8, 1024, 128, seed=5)
    assert (load.concurrency, load.num_requests, load.warmup_requests, load.prompt_pool, load.pool_seed) == (
        8, 80, 16, 96, 5)
    assert AIC_EVAL_2025.prefix_caching and len(AIC_EVAL_2025.seeds) > 1 and not AIC_EVAL_2025.steady_state
    assert AIC_EVAL_2025.load(8, 1024, 128, seed=5, rounds=2).num_requests == 16
    assert not PROTOCOLS["vllm-0.12-gap-analysis"].prefix_caching
    with pytest.raises(ValueError, match="no steady state"):
        BenchmarkProtocol("x", rounds=2, warmup_rounds=0, dataset_rounds=3, prefix_caching=True,
                          async_scheduling=True, seeds=(1,), steady_state=True)


def test_a_row_is_the_mean_over_the_protocols_seeds(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from cluster import validation

    (case,), _ = resolve(read_rows(write_csv(tmp_path / "s.csv", ROWS[:1])), default_catalog())
    seeds = AIC_EVAL_2025.seeds
    single = []
    for seed in seeds:
        monkeypatch.setitem(validation.PROTOCOLS, "aiconfigurator", BenchmarkProtocol("one", 2, 2, 12, True, True,
                                                                                      (seed,), False))
        single.append(validation.run_case(case, catalog=default_catalog()))
    monkeypatch.setitem(validation.PROTOCOLS, "aiconfigurator", AIC_EVAL_2025)
    both = validation.run_case(case, 2, default_catalog())
    assert both.ttft_ms == pytest.approx(sum(r.ttft_ms for r in single) / len(seeds))
    assert both.tpot_ms == pytest.approx(sum(r.tpot_ms for r in single) / len(seeds))

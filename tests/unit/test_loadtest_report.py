"""Run folders, summaries and comparisons, written to a temporary directory."""

from __future__ import annotations

import io
import json
from pathlib import Path

import pytest
from rich.console import Console

from cluster.loadtest import LoadTestConfig, RequestId, RequestRecord, RequestSpec, TraceData
from cluster.loadtest.replay import ReplayResult
from cluster.loadtest.report import (
    load_runs,
    new_run_folder,
    plot_compare,
    plot_slo_vs_rate,
    print_compare,
    print_summary,
    print_sweep,
    read_records,
    write_json,
    write_run,
)
from cluster.loadtest.scrape import DepthSample, TargetProbe, parse_metrics
from cluster.loadtest.session import build_summary
from run_cluster import main
from tests.unit.test_loadtest_scrape import AFTER, BEFORE

REQUIRED = {"ttft_ms", "tpot_ms", "itl_ms", "e2e_ms", "completed", "failed", "duration_s", "request_throughput",
            "output_throughput", "prefix_hit_ratio", "step_lag_ms"}
PNG = b"\x89PNG\r\n\x1a\n"


def records(shift: float = 0.0) -> list[RequestRecord]:
    out = []
    for i in range(20):
        ok = i != 7
        out.append(RequestRecord(
            request_id=RequestId(f"r{i}"), status="ok" if ok else "timeout", scheduled_ms=100.0 * i,
            sent_ms=100.0 * i + 0.5, input_len=64, expected_output_len=5, ttft_ms=50.0 + i + shift if ok else None,
            e2e_ms=90.0 + i + shift if ok else None, itl_ms=(10.0, 10.0, 10.0, 10.0 + i) if ok else (),
            output_tokens=5 if ok else 0, worker=f"w{i % 2}", send_lag_wall_ms=0.5))
    return out


def trace() -> TraceData:
    specs = tuple(RequestSpec(RequestId(f"r{i}"), 100.0 * i, 64, 5, (0, 1, 2, i + 3), 16) for i in range(20))
    return TraceData(source="t.jsonl", format="mooncake", requests=specs, block_size=16)


def result(before: str | None = BEFORE, after: str | None = AFTER) -> ReplayResult:
    depth = [DepthSample(500.0 * k, float(k), 1.0, {"w0": (float(k), 0.0), "w1": (1.0, 1.0)}) for k in range(5)]
    return ReplayResult(records=records(), duration_s=2.5, wall_s=2.5, model="m",
                        before=parse_metrics(before) if before else None,
                        after=parse_metrics(after) if after else None, depth=depth, workers=[("w0", "http://x")])


def test_summary_has_the_required_keys_and_target_figures() -> None:
    tr = trace()
    s = build_summary("t", "http://x", tr, tr.requests, result(), LoadTestConfig(slos={"ttft": 60}), None)
    assert set(s) >= REQUIRED
    for key in ("ttft_ms", "tpot_ms", "itl_ms", "e2e_ms"):
        assert {"mean", "p50", "p90", "p99"} <= set(s[key])
    assert (s["completed"], s["failed"]) == (19, 1)
    assert s["prefix_hit_ratio"] == pytest.approx(0.4)
    assert s["step_lag_ms"]["p99"] == pytest.approx(5.0)
    assert s["trace_ideal_block_hit_ratio"] == pytest.approx(57 / 80)
    assert s["slo_attainment"] == pytest.approx(10 / 20)  # ttft 50..60: requests 0..10 less the timeout (7)
    assert s["trustworthy"] is True
    json.dumps(s)


def test_summary_says_when_the_target_exports_nothing_and_flags_lag() -> None:
    tr = trace()
    s = build_summary("t", "http://x", tr, tr.requests, result(None, None), LoadTestConfig(), None)
    assert s["prefix_hit_ratio"] is None and s["step_lag_ms"] is None
    assert any("prefix_hit_ratio" in n for n in s["notes"]) and any("step_lag_ms" in n for n in s["notes"])
    lagging = build_summary("t", "http://x", tr, tr.requests, result(), LoadTestConfig(step_lag_threshold_ms=1.0),
                            None)
    assert lagging["trustworthy"] is False and any("emulator lagged" in n for n in lagging["notes"])


def transfers_page(transfers: float, slow: float) -> str:
    return AFTER + "\n".join([
        "# TYPE kvmesh:kv_transfers counter",
        f'kvmesh:kv_transfers_total{{engine="e0",op="push",outcome="ok"}} {transfers}',
        "# TYPE kvmesh:kv_transfer_real_bottleneck counter",
        f'kvmesh:kv_transfer_real_bottleneck_total{{engine="e0"}} {slow}']) + "\n"


def test_summary_flags_a_real_transport_slower_than_the_emulated_link() -> None:
    tr = trace()
    before = transfers_page(10, 0)
    slow = build_summary("t", "http://x", tr, tr.requests, result(before, transfers_page(110, 5)),
                         LoadTestConfig(), None)
    assert slow["kv_transfer_real_bottleneck"] == {"transfers": 100, "real_bottleneck": 5, "share": 0.05}
    assert slow["trustworthy"] is False
    assert any("real transport was the bottleneck: 5 of 100" in n for n in slow["notes"])
    fine = build_summary("t", "http://x", tr, tr.requests, result(before, transfers_page(1010, 5)),
                         LoadTestConfig(), None)  # 0.5% is within the default 1%
    assert fine["trustworthy"] is True and not any("real transport" in n for n in fine["notes"])
    assert build_summary("t", "http://x", tr, tr.requests, result(), LoadTestConfig(),
                         None)["kv_transfer_real_bottleneck"] is None


def engine_page(engine: str, lag_counts: tuple[float, float, float], steps_ms_sum: float) -> str:
    """One engine's page: step lag counts in buckets (<=1, <=20, beyond) and its step-time sum and count."""
    a, b, c = lag_counts
    n = a + b + c
    return "\n".join([
        "# TYPE kvmesh:step_lag_ms histogram",
        f'kvmesh:step_lag_ms_bucket{{engine="{engine}",le="1.0"}} {a}',
        f'kvmesh:step_lag_ms_bucket{{engine="{engine}",le="20.0"}} {a + b}',
        f'kvmesh:step_lag_ms_bucket{{engine="{engine}",le="+Inf"}} {n}',
        f'kvmesh:step_lag_ms_count{{engine="{engine}"}} {n}',
        f'kvmesh:step_lag_ms_sum{{engine="{engine}"}} 0',
        "# TYPE kvmesh:step_time_ms histogram",
        f'kvmesh:step_time_ms_bucket{{engine="{engine}",le="+Inf"}} {n}',
        f'kvmesh:step_time_ms_count{{engine="{engine}"}} {n}',
        f'kvmesh:step_time_ms_sum{{engine="{engine}"}} {steps_ms_sum}']) + "\n"


def test_a_lagging_run_names_the_engines_behind_per_process_and_suggests_a_time_scale() -> None:
    tr = trace()
    zero = {n: parse_metrics(engine_page(n, (0, 0, 0), 0)) for n in ("a", "b", "c")}
    after = {"a": parse_metrics(engine_page("a", (100, 0, 0), 2000)),   # on time
             "b": parse_metrics(engine_page("b", (0, 100, 0), 2000)),   # ~20 ms late at p99
             "c": parse_metrics(engine_page("c", (50, 50, 0), 2000))}   # half late
    res = result()
    res.before = TargetProbe.combined(None, zero)
    res.after = TargetProbe.combined(None, after)
    res.before_workers, res.after_workers = zero, after
    res.processes = {"a": "p0", "b": "p0", "c": "p1"}
    s = build_summary("t", "http://x", tr, tr.requests, res, LoadTestConfig(step_lag_threshold_ms=5.0), None)
    assert s["trustworthy"] is False
    assert s["engines_behind"] == ["b", "c"]
    assert set(s["step_lag_by_process"]) == {"p0", "p1"}
    assert s["step_lag_by_process"]["p0"]["steps"] == 200
    assert s["step_lag_by_engine"]["a"]["p99"] == pytest.approx(0.99)
    # mean step 20 emulated ms, p99 lag ~19.8 wall ms at time scale 1: about 2x slower would have kept up
    assert s["suggested_time_scale"] == pytest.approx(1.0 + s["step_lag_ms"]["p99"] / 20.0)
    note = next(n for n in s["notes"] if "emulator lagged" in n)
    assert "engines that fell behind: b (" in note and "time_scale 2" in note
    calm = build_summary("t", "http://x", tr, tr.requests, res, LoadTestConfig(step_lag_threshold_ms=50.0), None)
    assert calm["trustworthy"] is True and calm["engines_behind"] == [] and calm["suggested_time_scale"] is None


def test_run_folder_holds_summary_records_timeseries_and_plots(tmp_path: Path) -> None:
    tr = trace()
    res = result()
    s = build_summary("t", "http://x", tr, tr.requests, res, LoadTestConfig(), None)
    folder = new_run_folder(tmp_path, "my run")
    assert folder.name.endswith("-my-run") and new_run_folder(tmp_path, "my run") != folder
    notes = write_run(folder, s, res.records, res.depth)
    assert notes == []
    for name in ("ttft_cdf.png", "tpot_cdf.png", "throughput.png", "queue_depth.png", "worker_load.png"):
        assert (folder / name).read_bytes()[:8] == PNG, name
    assert json.loads((folder / "summary.json").read_text())["completed"] == 19
    assert read_records(folder / "requests.jsonl") == res.records
    ts = json.loads((folder / "timeseries.json").read_text())
    assert len(ts["target_depth"]) == 5 and ts["client"]["t_s"][0] == 0.0
    out = io.StringIO()
    print_summary(Console(file=out, width=160), s)
    assert "TTFT" in out.getvalue() and "prefix hit ratio" in out.getvalue()


def test_worker_plot_is_skipped_with_a_note_when_nothing_names_workers(tmp_path: Path) -> None:
    bare = [RequestRecord(**{**r.__dict__, "worker": None}) for r in records()]
    notes = write_run(tmp_path / "run", {"name": "x"}, bare, [])
    assert any("per-worker load" in n for n in notes) and any("queue depth" in n for n in notes)
    assert not (tmp_path / "run" / "worker_load.png").exists()


def test_compare_reads_runs_and_sweeps_and_overlays_cdfs(tmp_path: Path) -> None:
    tr = trace()
    a, b, sweep = tmp_path / "a", tmp_path / "b", tmp_path / "sweep"
    for folder, shift in ((a, 0.0), (b, 30.0)):
        res = result()
        res.records = records(shift)
        write_run(folder, build_summary(folder.name, "u", tr, tr.requests, res, LoadTestConfig(), None),
                  res.records, res.depth, plots=False)
    subs = []
    for rate in (1.0, 2.0):
        s = build_summary(f"s@{rate:g}", "u", tr, tr.requests, result(), LoadTestConfig(slos={"ttft": 60}), rate)
        s["folder"] = f"rate-{rate:g}"
        write_run(sweep / s["folder"], s, records(), [], plots=False)
        subs.append(s)
    write_json(sweep / "summary.json", {"sweep": True, "name": "s", "retime": "scale", "runs": subs,
                                        "goodput_target": 0.5, "max_rate_meeting_target": 2.0})
    plot_slo_vs_rate(sweep, [(1.0, 0.6), (2.0, 0.55)], 0.5, "s")
    assert (sweep / "slo_attainment_vs_rate.png").read_bytes()[:8] == PNG
    runs = load_runs([a, b, sweep])
    assert [label for label, _, _ in runs] == ["a", "b", "sweep/rate-1", "sweep/rate-2"]
    out = io.StringIO()
    print_compare(Console(file=out, width=200), runs)
    print_sweep(Console(file=out, width=200), json.loads((sweep / "summary.json").read_text()))
    assert "TTFT p99" in out.getvalue() and "2 req/s" in out.getvalue()
    written = plot_compare(tmp_path / "cmp", runs)
    assert [p.name for p in written] == ["ttft_cdf.png", "tpot_cdf.png", "itl_cdf.png", "e2e_cdf.png"]
    with pytest.raises(FileNotFoundError, match="not a load-test run folder"):
        load_runs([tmp_path / "cmp"])


def test_compare_command(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    tr = trace()
    for name in ("x", "y"):
        res = result()
        write_run(tmp_path / name, build_summary(name, "u", tr, tr.requests, res, LoadTestConfig(), None),
                  res.records, res.depth, plots=False)
    assert main(["compare", str(tmp_path / "x"), str(tmp_path / "y"), "--out", str(tmp_path / "c"), "--json"]) == 0
    last = capsys.readouterr().out.strip().splitlines()[-1]
    obj = json.loads(last)
    assert obj["runs"] == ["x", "y"] and obj["rows"]["completed"] == [19, 19]
    assert (tmp_path / "c" / "ttft_cdf.png").exists()


def test_loadtest_command_rejects_bad_arguments(tmp_path: Path) -> None:
    t = tmp_path / "t.jsonl"
    t.write_text('{"timestamp": 0, "input_length": 16, "output_length": 1, "hash_ids": [0]}\n{"bad\n')
    with pytest.raises(SystemExit, match="strict"):
        main(["loadtest", "--target", "http://127.0.0.1:9", "--trace", str(t), "--strict", "--block-size", "16"])
    with pytest.raises(SystemExit, match="bad SLO"):
        main(["loadtest", "--target", "http://127.0.0.1:9", "--trace", str(t), "--block-size", "16",
              "--slo", "speed:1", "--runs-dir", str(tmp_path)])
    with pytest.raises(SystemExit):
        main(["loadtest", "--target", "http://x", "--trace", str(t), "--rate", "0"])

"""Trace readers: Mooncake JSONL, Azure CSV, synthetic YAML; malformed lines counted, --strict fails."""

from __future__ import annotations

import itertools
import json
from pathlib import Path

import pytest

from cluster.loadtest import ReadOptions, RequestSpec, TraceError, detect_format, read_trace
from cluster.loadtest.azure import parse_timestamp
from cluster.loadtest.formats import READERS, format_names
from cluster.loadtest.mooncake import infer_block_size
from tests.conftest import shared_path


def write(tmp_path: Path, name: str, text: str) -> Path:
    p = tmp_path / name
    p.write_text(text)
    return p


def mooncake_line(ts: float, n_in: int, n_out: int, ids: list[int], **extra: object) -> str:
    return json.dumps({"timestamp": ts, "input_length": n_in, "output_length": n_out, "hash_ids": ids, **extra})


GOOD_MOONCAKE = "\n".join([
    mooncake_line(0, 1000, 10, [0, 1]),
    mooncake_line(0, 512, 5, [0]),
    mooncake_line(3000, 1030, 7, [0, 1, 2], session_id=42, origin_region="us-east-1", residency_region="eu-west-1",
                  priority=2),
]) + "\n"


def test_registry_knows_every_format() -> None:
    assert format_names() == ["azure", "mooncake", "synthetic"]
    assert set(READERS) == {"azure", "mooncake", "synthetic"}


def test_mooncake_reads_requests_with_their_optional_fields(tmp_path: Path) -> None:
    data = read_trace(write(tmp_path, "t.jsonl", GOOD_MOONCAKE), options=ReadOptions(block_size=512))
    assert data.format == "mooncake" and data.block_size == 512 and data.malformed_count == 0
    assert [r.request_id for r in data.requests] == ["L1", "L2", "L3"]
    last = data.requests[2]
    assert (last.arrival_ms, last.input_len, last.output_len, last.hash_ids) == (3000.0, 1030, 7, (0, 1, 2))
    assert (last.session_id, last.origin_region, last.residency_region, last.priority) == ("42", "us-east-1",
                                                                                           "eu-west-1", 2)
    assert data.requests[0].session_id is None and data.requests[0].priority is None


def test_mooncake_infers_the_block_size_from_the_hash_ids(tmp_path: Path) -> None:
    data = read_trace(write(tmp_path, "t.jsonl", GOOD_MOONCAKE))
    assert data.block_size == 512
    assert any("inferred" in n for n in data.notes)
    assert infer_block_size([(1000, 2), (512, 1), (1030, 3)]) == 512
    assert infer_block_size([(20, 2), (33, 3)]) == 16
    assert infer_block_size([(10, 1)]) is None  # one short block fits 16, 32, ... : ambiguous


def test_mooncake_ambiguous_block_size_asks_for_the_argument(tmp_path: Path) -> None:
    p = write(tmp_path, "t.jsonl", mooncake_line(0, 10, 1, [0]) + "\n")
    with pytest.raises(TraceError, match="--block-size"):
        read_trace(p)
    assert read_trace(p, options=ReadOptions(block_size=16)).block_size == 16


BAD_MOONCAKE = "\n".join([
    mooncake_line(0, 1000, 10, [0, 1]),
    "{not json",
    "[1, 2]",
    json.dumps({"timestamp": 5, "input_length": 100}),
    mooncake_line(6, 1000, 10, [0, 1, 2]),  # 3 ids for 2 blocks of 512
    mooncake_line(7, 0, 10, []),
    mooncake_line(8, 100, 0, [9]),
    json.dumps({"timestamp": "soon", "input_length": 1, "output_length": 1, "hash_ids": [1]}),
    mooncake_line(9, 100, 1, [3], priority="high"),
    "",
    mooncake_line(10, 600, 3, [0, 4]),
]) + "\n"


def test_mooncake_counts_and_reports_every_malformed_line(tmp_path: Path) -> None:
    data = read_trace(write(tmp_path, "t.jsonl", BAD_MOONCAKE), options=ReadOptions(block_size=512))
    assert len(data.requests) == 2
    assert data.malformed_count == 8
    lines = {m.line: m.reason for m in data.malformed}
    assert sorted(lines) == [2, 3, 4, 5, 6, 7, 8, 9]
    assert "not valid JSON" in lines[2]
    assert "not a JSON object" in lines[3]
    assert "missing field 'output_length'" in lines[4]
    assert "3 hash_ids" in lines[5] and "wrong --block-size" in lines[5]
    assert "input length must be at least 1" in lines[6]
    assert "output length must be at least 1" in lines[7]
    assert "timestamp must be a number" in lines[8]
    assert "priority must be an integer" in lines[9]
    assert data.describe()["malformed_lines"] == 8
    assert any("8 malformed" in n for n in data.notes)


def test_strict_mode_fails_on_the_first_malformed_line(tmp_path: Path) -> None:
    p = write(tmp_path, "t.jsonl", BAD_MOONCAKE)
    with pytest.raises(TraceError, match=r"line 2: not valid JSON.*strict"):
        read_trace(p, options=ReadOptions(block_size=512, strict=True))


def test_out_of_order_arrivals_are_sorted_and_noted(tmp_path: Path) -> None:
    text = mooncake_line(500, 16, 1, [1]) + "\n" + mooncake_line(100, 16, 1, [2]) + "\n"
    data = read_trace(write(tmp_path, "t.jsonl", text), options=ReadOptions(block_size=16))
    assert [r.arrival_ms for r in data.requests] == [100.0, 500.0]
    assert data.resorted and any("sorted" in n for n in data.notes)


AZURE = """TIMESTAMP,ContextTokens,GeneratedTokens
2023-11-16 18:17:03.9799600,4808,10
2023-11-16 18:17:04.0319600,3180,8
2023-11-16 18:17:04.1000000,12,x
2023-11-16 18:17:04.2000000,12
yesterday,100,10
2023-11-16 18:17:05.5,0,3
2023-11-16 18:17:06,100,5
"""


def test_azure_reads_timestamps_to_the_microsecond_and_counts_bad_rows(tmp_path: Path) -> None:
    data = read_trace(write(tmp_path, "a.csv", AZURE))
    assert data.format == "azure" and data.block_size == 16
    assert [r.arrival_ms for r in data.requests] == [0.0, 52.0, 2020.04]
    assert [(r.input_len, r.output_len, r.hash_ids) for r in data.requests] == [(4808, 10, ()), (3180, 8, ()),
                                                                                (100, 5, ())]
    assert data.malformed_count == 4
    reasons = [m.reason for m in data.malformed]
    assert "'x' is not an integer" in reasons[0]
    assert "2 cells, the header has 3" in reasons[1]
    assert "ContextTokens must be at least 1" in reasons[3]
    with pytest.raises(TraceError, match="line 4"):
        read_trace(tmp_path / "a.csv", options=ReadOptions(strict=True))


def test_azure_timestamps_and_headers() -> None:
    assert parse_timestamp("12.5") == 12_500_000_000
    a = parse_timestamp("2023-11-16 18:17:03.9799600")
    b = parse_timestamp("2023-11-16 18:17:04.0319601")
    assert b - a == 52_000_100
    assert parse_timestamp("1970-01-01 00:00:01.5") == 1_500_000_000
    with pytest.raises(ValueError):
        parse_timestamp("2023-11-16 18:17:03.12x")


def test_azure_optional_columns_and_vidur_names(tmp_path: Path) -> None:
    text = "arrived_at,num_prefill_tokens,num_decode_tokens,origin_region,priority\n0.5,10,2,us-west-2,1\n1.0,20,3,,\n"
    data = read_trace(write(tmp_path, "v.csv", text))
    assert [(r.arrival_ms, r.origin_region, r.priority) for r in data.requests] == [(0.0, "us-west-2", 1),
                                                                                   (500.0, None, None)]


def test_azure_without_its_columns_fails(tmp_path: Path) -> None:
    with pytest.raises(TraceError, match="header lacks"):
        read_trace(write(tmp_path, "x.csv", "a,b,c\n1,2,3\n"), "azure")


SYNTH = """format: synthetic
num_requests: 200
rate: 10
burstiness: 0.5
block_size: 16
input_len: {kind: uniform, mean: 200, spread: 100}
output_len: {kind: fixed, mean: 20}
prefixes: {num_prefixes: 3, prefix_len: 100, share_ratio: 0.5}
sessions:
  turns: {kind: uniform, mean: 2, spread: 1, min: 1, max: 3}
  think_time_s: 2
  user_len: {kind: fixed, mean: 40}
origin_regions: {us-east-1: 3, eu-west-1: 1}
residency_ratio: 0.5
priorities: {0: 1, 1: 1}
seed: 3
"""


def test_synthetic_workload_is_exact_in_count_and_deterministic(tmp_path: Path) -> None:
    p = write(tmp_path, "w.yaml", SYNTH)
    a, b = read_trace(p), read_trace(p)
    assert a.format == "synthetic" and len(a) == 200
    assert a.requests == b.requests
    assert read_trace(p, options=ReadOptions(seed=1)).requests != a.requests
    arrivals = [r.arrival_ms for r in a.requests]
    assert arrivals == sorted(arrivals)
    assert {r.origin_region for r in a.requests} == {"us-east-1", "eu-west-1"}
    assert all(r.residency_region in (None, r.origin_region) for r in a.requests)
    assert {r.priority for r in a.requests} == {0, 1}
    assert all(r.output_len == 20 for r in a.requests)


def test_synthetic_prefixes_share_whole_blocks_and_sessions_grow(tmp_path: Path) -> None:
    data = read_trace(write(tmp_path, "w.yaml", SYNTH))
    firsts: dict[str, RequestSpec] = {}
    by_session: dict[str, list[RequestSpec]] = {}
    for r in data.requests:
        assert r.session_id is not None
        by_session.setdefault(r.session_id, []).append(r)
        firsts.setdefault(r.session_id, r)
    prefix_groups = {r.hash_ids[:6] for r in firsts.values() if r.hash_ids[0] < 18}
    assert 1 <= len(prefix_groups) <= 3  # 3 prefixes of 100 // 16 = 6 blocks each: ids 0..17
    multi = [turns for turns in by_session.values() if len(turns) > 1]
    assert multi
    for turns in multi:
        for prev, nxt in itertools.pairwise(turns):
            assert nxt.input_len == prev.input_len + prev.output_len + 40
            keep = prev.input_len // 16
            assert nxt.hash_ids[:keep] == prev.hash_ids[:keep]
            assert set(nxt.hash_ids[keep:]).isdisjoint(prev.hash_ids)


def test_synthetic_spec_errors_name_the_field(tmp_path: Path) -> None:
    p = write(tmp_path, "w.yaml", SYNTH.replace("kind: fixed", "kind: zipfian"))
    with pytest.raises(TraceError, match="zipfian"):
        read_trace(p)


def test_format_detection(tmp_path: Path) -> None:
    assert detect_format(write(tmp_path, "a.jsonl", GOOD_MOONCAKE)) == "mooncake"
    assert detect_format(write(tmp_path, "a.csv", AZURE)) == "azure"
    assert detect_format(write(tmp_path, "a.yml", SYNTH)) == "synthetic"
    assert detect_format(write(tmp_path, "trace.txt", GOOD_MOONCAKE)) == "mooncake"
    assert detect_format(write(tmp_path, "azure.dat", AZURE)) == "azure"
    with pytest.raises(TraceError, match="--format"):
        detect_format(write(tmp_path, "junk.txt", "hello\n"))
    with pytest.raises(TraceError, match="no such trace file"):
        read_trace(tmp_path / "missing.jsonl")
    with pytest.raises(TraceError, match="unknown trace format"):
        read_trace(tmp_path / "a.csv", "parquet")


def test_the_shared_traces_read_cleanly() -> None:
    conv = read_trace(shared_path("traces", "mooncake_fast25", "conversation_trace.jsonl"),
                      options=ReadOptions(block_size=512))
    assert (len(conv), conv.malformed_count) == (12031, 0)
    assert sum(r.input_len for r in conv.requests) / len(conv) == pytest.approx(12035, abs=1)
    code = read_trace(shared_path("traces", "azure_llm_2023", "AzureLLMInferenceTrace_code.csv"))
    assert (len(code), code.malformed_count) == (8819, 0)
    assert code.requests[-1].arrival_ms / 1000 == pytest.approx(3436, abs=1)
    derived = read_trace(shared_path("traces", "llmservingsim_vllm_runs", "derived",
                                     "sharegpt-qwen3-32b-300-sps10.blk16.jsonl"))
    assert (len(derived), derived.block_size) == (300, 16)

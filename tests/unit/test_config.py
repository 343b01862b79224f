"""Config: presets load; bad files are rejected naming the file, the field path and the reason."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import yaml
from pydantic import ValidationError

from config import Catalog, ClusterSpec, ConfigError, default_catalog, load_cluster
from config.catalog import CATALOG_FILES, PRESETS_DIR

GOOD = {
    "name": "t",
    "regions": [{"name": "us-east-1"}, {"name": "eu-west-1"}],
    "nodes": [
        {"name": "n0", "region": "us-east-1", "hardware": "h100-80g-sxm", "gpus": 8,
         "engines": [{"name": "p", "role": "prefill", "model": "llama-3.1-8b", "tp": 2, "replicas": 2},
                     {"name": "d", "role": "decode", "model": "llama-3.1-8b", "tp": 1, "replicas": 4}]},
        {"name": "n1", "region": "eu-west-1", "hardware": "a100-80g-sxm",
         "engines": [{"name": "c", "model": "lesson-70b-fp8"}]},
    ],
}


def write(tmp_path: Path, data: object, name: str = "c.yaml") -> Path:
    p = tmp_path / name
    p.write_text(data if isinstance(data, str) else yaml.safe_dump(data))
    return p


def mutate(**changes: object) -> dict:
    import copy

    d = copy.deepcopy(GOOD)
    for path, value in changes.items():
        obj: Any = d
        keys = path.split("__")
        for k in keys[:-1]:
            obj = obj[int(k)] if k.isdigit() else obj[k]
        last = keys[-1]
        if isinstance(obj, list):
            obj[int(last)] = value
        else:
            obj[last] = value
    return d


def test_presets_load_and_hold_the_required_profiles() -> None:
    cat = default_catalog()
    for hw in ("a100-80g-sxm", "h100-80g-sxm", "h200-141g-sxm", "b200-180g-sxm", "l40s-48g", "rtx-4090",
               "rtx-pro-6000-blackwell"):
        assert hw in cat.hardware
        assert cat.hardware.get(hw).source
    for m in ("llama-3.1-8b", "llama-3.1-70b", "llama-3.1-70b-fp8", "llama-2-70b", "qwen3-32b", "qwen3-30b-a3b",
              "deepseek-v3", "bloom-176b"):
        assert m in cat.models
    lesson = cat.profiles.get("lesson-70b-fp8")
    assert (lesson.prefill_tokens_per_ms, lesson.decode_tokens_per_ms_colocated,
            lesson.decode_tokens_per_ms_decode, lesson.kv_bytes_per_token, lesson.block_tokens) == (40, 0.1, 0.18,
                                                                                                    125000, 16)
    assert cat.links.get(lesson.rdma_link).bandwidth_gbps == 100
    assert cat.links.get(lesson.tcp_link).bandwidth_gbps == 10


def test_uncalibrated_hardware_inherits_a_calibrated_efficiency() -> None:
    cat = default_catalog()
    rtx = cat.hardware.get("rtx-4090")
    assert rtx.efficiency == cat.hardware.get("l40s-48g").efficiency.model_copy(
        update={"fitted_on": rtx.efficiency.fitted_on})
    assert rtx.efficiency.fitted_on.startswith("inherited from l40s-48g")


def test_every_cluster_preset_loads() -> None:
    files = [p for p in PRESETS_DIR.glob("*.yaml") if p.name not in CATALOG_FILES]
    assert files
    for p in files:
        spec = load_cluster(p)
        assert spec.engines()


def test_good_spec_expands_engines_with_profiles() -> None:
    spec = ClusterSpec.model_validate(GOOD)
    engines = spec.engines()
    assert [e.name for e in engines] == ["p-0", "p-1", "d-0", "d-1", "d-2", "d-3", "c"]
    assert engines[1].gpu_indices == (2, 3)
    assert engines[-1].profile is not None and engines[-1].model is None
    assert spec.rtt_ms("us-east-1", "eu-west-1") == 75.0
    assert spec.wan_link("eu-west-1", "us-east-1").latency_us == 37500.0


def test_config_objects_are_frozen() -> None:
    spec = ClusterSpec.model_validate(GOOD)
    with pytest.raises(ValidationError):
        spec.time_scale = 2.0  # type: ignore[misc]


BAD_CLUSTERS = [
    ("unknown key", mutate(colour="blue"), "colour", "unknown key"),
    ("wrong type", mutate(time_scale="fast"), "time_scale", "valid number"),
    ("negative time scale", mutate(time_scale=-1), "time_scale", "greater than 0"),
    ("tp larger than node", mutate(nodes__0__engines__1__tp=16, nodes__0__engines__1__replicas=1),
     "nodes[0].engines[1].tp", "larger than node"),
    ("role that does not exist", mutate(nodes__0__engines__0__role="verifier"),
     "nodes.0.engines.0.role", "'colocated', 'prefill' or 'decode'"),
    ("region that no node has", mutate(regions=[{"name": "us-east-1"}, {"name": "eu-west-1"},
                                                {"name": "ap-south-1"}]), "regions", "'ap-south-1' has no node"),
    ("node in an undeclared region", mutate(nodes__1__region="mars-1"), "nodes[1].region", "not declared"),
    ("duplicate node names", mutate(nodes__1__name="n0"), "nodes", "duplicate node name 'n0'"),
    ("duplicate engine names", mutate(nodes__1__engines=[{"name": "p", "model": "llama-3.1-8b"}]), "nodes",
     "duplicate engine group name 'p'"),
    ("unknown model", mutate(nodes__0__engines__0__model="gpt-5"), "nodes[0].engines[0].model", "unknown model"),
    ("unknown hardware", mutate(nodes__1__hardware="tpu-v5"), "nodes[1].hardware", "unknown hardware"),
    ("more GPUs than the node has", mutate(nodes__0__engines__1__replicas=5), "nodes[0].engines",
     "need 9 GPUs"),
    ("model does not fit", mutate(nodes__0__engines__0__model="llama-3.1-70b", nodes__0__engines__0__tp=1),
     "nodes[0].engines[0].tp", "GB of weights per GPU"),
    ("payload scale above one", mutate(transport={"kv_payload_scale": 2}), "transport.kv_payload_scale",
     "less than or equal to 1"),
    ("unknown transport backend", mutate(transport={"backend": "carrier-pigeon"}), "transport.backend",
     "'inproc', 'tcp' or 'ucx'"),
    ("wan to an undeclared region", mutate(wan=[{"a": "us-east-1", "b": "moon", "rtt_ms": 3}]), "wan[0].b",
     "not declared"),
    ("no round-trip for a region pair", mutate(regions=[{"name": "us-east-1"}, {"name": "mars"}],
                                              nodes__1__region="mars"), "wan", "no round-trip time"),
    ("missing nodes", {"name": "x"}, "nodes", "required field is missing"),
    ("router in a region without nodes", mutate(router={"region": "us-west-2"}), "router.region", "has no node"),
    ("feed beats too seldom for the health check", mutate(feed={"heartbeat_ms": 1500}), "feed.heartbeat_ms",
     "beats too seldom"),
]


@pytest.mark.parametrize(("label", "data", "path", "reason"), BAD_CLUSTERS, ids=[b[0] for b in BAD_CLUSTERS])
def test_bad_cluster_file_names_file_field_and_reason(tmp_path: Path, label: str, data: dict, path: str,
                                                      reason: str) -> None:
    f = write(tmp_path, data)
    with pytest.raises(ConfigError) as ei:
        load_cluster(f)
    msg = str(ei.value)
    assert str(f) in msg, label
    assert any(p == path or p.replace("[", ".").replace("]", "") == path for p, _ in ei.value.problems), msg
    assert reason in msg, msg


def test_not_yaml_is_reported_with_its_position(tmp_path: Path) -> None:
    f = write(tmp_path, "name: [unclosed\nnodes: {")
    with pytest.raises(ConfigError, match=r"not valid YAML: line \d+"):
        load_cluster(f)


def test_missing_file_is_a_config_error(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="cannot read file"):
        load_cluster(tmp_path / "nope.yaml")


def _catalog_dir(tmp_path: Path, kind: str, item: dict) -> Path:
    d = tmp_path / "presets"
    d.mkdir()
    for name in CATALOG_FILES:
        (d / name).write_text((PRESETS_DIR / name).read_text())
    data = yaml.safe_load((PRESETS_DIR / kind).read_text())
    data["items"].append(item)
    (d / kind).write_text(yaml.safe_dump(data))
    return d


def test_negative_bandwidth_is_rejected(tmp_path: Path) -> None:
    d = _catalog_dir(tmp_path, "links.yaml", {"name": "bad", "source": "x", "kind": "tcp", "bandwidth_gbps": -1})
    with pytest.raises(ConfigError) as ei:
        Catalog.load(d)
    assert "links.yaml" in str(ei.value) and "bandwidth_gbps" in str(ei.value)
    assert "greater than 0" in str(ei.value)


def test_kv_heads_must_divide_heads(tmp_path: Path) -> None:
    bad = {"name": "odd", "source": "x", "num_layers": 2, "hidden_size": 64, "num_heads": 6, "num_kv_heads": 4,
           "head_dim": 16, "vocab_size": 100, "params_b": 0.1, "max_context": 128}
    d = _catalog_dir(tmp_path, "models.yaml", bad)
    with pytest.raises(ConfigError, match=r"models.yaml: items\[\d+\]: num_kv_heads \(4\) must divide num_heads"):
        Catalog.load(d)


def test_efficiency_above_one_is_rejected(tmp_path: Path) -> None:
    hw = yaml.safe_load((PRESETS_DIR / "hardware.yaml").read_text())["items"][0]
    gemm = {**hw["efficiency"]["gemm"], "compute": [1.5] * len(hw["efficiency"]["gemm"]["compute"])}
    hw = {**hw, "name": "fast", "efficiency": {**hw["efficiency"], "gemm": gemm}}
    d = _catalog_dir(tmp_path, "hardware.yaml", hw)
    with pytest.raises(ConfigError, match=r"efficiency.gemm.compute\[0\]: Input should be less than or equal to 1"):
        Catalog.load(d)


def test_duplicate_catalog_names_are_rejected(tmp_path: Path) -> None:
    item = yaml.safe_load((PRESETS_DIR / "links.yaml").read_text())["items"][0]
    d = _catalog_dir(tmp_path, "links.yaml", item)
    with pytest.raises(ConfigError, match="duplicate link name"):
        Catalog.load(d)


def test_several_problems_are_all_reported(tmp_path: Path) -> None:
    f = write(tmp_path, mutate(nodes__0__engines__0__model="nope", nodes__1__hardware="nope", colour=1))
    with pytest.raises(ConfigError) as ei:
        load_cluster(f)
    assert len(ei.value.problems) >= 1
    assert "colour" in str(ei.value)

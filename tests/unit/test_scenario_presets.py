"""The scenario presets (config/presets/scenario-*.yaml): each loads and validates as the cluster it
promises, and `up` and `loadtest` accept it (the live runs are the scenarios' and benchmarks' job)."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import pytest

from cluster.cli import build_parser
from config import load_cluster

PRESETS = Path(__file__).resolve().parents[2] / "config" / "presets"


def preset(name: str) -> Path:
    return PRESETS / f"scenario-{name}.yaml"


@pytest.mark.parametrize(("name", "p", "d", "nic"), [
    ("1p1d-h100-rdma", 1, 1, "rdma-ib-ndr400"), ("1p1d-h100-tcp", 1, 1, "tcp-25g"),
    ("2p4d-h100-rdma", 2, 4, "rdma-ib-ndr400"), ("2p4d-h100-tcp", 2, 4, "tcp-25g")])
def test_pd_presets(name: str, p: int, d: int, nic: str) -> None:
    spec = load_cluster(preset(name))
    roles = Counter(e.role for e in spec.engines())
    assert roles == {"prefill": p, "decode": d}
    assert {e.hardware.name for e in spec.engines()} == {"h100-80g-sxm"}
    assert {n.nic for n in spec.nodes} == {nic}
    assert spec.disagg.transfer_timeout_ms == 500


def test_regions_offload_and_spot_presets() -> None:
    regions = load_cluster(preset("3regions-x4"))
    assert Counter(e.region for e in regions.engines()) == {"us-east-1": 4, "eu-west-1": 4, "ap-south-1": 4}
    assert regions.rtt_ms("eu-west-1", "ap-south-1") == 440
    offload = load_cluster(preset("offload"))
    tiers = offload.engines()[0].group.tiers
    assert tiers.enabled and tiers.cpu is not None and tiers.disk is not None and tiers.preemption == "swap"
    spot = load_cluster(preset("spot-fleet"))
    assert {e.hardware.name for e in spot.engines() if e.role == "decode"} == {"a100-80g-sxm"}
    assert spot.router.kv_migration.checkpoints and spot.router.kv_migration.checkpoint_every_tokens == 32


@pytest.mark.parametrize("path", sorted(PRESETS.glob("scenario-*.yaml")), ids=lambda p: p.stem)
def test_up_and_loadtest_accept_each_preset(path: Path) -> None:
    parser = build_parser()
    assert parser.parse_args(["up", "--config", str(path)]).config == path
    args = parser.parse_args(["loadtest", "--config", str(path), "--trace", "t.jsonl"])
    assert args.config == path
    assert load_cluster(path).name == path.stem

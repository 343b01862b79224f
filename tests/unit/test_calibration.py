"""The calibrated cost model stays inside the error bounds on the Splitwise measurements."""

from __future__ import annotations

import pytest

from actors.calibration import Point, current_errors, fit_hardware, load_points, split_inconsistent
from config import default_catalog
from tests.conftest import shared_path

MEDIAN, P90 = 0.12, 0.30


@pytest.fixture(scope="module")
def groups():
    return load_points(shared_path("calibration", "splitwise_dgx", "perf_model.csv"))


def test_every_group_is_measured(groups) -> None:
    keys = {(g.model, g.hardware, g.tp) for g in groups}
    assert len(keys) == 12
    assert all(len(g.points) >= 30 for g in groups)


def test_preset_efficiencies_keep_every_group_within_bounds(groups) -> None:
    errors = current_errors(default_catalog(), groups)
    bad = [e for e in errors if not e.within(MEDIAN, P90)]
    assert not bad, bad


def test_fitted_values_stay_physical() -> None:
    cat = default_catalog()
    for name in ("a100-80g-sxm", "h100-80g-sxm", "h100-80g-sxm-pcap"):
        eff = cat.hardware.get(name).efficiency
        assert eff.fitted_on.startswith("splitwise_dgx")
        for frac in (eff.compute, eff.memory, eff.link, eff.link_large):
            assert 0 < frac <= 1
        assert eff.layer_overhead_us >= 0 and eff.seq_layer_overhead_us >= 0


def test_refitting_one_hardware_reproduces_the_bounds(groups) -> None:
    fit = fit_hardware(default_catalog(), "h100-80g-sxm", groups)
    assert all(e.within(MEDIAN, P90) for e in fit.errors), fit.errors


def test_inconsistent_rows_are_set_aside() -> None:
    pts = [Point("prefill", 512, 1, 0, 50.0), Point("prefill", 512, 32, 0, 2400.0), Point("prefill", 512, 64, 0, 361.0)]
    keep, drop = split_inconsistent(pts)
    assert drop == [pts[2]]
    assert keep == pts[:2]

"""The connector's store path priced per step: LMCache's synchronous gather pays the step's new KV over the
host link, vLLM's native DMA offload pays it against HBM bandwidth, decode-only steps store nothing under
LMCache, and an engine's tiers or store pick the path (``connector_overhead``)."""

from __future__ import annotations

import pytest

from actors.cost_model import EmpiricalCostModel, RooflineCostModel, StepShape
from actors.engine.tiers.overhead import (
    STORE_LOOKUP_MS,
    STORE_PATHS,
    ConnectorCostModel,
    LookupPrice,
    base_cost,
    with_store_path,
)
from config import default_catalog
from config.tiers import TiersSpec, tier_devices

LINK = tier_devices()["pcie-gen5-x16"]


def roofline(tp: int = 1) -> RooflineCostModel:
    cat = default_catalog()
    return RooflineCostModel(cat.hardware.get("h100-80g-sxm"), cat.models.get("llama-3.1-8b"), tp)


def test_the_config_names_every_store_path() -> None:
    field = TiersSpec.model_fields["connector_overhead"]
    assert set(field.annotation.__args__) == {"auto", "off", *STORE_PATHS}  # type: ignore[union-attr]


def test_kernel_sync_adds_the_prefill_kv_over_the_host_link_and_nothing_to_decode() -> None:
    bare = roofline()
    cm = ConnectorCostModel(bare, "kernel-sync", LINK, 3350.0)
    prefill = StepShape.of(prefills=[(1024, 0)], decodes=[2000] * 8)
    want = 1000.0 * LINK.transfer_s(1024 * bare.kv_bytes_per_token, write=True)
    got = cm.step(prefill)
    assert got.total_ms == pytest.approx(bare.step(prefill).total_ms + want)
    assert got.overhead_ms == pytest.approx(bare.step(prefill).overhead_ms + want)
    decode = StepShape.of(decodes=[2000] * 8)
    assert cm.step(decode) == bare.step(decode)
    assert cm.connector_ms == pytest.approx(want) and cm.stored_bytes == 1024 * bare.kv_bytes_per_token


def test_dma_async_adds_hbm_contention_for_every_new_token_and_tp_splits_the_bytes() -> None:
    bare = roofline(tp=2)
    cm = ConnectorCostModel(bare, "dma-async", LINK, 3350.0)
    shape = StepShape.of(prefills=[(512, 0)], decodes=[1000] * 4)
    per_gpu = bare.kv_bytes_per_token / 2
    assert cm.step(shape).total_ms - bare.step(shape).total_ms == pytest.approx(1000.0 * 516 * per_gpu / 3350e9)
    # far cheaper than the synchronous gather of the same bytes
    sync = ConnectorCostModel(bare, "kernel-sync", LINK, 3350.0)
    assert sync.added_ms(shape) > 20 * cm.added_ms(shape)
    assert cm.step(StepShape()).total_ms == 0.0


def test_with_store_path_resolves_auto_off_and_rewraps_once() -> None:
    bare = roofline()
    native = with_store_path(bare, "auto", "dma-async", LINK)
    assert isinstance(native, ConnectorCostModel) and native.path_name == "dma-async"
    lm = with_store_path(native, "auto", "kernel-sync", LINK)
    assert isinstance(lm, ConnectorCostModel) and lm.path_name == "kernel-sync" and lm.inner is bare
    assert with_store_path(lm, "off", "kernel-sync", LINK) is bare
    forced = with_store_path(bare, "dma-async", "kernel-sync", LINK)
    assert isinstance(forced, ConnectorCostModel) and forced.path_name == "dma-async"
    assert base_cost(forced) is bare and forced.hardware is bare.hardware  # the inner model's attributes show
    # an empirical profile has no HBM figure: DMA contention is not priced, the synchronous gather is
    emp = EmpiricalCostModel(default_catalog().profiles.get("lesson-70b-fp8"), "colocated")
    assert with_store_path(emp, "auto", "dma-async", LINK) is emp
    assert isinstance(with_store_path(emp, "auto", "kernel-sync", LINK), ConnectorCostModel)
    with pytest.raises(ValueError, match="unknown store path"):
        ConnectorCostModel(bare, "nvlink-magic", LINK, 1.0)


def test_each_store_lookup_is_charged_once_on_the_next_step() -> None:
    bare = roofline()
    made = [3]  # lookups made before the wrapper existed are not charged to it
    cm = ConnectorCostModel(bare, "kernel-sync", LINK, 3350.0, LookupPrice(STORE_LOOKUP_MS, lambda: made[0]))
    decode = StepShape.of(decodes=[2000] * 8)
    assert cm.step(decode) == bare.step(decode)
    made[0] += 2  # two requests admitted while this step was planned
    got = cm.step(decode)
    assert got.total_ms == pytest.approx(bare.step(decode).total_ms + 2 * STORE_LOOKUP_MS)
    assert got.overhead_ms == pytest.approx(bare.step(decode).overhead_ms + 2 * STORE_LOOKUP_MS)
    assert cm.step(decode) == bare.step(decode)  # charged once
    assert cm.lookup_ms == pytest.approx(2 * STORE_LOOKUP_MS) == pytest.approx(cm.connector_ms)
    lm = with_store_path(bare, "auto", "kernel-sync", LINK, LookupPrice(STORE_LOOKUP_MS, lambda: made[0]))
    assert isinstance(lm, ConnectorCostModel) and lm.lookup is not None
    assert with_store_path(lm, "off", "kernel-sync", LINK) is bare  # off prices nothing, lookups included


def test_async_scheduling_hides_lookups_behind_the_previous_step() -> None:
    bare = roofline()
    made = [0]
    cm = ConnectorCostModel(bare, "kernel-sync", LINK, 3350.0,
                            LookupPrice(STORE_LOOKUP_MS, lambda: made[0], overlapped=True))
    decode = StepShape.of(decodes=[2000] * 8)
    prev = cm.step(decode).total_ms
    assert prev > STORE_LOOKUP_MS  # one lookup hides behind a step longer than it
    made[0] += 1
    assert cm.step(decode) == bare.step(decode)
    many = int(prev // STORE_LOOKUP_MS) + 3  # a burst of admissions: only the part past the step shows
    made[0] += many
    got = cm.step(decode)
    assert got.total_ms - bare.step(decode).total_ms == pytest.approx(many * STORE_LOOKUP_MS - prev)

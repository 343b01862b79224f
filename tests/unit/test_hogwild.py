"""Hogwild! on the virtual clock: the card's formula where the model meets its assumptions, duplicates
where workers do not coordinate, the network's share across nodes, and the shared cache's invariants."""

from __future__ import annotations

import random
import statistics

import pytest

from actors.cost_model import EmpiricalCostModel
from actors.engine.virtual import ManualTime
from actors.hogwild import HogwildSim, HogwildTask, Placement, expected_speedup
from config import default_catalog


@pytest.fixture
def cost() -> EmpiricalCostModel:
    # fixed rates: every decode step costs 10 ms whatever the batch, so time = steps x 10 ms exactly
    return EmpiricalCostModel(default_catalog().profiles.get("lesson-70b-fp8"), "colocated")


def test_one_worker_takes_t_serial_steps(cost: EmpiricalCostModel) -> None:
    time = ManualTime()
    r = HogwildSim(cost, random.Random(0), time).run(HogwildTask(400, 0.5, 4, 1.0, 0), 1)
    assert r.steps == 400 and r.duplicate_tokens == 0 and r.coordination_tokens == 0
    assert r.time_ms == pytest.approx(400 * 10.0)
    assert time.t == pytest.approx(4.0)  # the clock it was given moved to the run's end


@pytest.mark.parametrize("n", [2, 4])
def test_coordinated_workers_follow_the_formula(cost: EmpiricalCostModel, n: int) -> None:
    t, p, c = 1000, 0.7, 20
    task = HogwildTask(t, p, 4 * n, 1.0, c)  # 700 parallel tokens over 4N sub-goals: even shares
    single = 1000 * 10.0
    for seed in range(5):
        r = HogwildSim(cost, random.Random(seed)).run(task, n)
        denominator = t * ((1 - p) + p / n) + c * n
        collisions = r.duplicate_tokens  # one token per simultaneous pick of one sub-goal
        assert collisions <= n
        assert denominator <= r.steps <= denominator + collisions + 1
        assert single / r.time_ms == pytest.approx(expected_speedup(t, p, c, n), rel=0.02)


def test_uncoordinated_workers_duplicate_work(cost: EmpiricalCostModel) -> None:
    def mean_dup(weight: float) -> float:
        return statistics.fmean(HogwildSim(cost, random.Random(s)).run(HogwildTask(1000, 0.7, 2, weight, 0), 2)
                                .duplicate_tokens for s in range(6))

    none, full = mean_dup(0.0), mean_dup(1.0)
    assert full <= 2 < none
    # with no coordination and two sub-goals, two workers may write the same ones: no faster than one worker
    slow = [HogwildSim(cost, random.Random(s)).run(HogwildTask(1000, 0.7, 2, 0.0, 0), 2).steps for s in range(6)]
    assert max(slow) >= 1000


def test_cache_holds_every_token_in_arrival_order(cost: EmpiricalCostModel) -> None:
    r = HogwildSim(cost, random.Random(3)).run(HogwildTask(300, 0.8, 6, 0.5, 5), 3)
    assert r.cache_tokens == r.useful_tokens + r.duplicate_tokens + r.coordination_tokens
    assert r.useful_tokens == 300
    assert r.coordination_tokens == 5 * 3 * 3
    assert set(r.cache_writers) == {0, 1, 2}
    # the serial part is one worker's, then the workers interleave, not in index order every step
    assert r.cache_writers[:60] == [0] * 60
    steps = [tuple(r.cache_writers[i:i + 3]) for i in range(60, 60 + 3 * 15, 3)]
    assert len(set(steps)) > 1


def test_across_nodes_every_step_pays_the_link(cost: EmpiricalCostModel) -> None:
    link = default_catalog().links.get("tcp-25g")
    task = HogwildTask(500, 0.6, 4, 1.0, 0)
    one = HogwildSim(cost, random.Random(1)).run(task, 4)
    far = HogwildSim(cost, random.Random(1)).run(task, 4, Placement(link))
    assert far.steps == one.steps
    per_step = link.transfer_ms(3 * cost.kv_bytes_per_token)
    parallel_steps = far.steps - task.serial_tokens
    assert far.network_ms == pytest.approx(parallel_steps * per_step, rel=0.05)  # the last steps have fewer senders
    assert far.time_ms == pytest.approx(one.time_ms + far.network_ms)


@pytest.mark.parametrize("kw", [{"p": 1.5}, {"coordination_weight": -0.1}, {"subgoals": 0}, {"t_serial": 0}])
def test_bad_task_is_refused(kw: dict[str, float]) -> None:
    base: dict[str, float] = {"t_serial": 100, "p": 0.5, "subgoals": 2, "coordination_weight": 0.5}
    with pytest.raises(ValueError):
        HogwildTask(**{**base, **kw})  # type: ignore[arg-type]

"""aiperf's worker processes as the virtual driver replays them (``actors.engine.client_workers``)."""

from __future__ import annotations

import pytest

from actors.engine.client_workers import ClientWorkers, WorkerPool
from actors.engine.engine import EngineConfig
from actors.engine.scheduler import SchedulerLimits
from actors.engine.virtual import ClosedLoop, RequestRecord, VirtualDriver
from tests.unit.engine.test_virtual import Fixed


def test_credits_go_round_robin_to_at_most_the_cap_of_workers() -> None:
    assert ClientWorkers().pool(8).workers == 8
    assert ClientWorkers().pool(64).workers == 32  # aiperf's DEFAULT_MAX_WORKERS_CAP
    pool = ClientWorkers(max_workers=3).pool(16)
    assert [pool.worker_of(n) for n in range(7)] == [0, 1, 2, 0, 1, 2, 0]
    with pytest.raises(ValueError):
        ClientWorkers(max_workers=0)


def test_post_processing_grows_with_the_output_and_serializes_on_one_loop() -> None:
    spec = ClientWorkers(max_workers=2, post_base_ms=1.0, post_ms_per_token=0.01)
    assert spec.post_ms(8192) == pytest.approx(1.0 + 81.92)
    pool = WorkerPool(spec, 2)
    assert pool.post(0, 10.0, 100) == pytest.approx(12.0)  # busy [10, 12)
    assert pool.post(0, 11.0, 100) == pytest.approx(14.0)  # queued behind the first: [12, 14)
    assert pool.seen_ms(0, 10.0) == 10.0  # a chunk at the very start of the work is read at once
    assert pool.seen_ms(0, 13.0) == pytest.approx(14.0)  # ... one during it when the loop is free
    assert pool.pickup_ms(0, 10.0) == pytest.approx(14.0)
    assert pool.seen_ms(1, 13.0) == 13.0 and pool.pickup_ms(0, 20.0) == 20.0


def run(client: ClientWorkers | None, concurrency: int = 2, output_len: int = 5) -> list[RequestRecord]:
    cfg = EngineConfig("v", "m", "colocated", 1000, 16, SchedulerLimits(64, 4096, 100_000),
                       enable_prefix_caching=False)
    load = ClosedLoop(concurrency, 3 * concurrency, input_len=100, output_len=output_len, burst_gap_ms=0.5,
                      turnaround_ms=0.1, client=client)
    return VirtualDriver(cfg, Fixed()).run(load).records


def test_the_next_request_goes_out_after_the_workers_post_processing() -> None:
    plain = run(None, concurrency=1)
    busy = run(ClientWorkers(post_base_ms=3.0, post_ms_per_token=0.0), concurrency=1)
    assert plain[1].arrival_ms == pytest.approx(plain[0].last_token_ms + 0.1)
    assert busy[1].arrival_ms == pytest.approx(busy[0].last_token_ms + 3.0 + 0.1)


def test_requests_reach_the_engine_in_arrival_order_whatever_order_they_were_sent() -> None:
    # One worker for two clients: the second finished request's next one waits for the worker, which is
    # post-processing the first; a later-sent request can still arrive first, and is scheduled first.
    recs = run(ClientWorkers(max_workers=1, post_base_ms=5.0, post_ms_per_token=0.0))
    for r in recs:
        assert r.arrival_ms <= r.first_scheduled_ms
    arrivals = sorted(recs, key=lambda r: r.arrival_ms)
    firsts = [r.first_scheduled_ms for r in arrivals]
    assert firsts == sorted(firsts)


def test_a_first_token_reaching_a_busy_worker_counts_when_the_worker_is_free() -> None:
    # Client 0 prefills at [0, 2) and decodes its 5th token at 6, then its worker post-processes [6, 11).
    # Client 1 arrives at 5.5 and its first token comes at 8: read at once by a worker of its own, read at
    # 11 when both share one worker (aiperf's timestamp is taken when the loop reads the chunk).
    def second(workers: int) -> float:
        cfg = EngineConfig("v", "m", "colocated", 1000, 16, SchedulerLimits(64, 4096, 100_000),
                           enable_prefix_caching=False)
        load = ClosedLoop(2, 2, input_len=100, output_len=5, burst_gap_ms=5.5,
                          client=ClientWorkers(max_workers=workers, post_base_ms=5.0, post_ms_per_token=0.0))
        return VirtualDriver(cfg, Fixed()).run(load).records[1].ttft_ms

    assert second(2) == pytest.approx(8.0 - 5.5)
    assert second(1) == pytest.approx(11.0 - 5.5)

"""kv_aware's lookahead for a new prefix home (``policies.lookahead``), on a virtual clock: no Ray, no sockets."""

from __future__ import annotations

from cluster.router.policies import make_policy
from cluster.router.policies.lookahead import HomeLookahead
from cluster.router.view import ClusterView, RequestContext, WorkerId, WorkerInfo

BLOCKS = 10
"""Blocks per prompt; with ``max_tokens`` 16 a request's footprint is 11 blocks (16 tokens a block)."""


class StepTimes:
    """A worker's step times as a fixed table: 0.35 ms a prefill block, 7 ms a decode step (wait: 30 blocks)."""

    def block_ms(self, w: WorkerInfo) -> float:
        return 0.35

    def decode_step_ms(self, w: WorkerInfo, seqs: int, context_tokens: int) -> float:
        return 7.0


class Clock:
    def __init__(self) -> None:
        self.s = 0.0

    def __call__(self) -> float:
        return self.s


def request(prefix: int, held: dict[str, int] | None = None) -> RequestContext:
    return RequestContext({"max_tokens": 16}, block_hashes=[prefix * 1000 + i for i in range(BLOCKS)],
                          overlap={WorkerId(k): v for k, v in (held or {}).items()})


def history(num_blocks: int, busy_w0: bool, lookahead: bool) -> tuple[object, list[WorkerInfo], ClusterView, Clock]:
    """Two workers, 13 prefixes made one a second (w0 home to 7, w1 to 6), each followed by a hit at its home;
    w0 has requests open at every decision when ``busy_w0``."""
    ws = [WorkerInfo(WorkerId(f"w{i}"), f"http://w{i}", num_blocks=num_blocks, free_blocks=num_blocks)
          for i in range(2)]
    clock = Clock()
    view = ClusterView(ws, now=clock, timing=StepTimes())
    p = make_policy("kv_aware", params={"lookahead": lookahead})
    ws[0].inflight = 1 if busy_w0 else 0
    for k in range(13):
        home = ws[0] if k % 2 == 0 else ws[1]
        for ctx in (request(k), request(k, {home.name: BLOCKS})):
            p.rank(ws, ctx, view)
            p.on_routed(home, ctx)
            home.pending_blocks = 0
            clock.s += 0.5
    ws[0].inflight = 0
    return p, ws, view, clock


def first_for_a_new_prefix(p: object, ws: list[WorkerInfo], view: ClusterView) -> str:
    # w1 computed one prefix less (balanced) but has a request open; w0 is idle.
    ws[1].inflight = 1
    return str(p.rank(ws, request(99), view)[0].name)  # type: ignore[attr-defined]


def test_a_new_home_skips_a_busy_balanced_worker_when_homes_are_short_lived_and_busy_alike() -> None:
    # 130 blocks computed on caches of 2 x 50: homes lose their prefixes, so the balance kept pays off for only
    # a few later requests, and both workers were found busy equally often: the 30-block wait decides.
    p, ws, view, _ = history(num_blocks=50, busy_w0=False, lookahead=False)
    assert first_for_a_new_prefix(p, ws, view) == "w1"  # balance alone: behind w1's step
    p, ws, view, _ = history(num_blocks=50, busy_w0=False, lookahead=True)
    assert first_for_a_new_prefix(p, ws, view) == "w0"


def test_balance_wins_while_no_home_can_have_lost_its_prefix() -> None:
    # Caches of 2 x 1000 blocks, 130 computed: every home still holds its prefix, so its later requests are
    # unbounded and the wait never outweighs them.
    p, ws, view, _ = history(num_blocks=1000, busy_w0=False, lookahead=True)
    assert first_for_a_new_prefix(p, ws, view) == "w1"


def test_balance_wins_when_the_idle_worker_is_the_one_later_requests_find_busy() -> None:
    # Short-lived homes, but w0 was busy at every decision: later requests of a home there would wait behind
    # its step far more often than on w1, and more of them come than the one wait saved now.
    p, ws, view, _ = history(num_blocks=50, busy_w0=True, lookahead=True)
    assert first_for_a_new_prefix(p, ws, view) == "w1"


def test_later_requests_are_the_hit_rate_per_home_times_how_long_a_home_keeps_its_prefix() -> None:
    la = HomeLookahead()
    w = WorkerInfo(WorkerId("w0"), "http://w0")
    la.observe([w], 0.0)
    la.routed(held=0, computed=100, now_s=0.0)  # a home made at 0 s
    la.routed(held=0, computed=100, now_s=1.0)  # and one at 1 s
    la.routed(held=100, computed=10, now_s=2.0)  # three hits
    la.routed(held=100, computed=10, now_s=2.0)
    la.routed(held=100, computed=10, now_s=2.0)
    assert la.keep_s(1000, 2.0) == float("inf")  # 230 blocks computed, caches of 1000: nothing evicted yet
    # Caches of 115 blocks: written over once a second (230 blocks in 2 s); homes counted 1 s each at most.
    assert la.keep_s(115, 2.0) == 1.0
    assert la.later_requests(115, 2.0) == 3 / (1.0 + 1.0) * 1.0

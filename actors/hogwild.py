"""Hogwild!: N workers of one model write one shared KV cache (the lessons card's first method).

The mechanism (as the card's "One Hogwild! step" describes it):

- Every worker's step attends to the whole shared cache (the prompt plus every token any worker wrote);
  it writes one token at the next cache position. The cache's order is write-arrival order: a step's
  tokens are appended in the order they arrive (on one node they arrive together; ties are broken by the
  seeded RNG), never by worker index. A worker sees the others' tokens on its next step.
- One node: the N workers are N sequences of one engine, batched per step; a step costs what the
  engine's cost model says for N decodes whose context is the shared cache.
- Across nodes: each worker has its own GPU and runs a one-sequence step, but before its next step can
  read the others' tokens, their KV must cross the link (``LinkProfile.transfer_ms`` of the other active
  workers' KV bytes per step), so every step pays the network.

The task model: a job that one worker finishes in ``t_serial`` tokens. A fraction ``1 - p`` is serial
(one worker writes it while the others wait); then every worker writes ``coordination_tokens`` per worker
in the team (the card's ``c N`` term: plans read and answered); the parallel rest is split into
``subgoals`` equal sub-goals. A worker without a sub-goal picks one: with probability
``coordination_weight`` it reads the cache and takes an unfinished sub-goal nobody has visibly claimed
(it stops when none is left); otherwise it picks any sub-goal not visibly finished, which may be one
another worker is already on. A sub-goal is done when one worker has written all its tokens; every
token another worker wrote on it is a duplicate (wasted). A worker learns that its sub-goal was finished
by someone else on its next step, and picks again.

Invariants: the cache length equals the tokens written (serial + coordination + sub-goal tokens,
duplicates included); time only moves forward, by one step's cost per step. With
``coordination_weight = 1`` the only duplicates come from simultaneous picks of one sub-goal (the worker
whose first token arrived later leaves it on its next step, one wasted token each), so with the
sub-goals dividing evenly the step count is the card's formula's denominator ``T((1-p)+p/N) + cN`` plus
those collisions.

Failure behaviour: bad parameters raise ``ValueError`` naming the field; a run that cannot finish (a
bug) stops after ``10 x t_serial`` steps with ``RuntimeError`` instead of looping.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from typing import NewType

from actors.cost_model import CostModel, StepShape
from actors.engine.virtual import ManualTime, virtual_clock
from config.link import LinkProfile

WorkerId = NewType("WorkerId", int)
SubgoalId = NewType("SubgoalId", int)


def expected_speedup(t_serial: int, p: float, c: int, n: int) -> float:
    """The card's formula: ``T / (T((1-p) + p/N) + cN)`` (Amdahl plus coordination)."""
    return t_serial / (t_serial * ((1 - p) + p / n) + c * n)


@dataclass(frozen=True)
class HogwildTask:
    t_serial: int
    """Tokens one worker writes to finish the job alone."""
    p: float
    """Parallel fraction of the job."""
    subgoals: int = 8
    coordination_weight: float = 1.0
    """Chance that a worker reads the others' work before it picks a sub-goal (1: never duplicates)."""
    coordination_tokens: int = 0
    """``c``: tokens each worker writes per worker in the team to coordinate."""
    prompt_tokens: int = 512
    """The shared cache's length before the job starts (the task statement)."""

    def __post_init__(self) -> None:
        if self.t_serial < 1:
            raise ValueError("t_serial must be at least 1")
        if not 0.0 <= self.p <= 1.0:
            raise ValueError(f"p must be in [0, 1], got {self.p}")
        if not 0.0 <= self.coordination_weight <= 1.0:
            raise ValueError(f"coordination_weight must be in [0, 1], got {self.coordination_weight}")
        if self.subgoals < 1 or self.coordination_tokens < 0 or self.prompt_tokens < 0:
            raise ValueError("subgoals must be at least 1; coordination_tokens and prompt_tokens not negative")

    @property
    def serial_tokens(self) -> int:
        return round(self.t_serial * (1.0 - self.p))

    def subgoal_sizes(self) -> list[int]:
        par = self.t_serial - self.serial_tokens
        base, extra = divmod(par, self.subgoals)
        return [base + (1 if i < extra else 0) for i in range(self.subgoals)]


@dataclass(frozen=True)
class Placement:
    """Where the workers run: one node (``link`` None: batched on one engine) or one node each, joined by
    ``link``."""

    link: LinkProfile | None = None

    @property
    def label(self) -> str:
        return "one node" if self.link is None else f"across nodes ({self.link.name})"


@dataclass
class HogwildRun:
    """One run's outcome (times in emulated ms)."""

    workers: int
    placement: str
    steps: int
    time_ms: float
    useful_tokens: int
    duplicate_tokens: int
    coordination_tokens: int
    network_ms: float
    """Time steps spent waiting for the others' tokens to cross the link (0 on one node)."""
    cache_writers: list[WorkerId] = field(repr=False, default_factory=list)
    """Who wrote each cache position, in cache order (write-arrival order)."""

    @property
    def cache_tokens(self) -> int:
        return len(self.cache_writers)


@dataclass
class _Worker:
    wid: WorkerId
    goal: SubgoalId | None = None
    written_on_goal: int = 0
    coord_left: int = 0
    stopped: bool = False
    coordinated: bool = False
    """This pick was made reading the cache (drawn per pick with probability ``coordination_weight``)."""
    check_pending: bool = False


class HogwildSim:
    """Runs a ``HogwildTask`` with N workers (module docstring) on a virtual clock (``ManualTime``, moved
    to each step's end) with a seeded RNG."""

    def __init__(self, cost: CostModel, rng: random.Random, time: ManualTime | None = None) -> None:
        self.cost = cost
        self.rng = rng
        self.time = time or ManualTime()
        self.clock = virtual_clock(self.time)

    def _step_ms(self, active: int, context: int, placement: Placement) -> tuple[float, float]:
        """(step time, of which network wait) for ``active`` workers over a shared cache of ``context``."""
        if placement.link is None:
            return self.cost.step(StepShape.of(decodes=[context] * active)).total_ms, 0.0
        net = placement.link.transfer_ms((active - 1) * self.cost.kv_bytes_per_token) if active > 1 else 0.0
        return self.cost.step(StepShape.of(decodes=[context])).total_ms + net, net

    def _advance(self, ms: float) -> None:
        self.time.advance_to_ms(self.clock.now_ms() + ms)

    def run(self, task: HogwildTask, n: int, placement: Placement | None = None) -> HogwildRun:
        placement = placement or Placement()
        if n < 1:
            raise ValueError("the number of workers must be at least 1")
        start = self.clock.now_ms()
        cache: list[WorkerId] = []
        steps = 0
        network = 0.0
        limit = 10 * task.t_serial + 10 * n * n * task.coordination_tokens + 10
        # serial part: one worker writes, the others wait
        for _ in range(task.serial_tokens):
            ms, _net = self._step_ms(1, task.prompt_tokens + len(cache), placement)
            self._advance(ms)
            cache.append(WorkerId(0))
            steps += 1
        sizes = task.subgoal_sizes()
        done: list[bool] = [s == 0 for s in sizes]
        claimed_by: dict[SubgoalId, list[WorkerId]] = {}
        """Who wrote on each sub-goal, in the order of their first token there; every worker sees it from
        the next step."""
        workers = [_Worker(WorkerId(i), coord_left=task.coordination_tokens * n if n > 1 else 0)
                   for i in range(n)]
        coord = 0
        goal_tokens = 0
        while not all(done):
            steps += 1
            if steps > limit:
                raise RuntimeError(f"Hogwild! run did not finish in {limit} steps ({sizes}, {done})")
            # each worker decides on what it saw at the end of the previous step
            visible_claims = {g: list(ws) for g, ws in claimed_by.items()}
            writes: list[_Worker] = []
            for w in workers:
                if w.stopped:
                    continue
                if w.coord_left == 0:
                    if w.goal is not None and done[w.goal]:
                        w.goal, w.written_on_goal = None, 0
                    if w.goal is not None and w.check_pending:
                        # first step after the pick: a coordinated worker that sees another worker started
                        # this sub-goal before it did (simultaneous picks) leaves it to them
                        w.check_pending = False
                        first = visible_claims.get(w.goal, [w.wid])[0]
                        if w.coordinated and first != w.wid:
                            w.goal, w.written_on_goal = None, 0
                    if w.goal is None:
                        w.coordinated = self.rng.random() < task.coordination_weight
                        w.goal = self._pick(w.wid, w.coordinated, done, visible_claims)
                        w.check_pending = True
                        if w.goal is None:
                            w.stopped = True
                            continue
                writes.append(w)
            if not writes:
                raise RuntimeError("every worker stopped with sub-goals unfinished")
            ms, net = self._step_ms(len(writes), task.prompt_tokens + len(cache), placement)
            self._advance(ms)
            network += net
            self.rng.shuffle(writes)  # write-arrival order within one step: no per-worker index
            for w in writes:
                cache.append(w.wid)
                if w.coord_left > 0:
                    w.coord_left -= 1
                    coord += 1
                    continue
                assert w.goal is not None
                goal_tokens += 1
                w.written_on_goal += 1
                order = claimed_by.setdefault(w.goal, [])
                if w.wid not in order:
                    order.append(w.wid)
                if not done[w.goal] and w.written_on_goal >= sizes[w.goal]:
                    done[w.goal] = True  # the first to write the whole sub-goal finishes it
        # every sub-goal token beyond the sub-goals' sizes was written by a worker duplicating another
        useful = task.serial_tokens + sum(sizes)
        dup = goal_tokens - sum(sizes)
        return HogwildRun(n, placement.label, steps, self.clock.now_ms() - start, useful, dup, coord, network, cache)

    def _pick(self, wid: WorkerId, coordinated: bool, done: list[bool],
              claims: dict[SubgoalId, list[WorkerId]]) -> SubgoalId | None:
        """A coordinated pick: a random unfinished sub-goal nobody else has visibly started (None: stop).
        Otherwise: any unfinished sub-goal, at random."""
        open_goals = [SubgoalId(g) for g, d in enumerate(done) if not d]
        if not open_goals:
            return None
        if coordinated:
            free = [g for g in open_goals if not set(claims.get(g, [])) - {wid}]
            return self.rng.choice(free) if free else None
        return self.rng.choice(open_goals)

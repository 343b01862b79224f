"""Synthetic workloads: gamma/Poisson arrivals, length distributions, shared prefixes, multi-turn sessions.

A workload is a YAML file (``SyntheticSpec``; ``--format synthetic``, detected from ``.yaml``/``.yml``)
turned into request specs by ``generate`` with a seeded generator:

- Arrivals of new sessions: gaps drawn from a gamma distribution with shape ``burstiness`` and mean
  ``1 / rate`` (shape 1 is a Poisson process; below 1 burstier, above 1 more regular), as vLLM's
  benchmark draws them.
- Lengths: ``input_len`` and ``output_len`` from distributions in ``LENGTH_SAMPLERS`` (fixed, uniform,
  normal, lognormal, exponential), rounded and clipped to ``[min, max]``.
- Shared prefixes: with probability ``share_ratio`` a session's first prompt starts with one of
  ``num_prefixes`` prefixes of ``prefix_len`` tokens (chosen uniformly); its prompt is the prefix plus an
  ``input_len`` suffix. Only whole blocks of a prefix are shared (``prefix_len // block_size`` blocks);
  the rest of the prefix lands in a block that also holds the request's own tokens.
- Sessions: a session has ``turns`` requests; turn k+1 arrives an exponential think time (mean
  ``think_time_s``) after turn k and its prompt is turn k's prompt, turn k's answer and ``user_len`` new
  tokens, so it shares turn k's full prompt blocks (the partial last block and the answer are new
  content, hence new block ids).
- Optional tags: origin region drawn from ``origin_regions`` weights, residency pinned to the origin with
  probability ``residency_ratio``, priority drawn from ``priorities`` weights.

Hash ids are allocated from a counter in generation order, so equal ids mean equal prefixes, exactly as
in a Mooncake trace. Sessions are generated until ``num_requests`` requests exist; the result is sorted
by arrival and cut to ``num_requests``. A spec that does not validate raises ``TraceError`` naming the
field.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from pydantic import Field, field_validator

from cluster.loadtest.formats import ReadOptions, register_reader
from cluster.loadtest.spec import MalformedLog, RequestId, RequestSpec, TraceData, TraceError, finish
from config.base import Frozen, PositiveFloat, PositiveInt
from config.errors import ConfigError
from config.yamlio import read_yaml, validate


class LengthDist(Frozen):
    """A token-count distribution: ``kind`` names a sampler in ``LENGTH_SAMPLERS``.

    ``spread`` is the standard deviation (normal), the sigma of the log (lognormal) or the half-width
    (uniform); ``mean`` is the arithmetic mean in every case. Samples are rounded and clipped to
    ``[min, max]``.
    """

    kind: str = "fixed"
    mean: PositiveFloat
    spread: float = Field(default=0.0, ge=0)
    min: PositiveInt = 1
    max: PositiveInt = 1 << 20

    @field_validator("kind")
    @classmethod
    def _known(cls, v: str) -> str:
        if v not in LENGTH_SAMPLERS:
            raise ValueError(f"unknown length distribution {v!r} (known: {', '.join(sorted(LENGTH_SAMPLERS))})")
        return v

    def sample(self, rng: np.random.Generator, n: int = 1) -> np.ndarray:
        raw = LENGTH_SAMPLERS[self.kind](self, rng, n)
        return np.clip(np.rint(raw), self.min, self.max).astype(np.int64)


def _fixed(d: LengthDist, rng: np.random.Generator, n: int) -> np.ndarray:
    return np.full(n, d.mean)


def _uniform(d: LengthDist, rng: np.random.Generator, n: int) -> np.ndarray:
    return rng.uniform(d.mean - d.spread, d.mean + d.spread, n)


def _normal(d: LengthDist, rng: np.random.Generator, n: int) -> np.ndarray:
    return rng.normal(d.mean, d.spread, n)


def _lognormal(d: LengthDist, rng: np.random.Generator, n: int) -> np.ndarray:
    mu = np.log(d.mean) - d.spread**2 / 2.0
    return rng.lognormal(mu, d.spread, n)


def _exponential(d: LengthDist, rng: np.random.Generator, n: int) -> np.ndarray:
    return rng.exponential(d.mean, n)


LENGTH_SAMPLERS: dict[str, Callable[[LengthDist, np.random.Generator, int], np.ndarray]] = {
    "fixed": _fixed, "uniform": _uniform, "normal": _normal, "lognormal": _lognormal,
    "exponential": _exponential,
}


class PrefixSpec(Frozen):
    num_prefixes: PositiveInt = 1
    prefix_len: PositiveInt
    share_ratio: float = Field(default=1.0, ge=0, le=1)
    """Fraction of sessions whose first prompt starts with a shared prefix."""


class SessionSpec(Frozen):
    turns: LengthDist
    think_time_s: float = Field(default=10.0, ge=0)
    """Mean of the exponential gap between one turn's arrival and the next."""
    user_len: LengthDist
    """New user tokens added by each later turn."""


class SyntheticSpec(Frozen):
    """A generated workload (see the module docstring)."""

    format: str = "synthetic"
    name: str = "synthetic"
    num_requests: PositiveInt
    rate: PositiveFloat
    """New sessions per second (requests per second when every session has one turn)."""
    burstiness: PositiveFloat = 1.0
    input_len: LengthDist
    output_len: LengthDist
    block_size: PositiveInt = 16
    prefixes: PrefixSpec | None = None
    sessions: SessionSpec | None = None
    origin_regions: dict[str, PositiveFloat] = Field(default_factory=dict)
    residency_ratio: float = Field(default=0.0, ge=0, le=1)
    priorities: dict[int, PositiveFloat] = Field(default_factory=dict)
    seed: int = 0


def gamma_arrivals_ms(n: int, rate: float, burstiness: float, rng: np.random.Generator,
                      start_ms: float = 0.0) -> np.ndarray:
    """``n`` arrival times (ms): cumulative gamma gaps of shape ``burstiness`` and mean ``1000 / rate``.

    The first arrival is one gap after ``start_ms`` (as in vLLM's benchmark, which sleeps before each send).
    """
    if n <= 0:
        return np.zeros(0)
    gaps = rng.gamma(shape=burstiness, scale=1.0 / (rate * burstiness), size=n) * 1000.0
    return start_ms + np.cumsum(gaps)


@dataclass
class _Ids:
    next_id: int = 0

    def take(self, n: int) -> list[int]:
        out = list(range(self.next_id, self.next_id + n))
        self.next_id += n
        return out


@dataclass
class _Draft:
    arrival_ms: float
    input_len: int
    output_len: int
    hash_ids: list[int]
    session: int
    turn: int
    origin: str | None = None
    residency: str | None = None
    priority: int | None = None


def _weighted(weights: Mapping[Any, float], rng: np.random.Generator) -> object | None:
    if not weights:
        return None
    keys = list(weights)
    p = np.array([weights[k] for k in keys], dtype=float)
    return keys[int(rng.choice(len(keys), p=p / p.sum()))]


def generate(spec: SyntheticSpec, rng: np.random.Generator) -> list[RequestSpec]:
    """The workload's requests, sorted by arrival, exactly ``spec.num_requests`` of them."""
    bs = spec.block_size
    ids = _Ids()
    prefix_blocks: list[list[int]] = []
    if spec.prefixes is not None:
        prefix_blocks = [ids.take(spec.prefixes.prefix_len // bs) for _ in range(spec.prefixes.num_prefixes)]
    drafts: list[_Draft] = []
    session = 0
    t = 0.0
    while len(drafts) < spec.num_requests:
        t = float(gamma_arrivals_ms(1, spec.rate, spec.burstiness, rng, t)[0])
        turns = int(spec.sessions.turns.sample(rng)[0]) if spec.sessions is not None else 1
        picked = _weighted(spec.origin_regions, rng)
        origin = str(picked) if picked is not None else None
        residency = origin if origin is not None and rng.random() < spec.residency_ratio else None
        n_in = int(spec.input_len.sample(rng)[0])
        blocks: list[int]
        if prefix_blocks and spec.prefixes is not None and rng.random() < spec.prefixes.share_ratio:
            group = prefix_blocks[int(rng.integers(len(prefix_blocks)))]
            n_in += spec.prefixes.prefix_len
            blocks = list(group) + ids.take(-(-n_in // bs) - len(group))
        else:
            blocks = ids.take(-(-n_in // bs))
        arrival = t
        for turn in range(turns):
            if turn > 0 and spec.sessions is not None:
                prev = drafts[-1]
                arrival += float(rng.exponential(spec.sessions.think_time_s * 1000.0)) \
                    if spec.sessions.think_time_s > 0 else 0.0
                n_in = prev.input_len + prev.output_len + int(spec.sessions.user_len.sample(rng)[0])
                keep = prev.hash_ids[: prev.input_len // bs]
                blocks = keep + ids.take(-(-n_in // bs) - len(keep))
            prio = _weighted(spec.priorities, rng)
            drafts.append(_Draft(arrival_ms=arrival, input_len=n_in, output_len=int(spec.output_len.sample(rng)[0]),
                                 hash_ids=blocks, session=session, turn=turn, origin=origin, residency=residency,
                                 priority=int(str(prio)) if prio is not None else None))
        session += 1
    drafts.sort(key=lambda d: (d.arrival_ms, d.session, d.turn))
    drafts = drafts[: spec.num_requests]
    return [
        RequestSpec(request_id=RequestId(f"q{i}"), arrival_ms=round(d.arrival_ms, 4), input_len=d.input_len,
                    output_len=d.output_len, hash_ids=tuple(d.hash_ids), block_size=bs,
                    origin_region=d.origin, residency_region=d.residency,
                    session_id=f"s{d.session}" if spec.sessions is not None else None, priority=d.priority)
        for i, d in enumerate(drafts)
    ]


def load_spec(path: Path | str) -> SyntheticSpec:
    """Read and validate a workload file; a bad one raises ``TraceError`` naming the field and reason."""
    try:
        return validate(SyntheticSpec, read_yaml(path), source=str(path))
    except ConfigError as e:
        raise TraceError(str(e)) from None


class SyntheticReader:
    name = "synthetic"
    extensions: tuple[str, ...] = (".yaml", ".yml")

    def sniff(self, head: str) -> bool:
        return head.replace(" ", "").startswith(("format:synthetic", "num_requests:"))

    def read(self, path: Path, options: ReadOptions, log: MalformedLog) -> TraceData:
        spec = load_spec(path)
        if options.block_size is not None and options.block_size != spec.block_size:
            spec = spec.model_copy(update={"block_size": options.block_size})
        rng = np.random.default_rng([spec.seed & 0xFFFFFFFF, options.seed & 0xFFFFFFFF])
        return finish(path, self.name, generate(spec, rng), log, spec.block_size,
                      [f"generated: {spec.num_requests} requests, {spec.rate} sessions/s, burstiness "
                       f"{spec.burstiness}, seed ({spec.seed}, {options.seed})"])


READER = register_reader(SyntheticReader())

BUNDLED_DIR = Path(__file__).resolve().parent / "workloads"
DEMO_WORKLOAD = BUNDLED_DIR / "demo-synthetic.yaml"
"""A small bundled workload (shared prefixes, a few multi-turn sessions) for when ../shared is absent."""

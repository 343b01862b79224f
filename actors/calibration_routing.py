"""The expert routing an op table's MoE rows measured, so that the calibration predicts each row with the work its
rank really did (``actors.calibration._moe``), not the serving model's expected uniform routing.

aiconfigurator's MoE collector times vLLM's fused MoE on rank 0 of ``moe_ep_size`` ranks, which holds experts
``[0, E / ep)`` (vLLM's linear expert placement), under one of two routings (``collector/helper.py``):

- ``balanced`` (``balanced_logits``): token i's j-th expert is ``(i + j x stride) mod E``, ``stride = ceil(E /
  topk)``, or ``(i x stride / tokens + j x stride) mod E`` when ``tokens < stride``. Deterministic: rank 0's pairs
  and distinct experts are counted exactly. Uniform on average, but not at few tokens on wide EP, where uniform
  routing expects a fraction of a pair on the rank while token 0's first expert (expert 0) always lands there.
- ``power_law_<alpha>`` (``_generate_power_law_distribution``):

  1. ``x_e`` for each of the E experts from a power law on ``[1, 0.8 x tokens]`` (``[0.01, 2]`` when
     ``tokens x topk <= E``) by inverse CDF, ``x = ((hi^(1-a) - lo^(1-a)) u + lo^(1-a))^(1/(1-a))``, u uniform;
  2. ``n_e = round(x_e / sum(x) x tokens x topk)``, the rounding error put back one pair at a time on the
     largest experts (or taken from the smallest);
  3. the EP group of ``E / ep`` consecutive experts with the most pairs is swapped to rank 0, the rank timed.

  So rank 0 computes the most-loaded group's pairs (more than ``tokens x topk / ep``: A100's EP 2-256 rows ran
  0.85-0.94x of the uniform fit) and reads only the weights of its experts that got a token (far fewer than
  uniform at small and mid token counts: EP 1 rows ran 1.16x). The table's latency is the mean over the
  collector's draws (10 at vLLM 0.14); this module takes the mean pairs and touched experts over ``DRAWS``
  seeded draws of the same generator.

Either way the counts go to ``moe_work`` (``pairs``, ``touched``), which otherwise keeps its formulas.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence

import numpy as np

from actors.cost_model import moe_work

DRAWS = 10
"""Draws per table row, as aiconfigurator's vLLM 0.14 MoE collector averages (``num_iter = 10``)."""
SEED = 12


@functools.cache  # (a pure function of its arguments: a table's model shapes repeat each routing many times)
def power_law_rank0(tokens: int, topk: int, experts: int, ep: int, alpha: float, draws: int = DRAWS,
                    seed: int = SEED) -> tuple[float, float]:
    """Mean (pairs, experts with at least one pair) on the most-loaded EP rank under aiconfigurator's power-law
    routing of ``tokens`` tokens to ``topk`` of ``experts`` experts with exponent ``alpha`` (module docstring)."""
    if tokens < 1 or topk < 1 or experts < 1 or ep < 1 or experts % ep or alpha <= 0 or alpha == 1.0:
        raise ValueError(f"power-law routing needs tokens, topk, experts, ep >= 1, ep dividing experts and "
                         f"alpha > 0, != 1: got {tokens=}, {topk=}, {experts=}, {ep=}, {alpha=}")
    rng = np.random.default_rng(seed)
    target = tokens * topk
    lo, hi = (1.0, tokens * 0.8) if target > experts else (0.01, 2.0)
    a = 1.0 - alpha
    pairs = touched = 0.0
    for _ in range(draws):
        x = ((hi ** a - lo ** a) * rng.random(experts) + lo ** a) ** (1.0 / a)
        n = np.round(x / x.sum() * target).astype(np.int64)
        delta = target - int(n.sum())
        order = np.argsort(-n, kind="stable")
        for i in range(abs(delta)):
            if delta > 0:
                n[order[i % experts]] += 1
            else:
                j = order[-(i % experts) - 1]
                n[j if n[j] > 0 else int(np.argmax(n))] -= 1
        groups = n.reshape(ep, experts // ep)
        rank0 = groups[int(np.argmax(groups.sum(axis=1)))]
        pairs += float(rank0.sum())
        touched += float(np.count_nonzero(rank0))
    return pairs / draws, touched / draws


@functools.cache
def balanced_rank0(tokens: int, topk: int, experts: int, ep: int) -> tuple[float, float]:
    """(pairs, distinct experts) on rank 0 of ``ep`` under aiconfigurator's ``balanced_logits`` (module docstring)."""
    if tokens < 1 or topk < 1 or experts < 1 or ep < 1 or experts % ep:
        raise ValueError(f"balanced routing needs tokens, topk, experts, ep >= 1 and ep dividing experts: got "
                         f"{tokens=}, {topk=}, {experts=}, {ep=}")
    stride = math.ceil(experts / topk)
    i = np.arange(tokens, dtype=float)[:, None]
    j = np.arange(topk, dtype=float)[None, :] * stride
    chosen = ((i if tokens >= stride else i * stride / tokens) + j) % experts
    local = chosen.astype(np.int64)
    local = local[local < experts // ep]
    return float(local.size), float(np.unique(local).size)


def moe_table_work(t: dict[str, np.ndarray], distribution: str, weight_bytes: float,
                   exact_balanced: bool = True, block_m: Sequence[int] = (),
                   block_tokens: Sequence[int] = ()) -> np.ndarray:
    """``moe_work`` (FLOPs, bytes, size, width) of every row of an op table's MoE rows of one ``distribution``,
    with rank 0's pairs and touched experts under that routing (``balanced`` or ``power_law_<alpha>``);
    ``exact_balanced`` False: balanced rows take the uniform expectation instead; ``block_m``, ``block_tokens``: the
    Triton blocks the pairs are padded to (``OpFit.moe_block_m``, ``moe_block_tokens``)."""
    alpha = float(distribution.removeprefix("power_law_")) if distribution.startswith("power_law_") else None
    if alpha is None and distribution != "balanced":
        raise ValueError(f"unknown MoE routing distribution {distribution!r} (balanced or power_law_<alpha>)")
    cols = ("num_tokens", "hidden_size", "inter_size", "topk", "num_experts", "moe_tp_size", "moe_ep_size")
    cache: dict[tuple[int, ...], tuple[float, float, float, float]] = {}
    out = []
    for row in zip(*(t[c].tolist() for c in cols), strict=True):
        key = tuple(int(v) for v in row)
        if key not in cache:
            nt, hd, it, k, e, tp, ep = key
            routed: tuple[float | None, float | None] = (None, None)
            if alpha is not None:
                routed = power_law_rank0(nt, k, e, ep, alpha)
            elif exact_balanced:
                routed = balanced_rank0(nt, k, e, ep)
            cache[key] = moe_work(float(nt), hd, it, k, e, tp, ep, weight_bytes, pairs=routed[0], touched=routed[1],
                                  block_m=block_m, block_tokens=block_tokens)
        out.append(cache[key])
    return np.array(out, dtype=float).reshape(-1, 4)


__all__ = ["DRAWS", "balanced_rank0", "moe_table_work", "power_law_rank0"]

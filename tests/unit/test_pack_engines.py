"""How the launch packs engines into actors: by node, by gpus_per_actor, or (default) from the host's cores."""

from __future__ import annotations

from typing import Any

import pytest

from cluster.launch import pack_engines
from config import ClusterSpec


def engines(nodes: list[tuple[int, int]]) -> Any:
    """``nodes``: (gpus, tp) per node, each filled with replicas of that tp."""
    return ClusterSpec.model_validate({"name": "p", "nodes": [
        {"name": f"n{i}", "region": "local", "hardware": "h100-80g-sxm", "gpus": g,
         "engines": [{"name": f"e{i}", "model": "llama-3.1-8b", "tp": tp, "replicas": g // tp}]}
        for i, (g, tp) in enumerate(nodes)]}).engines()


def shape(groups: list[list[Any]]) -> list[list[str]]:
    return [[e.name for e in g] for g in groups]


def test_fixed_gpus_per_actor_never_mixes_nodes() -> None:
    got = shape(pack_engines(engines([(4, 1), (2, 1)]), 3))
    assert got == [["e0-0", "e0-1", "e0-2"], ["e0-3"], ["e1-0", "e1-1"]]


@pytest.mark.parametrize(("nodes", "cores", "expected"), [
    ([(8, 1)], 1, [8]),  # one core: one actor for the node
    ([(8, 1)], 2, [4, 4]),  # two cores, one node: the node split in two
    ([(4, 1)], 16, [1, 1, 1, 1]),  # never more actors than engines
    ([(8, 1), (8, 1)], 2, [8, 8]),  # as many nodes as cores: one actor per node
    ([(8, 1)] * 4, 2, [8, 8, 8, 8]),  # more nodes than cores: still one per node
    ([(8, 2)], 4, [2, 2, 2, 2]),  # tp 2: 4 engines of 2 GPUs, an engine never split
])
def test_default_density_follows_nodes_and_cores(nodes: list[tuple[int, int]], cores: int,
                                                  expected: list[int]) -> None:
    groups = pack_engines(engines(nodes), None, cores)
    assert [sum(e.tp for e in g) for g in groups] == expected
    assert all(len({e.node for e in g}) == 1 for g in groups)

"""The router package stays layered: no import cycle among its modules, none over about 450 lines; config
imports no router or transport module; a bad router spec is refused before anything starts."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

import cluster.router

PACKAGE = Path(cluster.router.__file__).parent
MAX_LINES = 450


def modules() -> dict[str, Path]:
    out = {}
    for path in PACKAGE.rglob("*.py"):
        rel = path.relative_to(PACKAGE.parent.parent).with_suffix("")
        name = ".".join(rel.parts).removesuffix(".__init__")
        out[name] = path
    return out


def imports_of(path: Path, known: set[str]) -> set[str]:
    """Modules of the package ``path`` imports, at run time or for type checking alike."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        names: list[str] = []
        if isinstance(node, ast.ImportFrom) and node.module:
            names = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
        elif isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        found.update(n for n in names if n in known)
    return found


def test_no_import_cycle_inside_the_router() -> None:
    mods = modules()
    graph = {m: imports_of(p, set(mods)) - {m} for m, p in mods.items()}
    # A package's __init__ re-exporting its submodules is not a cycle of the submodules themselves.
    graph = {m: {d for d in deps if not (m.startswith(d + "."))} for m, deps in graph.items()}
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(m: str) -> None:
        state[m] = 1
        stack.append(m)
        for d in sorted(graph[m]):
            if state.get(d) == 1:
                raise AssertionError("import cycle: " + " -> ".join([*stack[stack.index(d):], d]))
            if d not in state:
                visit(d)
        stack.pop()
        state[m] = 2

    for m in sorted(graph):
        if m not in state:
            visit(m)


def test_no_router_module_is_over_450_lines() -> None:
    sizes = {str(p.relative_to(PACKAGE)): len(p.read_text().splitlines()) for p in modules().values()}
    assert {p: n for p, n in sizes.items() if n > MAX_LINES} == {}


def test_config_imports_neither_the_router_nor_the_transport() -> None:
    code = ("import sys, config, config.cluster; "
            "print(sorted(m for m in sys.modules if m.split('.')[0] in ('cluster', 'transport', 'actors')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


def test_launch_refuses_a_misspelt_policy_parameter_before_starting_anything() -> None:
    from cluster.launch import launch
    from config import ClusterSpec

    spec = ClusterSpec.model_validate({
        "name": "bad", "nodes": [{"name": "n", "region": "local", "hardware": "h100-80g-sxm", "gpus": 1,
                                  "engines": [{"name": "e", "model": "llama-3.1-8b"}]}],
        "router": {"policy": "kv_aware", "policy_params": {"overlap_weigth": 2}}})
    with pytest.raises(ValueError, match=r"router.policy_params: .*overlap_weigth"):
        launch(spec)

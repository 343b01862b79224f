"""Chaos tests start real clusters: every test here is ``integration`` and ``slow``; one embedded Ray per session."""

from __future__ import annotations

import os
import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        if HERE in item.path.parents:
            item.add_marker(pytest.mark.integration)
            item.add_marker(pytest.mark.slow)


@pytest.fixture(scope="session")
def ray_cluster() -> Iterator[str]:
    """A local Ray cluster for the whole session (its own temp dir; never attaches to another one)."""
    import ray

    from cluster.launch import start_local_ray

    if ray.is_initialized():  # another conftest's session fixture started it
        yield ""
        return
    tmp = start_local_ray(num_cpus=4, configure_logging=False,
                          runtime_env={"env_vars": {"PYTHONPATH": os.getcwd()}})
    try:
        yield tmp
    finally:
        ray.shutdown()
        shutil.rmtree(tmp, ignore_errors=True)

"""One embedded Ray cluster per test session, started with its own temp dir and stopped by handle."""

from __future__ import annotations

import os
import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Every test here is ``integration``; one that starts Ray (``ray_cluster``) is also ``slow``, so
    ``-m "not slow"`` runs the socket-level tests alone."""
    for item in items:
        if HERE in item.path.parents:
            item.add_marker(pytest.mark.integration)
            if "ray_cluster" in getattr(item, "fixturenames", ()):
                item.add_marker(pytest.mark.slow)


@pytest.fixture(scope="session")
def ray_cluster() -> Iterator[object]:
    """A local Ray cluster for the whole session (never attaches to another cluster on the host)."""
    import ray

    from cluster.launch import start_local_ray

    tmp = start_local_ray(num_cpus=4, configure_logging=False,
                          runtime_env={"env_vars": {"PYTHONPATH": os.getcwd()}})
    try:
        yield tmp
    finally:
        ray.shutdown()
        shutil.rmtree(tmp, ignore_errors=True)

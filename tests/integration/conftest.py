"""One embedded Ray cluster per test session, started with its own temp dir and stopped by handle."""

from __future__ import annotations

import os
import shutil
from collections.abc import Iterator

import pytest


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

"""One embedded Ray cluster per test session, started with its own temp dir and stopped by handle."""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Iterator

import pytest


@pytest.fixture(scope="session")
def ray_cluster() -> Iterator[object]:
    """A local Ray cluster for the whole session (never attaches to another cluster on the host)."""
    import ray

    tmp = tempfile.mkdtemp(prefix="kvr-", dir="/tmp")
    ctx = ray.init(address="local", _temp_dir=tmp, num_cpus=4, include_dashboard=False,
                   log_to_driver=False, configure_logging=False,
                   runtime_env={"env_vars": {"PYTHONPATH": os.getcwd()}})
    try:
        yield ctx
    finally:
        ray.shutdown()
        shutil.rmtree(tmp, ignore_errors=True)

"""Shared test fixtures: where the shared data lives, and how to skip without it."""

from __future__ import annotations

import os
import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[1]
SHARED = REPO_ROOT.parent / "shared"


def shared_path(*parts: str) -> Path:
    """A file under ../shared, or skip the test saying why."""
    p = SHARED.joinpath(*parts)
    if not p.exists():
        pytest.skip(f"{p} is absent: the shared data folder (traces, calibration) is not next to this checkout")
    return p


@pytest.fixture(scope="session")
def ray_cluster() -> Iterator[str]:
    """One local Ray cluster for the whole test session, shared by the integration and chaos tests.

    Started with its own temp dir (never attaches to another cluster on the host) and stopped by handle.
    """
    import ray

    from cluster.launch import start_local_ray

    tmp = start_local_ray(num_cpus=4, configure_logging=False,
                          runtime_env={"env_vars": {"PYTHONPATH": os.getcwd()}})
    try:
        yield tmp
    finally:
        ray.shutdown()
        shutil.rmtree(tmp, ignore_errors=True)

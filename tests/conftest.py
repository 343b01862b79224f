"""Shared test fixtures: where the shared data lives, and how to skip without it."""

from __future__ import annotations

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

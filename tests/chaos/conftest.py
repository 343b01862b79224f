"""Chaos tests start real clusters: each is ``integration`` and ``slow``.

The session's one Ray cluster is ``tests/conftest.py``'s ``ray_cluster``.
"""

from __future__ import annotations

from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        if HERE in item.path.parents:
            item.add_marker(pytest.mark.integration)
            item.add_marker(pytest.mark.slow)

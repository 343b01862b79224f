"""Every test here is ``integration``; one that starts Ray is also ``slow``.

The session's one Ray cluster is ``tests/conftest.py``'s ``ray_cluster``.
"""

from __future__ import annotations

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

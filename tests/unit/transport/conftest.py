"""Unit-test helpers for the transport: the shared virtual clock, and a check that no task is left behind."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from actors.clock import Clock
from tests.virtual_clock import VirtualClock as SharedVirtualClock


class VirtualClock(SharedVirtualClock):
    """The shared virtual clock (``tests/virtual_clock.py``), except that wall-clock deadlines never fire.

    The transport turns emulated deadlines into wall-clock timeouts (``asyncio.timeout``); on virtual time
    those would expire in real seconds while emulated time stands still, so here they lie an hour away.
    """

    wall_offset_s = 3600.0


@pytest.fixture
def vclock() -> VirtualClock:
    return VirtualClock()


@pytest.fixture
def clock() -> Clock:
    return Clock(1.0)


@pytest.fixture(autouse=True)
async def no_tasks_left_behind() -> Any:
    """Every test leaves no task running on its loop."""
    yield
    for _ in range(3):
        await asyncio.sleep(0)
    leftover = [t for t in asyncio.all_tasks() if t is not asyncio.current_task() and not t.done()]
    assert not leftover, f"tasks left behind: {leftover}"

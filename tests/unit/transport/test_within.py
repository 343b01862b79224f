"""``within``: a call's deadline scope turns expiry and backend exceptions into the transport's typed errors."""

from __future__ import annotations

import asyncio

import pytest

from actors.clock import Clock
from transport.base import ConnectError, IntegrityError, PeerGone, TransferTimeout
from transport.endpoint import within


def test_the_body_runs_to_completion_before_its_deadline() -> None:
    async def main() -> int:
        clock = Clock()
        async with within(clock, clock.now_ms() + 10_000, "op"):
            await asyncio.sleep(0)
            return 7

    assert asyncio.run(main()) == 7


def test_a_missed_deadline_cancels_the_body_and_raises_transfer_timeout() -> None:
    cancelled = []

    async def main() -> None:
        clock = Clock()
        async with within(clock, clock.now_ms() - 1.0, "push r to x"):  # already past: fires at once
            try:
                await asyncio.Event().wait()
            except asyncio.CancelledError:
                cancelled.append(True)
                raise

    with pytest.raises(TransferTimeout, match="push r to x: missed its deadline"):
        asyncio.run(main())
    assert cancelled == [True]


@pytest.mark.parametrize(("raised", "expected"), [
    (ConnectionResetError("reset"), PeerGone), (OSError(111, "refused"), ConnectError),
    (IntegrityError("bad"), IntegrityError), (TimeoutError(), TransferTimeout)])
def test_backend_exceptions_come_out_typed(raised: BaseException, expected: type[BaseException]) -> None:
    async def main() -> None:
        clock = Clock()
        async with within(clock, clock.now_ms() + 10_000, "op"):
            raise raised

    with pytest.raises(expected):
        asyncio.run(main())


def test_other_exceptions_pass_through() -> None:
    async def main() -> None:
        clock = Clock()
        async with within(clock, clock.now_ms() + 10_000, "op"):
            raise KeyError("mine")

    with pytest.raises(KeyError):
        asyncio.run(main())

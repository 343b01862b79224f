"""ucx's own default for where checksums run: on the worker's thread unless the caller chose otherwise."""

from __future__ import annotations

from transport import TransportOptions
from transport.ucx import ucx_options
from transport.verify import VERIFY_THREAD_MIN


def test_ucx_checks_payloads_on_the_workers_thread_by_default() -> None:
    assert TransportOptions().verify_thread_min_bytes == VERIFY_THREAD_MIN  # the framed backends' default
    assert ucx_options(None).verify_thread_min_bytes == 0
    o = ucx_options(TransportOptions(ucx_inflight_bytes=4 << 20))
    assert (o.verify_thread_min_bytes, o.ucx_inflight_bytes) == (0, 4 << 20)  # other choices kept


def test_a_chosen_threshold_is_kept() -> None:
    for chosen in (VERIFY_THREAD_MIN, 1 << 20, 0):
        assert ucx_options(TransportOptions(verify_thread_min_bytes=chosen)).verify_thread_min_bytes == chosen

"""The probe's search for the smallest time scale a host can hold (a fake host: lag = f(scale))."""

from __future__ import annotations

from collections.abc import Callable

import pytest

from cluster.cli.probe import SearchBounds, Trial, search_scale


def host(limit: float, bound: float = 5.0) -> tuple[list[float], Callable[[float], Trial]]:
    """A host that keeps up at scales >= ``limit`` (lag grows as the scale falls below it)."""
    asked: list[float] = []

    def measure(scale: float) -> Trial:
        asked.append(scale)
        lag = 1.0 if scale >= limit else 1.0 + 50.0 * (limit / scale - 1.0) + bound
        return Trial(scale, lag, lag <= bound)

    return asked, measure


@pytest.mark.parametrize("limit", [0.03, 0.13, 0.5, 0.9, 1.0, 3.7, 11.0])
def test_finds_the_limit_within_the_tolerance(limit: float) -> None:
    asked, measure = host(limit)
    bounds = SearchBounds(start=1.0, smallest=0.02, largest=16.0, tolerance=1.25)
    best, trials = search_scale(measure, bounds)
    assert best is not None and limit <= best <= limit * 1.25
    assert [t.time_scale for t in trials] == asked and len(asked) <= 12
    assert all(t.passed == (t.time_scale >= limit) for t in trials)


def test_a_host_that_holds_even_the_smallest_scale_stops_there() -> None:
    _, measure = host(0.001)
    best, trials = search_scale(measure, SearchBounds(start=0.5, smallest=0.1))
    assert best == 0.1 and trials[-1].time_scale == 0.1


def test_no_scale_holds_gives_none() -> None:
    _, measure = host(100.0)
    best, trials = search_scale(measure, SearchBounds(start=1.0, largest=8.0))
    assert best is None and [t.time_scale for t in trials] == [1.0, 2.0, 4.0, 8.0]


@pytest.mark.parametrize("kw", [{"smallest": 0.0}, {"start": 20.0}, {"tolerance": 1.0}])
def test_bad_bounds_are_refused(kw: dict[str, float]) -> None:
    with pytest.raises(ValueError):
        SearchBounds(**kw)

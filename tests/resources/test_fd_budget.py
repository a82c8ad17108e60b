"""FdBudget: which waiting connection is served, shed or left queued (unit, injected counts)."""

from __future__ import annotations

import pytest

from proxy._fdlimit import FdBudget, Verdict, reserve_problem


class _Counts:
    def __init__(self, open_fds: int | None) -> None:
        self.open_fds = open_fds
        self.calls = 0

    def __call__(self) -> int | None:
        self.calls += 1
        return self.open_fds


def _budget(open_fds: int | None, *, upstream: int = 0, limit: int = 100) -> FdBudget:
    return FdBudget(
        16, upstream_sockets=lambda: upstream, count=_Counts(open_fds), limit=lambda: limit
    )


def test_a_connection_is_served_while_the_reserve_stays_free_after_its_two() -> None:
    # 100 - 50 open - 32 served without an upstream socket = 18: after two, 16 stay.
    assert _budget(50).verdict(32) is Verdict.SERVE
    assert _budget(50).verdict(33) is Verdict.SHED
    # Served connections holding their upstream socket already need none more.
    assert _budget(50, upstream=33).verdict(33) is Verdict.SERVE


def test_below_the_reserve_connections_are_shed_and_under_a_quarter_of_it_accepting_pauses() -> (
    None
):
    assert _budget(95).verdict(0) is Verdict.SHED  # 5 free: one for the shed connection, 4 left
    assert _budget(96).verdict(0) is Verdict.PAUSE
    assert _budget(100).verdict(0) is Verdict.PAUSE


def test_uncountable_descriptors_serve_everyone() -> None:
    assert _budget(None).verdict(1000) is Verdict.SERVE


def test_far_from_the_limit_descriptors_are_counted_once_a_second_near_it_every_time() -> None:
    far = _Counts(10)
    now = [0.0]
    budget = FdBudget(16, count=far, limit=lambda: 10_000, clock=lambda: now[0])
    for _ in range(5):
        assert budget.verdict(0) is Verdict.SERVE
        budget.accepted()
    assert far.calls == 1
    now[0] = 1.5
    budget.verdict(0)
    assert far.calls == 2
    near = _Counts(60)
    budget = FdBudget(16, count=near, limit=lambda: 100, clock=lambda: now[0])
    for _ in range(5):
        budget.verdict(0)
    assert near.calls == 5


def test_a_reserve_under_four_is_refused() -> None:
    with pytest.raises(ValueError, match="fd_reserve"):
        FdBudget(3)


def test_a_reserve_of_half_the_limit_or_more_is_a_problem() -> None:
    assert reserve_problem(16, 256) is None
    assert reserve_problem(128, 256) is None
    problem = reserve_problem(129, 256)
    assert problem is not None and "fd_reserve: 129" in problem and "256" in problem

"""The upstream pool's policy (proxy/_pool.py), without sockets or an event loop: which
connection a request gets, who waits and in what order, what to close."""

from __future__ import annotations

from collections.abc import Sequence

from proxy._pool import OPEN, WAIT, Close, Park, PoolPolicy, Reuse, Wake

Policy = PoolPolicy[str, str, str]


def policy(limit: int = 0, cancelled: frozenset[str] = frozenset()) -> Policy:
    return PoolPolicy(limit, lambda waiter: waiter not in cancelled)


def alive(conn: str) -> bool:
    return not conn.startswith("dead")


def wakes(actions: Sequence[object]) -> list[str]:
    return [str(a.waiter) for a in actions if isinstance(a, Wake)]


def test_without_a_limit_every_request_opens_or_reuses_at_once() -> None:
    pool = policy()
    for n in range(3):
        assert pool.checkout("a", usable=alive) is OPEN
        pool.opened(f"c{n}")
    assert pool.in_use == 3 and pool.idle == 0


def test_a_kept_connection_is_reused_most_recent_first_and_only_on_its_route() -> None:
    pool = policy()
    for conn in ("c1", "c2"):
        pool.opened(conn)
    assert [type(a) for a in pool.checkin("a", "c1", reusable=True)] == [Park]
    assert [type(a) for a in pool.checkin("a", "c2", reusable=True)] == [Park]
    assert pool.checkout("b", usable=alive) is OPEN  # another route: a new connection
    grant = pool.checkout("a", usable=alive)
    assert isinstance(grant, Reuse) and grant.conn == "c2"
    assert pool.checkout("a", usable=alive, fresh=True) is OPEN  # a resend wants a new one
    assert (pool.idle, pool.in_use) == (1, 1)


def test_idle_connections_the_upstream_closed_are_skipped() -> None:
    pool = policy()
    for conn in ("c1", "dead2"):
        pool.opened(conn)
        pool.checkin("a", conn, reusable=True)
    grant = pool.checkout("a", usable=alive)
    assert isinstance(grant, Reuse) and grant.conn == "c1"
    assert pool.idle == 0


def test_a_connection_that_cannot_be_reused_is_closed_and_its_place_handed_on() -> None:
    pool = policy(limit=1)
    assert pool.checkout("a", usable=alive) is OPEN
    pool.opened("c1")
    assert pool.checkout("a", usable=alive) is WAIT
    pool.enqueue("w1")
    actions = pool.checkin("a", "c1", reusable=False)
    assert [type(a) for a in actions] == [Close, Wake] and wakes(actions) == ["w1"]
    assert pool.reserved == 1
    assert pool.checkout("a", usable=alive, woken=True) is OPEN
    assert pool.reserved == 0


def test_waiters_are_served_first_come_first_served_and_never_overtaken() -> None:
    pool = policy(limit=1)
    pool.checkout("a", usable=alive)
    pool.opened("c1")
    for waiter in ("w1", "w2"):
        assert pool.checkout("a", usable=alive) is WAIT
        pool.enqueue(waiter)
    actions = pool.checkin("a", "c1", reusable=True)
    assert wakes(actions) == ["w1"]
    # A newcomer while w1 holds the freed place (not yet checked out): it waits too.
    assert pool.checkout("a", usable=alive) is WAIT
    grant = pool.checkout("a", usable=alive, woken=True)
    assert isinstance(grant, Reuse) and grant.conn == "c1"
    assert wakes(pool.dropped("c1")) == ["w2"]


def test_a_waiter_cancelled_once_woken_passes_its_place_on() -> None:
    pool = policy(limit=1)
    pool.checkout("a", usable=alive)
    pool.opened("c1")
    for waiter in ("w1", "w2"):
        pool.enqueue(waiter)
    assert wakes(pool.dropped("c1")) == ["w1"]
    assert wakes(pool.withdraw("w1", woken=True)) == ["w2"]
    assert pool.reserved == 1 and pool.waiters == 0


def test_a_waiter_cancelled_before_its_turn_leaves_the_queue_and_is_skipped() -> None:
    pool = policy(limit=1, cancelled=frozenset({"w2"}))
    pool.checkout("a", usable=alive)
    pool.opened("c1")
    for waiter in ("w1", "w2", "w3"):
        pool.enqueue(waiter)
    assert pool.withdraw("w1", woken=False) == [] and pool.waiters == 2
    # w2 was cancelled but its cleanup has not run yet: the place goes to w3.
    assert wakes(pool.dropped("c1")) == ["w3"]
    assert pool.reserved == 1


def test_a_connection_dropped_twice_or_not_in_use_frees_nothing() -> None:
    pool = policy(limit=1)
    pool.checkout("a", usable=alive)
    pool.opened("c1")
    pool.enqueue("w1")
    assert wakes(pool.dropped("c1")) == ["w1"]
    assert pool.dropped("c1") == [] and pool.reserved == 1


def test_closing_fails_every_waiter_closes_every_connection_and_refuses_reuse() -> None:
    pool = policy(limit=2)
    for conn in ("c1", "c2"):
        pool.checkout("a", usable=alive)
        pool.opened(conn)
    pool.checkin("a", "c1", reusable=True)
    pool.checkout("a", usable=alive)  # c1 back in use
    pool.checkin("a", "c1", reusable=True)
    pool.enqueue("w1")
    actions = pool.shut()
    assert sorted(
        (type(a).__name__, getattr(a, "conn", getattr(a, "waiter", ""))) for a in actions
    ) == [
        ("Close", "c1"),
        ("Close", "c2"),
        ("Fail", "w1"),
    ]
    assert pool.closed and pool.idle == 0 and pool.waiters == 0
    # An answer finishing after the close: its connection is closed, not kept.
    assert [type(a) for a in pool.checkin("a", "c2", reusable=True)] == [Close]

"""Session registry: lock rules, in-flight tracking, tombstones, close_all.

Ordering is done with asyncio.Event and an injected clock, never with sleeps. The
only wall-clock waits are the shutdown grace period under test (GRACE_S) and the
deadlock detector (DEADLOCK_TIMEOUT_S), both bounded by asyncio.timeout.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable

import pytest

from proxy._sessions import (
    SessionClosed,
    SessionCloseError,
    SessionRegistry,
    SessionShutdown,
    ShutdownResult,
    _Session,
    shutdown_cause,
)

GRACE_S = 0.3
DEADLOCK_TIMEOUT_S = 0.5
BOUND_S = 5.0  # upper bound for waits that should finish at once


class FakeClock:
    """A monotonic clock the test moves by hand (seconds)."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


def make_registry(
    *,
    idle_cap: int = 100,
    tombstone_ttl: float = 60.0,
    tombstone_cap: int = 100,
    clock: FakeClock | None = None,
    on_close: Callable[[str], Awaitable[None]] | None = None,
) -> SessionRegistry:
    return SessionRegistry(
        idle_cap=idle_cap,
        tombstone_ttl=tombstone_ttl,
        tombstone_cap=tombstone_cap,
        clock=clock if clock is not None else FakeClock(),
        on_close=on_close,
    )


async def touch(registry: SessionRegistry, sid: str) -> None:
    """One minimal exchange: admitted, tracked, prepared under the lock."""
    with registry.track(sid):
        async with registry.locked(sid):
            pass


# --------------------------------------------------------------------------- lock rules


async def test_prepares_are_serialized_and_never_wait_for_a_stream() -> None:
    registry = make_registry()
    log: list[str] = []
    holders = 0
    max_holders = 0

    class Steps:
        def __init__(self) -> None:
            self.trying = asyncio.Event()
            self.in_prepare = asyncio.Event()
            self.finish_prepare = asyncio.Event()
            self.streaming = asyncio.Event()
            self.finish_stream = asyncio.Event()

    async def request(name: str, steps: Steps) -> None:
        nonlocal holders, max_holders
        with registry.track("s"):
            steps.trying.set()
            async with registry.locked("s"):
                holders += 1
                max_holders = max(max_holders, holders)
                log.append(f"{name} prepare")
                steps.in_prepare.set()
                await steps.finish_prepare.wait()
                holders -= 1
            steps.streaming.set()
            await steps.finish_stream.wait()  # the upstream stream: no lock held
            async with registry.locked("s"):
                log.append(f"{name} commit")

    first, second = Steps(), Steps()
    second.finish_prepare.set()
    async with asyncio.timeout(BOUND_S):
        t1 = asyncio.create_task(request("first", first))
        await first.in_prepare.wait()
        t2 = asyncio.create_task(request("second", second))
        # `trying` is set in the same step that then blocks on the lock.
        await second.trying.wait()
        assert not second.in_prepare.is_set()

        first.finish_prepare.set()
        await first.streaming.wait()
        # The second prepare runs to completion while the first is still streaming.
        await second.streaming.wait()
        assert not t1.done()
        info = registry.info("s")
        assert info is not None and info.in_flight == 2 and not info.locked

        first.finish_stream.set()
        second.finish_stream.set()
        await asyncio.gather(t1, t2)

    assert max_holders == 1
    assert log[:2] == ["first prepare", "second prepare"]
    assert sorted(log[2:]) == ["first commit", "second commit"]
    assert registry.in_flight_total == 0


async def test_holding_two_session_locks_raises() -> None:
    registry = make_registry()

    async def take_b() -> bool:
        async with registry.locked("b"):
            info = registry.info("b")
            return info is not None and info.locked

    async with registry.locked("a"):
        with pytest.raises(RuntimeError, match="rule 3"):
            async with registry.locked("b"):
                pass
        with pytest.raises(RuntimeError, match="rule 3"):
            async with registry.locked("a"):  # same session: would wait for itself
                pass
        with pytest.raises(RuntimeError, match="rule 3"):
            await registry.status("a")
        with pytest.raises(RuntimeError, match="rule 3"):
            await registry.shutdown_session("b", timeout=1.0)
        with pytest.raises(RuntimeError, match="rule 3"):
            await registry.close_all()
        # A child task awaited under the lock is the same flow: refused too.
        with pytest.raises(RuntimeError, match="rule 3"):
            await asyncio.wait_for(take_b(), timeout=BOUND_S)
        # One created here but run after the release is free.
        later = asyncio.create_task(take_b())
    async with asyncio.timeout(BOUND_S):
        assert await later

    assert registry.info("b") is not None
    assert not registry.is_tombstoned("b")  # the refused shutdown did nothing
    assert [info.locked for info in registry.snapshot()] == [False, False]


async def test_status_read_waits_for_a_commit_in_progress() -> None:
    registry = make_registry()
    plugin_state: dict[str, int] = {}
    half_done, finish = asyncio.Event(), asyncio.Event()

    async def commit() -> None:
        async with registry.locked("s"):
            plugin_state["requests"] = 1
            half_done.set()
            await finish.wait()  # e.g. a plugin flushing to disk mid-commit
            plugin_state["tokens"] = 42

    async with asyncio.timeout(BOUND_S):
        committer = asyncio.create_task(commit())
        await half_done.wait()
        reader = asyncio.create_task(registry.status("s", probe=lambda sid: dict(plugin_state)))
        quick = registry.info("s")  # the lock-free read does not wait
        assert quick is not None and quick.locked
        finish.set()
        status = await reader
        await committer
    assert status is not None and status.state == {"requests": 1, "tokens": 42}
    assert await registry.status("unknown") is None


@pytest.mark.parametrize(
    "bad", [{"idle_cap": -1}, {"tombstone_ttl": float("nan")}, {"tombstone_cap": -5}]
)
def test_registry_rejects_negative_or_non_finite_limits(bad: dict[str, float]) -> None:
    limits: dict[str, float] = {"idle_cap": 1, "tombstone_ttl": 1.0, "tombstone_cap": 1}
    limits.update(bad)
    with pytest.raises(ValueError, match=next(iter(bad))):
        SessionRegistry(
            idle_cap=int(limits["idle_cap"]),
            tombstone_ttl=limits["tombstone_ttl"],
            tombstone_cap=int(limits["tombstone_cap"]),
        )


# --------------------------------------------------------------------------- in-flight


async def test_track_deregisters_on_exception() -> None:
    registry = make_registry()
    with pytest.raises(ValueError, match="upstream said no"), registry.track("s"):
        assert registry.tasks("s") == {asyncio.current_task()}
        assert registry.in_flight_total == 1
        raise ValueError("upstream said no")
    info = registry.info("s")
    assert info is not None and info.in_flight == 0 and not info.pinned and info.requests == 1
    assert registry.tasks("s") == frozenset()
    assert registry.in_flight_total == 0


async def test_track_without_a_session_registers_nothing() -> None:
    registry = make_registry()
    with registry.track(None):
        assert registry.in_flight_total == 0
    assert registry.snapshot() == [] and registry.session_count == 0


async def test_track_deregisters_on_cancellation() -> None:
    registry = make_registry()
    entered = asyncio.Event()

    async def exchange() -> None:
        with registry.track("s"):
            entered.set()
            await asyncio.Event().wait()

    task = asyncio.create_task(exchange())
    async with asyncio.timeout(BOUND_S):
        await entered.wait()
        assert registry.tasks("s") == {task}
        info = registry.info("s")
        assert info is not None and info.pinned
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
    assert registry.tasks("s") == frozenset()
    assert registry.in_flight_total == 0


async def test_tracking_outlives_session_state_dropped_by_close_all() -> None:
    archived: list[str] = []

    async def on_close(sid: str) -> None:
        archived.append(sid)

    registry = make_registry(on_close=on_close)
    streaming, finish = asyncio.Event(), asyncio.Event()

    async def exchange() -> None:
        with registry.track("s"):
            streaming.set()
            await finish.wait()
            async with registry.locked("s"):  # commit after the state was archived
                pass

    task = asyncio.create_task(exchange())
    async with asyncio.timeout(BOUND_S):
        await streaming.wait()
        await registry.close_all()  # does not wait for in-flight exchanges
        assert archived == ["s"]
        assert registry.info("s") is None
        assert registry.tasks("s") == {task}
        finish.set()
        await task
    info = registry.info("s")  # the late commit got a fresh entry
    assert info is not None and info.requests == 0 and info.in_flight == 0
    assert registry.in_flight_total == 0


# --------------------------------------------------------------------------- LRU


async def test_idle_lru_evicts_least_recently_used_and_never_a_pinned_session() -> None:
    clock = FakeClock()
    closed: list[str] = []

    async def on_close(sid: str) -> None:
        closed.append(sid)

    registry = make_registry(idle_cap=2, clock=clock, on_close=on_close)
    pinned_in, pinned_done = asyncio.Event(), asyncio.Event()

    async def long_exchange() -> None:
        with registry.track("pinned"):
            async with registry.locked("pinned"):  # prepare
                pass
            pinned_in.set()
            await pinned_done.wait()  # streaming: in flight, lock released

    task = asyncio.create_task(long_exchange())
    async with asyncio.timeout(BOUND_S):
        await pinned_in.wait()
        for sid in ("a", "b", "c", "d"):
            clock.advance(1.0)
            await touch(registry, sid)
        assert {info.id for info in registry.snapshot()} == {"pinned", "c", "d"}
        assert registry.evictions == 2

        clock.advance(1.0)
        await touch(registry, "c")  # c is now more recent than d
        await touch(registry, "e")
        assert {info.id for info in registry.snapshot()} == {"pinned", "c", "e"}

        clock.advance(5.0)
        pinned = registry.info("pinned")
        assert pinned is not None and pinned.pinned and pinned.idle_s == 10.0

        pinned_done.set()
        await task  # "pinned" turns idle as the most recent one: c goes
    assert {info.id for info in registry.snapshot()} == {"e", "pinned"}
    assert registry.evictions == 4
    assert closed == []  # eviction drops the registry's entry only


async def test_a_session_whose_lock_is_held_is_never_evicted_even_with_no_idle_room() -> None:
    registry = make_registry(idle_cap=0)
    in_commit, commit_done = asyncio.Event(), asyncio.Event()

    async def slow_commit() -> None:
        async with registry.locked("busy"):  # a commit, after the exchange left track()
            in_commit.set()
            await commit_done.wait()

    task = asyncio.create_task(slow_commit())
    async with asyncio.timeout(BOUND_S):
        await in_commit.wait()
        for sid in ("a", "b"):
            await touch(registry, sid)  # idle at once, and idle_cap 0 keeps none
        busy = registry.info("busy")
        assert busy is not None and busy.locked
        assert [info.id for info in registry.snapshot()] == ["busy"]
        assert registry.evictions == 2
        commit_done.set()
        await task
    assert registry.snapshot() == [] and registry.evictions == 3


# --------------------------------------------------------------------------- shutdown_session


async def test_shutdown_session_waits_then_cancels_stragglers_and_tombstones() -> None:
    clock = FakeClock()
    registry: SessionRegistry
    closed: list[tuple[str, int, dict[str, bool]]] = []
    upstream_closed: dict[str, bool] = {}

    async def on_close(sid: str) -> None:
        closed.append((sid, registry.in_flight_total, dict(upstream_closed)))

    registry = make_registry(tombstone_ttl=60.0, clock=clock, on_close=on_close)
    streaming = {"fast": asyncio.Event(), "slow": asyncio.Event()}
    finish = {"fast": asyncio.Event(), "slow": asyncio.Event()}
    causes: dict[str, SessionShutdown | None] = {}

    async def exchange(name: str) -> None:
        with registry.track("s"):
            try:
                streaming[name].set()
                await finish[name].wait()
            except asyncio.CancelledError as exc:
                causes[name] = shutdown_cause(exc)
                raise
            finally:
                upstream_closed[name] = True  # where the relay aborts its upstream

    fast = asyncio.create_task(exchange("fast"))
    slow = asyncio.create_task(exchange("slow"))
    async with asyncio.timeout(GRACE_S + BOUND_S):
        await streaming["fast"].wait()
        await streaming["slow"].wait()
        assert registry.tasks("s") == {fast, slow}

        shutdown = registry.start_shutdown("s", timeout=GRACE_S)
        assert registry.is_tombstoned("s")
        with pytest.raises(SessionClosed):
            registry.admit("s")
        with pytest.raises(SessionClosed), registry.track("s"):
            pass
        finish["fast"].set()
        result = await shutdown

    assert result == ShutdownResult(sid="s", finished=1, cancelled=1)
    assert fast.done() and not fast.cancelled()
    assert slow.cancelled()
    assert causes == {"slow": SessionShutdown("s")}
    assert closed == [("s", 0, {"fast": True, "slow": True})]
    assert registry.info("s") is None and registry.tasks("s") == frozenset()

    # Late requests after completion: refused, nothing created.
    with pytest.raises(SessionClosed) as refused:
        registry.admit("s")
    assert refused.value.retry_after == 60.0
    with pytest.raises(SessionClosed):
        async with registry.locked("s"):
            pass
    assert registry.info("s") is None

    again = await registry.shutdown_session("s", timeout=GRACE_S)
    assert again.already_closed and len(closed) == 1

    clock.advance(59.5)
    assert registry.is_tombstoned("s")
    with pytest.raises(SessionClosed) as refused:
        registry.admit("s")
    assert refused.value.retry_after == 0.5
    clock.advance(0.5)
    assert not registry.is_tombstoned("s")
    assert registry.tombstone_count == 0
    await touch(registry, "s")  # the id is usable again, as a new session
    info = registry.info("s")
    assert info is not None and info.requests == 1 and not info.tombstoned


async def test_concurrent_shutdowns_of_one_session_call_on_close_once() -> None:
    calls: list[str] = []
    entered, release = asyncio.Event(), asyncio.Event()

    async def on_close(sid: str) -> None:
        calls.append(sid)
        entered.set()
        await release.wait()

    registry = make_registry(on_close=on_close)
    await touch(registry, "s")
    async with asyncio.timeout(BOUND_S):
        first = asyncio.create_task(registry.shutdown_session("s", timeout=1.0))
        second = asyncio.create_task(registry.shutdown_session("s", timeout=1.0))
        third = asyncio.create_task(registry.shutdown_session("s", timeout=1.0))
        await entered.wait()
        third.cancel()  # a caller going away does not stop the shutdown
        release.set()
        results = await asyncio.gather(first, second)
        with pytest.raises(asyncio.CancelledError):
            await third
    assert calls == ["s"]
    assert results[0] == results[1] == ShutdownResult(sid="s", finished=0, cancelled=0)
    assert registry.info("s") is None and registry.is_tombstoned("s")


async def test_failed_shutdown_cleanup_keeps_the_session_for_a_retry() -> None:
    failing = True
    calls: list[str] = []

    async def on_close(sid: str) -> None:
        calls.append(sid)
        if failing:
            raise OSError("ledger disk full")

    registry = make_registry(idle_cap=0, on_close=on_close)
    await touch(registry, "s")
    registry.start_shutdown("s", timeout=1.0)  # creates the entry even when evicted
    with pytest.raises(SessionCloseError) as error:
        await registry.shutdown_session("s", timeout=1.0)
    assert error.value.sid == "s" and isinstance(error.value.cause, OSError)
    info = registry.info("s")
    assert info is not None and info.close_failed and info.tombstoned and not info.locked

    failing = False
    retry = await registry.shutdown_session("s", timeout=1.0)
    assert not retry.already_closed
    assert calls == ["s", "s"]
    assert registry.info("s") is None


async def test_close_all_and_shutdown_session_never_archive_twice() -> None:
    calls: list[str] = []
    entered: dict[str, asyncio.Event] = {"a": asyncio.Event(), "b": asyncio.Event()}
    release = asyncio.Event()

    async def on_close(sid: str) -> None:
        calls.append(sid)
        entered[sid].set()
        await release.wait()

    registry = make_registry(on_close=on_close)
    await touch(registry, "a")
    await touch(registry, "b")
    async with asyncio.timeout(BOUND_S):
        # b: its shutdown is in on_close when close_all starts; close_all awaits it.
        shutdown_b = asyncio.create_task(registry.shutdown_session("b", timeout=1.0))
        await entered["b"].wait()
        closer = asyncio.create_task(registry.close_all())
        # a: close_all is in on_close when a shutdown of a arrives.
        await entered["a"].wait()
        shutdown_a = asyncio.create_task(registry.shutdown_session("a", timeout=1.0))
        release.set()
        await asyncio.gather(closer, shutdown_a, shutdown_b)
    assert sorted(calls) == ["a", "b"]
    assert registry.session_count == 0
    assert registry.is_tombstoned("a") and registry.is_tombstoned("b")


async def test_shutdown_waiting_on_the_lock_of_a_session_close_all_archives() -> None:
    calls: list[str] = []
    entered, release = asyncio.Event(), asyncio.Event()

    async def on_close(sid: str) -> None:
        calls.append(sid)
        entered.set()
        await release.wait()

    registry = make_registry(on_close=on_close)
    await touch(registry, "a")
    loop = asyncio.get_running_loop()
    async with asyncio.timeout(BOUND_S):
        closer = asyncio.create_task(registry.close_all())
        await entered.wait()  # close_all holds a's lock, inside on_close
        shutdown = registry.start_shutdown("a", timeout=1.0)
        # Callbacks run in FIFO order: once this one has run, the shutdown task
        # has taken its first step, which ends blocked on a's lock.
        first_step_done = asyncio.Event()
        loop.call_soon(first_step_done.set)
        await first_step_done.wait()
        assert not shutdown.done()
        release.set()
        await closer
        result = await shutdown
    assert calls == ["a"]
    assert result == ShutdownResult(sid="a", finished=0, cancelled=0)
    assert registry.session_count == 0


async def test_tombstones_are_bounded_in_number_and_time() -> None:
    clock = FakeClock()
    registry = make_registry(tombstone_cap=100, tombstone_ttl=600.0, clock=clock)
    for i in range(10_000):
        await registry.shutdown_session(f"s{i}", timeout=0.0)
    assert registry.tombstone_count == 100
    assert registry.is_tombstoned("s9999") and registry.is_tombstoned("s9900")
    assert not registry.is_tombstoned("s9899") and not registry.is_tombstoned("s0")
    assert registry.session_count == 0
    clock.advance(600.0)
    assert registry.tombstone_count == 0


# --------------------------------------------------------------------------- close_all


class _RepublishUnderLock(SessionRegistry):
    """Test-only variant that breaks rule 4: a failed session is put back into the
    live dict at once while its lock is still held, and that lock is only released
    when close_all ends. A reader that finds it then waits on close_all."""

    def __init__(self, **kwargs: object) -> None:
        super().__init__(**kwargs)  # type: ignore[arg-type]
        self.still_held: list[asyncio.Lock] = []

    async def _close_detached(self, session: _Session) -> SessionCloseError | None:
        await session.lock.acquire()
        try:
            await self._archive(session)
        except SessionCloseError as failure:
            self._republish(session)
            self.still_held.append(session.lock)
            return failure
        session.lock.release()
        return None

    async def close_all(self) -> None:
        try:
            await super().close_all()
        finally:
            for lock in self.still_held:
                lock.release()
            self.still_held.clear()


@pytest.mark.parametrize("expect_deadlock", [False, True], ids=["rule4", "republish-under-lock"])
async def test_failing_close_all_with_concurrent_status_read(expect_deadlock: bool) -> None:
    failing = True
    archived: list[str] = []
    b_entered, release_b = asyncio.Event(), asyncio.Event()

    async def on_close(sid: str) -> None:
        if sid == "b":
            b_entered.set()
            await release_b.wait()
        if failing:
            raise OSError(f"flush of {sid} failed")
        archived.append(sid)

    kind = _RepublishUnderLock if expect_deadlock else SessionRegistry
    registry = kind(idle_cap=100, tombstone_ttl=60.0, tombstone_cap=100, on_close=on_close)
    await touch(registry, "a")
    await touch(registry, "b")

    closer = asyncio.create_task(registry.close_all())
    async with asyncio.timeout(BOUND_S):
        await b_entered.wait()  # a's cleanup has failed; b's is running
    reader = asyncio.create_task(registry.status("a", probe=lambda sid: {"seen": sid}))

    async def status_read_then_second_failure() -> None:
        async with asyncio.timeout(DEADLOCK_TIMEOUT_S):
            await asyncio.shield(reader)
            release_b.set()
            with pytest.raises(ExceptionGroup) as group:
                await closer
        failures = [f for f in group.value.exceptions if isinstance(f, SessionCloseError)]
        assert len(failures) == len(group.value.exceptions)
        assert sorted(failure.sid for failure in failures) == ["a", "b"]
        assert all(isinstance(failure.cause, OSError) for failure in failures)

    if expect_deadlock:
        with pytest.raises(TimeoutError):
            await status_read_then_second_failure()
        # Unwind, so the loop ends clean: the reader finishes once close_all does.
        release_b.set()
        async with asyncio.timeout(BOUND_S):
            with pytest.raises(ExceptionGroup):
                await closer
            await reader
        return

    await status_read_then_second_failure()
    status = reader.result()
    assert status is not None and status.info.closing and status.state == {"seen": "a"}
    for sid in ("a", "b"):
        info = registry.info(sid)  # re-published: readable, retryable, unlocked
        assert info is not None and not info.locked and not info.closing and info.close_failed
    async with asyncio.timeout(BOUND_S):
        fresh = await registry.status("b")
    assert fresh is not None and not fresh.info.closing

    failing = False
    async with asyncio.timeout(BOUND_S):
        await registry.close_all()
        assert archived == ["a", "b"]
        assert registry.session_count == 0
        await registry.close_all()
    assert archived == ["a", "b"]


async def test_stored_sessions_are_idle_entries_that_a_request_makes_live() -> None:
    """``add_stored``: listed not live with their age, evicted like any idle entry,
    dropped by ``close_all`` without ``on_close``, live once a request tracks them."""
    clock = FakeClock()
    closed: list[str] = []

    async def on_close(sid: str) -> None:
        closed.append(sid)

    registry = make_registry(idle_cap=2, clock=clock, on_close=on_close)
    assert registry.add_stored("oldest", 300.0)
    assert registry.add_stored("old", 120.0)
    assert not registry.add_stored("old", 1.0)  # already listed
    info = registry.info("old")
    assert info is not None and not info.live and info.requests == 0 and info.idle_s == 120.0
    assert registry.add_stored("recent", 5.0)  # over idle_cap: the oldest one goes
    assert registry.info("oldest") is None
    assert [i.id for i in registry.page(None, 10).sessions] == ["old", "recent"]

    with registry.track("recent", asyncio.current_task()):
        info = registry.info("recent")
        assert info is not None and info.live and info.requests == 1
    await registry.close_all()
    assert closed == ["recent"]  # "old" was never used here: dropped, not closed
    assert registry.session_count == 0

    await registry.shutdown_session("gone", 0.1)
    assert not registry.add_stored("gone", 1.0)  # tombstoned
    assert not make_registry(idle_cap=0).add_stored("any", 1.0)  # no idle entries kept

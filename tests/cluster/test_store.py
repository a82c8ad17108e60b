"""The Redis store and one node's cluster logic against a real redis-server.

The Lua scripts run in Redis itself (fakeredis would need lupa to run them, and
its Lua is not Redis's), so these tests start a redis-server on a loopback port
per test. Nodes here are :class:`ClusterNode` objects in this process with
registries of their own; the HTTP layer is tested in tests/cluster/test_e2e.py.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator
from typing import Any

import pytest
import redis.exceptions
from redis.crc import key_slot

from proxy._cluster import ClusterNode, ClusterUnavailable, RedisStore
from proxy._cluster.keys import SessionKeys
from proxy._cluster.store import _ConnectionQueue, read_closes
from proxy._sessions import SessionClosed, SessionRegistry, shutdown_cause
from tests.support.cluster import RedisServer
from tests.support.e2e import wait_until
from tests.support.ports import free_port

pytestmark = pytest.mark.timeout(60)


@pytest.fixture
async def store(redis_server: RedisServer) -> AsyncIterator[RedisStore]:
    s = RedisStore(redis_server.url, timeout=0.5, max_connections=8)
    try:
        yield s
    finally:
        await s.close()


def _registry() -> SessionRegistry:
    return SessionRegistry(idle_cap=100, tombstone_ttl=60.0, tombstone_cap=100)


def test_keys_of_a_session_share_one_cluster_slot() -> None:
    for sid in ("abc", "with}brace", "{tagged}", "h:" + "f" * 32):
        k = SessionKeys(sid)
        slots = {key_slot(key.encode()) for key in (k.tombstone, k.in_flight, k.tally, k.ledger)}
        assert len(slots) == 1, sid
    # The tag is the id: different sessions spread over the slots.
    assert len({key_slot(SessionKeys(f"s{n}").tombstone.encode()) for n in range(50)}) > 40


async def test_admission_registers_and_a_tombstone_refuses(store: RedisStore) -> None:
    assert await store.admit("s1", "n|b|ex-1", ttl=5.0) is None
    assert await store.in_flight("s1") == ["n|b|ex-1"]
    start = await store.begin_close("s1", "c1", tombstone_ttl=30.0)
    assert start.new and not start.done
    left = await store.admit("s1", "n|b|ex-2", ttl=5.0)
    assert left is not None and 29.0 < left <= 30.0
    # The refused exchange left no entry.
    assert await store.in_flight("s1") == ["n|b|ex-1"]
    again = await store.begin_close("s1", "c2", tombstone_ttl=30.0)
    assert not again.new and again.close_id == "c1" and not again.done


async def test_the_shared_tombstone_answers_its_remaining_life(store: RedisStore) -> None:
    """What the admin view of a node that missed a close reads: the tombstone's TTL."""
    assert await store.tombstone_left("gone") is None
    await store.begin_close("gone", "c1", tombstone_ttl=30.0)
    left = await store.tombstone_left("gone")
    assert left is not None and 29.0 < left <= 30.0


async def test_deregistration_counts_only_exchanges_in_flight_at_the_close(
    store: RedisStore,
) -> None:
    for n in range(3):
        assert await store.admit("s", f"n|b|ex-{n}", ttl=5.0) is None
    assert await store.deregister("s", "n|b|ex-0", cancelled=False)  # before the close
    await store.begin_close("s", "c", tombstone_ttl=30.0)
    assert await store.deregister("s", "n|b|ex-1", cancelled=False)
    assert await store.deregister("s", "n|b|ex-2", cancelled=True)
    assert not await store.deregister("s", "n|b|ex-2", cancelled=True)  # twice: counted once
    tally = await store.finish_close("s")
    assert (tally.finished, tally.cancelled, tally.expired, tally.done) == (1, 1, 0, True)
    assert (await store.begin_close("s", "again", tombstone_ttl=30.0)).done


async def test_entries_expire_without_heartbeat_and_live_with_it(store: RedisStore) -> None:
    assert await store.admit("s", "dead|b|ex-1", ttl=0.3) is None
    assert await store.admit("s", "live|b|ex-1", ttl=1.0) is None
    await store.begin_close("s", "c", tombstone_ttl=30.0)
    # 1.2 s: past both TTLs; the live entry is refreshed every 0.1 s (a loaded
    # machine may stall a refresh by up to 0.9 s without failing the test).
    for _ in range(12):
        await asyncio.sleep(0.1)
        await store.refresh({"s": ["live|b|ex-1"]}, ttl=1.0)
    assert await store.prune("s") == 1
    assert await store.in_flight("s") == ["live|b|ex-1"]
    assert (await store.tally("s")).expired == 1
    # A heartbeat never resurrects an entry that was pruned; a reconcile re-adds it.
    await store.refresh({"s": ["dead|b|ex-1"]}, ttl=5.0)
    assert await store.in_flight("s") == ["live|b|ex-1"]
    await store.refresh({"s": ["dead|b|ex-1"]}, ttl=5.0, readd=True)
    assert sorted(await store.in_flight("s")) == ["dead|b|ex-1", "live|b|ex-1"]


async def test_a_set_whose_nodes_all_died_vanishes(
    store: RedisStore, redis_server: RedisServer
) -> None:
    assert await store.admit("gone", "dead|b|ex-1", ttl=0.2) is None
    await asyncio.sleep(0.55)  # past twice the TTL
    import redis.asyncio as aioredis

    raw = aioredis.Redis.from_url(redis_server.url)
    try:
        assert await raw.exists(SessionKeys("gone").in_flight) == 0
    finally:
        await raw.aclose()


async def test_ledger_gate_outcomes(store: RedisStore) -> None:
    kw = {"request_bytes": 10, "response_bytes": 5, "last_activity": 1.5}
    assert await store.ledger_gate("s", digest="d1", comparable=True, **kw) == ("first", 0, False)
    assert await store.ledger_gate("s", digest="d1", comparable=True, **kw) == (
        "identical",
        0,
        False,
    )
    assert await store.ledger_gate("s", digest="d2", comparable=True, **kw) == (
        "reformat",
        0,
        False,
    )
    assert await store.ledger_gate("s", digest="d3", comparable=False, **kw) == (
        "revision",
        1,
        True,
    )
    state = await store.ledger_state("s")
    # The identical retry wrote nothing: three requests counted, not four.
    assert state["requests"] == "3" and state["digest"] == "d3"


async def test_ledger_last_activity_never_moves_back(store: RedisStore) -> None:
    """A commit with an older timestamp arriving after a newer one (another node, a
    slow commit) keeps the newer ``last_activity``, as the SQLite ledger's max() does."""

    async def gate(digest: str, at: float) -> None:
        await store.ledger_gate(
            "s", digest=digest, comparable=True, request_bytes=1, response_bytes=1, last_activity=at
        )

    await gate("d1", 200.0)
    await gate("d2", 100.5)  # older, counted (a reformat) but not the activity
    state = await store.ledger_state("s")
    assert state["requests"] == "2" and float(state["last_activity"]) == 200.0
    await gate("d3", 300.25)
    assert float((await store.ledger_state("s"))["last_activity"]) == 300.25


async def test_concurrent_verdict_flips_bump_the_epoch_once(redis_server: RedisServer) -> None:
    stores = [RedisStore(redis_server.url, timeout=0.5, max_connections=4) for _ in range(2)]
    try:
        kw = {"request_bytes": 1, "response_bytes": 1, "last_activity": 1.0}
        await stores[0].ledger_gate("s", digest="d0", comparable=True, **kw)
        results = await asyncio.gather(
            *(s.ledger_gate("s", digest="d1", comparable=False, **kw) for s in stores)
        )
        outcomes = sorted(r[0] for r in results)
        assert outcomes == ["identical", "revision"]
        assert (await stores[0].ledger_state("s"))["revision_epoch"] == "1"
    finally:
        for s in stores:
            await s.close()


async def test_an_unreachable_redis_raises_cluster_unavailable_within_the_timeout() -> None:
    s = RedisStore(f"redis://127.0.0.1:{free_port()}/0", timeout=0.3, max_connections=2)
    try:
        loop = asyncio.get_running_loop()
        began = loop.time()
        with pytest.raises(ClusterUnavailable) as caught:
            await s.admit("s", "n|b|e", ttl=1.0)
        assert loop.time() - began < 2.0
        assert "redis://" not in str(caught.value)
    finally:
        await s.close()


async def test_a_command_against_a_hung_redis_costs_one_timeout(
    redis_server: RedisServer,
) -> None:
    """``redis_timeout`` is what one command against a hung Redis costs (±10%): a
    timeout is not retried (redis-py's default Retry would, doubling it). A pooled
    connection, a fresh connection and the ledger gate's own client alike; and a
    restarted Redis is reached again on the next call."""
    from proxy import open_ledger_gate

    timeout = 1.0  # generous: ±10% is ±0.1 s of scheduling slack on a loaded machine
    store = RedisStore(redis_server.url, timeout=timeout, max_connections=8)
    fresh = RedisStore(redis_server.url, timeout=timeout, max_connections=2)
    gate = open_ledger_gate(redis_server.url, timeout=timeout)
    kw = {"request_bytes": 1, "response_bytes": 1, "last_activity": 1.0}
    try:
        # Connections pooled (and scripts loaded) before the hang.
        assert await store.admit("s", "n|b|e", ttl=5.0) is None
        assert (await gate.apply("s", digest="d1", comparable=True, **kw)).outcome == "first"

        async def took(call: Any) -> float:
            began = time.monotonic()
            with pytest.raises(ClusterUnavailable):
                await call
            return time.monotonic() - began

        with redis_server.hung():
            # Concurrently: one timeout's worth of wall time for all of them.
            costs = await asyncio.gather(
                took(store.admit("s", "n|b|e2", ttl=5.0)),
                took(store.ping()),
                took(store.tally("s")),
                took(store.refresh({"s": ["n|b|e"]}, ttl=5.0)),
                took(gate.apply("s", digest="d2", comparable=True, **kw)),
                took(fresh.admit("s", "n|b|e3", ttl=5.0)),  # connects to the hung server
            )
        for cost in costs:
            assert 0.9 * timeout <= cost <= 1.1 * timeout, costs
        # Restarted: every pooled connection is broken; the next call is served.
        redis_server.kill()
        redis_server.start(same_port=True)
        assert await store.admit("s2", "n|b|e", ttl=5.0) is None
        # The gate's breaker opened in the hang: it fails fast until its cool-off
        # ends, then its probe is served, within 2 x timeout of Redis returning.
        back = time.monotonic()
        outcome: str | None = None
        for _ in range(100):  # bounded: 100 x 0.05 s
            try:
                outcome = (await gate.apply("s2", digest="d1", comparable=True, **kw)).outcome
            except ClusterUnavailable:
                await asyncio.sleep(0.05)
                continue
            break
        assert outcome == "first"
        assert time.monotonic() - back <= 2 * timeout
    finally:
        await store.close()
        await fresh.close()
        await gate.close()


@pytest.mark.parametrize("connected", [True, False], ids=["answer-read-late", "connecting-late"])
async def test_a_loop_too_busy_to_read_in_time_is_not_an_outage(
    redis_server: RedisServer, connected: bool
) -> None:
    """A healthy Redis answers while this node's loop is blocked past the timeout
    (a loaded node: the audit's 1,000 closes beside a CPU hog). The call succeeds:
    only time Redis took counts against ``redis_timeout``, not the loop's lag,
    whether the answer waited in the socket or the connection was still being made.
    Before, redis-py's own socket timeout fired in the pass that had the answer."""
    store = RedisStore(redis_server.url, timeout=0.3, max_connections=2)
    try:
        loop = asyncio.get_running_loop()
        if connected:
            await store.ping()
            # The command is written to a stopped Redis; 50 ms later Redis resumes
            # and answers while the loop is blocked for 0.8 s (past the 0.3 s
            # timeout): the answer waits in the socket for the loop.
            redis_server.pause()

            def resume_then_block() -> None:
                redis_server.resume()
                time.sleep(0.8)

            loop.call_later(0.05, resume_then_block)
        else:
            # The loop is blocked for 0.8 s while the connection is being made.
            loop.call_soon(time.sleep, 0.8)
        try:
            assert await store.admit("busy", "n|b|e", ttl=5.0) is None
        finally:
            redis_server.resume()
        # And a hung Redis still fails in one timeout once the loop is free again.
        with redis_server.hung():
            began = time.monotonic()
            with pytest.raises(ClusterUnavailable):
                await store.ping()
            assert time.monotonic() - began < 0.3 * 4  # the lag credit's cap at most
    finally:
        await store.close()


async def test_scripts_asked_for_in_one_pass_share_one_round_trip(
    redis_server: RedisServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    """200 admissions and deregistrations started together go out as one pipelined trip
    each (not 400 commands), every caller gets its own answer, a wrong-type key fails
    only its own script, a caller cancelled before the trip sends nothing, and the
    scripts Redis lost in a restart are loaded again."""
    store = RedisStore(redis_server.url, timeout=2.0, max_connections=8)
    calls = 0
    real_call = RedisStore._call

    async def counted(self: RedisStore, op: Any, budget: float | None = None) -> Any:
        nonlocal calls
        calls += 1
        return await real_call(self, op, budget)

    monkeypatch.setattr(RedisStore, "_call", counted)
    try:
        await store.admit("warm", "n|b|e", ttl=5.0)  # loads the scripts
        await store.deregister("warm", "n|b|e", cancelled=False)
        calls = 0
        admitted = await asyncio.gather(
            *(store.admit(f"pass-{n}", "n|b|e", ttl=30.0) for n in range(200))
        )
        assert admitted == [None] * 200
        assert calls == 1
        # The members are really there, each in its own session's set.
        removed = await asyncio.gather(
            *(store.deregister(f"pass-{n}", "n|b|e", cancelled=False) for n in range(200))
        )
        assert removed == [True] * 200
        assert calls == 2
        # A script that fails in Redis fails alone.
        await store._client.set(SessionKeys("wrong").in_flight, "a string, not a zset")
        results = await asyncio.gather(
            store.admit("right", "n|b|e", ttl=30.0),
            store.admit("wrong", "n|b|e", ttl=30.0),
            return_exceptions=True,
        )
        assert results[0] is None
        assert isinstance(results[1], redis.exceptions.ResponseError)
        # Cancelled before its trip: never sent.
        lost = asyncio.ensure_future(store.admit("cancelled", "n|b|e", ttl=30.0))
        kept = asyncio.ensure_future(store.admit("kept", "n|b|e", ttl=30.0))
        await asyncio.sleep(0)  # both queued for this pass's trip
        lost.cancel()
        assert await kept is None
        assert await store._client.exists(SessionKeys("cancelled").in_flight) == 0
        # Scripts flushed (a restarted Redis): loaded again, every caller answered.
        await store._client.script_flush()
        calls = 0
        again = await asyncio.gather(
            *(store.admit(f"flushed-{n}", "n|b|e", ttl=30.0) for n in range(5))
        )
        assert again == [None] * 5
        assert calls == 3  # the trip that met NOSCRIPT, one SCRIPT LOAD, the trip again
    finally:
        await store.close()


async def test_a_burst_queues_for_the_pool_instead_of_failing(redis_server: RedisServer) -> None:
    """5,000 calls at once on a 2-connection pool: each waits its turn (well past the
    0.5 s timeout for the last ones) and none is taken for an outage."""
    store = RedisStore(redis_server.url, timeout=0.5, max_connections=2)
    try:
        await store.ping()
        answers = await asyncio.gather(
            *(store.admit(f"burst-{n}", "n|b|e", ttl=30.0) for n in range(5000)),
            return_exceptions=True,
        )
        failed = [a for a in answers if a is not None]
        assert failed == [], f"{len(failed)} failed, first: {failed[0]!r}"
    finally:
        await store.close()


async def test_a_cancelled_waiter_gives_its_turn_to_the_next() -> None:
    """The pool queue alone (no Redis): a waiter cancelled while queued, or cancelled
    just after it was handed the place, leaves the place to the next waiter."""
    queue = _ConnectionQueue(1)
    await queue.acquire()
    order: list[str] = []

    async def wait(name: str) -> None:
        await queue.acquire()
        order.append(name)

    a, b, c = (asyncio.ensure_future(wait(name)) for name in "abc")
    await asyncio.sleep(0)  # all three queued
    a.cancel()
    queue.release()  # handed to b (a is gone)...
    b.cancel()  # ...which is cancelled before it runs: c gets the place
    await asyncio.wait_for(c, 5)
    assert order == ["c"] and a.cancelled() and b.cancelled()
    queue.release()
    await asyncio.wait_for(queue.acquire(), 5)  # the place came back exactly once
    waiter = asyncio.ensure_future(queue.acquire())
    await asyncio.sleep(0)
    queue.fail_waiting("redis: TimeoutError")
    with pytest.raises(ClusterUnavailable, match="TimeoutError"):
        await asyncio.wait_for(waiter, 5)


async def test_calls_queued_behind_a_hung_redis_fail_with_the_first_timeout(
    redis_server: RedisServer,
) -> None:
    """Queued calls do not each wait for their own turn and timeout: when a call
    holding a connection times out, every queued one fails with it."""
    timeout = 1.0
    store = RedisStore(redis_server.url, timeout=timeout, max_connections=2)
    try:
        await store.ping()

        async def took(n: int) -> float:
            began = time.monotonic()
            with pytest.raises(ClusterUnavailable):
                await store.admit(f"q-{n}", "n|b|e", ttl=5.0)
            return time.monotonic() - began

        with redis_server.hung():
            costs = await asyncio.gather(*(took(n) for n in range(8)))  # 4 rounds of 2
        assert max(costs) <= 1.1 * timeout, costs
        # Redis back: the queue works as before.
        assert await store.admit("after", "n|b|e", ttl=5.0) is None
    finally:
        await store.close()


# ----------------------------------------------------------------------------- nodes


async def _node(url: str, registry: SessionRegistry, name: str, ttl: float = 1.5) -> ClusterNode:
    node = ClusterNode(
        RedisStore(url, timeout=0.5, max_connections=8),
        registry,
        node_id=name,
        heartbeat_ttl=ttl,
        tombstone_ttl=60.0,
    )
    await node.start()
    return node


async def _hold(
    node: ClusterNode,
    registry: SessionRegistry,
    sid: str,
    ex: str,
    started: asyncio.Event,
    seconds: float,
) -> str:
    """An exchange held in flight on ``node``; returns how it ended."""
    task = asyncio.current_task()
    assert task is not None
    try:
        async with node.admitted(sid, ex):
            with registry.track(sid, task):
                started.set()
                await asyncio.sleep(seconds)
    except asyncio.CancelledError as exc:
        return "cancelled" if shutdown_cause(exc) else "cancelled-other"
    return "finished"


async def test_a_close_on_one_node_cancels_the_exchange_held_on_another(
    redis_server: RedisServer,
) -> None:
    closed_on_b: list[str] = []

    async def on_close(sid: str) -> None:
        closed_on_b.append(sid)

    reg_a = _registry()
    reg_b = SessionRegistry(idle_cap=100, tombstone_ttl=60.0, tombstone_cap=100, on_close=on_close)
    a = await _node(redis_server.url, reg_a, "a")
    b = await _node(redis_server.url, reg_b, "b")
    try:
        started = asyncio.Event()
        held = asyncio.create_task(_hold(b, reg_b, "s", "ex-1", started, 30.0))
        short_started = asyncio.Event()
        short = asyncio.create_task(_hold(b, reg_b, "s", "ex-2", short_started, 0.1))
        await asyncio.wait_for(started.wait(), 5)
        await asyncio.wait_for(short_started.wait(), 5)
        result = await asyncio.wait_for(a.close_session("s", grace=0.5), 10)
        assert await held == "cancelled"
        assert await short == "finished"
        assert (result.finished, result.cancelled, result.remaining) == (1, 1, 0)
        assert not result.already_closed and not result.degraded
        assert closed_on_b == ["s"]
        # Late requests are refused on both nodes, by Redis and by B's own registry.
        for node in (a, b):
            with pytest.raises(SessionClosed):
                async with node.admitted("s", "late"):
                    pass
        assert reg_b.is_tombstoned("s")
        again = await b.close_session("s", grace=0.5)
        assert again.already_closed
        assert await a.store.in_flight("s") == []
    finally:
        await a.stop()
        await b.stop()


async def test_a_dead_nodes_entry_expires_and_the_close_returns(redis_server: RedisServer) -> None:
    reg = _registry()
    a = await _node(redis_server.url, reg, "a", ttl=0.6)
    try:
        # A node that admitted an exchange and died: its entry is never refreshed.
        assert await a.store.admit("s", "dead|b|ex-9", ttl=0.6) is None
        loop = asyncio.get_running_loop()
        began = loop.time()
        result = await asyncio.wait_for(a.close_session("s", grace=0.2), 20)
        # Grace and TTL, then the close returns (not the wait_for's 20 s); generous for load.
        assert loop.time() - began < 0.2 + 0.6 + 5.0
        assert result.expired == 1 and result.remaining == 0
        assert await a.store.in_flight("s") == []
    finally:
        await a.stop()


def _recording_registry(closes: list[str]) -> SessionRegistry:
    """A registry whose ``on_close`` (the plugins' session_closed) appends to ``closes``."""

    async def on_close(sid: str) -> None:
        closes.append(sid)

    return SessionRegistry(idle_cap=10, tombstone_ttl=60.0, tombstone_cap=10, on_close=on_close)


async def test_concurrent_closes_on_two_nodes_share_one_close(redis_server: RedisServer) -> None:
    closes_a: list[str] = []
    closes_b: list[str] = []
    regs = [_recording_registry(closes_a), _recording_registry(closes_b)]
    a = await _node(redis_server.url, regs[0], "a")
    b = await _node(redis_server.url, regs[1], "b")
    try:
        started = asyncio.Event()
        held = asyncio.create_task(_hold(a, regs[0], "s", "ex-1", started, 0.3))
        await asyncio.wait_for(started.wait(), 5)
        r1, r2 = await asyncio.wait_for(
            asyncio.gather(a.close_session("s", grace=2.0), b.close_session("s", grace=2.0)), 10
        )
        assert await held == "finished"
        assert r1.finished == r2.finished == 1
        # One session_closed on A, which served the session; none on B, which did not.
        assert closes_a == ["s"]
        assert closes_b == []
    finally:
        await a.stop()
        await b.stop()


async def test_only_a_node_that_served_a_session_tells_its_plugins(
    redis_server: RedisServer,
) -> None:
    closes: dict[str, list[str]] = {name: [] for name in "abc"}
    regs = {name: _recording_registry(closes[name]) for name in "abc"}
    nodes = {name: await _node(redis_server.url, regs[name], name) for name in "abc"}
    try:
        for name, sid in (("a", "s1"), ("b", "s2")):
            async with nodes[name].admitted(sid, f"ex-{sid}"):
                with regs[name].track(sid):
                    pass

        # Closed on B, which never served s1: A's plugins are told, B's and C's are not.
        result = await asyncio.wait_for(nodes["b"].close_session("s1", grace=0.5), 10)
        assert result.finished == 0 and not result.already_closed
        await wait_until(
            lambda: all(reg.tombstone_count == 1 for reg in regs.values()),
            "every node's local shutdown of s1 done",
            within=10,
        )
        assert closes == {"a": ["s1"], "b": [], "c": []}
        # Every node still keeps the local tombstone (it refuses while Redis is down).
        assert all(reg.is_tombstoned("s1") for reg in regs.values())

        # Closed on B, which served s2: only B's plugins are told.
        await asyncio.wait_for(nodes["b"].close_session("s2", grace=0.5), 10)
        await wait_until(
            lambda: all(reg.tombstone_count == 2 for reg in regs.values()),
            "every node's local shutdown of s2 done",
            within=10,
        )
        assert closes == {"a": ["s1"], "b": ["s2"], "c": []}
    finally:
        for node in nodes.values():
            await node.stop()


async def test_redis_down_policy_and_reconcile(redis_server: RedisServer) -> None:
    regs = [_registry(), _registry()]
    a = await _node(redis_server.url, regs[0], "a", ttl=0.6)
    b = await _node(redis_server.url, regs[1], "b", ttl=0.6)
    try:
        redis_server.kill()
        # Admission keeps flowing with the local view; the node says it is degraded.
        async with a.admitted("s1", "ex-1"):
            pass
        assert a.degraded
        result = await asyncio.wait_for(a.close_session("closed-in-outage", grace=0.1), 5)
        assert result.degraded
        # The tombstone it knows keeps refusing, locally.
        with pytest.raises(SessionClosed), regs[0].track("closed-in-outage"):
            pass
        redis_server.start(same_port=True)
        await wait_until(
            lambda: not a.degraded and regs[1].is_tombstoned("closed-in-outage"),
            "reconciled and replayed",
            within=10.0,
        )
        assert not a.degraded and a.reconciles == 1
        # Replayed: the Redis tombstone refuses on B, B's registry got the close.
        assert regs[1].is_tombstoned("closed-in-outage")
        with pytest.raises(SessionClosed):
            async with b.admitted("closed-in-outage", "late"):
                pass
    finally:
        await a.stop()
        await b.stop()


# ----------------------------------------------------------------------------- ledger


async def test_the_ledger_gate_in_redis_is_shared_and_atomic(
    redis_server: RedisServer, store: RedisStore
) -> None:
    from plugins.ledger import LedgerPlugin
    from proxy.testing import make_record

    ledgers = [LedgerPlugin(path=":memory:", redis_url=redis_server.url) for _ in range(2)]
    for ledger in ledgers:
        await ledger.startup()
    try:
        one, two = ledgers
        # A commit folds into the session's held run; flush() waits until it is in Redis.
        await one.commit(make_record(session_id="s", wire_digest="d0", comparable=True))
        await one.flush()
        # A reformat on the other node: the digest moves, nothing is dirty.
        await two.commit(make_record(session_id="s", wire_digest="d1", comparable=True))
        await two.flush()
        assert two.session_state("s")["dirty"] is False
        # Both nodes see the same flip at once: the epoch moves once.
        flip = make_record(session_id="s", wire_digest="d2", comparable=False)
        await asyncio.gather(one.commit(flip), two.commit(flip))
        await asyncio.gather(one.flush(), two.flush())
        gates = sorted(str(ledger.session_state("s")["gate"]) for ledger in ledgers)
        assert gates == ["identical", "revision"]
        assert {ledger.session_state("s")["revision_epoch"] for ledger in ledgers} == {1}
        assert not await one.mark_clean("s", epoch=0)  # moved on since epoch 0
        assert await two.mark_clean("s", epoch=1)
        state = await store.ledger_state("s")  # what Redis holds, read on the side
        assert (state["dirty"], state["revision_epoch"], state["digest"]) == ("0", "1", "d2")
        # Outcomes other than ok and records without a session never reach the gate.
        await one.commit(make_record(session_id="s", wire_digest="d9", outcome="client_gone"))
        await one.flush()
        assert (await store.ledger_state("s"))["digest"] == "d2"
    finally:
        for ledger in ledgers:
            await ledger.shutdown()


async def test_the_ledger_joins_cluster_mode_through_the_proxy_setting(
    redis_server: RedisServer,
) -> None:
    from plugins.ledger import LedgerPlugin
    from proxy._plugins import load_plugins

    host = load_plugins(
        ["ledger", "usage"],
        {"ledger": {"path": ":memory:"}},
        timeout=1.0,
        shared={"redis_url": redis_server.url},
    )
    ledger = host.plugins[0]
    assert isinstance(ledger, LedgerPlugin) and ledger.redis_url == redis_server.url
    plain = load_plugins(["ledger"], {"ledger": {"path": ":memory:"}}, timeout=1.0)
    assert isinstance(plain.plugins[0], LedgerPlugin) and plain.plugins[0].redis_url is None


async def test_a_close_cut_between_tombstone_and_announcement_is_announced_on_replay(
    redis_server: RedisServer,
) -> None:
    regs = [_registry(), _registry()]
    a = await _node(redis_server.url, regs[0], "a")
    b = await _node(redis_server.url, regs[1], "b")
    try:
        # Redis went away right after A's tombstone landed, before its XADD: A kept
        # the close for the reconcile, which finds the tombstone already there.
        assert (await a.store.begin_close("half", "c", tombstone_ttl=60.0)).new
        a._pending_closes["half"] = 0.1
        await a._flush_pending()
        await wait_until(lambda: regs[1].is_tombstoned("half"), "B closed it", within=5.0)
    finally:
        await a.stop()
        await b.stop()


async def test_tip_since_reaches_back_that_many_seconds_on_redis_clock(store: RedisStore) -> None:
    entry = await store.announce_close("s", 1.0, "origin")
    await asyncio.sleep(0.05)
    reader = store.tail_client(0.1)
    try:
        assert [c.entry_id for c in await read_closes(reader, await store.tip_since(5.0), 0.1)] == [
            entry
        ]
        assert await read_closes(reader, await store.tip_since(0.0), 0.1) == []
    finally:
        await reader.aclose()
    assert await store.tip_since(1e12) == "0-0"


class _SwallowingTailClient:
    """A tail client whose blocking read, like a client library's when a cancel races
    its own read timeout, turns the cancellation into an ordinary empty answer."""

    def __init__(self) -> None:
        self.reads = 0

    async def xread(self, *args: object, **kwargs: object) -> list[object]:
        self.reads += 1
        with contextlib.suppress(asyncio.CancelledError):
            await asyncio.sleep(0.2)
        return []

    async def aclose(self) -> None:
        pass


class _SwallowingStore(RedisStore):
    def __init__(self, url: str) -> None:
        super().__init__(url, timeout=0.5, max_connections=8)
        self.tail = _SwallowingTailClient()

    def tail_client(self, block_s: float) -> Any:
        return self.tail


async def test_stop_ends_even_when_the_tail_read_swallows_its_cancellation(
    redis_server: RedisServer,
) -> None:
    """Finding (a test that hung under load): stop() cancelled the tailer and awaited it
    without bound; a cancellation lost inside the Redis client left the tailer looping
    and the node's stop (the process's shutdown) waiting forever."""
    store = _SwallowingStore(redis_server.url)
    node = ClusterNode(store, _registry(), node_id="n", heartbeat_ttl=1.5, tombstone_ttl=60.0)
    await node.start()
    await wait_until(lambda: store.tail.reads > 0, "the tailer reading")
    await asyncio.wait_for(node.stop(within=2.0), 5.0)


class _UnreachableAtStart(RedisStore):
    """A store that cannot reach Redis until ``reachable`` is set (the real server is up
    all along: the outage is this node's, e.g. commands timing out on a loaded host)."""

    def __init__(self, url: str) -> None:
        super().__init__(url, timeout=0.5, max_connections=8)
        self.reachable = asyncio.Event()

    async def stream_tip(self) -> str:
        if not self.reachable.is_set():
            raise ClusterUnavailable("redis: TimeoutError")
        return await super().stream_tip()

    async def ping(self) -> None:
        if not self.reachable.is_set():
            raise ClusterUnavailable("redis: TimeoutError")
        await super().ping()


async def test_a_node_that_started_degraded_applies_the_closes_announced_before_its_reconcile(
    redis_server: RedisServer,
) -> None:
    """Finding (a flaky close test): a node whose start could not read the stream's tip
    took it at the reconcile, after the closes announced meanwhile, and never applied
    them, though it may have admitted those sessions with its local view."""
    regs = [_registry(), _registry()]
    a = await _node(redis_server.url, regs[0], "a")
    late = _UnreachableAtStart(redis_server.url)
    b = ClusterNode(late, regs[1], node_id="b", heartbeat_ttl=1.5, tombstone_ttl=60.0)
    await b.start()
    try:
        assert b.degraded
        async with b.admitted("s", "ex-local"):  # served with the local view meanwhile
            pass
        result = await asyncio.wait_for(a.close_session("s", grace=0.1), 5)
        assert not result.degraded
        assert b.degraded and b.reconciles == 0 and not regs[1].is_tombstoned("s")
        late.reachable.set()
        await wait_until(lambda: b.reconciles == 1, "B reconciled", within=5.0)
        await wait_until(lambda: regs[1].is_tombstoned("s"), "B closed it", within=5.0)
    finally:
        await a.stop()
        await b.stop()


async def test_redis_dying_during_a_close_answers_with_this_close_local_counts(
    redis_server: RedisServer,
) -> None:
    """The close started this node's shutdown before Redis died: the degraded answer
    is that shutdown's result (its own exchange finished), not ``already_closed``."""
    regs = [_registry(), _registry()]
    a = await _node(redis_server.url, regs[0], "a")
    b = await _node(redis_server.url, regs[1], "b")
    try:
        a_started, b_started = asyncio.Event(), asyncio.Event()
        # A's exchange outlives the outage; B's own one finishes within the grace.
        on_a = asyncio.create_task(_hold(a, regs[0], "s", "ex-a", a_started, 30.0))
        on_b = asyncio.create_task(_hold(b, regs[1], "s", "ex-b", b_started, 0.2))
        await asyncio.wait_for(asyncio.gather(a_started.wait(), b_started.wait()), 5)
        closing = asyncio.create_task(b.close_session("s", grace=10.0))
        assert await asyncio.wait_for(on_b, 5) == "finished"
        # B's local shutdown is over; it is still waiting for A's exchange in Redis.
        await wait_until(lambda: regs[1].is_tombstoned("s"), "B's local shutdown done")
        assert not closing.done()
        redis_server.kill()
        result = await asyncio.wait_for(closing, 10)
        assert result.degraded
        assert not result.already_closed
        assert (result.finished, result.cancelled) == (1, 0)
        # A second close is the one that finds the session already closed.
        again = await asyncio.wait_for(b.close_session("s", grace=0.1), 5)
        assert again.already_closed and again.degraded
        on_a.cancel()
        await asyncio.gather(on_a, return_exceptions=True)
    finally:
        await a.stop()
        await b.stop()

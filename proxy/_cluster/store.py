"""The Redis side of cluster mode: one object per node, one method per round trip.

An I/O edge (docs/design.md §8): every method is one Redis round trip (a Lua
script from :mod:`proxy._cluster.scripts`, or one command) and raises
:class:`ClusterUnavailable` for any failure to reach Redis, so the node
(:mod:`proxy._cluster.node`) has one exception to turn into its degraded mode.
The connection pool is bounded; a burst queues for a free connection (first
come first served) instead of opening thousands, and a queue is not an outage.
Every command has the timeout, which is never retried: one command against a
hung Redis costs ``timeout``, and when it times out every call queued behind it
fails at once instead of waiting for a connection and a timeout of its own.
Only a connection that turns out broken (Redis restarted) is retried, once, on
a fresh connection.
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import functools
import math
from collections.abc import Awaitable, Callable, Iterable, Mapping, Sequence
from typing import Any, Final, TypeVar

import redis.asyncio as aioredis
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff
from redis.commands.core import AsyncScript
from redis.exceptions import (
    ClusterDownError,
    NoScriptError,
    OutOfMemoryError,
    ReadOnlyError,
    RedisError,
    ResponseError,
    TryAgainError,
)
from redis.exceptions import ConnectionError as RedisConnectionError

# Defined beside the public LedgerGate (plugins catch it without importing redis).
from .._shared import ClusterUnavailable, GateRun
from . import scripts
from .keys import CLOSE_STREAM, SessionKeys

__all__ = ["CloseCommand", "CloseStart", "ClusterUnavailable", "RedisStore", "Tally"]

#: Close commands kept in the stream (approximately: ``MAXLEN ~``). A node cut off
#: for longer than this many closes misses the oldest ones; the tombstones in Redis
#: still refuse those sessions at its admission.
STREAM_MAXLEN: Final = 100_000

_T = TypeVar("_T")

#: Error replies that say what state the server is in, not that a script or key is
#: wrong: out of memory, a read-only replica after a failover, a failed snapshot, a
#: script running too long, a replica without its master. redis-py turns some into
#: classes of their own (the code stripped from the text), the rest keep their code.
#: They are taken for Redis failing to answer (degraded mode; the ledger's held runs
#: kept and retried), never for a defect of the caller.
_SERVER_STATE_CLASSES: Final = (OutOfMemoryError, ReadOnlyError, TryAgainError, ClusterDownError)
_SERVER_STATE_CODES: Final = ("MISCONF", "BUSY", "NOREPLICAS", "MASTERDOWN")


def _server_state(exc: ResponseError) -> ClusterUnavailable | None:
    """The outage an error reply stands for (see :data:`_SERVER_STATE_CLASSES`), or None."""
    if isinstance(exc, _SERVER_STATE_CLASSES):
        return ClusterUnavailable(f"redis: {type(exc).__name__}")
    code = str(exc).split(" ", 1)[0]
    if code in _SERVER_STATE_CODES:
        return ClusterUnavailable(f"redis: {code} reply")
    return None


#: One script waiting for its trip: the script, its keys, its args, the caller's future.
_Scripted = tuple[AsyncScript, list[str], list[Any], "asyncio.Future[Any]"]

#: Seconds between two ticks of the loop-lag clock (:class:`_LoopLag`) while Redis
#: calls are in flight.
_LAG_TICK: Final = 0.05
#: Lateness of one tick that is not counted (timer and scheduler jitter), seconds.
_LAG_JITTER: Final = 0.01
#: A call's deadline, credited with the loop's lag, never passes this many times
#: its budget: a hung Redis on an overloaded node still fails in bounded time.
_LAG_CREDIT_CAP: Final = 4.0


class _ConnectionQueue:
    """At most ``size`` Redis calls at once (one pooled connection each); the others
    wait their turn, first come first served.

    Queueing for a connection is not an outage: while Redis answers, every place
    frees within one round trip. The wait has no timeout of its own: it ends when
    a place frees or, if the call holding one fails to reach Redis,
    :meth:`fail_waiting` raises :class:`ClusterUnavailable` in every waiter at
    once. A waiter therefore waits at most about (its position / ``size``)
    round trips, each bounded by the command timeout.
    """

    __slots__ = ("_free", "_waiters")

    def __init__(self, size: int) -> None:
        self._free = size
        self._waiters: collections.deque[asyncio.Future[None]] = collections.deque()

    async def acquire(self) -> None:
        """Take a place, waiting for one if none is free.

        Raises:
            ClusterUnavailable: a call holding a place failed while this one waited.
        """
        if self._free > 0 and not self._waiters:
            self._free -= 1
            return
        turn: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._waiters.append(turn)
        try:
            await turn
        except BaseException:
            if turn.done() and not turn.cancelled() and turn.exception() is None:
                self.release()  # handed a place while being cancelled: pass it on
            else:
                # Cancelled while queued (failed waiters are out of the queue already).
                if turn in self._waiters:
                    self._waiters.remove(turn)
            raise

    def release(self) -> None:
        """Give a place back: to the first live waiter, else to the free count."""
        while self._waiters:  # bounded by the queue's length
            turn = self._waiters.popleft()
            if not turn.done():
                turn.set_result(None)
                return
        self._free += 1

    def fail_waiting(self, reason: str) -> None:
        """Raise ``ClusterUnavailable`` in every call queued now (``reason``: what failed)."""
        while self._waiters:  # bounded by the queue's length
            turn = self._waiters.popleft()
            if not turn.done():
                turn.set_exception(
                    ClusterUnavailable(f"{reason} (another call, while this one was queued)")
                )


class _LoopLag:
    """Seconds this event loop ran late while Redis calls were in flight, summed.

    A ticker every :data:`_LAG_TICK` seconds adds how late each tick ran (beyond
    :data:`_LAG_JITTER`). It runs
    only while a call holds it (:meth:`hold` / :meth:`let_go`), so an idle node
    has no timer. :meth:`RedisStore._call` credits the lag a call saw to its
    deadline: a node whose loop was too busy to read an answer in time has not
    seen Redis fail to answer (docs/cluster.md, "When Redis hangs").
    """

    __slots__ = ("_expected", "_handle", "_holders", "total")

    def __init__(self) -> None:
        self.total = 0.0
        self._holders = 0
        self._expected = 0.0
        self._handle: asyncio.TimerHandle | None = None

    def hold(self, loop: asyncio.AbstractEventLoop) -> None:
        """One more call in flight (starts the ticker for the first)."""
        self._holders += 1
        if self._handle is None:
            self._expected = loop.time() + _LAG_TICK
            self._handle = loop.call_at(self._expected, self._tick, loop)

    def let_go(self) -> None:
        """One call fewer in flight (stops the ticker after the last)."""
        self._holders -= 1
        if self._holders == 0 and self._handle is not None:
            self._handle.cancel()
            self._handle = None

    def _tick(self, loop: asyncio.AbstractEventLoop) -> None:
        now = loop.time()
        # A tick a few ms late is the scheduler's jitter, not a loop too busy to read.
        self.total += max(0.0, now - self._expected - _LAG_JITTER)
        self._expected = now + _LAG_TICK
        self._handle = loop.call_at(self._expected, self._tick, loop)


@dataclasses.dataclass(frozen=True, slots=True)
class CloseCommand:
    """One entry of the close stream: close ``sid``, giving exchanges ``timeout`` s."""

    entry_id: str
    sid: str
    timeout: float
    origin: str


@dataclasses.dataclass(frozen=True, slots=True)
class CloseStart:
    """What :meth:`RedisStore.begin_close` found.

    ``new``: this call set the tombstone (it owns the close). Otherwise the
    session was tombstoned already: ``done`` says whether that close has answered.
    """

    new: bool
    close_id: str
    done: bool


@dataclasses.dataclass(frozen=True, slots=True)
class Tally:
    """Cluster-wide counts of one close: exchanges that ended within the timeout
    (``finished``), were cancelled after it (``cancelled``), or whose node stopped
    heartbeating and whose entries expired (``expired``)."""

    finished: int
    cancelled: int
    expired: int
    done: bool


class RedisStore:
    """Cluster state in Redis for one node (docs/design.md §9).

    Args:
        url: ``redis://host:port/db`` (or ``rediss://``, ``unix://``).
        timeout: seconds, for connecting and for each command (never retried).
        max_connections: size of the bounded pool (>= 2); more calls at once
            queue for a connection, without a timeout of their own (see
            :class:`_ConnectionQueue`).

    Every coroutine method raises :class:`ClusterUnavailable` when Redis cannot
    be reached in time. ``ResponseError`` (a script bug, a wrong-type key) is
    not caught: that is a defect, not an outage.
    """

    __slots__ = (
        "_batch",
        "_client",
        "_lag",
        "_pool",
        "_queue",
        "_scripts",
        "_trips",
        "timeout",
        "url",
    )

    def __init__(self, url: str, *, timeout: float, max_connections: int) -> None:
        self.url: Final = url
        self.timeout: Final = timeout
        self._pool: Final = aioredis.BlockingConnectionPool.from_url(
            url,
            max_connections=max_connections,
            timeout=timeout,
            # No socket timeouts of redis-py's own: :meth:`_call`'s deadline bounds
            # connecting and the command together. redis-py's would cancel a read
            # whose answer the socket already holds when the loop is busy (its timer
            # runs in the same pass as the reader, before the read resumes), and a
            # loaded node is not an outage.
            socket_timeout=None,
            socket_connect_timeout=None,
            # One retry, on a fresh connection, for a connection that broke while
            # idle (Redis restarted); a timeout is never retried.
            retry=_retry(1),
            decode_responses=True,
        )
        self._client: Final = aioredis.Redis(connection_pool=self._pool)
        # In front of the pool: a call waits here, never in the pool, whose own wait
        # (``timeout`` above) is a bound the queue keeps from ever being reached.
        self._queue: Final = _ConnectionQueue(max_connections)
        self._lag: Final = _LoopLag()
        # Scripts asked for in this loop pass, sent together by _send_batch.
        self._batch: list[_Scripted] = []
        self._trips: Final[set[asyncio.Task[None]]] = set()
        register = self._client.register_script
        self._scripts: Final = {
            "admit": register(scripts.ADMIT),
            "deregister": register(scripts.DEREGISTER),
            "refresh": register(scripts.REFRESH),
            "begin_close": register(scripts.BEGIN_CLOSE),
            "prune": register(scripts.PRUNE),
            "ledger_gate": register(scripts.LEDGER_GATE),
            "ledger_gate_run": register(scripts.LEDGER_GATE_RUN),
            "ledger_mark_clean": register(scripts.LEDGER_MARK_CLEAN),
        }

    def tail_client(self, block_s: float) -> aioredis.Redis:
        """A separate one-connection client for ``XREAD BLOCK`` (``block_s`` seconds).

        A blocking read holds its connection for the whole block; it must not
        take one from the pool the admission path uses. Close it with ``aclose``.
        """
        return aioredis.Redis.from_url(
            self.url,
            single_connection_client=True,
            socket_timeout=block_s + self.timeout,
            socket_connect_timeout=self.timeout,
            retry=_retry(0),
            decode_responses=True,
        )

    async def _run(self, name: str, keys: Sequence[str], args: Sequence[Any]) -> Any:
        """Script ``name``'s answer. Scripts asked for in the same loop pass (a burst of
        admissions, deregistrations, close polls) share one pipelined round trip:
        redis-py spends ~100 us of this loop's CPU per command and a pipeline a
        fraction of it per script, so a node's admission rate is not capped by the
        client's overhead. Each caller gets its own answer or error, as alone.

        Raises:
            ClusterUnavailable: as :meth:`_call`, for every script of the trip.
            ResponseError: this script failed in Redis (a defect).
        """
        loop = asyncio.get_running_loop()
        turn: asyncio.Future[Any] = loop.create_future()
        batch = self._batch
        batch.append((self._scripts[name], list(keys), list(args), turn))
        if len(batch) == 1:
            loop.call_soon(self._send_batch, loop)
        return await turn

    def _send_batch(self, loop: asyncio.AbstractEventLoop) -> None:
        # Callers cancelled before the trip leave: their scripts are not sent.
        batch = [entry for entry in self._batch if not entry[3].done()]
        self._batch = []
        if batch:
            task = loop.create_task(self._send_trip(batch))
            self._trips.add(task)
            task.add_done_callback(self._trips.discard)

    async def _send_trip(self, batch: list[_Scripted]) -> None:
        """One round trip for ``batch``; each future gets its script's answer or error.

        Scripts Redis does not know (first use, or a restarted Redis) are loaded,
        once each, and the scripts that met ``NOSCRIPT`` are sent again together.
        """
        try:
            answers = await self._trip(batch)
            missed = [n for n, answer in enumerate(answers) if isinstance(answer, NoScriptError)]
            if missed:
                for source in {batch[n][0].script for n in missed}:
                    await self._call(functools.partial(self._client.script_load, source))
                resent = await self._trip([batch[n] for n in missed])
                for n, answer in zip(missed, resent, strict=True):
                    answers[n] = answer
        except (ClusterUnavailable, ResponseError) as exc:
            for *_, turn in batch:
                if not turn.done():
                    turn.set_exception(type(exc)(*exc.args))
            return
        except BaseException:
            for *_, turn in batch:
                turn.cancel()
            raise
        for (*_, turn), answer in zip(batch, answers, strict=True):
            if turn.done():
                continue  # its caller left after the trip was sent
            if isinstance(answer, ResponseError):
                answer = _server_state(answer) or answer
            if isinstance(answer, BaseException):
                turn.set_exception(answer)
            else:
                turn.set_result(answer)

    async def _trip(self, batch: list[_Scripted]) -> list[Any]:
        """``EVALSHA`` of each script in ``batch`` in one round trip: each one's answer,
        or the ``ResponseError`` it met (``NoScriptError`` included), in order.

        ``evalsha`` itself: a redis-py ``Script`` in a pipeline costs a ``SCRIPT
        EXISTS`` round trip on every execute.

        Raises:
            ClusterUnavailable: as :meth:`_call`.
        """
        if len(batch) == 1:
            script, keys, args, _ = batch[0]
            try:
                call = functools.partial(self._client.evalsha, script.sha, len(keys), *keys, *args)
                return [await self._call(call)]
            except ResponseError as exc:
                return [exc]

        async def pipelined() -> list[Any]:
            async with self._client.pipeline(transaction=False) as pipe:
                for script, keys, args, _ in batch:
                    pipe.evalsha(script.sha, len(keys), *keys, *args)
                return list(await pipe.execute(raise_on_error=False))

        return await self._call(pipelined)

    async def _call(self, op: Callable[[], Awaitable[_T]], budget: float | None = None) -> _T:
        """``op()`` (one round trip) holding one of the pool's places.

        Waits its turn in the queue while every pooled connection is busy (a burst,
        not an outage). A failure to reach Redis, or an answer that did not come
        within ``budget`` seconds (default ``timeout``; connecting included), is
        raised as :class:`ClusterUnavailable` and fails every call still queued the
        same way: the server did not answer, they would each wait for their own
        timeout only to learn it again.

        The deadline counts Redis's time, not this loop's: each time it fires, the
        time the loop ran late since the last (:class:`_LoopLag`) moves it on by as
        much, up to :data:`_LAG_CREDIT_CAP` x ``budget`` in all; then ``op`` is cancelled one
        loop pass later, so an answer that reached the socket in time, whose
        reader callback is queued ahead of the timer in that pass, is read. A
        busy node is not an outage; against a hung Redis an idle loop's call
        costs ``budget``.
        """
        await self._queue.acquire()
        loop = asyncio.get_running_loop()
        lag = self._lag
        lag.hold(loop)
        began = loop.time()
        seconds = self.timeout if budget is None else budget
        lag_seen = lag.total
        try:
            async with asyncio.timeout(None) as deadline:
                fire: asyncio.TimerHandle | None = None

                def expire() -> None:
                    nonlocal lag_seen, fire
                    now = loop.time()
                    late = lag.total - lag_seen
                    lag_seen = lag.total
                    if late > 0.0 and now - began < _LAG_CREDIT_CAP * seconds:
                        fire = loop.call_at(now + late, expire)
                    else:
                        deadline.reschedule(now)  # cancels op on the next pass

                fire = loop.call_at(began + seconds, expire)
                try:
                    return await op()
                finally:
                    fire.cancel()  # the newest timer: each expire() replaced the last
        except ResponseError as exc:
            outage = _server_state(exc)
            if outage is None:
                raise  # a script or key is wrong: a defect, not an outage
            self._queue.fail_waiting(str(outage))
            raise outage from exc
        except (RedisError, OSError, TimeoutError) as exc:
            reason = f"redis: {type(exc).__name__}"
            self._queue.fail_waiting(reason)
            raise ClusterUnavailable(reason) from exc
        finally:
            lag.let_go()
            self._queue.release()

    async def reset(self) -> None:
        """Drop every pooled connection (after an outage: they may all be stale)."""
        await self._pool.disconnect()

    async def ping(self) -> None:
        """One ``PING``."""
        await self._call(self._client.ping)

    async def admit(self, sid: str, member: str, ttl: float) -> float | None:
        """Tombstone check + in-flight registration of ``member``, in one script.

        ``ttl``: seconds the entry lives without a heartbeat. Returns ``None``
        when admitted, else the tombstone's remaining life in seconds (``-1.0``:
        a tombstone without expiry).
        """
        k = SessionKeys(sid)
        ok, left = await self._run("admit", (k.tombstone, k.in_flight), (member, _ms(ttl)))
        if int(ok) == 1:
            return None
        return -1.0 if int(left) < 0 else int(left) / 1000.0

    async def tombstone_left(self, sid: str) -> float | None:
        """Seconds the tombstone of ``sid`` still lives in Redis, or ``None`` if it has none.

        A tombstone without expiry answers ``-1.0``. Raises :class:`ClusterUnavailable`.
        """
        left: Any = await self._call(lambda: self._client.pttl(SessionKeys(sid).tombstone))
        # PTTL: -2 no such key, -1 no expiry (redis.io/commands/pttl).
        if int(left) == -2:
            return None
        return -1.0 if int(left) < 0 else int(left) / 1000.0

    async def deregister(self, sid: str, member: str, *, cancelled: bool) -> bool:
        """Remove ``member`` from the in-flight set; counts it in a running close's tally.

        Returns whether it was there.
        """
        k = SessionKeys(sid)
        removed = await self._run(
            "deregister",
            (k.tombstone, k.in_flight, k.tally),
            (member, "cancelled" if cancelled else "finished"),
        )
        return int(removed) == 1

    async def refresh(
        self, entries: Mapping[str, Iterable[str]], ttl: float, *, readd: bool = False
    ) -> None:
        """Push the deadline of every entry (sid -> members) to now + ``ttl`` seconds.

        One pipelined round trip for all sessions. ``readd``: also re-create
        entries Redis no longer has (reconcile after an outage); otherwise only
        existing entries are refreshed (a heartbeat never resurrects an entry a
        closer already expired).
        """
        if not entries:
            return
        mode = "" if readd else "XX"
        script = self._scripts["refresh"]

        async def pipelined() -> None:
            async with self._client.pipeline(transaction=False) as pipe:
                for sid, members in entries.items():
                    k = SessionKeys(sid)
                    args: list[str | int] = [_ms(ttl), mode, *members]
                    await script(keys=[k.tombstone, k.in_flight], args=args, client=pipe)
                await pipe.execute()

        # Redis runs one REFRESH in ~10-20 us: a budget per 10,000 sessions keeps a
        # node with many streams from reading a long pipeline as an outage.
        await self._call(pipelined, self.timeout * (1 + len(entries) // 10_000))

    async def begin_close(self, sid: str, close_id: str, tombstone_ttl: float) -> CloseStart:
        """Set the tombstone (if none) and reset the tally; see :class:`CloseStart`."""
        k = SessionKeys(sid)
        new, found, done = await self._run(
            "begin_close", (k.tombstone, k.tally), (close_id, _ms(tombstone_ttl))
        )
        return CloseStart(new=int(new) == 1, close_id=str(found), done=int(done) == 1)

    async def announce_close(self, sid: str, grace: float, origin: str) -> str:
        """``XADD`` the close command to the stream every node tails; returns the entry id.

        ``grace``: seconds each node gives the session's exchanges before cancelling.
        """
        entry: Any = await self._call(
            lambda: self._client.xadd(
                CLOSE_STREAM,
                {"sid": sid, "timeout": repr(grace), "origin": origin},
                maxlen=STREAM_MAXLEN,
                approximate=True,
            )
        )
        return str(entry)

    async def stream_tip(self) -> str:
        """The id of the newest close command, or ``0-0`` for an empty stream.

        A tailer starts after it: ``$`` in a loop of ``XREAD`` calls would skip
        whatever is added between two calls.
        """
        newest: Any = await self._call(
            lambda: self._client.xrevrange(CLOSE_STREAM, "+", "-", count=1)
        )
        return str(newest[0][0]) if newest else "0-0"

    async def tip_since(self, seconds: float) -> str:
        """A stream id older than every close command added in the last ``seconds``
        seconds, by Redis's own clock (``TIME``): a tailer reading after it misses none
        of them. ``0-0`` when ``seconds`` reaches back before the epoch."""
        now_s, now_us = await self._call(self._client.time)
        # Ids are "<ms>-<seq>"; XREAD returns ids after the one given, so one ms earlier.
        ms = int(now_s) * 1000 + int(now_us) // 1000 - math.ceil(seconds * 1000) - 1
        return f"{ms}-0" if ms > 0 else "0-0"

    async def prune(self, sid: str) -> int:
        """Expire entries past their deadline (counted in the tally); entries left."""
        k = SessionKeys(sid)
        return int(await self._run("prune", (k.in_flight, k.tally), ()))

    async def finish_close(self, sid: str) -> Tally:
        """Mark the close answered and read its tally."""
        k = SessionKeys(sid)

        async def transaction() -> Any:
            async with self._client.pipeline(transaction=True) as pipe:
                pipe.hset(k.tally, "done", 1)
                pipe.hgetall(k.tally)
                _, raw = await pipe.execute()
                return raw

        return _tally(await self._call(transaction))

    async def tally(self, sid: str) -> Tally:
        """The tally of the session's current (or last) close."""
        raw: Any = await self._call(lambda: self._client.hgetall(SessionKeys(sid).tally))
        return _tally(raw)

    async def in_flight(self, sid: str) -> list[str]:
        """Members of the session's in-flight set (expired ones included until pruned)."""
        members: Any = await self._call(
            lambda: self._client.zrange(SessionKeys(sid).in_flight, 0, -1)
        )
        return [str(m) for m in members]

    async def ledger_gate(
        self,
        sid: str,
        *,
        digest: str,
        comparable: bool,
        request_bytes: int,
        response_bytes: int,
        last_activity: float,
    ) -> tuple[str, int, bool]:
        """The ledger's hash gate in one script: ``(outcome, revision_epoch, dirty)``."""
        outcome, epoch, dirty = await self._run(
            "ledger_gate",
            (SessionKeys(sid).ledger,),
            (digest, int(comparable), request_bytes, response_bytes, repr(last_activity)),
        )
        return str(outcome), int(epoch), int(dirty) == 1

    async def ledger_gate_runs(
        self, writer: str, runs: Sequence[GateRun]
    ) -> list[tuple[str, int, bool]]:
        """Each :class:`~proxy.GateRun` through its session's gate (one script each, all
        pipelined in one round trip): ``(outcome of its first commit, revision_epoch,
        dirty)`` per run, in order. ``writer`` and each run's ``seq`` make a resent run
        a no-op (see :meth:`proxy.LedgerGate.apply_runs`)."""
        if not runs:
            return []
        script = self._scripts["ledger_gate_run"]

        async def pipelined() -> Any:
            async with self._client.pipeline(transaction=False) as pipe:
                for run in runs:
                    args: list[str | int] = [
                        run.first_digest,
                        int(run.first_comparable),
                        run.first_bytes_in,
                        run.first_bytes_out,
                        repr(run.first_last_activity),
                        run.requests,
                        run.bytes_in,
                        run.bytes_out,
                        run.flips,
                        run.digest,
                        int(run.comparable),
                        repr(run.last_activity),
                        f"run:{writer}",
                        -1 if run.seq is None else run.seq,
                    ]
                    await script(keys=[SessionKeys(run.session_id).ledger], args=args, client=pipe)
                return await pipe.execute()

        answers: Any = await self._call(pipelined)
        return [(str(o), int(e), int(d) == 1) for o, e, d, _dup in answers]

    async def ledger_mark_clean(self, sid: str, epoch: int | None) -> bool:
        """Clear the ledger's ``dirty`` flag (only at ``epoch`` if given); whether it was."""
        cleared = await self._run(
            "ledger_mark_clean", (SessionKeys(sid).ledger,), ("" if epoch is None else epoch,)
        )
        return int(cleared) == 1

    async def ledger_state(self, sid: str) -> dict[str, str]:
        """The raw ledger hash of ``sid`` (empty for an unknown session)."""
        raw: Any = await self._call(lambda: self._client.hgetall(SessionKeys(sid).ledger))
        return {str(k): str(v) for k, v in raw.items()}

    async def plugin_state(self, sid: str, name: str) -> dict[str, str]:
        """Plugin ``name``'s shared hash for ``sid`` (empty when there is none)."""
        raw: Any = await self._call(lambda: self._client.hgetall(SessionKeys(sid).plugin(name)))
        return {str(k): str(v) for k, v in raw.items()}

    async def save_plugin_state(
        self, sid: str, name: str, put: Mapping[str, str], drop: Sequence[str], ttl: float
    ) -> None:
        """Set ``put``, delete ``drop`` and refresh the TTL (seconds) in one transaction."""
        key = SessionKeys(sid).plugin(name)
        # redis-py's mapping type is invariant in its keys: a plain dict of str is not one.
        fields: Any = dict(put)

        async def transaction() -> Any:
            async with self._client.pipeline(transaction=True) as pipe:
                if drop:
                    pipe.hdel(key, *drop)
                if put:
                    pipe.hset(key, mapping=fields)
                pipe.pexpire(key, _ms(ttl))
                return await pipe.execute()

        await self._call(transaction)

    async def close(self) -> None:
        """Close the pool's connections."""
        await self._client.aclose()
        await self._pool.aclose()


def _retry(retries: int) -> Retry:
    """redis-py's retry policy for this store: ``retries`` more attempts after a
    ``ConnectionError`` (a connection that broke: refused, reset, closed by a
    restarted Redis), none after a timeout.

    redis-py's ``Retry`` retries ``TimeoutError`` by default and ``retry_on_error``
    only adds to that list, so the errors are given here explicitly: a retried
    timeout would make one command against a hung Redis cost twice ``timeout``.
    """
    return Retry(NoBackoff(), retries, supported_errors=(RedisConnectionError,))


def _ms(seconds: float) -> int:
    return max(1, round(seconds * 1000))


def _tally(raw: Mapping[str, str]) -> Tally:
    return Tally(
        finished=int(raw.get("finished", 0)),
        cancelled=int(raw.get("cancelled", 0)),
        expired=int(raw.get("expired", 0)),
        done=raw.get("done", "0") == "1",
    )


async def read_closes(
    client: aioredis.Redis, last_id: str, block_s: float, count: int = 500
) -> list[CloseCommand]:
    """One ``XREAD BLOCK`` of the close stream after ``last_id`` (``$``: only new ones).

    Returns the commands in stream order (empty after ``block_s`` seconds of
    silence). Malformed entries are returned with ``sid`` empty so the caller
    still advances past them.

    Raises:
        ClusterUnavailable: Redis could not be read.
    """
    try:
        answer: Any = await client.xread({CLOSE_STREAM: last_id}, count=count, block=_ms(block_s))
    except (RedisError, OSError, TimeoutError) as exc:
        raise ClusterUnavailable(f"redis: {type(exc).__name__}") from exc
    commands: list[CloseCommand] = []
    for _stream, entries in answer or ():
        for entry_id, fields in entries:
            try:
                timeout = float(fields.get("timeout", "0"))
            except ValueError:
                timeout = 0.0
            commands.append(
                CloseCommand(
                    entry_id=str(entry_id),
                    sid=str(fields.get("sid", "")),
                    timeout=max(0.0, timeout),
                    origin=str(fields.get("origin", "")),
                )
            )
    return commands

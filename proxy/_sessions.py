"""Session registry: per-session locks, in-flight tracking, shutdown, close_all.

docs/design.md §6. Pure asyncio (no aiohttp); one registry per proxy process, used
only from the server's event loop. The lock rules, which come from real deadlocks:

1. The registry has no lock of its own. Its dicts are only touched in synchronous
   stretches of code (single-threaded asyncio), so no registry-wide lock can ever
   be held across I/O or while waiting for a session lock.
2. Each session has one :class:`asyncio.Lock`, taken with ``async with
   registry.locked(sid)`` around prepare and around commit, never across the
   upstream stream, so a sub-agent's request does not queue behind a slow answer.
3. Never two session locks at once: :meth:`SessionRegistry.locked`,
   :meth:`SessionRegistry.status`, :meth:`SessionRegistry.shutdown_session` and
   :meth:`SessionRegistry.close_all` raise :class:`RuntimeError` when the calling
   context already holds one (tracked in a context variable, which child tasks
   created under the lock share until it is released).
4. ``close_all`` cleans up one session at a time under that session's own lock and
   re-publishes the failed ones only after every session lock is released.
5. ``shutdown_session`` tombstones first, then waits for and cancels in-flight
   exchanges, and only then drops the session's state.

In-flight tracking lives in the registry, keyed by session id, not in the session
object, so it outlives the session's state (close_all and eviction drop state,
never tracking). Eviction (the ``idle_cap`` LRU) only drops the registry's entry
(its lock and counters): ``on_close`` is not called and plugins keep their state
until a ``shutdown_session`` of that id or their own ``shutdown``.

Which session a request belongs to is decided in :mod:`proxy._session_ids`; the
tombstones are a :class:`~proxy._tombstones.TombstoneStore` (in-process by default,
injectable so cluster mode can share them).
"""

from __future__ import annotations

import asyncio
import contextvars
import dataclasses
import enum
import functools
import itertools
import math
import secrets
import time
from collections.abc import Awaitable, Callable, Iterable, Mapping
from types import TracebackType
from typing import Any, Final

from cachetools import LRUCache
from sortedcontainers import SortedDict

from ._tombstones import TombstoneSet, TombstoneStore

__all__ = [
    "SessionCloseError",
    "SessionClosed",
    "SessionInfo",
    "SessionLock",
    "SessionPage",
    "SessionRegistry",
    "SessionShutdown",
    "SessionStatus",
    "ShutdownResult",
    "Tracking",
    "shutdown_cause",
]

# --------------------------------------------------------------------------- results, errors


class SessionClosed(Exception):
    """The session is tombstoned: a request for it must not start.

    The HTTP layer answers 503 "session closed" with ``Retry-After``.
    ``retry_after`` is the number of seconds until the tombstone expires (for a
    shutdown still in progress: the full tombstone TTL, which only starts
    counting when the shutdown completes).
    """

    def __init__(self, sid: str, retry_after: float) -> None:
        super().__init__(f"session {sid!r} is closed")
        self.sid: Final = sid
        self.retry_after: Final = retry_after

    @property
    def retry_after_header(self) -> str:
        """``retry_after`` as a ``Retry-After`` value: whole seconds, rounded up.

        RFC 9110 section 10.2.3 allows only a non-negative integer of seconds (or a date).
        """
        return str(max(0, math.ceil(self.retry_after)))


class SessionCloseError(Exception):
    """Cleaning up one session (``on_close``) failed; the session stays retryable.

    ``cause`` is the exception ``on_close`` raised (also the ``__cause__``).
    :meth:`SessionRegistry.close_all` raises these inside one ``ExceptionGroup``;
    :meth:`SessionRegistry.shutdown_session` raises one directly.
    """

    def __init__(self, sid: str, cause: BaseException) -> None:
        super().__init__(sid, cause)
        self.sid: Final = sid
        self.cause: Final = cause
        self.__cause__ = cause

    def __str__(self) -> str:
        return f"session {self.sid!r}: cleanup failed: {type(self.cause).__name__}: {self.cause}"


@dataclasses.dataclass(frozen=True, slots=True)
class SessionShutdown:
    """The cancel message given to an exchange cancelled by ``shutdown_session``.

    The exchange's task sees ``CancelledError(SessionShutdown(sid))``; its own
    ``finally`` aborts the upstream request. Use :func:`shutdown_cause` to
    recognise it (e.g. to record the outcome ``cancelled``, or to end the
    stream with an in-band "session closed" error before re-raising).
    """

    sid: str


def shutdown_cause(exc: BaseException) -> SessionShutdown | None:
    """The :class:`SessionShutdown` marker carried by a ``CancelledError``, else ``None``."""
    if isinstance(exc, asyncio.CancelledError) and exc.args:
        marker = exc.args[0]
        if isinstance(marker, SessionShutdown):
            return marker
    return None


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class ShutdownResult:
    """What one ``shutdown_session`` did.

    ``finished``: in-flight exchanges that ended within the timeout.
    ``cancelled``: stragglers cancelled after the timeout (and then awaited).
    ``already_closed``: the id was already shut down and its tombstone is still
    alive; nothing was done (``on_close`` is not called again).
    """

    sid: str
    finished: int
    cancelled: int
    already_closed: bool = False


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class SessionInfo:
    """A consistent view of one session entry; times use the registry's clock (seconds).

    ``pinned`` is ``in_flight > 0`` (a pinned session is never evicted).
    ``locked``: some task holds its lock (prepare or commit running).
    ``tombstoned``: shut down or being shut down; new requests are refused.
    ``closing``: detached by a ``close_all`` that has not reached it yet or
    that failed to clean it up and has not re-published it yet.
    ``close_failed``: the last cleanup raised; kept (never evicted) for a retry.
    ``idle_s``: seconds since the last activity, at the time of the read.
    ``live``: ``False`` for a session known only from a plugin's storage (loaded
    at start-up, :meth:`SessionRegistry.add_stored`) that no request of this
    process has reached yet; ``requests`` counts this process's requests only.
    """

    id: str
    requests: int
    in_flight: int
    pinned: bool
    locked: bool
    tombstoned: bool
    closing: bool
    close_failed: bool
    created_at: float
    last_activity: float
    idle_s: float
    live: bool = True


@dataclasses.dataclass(frozen=True, slots=True)
class SessionPage:
    """One page of :meth:`SessionRegistry.page`: entries in creation order.

    ``next_cursor``: the opaque token to pass for the following page, or
    ``None`` when this page reached the last entry.
    """

    sessions: list[SessionInfo]
    next_cursor: str | None


@dataclasses.dataclass(frozen=True, slots=True)
class SessionStatus:
    """A status read taken under the session's lock (see :meth:`SessionRegistry.status`).

    ``state`` is what the probe returned (e.g. the plugins' ``session_state``),
    or an empty mapping without a probe.
    """

    info: SessionInfo
    state: Mapping[str, object]


# --------------------------------------------------------------------------- internals


class _State(enum.Enum):
    LIVE = "live"  # in _sessions: found by requests, may sit in the idle LRU
    DETACHED = "detached"  # in _detached: taken out by a running close_all
    ARCHIVED = "archived"  # on_close succeeded; gone for good
    EVICTED = "evicted"  # dropped by the idle LRU; on_close not called


class _Session:
    """Per-session state. ``lock_users`` counts tasks inside ``locked()`` (waiting or holding)."""

    __slots__ = (
        "close_failed",
        "created_at",
        "last_activity",
        "live",
        "lock",
        "lock_users",
        "requests",
        "seq",
        "sid",
        "state",
    )

    def __init__(self, sid: str, now: float, seq: int) -> None:
        self.sid: Final = sid
        # Creation order, the key of the registry's listing index (never reused).
        self.seq: Final = seq
        self.lock: Final = asyncio.Lock()
        self.created_at: Final = now
        self.last_activity = now
        self.requests = 0
        self.lock_users = 0
        self.state = _State.LIVE
        self.close_failed = False
        # False until a request of this process reaches a session loaded from storage.
        self.live = True


class _Held:
    """The session lock held in a context; ``active`` turns false on release."""

    __slots__ = ("active", "sid")

    def __init__(self, sid: str) -> None:
        self.sid: Final = sid
        self.active = True


# The session lock held by the current context. A task created while a lock is
# held copies the context and so shares the same record: while the lock is held
# the child is refused too (awaiting a child that waits for a second lock is the
# same deadlock; asyncio.wait_for on 3.11 runs its coroutine in a child task),
# and once the parent releases, the record is inactive and the child is free.
_HELD: Final[contextvars.ContextVar[_Held | None]] = contextvars.ContextVar(
    "context_proxy_session_lock", default=None
)


def _current_task(what: str) -> asyncio.Task[Any]:
    task = asyncio.current_task()
    if task is None:
        raise RuntimeError(f"{what} must run inside an asyncio task")
    return task


def _refuse_while_holding(what: str) -> None:
    held = _HELD.get()
    if held is not None and held.active:
        raise RuntimeError(
            f"{what}: this context already holds the lock of session {held.sid!r}; never "
            "wait for a session lock while holding one (docs/design.md §6, rule 3)"
        )


class _Hold:
    """Holding one session's lock in the current task, with the rule-3 check."""

    __slots__ = ("_held", "_pin", "_registry", "_reset", "session")

    def __init__(self, registry: SessionRegistry, session: _Session, *, pin: bool) -> None:
        self._registry = registry
        self.session = session
        # A status read does not pin: it must not count as use for the LRU order.
        self._pin = pin
        self._held: _Held | None = None
        self._reset: contextvars.Token[_Held | None] | None = None

    async def acquire(self) -> None:
        _refuse_while_holding("taking a session lock")
        session = self.session
        if self._pin:
            session.lock_users += 1
            self._registry._pin(session)
        try:
            await session.lock.acquire()
        except BaseException:
            if self._pin:
                session.lock_users -= 1
                self._registry._unpin(session)
            raise
        self._held = _Held(session.sid)
        self._reset = _HELD.set(self._held)

    def release(self) -> None:
        if self._held is None or self._reset is None:
            return
        self._held.active = False
        _HELD.reset(self._reset)
        self._held = self._reset = None
        session = self.session
        session.lock.release()
        if self._pin:
            session.lock_users -= 1
            session.last_activity = self._registry._clock()
            self._registry._unpin(session)


class SessionLock:
    """``async with registry.locked(sid):`` holds the session's lock (prepare, commit).

    Entering raises :class:`SessionClosed` if the session's shutdown has
    completed (an exchange admitted before the tombstone may still commit while
    the shutdown waits for it) and :class:`RuntimeError` if the task already
    holds a session lock. Not re-entrant; one ``async with`` per object.
    """

    __slots__ = ("_hold", "_registry", "sid")

    def __init__(self, registry: SessionRegistry, sid: str) -> None:
        self._registry = registry
        self.sid: Final = sid
        self._hold: _Hold | None = None

    async def __aenter__(self) -> None:
        if self._hold is not None:
            raise RuntimeError("a SessionLock is entered once")
        self._hold = await self._registry._hold_sid(self.sid, for_shutdown=False)

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        if self._hold is not None:
            self._hold.release()


class Tracking:
    """``with registry.track(sid):`` marks the current exchange in flight for ``sid``.

    Entering admits and registers in one synchronous step (no ``await`` in
    between, so no request can pass admission after a tombstone and still be
    missed by ``shutdown_session``); it raises :class:`SessionClosed` if the
    session is tombstoned. Leaving always deregisters, on success, exception or
    cancellation. ``task`` is the task running the block (the one
    ``shutdown_session`` cancels). With ``sid=None`` (a request without a
    session) it does nothing, so no entry is ever keyed by ``None``.
    """

    __slots__ = ("_entered", "_exited", "_registry", "_waiter", "sid", "task")

    def __init__(self, registry: SessionRegistry, sid: str | None, task: asyncio.Task[Any]) -> None:
        self._registry = registry
        self.sid: Final = sid
        self.task: Final = task
        self._entered = False
        self._exited = False
        # Created only when a shutdown waits for this exchange.
        self._waiter: asyncio.Future[None] | None = None

    def __enter__(self) -> Tracking:
        if self._entered:
            raise RuntimeError("a Tracking is entered once")
        self._registry._enter_tracking(self)
        self._entered = True
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self._registry._exit_tracking(self)


def _check_non_negative(name: str, value: float) -> None:
    if not (value >= 0 and math.isfinite(value)):
        raise ValueError(f"{name} must be a finite number >= 0, got {value!r}")


class _IdleSessions(LRUCache[str, _Session]):
    """The idle sessions, least recently used first; evicting one drops its entry.

    cachetools' documented way to act on an eviction is to override
    ``popitem``, which the cache calls when an insertion passes ``maxsize``
    (``clear`` does not call it). The pinning rule holds because the registry
    inserts only sessions with nothing in flight, no task in their lock and no
    failed cleanup, and removes a session the moment it is pinned again.
    """

    def __init__(self, maxsize: int, on_evict: Callable[[_Session], None]) -> None:
        super().__init__(maxsize)
        self._on_evict = on_evict

    def popitem(self) -> tuple[str, _Session]:
        sid, victim = super().popitem()
        self._on_evict(victim)
        return sid, victim


# --------------------------------------------------------------------------- registry


class SessionRegistry:
    """All sessions of one proxy process (docs/design.md §6).

    Args:
        idle_cap: most idle sessions kept (>= 0); when exceeded, the least
            recently used idle ones are evicted. A session is idle when nothing
            is in flight for it, no task is in its lock, and its last cleanup did
            not fail. Eviction drops the registry's entry only (no ``on_close``).
        tombstone_ttl: seconds (finite, >= 0) a tombstone outlives the completion
            of its shutdown, measured with ``clock``; expired tombstones are
            dropped lazily on access and in bulk.
        tombstone_cap: most completed tombstones kept (>= 0), so closing
            millions of sessions stays bounded (see :class:`TombstoneSet`).
        clock: monotonic seconds; injectable for tests.
        tombstones: the tombstone store to use instead of a
            :class:`TombstoneSet` built from ``tombstone_ttl``,
            ``tombstone_cap`` and ``clock`` (cluster mode shares one); give
            either it or those two settings.
        on_close: awaited with the session id when a session is archived (the
            plugins' ``session_closed``); runs under the session's lock. If it
            raises, the session is kept and the error is reported.
        before_close: awaited with the session id before a shutdown or
            ``close_all`` takes the session's lock to archive it, holding no
            lock (the app waits there for the session's pending commits, which
            take that lock themselves). Must not raise.

    Raises:
        ValueError: a negative or non-finite argument.
    """

    __slots__ = (
        "_before_close",
        "_clock",
        "_closing",
        "_detached",
        "_idle",
        "_in_flight_total",
        "_inflight",
        "_listing",
        "_listing_token",
        "_next_seq",
        "_on_close",
        "_sessions",
        "_tombstones",
        "evictions",
    )

    def __init__(
        self,
        *,
        idle_cap: int,
        tombstone_ttl: float | None = None,
        tombstone_cap: int | None = None,
        clock: Callable[[], float] = time.monotonic,
        on_close: Callable[[str], Awaitable[None]] | None = None,
        tombstones: TombstoneStore | None = None,
        before_close: Callable[[str], Awaitable[None]] | None = None,
    ) -> None:
        _check_non_negative("idle_cap", idle_cap)
        if tombstones is None:
            if tombstone_ttl is None or tombstone_cap is None:
                raise TypeError("give tombstone_ttl and tombstone_cap, or a tombstone store")
            tombstones = TombstoneSet(ttl=tombstone_ttl, cap=tombstone_cap, clock=clock)
        elif tombstone_ttl is not None or tombstone_cap is not None:
            raise TypeError("give tombstone_ttl and tombstone_cap, or a tombstone store, not both")
        self._clock = clock
        self._on_close = on_close
        self._before_close = before_close
        self._sessions: dict[str, _Session] = {}
        self._detached: dict[str, _Session] = {}
        # Subset of _sessions that may be evicted, least recently used first. Only
        # unpinned sessions ever enter it (see _unpin), so the cache's own eviction
        # can never drop a session with work in flight or a task in its lock.
        self._idle: _IdleSessions | None = (
            _IdleSessions(idle_cap, self._evict) if idle_cap > 0 else None
        )
        # Every entry (live and detached) by creation number, so a listing page
        # starts at its cursor in O(log n) and costs O(page), never a scan or sort of
        # all sessions (GET /admin/sessions on the event loop).
        self._listing: SortedDict[int, _Session] = SortedDict()
        self._next_seq = itertools.count()
        # Names this registry in its cursors: one from another process (a restart
        # renumbers the entries) is refused rather than silently misplaced.
        self._listing_token: Final = secrets.token_hex(4)
        self._inflight: dict[str, set[Tracking]] = {}
        self._in_flight_total = 0
        # Completed shutdowns (tombstoned for their TTL).
        self._tombstones: Final[TombstoneStore] = tombstones
        # Shutdowns in progress (tombstoned until done): sid -> the shared task.
        self._closing: dict[str, asyncio.Task[ShutdownResult]] = {}
        self.evictions = 0
        """Sessions evicted by the idle LRU since start (a counter for metrics)."""

    # ----------------------------------------------------------------- tombstones

    def is_tombstoned(self, sid: str) -> bool:
        """Whether ``sid`` is being shut down or was shut down less than the TTL ago."""
        return sid in self._closing or sid in self._tombstones

    @property
    def tombstone_count(self) -> int:
        """Completed, unexpired tombstones kept (at most ``tombstone_cap``)."""
        return self._tombstones.count()

    def tombstone_remaining(self, sid: str) -> float | None:
        """Seconds until new requests for ``sid`` are accepted again, or ``None``.

        A shutdown still in progress answers the full ``tombstone_ttl`` (its
        tombstone's lifetime starts when the shutdown completes).
        """
        if sid in self._closing:
            return self._tombstones.ttl
        return self._tombstones.remaining_ttl(sid)

    def tombstoned(self) -> list[tuple[str, float]]:
        """Every tombstoned id as ``(sid, remaining seconds)``: closing ones, then closed.

        Bounded by the shutdowns in progress plus ``tombstone_cap``; takes no lock.
        """
        ttl = self._tombstones.ttl
        closing = [(sid, ttl) for sid in self._closing]
        return closing + [
            (sid, left) for sid, left in self._tombstones.items() if sid not in self._closing
        ]

    def tombstoned_page(
        self, cursor: str | None, limit: int
    ) -> tuple[list[tuple[str, float]], str | None]:
        """One page of :meth:`tombstoned`: ``(sid, remaining seconds)`` items, next cursor.

        The first page (``cursor=None``) has every close in progress, then up to
        ``limit`` closed ids, oldest tombstone first; the next pages continue
        the closed ones after the cursor (``None``: no more). O(page) work (the
        shutdowns in progress are few: one per close being run).

        Raises:
            ValueError: ``limit`` < 1, or a cursor this registry did not issue
                for this listing.
        """
        after = -1
        closing: list[tuple[str, float]] = []
        if cursor is None:
            ttl = self._tombstones.ttl
            closing = [(sid, ttl) for sid in self._closing]
        else:
            token, _, number = cursor.partition(".t")
            if token != self._listing_token or not (number.isascii() and number.isdigit()):
                raise ValueError("cursor: not one this process issued (start again without one)")
            after = int(number)
        closed, position = self._tombstones.page(after, limit)
        closed = [(sid, left) for sid, left in closed if sid not in self._closing]
        following = None if position is None else f"{self._listing_token}.t{position}"
        return closing + closed, following

    def _refuse_tombstoned(self, sid: str) -> None:
        """Raise :class:`SessionClosed` if ``sid`` has a live, completed tombstone."""
        remaining = self._tombstones.remaining_ttl(sid)
        if remaining is not None:
            raise SessionClosed(sid, remaining)

    def admit(self, sid: str) -> None:
        """Refuse a new request for a tombstoned session; creates no state.

        An early check (e.g. before reading the body when the id comes from a
        header); :meth:`track` repeats it atomically with registration.

        Raises:
            SessionClosed: ``sid`` is tombstoned.
        """
        if sid in self._closing:
            raise SessionClosed(sid, self._tombstones.ttl)
        self._refuse_tombstoned(sid)

    # ----------------------------------------------------------------- entries, LRU

    def _find(self, sid: str) -> _Session | None:
        session = self._sessions.get(sid)
        return session if session is not None else self._detached.get(sid)

    def _get_or_create(self, sid: str) -> _Session:
        """The entry of ``sid``; a new one is not idle, the caller pins it at once."""
        session = self._find(sid)
        if session is None:
            session = _Session(sid, self._clock(), next(self._next_seq))
            self._sessions[sid] = session
            self._listing[session.seq] = session
        return session

    def add_stored(self, sid: str, idle_s: float) -> bool:
        """List ``sid``, known from a plugin's storage, as an idle session that is not live.

        ``idle_s``: seconds since its last activity (>= 0). The entry is an
        ordinary idle one (the LRU may evict it; a request makes it live); it
        has no work, so ``close_all`` drops it without ``on_close`` (the plugins
        that stored it flush at their own shutdown), while ``shutdown_session``
        closes it as any other. Call oldest first: the LRU keeps the newest.
        Returns whether it was added: not for an id that already has an entry
        or a tombstone, nor when ``idle_cap`` is 0 (no idle session is kept).
        """
        if self._idle is None or self._find(sid) is not None or self.is_tombstoned(sid):
            return False
        session = _Session(sid, self._clock(), next(self._next_seq))
        session.live = False
        session.last_activity = session.created_at - max(0.0, idle_s)
        self._sessions[sid] = session
        self._listing[session.seq] = session
        self._idle[sid] = session
        return True

    def _pin(self, session: _Session) -> None:
        if session.state is _State.LIVE and self._idle is not None:
            self._idle.pop(session.sid, None)

    def _unpin(self, session: _Session) -> None:
        if (
            session.state is _State.LIVE
            and session.lock_users == 0
            and not session.close_failed
            and session.sid not in self._inflight
        ):
            if self._idle is None:
                self._evict(session)  # idle_cap 0: no idle session is kept
            else:
                # Most recently used; the cache evicts its least recently used one
                # (through _evict) when this passes idle_cap.
                self._idle[session.sid] = session

    def _evict(self, session: _Session) -> None:
        self._drop(session, _State.EVICTED)
        self.evictions += 1

    def _drop(self, session: _Session, state: _State) -> None:
        sid = session.sid
        if self._sessions.get(sid) is session:
            del self._sessions[sid]
        if self._detached.get(sid) is session:
            del self._detached[sid]
        if self._idle is not None and sid in self._idle:
            del self._idle[sid]
        self._listing.pop(session.seq, None)
        session.state = state

    def _republish(self, session: _Session) -> None:
        """Put a detached session back into the live dict (readable, retryable)."""
        if session.state is not _State.DETACHED:
            return
        if self._detached.get(session.sid) is session:
            del self._detached[session.sid]
        session.state = _State.LIVE
        if self._sessions.setdefault(session.sid, session) is not session:
            # A newer entry of the id took its place: this one is no longer listed.
            self._listing.pop(session.seq, None)
            return
        self._unpin(session)

    # ----------------------------------------------------------------- locks

    def locked(self, sid: str) -> SessionLock:
        """The session's lock, for ``async with``: around prepare and commit only.

        Creates the session entry if needed. See :class:`SessionLock` for the
        errors raised on entry.
        """
        return SessionLock(self, sid)

    async def _hold_sid(self, sid: str, *, for_shutdown: bool) -> _Hold | None:
        """Hold the lock of the current entry of ``sid``.

        If the entry is archived while we wait, a request gets
        :class:`SessionClosed` when the id is tombstoned and a fresh entry
        otherwise (close_all archived it under a late exchange); a shutdown gets
        ``None`` (someone else already archived it).
        """
        while True:
            # Both checks before creating anything, so a refused call leaves no entry.
            _refuse_while_holding("taking a session lock")
            if not for_shutdown:
                self._refuse_tombstoned(sid)
            session = self._get_or_create(sid)
            hold = _Hold(self, session, pin=True)
            await hold.acquire()
            if session.state in (_State.LIVE, _State.DETACHED):
                return hold
            hold.release()
            if for_shutdown:
                return None
            if sid in self._closing:
                raise SessionClosed(sid, self._tombstones.ttl)
            self._refuse_tombstoned(sid)

    # ----------------------------------------------------------------- in-flight

    def track(self, sid: str | None, task: asyncio.Task[Any] | None = None) -> Tracking:
        """A context manager marking ``task`` (default: the current task) in flight.

        Use it around the whole exchange: ``with registry.track(sid): ...``.
        See :class:`Tracking`.

        Raises:
            RuntimeError: no task given and none running.
        """
        return Tracking(self, sid, task if task is not None else _current_task("track()"))

    def _enter_tracking(self, tracking: Tracking) -> None:
        sid = tracking.sid
        if sid is None:
            return
        self.admit(sid)
        session = self._get_or_create(sid)
        bucket = self._inflight.get(sid)
        if bucket is None:
            bucket = self._inflight[sid] = set()
        bucket.add(tracking)
        self._in_flight_total += 1
        session.requests += 1
        session.live = True
        session.last_activity = self._clock()
        self._pin(session)

    def _exit_tracking(self, tracking: Tracking) -> None:
        if tracking._exited or not tracking._entered:
            return
        tracking._exited = True
        sid = tracking.sid
        if sid is None:
            return
        bucket = self._inflight.get(sid)
        if bucket is not None:
            bucket.discard(tracking)
            if not bucket:
                del self._inflight[sid]
        self._in_flight_total -= 1
        waiter = tracking._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)
        session = self._find(sid)
        if session is not None:
            session.last_activity = self._clock()
            self._unpin(session)

    def in_flight_of(self, sid: str) -> int:
        """Exchanges of ``sid`` in flight now (admitted, not yet ended)."""
        return len(self._inflight.get(sid, ()))

    @property
    def in_flight_total(self) -> int:
        """Exchanges currently inside a ``track()`` block, all sessions together."""
        return self._in_flight_total

    def tasks(self, sid: str) -> frozenset[asyncio.Task[Any]]:
        """The tasks currently tracked in flight for ``sid`` (mainly for tests)."""
        return frozenset(tracking.task for tracking in self._inflight.get(sid, ()))

    # ----------------------------------------------------------------- reads

    def _info(self, session: _Session, now: float) -> SessionInfo:
        in_flight = len(self._inflight.get(session.sid, ()))
        return SessionInfo(
            id=session.sid,
            requests=session.requests,
            in_flight=in_flight,
            pinned=in_flight > 0,
            locked=session.lock.locked(),
            tombstoned=self.is_tombstoned(session.sid),
            closing=session.state is _State.DETACHED,
            close_failed=session.close_failed,
            created_at=session.created_at,
            last_activity=session.last_activity,
            idle_s=max(0.0, now - session.last_activity),
            live=session.live,
        )

    def info(self, sid: str) -> SessionInfo | None:
        """The registry's view of ``sid`` without taking any lock; ``None`` if no entry."""
        session = self._find(sid)
        return None if session is None else self._info(session, self._clock())

    def snapshot(self) -> list[SessionInfo]:
        """Every session entry (live, then detached by a running close_all); takes no lock."""
        now = self._clock()
        sessions: Iterable[_Session] = [*self._sessions.values(), *self._detached.values()]
        return [self._info(session, now) for session in sessions]

    def page(self, cursor: str | None, limit: int) -> SessionPage:
        """At most ``limit`` entries (live and detached) after ``cursor``, oldest first.

        Entries are in creation order, so paging is stable while sessions come
        and go: every entry that lives through a whole walk of the pages is
        listed exactly once; one created meanwhile shows up on a later page, one
        dropped meanwhile is skipped. An id evicted and seen again is a new entry
        (listed again, later). Work is O(log n + ``limit``): the page starts at
        the cursor in the creation index, nothing else is visited. Takes no lock.

        Args:
            cursor: ``None`` for the first page, else a previous page's
                ``next_cursor`` (opaque).
            limit: most entries returned (>= 1).

        Raises:
            ValueError: ``limit`` < 1, or ``cursor`` is malformed or was issued
                by another registry (e.g. before a restart).
        """
        if limit < 1:
            raise ValueError(f"limit must be >= 1, got {limit!r}")
        after = -1
        if cursor is not None:
            token, _, number = cursor.partition(".")
            if token != self._listing_token or not (number.isascii() and number.isdigit()):
                raise ValueError("cursor: not one this process issued (start again without one)")
            after = int(number)
        keys = self._listing.irange(minimum=after, inclusive=(False, True))
        now = self._clock()
        picked = [self._listing[seq] for seq in itertools.islice(keys, limit + 1)]
        more = len(picked) > limit
        sessions = [self._info(session, now) for session in picked[:limit]]
        next_cursor = f"{self._listing_token}.{picked[limit - 1].seq}" if more else None
        return SessionPage(sessions, next_cursor)

    @property
    def session_count(self) -> int:
        """Session entries held (live and detached), pinned or idle."""
        return len(self._sessions) + len(self._detached)

    async def status(
        self, sid: str, probe: Callable[[str], Mapping[str, object]] | None = None
    ) -> SessionStatus | None:
        """A consistent read of ``sid``, taken between two prepare/commit phases.

        Waits for the session's lock (so the read never sees a plugin's state
        half-way through a commit), runs ``probe(sid)`` under it (synchronous;
        e.g. ``PluginHost.session_state``), releases it. Never holds any other
        lock and never waits for anything but that one lock, so it cannot
        deadlock with a ``close_all`` that follows rule 4. It may wait as long
        as a prepare or commit runs: callers bound it with ``asyncio.timeout``
        and fall back to :meth:`info`. Does not count as use for the LRU.

        Returns ``None`` if ``sid`` has no entry (or it was dropped meanwhile).

        Raises:
            RuntimeError: the calling task holds a session lock (rule 3).
        """
        _refuse_while_holding("status()")
        session = self._find(sid)
        if session is None:
            return None
        hold = _Hold(self, session, pin=False)
        await hold.acquire()
        try:
            if session.state not in (_State.LIVE, _State.DETACHED):
                return None
            state: Mapping[str, object] = probe(sid) if probe is not None else {}
            return SessionStatus(self._info(session, self._clock()), state)
        finally:
            hold.release()

    # ----------------------------------------------------------------- shutdown

    def start_shutdown(
        self, sid: str, timeout: float, *, notify_unknown: bool = True
    ) -> asyncio.Future[ShutdownResult]:
        """Tombstone ``sid`` now and start shutting it down; see :meth:`shutdown_session`.

        Synchronous: when it returns, the tombstone is set (new requests get
        :class:`SessionClosed`) and the set of exchanges to wait for is fixed.
        Returns the shared future of the shutdown (the running one if a
        shutdown of ``sid`` is already in progress). Must run on the event loop.
        Do not await the future while holding a session lock: the shutdown
        takes the session's lock to archive it.

        ``notify_unknown``: whether ``on_close`` runs when the registry has no
        entry for ``sid`` by the time of archiving (an evicted id: plugins may
        still hold state). Cluster mode passes ``False`` for a session this node
        never served, so its plugins are not told about another node's session;
        the tombstone is set all the same.

        Raises:
            ValueError: ``timeout`` is negative or not finite.
        """
        _check_non_negative("timeout", timeout)
        running = self._closing.get(sid)
        if running is not None:
            return running
        loop = asyncio.get_running_loop()
        if sid in self._tombstones and self._find(sid) is None:
            done: asyncio.Future[ShutdownResult] = loop.create_future()
            done.set_result(ShutdownResult(sid=sid, finished=0, cancelled=0, already_closed=True))
            return done
        # Tombstone and snapshot in one synchronous step: an exchange admitted
        # before this line is in `tokens`; any later one is refused.
        tokens = tuple(self._inflight.get(sid, ()))
        target = self._find(sid)
        self._tombstones.discard(sid)
        # A fresh context: the shutdown belongs to no caller and inherits no held lock.
        task = loop.create_task(
            self._run_shutdown(sid, target, tokens, timeout, notify_unknown),
            context=contextvars.Context(),
        )
        self._closing[sid] = task
        # Registered first, so it runs before any awaiter resumes: callers see
        # the completed tombstone as soon as they see the result.
        task.add_done_callback(functools.partial(self._shutdown_done, sid))
        return task

    def _shutdown_done(self, sid: str, task: asyncio.Task[ShutdownResult]) -> None:
        if self._closing.get(sid) is task:
            del self._closing[sid]
        self._tombstones.add(sid)
        if not task.cancelled():
            # Retrieved here so an abandoned caller does not log "never retrieved";
            # the failure stays visible as close_failed on the kept entry.
            task.exception()

    # `timeout` is the grace period given to in-flight exchanges, not a deadline for
    # the call itself (hence the ASYNC109 exemption).
    async def shutdown_session(self, sid: str, timeout: float) -> ShutdownResult:  # noqa: ASYNC109
        """Shut one session down (docs/design.md §6, rule 5); idempotent.

        1. Tombstone ``sid``: from now on ``admit``/``track`` raise
           :class:`SessionClosed` (the HTTP layer's 503 "session closed").
        2. Wait up to ``timeout`` seconds (event-driven, no polling) for the
           exchanges in flight at that moment to leave their ``track()`` block.
        3. Cancel the stragglers with ``task.cancel(SessionShutdown(sid))``
           (their own ``finally`` aborts the upstream request), then wait for
           all of them to leave (no timeout: a task that swallows the
           cancellation holds the shutdown up).
        4. Under the session's own lock, await ``on_close(sid)`` and drop the
           session's state. ``on_close`` is called even if the registry has no
           entry (e.g. it was evicted), since plugins may still hold state.

        The tombstone's TTL starts when this completes. Concurrent calls for
        the same id share one shutdown (``on_close`` runs once); a call while
        the completed tombstone is alive returns ``already_closed=True``, unless
        the previous cleanup failed, in which case the cleanup is retried. The
        shutdown runs in its own task: cancelling a caller does not stop it.

        Raises:
            SessionCloseError: ``on_close`` raised; the entry is kept, marked
                ``close_failed``, and the session stays tombstoned.
            RuntimeError: the calling task holds a session lock (rule 3).
            ValueError: ``timeout`` is negative or not finite.
        """
        _refuse_while_holding("shutdown_session()")
        return await asyncio.shield(self.start_shutdown(sid, timeout))

    async def _run_shutdown(
        self,
        sid: str,
        target: _Session | None,
        tokens: tuple[Tracking, ...],
        grace: float,
        notify_unknown: bool,
    ) -> ShutdownResult:
        loop = asyncio.get_running_loop()
        waiters: dict[asyncio.Future[None], Tracking] = {}
        finished = cancelled = 0
        for tracking in tokens:
            if tracking._exited:
                finished += 1
                continue
            waiter: asyncio.Future[None] = loop.create_future()
            tracking._waiter = waiter
            waiters[waiter] = tracking
        if waiters:
            done, pending = await asyncio.wait(set(waiters), timeout=grace)
            finished += len(done)
            if pending:
                marker = SessionShutdown(sid)
                for waiter in pending:
                    tracking = waiters[waiter]
                    if tracking.task.done():
                        # Its block can no longer exit (a misuse of track(task=...)):
                        # deregister it here rather than wait forever.
                        self._exit_tracking(tracking)
                    else:
                        tracking.task.cancel(msg=marker)
                cancelled = len(pending)
                await asyncio.wait(pending)
        # The entry seen when the tombstone was set may have been archived since
        # (by a close_all): it must not be archived twice. Without an entry
        # (unknown or evicted id) on_close still runs, as plugins may hold state,
        # unless the caller knows this process never served the id.
        if not notify_unknown and self._find(sid) is None:
            return ShutdownResult(sid=sid, finished=finished, cancelled=cancelled)
        if self._before_close is not None:
            await self._before_close(sid)
        archived = target is not None and target.state is _State.ARCHIVED
        hold = None if archived else await self._hold_sid(sid, for_shutdown=True)
        if hold is not None:
            try:
                await self._archive(hold.session)
            finally:
                hold.release()
        return ShutdownResult(sid=sid, finished=finished, cancelled=cancelled)

    async def _archive(self, session: _Session) -> None:
        """Run ``on_close`` and drop the state; the caller holds the session's lock.

        Raises:
            SessionCloseError: ``on_close`` raised; the state is kept.
        """
        try:
            if self._on_close is not None:
                await self._on_close(session.sid)
        except Exception as exc:
            session.close_failed = True
            raise SessionCloseError(session.sid, exc) from exc
        self._drop(session, _State.ARCHIVED)

    # ----------------------------------------------------------------- close_all

    async def close_all(self) -> None:
        """Archive every session (process shutdown; docs/design.md §6, rule 4).

        Detaches a snapshot of all entries from the live dict, then for each
        one, one at a time, under that session's own lock: ``on_close(sid)`` and
        drop. Failures are collected; the failed sessions are re-published
        (readable, retryable by a later ``close_all``) only after every session
        lock has been released. Shutdowns already in progress are awaited
        rather than duplicated. A session archived here is never archived again.

        Does not wait for in-flight exchanges: process shutdown calls it after
        the streams have drained. An exchange still in flight keeps its
        tracking; if it then takes the session lock it gets a fresh entry.

        Raises:
            ExceptionGroup: of :class:`SessionCloseError`, one per failed session.
            RuntimeError: the calling task holds a session lock (rule 3).
        """
        _refuse_while_holding("close_all()")
        detached = list(self._sessions.values())
        self._sessions.clear()
        if self._idle is not None:
            self._idle.clear()  # not popitem(): nothing here is evicted
        for session in detached:
            session.state = _State.DETACHED
            self._detached[session.sid] = session
        failures: list[SessionCloseError] = []
        try:
            for session in detached:
                if session.sid in self._closing:
                    continue  # its shutdown_session archives it; awaited below
                if not session.live:
                    # Only listed from storage, never used here: nothing to close.
                    self._drop(session, _State.ARCHIVED)
                    continue
                if self._before_close is not None:
                    await self._before_close(session.sid)
                failure = await self._close_detached(session)
                if failure is not None:
                    failures.append(failure)
            failures.extend(await self._await_shutdowns())
        finally:
            # No session lock is held here (rule 4); also re-publishes what a
            # cancellation of close_all left unprocessed.
            for session in detached:
                self._republish(session)
        if failures:
            raise ExceptionGroup(
                f"close_all: {len(failures)} of {len(detached)} sessions failed to close",
                failures,
            )

    async def _close_detached(self, session: _Session) -> SessionCloseError | None:
        """Archive one detached session under its own lock; the failure, if any."""
        hold = _Hold(self, session, pin=True)
        await hold.acquire()
        try:
            if session.state is not _State.DETACHED:
                return None  # a concurrent shutdown_session archived it
            try:
                await self._archive(session)
            except SessionCloseError as failure:
                return failure
            return None
        finally:
            hold.release()

    async def _await_shutdowns(self) -> list[SessionCloseError]:
        running = list(self._closing.items())
        if not running:
            return []
        await asyncio.wait([task for _, task in running])
        failures: list[SessionCloseError] = []
        for sid, task in running:
            if task.cancelled():
                continue
            exc = task.exception()
            if isinstance(exc, SessionCloseError):
                failures.append(exc)
            elif exc is not None:
                failures.append(SessionCloseError(sid, exc))
        return failures

"""The upstream pool's policy, sans-I/O: which connection a request gets, who waits, what
to close.

:class:`PoolPolicy` holds the bookkeeping (idle connections per route, those in
use, requests waiting for a place under ``limit``) and answers each step with
what to do; the caller (:class:`proxy._upstream.UpstreamPool`) does it: opens a
connection for :data:`OPEN`, awaits a future for :data:`WAIT`, and applies the
:class:`Park`, :class:`Close`, :class:`Wake` and :class:`Fail` actions the other
steps return (as httpcore's pool returns the connections still to close). The
connections and waiters are the caller's objects, opaque here; nothing is
awaited, closed or timed in this module.

The rules: a place under ``limit`` (0: no limit) is handed to the first waiter
directly, so a newcomer never overtakes a waiter (FIFO); a waiter woken, then
cancelled, passes its place on; a reused connection is the route's most recent
idle one (the least likely to have been closed by the upstream); a connection
put back after the pool closed is closed.
"""

from __future__ import annotations

import collections
from collections.abc import Callable, Hashable
from typing import Final, Generic, TypeVar

__all__ = ["OPEN", "WAIT", "Close", "Fail", "Park", "PoolPolicy", "Reuse", "Wake"]

C = TypeVar("C", bound=Hashable)  # a connection
W = TypeVar("W")  # a waiter
K = TypeVar("K", bound=Hashable)  # a route key


class Reuse(Generic[C]):
    """Checkout's answer: take ``conn``, an idle connection of the route (in use now)."""

    __slots__ = ("conn",)

    def __init__(self, conn: C) -> None:
        self.conn = conn


class _Open:
    def __repr__(self) -> str:
        return "OPEN"


class _Wait:
    def __repr__(self) -> str:
        return "WAIT"


#: Checkout's answer: a place is held; open a connection, report it (:meth:`~PoolPolicy.opened`).
OPEN: Final = _Open()
#: Checkout's answer: no place; :meth:`~PoolPolicy.enqueue` a waiter and check out again when woken.
WAIT: Final = _Wait()


class Park(Generic[C]):
    """Keep ``conn`` idle for the next request (start its keep-alive time)."""

    __slots__ = ("conn",)

    def __init__(self, conn: C) -> None:
        self.conn = conn


class Close(Generic[C]):
    """Close ``conn``."""

    __slots__ = ("conn",)

    def __init__(self, conn: C) -> None:
        self.conn = conn


class Wake(Generic[W]):
    """Wake ``waiter``: a place is held for it (it checks out with ``woken=True``)."""

    __slots__ = ("waiter",)

    def __init__(self, waiter: W) -> None:
        self.waiter = waiter


class Fail(Generic[W]):
    """Fail ``waiter``: the pool closed."""

    __slots__ = ("waiter",)

    def __init__(self, waiter: W) -> None:
        self.waiter = waiter


class PoolPolicy(Generic[K, C, W]):
    """The pool's decisions (see the module docstring).

    ``limit`` bounds the connections in use (0: none); ``waiting(waiter)`` says
    whether a queued waiter still waits (one cancelled before its turn is skipped).
    """

    __slots__ = ("_idle", "_in_use", "_waiters", "_waiting", "closed", "limit", "reserved")

    def __init__(self, limit: int, waiting: Callable[[W], bool]) -> None:
        self.limit = limit
        self._waiting = waiting
        self._idle: dict[K, list[C]] = {}
        self._in_use: set[C] = set()
        self._waiters: collections.deque[W] = collections.deque()
        #: Places handed to woken waiters that have not checked out yet.
        self.reserved = 0
        #: Whether :meth:`shut` ran: checkouts are refused from then on.
        self.closed = False

    @property
    def idle(self) -> int:
        """Connections idle in the pool."""
        return sum(len(conns) for conns in self._idle.values())

    @property
    def in_use(self) -> int:
        """Connections carrying a request or an answer."""
        return len(self._in_use)

    @property
    def waiters(self) -> int:
        """Requests queued for a place."""
        return len(self._waiters)

    def checkout(
        self, key: K, *, usable: Callable[[C], bool], fresh: bool = False, woken: bool = False
    ) -> Reuse[C] | _Open | _Wait:
        """A place for a request to ``key``'s route: an idle connection (``usable`` says
        which still are; the others are dropped), :data:`OPEN`, or :data:`WAIT`.
        ``fresh``: never an idle one; ``woken``: the caller holds a reserved place.
        """
        if woken:
            self.reserved -= 1
        elif self.limit and (self._waiters or len(self._in_use) + self.reserved >= self.limit):
            return WAIT
        idle = None if fresh else self._idle.get(key)
        while idle:
            conn = idle.pop()  # the most recent
            if usable(conn):
                self._in_use.add(conn)
                return Reuse(conn)
        return OPEN

    def opened(self, conn: C) -> None:
        """``conn`` was made for an :data:`OPEN` place: it is in use from now on."""
        self._in_use.add(conn)

    def enqueue(self, waiter: W) -> None:
        """Queue ``waiter`` after a :data:`WAIT` (it is woken in turn)."""
        self._waiters.append(waiter)

    def withdraw(self, waiter: W, *, woken: bool) -> list[Wake[W]]:
        """``waiter`` stopped waiting (cancelled); ``woken``: a place was held for it,
        which goes to the next waiter. What to do: the waiters to wake."""
        if woken:
            self.reserved -= 1
            return self._hand_on()
        if waiter in self._waiters:  # (a woken one is off the queue already)
            self._waiters.remove(waiter)
        return []

    def checkin(self, key: K, conn: C, *, reusable: bool) -> list[Park[C] | Close[C] | Wake[W]]:
        """``conn`` is done with its request: kept idle if ``reusable`` and the pool is
        open, else closed; its place goes to the next waiter."""
        self._in_use.discard(conn)
        if not reusable or self.closed:
            return [Close(conn), *self._hand_on()]
        self._idle.setdefault(key, []).append(conn)
        return [Park(conn), *self._hand_on()] if self._waiters else [Park(conn)]

    def dropped(self, conn: C) -> list[Wake[W]]:
        """``conn`` closed while in use (or its connect failed): its place is free."""
        if conn not in self._in_use:
            return []
        self._in_use.discard(conn)
        return self._hand_on()

    def forget(self, key: K, conn: C) -> None:
        """``conn`` closed while idle."""
        idle = self._idle.get(key)
        if idle is not None and conn in idle:
            idle.remove(conn)
            if not idle:
                del self._idle[key]

    def shut(self) -> list[Fail[W] | Close[C]]:
        """The pool closes: every waiter fails, every connection (idle or in use) closes."""
        self.closed = True
        actions: list[Fail[W] | Close[C]] = [Fail(waiter) for waiter in self._waiters]
        self._waiters.clear()
        for conns in self._idle.values():
            actions.extend(Close(conn) for conn in conns)
        self._idle.clear()
        actions.extend(Close(conn) for conn in list(self._in_use))
        return actions

    def _hand_on(self) -> list[Wake[W]]:
        """Places came free: the first waiters to wake, each holding one."""
        waiters = self._waiters
        wake: list[Wake[W]] = []
        while waiters and len(self._in_use) + self.reserved < self.limit:
            waiter = waiters.popleft()
            if self._waiting(waiter):
                self.reserved += 1
                wake.append(Wake(waiter))
        return wake

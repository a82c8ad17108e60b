"""Tombstones: the ids of sessions shut down recently, so late requests get 503 (pure).

docs/design.md §6. A tombstone is set when a session's shutdown completes and
lives ``ttl`` seconds; while it lives, a request for that session is refused with
503 "session closed" and ``Retry-After`` = the tombstone's remaining lifetime. The
number kept is capped so that closing millions of sessions stays bounded.

:class:`TombstoneStore` is the seam the session registry codes against: the
in-process :class:`TombstoneSet` here, and a Redis-backed store in cluster mode
(docs/design.md §9) whose tombstones are Redis keys with a TTL. The interface is
synchronous because admission checks a tombstone and registers the exchange in
one synchronous step (lock rule 5: no request may slip between the tombstone and
the in-flight snapshot); a shared store answers from state it keeps locally
up to date, and does its round trips outside those steps.
"""

from __future__ import annotations

import itertools
import math
import time
from collections.abc import Callable
from typing import Final, Protocol

from cachetools import TTLCache
from sortedcontainers import SortedDict

__all__ = ["TombstoneSet", "TombstoneStore"]


class TombstoneStore(Protocol):
    """What the session registry needs from a tombstone store.

    Times are seconds of the store's own clock. Every method is synchronous,
    runs on the event loop and must not block.
    """

    @property
    def ttl(self) -> float:
        """Seconds a tombstone lives after :meth:`add` (finite, >= 0)."""
        ...

    def add(self, sid: str) -> None:
        """Tombstone ``sid`` for :attr:`ttl` seconds from now (re-adding restarts the TTL)."""
        ...

    def discard(self, sid: str) -> None:
        """Drop the tombstone of ``sid`` if there is one (a retried shutdown re-adds it)."""
        ...

    def remaining_ttl(self, sid: str) -> float | None:
        """Seconds until the tombstone of ``sid`` expires (> 0), or ``None`` if it has none."""
        ...

    def __contains__(self, sid: object) -> bool:
        """Whether ``sid`` has an unexpired tombstone."""
        ...

    def count(self) -> int:
        """Unexpired tombstones kept."""
        ...

    def items(self) -> list[tuple[str, float]]:
        """Every unexpired tombstone as ``(sid, remaining seconds)`` (for the admin views)."""
        ...

    def page(self, after: int, limit: int) -> tuple[list[tuple[str, float]], int | None]:
        """Up to ``limit`` (>= 1) unexpired tombstones set after position ``after``.

        Oldest first, as ``(sid, remaining seconds)``; ``after`` is -1 for the
        first page, else the position a previous page returned, which is the
        second item (``None`` once the last tombstone was listed). O(``limit``)
        apart from dropping expired tombstones (for the admin listing's pages).
        """
        ...


class _Cache(TTLCache[str, float, float]):
    """A TTLCache telling its owner about every key it drops by itself (expiry, the cap).

    cachetools' documented hooks: ``popitem`` (an eviction over ``maxsize``) and
    ``expire`` (called on every insertion, and by the owner).
    """

    def __init__(
        self, cap: int, ttl: float, clock: Callable[[], float], on_drop: Callable[[str], None]
    ) -> None:
        super().__init__(maxsize=cap, ttl=ttl, timer=clock)
        self._on_drop = on_drop

    def popitem(self) -> tuple[str, float]:
        key, value = super().popitem()
        self._on_drop(key)
        return key, value

    def expire(self, time: float | None = None) -> list[tuple[str, float]]:
        expired = super().expire(time)
        for key, _ in expired:
            self._on_drop(key)
        return expired


class TombstoneSet:
    """In-process tombstones with a TTL and a count cap (a :class:`TombstoneStore`).

    Backed by :class:`cachetools.TTLCache`: expired tombstones are dropped
    lazily on access and in bulk on every insertion, so memory stays
    O(``cap``). When the cap is reached, the least recently consulted
    tombstone goes first (the cache's LRU order; with no lookups in between,
    that is the oldest): one that late clients still hit is the one worth
    keeping.

    Args:
        ttl: seconds (finite, >= 0) a tombstone lives after :meth:`add`; 0
            keeps none alive.
        cap: most tombstones kept (>= 0); 0 keeps none.
        clock: monotonic seconds; injectable for tests.

    Raises:
        ValueError: ``ttl`` or ``cap`` is negative or not finite.
    """

    __slots__ = ("_cache", "_clock", "_next", "_order", "_position", "_ttl")

    def __init__(
        self, *, ttl: float, cap: int, clock: Callable[[], float] = time.monotonic
    ) -> None:
        _check_non_negative("tombstone_ttl", ttl)
        _check_non_negative("tombstone_cap", cap)
        self._ttl: Final = float(ttl)
        self._clock: Final = clock
        # The value is the expiry (clock seconds), for remaining_ttl; the cache
        # applies the same expiry itself. None with cap 0: cachetools refuses
        # maxsize 0 for a store, and a cap of 0 means "keep nothing".
        self._cache: Final[_Cache | None] = (
            _Cache(int(cap), self._ttl, clock, self._forget) if cap > 0 else None
        )
        # The order tombstones were set in, for the admin listing's pages: position
        # -> sid, and sid -> (position, expiry). Kept in step with the cache (its
        # own drops come through _forget), so it never holds more than ``cap``.
        self._order: Final[SortedDict[int, str]] = SortedDict()
        self._position: Final[dict[str, tuple[int, float]]] = {}
        self._next: Final = itertools.count()

    @property
    def ttl(self) -> float:
        """Seconds a tombstone lives after :meth:`add`."""
        return self._ttl

    def add(self, sid: str) -> None:
        """Tombstone ``sid`` for :attr:`ttl` seconds; evicts one when over the cap."""
        cache = self._cache
        if cache is None:
            return
        # One clock reading for the stored expiry and the cache's own.
        with cache.timer as now:
            cache[sid] = now + self._ttl
        if sid not in cache:
            return  # a TTL of 0: expired at once
        # After the insertion, whose own expiry and eviction may have dropped sid's
        # previous position: a re-added tombstone moves to the end.
        self._forget(sid)
        position = next(self._next)
        self._order[position] = sid
        self._position[sid] = (position, now + self._ttl)

    def discard(self, sid: str) -> None:
        """Drop the tombstone of ``sid``, if any."""
        if self._cache is not None:
            self._cache.pop(sid, None)
            self._forget(sid)

    def remaining_ttl(self, sid: str) -> float | None:
        """Seconds until the tombstone of ``sid`` expires, or ``None`` if it has none."""
        cache = self._cache
        if cache is None:
            return None
        with cache.timer as now:
            expires = cache.get(sid)
        if expires is None or now >= expires:
            return None
        return expires - now

    def __contains__(self, sid: object) -> bool:
        return self._cache is not None and sid in self._cache

    def count(self) -> int:
        """Unexpired tombstones kept (at most ``cap``)."""
        return 0 if self._cache is None else len(self._cache)

    def items(self) -> list[tuple[str, float]]:
        """Every unexpired tombstone as ``(sid, remaining seconds)``; at most ``cap`` entries."""
        cache = self._cache
        if cache is None:
            return []
        with cache.timer as now:
            # items() of a TTLCache skips expired entries; the expiry check here
            # keeps a tombstone expiring between the two readings out as well.
            return [(sid, expires - now) for sid, expires in cache.items() if expires > now]

    def page(self, after: int, limit: int) -> tuple[list[tuple[str, float]], int | None]:
        """Up to ``limit`` tombstones set after position ``after`` (see :class:`TombstoneStore`).

        Raises:
            ValueError: ``limit`` < 1.
        """
        if limit < 1:
            raise ValueError(f"limit must be >= 1, got {limit!r}")
        cache = self._cache
        if cache is None:
            return [], None
        with cache.timer as now:
            cache.expire(now)  # each tombstone is dropped once: amortised O(1)
            keys = self._order.irange(minimum=after, inclusive=(False, True))
            picked = list(itertools.islice(keys, limit + 1))
            out = []
            for position in picked[:limit]:
                sid = self._order[position]
                out.append((sid, self._position[sid][1] - now))
        return out, picked[limit - 1] if len(picked) > limit else None

    def _forget(self, sid: str) -> None:
        """Drop ``sid`` from the listing order (it left the cache, or is set again)."""
        known = self._position.pop(sid, None)
        if known is not None:
            del self._order[known[0]]


def _check_non_negative(name: str, value: float) -> None:
    if not (value >= 0 and math.isfinite(value)):
        raise ValueError(f"{name} must be a finite number >= 0, got {value!r}")

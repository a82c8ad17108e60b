"""File descriptors: the process limit, and telling their exhaustion apart from other errors.

Each open stream holds two sockets (client and upstream), so the soft
``RLIMIT_NOFILE`` many systems default to (1024) caps a proxy at a few hundred
streams although the hard limit allows far more.
"""

from __future__ import annotations

import enum
import errno
import os
import resource
import time
from collections.abc import Callable
from typing import Final

__all__ = [
    "DEFAULT_RESERVE",
    "EXHAUSTED_MESSAGE",
    "EXHAUSTION_ERRNOS",
    "FdBudget",
    "Verdict",
    "count_open_fds",
    "is_fd_exhaustion",
    "raise_nofile_limit",
]

#: ``EMFILE``: this process is at its limit; ``ENFILE``: the whole system is.
EXHAUSTION_ERRNOS: Final = frozenset({errno.EMFILE, errno.ENFILE})

#: What the client of a request refused for want of a descriptor reads (in a 503).
EXHAUSTED_MESSAGE: Final = "proxy is out of file descriptors; retry later"


DEFAULT_RESERVE: Final = 16
"""Descriptors kept free by default (the ``fd_reserve`` setting): for probes, 503s and the
process's own needs (a Redis reconnect, a log file, a second happy-eyeballs socket)."""

_FD_DIRS: Final = ("/proc/self/fd", "/dev/fd")

_MEASURE_EVERY_S: Final = 1.0
"""Seconds a count of open descriptors is trusted while far from the limit."""

_FAR: Final = 256
"""Descriptors past ``3 x reserve`` that make the limit far: counted at most once a second."""


def count_open_fds() -> int | None:
    """Descriptors this process has open (from ``/proc/self/fd``); None where unknown.

    O(open descriptors): about 30 µs for 256 of them.
    """
    for directory in _FD_DIRS:
        try:
            # The listing's own descriptor is in it.
            return len(os.listdir(directory)) - 1
        except OSError:
            continue
    return None


class Verdict(enum.Enum):
    """What to do with the next connection waiting to be accepted."""

    SERVE = "serve"
    """Accept it as any other: there is room for it and its upstream socket."""
    SHED = "shed"
    """Accept it from the reserve: answer its probe (``/healthz``, ``/readyz``,
    ``/metrics``) or a 503 with ``Retry-After``, then close it."""
    PAUSE = "pause"
    """Leave it in the kernel's queue: stop accepting until descriptors free up."""


class FdBudget:
    """Admission of new client connections by free file descriptors (``fd_reserve``).

    Free descriptors are the soft ``RLIMIT_NOFILE`` minus those open, less one
    for every served client connection that holds no upstream socket yet (each
    stream holds two: client and upstream; ``upstream_sockets`` reports how many
    upstream sockets the pool holds, in use or idle). A new connection is served
    while at least ``reserve`` would stay free after its two; below that it is
    accepted from the reserve and shed (:attr:`Verdict.SHED`: it holds one
    descriptor for the length of one small answer); with fewer than
    ``reserve // 4`` (at least 2) free, accepting stops (:attr:`Verdict.PAUSE`)
    and resumes as descriptors free up, like nginx's ``worker_connections``.

    Open descriptors are counted from the process (:func:`count_open_fds`) for
    every decision near the limit, and at most once a second while more than
    ``3 x reserve + 256`` are free (in between each accepted connection is
    taken to have added two). Where they cannot be counted, every connection
    is served (the limit then shows as a 503 when an upstream connect fails).

    Args:
        reserve: descriptors kept free (>= 4).
        upstream_sockets: upstream sockets open (the pool's in use + idle).
        count: open descriptors of the process, or None (tests inject one).
        limit: the descriptor limit now (tests inject one).
        clock: monotonic seconds.

    Raises:
        ValueError: ``reserve`` is under 4.
    """

    __slots__ = (
        "_accepted",
        "_clock",
        "_count",
        "_counted",
        "_counted_at",
        "_limit",
        "_upstream_sockets",
        "reserve",
    )

    def __init__(
        self,
        reserve: int = DEFAULT_RESERVE,
        *,
        upstream_sockets: Callable[[], int] = lambda: 0,
        count: Callable[[], int | None] = count_open_fds,
        limit: Callable[[], int] | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if reserve < 4:
            raise ValueError("fd_reserve must be >= 4 descriptors")
        self.reserve = reserve
        self._upstream_sockets = upstream_sockets
        self._count = count
        self._limit = limit or _soft_limit
        self._clock = clock
        self._counted: int | None = None
        self._counted_at = float("-inf")
        # Connections accepted since the count (each taken to have added two descriptors).
        self._accepted = 0

    def free(self, served: int) -> int | None:
        """Descriptors free once every served connection has its upstream socket; None: unknown.

        ``served``: client connections being served (not shed ones).
        """
        limit = self._limit()
        pending = max(0, served - self._upstream_sockets())
        now = self._clock()
        counted = self._counted
        if counted is not None and now - self._counted_at < _MEASURE_EVERY_S:
            estimate = limit - counted - 2 * self._accepted - pending
            if estimate > 3 * self.reserve + _FAR:
                return estimate
        counted = self._counted = self._count()
        self._counted_at = now
        self._accepted = 0
        if counted is None:
            return None
        return limit - counted - pending

    def verdict(self, served: int) -> Verdict:
        """What to do with the next waiting connection (see the class docstring)."""
        free = self.free(served)
        if free is None or free - 2 >= self.reserve:
            return Verdict.SERVE
        if free - 1 >= max(2, self.reserve // 4):
            return Verdict.SHED
        return Verdict.PAUSE

    def accepted(self) -> None:
        """A connection was accepted (counted until the next count of descriptors)."""
        self._accepted += 1


def _soft_limit() -> int:
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    return soft if soft != resource.RLIM_INFINITY else 1 << 20


def reserve_problem(fd_reserve: int, limit: int) -> str | None:
    """Why ``fd_reserve`` cannot work under a descriptor ``limit``, or ``None``.

    The server serves a connection only while ``fd_reserve`` descriptors stay
    free after its two, and stops accepting under a quarter of it: a reserve of
    half the limit or more leaves (almost) nothing to serve with, and a proxy
    that starts with it answers no connection at all, probes included.
    """
    if fd_reserve * 2 > limit:
        return (
            f"fd_reserve: {fd_reserve} leaves too few of the {limit} file descriptors "
            "this process may open to serve with (keep it under half of the limit)"
        )
    return None


def reachable_nofile_limit() -> int:
    """The soft ``RLIMIT_NOFILE`` :func:`raise_nofile_limit` would set (nothing changed)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    target = hard if hard != resource.RLIM_INFINITY else max(soft, 1 << 20)
    return max(target, soft) if soft != resource.RLIM_INFINITY else target


def raise_nofile_limit() -> tuple[int, int]:
    """Raise the soft ``RLIMIT_NOFILE`` to the hard limit; return ``(before, after)``.

    An unlimited hard limit is not a valid soft limit on Linux: the soft limit
    then goes to ``fs.nr_open``'s usual ceiling, 1,048,576. If the kernel refuses
    (a container's seccomp, say), the limit stays as it was.
    """
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    target = hard if hard != resource.RLIM_INFINITY else max(soft, 1 << 20)
    if target <= soft and soft != resource.RLIM_INFINITY:
        return soft, soft
    try:
        resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
    except (ValueError, OSError):
        return soft, soft
    return soft, target


def is_fd_exhaustion(exc: BaseException | None) -> bool:
    """Whether ``exc`` (or an error it wraps) is ``EMFILE``/``ENFILE``.

    A failed upstream connect comes wrapped (``proxy._upstream.ConnectFailed``)
    with the original as ``__cause__``/``os_error``, as aiohttp's errors do.
    """
    seen = 0
    while exc is not None and seen < 8:  # a short chain; bounded all the same
        if isinstance(exc, OSError) and exc.errno in EXHAUSTION_ERRNOS:
            return True
        inner = getattr(exc, "os_error", None)
        exc = inner if isinstance(inner, BaseException) else (exc.__cause__ or exc.__context__)
        seen += 1
    return False

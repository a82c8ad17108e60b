"""Commits as tracked work: every finished exchange's ``commit`` hooks run exactly once.

docs/design.md §5: the commit runs after the last byte was written, exactly once,
whatever the client does next; session close and shutdown wait for pending
commits. A commit therefore never runs in the request handler's task: the
server edge (:mod:`proxy._front`) cancels that task when the client hangs up, and
a handler that awaited its commit would also hold its keep-alive connection (the
edge serves the connection's next request only once the handler returned), so
the client's next request would wait for a slow hook. Instead the handler hands
the record to :meth:`CommitTracker.start` in its ``finally`` and returns; the
commit runs in a task of its own, owned by the app state, in a fresh context
(it inherits no session lock and no cancellation), keyed by session id so that
``shutdown_session`` and ``close_all`` can wait for a session's commits before
they archive it, and the process drain for all of them before the plugins are
flushed.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import logging
import math
import time
from collections.abc import Awaitable, Callable
from contextlib import AbstractAsyncContextManager
from typing import Final

from prometheus_client import CollectorRegistry

from . import _logs as logs
from ._plugins import ExchangeRecord, within
from ._tally import CounterTally, TallyCollector

__all__ = ["CommitTracker"]

log = logging.getLogger("context_proxy.commits")

#: ``run(record)``: books one record (the app's: the plugins' commit hooks).
CommitRunner = Callable[[ExchangeRecord], Awaitable[None]]
#: ``lock(record)``: what ``run`` must hold (the app's: the session's lock), entered
#: before the budget starts.
CommitLock = Callable[[ExchangeRecord], AbstractAsyncContextManager[object]]


def _no_lock(record: ExchangeRecord) -> AbstractAsyncContextManager[object]:
    return contextlib.nullcontext()


class CommitTracker:
    """The pending commits of one proxy instance.

    Args:
        run: awaited with each record, once, in a task of its own, inside
            ``lock(record)``.
        timeout: seconds ``run`` may take (the hooks' time) before it is
            cancelled and counted ``timed_out``; ``math.inf`` for no bound. The
            wait to enter ``lock`` is not counted: a queue of commits behind a
            slow one (one session's commits run one at a time) must not spend
            the budget of the ones at its end, or a single slow hook would cost
            every plugin the commits queued behind it. That wait is bounded by
            the holders ahead, each bounded by its own budget.
        lock: the context each ``run`` holds (the session's lock); default none.
        registry: the Prometheus registry the ``context_proxy_commits`` counter
            (label ``event``: ``started``, ``finished``, ``failed``,
            ``timed_out``) is registered in.
        hooked: whether any plugin has a ``commit`` hook. Without one there is
            nothing to book: :meth:`count_unbooked` counts the commit, and no
            record, task or session lock is spent on it.

    ``started = finished + failed + timed_out + pending`` at any time. A commit
    counts ``failed`` when ``run`` raised (a plugin hook that raises or times
    out is isolated by :class:`~proxy._plugins.PluginHost` and does not fail the
    commit).
    """

    __slots__ = (
        "_by_session",
        "_counters",
        "_lock",
        "_pending",
        "_run",
        "_tally",
        "hooked",
        "timeout",
    )

    def __init__(
        self,
        run: CommitRunner,
        *,
        timeout: float,
        registry: CollectorRegistry,
        hooked: bool = True,
        lock: CommitLock = _no_lock,
    ) -> None:
        self._run = run
        self._lock = lock
        self.hooked: Final = hooked
        self.timeout = timeout if timeout > 0 else math.inf
        self._pending: set[asyncio.Task[None]] = set()
        self._by_session: dict[str, set[asyncio.Task[None]]] = {}
        counter = CounterTally(
            "context_proxy_commits",
            "Exchange commits (the plugins' commit hooks), by event",
            ["event"],
        )
        registry.register(TallyCollector([counter]))
        events = ("started", "finished", "failed", "timed_out")
        self._counters: Final = {event: counter.labels(event) for event in events}
        self._tally: Final = dict.fromkeys(events, 0)

    @property
    def pending(self) -> frozenset[asyncio.Task[None]]:
        """The commit tasks not finished yet."""
        # A task cancelled before its first step never ran _book's finally.
        return frozenset(task for task in self._pending if not task.done())

    def count(self, event: str) -> int:
        """How many commits reached ``event`` (``started``, ``finished``, ``failed``,
        ``timed_out``) since start."""
        return self._tally[event]

    def _bump(self, event: str) -> None:
        self._tally[event] += 1
        self._counters[event].inc()

    def pending_for(self, session_id: str) -> int:
        """How many commits of ``session_id`` are not booked yet (queued or running)."""
        tasks = self._by_session.get(session_id)
        return 0 if tasks is None else len(tasks)

    def count_unbooked(self) -> None:
        """Count one commit with no hook to run (``hooked`` is false): started and finished.

        Synchronous; nothing is left pending.
        """
        # _bump twice, inline: most exchanges end here (no plugin takes them).
        tally, counters = self._tally, self._counters
        tally["started"] += 1
        counters["started"].inc()
        tally["finished"] += 1
        counters["finished"].inc()

    def start(self, record: ExchangeRecord, run: CommitRunner | None = None) -> asyncio.Task[None]:
        """Book ``record`` in the background; returns at once (synchronous).

        ``run``: what books this record instead of the tracker's runner (the app's:
        the commit hooks of the plugins that take it). The task runs in a fresh
        context, so the caller's cancellation, session lock and context variables
        do not reach it. Must run on the event loop.
        """
        self._bump("started")
        task = asyncio.get_running_loop().create_task(
            self._book(record, self._run if run is None else run), context=contextvars.Context()
        )
        self._pending.add(task)
        sid = record.session_id
        if sid is not None:
            self._by_session.setdefault(sid, set()).add(task)
        # Taken off the books by the task itself, in its last step (_book): a done
        # callback would cost each commit one more handle on the loop.
        return task

    def _done(self, sid: str | None, task: asyncio.Task[object] | None) -> None:
        self._pending.discard(task)
        if sid is not None:
            tasks = self._by_session.get(sid)
            if tasks is not None:
                tasks.discard(task)
                if not tasks:
                    del self._by_session[sid]

    async def _book(self, record: ExchangeRecord, run: CommitRunner) -> None:
        try:
            await self._booked(record, run)
        finally:
            self._done(record.session_id, asyncio.current_task())

    async def _booked(self, record: ExchangeRecord, run: CommitRunner) -> None:
        # A fresh context: give its log records the exchange's ids again.
        logs.EXCHANGE_ID.set(record.exchange_id)
        logs.SESSION_ID.set(record.session_id)
        began = time.monotonic()
        try:
            lock = self._lock(record)
            if isinstance(lock, contextlib.nullcontext):
                # No lock to hold (no session): its enter and exit would do nothing.
                began = time.monotonic()
                await within(run(record), self.timeout)
            else:
                async with lock:
                    began = time.monotonic()  # the budget starts with the hooks
                    # No timer unless a hook suspends (within).
                    await within(run(record), self.timeout)
        except TimeoutError:
            self._bump("timed_out")
            log.warning(
                "%s: commit did not finish within %.1fs (%.1fs spent); cancelled",
                record.exchange_id,
                self.timeout,
                time.monotonic() - began,
            )
        except asyncio.CancelledError:
            # Only the process itself cancels a commit (a loop closing at exit).
            self._bump("failed")
            raise
        except Exception as exc:
            self._bump("failed")
            log.error("%s: commit failed: %s", record.exchange_id, type(exc).__name__)
        else:
            self._bump("finished")

    async def wait(self, session_id: str | None = None, *, timeout: float) -> int:  # noqa: ASYNC109
        """Wait up to ``timeout`` seconds for the pending commits of ``session_id``
        (all of them when ``None``), including any that start while waiting.

        Returns the number still pending afterwards (0: all booked). Never
        cancels a commit: one that outlives the wait goes on, its hooks bounded
        by :attr:`timeout`.
        """
        deadline = time.monotonic() + max(timeout, 0.0)
        for _ in range(100):  # bounded: each pass waits for the commits seen in it
            tasks = self._pending if session_id is None else self._by_session.get(session_id, set())
            live = {t for t in tasks if not t.done()}
            left = deadline - time.monotonic()
            if not live or left <= 0:
                return len(live)
            await asyncio.wait(live, timeout=left)
        return len(self._pending)

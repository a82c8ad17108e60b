"""The state one proxy instance owns, and its drain at shutdown.

Held by the application (:class:`proxy._app.ProxyApp`); the handlers in
:mod:`proxy._app` and the routes in :mod:`proxy._admin` are given it.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import tempfile
import time
from collections.abc import Callable
from types import TracebackType
from typing import TYPE_CHECKING, Any, Final

from ._alloc import Allocator
from ._cancel import SHUTDOWN_CANCEL
from ._commits import CommitTracker
from ._config import Settings
from ._exchange import Exchange
from ._gc import IdleCollector
from ._logs import LogLimiter
from ._metrics import Metrics
from ._plugins import ExchangeRecord, Outcome, PluginHost
from ._relay import Upstream
from ._sessions import SessionRegistry, Tracking
from ._spool import Spool

if TYPE_CHECKING:
    from ._cluster import ClusterNode
    from ._tracing import Tracing

__all__ = ["AppState"]

log = logging.getLogger("context_proxy")


class AppState:
    """Everything one proxy instance owns (:attr:`proxy._app.ProxyApp.state`).

    Exchanges are listed in ``exchanges`` only while their handler runs (the
    handler removes them in ``finally``), so nothing here outlives a request.
    ``clock`` (monotonic seconds) is the session registry's, for tombstone TTLs
    and idle times; tests inject one to expire tombstones without sleeping.

    ``commits`` owns every pending commit (see :mod:`proxy._commits`): one
    commit's hooks may take ``plugin_timeout`` per plugin plus as much again,
    counted from the moment it holds the session lock (not while it queues for
    it); session close and the drain wait for that long at most.
    """

    __slots__ = (
        "allocator",
        "background_closes",
        "cluster",
        "collector",
        "commits",
        "draining",
        "exchanges",
        "handlers",
        "host",
        "memory_refusals",
        "metrics",
        "on_release",
        "reading_bytes",
        "registry",
        "settings",
        "snapshot_event",
        "spool",
        "stop",
        "tracing",
        "upstream",
    )

    def __init__(
        self,
        settings: Settings,
        host: PluginHost,
        *,
        clock: Callable[[], float] = time.monotonic,
        tracing: Tracing | None = None,
    ) -> None:
        self.settings: Final = settings
        #: OpenTelemetry spans (``tracing = "otel"``); ``None``: off, nothing imported.
        self.tracing: Final = tracing
        self.host: Final = host
        self.registry: Final = SessionRegistry(
            idle_cap=settings.idle_session_cap,
            tombstone_ttl=settings.tombstone_ttl,
            tombstone_cap=settings.tombstone_cap,
            clock=clock,
            on_close=host.run_session_closed,
            before_close=self._session_commits,
        )
        #: Cluster mode (``redis_url`` set): this node's part; ``None`` for one embedded node.
        self.cluster: ClusterNode | None = _cluster_node(settings, self.registry)
        self.upstream: Upstream | None = None
        self.exchanges: dict[str, Exchange] = {}
        self.handlers: set[asyncio.Task[object]] = set()
        self.draining = False
        #: Body bytes received so far by the reads in progress (a declared Content-Length
        #: is not charged: it reserves no memory), bytes; ``max_reading_bytes`` bounds it.
        self.reading_bytes = 0
        self.stop = asyncio.Event()
        #: The last ``snapshot`` event of ``/admin/events`` (event-loop time, encoded
        #: bytes), shared by the viewers that ask within half an interval (proxy/_live.py).
        self.snapshot_event: tuple[float, bytes] | None = None
        #: Cluster-mode session closes answered with 202 and still running (``?wait=false``),
        #: referenced until done (the loop keeps only weak references to tasks).
        self.background_closes: set[asyncio.Task[Any]] = set()
        #: Large bodies' anonymous files and their budget (proxy/_spool.py).
        self.spool: Final = Spool(
            settings.spool_dir or tempfile.gettempdir(),
            above_bytes=settings.spool_above_bytes,
            max_bytes=settings.max_spool_bytes,
            # A full disk fails every large body until space is freed: one line a minute.
            warner=LogLimiter(logging.getLogger("context_proxy.spool"), interval=60.0),
        )
        #: Hands released body memory back to the OS (glibc); see proxy/_alloc.py.
        self.allocator: Final = Allocator.for_process()
        #: Every exchange's ``on_release``: one bound method, not one made per exchange.
        self.on_release: Final = self.allocator.released
        # Every exchange in flight, a session's or not (the registry counts only the
        # former: 4,000 session-less streams looked quiet and paid a 300 ms collection).
        # The dict, not self: the state would hold itself through the hook.
        exchanges = self.exchanges
        #: Full garbage collections while quiet, when they visit few objects, and at least
        #: every 10 minutes once started (proxy/_gc.py).
        self.collector: Final = IdleCollector(lambda: len(exchanges))
        self.allocator.on_idle = self.collector
        self.metrics: Final = Metrics(self)  # it reads the state when registering
        #: Requests refused for want of memory (503): one WARNING, then a count per 10 s.
        self.memory_refusals: Final = LogLimiter(log)
        per_hook = settings.plugin_timeout if settings.plugin_timeout > 0 else math.inf
        self.commits: Final = CommitTracker(
            host.run_commit,
            timeout=per_hook * (len(host.plugins) + 1),
            registry=self.metrics.registry,
            hooked=bool(host.implementing("commit")),
            lock=self._commit_lock,
        )

    def _commit_lock(
        self, record: ExchangeRecord
    ) -> contextlib.AbstractAsyncContextManager[object]:
        """What the commit hooks for ``record`` run under: its session's lock
        (docs/design.md §6, rule 2).

        A session whose shutdown has already completed (its commit outlived the
        wait, see :meth:`_session_commits`) is not recreated for it: entering
        the lock raises :class:`~proxy._sessions.SessionClosed` and the commit
        counts as failed (the plugins were told the session closed). A request
        refused because its session is closed carries the session's id but is
        booked without the lock: it did nothing in the session, and the lock
        would refuse it or bring the closed session back.
        """
        sid = record.session_id
        refused = record.outcome == Outcome.REJECTED and record.error == "session_closed"
        if sid and not refused:
            return self.registry.locked(sid)
        return contextlib.nullcontext()

    async def _session_commits(self, sid: str) -> None:
        """Before a session is archived: wait for its pending commits (bounded)."""
        left = await self.commits.wait(sid, timeout=self.commits.timeout)
        if left:
            log.warning("session %s closed with %d commit(s) still running", sid, left)

    def admitted(self, sid: str | None, ex: Exchange, task: asyncio.Task[Any]) -> ExchangeAdmission:
        """Admission of one exchange, for ``async with`` around the whole exchange.

        In cluster mode, first the cluster's (tombstone check + in-flight entry
        in Redis, one round trip), then the registry's ``track``; leaving undoes
        both, also on cancellation. See :class:`ExchangeAdmission`.

        Raises:
            proxy._sessions.SessionClosed: on entry, the session is tombstoned
                (in Redis or locally).
        """
        return ExchangeAdmission(self, sid, ex, task)

    async def drain(self, grace: float) -> None:
        """Stop admitting, give in-flight handlers ``grace`` seconds, then cancel them.

        Cancelled streams end with an in-band protocol error event (the relay
        recognises :data:`SHUTDOWN_CANCEL`). Then the pending commits finish
        (each bounded, see :attr:`commits`), every session is closed and the
        plugins are flushed. Sets :attr:`stop` (when it was not yet).
        """
        self.draining = True
        # Whatever waits for the stop (the admin event streams) ends now, not at the grace's end.
        self.stop.set()
        pending = {t for t in self.handlers if not t.done()}
        if pending:
            log.info("draining %d in-flight request(s), grace %.1fs", len(pending), grace)
            _, late = await asyncio.wait(pending, timeout=grace)
            for task in late:
                task.cancel(SHUTDOWN_CANCEL)
            if late:
                log.warning(
                    "cancelled %d stream(s) still running after the grace period", len(late)
                )
                await asyncio.wait(late, timeout=5.0)
        left = await self.commits.wait(timeout=self.commits.timeout)
        if left:
            log.warning("shutting down with %d commit(s) still running", left)
        if self.cluster is not None:
            # Before close_all: no close from the stream may start while it runs.
            await self.cluster.stop()
        try:
            await self.registry.close_all()
        except ExceptionGroup as group:
            for exc in group.exceptions:
                log.error("closing a session failed at shutdown: %s", exc)
        await self.host.shutdown()
        self.allocator.close()
        self.collector.stop()


class ExchangeAdmission:
    """The ``async with`` of :meth:`AppState.admitted`: cluster entry, then local tracking.

    A slotted object rather than an ``asynccontextmanager``: it lives for the
    whole exchange, an idle open stream included, and a suspended async
    generator with its frame costs several times its size per stream.
    """

    __slots__ = ("_cluster", "_ex", "_sid", "_state", "_task", "_tracking")

    def __init__(
        self, state: AppState, sid: str | None, ex: Exchange, task: asyncio.Task[Any]
    ) -> None:
        self._state = state
        self._sid = sid
        self._ex = ex
        self._task = task
        self._cluster: contextlib.AbstractAsyncContextManager[object] | None = None
        self._tracking: Tracking | None = None

    async def __aenter__(self) -> None:
        state, ex = self._state, self._ex
        if state.cluster is not None:
            cluster = state.cluster.admitted(self._sid, ex.id, lambda: ex.outcome == "cancelled")
            await cluster.__aenter__()
            self._cluster = cluster
        if self._sid is None:
            # Tracking without a session does nothing (no entry is keyed by None): none made.
            return
        try:
            tracking = state.registry.track(self._sid, self._task)
            tracking.__enter__()
        except BaseException as exc:
            await self._leave_cluster(type(exc), exc, exc.__traceback__)
            raise
        self._tracking = tracking

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        tracking, self._tracking = self._tracking, None
        try:
            if tracking is not None:
                tracking.__exit__(exc_type, exc, tb)
        finally:
            if self._cluster is not None:  # no coroutine to run outside cluster mode
                await self._leave_cluster(exc_type, exc, tb)

    async def _leave_cluster(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        cluster, self._cluster = self._cluster, None
        if cluster is not None:
            await cluster.__aexit__(exc_type, exc, tb)


def _cluster_node(settings: Settings, registry: SessionRegistry) -> ClusterNode | None:
    """This process's :class:`~proxy._cluster.ClusterNode`, or ``None`` without ``redis_url``.

    The cluster package (and the Redis client) is imported only in cluster mode.
    """
    if settings.redis_url is None:
        return None
    from ._cluster import ClusterNode, RedisStore, default_node_id

    store = RedisStore(
        settings.redis_url,
        timeout=settings.redis_timeout,
        max_connections=settings.redis_max_connections,
    )
    return ClusterNode(
        store,
        registry,
        node_id=settings.node_id or default_node_id(settings.port),
        heartbeat_ttl=settings.cluster_heartbeat_ttl,
        tombstone_ttl=settings.tombstone_ttl,
    )

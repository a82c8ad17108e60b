"""One proxy node's part in cluster mode: admission, heartbeat, close stream, close.

The node runs two tasks next to the server: a *heartbeat* that pushes the
deadlines of this node's in-flight entries forward (so the entries of a node
that died expire instead of pinning a session) and probes Redis while it is
unreachable; and a *tailer* that follows the close stream with ``XREAD BLOCK``
from the last id it saw, so a node that was cut off catches up on the closes
it missed (pub/sub would have dropped them) and closes those sessions locally
through :meth:`proxy._sessions.SessionRegistry.start_shutdown`.

Redis down (the documented policy, docs/cluster.md): requests keep flowing
with the node's local view (tombstones it knows keep refusing, through the
local registry), ``/readyz`` stays 200, ``context_proxy_cluster_degraded`` is 1
and one warning is logged. No admission waits on Redis while degraded. When
the heartbeat reaches Redis again, the node *reconciles*: re-registers its
live entries, retries the deregistrations that failed, and replays the closes
it accepted during the outage (tombstone + stream command), so they take
effect on every node.

Lock rules (docs/design.md §6) hold: no session lock is taken here, and the
registry is only touched in synchronous stretches.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import dataclasses
import logging
import math
import secrets
from collections.abc import Callable, Coroutine
from types import TracebackType
from typing import Any, Final

from cachetools import LRUCache
from redis.exceptions import ResponseError

from .._sessions import SessionClosed, SessionRegistry, ShutdownResult, shutdown_cause
from .store import CloseCommand, ClusterUnavailable, RedisStore, read_closes

__all__ = ["Admission", "ClusterCloseResult", "ClusterNode"]

log = logging.getLogger("context_proxy.cluster")

#: Seconds one ``XREAD BLOCK`` of the close stream waits before it asks again.
TAIL_BLOCK: Final = 1.0
#: Seconds between two polls of a session's in-flight set by the closing node.
CLOSE_POLL: Final = 0.02
CLOSE_POLL_MAX: Final = 0.1
#: Failed deregistrations (and closes accepted while degraded) kept for the reconcile.
#: Beyond it the oldest are dropped: their entries stop being refreshed and expire.
MAX_PENDING: Final = 100_000
#: Session ids this node remembers having served (least recently admitted dropped
#: first). A close tells the node's plugins only about these and the ids its
#: registry still holds; a session that fell out of both gets no session_closed here.
SERVED_CAP: Final = 100_000


class _OutageMidClose(ClusterUnavailable):
    """Redis failed after a close started this node's shutdown of the session.

    ``local`` is that shutdown's future: the degraded answer awaits it.
    """

    def __init__(self, local: asyncio.Future[ShutdownResult]) -> None:
        super().__init__("Redis failed during a session close")
        self.local = local


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class ClusterCloseResult:
    """The answer of a cluster-wide close (``DELETE /admin/sessions/{id}``).

    Counts are cluster-wide: ``finished`` exchanges ended within the timeout,
    ``cancelled`` ones were cancelled after it, ``expired`` ones belonged to a
    node that stopped heartbeating. ``remaining``: entries still in the set when
    the wait ended (0 unless a node outlived timeout + heartbeat TTL without
    letting go). ``already_closed``: the session's close had answered before.
    ``degraded``: Redis was unreachable; the counts are this node's only and
    the close is replayed to the cluster after the reconcile.
    """

    sid: str
    finished: int
    cancelled: int
    expired: int = 0
    remaining: int = 0
    already_closed: bool = False
    degraded: bool = False


class Admission:
    """``async with node.admitted(sid, exchange_id):`` one exchange's in-flight entry.

    Entering runs the admission script (tombstone check + registration in one
    round trip) and raises :class:`~proxy._sessions.SessionClosed` for a
    tombstoned session. Leaving always deregisters, also when the handler is
    cancelled: the Redis call runs in a task of the node's own, which nothing
    the client does can cancel. With ``sid=None`` it does nothing.
    """

    __slots__ = ("_cancelled", "_member", "_node", "sid")

    def __init__(
        self,
        node: ClusterNode,
        sid: str | None,
        exchange_id: str,
        cancelled: Callable[[], bool] | None = None,
    ) -> None:
        self._node = node
        self.sid: Final = sid
        self._member: Final = f"{node.origin}|{exchange_id}"
        self._cancelled = cancelled

    async def __aenter__(self) -> Admission:
        sid = self.sid
        if sid is None:
            return self
        node = self._node
        # Listed before the round trip: the heartbeat refreshes it and a reconcile
        # re-adds it, whether or not this call reaches Redis.
        node._entries.setdefault(sid, set()).add(self._member)
        if node.degraded:
            node._served[sid] = None
            return self
        try:
            left = await node.store.admit(sid, self._member, node.heartbeat_ttl)
        except ClusterUnavailable as exc:
            node._set_degraded(exc)
            node._served[sid] = None
            return self
        except BaseException:
            # Cancelled mid round trip: the entry may exist in Redis; take it out.
            node._release(sid, self._member, cancelled=False)
            raise
        if left is not None:
            node._forget(sid, self._member)
            raise SessionClosed(sid, left if left >= 0 else node.tombstone_ttl)
        node._served[sid] = None
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        if self.sid is not None:
            # The relay turns a shutdown's cancellation into an in-band error and
            # returns normally, so the exception alone does not say; the caller's
            # probe (the exchange's outcome) does.
            cancelled = (exc is not None and shutdown_cause(exc) is not None) or (
                self._cancelled is not None and self._cancelled()
            )
            self._node._release(self.sid, self._member, cancelled=cancelled)


class ClusterNode:
    """This process as one node of a cluster (docs/design.md §9).

    Args:
        store: the Redis side.
        registry: this node's session registry; closes from the stream run
            its ``start_shutdown``.
        node_id: this node's name (``hostname:port`` by default); entries are
            ``node_id|boot|exchange`` where ``boot`` is random per process, so a
            restarted node never mistakes a dead predecessor's entries for its own.
        heartbeat_ttl: seconds an entry lives without a heartbeat; the
            heartbeat runs every third of it.
        tombstone_ttl: seconds a tombstone outlives its close (as locally).
        served_cap: most session ids remembered as served by this node (>= 1);
            a close runs the plugins' ``session_closed`` only for a session this
            node served (remembered here or still in its registry).

    Raises:
        ValueError: a non-positive or non-finite ``heartbeat_ttl``, or a
            ``served_cap`` below 1.
    """

    __slots__ = (
        "_entries",
        "_heartbeat",
        "_pending_closes",
        "_pending_deregs",
        "_served",
        "_started",
        "_stopping",
        "_tailer",
        "_tasks",
        "_tip",
        "degraded",
        "degraded_since",
        "heartbeat_ttl",
        "node_id",
        "origin",
        "reconciles",
        "registry",
        "store",
        "tombstone_ttl",
    )

    def __init__(
        self,
        store: RedisStore,
        registry: SessionRegistry,
        *,
        node_id: str,
        heartbeat_ttl: float,
        tombstone_ttl: float,
        served_cap: int = SERVED_CAP,
    ) -> None:
        if not (heartbeat_ttl > 0 and math.isfinite(heartbeat_ttl)):
            raise ValueError(f"heartbeat_ttl must be a finite number > 0, got {heartbeat_ttl!r}")
        if served_cap < 1:
            raise ValueError(f"served_cap must be >= 1, got {served_cap!r}")
        self.store: Final = store
        self.registry: Final = registry
        self.node_id: Final = node_id
        self.origin: Final = f"{node_id}|{secrets.token_hex(4)}"
        self.heartbeat_ttl: Final = float(heartbeat_ttl)
        self.tombstone_ttl: Final = float(tombstone_ttl)
        self.degraded = False
        """True while Redis is unreachable (see the module docstring)."""
        self.degraded_since: float | None = None
        self.reconciles = 0
        """Completed reconciles after an outage (a counter for metrics and tests)."""
        # sid -> members this node holds in flight (what the heartbeat refreshes).
        self._entries: dict[str, set[str]] = {}
        # Sessions this node admitted an exchange for (values unused), bounded.
        self._served: LRUCache[str, None] = LRUCache(served_cap)
        self._pending_deregs: collections.deque[tuple[str, str, bool]] = collections.deque(
            maxlen=MAX_PENDING
        )
        self._pending_closes: collections.OrderedDict[str, float] = collections.OrderedDict()
        self._tasks: set[asyncio.Task[Any]] = set()
        self._heartbeat: asyncio.Task[None] | None = None
        self._tailer: asyncio.Task[None] | None = None
        self._tip: str | None = None
        self._started = 0.0  # loop time of start(), for a tip taken only at the reconcile
        # Set by stop(): the loops end at their next turn even if a cancellation was lost
        # (a client library that turns a cancel racing its own timeout into a timeout).
        self._stopping = False

    # ----------------------------------------------------------------- lifecycle

    async def start(self) -> None:
        """Find the close stream's tip and start the heartbeat and the tailer.

        Redis unreachable at start: the node starts degraded (logged) and
        catches up once the heartbeat reaches it, closes announced since this
        call included. Never raises for an outage.
        """
        loop = asyncio.get_running_loop()
        self._started = loop.time()
        try:
            self._tip = await self.store.stream_tip()
        except ClusterUnavailable as exc:
            self._set_degraded(exc)
        self._heartbeat = loop.create_task(self._heartbeat_loop(), name="cluster-heartbeat")
        self._tailer = loop.create_task(self._tail_loop(), name="cluster-close-tailer")

    async def stop(self, within: float = 5.0) -> None:
        """Leave the cluster: finish deregistrations, remove what is left, close the pool.

        Called at process shutdown after the streams have drained (``within``
        seconds bound the wait for the background tasks, and again the Redis work;
        past it, entries expire by their TTL). Never hangs: a task that outlives the
        bound is logged and left to end at its next turn.
        """
        self._stopping = True
        tasks = {task for task in (self._heartbeat, self._tailer) if task is not None}
        for task in tasks:
            task.cancel()
        if tasks:
            done, pending = await asyncio.wait(tasks, timeout=within)
            if pending:
                log.warning(
                    "cluster: %d background task(s) did not stop in %.1fs", len(pending), within
                )
            for task in done:
                if not task.cancelled():
                    task.result()  # a defect in a loop surfaces here, as it did when awaited
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(within):
                if self._tasks:
                    await asyncio.wait(set(self._tasks))
                if not self.degraded:
                    await self._flush_pending()
                    for sid, members in list(self._entries.items()):
                        for member in list(members):
                            await self.store.deregister(sid, member, cancelled=False)
        self._entries.clear()
        await self.store.close()

    # ----------------------------------------------------------------- admission

    def admitted(
        self, sid: str | None, exchange_id: str, cancelled: Callable[[], bool] | None = None
    ) -> Admission:
        """The in-flight entry of one exchange, for ``async with``; see :class:`Admission`.

        ``cancelled``, asked on exit: whether the exchange ended cancelled (for
        the close's tally), in addition to a ``SessionShutdown`` cancellation
        seen as the exiting exception.
        """
        return Admission(self, sid, exchange_id, cancelled)

    def in_flight_entries(self) -> int:
        """Entries this node holds in flight (all sessions)."""
        return sum(len(members) for members in self._entries.values())

    def _forget(self, sid: str, member: str) -> None:
        members = self._entries.get(sid)
        if members is not None:
            members.discard(member)
            if not members:
                del self._entries[sid]

    def _release(self, sid: str, member: str, *, cancelled: bool) -> None:
        """Deregister in a task of the node's own (cancellation-safe)."""
        self._forget(sid, member)
        if self.degraded:
            self._pending_deregs.append((sid, member, cancelled))
            return
        self._spawn(self._deregister(sid, member, cancelled))

    async def _deregister(self, sid: str, member: str, cancelled: bool) -> None:
        try:
            await self.store.deregister(sid, member, cancelled=cancelled)
        except ClusterUnavailable as exc:
            self._pending_deregs.append((sid, member, cancelled))
            self._set_degraded(exc)
        except ResponseError as exc:
            # A wrong-type key (a defect, not an outage): retrying cannot help, and a
            # task of ours must not end with an exception nobody retrieves. The entry
            # expires with its heartbeat TTL.
            log.error("cluster: Redis refused a deregistration: %s", type(exc).__name__)

    def _spawn(self, coro: Coroutine[Any, Any, None]) -> None:
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    # ----------------------------------------------------------------- close

    async def close_session(self, sid: str, grace: float) -> ClusterCloseResult:
        """Close ``sid`` on every node (``DELETE /admin/sessions/{id}``); idempotent.

        1. Tombstone in Redis (every node's admission refuses from now on).
        2. ``XADD`` the close command; every node's tailer starts its local
           ``shutdown_session(sid, grace)``: in-flight exchanges get
           ``grace`` seconds, then are cancelled (upstream aborted, in-band
           error event); the plugins of each node that served ``sid`` get
           ``session_closed`` (see :meth:`served`).
        3. The same locally, then wait until the session's in-flight set is
           empty or ``grace`` + the heartbeat TTL has passed (a dead node's
           entries expire by then), and answer with the cluster-wide tally.

        Concurrent calls on several nodes share one close: one sets the
        tombstone, the others wait for the same set and return the same
        tally. A call after the close answered (tombstone alive) returns
        ``already_closed``. Redis unreachable: the close runs locally now and
        is replayed to the cluster after the reconcile (``degraded=True``).

        Raises:
            proxy._sessions.SessionCloseError: a local plugin's ``session_closed``
                failed (as for a single node).
        """
        started: asyncio.Future[ShutdownResult] | None = None
        if not self.degraded:
            try:
                return await self._close_cluster(sid, grace)
            except _OutageMidClose as exc:
                self._set_degraded(exc.__cause__ or exc)
                started = exc.local
            except ClusterUnavailable as exc:
                self._set_degraded(exc)
        self._pending_closes[sid] = grace
        while len(self._pending_closes) > MAX_PENDING:
            self._pending_closes.popitem(last=False)
        # Redis died after this close started the local shutdown: its result is
        # this close's (asking again would find the tombstone it set and answer
        # already_closed, as if an earlier close had answered).
        if started is None:
            started = self._close_locally(sid, grace)
        local = await asyncio.shield(started)
        return ClusterCloseResult(
            sid=sid,
            finished=local.finished,
            cancelled=local.cancelled,
            already_closed=local.already_closed,
            degraded=True,
        )

    async def _close_cluster(self, sid: str, grace: float) -> ClusterCloseResult:
        store = self.store
        start = await store.begin_close(
            sid, f"{self.origin}|{secrets.token_hex(4)}", self.tombstone_ttl + grace
        )
        if start.new:
            await store.announce_close(sid, grace, self.origin)
        local = self._close_locally(sid, grace)
        if not start.new and start.done:
            await asyncio.shield(local)
            return ClusterCloseResult(sid=sid, finished=0, cancelled=0, already_closed=True)
        try:
            return await self._await_close(sid, grace, local, new=start.new)
        except ClusterUnavailable as exc:
            raise _OutageMidClose(local) from exc

    async def _await_close(
        self, sid: str, grace: float, local: asyncio.Future[ShutdownResult], *, new: bool
    ) -> ClusterCloseResult:
        """Wait for the cluster's in-flight set of ``sid`` to empty; the tally (see close).

        Raises:
            ClusterUnavailable: Redis failed while waiting.
        """
        store = self.store
        loop = asyncio.get_running_loop()
        deadline = loop.time() + grace + self.heartbeat_ttl + 1.0
        pause = CLOSE_POLL
        remaining = await store.prune(sid)
        while remaining and loop.time() < deadline:  # bounded by the deadline
            await asyncio.sleep(pause)
            pause = min(pause * 2, CLOSE_POLL_MAX)
            remaining = await store.prune(sid)
        # This node's own exchanges are in the tally already (they deregister like
        # every node's); waiting here means its plugins have had session_closed.
        await asyncio.shield(local)
        tally = await store.finish_close(sid) if new else await store.tally(sid)
        return ClusterCloseResult(
            sid=sid,
            finished=tally.finished,
            cancelled=tally.cancelled,
            expired=tally.expired,
            remaining=remaining,
        )

    async def tombstone_left(self, sid: str) -> float | None:
        """Seconds the shared tombstone of ``sid`` still lives (``-1.0``: no expiry).

        ``None`` if Redis has none, or cannot be reached (the caller then has
        only its local view, :meth:`SessionRegistry.tombstone_remaining`).
        """
        try:
            return await self.store.tombstone_left(sid)
        except ClusterUnavailable:
            return None

    def _apply(self, command: CloseCommand) -> None:
        if not command.sid or command.origin == self.origin:
            return  # this node started that close itself
        log.debug("cluster: close of a session from node %s", command.origin.split("|")[0])
        self._close_locally(command.sid, command.timeout)

    def served(self, sid: str) -> bool:
        """Whether this node served ``sid`` (admitted an exchange for it) as far as it
        remembers: the last ``served_cap`` sessions admitted, or an entry in its registry.
        """
        return sid in self._served or self.registry.info(sid) is not None

    def _close_locally(self, sid: str, grace: float) -> asyncio.Future[ShutdownResult]:
        """This node's part of a close: the local tombstone always (it keeps refusing
        while Redis is down), ``session_closed`` for the plugins only if it served ``sid``.
        """
        served = self.served(sid)
        self._served.pop(sid, None)  # tombstoned now; admitted again only after its TTL
        return self.registry.start_shutdown(sid, grace, notify_unknown=served)

    # ----------------------------------------------------------------- background

    async def _heartbeat_loop(self) -> None:
        interval = self.heartbeat_ttl / 3
        while not self._stopping:  # until cancelled by stop(), or its flag
            await asyncio.sleep(min(interval, 1.0) if self.degraded else interval)
            try:
                if self.degraded:
                    await self.store.ping()
                    await self._reconcile()
                else:
                    await self.store.refresh(dict(self._entries), self.heartbeat_ttl)
            except ClusterUnavailable as exc:
                self._set_degraded(exc)

    async def _reconcile(self) -> None:
        """After an outage: re-add live entries, retry deregistrations, replay closes."""
        store = self.store
        await store.reset()
        await store.refresh(dict(self._entries), self.heartbeat_ttl, readd=True)
        await self._flush_pending()
        if self._tip is None:
            # Started during the outage: the tail starts where the stream stood when this
            # node started, not now, or the closes announced meanwhile (for sessions it
            # may have admitted with its local view) would never reach it. Measured on
            # Redis's clock (stream ids are its milliseconds): no clock skew between hosts.
            since = asyncio.get_running_loop().time() - self._started + store.timeout
            self._tip = await store.tip_since(since)
        was = self.degraded_since
        self.degraded = False
        self.degraded_since = None
        self.reconciles += 1
        loop = asyncio.get_running_loop()
        down = loop.time() - was if was is not None else 0.0
        log.warning("cluster: Redis reachable again after %.1fs; state reconciled", down)

    async def _flush_pending(self) -> None:
        store = self.store
        while self._pending_deregs:  # bounded by MAX_PENDING
            sid, member, cancelled = self._pending_deregs[0]
            await store.deregister(sid, member, cancelled=cancelled)
            self._pending_deregs.popleft()
        while self._pending_closes:  # bounded by MAX_PENDING
            sid, timeout = next(iter(self._pending_closes.items()))
            await store.begin_close(
                sid, f"{self.origin}|{secrets.token_hex(4)}", self.tombstone_ttl + timeout
            )
            # Announced even when the tombstone was there already: the outage may have
            # struck between this node's tombstone and its XADD. A repeated command is
            # harmless (every node's shutdown_session is idempotent).
            await store.announce_close(sid, timeout, self.origin)
            self._pending_closes.pop(sid, None)

    async def _tail_loop(self) -> None:
        client = self.store.tail_client(TAIL_BLOCK)
        try:
            while not self._stopping:  # until cancelled by stop(), or its flag
                if self._tip is None or self.degraded:
                    await asyncio.sleep(min(self.heartbeat_ttl / 3, 1.0))
                    continue
                try:
                    commands = await read_closes(client, self._tip, TAIL_BLOCK)
                except ClusterUnavailable as exc:
                    self._set_degraded(exc)
                    continue
                for command in commands:
                    self._tip = command.entry_id
                    self._apply(command)
        finally:
            await client.aclose()

    def _set_degraded(self, cause: BaseException) -> None:
        if self.degraded:
            return
        self.degraded = True
        self.degraded_since = asyncio.get_running_loop().time()
        log.warning(
            "cluster: Redis unreachable (%s); degraded: serving with this node's local view",
            cause,
        )

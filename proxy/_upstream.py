"""The upstream HTTP/1.1 client: pooled keep-alive connections, one exchange at a time on each.

Why our own and not aiohttp's ``ClientSession``: the proxy sends one request
shape (a method, a target, header fields it already filtered, a body it
already holds as slices) and relays one answer shape (a status, header fields,
body bytes as they come). aiohttp's client does much more per request (URL
objects, cookie and redirect handling, trace hooks, a task per upload, a
timer per socket read) and keeps several KiB per open stream (its response,
parser, stream reader and queues; see ``bench overhead``).

This module is the driver only: the transport, one timer per connection, its
:class:`~proxy._upload.FlowControl`, and the awaits. What the bytes mean, when an
answer ends, whether a connection may be reused and when it must be woken is
decided by :class:`proxy._http1.ClientConnection` (sans-I/O); which connection a
request gets, who waits and what to close, by :class:`proxy._pool.PoolPolicy`
(sans-I/O); how a connection is opened, by :class:`proxy._connect.Connector`.
Errors are :mod:`proxy._upstream_errors`' (our words, never the upstream's bytes).
"""

from __future__ import annotations

import asyncio
import contextvars
import ssl
import typing
from collections.abc import AsyncIterable, Callable, Mapping
from typing import Any, Final

from ._connect import Connector, RouteKey, UpstreamTarget, status_words
from ._gc import drop_transport_cycle
from ._http1 import (
    NEED_DATA,
    ClientConnection,
    ClientState,
    EndOfMessage,
    Expiry,
    Fault,
    Request,
    ResponseHead,
)
from ._pool import OPEN, WAIT, Close, Fail, Park, PoolPolicy, Reuse, Wake
from ._upload import FlowControl, Piece, upload
from ._upstream_answer import UpstreamAnswer
from ._upstream_errors import (
    AnswerCut,
    BadResponseHead,
    ConnectFailed,
    ConnectTimeout,
    HeadTimeout,
    IdleReadTimeout,
    PoolBusy,
    PoolClosed,
    ServerDisconnected,
    TunnelFailed,
    UpstreamError,
)

__all__ = [
    "AnswerCut",
    "BadResponseHead",
    "ConnectFailed",
    "ConnectTimeout",
    "HeadTimeout",
    "IdleReadTimeout",
    "PoolBusy",
    "PoolClosed",
    "ServerDisconnected",
    "TunnelFailed",
    "UpstreamAnswer",
    "UpstreamError",
    "UpstreamPool",
    "UpstreamTarget",
]


#: Body bytes buffered from an upstream before its socket is paused: the relay reads
#: them as it writes to the client, so a slow client slows the upstream read.
READ_HIGH_WATER_BYTES: Final = 64 * 1024
#: Seconds after a request's first byte within which a kept connection's close (or
#: 408) counts as the upstream's idle close crossing it: it arrives within a round
#: trip. Later, the upstream may have acted on the request: it is not sent again.
RESEND_WINDOW_S: Final = 0.5

_CLOSING: Final = "proxy is shutting down"
_LATE: Final = "upstream sent no response headers in time"
_UNREAD: Final = "upstream answered but did not read the request body in time"
_ERROR: Final = ClientState.ERROR  # (a global: read per received piece)
_SEEN: Final = ResponseHead(0, [], False)  # the final head came and was handed on
_TIMER_CONTEXT: Final = contextvars.Context()  # shared and empty: holds no task's variables


class _Connection(asyncio.Protocol):
    """One upstream connection: transport, one timer and a :class:`FlowControl` around a
    :class:`~proxy._http1.ClientConnection`."""

    __slots__ = (
        "__weakref__",  # tests prove a closed connection is freed
        "_final",
        "_head",
        "_loop",
        "_reader",
        "_sent_at",
        "_timer",
        "_timer_at",
        "cut",
        "ended",
        "flow",
        "in_use",
        "key",
        "lost",
        "machine",
        "pool",
        "reused",
        "transport",
    )

    def __init__(self, pool: UpstreamPool, key: RouteKey) -> None:
        self.pool = pool
        self.key = key
        self.transport: asyncio.Transport | None = None
        self.flow: FlowControl | None = None
        self.machine = ClientConnection(idle_read_s=pool.idle_read)
        self._loop = asyncio.get_running_loop()  # made in a request's task (_acquire)
        self.in_use = True
        self.lost = False
        #: Whether it carried an earlier request (an upstream may close such one any time).
        self.reused = False
        #: The answer's final head, once parsed (interim ones are dropped).
        self._final: ResponseHead | None = None
        self.ended = False  # the body's end was read; cut: why the answer is unusable
        self.cut: Fault | None = None
        self._head: asyncio.Future[None] | None = None
        self._reader: asyncio.Future[None] | None = None
        self._timer: asyncio.TimerHandle | None = None
        self._timer_at = 0.0
        self._sent_at = 0.0

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # A stream transport (uvloop's is not an asyncio.Transport subclass, but has
        # the same methods): no isinstance check.
        self.transport = typing.cast(asyncio.Transport, transport)
        self.flow = FlowControl(self.transport)

    def data_received(self, data: bytes) -> None:
        if not self.in_use:
            # An idle connection must stay silent: whatever came, it is not reusable.
            self.abort()
            return
        machine = self.machine
        machine.receive_data(data)
        if self._final is None:
            self._take_head()
        if machine.their_state is _ERROR:
            self._wake_all()
            if self.transport is not None:
                self.transport.close()
            return
        if machine.has_events:
            _wake(self._reader)
            if machine.buffered_bytes > READ_HIGH_WATER_BYTES and self.flow is not None:
                self.flow.pause_reading()

    def eof_received(self) -> bool | None:
        self._closed()
        return None  # close the transport

    def connection_lost(self, exc: Exception | None) -> None:
        self.lost = True
        self._closed()
        drop_transport_cycle(self.transport)
        self._stop_timer()
        if not self.in_use:
            self.pool._gone(self, in_use=False)

    def pause_writing(self) -> None:
        if self.flow is not None:
            self.flow.pause_writing()

    def resume_writing(self) -> None:
        if self.flow is not None:
            self.flow.resume_writing()

    def _closed(self) -> None:
        """The peer closed: the machine ends or cuts the answer."""
        self.machine.receive_data(b"")
        if self._final is None:
            self._take_head()
        self._wake_all()

    def _take_head(self) -> None:
        """Take the events up to the final head (interim heads dropped, a fault kept)."""
        machine = self.machine
        while self._final is None and self.cut is None:
            event = machine.next_event()
            if isinstance(event, ResponseHead):
                if event.interim:
                    continue  # 100 Continue, 103 Early Hints: the final one follows
                self._final = event
                _wake(self._head)
                if self.flow is not None:
                    self.flow.interrupt()  # an answer during the upload may end it
            elif isinstance(event, Fault):
                self.cut = event
            else:
                return  # NEED_DATA (a head comes before anything else)

    def _wake_all(self) -> None:
        _wake(self._head)
        _wake(self._reader)
        if self.flow is not None:
            self.flow.interrupt()

    async def send(
        self,
        head: Request,
        body: AsyncIterable[Piece] | None,
        body_bytes: int,
        head_due: float | None = None,
    ) -> UpstreamAnswer:
        """Write the request, wait for the answer's head; the answer to read
        (``head_due``: the loop time by which the final head must be here; the
        connection's one timer watches it, armed lazily, so no timer per request).

        Raises:
            HeadTimeout: no final head by ``head_due`` (the upload stops too).
            ServerDisconnected: the connection closed before a complete head.
            BadResponseHead: the head could not be parsed or is over a limit.
        """
        transport = self.transport
        assert transport is not None
        loop = self._loop
        self._sent_at = loop.time()
        machine = self.machine
        data = machine.send_head(head, body_bytes if body is not None else 0, head_due=head_due)
        if head_due is not None:
            self._arm(loop)
        if body is None:
            transport.write(data)
        else:
            # Bound whole, even after a 2xx head (an upstream that answers, then stops
            # reading the body, would hold it forever).
            await upload(transport, self.flow, machine, data, body, body_bytes, self._upload_over)
        while self._final is None or machine.late:
            if machine.late:  # the deadline passed in the upload or the wait for the head
                raise HeadTimeout(_UNREAD if machine.status else _LATE)  # a 2xx head came
            cut = self.cut
            if cut is not None:
                if cut.closed:
                    raise ServerDisconnected(cut.words)
                raise BadResponseHead(cut.words)
            if self.lost:
                raise ServerDisconnected("upstream closed the connection before answering")
            self._head = loop.create_future()
            try:
                await self._head
            finally:
                self._head = None
        final = self._final
        answer = UpstreamAnswer(self, final.status, final.fields, loop.time() - self._sent_at)
        self._final = _SEEN  # not kept per stream: the answer has the fields' only copy
        return answer

    def raced(self) -> bool:
        """Whether what ended this request (a close, a 408) came within
        :data:`RESEND_WINDOW_S` of its first byte: the upstream's idle close crossing
        the request on the wire, not an upstream that worked on it and then failed."""
        return self._loop.time() - self._sent_at <= RESEND_WINDOW_S

    def _upload_over(self, transport: asyncio.Transport) -> bool:
        """Whether the rest of the body must not be sent (:func:`proxy._upload.upload`)."""
        return (
            self.lost
            or transport.is_closing()
            or self.cut is not None
            or self.machine.their_state is _ERROR
            or self.machine.status >= 300
        )

    async def read_body(self) -> bytes:
        machine = self.machine
        while True:
            if self.ended:
                # Ended; bytes after the end (a fault) only make the connection unusable.
                return b""
            event = machine.next_event()
            if isinstance(event, bytes):
                flow = self.flow
                if flow is not None and flow.read_paused and not self.lost:
                    flow.resume_reading()
                return event
            if isinstance(event, EndOfMessage):
                self.ended = True
                return b""
            if isinstance(event, Fault):
                self.cut = event
            if self.cut is not None:
                raise AnswerCut(self.cut.words)
            assert event is NEED_DATA
            loop = self._loop
            waiter = self._reader = loop.create_future()
            machine.reader_waits(loop.time())
            self._arm(loop)
            try:
                await waiter
            finally:
                self._reader = None

    def _arm(self, loop: asyncio.AbstractEventLoop) -> None:
        """Have the one timer fire by the machine's next deadline. Re-armed lazily: a
        timer due earlier is left to fire and re-arm (a stream reads once per event,
        and a timer made and cancelled per read costs more than the check)."""
        deadline = self.machine.next_deadline()
        if deadline is None:
            return
        if self._timer is not None:
            if self._timer_at <= deadline:
                return
            self._timer.cancel()
        self._timer_at = deadline
        self._timer = loop.call_at(deadline, self._on_timer, loop, context=_TIMER_CONTEXT)

    def _on_timer(self, loop: asyncio.AbstractEventLoop) -> None:
        self._timer = None
        expiry = self.machine.expired(loop.time())
        if expiry is Expiry.IDLE:
            if not self.in_use:
                self.abort()
            return  # else: taken from the pool; its next park arms the timer again
        if expiry is Expiry.HEAD:
            self._take_head()  # the fault: the upload stops, send() raises
            self._wake_all()
            return
        if expiry is Expiry.READ:
            waiter = self._reader
            if waiter is not None and not waiter.done():
                waiter.set_exception(
                    IdleReadTimeout("upstream sent nothing for too long mid-answer")
                )
            return
        self._arm(loop)

    def _stop_timer(self) -> None:
        # It holds this connection for up to idle_read (or keep-alive) seconds.
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def finish(self) -> None:
        """The relay is done with the answer: pool the connection if it can be reused."""
        self.pool._checkin(self, reusable=self.machine.reusable and not self.lost)

    def abort(self) -> None:
        """Close the connection now (unread bytes are dropped); idempotent."""
        was_in_use = self.in_use
        self.in_use = False
        self._stop_timer()
        self.machine.close()  # its parser and it form a cycle; nothing is read any more
        if self.transport is not None and not self.lost:
            self.transport.abort()
        self.pool._gone(self, in_use=was_in_use)

    def reuse(self) -> None:
        """Taken from the pool for the next request."""
        self.in_use = True  # the timer, if it fires meanwhile, lets it be
        self.reused = True
        self._final = None
        self.ended = False
        self.cut = None

    def park(self) -> None:
        """Put in the pool: closed if no request takes it within the keep-alive time."""
        self.in_use = False
        loop = self._loop
        self.machine.start_next(loop.time())
        self._arm(loop)


def _wake(waiter: asyncio.Future[None] | None) -> None:
    if waiter is not None and not waiter.done():
        waiter.set_result(None)


def _usable(conn: _Connection) -> bool:
    """Whether an idle connection may still carry a request (the upstream may have closed it)."""
    return not conn.lost and conn.transport is not None and not conn.transport.is_closing()


class UpstreamPool:
    """Keep-alive connections to the upstreams, and the requests made on them.

    ``max_connections`` bounds the connections in use at once (0: no bound; a
    request beyond it waits for one to come free). ``connect_timeout`` bounds a
    TCP/TLS connect (through a forward proxy: the connect to it, the ``CONNECT``
    and the handshake) and ``idle_read`` the silence between two body reads
    (seconds). There is no total timeout: it would cut a long stream. The wait
    for the head is the caller's to bound. A connection idle in the pool is
    closed after :data:`proxy._http1.CLIENT_KEEPALIVE_TIMEOUT`. ``tls_context`` verifies
    https upstreams (default: the system's trust store, made on first use).
    """

    __slots__ = ("_policy", "connector", "idle_read", "max_connections")

    def __init__(
        self,
        *,
        connect_timeout: float,
        idle_read: float,
        max_connections: int,
        tls_context: ssl.SSLContext | None = None,
    ) -> None:
        self.connector = Connector(connect_timeout, tls_context)
        self.idle_read = idle_read
        self.max_connections = max_connections
        self._policy: PoolPolicy[RouteKey, _Connection, asyncio.Future[None]] = PoolPolicy(
            max_connections, lambda waiter: not waiter.done()
        )

    @property
    def idle_connections(self) -> int:
        """Connections waiting in the pool for a request."""
        return self._policy.idle

    @property
    def connections_in_use(self) -> int:
        """Connections carrying a request or an answer now."""
        return self._policy.in_use

    async def request(
        self,
        target: UpstreamTarget,
        method: str,
        path: str,
        fields: Mapping[str, str],
        body: Callable[[], AsyncIterable[Piece]] | None = None,
        body_bytes: int = 0,
        *,
        head_timeout: float | None = None,
    ) -> UpstreamAnswer:
        """Send one request, return the answer once its head is here.

        ``path`` is the request target (path and query); ``fields`` are sent as
        given, with ``Host``, ``Accept-Encoding`` (what the proxy decodes) and,
        when absent, ``Accept`` and ``User-Agent`` added; ``body()`` gives the
        body's slices, a fresh pass each call (``body_bytes`` bytes; its
        ``Content-Length`` is the caller's field). ``head_timeout`` bounds it
        all, from the wait for a free connection to the answer's head (seconds;
        ``None``: no bound).

        A kept connection the upstream closed before a byte of answer came (its
        keep-alive timer crossed this request on the wire: uvicorn's is 5 s), or
        on which the answer is a ``408`` (what Node, nginx and Apache send on a
        connection they time out as idle), within :data:`RESEND_WINDOW_S` of the
        request's first byte, is replaced by a new one and the request sent once
        more: a close that crossed the request arrives within a round trip, so
        the upstream did not act on it. A later close (an upstream that worked on
        the request, then died) is the error it is, as is any failure on a new
        connection (Go's client resends a POST only if nothing was written; this
        window is the proxy's compromise between that and a 502 for every race).

        Raises:
            PoolBusy: no connection came free (``max_connections``) in ``head_timeout``.
            HeadTimeout: the answer's head did not come in ``head_timeout``.
            ConnectFailed: the connect failed (refused, name not resolved, other).
            ConnectTimeout: the connect took over ``connect_timeout``.
            ServerDisconnected: the upstream closed before a complete head.
            BadResponseHead: the head could not be parsed or is over a limit.
            ValueError: a field name or value holds a line break.
            PoolClosed: the pool is closed (the proxy shuts down).
            TunnelFailed: an http upstream through a forward proxy, and the proxy
                answered 407 (its credentials are missing or wrong).
        """
        head = target.request_head(method, path, fields)
        due = None if head_timeout is None else asyncio.get_running_loop().time() + head_timeout
        answer = await self._exchange(target, head, body, body_bytes, due)
        if target.origin and answer.status == 407:
            # An http upstream through a forward proxy: 407 can only be the proxy's own
            # answer (RFC 9110 section 15.5.8), never the upstream's, so the client
            # gets the tunnel refusal's 502, not the proxy's HTML page as its API's error.
            answer.close()
            assert target.via is not None
            raise TunnelFailed(
                target.via,
                target.authority,
                407,
                f"refused to forward to {target.authority}: {status_words(407)}",
            )
        return answer

    async def _exchange(
        self,
        target: UpstreamTarget,
        head: Request,
        body: Callable[[], AsyncIterable[Piece]] | None,
        body_bytes: int,
        due: float | None,
    ) -> UpstreamAnswer:
        """:meth:`request`'s attempts: a kept connection, then maybe a new one (``due``:
        the loop time the head must come by; a kept connection at hand needs no timer)."""
        conn = self._kept(target) or await self._acquire_by(target, due)
        try:
            answer = await conn.send(head, body() if body is not None else None, body_bytes, due)
        except ServerDisconnected:
            conn.abort()
            if not (conn.reused and conn.machine.received_nothing and conn.raced()):
                raise
        except BaseException:
            conn.abort()
            raise
        else:
            if not (conn.reused and answer.status == 408 and conn.raced()):
                return answer
            answer.close()  # not the answer: the same deadline holds (at once if it passed)
        conn = await self._acquire_by(target, due, fresh=True)
        try:
            return await conn.send(head, body() if body is not None else None, body_bytes, due)
        except BaseException:
            conn.abort()
            raise

    def _kept(self, target: UpstreamTarget) -> _Connection | None:
        """An idle kept connection taken at once (no wait, no connect), or ``None``.

        Raises:
            PoolClosed: the pool is closed.
        """
        if self._policy.closed:
            raise PoolClosed(_CLOSING)
        grant = self._policy.checkout(target.key, usable=_usable)
        if not isinstance(grant, Reuse):
            return None  # (WAIT and OPEN hold nothing: _acquire asks again)
        conn: _Connection = grant.conn
        conn.reuse()
        return conn

    async def _acquire_by(
        self, target: UpstreamTarget, due: float | None, *, fresh: bool = False
    ) -> _Connection:
        """:meth:`_acquire` by ``due`` (loop time; ``None``: no bound).

        Raises:
            PoolBusy: no connection came free by ``due``.
            HeadTimeout: the connect went on past ``due``.
            And :meth:`_acquire`'s errors.
        """
        waiting = [True]  # whether the bound ran out in the wait for a free connection
        try:
            async with asyncio.timeout_at(due):
                return await self._acquire(target, waiting, fresh=fresh)
        except ConnectTimeout:
            raise
        except TimeoutError:
            if waiting[0]:
                raise PoolBusy(
                    f"all {self.max_connections} upstream connections are in use "
                    "(upstream_max_connections); retry later"
                ) from None
            raise HeadTimeout(_LATE) from None

    async def _acquire(
        self, target: UpstreamTarget, waiting: list[bool], *, fresh: bool = False
    ) -> _Connection:
        """A connection for one request (``fresh``: a new one, not a kept one);
        ``waiting[0]`` is cleared once a place is held (the connect is not waiting).

        Raises:
            PoolClosed: the pool is closed, or closed while this request waited.
            ConnectFailed, ConnectTimeout, TunnelFailed: see :meth:`Connector.connect`.
        """
        policy = self._policy
        if policy.closed:
            raise PoolClosed(_CLOSING)
        grant = policy.checkout(target.key, usable=_usable, fresh=fresh)
        if grant is WAIT:
            waiter = asyncio.get_running_loop().create_future()
            policy.enqueue(waiter)
            try:
                await waiter
            except asyncio.CancelledError:
                woken = waiter.done() and not waiter.cancelled() and waiter.exception() is None
                self._apply(policy.withdraw(waiter, woken=woken))
                raise
            if policy.closed:  # woken, then the pool closed before this ran
                self._apply(policy.withdraw(waiter, woken=True))
                raise PoolClosed(_CLOSING)
            grant = policy.checkout(target.key, usable=_usable, fresh=fresh, woken=True)
        waiting[0] = False
        # No await from here to the connection's entry in the policy: the place is taken.
        if isinstance(grant, Reuse):
            conn: _Connection = grant.conn
            conn.reuse()
            return conn
        assert grant is OPEN
        conn = _Connection(self, target.key)
        policy.opened(conn)
        try:
            await self.connector.connect(conn, target)
        except BaseException:
            conn.abort()  # never connected: its place is free, its parser dropped
            raise
        return conn

    def _checkin(self, conn: _Connection, *, reusable: bool) -> None:
        self._apply(self._policy.checkin(conn.key, conn, reusable=reusable))

    def _gone(self, conn: _Connection, *, in_use: bool) -> None:
        """``conn`` closed (``in_use``: while it carried a request; its place is free)."""
        if in_use:
            self._apply(self._policy.dropped(conn))
        else:
            self._policy.forget(conn.key, conn)

    def _apply(
        self,
        actions: typing.Sequence[
            Park[_Connection] | Close[_Connection] | Wake[asyncio.Future[None]] | Fail[Any]
        ],
    ) -> None:
        """Do what the policy said."""
        for action in actions:
            if isinstance(action, Park):  # the common one first: an answer ended cleanly
                action.conn.park()
            elif isinstance(action, Wake):
                _wake(action.waiter)
            elif isinstance(action, Close):
                action.conn.abort()
            elif not action.waiter.done():
                action.waiter.set_exception(PoolClosed(_CLOSING))

    async def close(self) -> None:
        """Close every connection (in use ones too), refuse new requests and the
        waiting ones (:class:`PoolClosed`); idempotent."""
        self._apply(self._policy.shut())
        # Let the transports run their connection_lost callbacks.
        await asyncio.sleep(0)

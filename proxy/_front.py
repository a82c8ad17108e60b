"""The HTTP/1.1 server edge: request framing (sans-I/O), the connection driver, the listener.

Replaces aiohttp's server for the proxy (its request
handler, router, middlewares and response classes cost ~120 µs of CPU per
request, more than all of this proxy's own per-request logic). Three layers,
each usable alone:

* :class:`RequestFraming`: bytes in, events out (a :class:`RequestHead`, body
  pieces as ``bytes``, :data:`END` after each request). llhttp (``httptools``)
  does the parsing, strictly: both ``Content-Length`` and ``Transfer-Encoding``,
  a bad chunk size, a control character in a field are errors
  (:class:`MalformedRequest`). Limits of our own (llhttp has none): a request
  target or header field over :data:`MAX_LINE_BYTES`, more than
  :data:`MAX_FIELDS` fields, a head over :data:`MAX_HEAD_BYTES` (a chunked
  body's trailer fields too).
* :class:`_Connection`: one client connection. One request is handled at a
  time, in a task of its own (pipelined requests wait, in order, and reading
  pauses behind a few); a client that hangs up cancels its handler's task.
  One timer per connection, re-armed lazily, keeps two deadlines: request
  headers complete within ``header_timeout`` seconds of their first piece
  (docs/design.md §3; a slowloris client is closed without an answer) and an
  idle keep-alive connection closed after ``keepalive_timeout`` seconds.
* :class:`FrontServer`: the listener and its connections, with a bounded
  shutdown (idle connections close at once, busy ones after their answer). It
  accepts by itself so that it can keep descriptors free
  (:class:`proxy._fdlimit.FdBudget`): below the floor a connection gets one
  answer (a probe's, or a 503), and accepting pauses before ``accept`` fails.

A handler gets a :class:`Request` (head, :class:`BodyStream`, the transport)
and returns an answer: a :class:`proxy._answer.SmallAnswer` (a small, complete
one; it is only a value here, written by :meth:`_Connection._write_response`) or
a :class:`StreamAnswer` it has prepared and written itself.

Socket reads are sized for the body: asyncio's selector
transport receives up to ``max_size`` bytes per read (256 KiB, a CPython class
attribute with no public setter), and each read leaves transients of about its
size in the heap. Between bodies a connection reads :data:`HEAD_READ_BYTES`;
while a declared body arrives, :func:`proxy._coding.io_piece_bytes` of it
(the body reader asks for the same size), except that a body under
:data:`SMALL_BODY_BYTES` is read as asyncio would. Set only where the
transport's class has an integer ``max_size`` (uvloop reads into one buffer
per loop and has none).
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import logging
import socket
import urllib.parse
from collections.abc import Awaitable, Callable
from typing import Final, cast

from multidict import CIMultiDict, CIMultiDictProxy, MultiDict, MultiDictProxy

from ._answer import SmallAnswer
from ._coding import MIN_PIECE_BYTES, io_piece_bytes
from ._fdlimit import EXHAUSTED_MESSAGE, FdBudget, Verdict
from ._http1 import (
    END,
    KEEPALIVE_TIMEOUT,
    LINGER_TIMEOUT,
    MAX_FIELDS,
    MAX_HEAD_BYTES,
    MAX_LINE_BYTES,
    MalformedRequest,
    RequestFraming,
    RequestHead,
    answer_head,
    bodiless,
    closing_answer,
)
from ._logs import LogLimiter
from ._protocols import Protocol, error_body

__all__ = [
    "END",
    "HEAD_READ_BYTES",
    "KEEPALIVE_TIMEOUT",
    "LINGER_TIMEOUT",
    "MAX_FIELDS",
    "MAX_HEAD_BYTES",
    "MAX_LINE_BYTES",
    "MAX_READ_BYTES",
    "SMALL_BODY_BYTES",
    "Answer",
    "BodyStream",
    "ClientBodyError",
    "FrontServer",
    "Handler",
    "MalformedRequest",
    "Request",
    "RequestFraming",
    "RequestHead",
    "StreamAnswer",
]

log = logging.getLogger("context_proxy.server")

#: The descriptor floor's warning (and its summaries' subject), once per 10 s.
_FD_LOW: Final = (
    "file descriptors low: new connections answered 503 (probes answered), "
    "accepting paused below the floor (fd_reserve)"
)

HEAD_READ_BYTES: Final = MIN_PIECE_BYTES
"""Bytes per socket read while no body with a declared length is arriving (16 KiB).

A head and a small body fit whole. It is also the first read of a large body
(the head does not say its size before it is read): a larger first read would
leave its own transients in the heap, which the body's later, smaller reads
reuse but never exceed (64 KiB cost a 1 MiB body 0.06 of it at the peak)."""

MAX_READ_BYTES: Final = 256 * 1024
"""Largest socket read, for the largest bodies (asyncio's own default)."""

SMALL_BODY_BYTES: Final = 256 * 1024
"""A declared body under this many bytes is read in reads of up to :data:`MAX_READ_BYTES`
(its rest in one read, usually): reading a 100 KB body 16 KiB at a time cost ~30 % more
CPU per request (seven read cycles instead of two)."""

_QUEUED_MAX: Final = 4
"""Pipelined requests parsed ahead of the one being handled before reading pauses (and
parsing: a large read is parsed :data:`HEAD_READ_BYTES` at a time, the rest kept unparsed)."""

_SHUTDOWN_TURNS: Final = 20
"""Loop turns shutdown waits for aborted connections to report their loss."""

_BODY_HIGH_WATER: Final = 256 * 1024
"""Unread body bytes buffered for a request before reading pauses (backpressure on the client)."""

SHED_TIMEOUT: Final = 5.0
"""Seconds a connection accepted from the descriptor reserve may take to send its request
head (and stay idle before it), instead of ``header_timeout`` / ``keepalive_timeout``: the
reserve is a few descriptors, a silent client must not hold one for long."""

_ACCEPT_BATCH: Final = 64
"""Connections accepted per readiness of the listening socket (the loop's other work runs
between batches)."""

_RESUME_CHECK_S: Final = 0.05
"""Seconds between checks of the descriptors while accepting is paused (a closed connection
checks at once; descriptors freed elsewhere, an idle upstream socket closing, are seen so)."""

_ACCEPT_ERRNOS: Final = frozenset({errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM})


class ClientBodyError(Exception):
    """A request body could not be received whole: the client left, or broke its framing."""


class BodyStream:
    """A request body as it arrives: read it once, in pieces (the body reader's source).

    The connection feeds it (:meth:`feed`, :meth:`feed_eof`,
    :meth:`set_exception`); the handler reads it. Unread bytes over
    :data:`_BODY_HIGH_WATER` pause the connection's reading until they are read.
    """

    __slots__ = ("_buffered", "_conn", "_eof", "_error", "_parts", "_waiter")

    def __init__(self, conn: _Connection | None) -> None:
        self._conn = conn
        self._parts: list[bytes] = []
        self._buffered = 0
        self._eof = False
        self._error: BaseException | None = None
        self._waiter: asyncio.Future[None] | None = None

    def feed(self, data: bytes) -> None:
        """Append a received piece (connection side)."""
        self._parts.append(data)
        self._buffered += len(data)
        if self._buffered > _BODY_HIGH_WATER and self._conn is not None:
            self._conn.pause_for_body()
        self._wake()

    def feed_eof(self) -> None:
        """The body is complete (connection side)."""
        self._eof = True
        self._wake()

    def set_exception(self, exc: BaseException) -> None:
        """The body will not complete: a waiting or later read raises ``exc``."""
        if not self._eof:
            self._error = exc
            self._wake()

    def is_eof(self) -> bool:
        """Every byte of the body has arrived (some may still be unread)."""
        return self._eof

    def at_eof(self) -> bool:
        """Every byte of the body has arrived and been read."""
        return self._eof and not self._parts

    def failed(self) -> bool:
        """The body will not complete: the client left, or broke its framing."""
        return self._error is not None

    async def read(self, n: int) -> bytes:
        """Up to ``n`` bytes of the body (``b""``: its end).

        Raises:
            ClientBodyError: the client left or broke the framing mid-body.
        """
        while not self._parts:
            if self._eof:
                return b""
            if self._error is not None:
                raise self._error
            waiter = self._waiter = asyncio.get_running_loop().create_future()
            try:
                await waiter
            finally:
                self._waiter = None
        parts = self._parts
        first = parts[0]
        if len(first) <= n:
            del parts[0]
        else:
            parts[0] = first[n:]
            first = first[:n]
        self._buffered -= len(first)
        if self._buffered <= _BODY_HIGH_WATER and self._conn is not None:
            self._conn.body_drained()
        return first

    def release(self) -> None:
        """Drop what is buffered and unread (the answer is out; nobody will read it)."""
        paused = self._buffered > _BODY_HIGH_WATER
        self._parts = []
        self._buffered = 0
        if paused and self._conn is not None:
            # Its pause would keep a kept connection from reading the next request.
            self._conn.body_drained()

    def _wake(self) -> None:
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)


class Request:
    """One client request as a handler sees it: its head, its body, its connection.

    Attributes (from the head, see :class:`RequestHead`): ``method``, ``path``,
    ``raw_path``, ``query_string``, ``headers``, ``version``,
    ``content_length``; ``content`` is the :class:`BodyStream`.
    """

    __slots__ = ("_conn", "_query", "answer", "content", "head")

    def __init__(self, head: RequestHead, conn: _Connection | None) -> None:
        self.head = head
        self._conn = conn
        self.content = BodyStream(conn)
        if not head.expects_body:
            self.content.feed_eof()
        self._query: MultiDictProxy[str] | None = None
        # The streamed answer in progress, once a handler prepared one.
        self.answer: StreamAnswer | None = None

    @property
    def method(self) -> str:
        return self.head.method

    @property
    def path(self) -> str:
        return self.head.path

    @property
    def raw_path(self) -> str:
        return self.head.raw_path

    @property
    def query_string(self) -> str:
        return self.head.query_string

    @property
    def headers(self) -> CIMultiDictProxy[str]:
        return self.head.headers

    @property
    def version(self) -> tuple[int, int]:
        return self.head.version

    @property
    def content_length(self) -> int | None:
        return self.head.content_length

    @property
    def body_exists(self) -> bool:
        """A body was framed (declared, even as 0 bytes, or chunked)."""
        return self.head.expects_body

    @property
    def query(self) -> MultiDictProxy[str]:
        """The query string's parameters, decoded (parsed on first use)."""
        if self._query is None:
            pairs = urllib.parse.parse_qsl(self.head.query_string, keep_blank_values=True)
            self._query = MultiDictProxy(MultiDict(pairs))
        return self._query

    @property
    def transport(self) -> asyncio.Transport | None:
        """The connection's transport; None once it is lost."""
        conn = self._conn
        return conn.transport if conn is not None else None

    def client_gone(self) -> bool:
        """The connection is lost or closing: nothing written now would arrive."""
        transport = self.transport
        return transport is None or transport.is_closing()

    async def send_continue(self) -> None:
        """Send ``100 Continue`` (RFC 9110 §10.1.1), to an HTTP/1.1 client only."""
        conn = self._conn
        if conn is not None and self.head.version >= (1, 1):
            conn.write(b"HTTP/1.1 100 Continue\r\n\r\n")
            await conn.drain()


# ---------------------------------------------------------------------- answers

class StreamAnswer:
    """A streamed answer: a status and fields, then body bytes written as they come.

    The head waits for the first body bytes (it leaves with them, one write),
    or for :meth:`send_head`. Framing is chosen when the head leaves: the
    whole body known then (:meth:`write_eof` with the head still waiting) →
    ``Content-Length``; else chunked to an HTTP/1.1 client, the connection's
    end to an HTTP/1.0 one. A ``HEAD`` request or a 1xx/204/304 status gets no body
    and no framing field (a ``Content-Length`` a ``HEAD`` answer states is the
    handler's, in ``headers``).

    Args:
        status: the HTTP status.
        headers: end-to-end fields (no framing or hop-by-hop ones).
    """

    __slots__ = (
        "_chunked",
        "_conn",
        "_ended",
        "_head_sent",
        "_no_body",
        "headers",
        "prepared",
        "status",
    )

    def __init__(self, status: int, headers: CIMultiDict[str]) -> None:
        self.status = status
        self.headers = headers
        self._conn: _Connection | None = None
        self.prepared = False
        self._head_sent = False
        self._chunked = False
        self._no_body = bodiless(status)
        self._ended = False

    async def prepare(self, request: Request) -> None:
        """Bind to ``request``'s connection (nothing is written yet).

        Raises:
            ConnectionResetError: the client is gone.
        """
        conn = request._conn
        if conn is None or request.client_gone():
            raise ConnectionResetError("the client closed the connection")
        self._conn = conn
        if request.method == "HEAD":
            self._no_body = True
        request.answer = self
        self.prepared = True

    def _head(self, length: int | None) -> bytes:
        conn = self._conn
        assert conn is not None
        self._head_sent = True
        if self._no_body:
            # None of ours: a 1xx/204/304 has no content, and for a HEAD the bytes written
            # (none: the upstream sent none) do not count what a GET would get, the only
            # length a HEAD answer may state (RFC 9110 §8.6).
            framing = b""
        elif length is not None:
            framing = b"Content-Length: %d\r\n" % length
        elif conn.request_version >= (1, 1):
            self._chunked = True
            framing = b"Transfer-Encoding: chunked\r\n"
        else:
            conn.close_after_answer()
            framing = b""
        if conn.closes_after_answer():
            framing += b"Connection: close\r\n"
        return answer_head(self.status, None, self.headers, framing)

    def send_head(self) -> None:
        """Send the head now if it still waits (a client must not wait on the upstream)."""
        conn = self._conn
        if conn is not None and not self._head_sent and conn.transport is not None:
            conn.write(self._head(None))

    async def write(self, data: bytes) -> None:
        """Send ``data`` as body bytes; waits while the client reads slower than we write.

        Raises:
            ConnectionResetError: the client is gone.
        """
        conn = self._conn
        assert conn is not None
        if conn.transport is None:
            raise ConnectionResetError("the client closed the connection")
        out = b"" if self._head_sent else self._head(None)
        if self._no_body or not data:
            if out:
                conn.write(out)
        elif self._chunked:
            conn.write(b"%s%x\r\n%s\r\n" % (out, len(data), data))
        elif out:
            conn.write(out + data)
        else:
            conn.write(data)
        if conn._write_paused:
            # Only then is there anything to wait for (a lost connection raised above,
            # and a write never loses it synchronously): no coroutine per write.
            await conn.drain()

    async def write_eof(self, data: bytes = b"") -> None:
        """Send the last body bytes (if any) and the body's end; once only.

        Raises:
            ConnectionResetError: the client is gone.
        """
        if self._ended:
            return
        self._ended = True
        conn = self._conn
        assert conn is not None
        if conn.transport is None:
            raise ConnectionResetError("the client closed the connection")
        if not self._head_sent:
            out = self._head(len(data))
            conn.write(out if self._no_body or not data else out + data)
        elif self._no_body:
            pass
        elif self._chunked:
            conn.write(b"%x\r\n%s\r\n0\r\n\r\n" % (len(data), data) if data else b"0\r\n\r\n")
        elif data:
            conn.write(data)
        await conn.drain()

    @property
    def ended(self) -> bool:
        """:meth:`write_eof` was called."""
        return self._ended


Answer = SmallAnswer | StreamAnswer
Handler = Callable[[Request], Awaitable[Answer]]
"""A request handler: the answer to return (a :class:`SmallAnswer`, or a
:class:`StreamAnswer` it has prepared)."""


def _internalclosing_answer() -> bytes:
    """The 500 of a handler's bug (OpenAI shape: no route is known here), closing."""
    body = error_body(Protocol.OPENAI, 500, "internal proxy error", code="internal_error")
    return closing_answer(500, body)


async def _shed_answer(request: Request) -> Answer:
    """A request on a connection accepted from the descriptor reserve, with no
    ``shed_handler`` given: 503 (OpenAI shape) with ``Retry-After``."""
    return SmallAnswer(
        503,
        body=error_body(Protocol.OPENAI, 503, EXHAUSTED_MESSAGE),
        headers={"Content-Type": "application/json", "Retry-After": "5"},
        close=True,
    )


# ---------------------------------------------------------------------- connection


class _Connection(asyncio.Protocol):
    """One client connection: frames requests, runs their handlers one at a time, writes answers."""

    __slots__ = (
        "__weakref__",
        "_body_left",
        "_body_paused",
        "_broken",
        "_close_after",
        "_current",
        "_deadline",
        "_drain_waiter",
        "_framing",
        "_head_clock",
        "_held",
        "_lingering",
        "_loop",
        "_parsing",
        "_queue",
        "_queue_paused",
        "_server",
        "_sized",
        "_task",
        "_timer",
        "_write_paused",
        "request_version",
        "shed",
        "transport",
    )

    def __init__(self, server: FrontServer, *, shed: bool = False) -> None:
        self._server = server
        # Accepted from the descriptor reserve: one answer (a probe's, or a 503), then closed.
        self.shed = shed
        self._loop = server.loop
        self.transport: asyncio.Transport | None = None
        self._framing = RequestFraming()
        # The request whose body is being parsed; the one being handled; those waiting.
        self._parsing: Request | None = None
        self._current: Request | None = None
        self._queue: list[Request] = []
        # Bytes of the declared body being parsed not received yet.
        self._body_left = 0
        # Bytes read and not parsed yet: the queue was full (pipelined requests).
        self._held: bytes | None = None
        self._task: asyncio.Task[None] | None = None
        self._close_after = False
        # The client's bytes stopped making sense: the words for its 400, once answered.
        self._broken: str | None = None
        self._write_paused = False
        self._drain_waiter: asyncio.Future[None] | None = None
        self._body_paused = False
        self._queue_paused = False
        # Loop time of the pending deadline (header or keep-alive); 0: none.
        self._deadline = 0.0
        self._head_clock = False  # the pending deadline is the header clock's
        self._timer: asyncio.TimerHandle | None = None
        self._sized = False
        # Closing after an answer: the rest of the request body is read and dropped.
        self._lingering = False
        self.request_version = (1, 1)

    # -- asyncio.Protocol

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # uvloop's transports are not asyncio.Transport subclasses, only alike.
        self.transport = transport = cast(asyncio.Transport, transport)
        self._server.connections.add(self)
        if not self.shed:
            self._server.served += 1
        # Only where max_size is the CPython class attribute the read loop uses:
        # an instance attribute then overrides it for this connection alone.
        if isinstance(getattr(type(transport), "max_size", None), int):
            self._sized = True
            transport.max_size = HEAD_READ_BYTES  # type: ignore[attr-defined]
        self._set_deadline(SHED_TIMEOUT if self.shed else self._server.keepalive_timeout)

    def data_received(self, data: bytes) -> None:
        if self._broken is not None or self.transport is None or self._lingering:
            return
        if self._held is not None:  # reading is paused: only a read already under way
            self._held += data
            return
        if len(data) > HEAD_READ_BYTES and self._body_left < len(data):
            # More than a body's rest: maybe many pipelined requests (uvloop reads up to
            # 256 KiB), each a ~1 KiB object once parsed. Parsed a slice at a time, the
            # parse stops behind a full queue and the rest waits as the bytes it is.
            self._parse_sliced(data)
        else:
            self._parse(data)
        if self._current is None and self._framing.in_head and not self._head_clock:
            # Headers not complete in this segment: the slowloris clock runs (once per
            # head: later pieces do not push it back).
            self._start_header_clock()

    def _parse_sliced(self, data: bytes) -> None:
        view = memoryview(data)
        start = 0
        for _ in range(len(data) // HEAD_READ_BYTES + 1):  # bounded: a slice is that or more
            if start >= len(data) or self._broken is not None or self.transport is None:
                break
            if self._queue_paused:
                self._held = data[start:]  # parsed when the queue has room (_finished)
                break
            # A declared body's rest in one piece (one body event), the rest a slice at a time.
            end = start + max(self._body_left, HEAD_READ_BYTES)
            self._parse(view[start:end])
            start = end

    def _parse(self, data: bytes | memoryview) -> None:
        fault: str | None = None
        try:
            events = self._framing.feed(data)
        except MalformedRequest as exc:
            # What came before the fault is handled first: a whole request ahead of the
            # bad bytes is answered (and committed) before the 400 that closes.
            fault, events = str(exc), exc.events
        for event in events:
            if event.__class__ is bytes:
                assert self._parsing is not None and isinstance(event, bytes)
                self._body_left -= len(event)
                self._parsing.content.feed(event)
            elif event is END:
                parsing = self._parsing
                if parsing is not None:  # None: a request without a body (already at EOF)
                    parsing.content.feed_eof()
                    self._parsing = None
                    self._body_left = 0
                    if self._sized:
                        self._set_read_size(HEAD_READ_BYTES)
            elif event.__class__ is RequestHead:
                assert isinstance(event, RequestHead)
                self._head(event)
            # Trailers: not relayed (the body reader has no place for them).
        if fault is not None:
            self._malformed(fault)
            return
        if self._framing.upgraded:
            self.close_after_answer()

    def connection_lost(self, exc: BaseException | None) -> None:
        self.transport = None
        self._server.lost(self)
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        self._deadline = 0.0
        gone = ClientBodyError("the client closed the connection")
        for request in (self._parsing, self._current, *self._queue):
            if request is not None:
                request.content.set_exception(gone)
        self._queue = []
        self._held = None
        self._parsing = None
        waiter = self._drain_waiter
        if waiter is not None and not waiter.done():
            waiter.set_exception(ConnectionResetError("the client closed the connection"))
        task = self._task
        if task is not None and not task.done():
            # The client hung up: its handler stops (the upstream request is closed on the way out).
            task.cancel()

    def pause_writing(self) -> None:
        self._write_paused = True

    def resume_writing(self) -> None:
        self._write_paused = False
        waiter = self._drain_waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    # -- writing

    def write(self, data: bytes) -> None:
        """Hand ``data`` to the transport (dropped once the connection is lost)."""
        transport = self.transport
        # Not after close(): asyncio would still send it (a 500 spliced into a cut answer).
        if transport is not None and not transport.is_closing():
            transport.write(data)

    async def drain(self) -> None:
        """Wait until the client has taken what was written (backpressure).

        Raises:
            ConnectionResetError: the connection was lost meanwhile.
        """
        if not self._write_paused:
            if self.transport is None:
                raise ConnectionResetError("the client closed the connection")
            return
        waiter = self._drain_waiter = self._loop.create_future()
        try:
            await waiter
        finally:
            self._drain_waiter = None

    def close_after_answer(self) -> None:
        """Close the connection once the current answer is out (no keep-alive)."""
        self._close_after = True

    def closes_after_answer(self) -> bool:
        """Whether the connection will close after the current answer."""
        current = self._current
        return (
            self._close_after
            or self._server.draining()
            # HTTP/1.0: every answer is the connection's last (no keep-alive dance).
            or (
                current is not None
                and (not current.head.keep_alive or current.head.version < (1, 1))
            )
        )

    # -- reading

    def pause_for_body(self) -> None:
        """Unread body bytes piled up: stop reading the socket until they are read."""
        if not self._body_paused and self.transport is not None:
            self._body_paused = True
            if not self._queue_paused:
                self.transport.pause_reading()

    def body_drained(self) -> None:
        """The handler caught up with the body: read on."""
        if self._body_paused:
            self._body_paused = False
            if not self._queue_paused and self.transport is not None:
                self.transport.resume_reading()

    def _set_read_size(self, nbytes: int) -> None:
        transport = self.transport
        if transport is not None:
            transport.max_size = nbytes  # type: ignore[attr-defined]

    def _head(self, head: RequestHead) -> None:
        request = Request(head, self)
        if head.expects_body:
            self._parsing = request
            declared = head.content_length
            self._body_left = declared or 0
            if self._sized and declared:
                self._set_read_size(
                    MAX_READ_BYTES
                    if declared < SMALL_BODY_BYTES
                    else io_piece_bytes(declared, MAX_READ_BYTES)
                )
        if self._current is None:
            self._start(request)
        else:
            self._queue.append(request)
            if len(self._queue) >= _QUEUED_MAX and not self._queue_paused:
                self._queue_paused = True
                if not self._body_paused and self.transport is not None:
                    self.transport.pause_reading()

    def _malformed(self, words: str) -> None:
        log.warning("%s: malformed request (%s)", self._peer(), words)
        self._broken = words
        parsing = self._parsing
        if parsing is not None:
            parsing.content.set_exception(ClientBodyError("the request's framing is broken"))
            self._parsing = None
        if self._current is None:
            self._answer_broken()

    def _answer_broken(self) -> None:
        words = self._broken or "malformed HTTP request"
        self.write(
            closing_answer(400, error_body(Protocol.OPENAI, 400, words, code="malformed_request"))
        )
        self._close()

    def _peer(self) -> str:
        transport = self.transport
        peer = transport.get_extra_info("peername") if transport is not None else None
        return f"{peer[0]}:{peer[1]}" if isinstance(peer, tuple) and len(peer) >= 2 else "client"

    # -- handling

    def _start(self, request: Request) -> None:
        self._current = request
        self._deadline = 0.0
        self._head_clock = False
        self.request_version = request.head.version
        if self.shed:
            self._close_after = True  # the reserve is for one answer at a time
        self._task = self._loop.create_task(self._serve(request))

    async def _serve(self, request: Request) -> None:
        try:
            await self._answer(request)
        finally:
            # Every way out: a hang-up (cancelled) and a handler's bug included.
            self._finished(request)

    async def _answer(self, request: Request) -> None:
        server = self._server
        try:
            answer = await (server.shed_handler if self.shed else server.handler)(request)
        except asyncio.CancelledError:
            self._close()
            raise
        except Exception as exc:  # a handler's bug: a 500, never a traceback page
            log.error(
                "%s %s: internal error %s in the request handler",
                request.method,
                request.path,
                type(exc).__name__,
            )
            del exc
            if request.answer is None:
                self.write(_internalclosing_answer())
            # Closed either way: an answer that had begun is cut, not spliced; after a
            # 500 the rest of the request may be unread.
            self._close()
            return
        try:
            if request.answer is not None and answer is not request.answer:
                # An error answer after a streamed one began: a truncated answer, not a spliced one.
                self._close()
            elif isinstance(answer, StreamAnswer):
                if not answer.ended and self.transport is not None:
                    await answer.write_eof()
            else:
                await self._write_response(request, answer)
        except ConnectionError:
            pass
        finally:
            del answer

    async def _write_response(self, request: Request, resp: SmallAnswer) -> None:
        if resp.close:
            self.close_after_answer()
        if not request.content.is_eof():
            # The body was not read to its end: its rest cannot be told from a next request.
            self.close_after_answer()
        status = resp.status
        body = resp.body
        framing = b"" if bodiless(status) else b"Content-Length: %d\r\n" % len(body)
        if self.closes_after_answer():
            framing += b"Connection: close\r\n"
        try:
            head = answer_head(status, resp.reason, resp.headers, framing)
        except ValueError:
            # A field with a line break (a handler's bug): never an answer split in two.
            log.error(
                "%s %s: an answer's header field holds a line break", request.method, request.path
            )
            self.write(_internalclosing_answer())
            self._close()
            return
        self.write(
            head if request.method == "HEAD" or not body or bodiless(status) else head + body
        )
        await self.drain()

    def _finished(self, request: Request) -> None:
        server = self._server
        close = self.closes_after_answer() or not request.content.is_eof()
        self._task = None
        self._current = None
        request.answer = None
        request.content.release()
        request._conn = None
        if server.on_request_done is not None:
            server.on_request_done()
        transport = self.transport
        if transport is None or transport.is_closing():
            return
        content = request.content
        if not content.is_eof() and not content.failed():
            self._linger()
            return
        if close:
            self._close()
            return
        if self._broken is not None and not self._queue:
            # The requests parsed before the fault are answered first, in order.
            self._answer_broken()
            return
        if self._queue:
            queued = self._queue.pop(0)
            if self._queue_paused and len(self._queue) < _QUEUED_MAX:
                self._queue_paused = False
                if not self._body_paused:
                    transport.resume_reading()
            self._start(queued)
            held = self._held
            if held is not None and not self._queue_paused:
                self._held = None
                self._parse_sliced(held)
            return
        if self._framing.in_head:
            self._start_header_clock()
        else:
            self._set_deadline(server.keepalive_timeout)

    def _linger(self) -> None:
        """The answer is out, the request body is not: drop its rest as it comes, then close
        (the client's end, or :data:`LINGER_TIMEOUT`), so the client reads the answer first."""
        transport = self.transport
        assert transport is not None
        self._lingering = True
        self._parsing = None
        self._queue = []
        self._held = None
        if self._body_paused or self._queue_paused:
            self._body_paused = self._queue_paused = False
            transport.resume_reading()
        self._set_deadline(LINGER_TIMEOUT)

    def _close(self) -> None:
        transport = self.transport
        if transport is not None and not transport.is_closing():
            transport.close()

    # -- the one timer

    def _start_header_clock(self) -> None:
        """The next request's head came in part: it must be complete within ``header_timeout``."""
        self._head_clock = True
        timeout = self._server.header_timeout
        self._set_deadline(min(timeout, SHED_TIMEOUT) if self.shed else timeout)

    def _set_deadline(self, seconds: float) -> None:
        loop = self._loop
        deadline = self._deadline = loop.time() + seconds
        timer = self._timer
        if timer is not None and timer.when() > deadline:
            # Armed for a later deadline (the keep-alive one): a nearer one needs its own.
            timer.cancel()
            timer = None
        if timer is None:
            self._timer = loop.call_at(deadline, self._on_timer)

    def _on_timer(self) -> None:
        self._timer = None
        deadline = self._deadline
        if not deadline or self._current is not None or self.transport is None:
            return
        if self._loop.time() < deadline:
            # The deadline moved on since this timer was set (a later request).
            self._timer = self._loop.call_at(deadline, self._on_timer)
            return
        self._deadline = 0.0
        if self._framing.in_head and not self._lingering:
            log.debug("%s: request headers not complete in time: closing", self._peer())
        self._close()

    @property
    def task(self) -> asyncio.Task[None] | None:
        """The task handling the current request, if any."""
        return self._task

    def close_idle(self) -> bool:
        """Close the connection if no request is being handled; whether it was."""
        if self._current is None:
            self._close()
            return True
        self.close_after_answer()
        return False

    def abort(self) -> None:
        """Drop the connection at once (shutdown's last step)."""
        transport = self.transport
        if transport is not None:
            transport.abort()


# ---------------------------------------------------------------------- listener


class FrontServer:
    """The listener and its client connections.

    Accepting is the server's own (not ``asyncio.Server``'s), so that it can
    stop and resume: with an :class:`~proxy._fdlimit.FdBudget`, each waiting
    connection is served, shed (accepted from the descriptor reserve: its
    request goes to ``shed_handler``, the connection closes after the answer
    and may take :data:`SHED_TIMEOUT` seconds for its head) or left in the
    kernel's queue while descriptors are too few (accepting resumes as a
    connection closes, or within :data:`_RESUME_CHECK_S` seconds of
    descriptors freeing elsewhere). ``EMFILE`` on ``accept`` pauses it too.

    Args:
        handler: answers each request (:data:`Handler`).
        header_timeout: seconds from a request head's first incomplete piece to
            its end; past it the connection closes without an answer.
        keepalive_timeout: seconds an idle keep-alive connection is kept.
        on_request_done: called (no arguments) after every answer is finished.
        draining: whether the proxy is draining (answers then close their connection).
        fd_budget: admission by free descriptors; None: every connection is served.
        shed_handler: answers a request on a shed connection (default: a 503,
            OpenAI shape, ``Retry-After: 5``); it must need no descriptor.

    Raises:
        ValueError: a timeout is not positive.
    """

    __slots__ = (
        "_adopting",
        "_emptied",
        "_listening",
        "_made_pending",
        "_paused",
        "_resume_timer",
        "_shed_log",
        "_sockets",
        "connections",
        "draining",
        "fd_budget",
        "handler",
        "header_timeout",
        "keepalive_timeout",
        "loop",
        "on_request_done",
        "served",
        "shed_handler",
    )

    def __init__(
        self,
        handler: Handler,
        *,
        header_timeout: float,
        keepalive_timeout: float = KEEPALIVE_TIMEOUT,
        on_request_done: Callable[[], object] | None = None,
        draining: Callable[[], bool] = lambda: False,
        fd_budget: FdBudget | None = None,
        shed_handler: Handler | None = None,
    ) -> None:
        if header_timeout <= 0 or keepalive_timeout <= 0:
            raise ValueError("header_timeout and keepalive_timeout must be > 0 seconds")
        self.handler = handler
        self.header_timeout = header_timeout
        self.keepalive_timeout = keepalive_timeout
        self.on_request_done = on_request_done
        self.draining = draining
        self.fd_budget = fd_budget
        self.shed_handler: Handler = shed_handler or _shed_answer
        self.loop = asyncio.get_running_loop()
        self.connections: set[_Connection] = set()
        #: Client connections open and served (not shed), for the descriptor budget.
        self.served = 0
        self._made_pending = 0
        self._sockets: list[socket.socket] = []
        self._listening = False
        self._paused = False
        self._resume_timer: asyncio.Handle | None = None
        # Accepted sockets whose transport is being made (referenced until it is).
        self._adopting: set[asyncio.Task[None]] = set()
        self._shed_log = LogLimiter(log)
        # Set by shutdown: resolved when the last connection is lost.
        self._emptied: asyncio.Future[None] | None = None

    async def start(self, host: str, port: int) -> int:
        """Listen on ``host:port`` (0: an ephemeral port); the bound port.

        Every address ``host`` resolves to gets a socket (IPv6 ones IPv6 only),
        as ``loop.create_server`` binds them.

        Raises:
            OSError: the address cannot be bound.
        """
        infos = await self.loop.getaddrinfo(
            host, port, family=socket.AF_UNSPEC, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE
        )
        seen: set[tuple[int, object]] = set()
        try:
            for family, kind, proto, _, address in infos:
                if (family, address) in seen:
                    continue
                seen.add((family, address))
                sock = socket.socket(family, kind, proto)
                self._sockets.append(sock)
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
                if family == socket.AF_INET6 and hasattr(socket, "IPPROTO_IPV6"):
                    sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
                sock.bind(address)
                sock.listen(1024)
                sock.setblocking(False)
        except BaseException:
            self._close_sockets()
            raise
        if not self._sockets:
            raise OSError(f"no address to listen on for {host!r}")
        self._listening = True
        self._watch()
        return int(self._sockets[0].getsockname()[1])

    # -- accepting

    def _watch(self) -> None:
        for sock in self._sockets:
            self.loop.add_reader(sock.fileno(), self._accept, sock)

    def _unwatch(self) -> None:
        for sock in self._sockets:
            self.loop.remove_reader(sock.fileno())

    def _accept(self, sock: socket.socket) -> None:
        budget = self.fd_budget
        for _ in range(_ACCEPT_BATCH):  # bounded: the loop's other work runs between batches
            verdict = Verdict.SERVE if budget is None else budget.verdict(self._serving())
            if verdict is Verdict.PAUSE:
                self._shed_log.event(_FD_LOW, _FD_LOW)
                self._pause()
                return
            try:
                conn, _ = sock.accept()
            except (BlockingIOError, InterruptedError):
                return
            except ConnectionAbortedError:
                continue
            except OSError as exc:
                if exc.errno not in _ACCEPT_ERRNOS:
                    raise  # the loop logs it; the reader stays
                # Out of descriptors anyway (opened elsewhere): wait for some to free.
                self._shed_log.event(_FD_LOW, _FD_LOW)
                self._pause()
                return
            if budget is not None:
                budget.accepted()
            shed = verdict is Verdict.SHED
            if shed:
                self._shed_log.event(_FD_LOW, _FD_LOW)
            else:
                self._made_pending += 1
            conn.setblocking(False)
            task = self.loop.create_task(self._adopt(conn, shed))
            self._adopting.add(task)
            task.add_done_callback(self._adopting.discard)

    def _serving(self) -> int:
        """Served connections, those whose transport is still being made included."""
        return self.served + self._made_pending

    async def _adopt(self, conn: socket.socket, shed: bool) -> None:
        try:
            await self.loop.connect_accepted_socket(lambda: _Connection(self, shed=shed), conn)
        except (OSError, RuntimeError):
            # The client left before its transport was made (or the loop is closing).
            conn.close()
        finally:
            if not shed:
                self._made_pending -= 1
            self._resume_soon()

    def _pause(self) -> None:
        if self._paused or not self._listening:
            return
        self._paused = True
        self._unwatch()
        self._resume_timer = self.loop.call_later(_RESUME_CHECK_S, self._resume_check)

    def _resume_soon(self) -> None:
        if self._paused and self._listening:
            if self._resume_timer is not None:
                self._resume_timer.cancel()
            self._resume_timer = self.loop.call_soon(self._resume_check)

    def _resume_check(self) -> None:
        self._resume_timer = None
        if not self._paused or not self._listening:
            return
        budget = self.fd_budget
        if budget is not None and budget.verdict(self._serving()) is Verdict.PAUSE:
            self._resume_timer = self.loop.call_later(_RESUME_CHECK_S, self._resume_check)
            return
        self._paused = False
        self._watch()  # a connection waiting in the queue makes the socket readable at once

    def _close_sockets(self) -> None:
        if self._listening and not self._paused:
            self._unwatch()
        self._listening = False
        if self._resume_timer is not None:
            self._resume_timer.cancel()
            self._resume_timer = None
        for sock in self._sockets:
            sock.close()
        self._sockets = []
        self._shed_log.flush()

    def lost(self, conn: _Connection) -> None:
        """``conn`` is closed (connection side: its ``connection_lost``)."""
        connections = self.connections
        if conn in connections and not conn.shed:
            self.served -= 1
        connections.discard(conn)
        self._resume_soon()
        emptied = self._emptied
        if not connections and emptied is not None and not emptied.done():
            emptied.set_result(None)

    async def shutdown(self, grace: float) -> None:
        """Stop listening, close idle connections, give busy ones ``grace`` seconds
        to finish their answer (its last bytes taken by the client), then drop every
        connection left."""
        self._close_sockets()
        loop = self.loop
        deadline = loop.time() + grace
        busy = [c.task for c in list(self.connections) if not c.close_idle()]
        running = [t for t in busy if t is not None]
        if running:
            await asyncio.wait(running, timeout=grace)
        if self.connections:
            # A closed transport still holds what a slow client has not taken yet (the
            # end of an answer that finished in time): it is lost once that is out. The
            # grace covers it; whatever is left at its end goes.
            emptied = self._emptied = loop.create_future()
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout_at(deadline):
                    await emptied
            self._emptied = None
        for conn in list(self.connections):
            conn.abort()
        for _ in range(_SHUTDOWN_TURNS):  # bounded: each lost connection reports in a turn or two
            if not self.connections:
                break
            await asyncio.sleep(0)

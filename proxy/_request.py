"""A request as a handler sees it: its head, its body as it arrives, its connection.

The connection driver (:mod:`proxy._front`) makes a :class:`Request` for each
request head and feeds its :class:`BodyStream`; the handler reads the body and
answers (:mod:`proxy._stream_answer`, :mod:`proxy._answer`). Both reach the
connection only through :class:`Link`, so that neither imports the driver.
"""

from __future__ import annotations

import asyncio
import urllib.parse
from typing import Final, Protocol

from multidict import CIMultiDictProxy, MultiDict, MultiDictProxy

from ._http1 import InformationalResponse, RequestHead, Response, ServerConnection

__all__ = [
    "BODY_HIGH_WATER",
    "Begun",
    "BodyStream",
    "ClientBodyError",
    "ClientFramingError",
    "Link",
    "Request",
]

BODY_HIGH_WATER: Final = 256 * 1024
"""Unread body bytes buffered for a request before reading pauses (backpressure on the client)."""


class Begun(Protocol):
    """An answer a handler has begun writing (a :class:`proxy._stream_answer.StreamAnswer`):
    once one has, any other answer would splice into it."""

    @property
    def ended(self) -> bool:
        """Its end was written."""


class Link(Protocol):
    """The client connection as its requests and answers see it (``_front.ClientConnection``)."""

    @property
    def transport(self) -> asyncio.Transport | None:
        """The connection's transport; None once it is lost."""

    @property
    def http(self) -> ServerConnection:
        """The connection's HTTP/1.1 state machine (framing, keep-alive, ``100 Continue``)."""

    @property
    def writing_paused(self) -> bool:
        """The transport's buffer is over its high-water mark: :meth:`drain` waits."""

    def write(self, data: bytes) -> None:
        """Hand ``data`` to the transport (dropped once the connection is lost or closing)."""

    async def drain(self) -> None:
        """Wait until the client has taken what was written (raises ``ConnectionResetError``
        once the connection is lost)."""

    def send_head(self, head: Response) -> bytes:
        """The bytes of an answer's head (the machine's :meth:`~ServerConnection.send`,
        closing the connection after it while the server drains)."""

    def pause_for_body(self) -> None:
        """Unread body bytes piled up: stop reading the socket until they are read."""

    def body_drained(self) -> None:
        """The handler caught up with the body: read on."""


class ClientBodyError(Exception):
    """A request body could not be received whole: the client left, or broke its framing."""


class ClientFramingError(ClientBodyError):
    """The client broke the body's framing (RFC 9112 §7.1) and may still be connected.

    Its text is the parser's description of the fault (no client bytes): safe to show.
    """


class BodyStream:
    """A request body as it arrives: read it once, in pieces (the body reader's source).

    The connection feeds it (:meth:`feed`, :meth:`feed_eof`,
    :meth:`set_exception`); the handler reads it. Unread bytes over
    :data:`BODY_HIGH_WATER` pause the connection's reading until they are read.
    """

    __slots__ = ("_buffered", "_conn", "_eof", "_error", "_parts", "_waiter")

    def __init__(self, conn: Link | None) -> None:
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
        if self._buffered > BODY_HIGH_WATER and self._conn is not None:
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
        if self._buffered <= BODY_HIGH_WATER and self._conn is not None:
            self._conn.body_drained()
        return first

    def release(self) -> None:
        """Drop what is buffered and unread (the answer is out; nobody will read it)."""
        paused = self._buffered > BODY_HIGH_WATER
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

    __slots__ = (
        "_conn",
        "_query",
        "answer",
        "content",
        "content_length",
        "head",
        "headers",
        "method",
        "path",
        "query_string",
        "raw_path",
    )

    def __init__(self, head: RequestHead, conn: Link | None) -> None:
        self.head = head
        # The head's fields a request's handling reads, a dozen times in all: copied
        # once as attributes (a property is a Python call each time).
        self.method: Final[str] = head.method
        self.path: Final[str] = head.path
        self.raw_path: Final[str] = head.raw_path
        self.query_string: Final[str] = head.query_string
        self.headers: Final[CIMultiDictProxy[str]] = head.headers
        self.content_length: Final[int | None] = head.content_length
        self._conn = conn
        self.content = BodyStream(conn)
        if not head.expects_body:
            self.content.feed_eof()
        self._query: MultiDictProxy[str] | None = None
        # The streamed answer in progress, once a handler prepared one.
        self.answer: Begun | None = None

    @property
    def version(self) -> tuple[int, int]:
        return self.head.version

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
        conn = self._conn  # self.transport, inline: looked at before each attempt and write
        transport = conn.transport if conn is not None else None
        return transport is None or transport.is_closing()

    async def send_continue(self) -> None:
        """Send ``100 Continue`` (RFC 9110 §10.1.1), to an HTTP/1.1 client only (the
        connection's machine decides, :class:`proxy._http1.InformationalResponse`)."""
        conn = self._conn
        if conn is not None and conn.transport is not None:
            data = conn.http.send(InformationalResponse())
            if data:
                conn.write(data)
                await conn.drain()

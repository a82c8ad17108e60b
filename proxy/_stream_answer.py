"""A streamed answer: a status and fields, then body bytes written as they come.

The handler's side of an answer whose body is not known in full (a relayed
upstream answer, an event stream). Its bytes are the connection's machine's
(:class:`proxy._http1.ServerConnection`: framing, ``Connection: close``); this
module only decides when the head leaves and waits on the client's pace.
"""

from __future__ import annotations

from typing import Final

from multidict import CIMultiDict, CIMultiDictProxy

from ._http1 import END, Response, bodiless
from ._request import Link, Request

__all__ = ["StreamAnswer"]

#: A sent head's fields: read-only and empty, shared by every answer streaming on.
_SENT: Final[CIMultiDictProxy[str]] = CIMultiDictProxy(CIMultiDict())


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

    __slots__ = ("_conn", "_ended", "_head_request", "_head_sent", "headers", "prepared", "status")

    def __init__(self, status: int, headers: CIMultiDict[str]) -> None:
        self.status = status
        #: The fields until the head leaves; then none (not kept for the stream's life).
        self.headers: CIMultiDict[str] | CIMultiDictProxy[str] = headers
        self._conn: Link | None = None
        self.prepared = False
        self._head_sent = False
        self._head_request = False
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
        self._head_request = request.method == "HEAD"
        request.answer = self
        self.prepared = True

    def _head(self, conn: Link, length: int | None) -> bytes:
        self._head_sent = True
        # For a HEAD the bytes written (none: the upstream sent none) do not count what
        # a GET would get, the only length a HEAD answer may state (RFC 9110 §8.6): the
        # handler's own Content-Length, in headers, if any.
        known = None if self._head_request or bodiless(self.status) else length
        headers, self.headers = self.headers, _SENT
        return conn.send_head(Response(self.status, headers, length=known))

    def send_head(self) -> None:
        """Send the head now if it still waits (a client must not wait on the upstream)."""
        conn = self._conn
        if conn is not None and not self._head_sent and conn.transport is not None:
            conn.write(self._head(conn, None))

    async def write(self, data: bytes) -> None:
        """Send ``data`` as body bytes; waits while the client reads slower than we write.

        Raises:
            ConnectionResetError: the client is gone.
        """
        conn = self._conn
        assert conn is not None
        if conn.transport is None:
            raise ConnectionResetError("the client closed the connection")
        http = conn.http
        # The head first (it moves the machine to the body), then the piece it frames.
        piece = http.send(data) if self._head_sent else self._head(conn, None) + http.send(data)
        if piece:
            conn.write(piece)
        if conn.writing_paused:
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
        http = conn.http
        out = b"" if self._head_sent else self._head(conn, len(data))
        out += http.send(data) + http.send(END)
        if out:
            conn.write(out)
        await conn.drain()

    @property
    def ended(self) -> bool:
        """:meth:`write_eof` was called."""
        return self._ended

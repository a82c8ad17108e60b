"""The upstream HTTP/1.1 client: pooled keep-alive connections, one exchange at a time on each.

Why our own and not aiohttp's ``ClientSession``: the proxy sends one request
shape (a method, a target, header fields it already filtered, a body it
already holds as slices) and relays one answer shape (a status, header fields,
body bytes as they come). aiohttp's client does much more per request (URL
objects, cookie and redirect handling, trace hooks, a task per upload, a
timer per socket read) and keeps several KiB per open stream (its response,
parser, stream reader and queues; see ``bench overhead``). Framing is not
ours: the status line, header fields, chunked and length bodies are parsed by
llhttp through ``httptools``.

Two layers, h11-style:

* :class:`ResponseFraming` is sans-I/O: feed it the bytes of a connection and
  read what it found (the head, body pieces, the end, a framing error).
  Tests drive it with bytes alone.
* :class:`UpstreamPool` and its connection protocol are the driver: connect
  (TCP or TLS, bounded by ``connect_timeout``), write the request with
  backpressure, hand the relay an :class:`UpstreamAnswer` once the head is
  here, and keep the connection for the next request when the answer ended
  cleanly and both sides allow it.

Errors are :class:`UpstreamError` subclasses carrying our own words, never
the upstream's bytes (a header value may hold a secret).
"""

from __future__ import annotations

import asyncio
import collections
import http
import ipaddress
import os
import socket
import ssl
import typing
import urllib.parse
from collections.abc import AsyncIterable, Callable, Coroutine, Mapping
from typing import Any, Final

import cachetools
import httptools
from multidict import CIMultiDict, CIMultiDictProxy

from ._egress import ForwardProxy
from ._spool import FileSlice

__all__ = [
    "AnswerCut",
    "BadResponseHead",
    "ConnectFailed",
    "ConnectTimeout",
    "HeadTimeout",
    "IdleReadTimeout",
    "PoolBusy",
    "PoolClosed",
    "ResponseFraming",
    "ServerDisconnected",
    "TunnelFailed",
    "UpstreamAnswer",
    "UpstreamError",
    "UpstreamPool",
    "UpstreamTarget",
]

#: One piece of an outbound body: bytes in memory, or a range of a spooled body's
#: file (sent with ``sendfile`` on a plain TCP connection, see ``_Connection._upload``).
_Piece: typing.TypeAlias = memoryview | FileSlice

#: Longest header field line accepted from an upstream (name, ``": "``, value), bytes.
#: The same bound as aiohttp's and nginx's default (8 KiB less the line end).
MAX_FIELD_LINE_BYTES: Final = 8190
#: Most header fields accepted in one response head.
MAX_FIELDS: Final = 128
#: Bytes a response head may take in all before it is refused, however it is split.
MAX_HEAD_BYTES: Final = MAX_FIELDS * (MAX_FIELD_LINE_BYTES + 2)
#: Body bytes buffered from an upstream before its socket is paused: the relay reads
#: them as it writes to the client, so a slow client slows the upstream read.
READ_HIGH_WATER_BYTES: Final = 64 * 1024
#: Seconds an idle pooled connection is kept for the next request (aiohttp's default).
KEEPALIVE_SECONDS: Final = 15.0
#: Seconds after a request's first byte within which a kept connection's close (or
#: 408) counts as the upstream's idle close crossing it: it arrives within a round
#: trip. Later, the upstream may have acted on the request: it is not sent again.
RESEND_WINDOW_S: Final = 0.5
#: Seconds before the next address of a host name is tried beside a slow one (RFC 8305).
HAPPY_EYEBALLS_DELAY_S: Final = 0.25
#: Seconds a host name's addresses are kept (aiohttp's default DNS cache time).
DNS_TTL_S: Final = 10.0
#: What the proxy accepts from upstreams (it decodes answers itself, piece by piece).
ACCEPT_ENCODING: Final = "gzip, deflate, br"
#: The ``User-Agent`` sent when the client sent none.
USER_AGENT: Final = "context-proxy"

_NO_FIELDS: Final[CIMultiDictProxy[str]] = CIMultiDictProxy(CIMultiDict())
# A body of at most this many bytes leaves with the request head in one write.
_COALESCE_BYTES: Final = 16 * 1024


class UpstreamError(Exception):
    """No usable answer (or no complete body) from the upstream; ``str()`` is our words."""


class ConnectFailed(UpstreamError):
    """The TCP or TLS connect failed: ``host``, ``port`` and the ``OSError`` behind it.

    ``proxy`` is the forward proxy when the failure was the connect to it (then
    ``host`` and ``port`` are the proxy's); a TLS failure through a tunnel is the
    upstream's, as without a proxy.
    """

    def __init__(
        self, host: str, port: int, os_error: OSError, proxy: ForwardProxy | None = None
    ) -> None:
        where = f"{host}:{port}"
        if proxy is not None:
            # The proxy's URL without its credentials, and the variable that named it.
            peer = f"egress proxy {proxy.shown} (from {proxy.source})"
        else:
            peer = "upstream"
        if isinstance(os_error, ConnectionRefusedError):
            words = f"{peer} refused the connection at {where}"
        elif isinstance(os_error, ssl.SSLCertVerificationError):
            # OpenSSL's reason ("self-signed certificate", "hostname mismatch"): no secret.
            reason = os_error.verify_message or "not trusted"
            words = f"{peer}'s TLS certificate could not be verified at {where}: {reason}"
        elif isinstance(os_error, ssl.SSLError):
            words = f"TLS handshake with the {peer} at {where} failed"
        elif isinstance(os_error, socket.gaierror):
            words = f"{peer} host name did not resolve ({where})"
        else:
            words = f"could not connect to the {peer} at {where}"
        super().__init__(words)
        self.host = host
        self.port = port
        self.os_error = os_error
        self.proxy = proxy
        self.__cause__ = os_error


class TunnelFailed(UpstreamError):
    """The forward proxy did not open a ``CONNECT`` tunnel to the upstream.

    ``status`` is the proxy's answer (407: credentials missing or wrong, 403: the
    target is not allowed, 502: the proxy could not reach the upstream), or
    ``None`` when it closed or sent no HTTP answer. ``str()`` is our words: the
    status and its standard reason phrase, never the proxy's own bytes.
    """

    def __init__(self, proxy: ForwardProxy, authority: str, status: int | None, words: str) -> None:
        super().__init__(f"egress proxy {proxy.shown} (from {proxy.source}) {words}")
        self.proxy = proxy
        self.authority = authority
        self.status = status


class ConnectTimeout(UpstreamError, TimeoutError):
    """The connect did not complete within ``connect_timeout`` seconds."""


class ServerDisconnected(UpstreamError):
    """The upstream closed the connection before a complete response head."""


class BadResponseHead(UpstreamError):
    """The response head could not be parsed, or is over a limit (our words say which)."""


class AnswerCut(UpstreamError):
    """The answer's body did not end as its framing says (closed early, bad chunking)."""


class PoolClosed(UpstreamError):
    """The pool was closed (the proxy shuts down): no request goes out any more."""


class PoolBusy(UpstreamError):
    """Every connection the pool may open (``max_connections``) stayed in use: the
    proxy's own limit, not the upstream's fault."""


class HeadTimeout(UpstreamError, TimeoutError):
    """The answer's head did not come in time."""


class IdleReadTimeout(UpstreamError, TimeoutError):
    """No body bytes for ``idle_read`` seconds mid-answer."""


# ---------------------------------------------------------------- sans-I/O framing


class ResponseFraming:
    """The framing of answers on one connection (sans-I/O, over llhttp).

    :meth:`feed` takes the bytes read; afterwards :attr:`status` and
    :attr:`fields` are set once a final head (not 1xx) is complete
    (:attr:`head_done`), :attr:`body` holds the body pieces not yet taken,
    :attr:`complete` says the answer ended, and :attr:`error` says why the
    connection's bytes are unusable (our words; the bytes after it are not
    parsed). :meth:`eof` says the peer closed. One answer per request:
    :meth:`expect` resets for the next request on a kept connection.

    Limits: a field line over :data:`MAX_FIELD_LINE_BYTES`, more than
    :data:`MAX_FIELDS` fields, or a head over :data:`MAX_HEAD_BYTES` is an
    :attr:`error`. A ``101`` (protocol switch) is an error too: nothing the
    proxy sends asks for one. Bytes after a complete answer are an error (no
    pipelining: nothing was asked).
    """

    __slots__ = (
        "_head_bytes",
        "_head_only",
        "_parser",
        "_since_field",
        "body",
        "body_bytes",
        "closed",
        "complete",
        "error",
        "fields",
        "head_done",
        "keep_alive",
        "keep_alive_s",
        "status",
        "until_close",
    )

    def __init__(self, *, head_only: bool = False) -> None:
        self._parser = httptools.HttpResponseParser(self)
        self.expect(head_only=head_only)

    def expect(self, *, head_only: bool) -> None:
        """Start over for the answer to the next request (``head_only``: a HEAD request)."""
        self._head_only = head_only
        self._head_bytes = 0
        self._since_field = 0
        self.status = 0
        self.fields: list[tuple[str, str]] = []
        self.head_done = False
        self.body: list[bytes] = []
        self.body_bytes = 0
        self.complete = False
        self.keep_alive = False
        #: Seconds the connection may idle before its next request (the upstream's
        #: ``Keep-Alive: timeout=N`` less a second, at most :data:`KEEPALIVE_SECONDS`).
        self.keep_alive_s = KEEPALIVE_SECONDS
        self.until_close = False
        #: The peer closed the connection (:meth:`eof`).
        self.closed = False
        self.error: str | None = None

    def feed(self, data: bytes) -> None:
        """Parse ``data``, the next bytes of the connection (nothing after an error)."""
        if self.error is not None:
            return
        if self.complete:
            self.error = "upstream sent bytes after its answer"
            return
        if not self.head_done:
            self._head_bytes += len(data)
            self._since_field += len(data)
        try:
            self._parser.feed_data(data)
        except httptools.HttpParserUpgrade:
            self.error = "upstream switched protocols"
        except httptools.HttpParserCallbackError:
            # One of ours raised: the limit or rule it states is in ``error``.
            if self.error is None:  # pragma: no cover - every callback sets one first
                self.error = "upstream sent a response head that could not be parsed"
        except httptools.HttpParserError:
            if self.error is None:
                if self.complete:
                    self.error = "upstream sent bytes after its answer"
                elif self.head_done:
                    self.error = "upstream body framing is broken"
                else:
                    self.error = "upstream sent a response head that could not be parsed"
        if self.error is not None or self.head_done:
            return
        if self._since_field > 2 * MAX_FIELD_LINE_BYTES:
            # One line still growing (llhttp gathers it whole before calling back).
            self.error = (
                "upstream response headers over the parser's limit "
                f"({MAX_FIELD_LINE_BYTES} bytes a line)"
            )
        elif self._head_bytes > MAX_HEAD_BYTES:
            self.error = (
                f"upstream response headers over the parser's limit ({MAX_HEAD_BYTES} bytes in all)"
            )

    def eof(self) -> None:
        """The peer closed: an answer framed "until close" ends here; else it is cut."""
        self.closed = True
        if self.complete or self.error is not None:
            return
        if self.head_done and self.until_close:
            self.complete = True
            return
        self.error = (
            "upstream closed the connection before answering"
            if not self.head_done
            else "upstream closed the connection mid-answer"
        )

    @property
    def received_nothing(self) -> bool:
        """Whether not one byte of an answer to this request came (the request may be resent)."""
        return self._head_bytes == 0 and not self.head_done

    def take(self) -> bytes:
        """The body bytes parsed so far (joined if several pieces), and forget them."""
        body = self.body
        if not body:
            return b""
        data = body[0] if len(body) == 1 else b"".join(body)
        self.body = []
        self.body_bytes = 0
        return data

    # llhttp callbacks (called by feed_data; an exception stops the parse).

    def on_header(self, name: bytes, value: bytes) -> None:
        if len(name) + len(value) + 2 > MAX_FIELD_LINE_BYTES:
            self.error = (
                "upstream response headers over the parser's limit "
                f"({MAX_FIELD_LINE_BYTES} bytes a line)"
            )
            raise _Stop
        self._since_field = 0
        fields = self.fields
        if len(fields) >= MAX_FIELDS:
            self.error = "upstream response headers over the parser's limit (too many fields)"
            raise _Stop
        # As aiohttp's parser decodes them: the client's response head encodes them
        # back to the same bytes (UTF-8 text stays UTF-8, other bytes survive too).
        fields.append(
            (name.decode("utf-8", "surrogateescape"), value.decode("utf-8", "surrogateescape"))
        )

    def on_headers_complete(self) -> None:
        parser = self._parser
        status = parser.get_status_code()
        if status == 101:
            self.error = "upstream switched protocols"
            raise _Stop
        if 100 <= status < 200:
            # An interim answer (100 Continue, 103 Early Hints): the final one follows.
            self.fields = []
            return
        self.status = status
        self.head_done = True
        self.keep_alive = parser.should_keep_alive()
        chunked = content_length = False
        for name, value in self.fields:
            lowered = name.lower()
            if lowered == "transfer-encoding":
                # Chunked framing only when chunked is the last coding (RFC 9112 section 6.3).
                chunked = value.rsplit(",", 1)[-1].strip().lower() == "chunked"
            elif lowered == "content-length":
                content_length = True
            elif lowered == "keep-alive":
                self.keep_alive_s = _keep_alive_timeout(value)
        if self._head_only:
            # No body follows, whatever Content-Length says; llhttp would wait for one,
            # so the connection is not reused.
            self.complete = True
            self.keep_alive = False
        elif status not in (204, 304):
            self.until_close = not (chunked or content_length)

    def on_body(self, body: bytes) -> None:
        self.body.append(body)
        self.body_bytes += len(body)

    def on_message_complete(self) -> None:
        if self.head_done:
            self.complete = True


def _keep_alive_timeout(value: str) -> float:
    """Seconds to keep an idle connection, from a ``Keep-Alive`` field's ``timeout=N``.

    One second less than the upstream says (its timer and ours start apart), within
    [0, :data:`KEEPALIVE_SECONDS`]; :data:`KEEPALIVE_SECONDS` when it says nothing
    usable. RFC 2068 section 19.7.1.1 defines the field (Node sends ``timeout=5``).
    """
    for part in value.split(","):
        name, _, number = part.partition("=")
        if name.strip().lower() == "timeout":
            try:
                seconds = float(number.strip().strip('"'))  # a quoted-string is allowed
            except ValueError:
                return KEEPALIVE_SECONDS
            return max(0.0, min(KEEPALIVE_SECONDS, seconds - 1.0))
    return KEEPALIVE_SECONDS


class _Stop(Exception):
    """Raised in a llhttp callback to stop parsing (the reason is in ``error``)."""


# ---------------------------------------------------------------- the driver


class UpstreamTarget:
    """Where one upstream base URL points: scheme, host, port, path prefix (parsed once),
    and the route to it: direct, or ``via`` a forward proxy (:mod:`proxy._egress`).

    Through a proxy an https upstream is reached in a ``CONNECT`` tunnel (the TLS
    handshake, SNI included, is with the upstream inside it); an http one gets the
    absolute-form request target and the proxy's ``Proxy-Authorization`` field
    (RFC 9112 section 3.2.2). Pooled connections are kept per target and route
    (:attr:`key`).

    Raises:
        ValueError: ``base`` is not an ``http://`` or ``https://`` URL with a host.
    """

    __slots__ = (
        "authority",
        "host",
        "host_field",
        "key",
        "literal",
        "origin",
        "port",
        "prefix",
        "proxy_fields",
        "tls",
        "via",
    )

    def __init__(self, base: str, via: ForwardProxy | None = None) -> None:
        parts = urllib.parse.urlsplit(base)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ValueError(f"upstream base URL must be http(s)://host[:port][/path]: {base!r}")
        self.tls = parts.scheme == "https"
        self.host = parts.hostname
        default = 443 if self.tls else 80
        self.port = parts.port or default
        shown = f"[{self.host}]" if ":" in self.host else self.host
        self.host_field = shown if self.port == default else f"{shown}:{self.port}"
        self.prefix = parts.path.rstrip("/")
        #: ``host:port`` with the port always there (a ``CONNECT`` target).
        self.authority = f"{shown}:{self.port}"
        self.via = via
        self.key = (self.tls, self.host, self.port, via.key if via is not None else "")
        #: Whether ``host`` is an IP address (nothing to resolve).
        self.literal = _is_ip(self.host)
        plain_via = via is not None and not self.tls
        # An http upstream through a proxy: the request line names the whole URL.
        self.origin = f"http://{self.host_field}" if plain_via else ""
        #: Header lines every request head carries for the route (CRLF-ended; ``""``).
        self.proxy_fields = (
            f"Proxy-Authorization: {via.authorization}\r\n"
            if plain_via and via is not None and via.authorization is not None
            else ""
        )

    def request_target(self, path: str, query: str) -> str:
        """The request target for ``path`` and the raw ``query`` (kept as sent): the
        origin form, or the absolute form for an http upstream through a proxy."""
        target = f"{self.origin}{self.prefix}{path}"
        return f"{target}?{query}" if query else target


class UpstreamAnswer:
    """An upstream answer whose head is here: status, header fields, the body to read.

    The body is read with :meth:`read` (pieces as they come, ``b""`` at its
    end); afterwards :meth:`release` keeps the connection for the next
    request, and :meth:`close` (for an answer not read to its end) drops it,
    which is how the upstream learns nobody reads on.
    """

    __slots__ = ("_conn", "content_type", "headers", "status", "wait_s")

    def __init__(
        self,
        conn: _Connection,
        status: int,
        fields: list[tuple[str, str]],
        wait_s: float | None = None,
    ) -> None:
        self._conn: _Connection | None = conn
        self.status = status
        #: Seconds from starting to send the request to the complete response head
        #: (nginx's ``$upstream_header_time``); ``None`` when not measured.
        self.wait_s = wait_s
        #: The answer's header fields (empty after :meth:`drop_head`).
        self.headers: CIMultiDictProxy[str] = CIMultiDictProxy(CIMultiDict(fields))
        raw_type = self.headers.get("Content-Type")
        #: The media type, lowercased, without parameters (``""``: no Content-Type).
        self.content_type = (
            raw_type.split(";", 1)[0].strip().lower() if raw_type is not None else ""
        )

    @property
    def arrived(self) -> bool:
        """Whether body bytes (or the body's end, or a failure) are here: a read will not wait."""
        conn = self._conn
        if conn is None:
            return True
        framing = conn.framing
        return bool(framing.body) or framing.complete or framing.error is not None

    @property
    def ended(self) -> bool:
        """Whether the body's end was parsed (bytes may still wait to be read)."""
        conn = self._conn
        return conn is None or conn.framing.complete

    @property
    def at_eof(self) -> bool:
        """Whether the body ended and every byte of it was read."""
        conn = self._conn
        return conn is None or (conn.framing.complete and not conn.framing.body)

    def read(self) -> Coroutine[Any, Any, bytes]:
        """The next body bytes (all that are here, joined), ``b""`` once it ended (awaitable).

        The connection's own coroutine is handed over: an idle stream waits in
        one frame less (each is held per open stream).

        Raises:
            AnswerCut: the connection closed before the body's end, or its framing broke.
            IdleReadTimeout: nothing came for the pool's ``idle_read`` seconds.
        """
        conn = self._conn
        if conn is None:
            return _nothing()
        return conn.read_body()

    def drop_head(self) -> None:
        """Forget the header fields (the client's head was built from them); idempotent."""
        self.headers = _NO_FIELDS

    def release(self) -> None:
        """Done with the answer: keep the connection if the body was read to its end."""
        conn = self._conn
        if conn is not None:
            self._conn = None
            conn.finish()

    def close(self) -> None:
        """Drop the connection (the body may be unread); idempotent."""
        conn = self._conn
        if conn is not None:
            self._conn = None
            conn.abort()


class _Connection(asyncio.Protocol):
    """One upstream connection: the driver around a :class:`ResponseFraming`."""

    __slots__ = (
        "__weakref__",  # tests prove a closed connection is freed
        "_bound",
        "_drain",
        "_head",
        "_idle",
        "_idle_until",
        "_read_paused",
        "_read_timer",
        "_reader",
        "_sent_at",
        "_waiting_since",
        "_write_paused",
        "framing",
        "in_use",
        "key",
        "lost",
        "pool",
        "reused",
        "transport",
    )

    def __init__(self, pool: UpstreamPool, key: _RouteKey, *, head_only: bool) -> None:
        self.pool = pool
        self.key = key
        self.transport: asyncio.Transport | None = None
        self.framing = ResponseFraming(head_only=head_only)
        self.in_use = True
        self.lost = False
        #: Whether it carried an earlier request (an upstream may close such one any time).
        self.reused = False
        self._head: asyncio.Future[None] | None = None
        # The deadline on the answer's head while it is awaited (UpstreamPool.request).
        self._bound: _Bound | None = None
        self._reader: asyncio.Future[None] | None = None
        self._drain: asyncio.Future[None] | None = None
        self._idle: asyncio.TimerHandle | None = None
        self._idle_until = 0.0  # loop time by which a parked connection is closed
        self._read_paused = False
        self._read_timer: asyncio.TimerHandle | None = None
        self._waiting_since = 0.0
        self._sent_at = 0.0
        self._write_paused = False

    # asyncio.Protocol

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # A stream transport (uvloop's is not an asyncio.Transport subclass, but has
        # the same methods): no isinstance check.
        self.transport = typing.cast(asyncio.Transport, transport)

    def data_received(self, data: bytes) -> None:
        framing = self.framing
        if not self.in_use:
            # An idle connection must stay silent: whatever came, it is not reusable.
            self.abort()
            return
        had_head = framing.head_done
        framing.feed(data)
        if framing.error is not None:
            self._wake_all()
            self.transport_close()
            return
        if framing.head_done and not had_head:
            if self._bound is not None:
                self._bound.met = True  # in time, whenever the task runs on
            _wake(self._head)
            _wake(self._drain)  # an answer during the upload ends the upload
        if framing.body or framing.complete:
            _wake(self._reader)
            if framing.body_bytes > READ_HIGH_WATER_BYTES and not self._read_paused:
                self._read_paused = True
                assert self.transport is not None
                self.transport.pause_reading()

    def eof_received(self) -> bool | None:
        self.framing.eof()
        self._wake_all()
        return None  # close the transport

    def connection_lost(self, exc: Exception | None) -> None:
        self.lost = True
        self.framing.eof()
        self._wake_all()
        if not self.in_use:
            self.pool._forget(self)
        if self._idle is not None:
            self._idle.cancel()
            self._idle = None

    def pause_writing(self) -> None:
        self._write_paused = True

    def resume_writing(self) -> None:
        self._write_paused = False
        _wake(self._drain)

    # the driver

    def _wake_all(self) -> None:
        _wake(self._head)
        _wake(self._reader)
        _wake(self._drain)

    def transport_close(self) -> None:
        if self.transport is not None:
            self.transport.close()

    async def send(
        self,
        head: bytes,
        body: AsyncIterable[_Piece] | None,
        body_bytes: int,
        bound: _Bound | None = None,
    ) -> UpstreamAnswer:
        """Write the request, wait for the answer's head; the answer to read
        (``bound``: the head's deadline, told when the head is parsed).

        Raises:
            ServerDisconnected: the connection closed before a complete head.
            BadResponseHead: the head could not be parsed or is over a limit.
        """
        transport = self.transport
        assert transport is not None
        framing = self.framing
        self._sent_at = asyncio.get_running_loop().time()
        if body is None:
            transport.write(head)
        else:
            # Bound whole, even after a 2xx head (an upstream that answers, then stops
            # reading the body, would hold it forever).
            await self._upload(transport, head, body, body_bytes)
        self._bound = bound
        try:
            while not framing.head_done:
                if framing.error is not None:
                    if framing.closed:
                        raise ServerDisconnected(framing.error)
                    raise BadResponseHead(framing.error)
                if self.lost:
                    raise ServerDisconnected("upstream closed the connection before answering")
                self._head = asyncio.get_running_loop().create_future()
                try:
                    await self._head
                finally:
                    self._head = None
        finally:
            self._bound = None  # it holds the request's task
        wait_s = asyncio.get_running_loop().time() - self._sent_at
        answer = UpstreamAnswer(self, framing.status, framing.fields, wait_s)
        # The answer's fields are the only copy: dropped with its head (drop_head).
        framing.fields = []
        return answer

    async def _upload(
        self,
        transport: asyncio.Transport,
        head: bytes,
        body: AsyncIterable[_Piece],
        body_bytes: int,
    ) -> None:
        """Write the head and the body's slices, waiting while the socket is full.

        A final answer that is not a success (a 413, a 401, a redirect) before
        the body is sent ends the upload, and the connection is not reused (the
        upstream did not read it all): RFC 9112 section 9.3 lets a client stop
        sending on a response that says the body is not wanted. A 2xx head
        (a server streaming before it reads) does not: the upload goes on. A
        lost connection ends it too (no write goes to a closed transport).

        On a plain TCP connection whose transport has nothing buffered, a slice
        goes straight to the socket: a :class:`~proxy._spool.FileSlice` (a range
        of a spooled body) with ``os.sendfile`` (page cache to socket), a heap
        slice with ``os.write``; what the socket cannot take now goes to the
        transport as a copy, never as a view of the body, since some transports
        (uvloop's; asyncio's from Python 3.12) keep what they cannot send as the
        object given, which would keep the whole body past the release boundary.
        On TLS a heap slice is written as it is (encrypted into the TLS buffer at
        once), a spooled one as a copy.
        """
        framing = self.framing
        pieces = aiter(body)
        native = transport.get_extra_info("sslcontext") is None
        sock = transport.get_extra_info("socket") if native else None
        try:
            if body_bytes <= _COALESCE_BYTES:
                # A small body leaves with its head in one write (one syscall).
                parts = [head]
                async for piece in pieces:
                    parts.append(bytes(piece.view if isinstance(piece, FileSlice) else piece))
                    del piece
                transport.write(b"".join(parts))
                return
            transport.write(head)
            async for piece in pieces:
                while self._write_paused and not self._upload_over(transport):
                    self._drain = asyncio.get_running_loop().create_future()
                    try:
                        await self._drain
                    finally:
                        self._drain = None
                if self._upload_over(transport):
                    framing.keep_alive = False
                    return
                sent = 0
                if sock is not None and not transport.get_write_buffer_size():
                    # Straight to the socket only behind an empty transport buffer,
                    # so bytes keep their order; the transport writes the rest.
                    try:
                        if isinstance(piece, FileSlice):
                            sent = os.sendfile(sock.fileno(), piece.fd, piece.offset, len(piece))
                        else:
                            sent = os.write(sock.fileno(), piece)
                    except BlockingIOError:
                        sent = 0
                    except OSError:
                        # A broken socket: the transport sees it on its next read.
                        framing.keep_alive = False
                        return
                view = piece.view if isinstance(piece, FileSlice) else piece
                if sent < len(view):
                    # A copy of the rest (at most one slice): uvloop and asyncio's
                    # selector transports from Python 3.12 on keep what they cannot
                    # send now as the object given, and a view there would keep the
                    # whole body (its buffer, or the spool's mapping) past the
                    # release boundary. TLS encrypts a heap slice at once: it gets
                    # the view (a spooled one is copied all the same).
                    rest = view[sent:]
                    copy = sock is not None or isinstance(piece, FileSlice)
                    transport.write(bytes(rest) if copy else rest)
                    del rest
                del view
                del piece  # the transport copied what it could not send
        finally:
            close = getattr(pieces, "aclose", None)
            if close is not None:
                await close()

    def raced(self) -> bool:
        """Whether what ended this request (a close, a 408) came within
        :data:`RESEND_WINDOW_S` of its first byte: the upstream's idle close crossing
        the request on the wire, not an upstream that worked on it and then failed."""
        return asyncio.get_running_loop().time() - self._sent_at <= RESEND_WINDOW_S

    def _upload_over(self, transport: asyncio.Transport) -> bool:
        """Whether the rest of the body must not be sent (see :meth:`_upload`)."""
        framing = self.framing
        return (
            self.lost
            or transport.is_closing()
            or framing.error is not None
            or (framing.head_done and framing.status >= 300)
        )

    async def read_body(self) -> bytes:
        framing = self.framing
        while True:
            if framing.body:
                data = framing.take()
                if self._read_paused and not self.lost:
                    self._read_paused = False
                    assert self.transport is not None
                    self.transport.resume_reading()
                return data
            if framing.complete:
                # Ended; bytes after the end (an error) only make the connection unusable.
                return b""
            if framing.error is not None:
                raise AnswerCut(framing.error)
            loop = asyncio.get_running_loop()
            waiter = self._reader = loop.create_future()
            self._waiting_since = now = loop.time()
            if self._read_timer is None:
                # One timer per idle_read seconds, re-armed when it fires early, instead
                # of one made and cancelled per read (a stream reads once per event).
                self._read_timer = loop.call_at(now + self.pool.idle_read, self._idle_check)
            try:
                await waiter
            finally:
                self._reader = None

    def _idle_check(self) -> None:
        """The read timer fired: time out a read that waited ``idle_read`` seconds."""
        self._read_timer = None
        waiter = self._reader
        if waiter is None or waiter.done():
            return  # no read waits: the next one arms the timer again
        loop = asyncio.get_running_loop()
        due = self._waiting_since + self.pool.idle_read
        if loop.time() < due:
            self._read_timer = loop.call_at(due, self._idle_check)
            return
        waiter.set_exception(IdleReadTimeout("upstream sent nothing for too long mid-answer"))

    def _stop_read_timer(self) -> None:
        if self._read_timer is not None:
            self._read_timer.cancel()
            self._read_timer = None

    def finish(self) -> None:
        """The relay is done with the answer: pool the connection if it can be reused."""
        framing = self.framing
        if (
            framing.complete
            and framing.keep_alive
            and framing.error is None
            and not framing.body
            and framing.keep_alive_s > 0
            and not self.lost
        ):
            self.pool._put_back(self)
        else:
            self.abort()

    def abort(self) -> None:
        """Close the connection now (unread bytes are dropped); idempotent."""
        was_in_use = self.in_use
        self.in_use = False
        self._stop_read_timer()  # it holds this connection for up to idle_read seconds
        if self._idle is not None:
            self._idle.cancel()
            self._idle = None
        if self.transport is not None and not self.lost:
            self.transport.abort()
        if was_in_use:
            self.pool._done(self)
        else:
            self.pool._forget(self)

    def reuse(self, *, head_only: bool) -> None:
        """Taken from the pool for the next request."""
        self.in_use = True  # the idle timer, if it fires meanwhile, lets it be
        self.reused = True
        self.framing.expect(head_only=head_only)

    def park(self, loop: asyncio.AbstractEventLoop) -> None:
        """Put in the pool: closed if no request takes it within the keep-alive time.

        One idle timer per connection, re-armed lazily: a connection parked again
        before its timer fires moves the deadline on instead of making a new timer
        (a timer and its cancel per request cost more than the deadline's check).
        """
        self.in_use = False
        self._stop_read_timer()
        self._idle_until = loop.time() + self.framing.keep_alive_s
        if self._idle is None:
            self._idle = loop.call_at(self._idle_until, self._idle_expired, loop)

    def _idle_expired(self, loop: asyncio.AbstractEventLoop) -> None:
        self._idle = None
        if self.in_use:
            return  # taken from the pool; its next park arms a timer again
        if loop.time() < self._idle_until:
            self._idle = loop.call_at(self._idle_until, self._idle_expired, loop)
            return
        self.abort()


async def _nothing() -> bytes:
    return b""


def _wake(waiter: asyncio.Future[None] | None) -> None:
    if waiter is not None and not waiter.done():
        waiter.set_result(None)


class _Bound:
    """A deadline on the current task: at ``when`` (loop time) the task is cancelled,
    and :meth:`expired` tells that cancellation from any other one.

    ``asyncio.timeout()`` does the same with a context manager, a ``Timeout``
    object and a reschedule; this is one timer, for the one await per request
    that needs a bound (the answer's head). :meth:`close` it in ``finally``.

    ``met`` is set by the connection as the head is parsed: a deadline falling
    due before the task has run on (a busy loop runs the socket's reads and the
    timers due in one turn) then lets it be; the head came in time.
    """

    __slots__ = ("_cancelling", "_due", "_fired", "_handle", "_task", "met")

    def __init__(self, loop: asyncio.AbstractEventLoop, when: float) -> None:
        task = asyncio.current_task(loop)
        assert task is not None, "a bound needs a task to cancel"
        self._task = task
        self._cancelling = task.cancelling()
        self._fired = False  # this bound cancelled the task
        self._due = False  # the deadline has passed
        self.met = False
        self._handle = loop.call_at(when, self._fire)

    def _fire(self) -> None:
        self._due = True
        if not self.met:
            self._fired = True
            self._task.cancel()

    def wait_again(self) -> None:
        """The head in hand is not the answer (a resend follows): bound again, and
        cancelled at once if the deadline passed meanwhile."""
        self.met = False
        if self._due and not self._fired:
            self._fire()

    def close(self) -> None:
        """Drop the timer (the bounded await is over)."""
        self._handle.cancel()

    def expired(self) -> bool:
        """Called on a ``CancelledError``: whether it was this bound's (then it is undone,
        as ``asyncio.timeout`` undoes its own, so the caller raises a timeout instead)."""
        return self._fired and self._task.uncancel() <= self._cancelling


class UpstreamPool:
    """Keep-alive connections to the upstreams, and the requests made on them.

    ``max_connections`` bounds the connections in use at once (0: no bound; a
    request beyond it waits for one to come free). ``connect_timeout`` bounds a
    TCP/TLS connect (through a forward proxy: the connect to it, the ``CONNECT``
    and the handshake) and ``idle_read`` the silence between two body reads
    (seconds). There is no total timeout: it would cut a long stream. The wait
    for the head is the caller's to bound. A connection idle in the pool is
    closed after :data:`KEEPALIVE_SECONDS`. ``tls_context`` verifies https
    upstreams (default: the system's trust store, made on first use).
    """

    __slots__ = (
        "_closed",
        "_dns",
        "_idle",
        "_idle_until",
        "_in_use",
        "_reserved",
        "_ssl",
        "_waiters",
        "connect_timeout",
        "idle_read",
        "max_connections",
    )

    def __init__(
        self,
        *,
        connect_timeout: float,
        idle_read: float,
        max_connections: int,
        tls_context: ssl.SSLContext | None = None,
    ) -> None:
        self.connect_timeout = connect_timeout
        self.idle_read = idle_read
        self.max_connections = max_connections
        self._idle: dict[_RouteKey, list[_Connection]] = {}
        self._in_use: set[_Connection] = set()
        # Requests waiting for a place (``max_connections``), first come first served,
        # and places handed to woken waiters that have not taken them yet.
        self._waiters: collections.deque[asyncio.Future[None]] = collections.deque()
        self._reserved = 0
        # Made on the first https connect unless given (the system trust store costs
        # a few hundred KiB and a file read).
        self._ssl: ssl.SSLContext | None = tls_context
        self._closed = False
        self._dns: cachetools.TTLCache[tuple[str, int], list[_Address]] = cachetools.TTLCache(
            maxsize=64, ttl=DNS_TTL_S
        )

    @property
    def idle_connections(self) -> int:
        """Connections waiting in the pool for a request."""
        return sum(len(conns) for conns in self._idle.values())

    @property
    def connections_in_use(self) -> int:
        """Connections carrying a request or an answer now."""
        return len(self._in_use)

    async def request(
        self,
        target: UpstreamTarget,
        method: str,
        path: str,
        fields: Mapping[str, str],
        body: Callable[[], AsyncIterable[_Piece]] | None = None,
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
        head = _request_head(target, method, path, fields)
        waiting = [True]  # whether the bound ran out in the wait for a free connection
        loop = asyncio.get_running_loop()
        bound = _Bound(loop, loop.time() + head_timeout) if head_timeout is not None else None
        try:
            try:
                answer = await self._exchange(
                    target, head, method == "HEAD", body, body_bytes, waiting, bound
                )
            except asyncio.CancelledError:
                if bound is None or not bound.expired():
                    raise
                raise TimeoutError from None
            finally:
                if bound is not None:
                    bound.close()
        except ConnectTimeout:
            raise
        except TimeoutError:
            if waiting[0]:
                raise PoolBusy(
                    f"all {self.max_connections} upstream connections are in use "
                    "(upstream_max_connections); retry later"
                ) from None
            raise HeadTimeout("upstream sent no response headers in time") from None
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
                f"refused to forward to {target.authority}: {_status_words(407)}",
            )
        return answer

    async def _exchange(
        self,
        target: UpstreamTarget,
        head: bytes,
        head_only: bool,
        body: Callable[[], AsyncIterable[_Piece]] | None,
        body_bytes: int,
        waiting: list[bool],
        bound: _Bound | None,
    ) -> UpstreamAnswer:
        """:meth:`request`'s attempts: a kept connection, then maybe a new one."""
        conn = await self._acquire(target, head_only=head_only, waiting=waiting)
        try:
            answer = await conn.send(head, body() if body is not None else None, body_bytes, bound)
        except ServerDisconnected:
            conn.abort()
            if not (conn.reused and conn.framing.received_nothing and conn.raced()):
                raise
        except BaseException:
            conn.abort()
            raise
        else:
            if not (conn.reused and answer.status == 408 and conn.raced()):
                return answer
            answer.close()
            if bound is not None:
                bound.wait_again()
        waiting[0] = True
        conn = await self._acquire(target, head_only=head_only, fresh=True, waiting=waiting)
        try:
            return await conn.send(head, body() if body is not None else None, body_bytes, bound)
        except BaseException:
            conn.abort()
            raise

    async def _acquire(
        self,
        target: UpstreamTarget,
        *,
        head_only: bool,
        waiting: list[bool],
        fresh: bool = False,
    ) -> _Connection:
        """A connection for one request (``fresh``: a new one, not a kept one);
        ``waiting[0]`` is cleared once a place is held (the connect is not waiting)."""
        if self._closed:
            raise PoolClosed("proxy is shutting down")
        limit = self.max_connections
        if limit and (self._waiters or len(self._in_use) + self._reserved >= limit):
            await self._wait_for_place()
            if self._closed:  # woken, then the pool closed before this ran
                self._hand_on()
                raise PoolClosed("proxy is shutting down")
        waiting[0] = False
        # No await from here to the connection's entry in _in_use: the place is taken.
        idle = None if fresh else self._idle.get(target.key)
        while idle:
            conn = idle.pop()  # the most recent: least likely closed by the upstream
            if conn.lost or conn.transport is None or conn.transport.is_closing():
                continue
            conn.reuse(head_only=head_only)
            self._in_use.add(conn)
            return conn
        conn = _Connection(self, target.key, head_only=head_only)
        self._in_use.add(conn)
        try:
            await self._connect(conn, target)
        except BaseException:
            self._done(conn)
            raise
        return conn

    async def _connect(self, conn: _Connection, target: UpstreamTarget) -> None:
        """Connect ``conn`` to ``target`` on its route, within ``connect_timeout``.

        Raises:
            ConnectFailed: the connect (to the upstream or to its proxy) or the TLS
                handshake failed.
            ConnectTimeout: it all took over ``connect_timeout``.
            TunnelFailed: the proxy did not open the ``CONNECT`` tunnel.
        """
        loop = asyncio.get_running_loop()
        context = None
        if target.tls:
            if self._ssl is None:
                self._ssl = ssl.create_default_context()
            context = self._ssl
        via = target.via
        # The TLS handshake (through a tunnel too) is with the upstream: SNI is its name.
        hostname = target.host if context is not None else None
        try:
            async with asyncio.timeout(self.connect_timeout):
                if via is None:
                    # A host name's addresses are raced here (asyncio's own race, its
                    # happy_eyeballs_delay, costs ~8 KiB of RSS per connection under a
                    # burst of connects, and uvloop has none); an IP address is direct.
                    if target.literal:
                        await loop.create_connection(
                            lambda: conn,  # this connection's protocol object, made before
                            target.host,
                            target.port,
                            ssl=context,
                            server_hostname=hostname,
                        )
                        return
                    sock = await self._race(loop, target.host, target.port)
                else:
                    sock = await self._via(loop, target, via)
                await loop.create_connection(
                    lambda: conn, sock=sock, ssl=context, server_hostname=hostname
                )
        except TimeoutError:
            where = f"{target.host}:{target.port}"
            if via is not None:
                where += f" through the egress proxy {via.shown}"
            raise ConnectTimeout(f"could not connect to the upstream at {where} in time") from None
        except OSError as exc:
            raise ConnectFailed(target.host, target.port, exc) from exc

    async def _via(
        self, loop: asyncio.AbstractEventLoop, target: UpstreamTarget, via: ForwardProxy
    ) -> socket.socket:
        """A socket connected to ``via`` and, for an https ``target``, tunnelled to it.

        The proxy's addresses are raced as a direct upstream's are (an IP address is
        connected to directly).

        Raises:
            ConnectFailed: the proxy could not be reached (``proxy`` set).
            TunnelFailed: the proxy refused the tunnel or broke off.
        """
        try:
            if via.literal:
                family = socket.AF_INET6 if ":" in via.host else socket.AF_INET
                sock = await _connect_to(
                    loop, (family, socket.SOCK_STREAM, 0, (via.host, via.port))
                )
            else:
                sock = await self._race(loop, via.host, via.port)
        except OSError as exc:
            raise ConnectFailed(via.host, via.port, exc, proxy=via) from exc
        if not target.tls:
            return sock  # absolute-form requests go to the proxy as they are
        try:
            await _open_tunnel(loop, sock, target, via)
        except BaseException:
            sock.close()
            raise
        return sock

    async def _addresses(
        self, loop: asyncio.AbstractEventLoop, host: str, port: int
    ) -> list[_Address]:
        """``host``'s addresses, families interleaved (RFC 8305 section 4), kept
        :data:`DNS_TTL_S` seconds (a resolution is a round trip through a thread).

        Raises:
            OSError: the name did not resolve (``socket.gaierror``).
        """
        key = (host, port)
        found = self._dns.get(key)
        if found is None:
            infos = await loop.getaddrinfo(host, port, type=socket.SOCK_STREAM)
            found = _interleave([(f, t, p, addr) for f, t, p, _name, addr in infos])
            if not found:
                raise socket.gaierror(socket.EAI_NONAME, "no address")
            self._dns[key] = found
        return found

    async def _race(self, loop: asyncio.AbstractEventLoop, host: str, port: int) -> socket.socket:
        """A connected socket to one of ``host``'s addresses (RFC 8305 section 5).

        The first address is tried alone; each :data:`HAPPY_EYEBALLS_DELAY_S` without a
        connection (or at once when an attempt fails) the next one starts beside it;
        the first to connect wins and the others are cancelled and closed. A name with
        one address costs no task.

        Raises:
            OSError: every address failed (the first address's error).
        """
        addresses = await self._addresses(loop, host, port)
        if len(addresses) == 1:
            return await _connect_to(loop, addresses[0])
        waiting = list(addresses)
        attempts: set[asyncio.Task[socket.socket]] = set()
        errors: list[OSError] = []
        try:
            for _ in range(2 * len(addresses)):  # bounded: each turn starts or ends one
                if waiting:
                    task = loop.create_task(_connect_to(loop, waiting.pop(0)))
                    task.add_done_callback(_retrieve)
                    attempts.add(task)
                if not attempts:
                    break
                done, _ = await asyncio.wait(
                    attempts,
                    timeout=HAPPY_EYEBALLS_DELAY_S if waiting else None,
                    return_when=asyncio.FIRST_COMPLETED,
                )
                for task in done:
                    attempts.discard(task)
                    failure = task.exception()
                    if failure is None:
                        return task.result()
                    errors.append(typing.cast(OSError, failure))
            # Every attempt ended (the loop's bound allows each to start and to end).
            raise errors[0] if errors else OSError("no address of the upstream connected")
        finally:
            for task in attempts:
                if task.done() and not task.cancelled() and task.exception() is None:
                    task.result().close()  # connected too, but second
                else:
                    task.cancel()

    async def _wait_for_place(self) -> None:
        """Queue for a place under ``max_connections``; return holding it (FIFO).

        A newcomer queues behind the waiters (it does not take a place freed for
        them), and a place is handed to the first waiter directly, so a waiter
        is never overtaken. A waiter cancelled once woken passes its place on.

        Raises:
            PoolClosed: the pool closed while this request waited.
        """
        waiter = asyncio.get_running_loop().create_future()
        self._waiters.append(waiter)
        try:
            await waiter
        except asyncio.CancelledError:
            if waiter.done() and not waiter.cancelled() and waiter.exception() is None:
                self._reserved -= 1  # woken in the same turn: the place is the next's
                self._hand_on()
            elif waiter in self._waiters:  # (a woken one is off the queue already)
                self._waiters.remove(waiter)
            raise
        self._reserved -= 1

    def _hand_on(self) -> None:
        """Places came free: hand them to the first waiters."""
        waiters = self._waiters
        limit = self.max_connections
        while waiters and len(self._in_use) + self._reserved < limit:
            waiter = waiters.popleft()
            if not waiter.done():
                self._reserved += 1
                waiter.set_result(None)

    def _put_back(self, conn: _Connection) -> None:
        self._in_use.discard(conn)
        if self._closed:
            conn.abort()
            return
        conn.park(asyncio.get_running_loop())
        self._idle.setdefault(conn.key, []).append(conn)
        self._hand_on()

    def _done(self, conn: _Connection) -> None:
        """``conn`` closed while in use: its place is free."""
        if conn in self._in_use:
            self._in_use.discard(conn)
            self._hand_on()

    def _forget(self, conn: _Connection) -> None:
        """``conn`` closed while idle in the pool."""
        idle = self._idle.get(conn.key)
        if idle is not None and conn in idle:
            idle.remove(conn)
            if not idle:
                del self._idle[conn.key]

    async def close(self) -> None:
        """Close every connection (in use ones too), refuse new requests and the
        waiting ones (:class:`PoolClosed`); idempotent."""
        self._closed = True
        while self._waiters:
            waiter = self._waiters.popleft()
            if not waiter.done():
                waiter.set_exception(PoolClosed("proxy is shutting down"))
        for conns in list(self._idle.values()):
            for conn in list(conns):
                conn.abort()
        self._idle.clear()
        for conn in list(self._in_use):
            conn.abort()
        # Let the transports run their connection_lost callbacks.
        await asyncio.sleep(0)


#: One address to connect to: family, socket type, protocol, socket address.
_Address = tuple[int, int, int, Any]
#: What pooled connections are kept by: TLS, upstream host and port, and the proxy's
#: ``host:port`` (``""``: direct), so a tunnel is reused for its own target only.
_RouteKey = tuple[bool, str, int, str]


def _interleave(addresses: list[_Address]) -> list[_Address]:
    """Alternate the address families, the first family first (RFC 8305 section 4)."""
    by_family: dict[int, list[_Address]] = {}
    for address in addresses:
        by_family.setdefault(address[0], []).append(address)
    queues = list(by_family.values())
    out: list[_Address] = []
    for index in range(max(len(q) for q in queues) if queues else 0):
        out.extend(q[index] for q in queues if index < len(q))
    return out


async def _connect_to(loop: asyncio.AbstractEventLoop, address: _Address) -> socket.socket:
    """A non-blocking socket connected to ``address`` (closed if that fails or is cancelled).

    Raises:
        OSError: the connect failed.
    """
    family, type_, proto, sockaddr = address
    sock = socket.socket(family, type_, proto)
    try:
        sock.setblocking(False)
        await loop.sock_connect(sock, sockaddr)
    except BaseException:
        sock.close()
        raise
    return sock


async def _open_tunnel(
    loop: asyncio.AbstractEventLoop, sock: socket.socket, target: UpstreamTarget, via: ForwardProxy
) -> None:
    """Ask the proxy on ``sock`` for a tunnel to ``target`` (RFC 9110 section 9.3.6).

    Writes ``CONNECT host:port`` (with ``Proxy-Authorization`` when the proxy URL
    has credentials) and reads the answer's head, at most
    :data:`MAX_TUNNEL_HEAD_BYTES`, in as many reads as the proxy takes within the
    connect timeout. Any 2xx opens the tunnel; the proxy's body after another
    status is not read (the socket is closed).

    Raises:
        TunnelFailed: a status other than 2xx (``status`` set), no HTTP answer, a
            close or a reset before the head's end, or bytes after a 2xx head
            (nothing may come before the client's TLS hello).
    """
    authority = target.authority
    lines = [f"CONNECT {authority} HTTP/1.1", f"Host: {authority}", f"User-Agent: {USER_AGENT}"]
    if via.authorization is not None:
        lines.append(f"Proxy-Authorization: {via.authorization}")
    request = ("\r\n".join(lines) + "\r\n\r\n").encode("utf-8", "surrogateescape")
    head = bytearray()
    try:
        await loop.sock_sendall(sock, request)
        # Each read adds at least one byte: the size bound bounds the reads too, and
        # the connect timeout the time (a proxy may write its head line by line).
        for _ in range(MAX_TUNNEL_HEAD_BYTES + 1):
            data = await loop.sock_recv(sock, MAX_TUNNEL_HEAD_BYTES + 1 - len(head))
            if not data:
                break
            head += data
            if b"\r\n\r\n" in head or len(head) > MAX_TUNNEL_HEAD_BYTES:
                break
    except OSError:
        raise TunnelFailed(
            via, authority, None, f"dropped the connection during CONNECT to {authority}"
        ) from None
    status = _tunnel_status(bytes(head[: head.find(b"\r\n")]) if b"\r\n" in head else b"")
    end = head.find(b"\r\n\r\n")
    if status is None or (end < 0 and 200 <= status < 300):
        if not head:
            words = "closed the connection before answering"
        elif status is not None and len(head) > MAX_TUNNEL_HEAD_BYTES:
            words = f"sent an answer head over {MAX_TUNNEL_HEAD_BYTES} bytes to"
        elif status is not None:
            words = "closed the connection in the middle of its answer to"
        else:
            words = "sent no HTTP answer to"
        raise TunnelFailed(via, authority, None, f"{words} CONNECT {authority}")
    if not 200 <= status < 300:
        raise TunnelFailed(
            via, authority, status, f"refused CONNECT to {authority}: {_status_words(status)}"
        )
    if end + 4 != len(head):
        raise TunnelFailed(via, authority, status, f"sent bytes after CONNECT to {authority}")


#: Most bytes of a proxy's answer to ``CONNECT`` read before it is refused.
MAX_TUNNEL_HEAD_BYTES: Final = 16 * 1024


def _tunnel_status(line: bytes) -> int | None:
    """The status of a status line (``HTTP/1.1 200 Connection established``); ``None``
    if it is not one."""
    version, _, rest = line.partition(b" ")
    code = rest[:3]
    if not version.startswith(b"HTTP/1.") or len(code) != 3 or not code.isdigit():
        return None
    return int(code)


def _status_words(status: int) -> str:
    """``407 Proxy Authentication Required``, with what it means for the operator."""
    try:
        phrase = http.HTTPStatus(status).phrase
    except ValueError:
        phrase = "unknown status"
    hint = _TUNNEL_HINTS.get(status, "")
    return f"{status} {phrase}{hint}"


_CREDENTIALS_HINT: Final = (
    " (proxy credentials missing or wrong: the user:password in the proxy URL)"
)
_TUNNEL_HINTS: Final = {
    # 407 is the standard answer; tinyproxy sends 401 to credentials it refuses.
    401: _CREDENTIALS_HINT,
    407: _CREDENTIALS_HINT,
    403: " (the proxy does not allow this host or port)",
}


def _retrieve(task: asyncio.Task[socket.socket]) -> None:
    """Mark an attempt's failure as seen (a loser's error is no news)."""
    if not task.cancelled():
        task.exception()


def _is_ip(host: str) -> bool:
    try:
        ipaddress.ip_address(host)
    except ValueError:
        return False
    return True


def _request_head(
    target: UpstreamTarget, method: str, path: str, fields: Mapping[str, str]
) -> bytes:
    """The request line and header fields, encoded (UTF-8, raw bytes kept by surrogateescape).

    Raises:
        ValueError: a field name or value holds CR or LF (it would split the head).
    """
    lines = [f"{name}: {value}\r\n" for name, value in fields.items()]
    block = "".join(lines)
    # Each line holds exactly one CR and one LF: any more came from a name or a value
    # and would split the head (one count over the block, not four scans a field).
    if block.count("\n") != len(lines) or block.count("\r") != len(lines):
        raise ValueError("a header field holds a line break")
    accept = "" if _has_field(fields, "accept") else "Accept: */*\r\n"
    agent = "" if _has_field(fields, "user-agent") else f"User-Agent: {USER_AGENT}\r\n"
    return (
        f"{method} {path} HTTP/1.1\r\nHost: {target.host_field}\r\n{target.proxy_fields}"
        f"{block}{accept}{agent}"
        f"Accept-Encoding: {ACCEPT_ENCODING}\r\n\r\n"
    ).encode("utf-8", "surrogateescape")


def _has_field(fields: Mapping[str, str], lowered: str) -> bool:
    """Whether ``fields`` has a field named ``lowered`` (lower case), in any case."""
    if isinstance(fields, (CIMultiDict, CIMultiDictProxy)):
        return lowered in fields  # the relay's own: a lookup, case-insensitive
    return any(name.lower() == lowered for name in fields)

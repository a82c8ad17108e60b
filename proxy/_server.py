"""The HTTP server edge: aiohttp's request protocol with a header deadline, and its runner.

aiohttp has no limit on how long a client may take to send request headers: a
client that sends them one byte at a time (slowloris) holds a connection, a
parser buffer and a handler task for as long as it likes. docs/design.md §3:
request headers not complete within ``header_timeout`` seconds → the connection
is closed (there is no request yet to answer).

The deadline is kept by the protocol object of each connection, on every
request of a keep-alive connection:

* it starts when a ``data_received`` call leaves a request's headers
  incomplete while no request is being handled (the first bytes of a request
  that did not arrive in one piece), and stops when the parser emits the
  request;
* headers that arrive whole in one segment (the normal case) never start it:
  no clock read, no timer;
* one timer per connection at most, re-armed lazily like aiohttp's own
  keep-alive timer (a timer that fires early for a later deadline re-arms
  itself), so a connection whose clients are slow on every request still has
  a single timer.

An idle keep-alive connection that has sent no byte of its next request is
aiohttp's keep-alive timeout's business, not this one's.

The same edge answers an ``Expect`` other than ``100-continue`` for every route,
matched or not, through one callback: aiohttp's own answer echoes the value
into its 417 and fails with a 500 when the value is not valid UTF-8.

It also sizes the connection's socket reads (issue 11 item 4). asyncio's
socket transport receives up to 256 KiB per read (``max_size``, a CPython
class attribute with no public setter), and every read costs about four times
its size in transients (the receive buffer, the parser's copy of the body
part, the payload queue, the piece being copied into the body's buffer): a
quarter of a 1 MiB body and more, as freed heap that stays resident. So
between bodies a connection reads :data:`HEAD_READ_BYTES` (a head and a
small body whole), and while a body with a declared length arrives it
reads :func:`proxy._coding.io_piece_bytes` of that length (1/64 of it within
16-256 KiB; the body reader asks the payload for the same size), except that a
body under :data:`SMALL_BODY_BYTES` is read as asyncio would (CPU matters more
there than a few hundred KiB). The size is
set only on a transport whose class has an integer ``max_size`` (CPython's
selector transports); on any other (uvloop's, which reads into one buffer per
loop) reads are left as they are.

And it answers a request aiohttp cannot parse (:meth:`HeaderDeadlineHandler.handle_error`):
aiohttp's own answer is text quoting the parser's message, i.e. request bytes
(a header line with its API key, the tail of a body past a short
``Content-Length``). Ours is a JSON error in the OpenAI shape, the one the
proxy uses when no route is known (nothing of the request is parsed yet), in
our own words.

Two per-connection queues of aiohttp's are made smaller, because an open stream
keeps them for as long as it lasts (docs/design.md §2, "streaming"): the
protocol's queue of parsed requests (:class:`_MessageQueue`) and, once a
request body has been read to its end, that body stream's empty read queue
(:func:`forget_read_queue`). A ``collections.deque`` allocates its first block
with it: ~760 bytes each, where a list takes 56 and an empty tuple nothing.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any, Final

from aiohttp import hdrs, http_exceptions, web
from aiohttp.streams import StreamReader
from aiohttp.web_protocol import RequestHandler

from ._coding import MIN_PIECE_BYTES, io_piece_bytes
from ._protocols import Protocol, error_body

ExpectRefusal = Callable[[web.BaseRequest], Awaitable[web.StreamResponse]]
"""Builds the answer to a request whose ``Expect`` is not ``100-continue`` (e.g. a 417)."""

__all__ = [
    "HEAD_READ_BYTES",
    "MAX_READ_BYTES",
    "SMALL_BODY_BYTES",
    "ExpectRefusal",
    "HeaderDeadlineHandler",
    "ProxyRunner",
    "forget_read_queue",
]

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
(its rest in one read, usually): its transients are small in bytes whatever their
share of it, and reading a 100 KB body 16 KiB at a time cost ~30 % more CPU per
request (seven read cycles instead of two)."""

# What a client is told about a request that could not be parsed, by the parser's
# exception class (most specific first); never the parser's message, which quotes bytes.
_MALFORMED: Final[tuple[tuple[type[Exception], str], ...]] = (
    (http_exceptions.LineTooLong, "a request line or header field is over the size limit"),
    (http_exceptions.InvalidHeader, "malformed header field"),
    (http_exceptions.BadStatusLine, "malformed request line"),
    (http_exceptions.InvalidURLError, "malformed request target"),
)


class _MessageQueue(list[Any]):
    """The connection's parsed requests awaiting the handler, oldest first
    (built from aiohttp's queue, empty at the protocol's construction).

    Replaces aiohttp's ``deque``, which the protocol uses through ``append``,
    ``popleft``, ``len`` and truth only. Requests are handled one at a time and
    aiohttp bounds the pipelined ones (``max_msg_queue_size``), so popping the
    head of a list of a few entries is as cheap, and it costs 56 bytes empty.
    """

    __slots__ = ()

    def popleft(self) -> Any:
        """Remove and return the oldest message (``IndexError`` when empty)."""
        return self.pop(0)


def forget_read_queue(payload: StreamReader) -> None:
    """Let go of ``payload``'s read queue once the body is read to its end.

    aiohttp keeps a request's body stream (and its empty ``deque``) with the
    request and the connection's handler frame until the answer ends, a whole
    stream long. At its end (EOF seen, nothing buffered) nothing is appended to
    the queue any more and every read finds it empty, so an empty tuple serves.
    A stream not at its end is left alone.
    """
    if payload.at_eof():
        payload._buffer = ()  # type: ignore[assignment]  # read-only from here on


class HeaderDeadlineHandler(RequestHandler):
    """aiohttp's ``RequestHandler`` closing connections whose headers miss ``header_timeout``.

    Args:
        header_timeout: seconds from the first incomplete piece of a request's
            headers to their end; past it the transport is closed without an answer.
        on_request_done: called (no arguments) after every answer is finished,
            whatever its route (the app's idle trim, proxy/_alloc.py).
        Everything else is passed to ``RequestHandler``.
    """

    __slots__ = (
        "_body_arriving",
        "_header_deadline",
        "_header_handle",
        "_header_timeout",
        "_on_request_done",
        "_sized_transport",
    )

    def __init__(
        self,
        *args: Any,
        header_timeout: float,
        on_request_done: Callable[[], object] | None = None,
        **kwargs: Any,
    ) -> None:
        super().__init__(*args, **kwargs)
        self._messages = _MessageQueue(self._messages)  # type: ignore[assignment]
        self._header_timeout = header_timeout
        self._on_request_done = on_request_done
        # Loop time by which the current request's headers must be complete; 0 = none pending.
        self._header_deadline = 0.0
        self._header_handle: asyncio.TimerHandle | None = None
        # The transport whose read size this connection sets (None: not settable).
        self._sized_transport: asyncio.Transport | None = None
        # The payload of a declared body still arriving, read in pieces sized for it.
        self._body_arriving: StreamReader | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        """Set up as aiohttp does; reads start at :data:`HEAD_READ_BYTES` where settable."""
        super().connection_made(transport)
        # Only where max_size is the CPython class attribute the read loop uses:
        # an instance attribute then overrides it for this connection alone.
        if isinstance(getattr(type(transport), "max_size", None), int):
            assert isinstance(transport, asyncio.Transport)
            self._sized_transport = transport
            transport.max_size = HEAD_READ_BYTES  # type: ignore[attr-defined]

    def data_received(self, data: bytes) -> None:
        """Parse ``data`` as aiohttp does, then start or stop the header clock and size reads."""
        requests = self._request_count
        super().data_received(data)
        if self._request_count != requests:
            # The parser emitted a request: its headers are complete. A request
            # pipelined behind it that is still incomplete is timed from the
            # next segment that leaves it so.
            self._header_deadline = 0.0
            if self._sized_transport is not None and self._messages:
                self._size_reads_for(*self._messages[-1])
        elif not self._header_deadline and self._waiting_for_headers():
            self._start_header_clock()
        arriving = self._body_arriving
        if arriving is not None and arriving.is_eof():
            # That body is complete: back to head-sized reads for the next request.
            self._body_arriving = None
            self._set_read_size(HEAD_READ_BYTES)

    def _size_reads_for(self, message: Any, payload: Any) -> None:
        """Read the body of ``message`` (just parsed; ``payload`` is its stream) in pieces
        sized for its declared length; a body without one keeps head-sized reads."""
        if not isinstance(payload, StreamReader) or payload.is_eof():
            return
        headers = getattr(message, "headers", None)
        declared = headers.get(hdrs.CONTENT_LENGTH) if headers is not None else None
        if declared is None or not declared.isdigit():
            return
        self._body_arriving = payload
        size = int(declared)
        self._set_read_size(
            MAX_READ_BYTES if size < SMALL_BODY_BYTES else io_piece_bytes(size, MAX_READ_BYTES)
        )

    def _set_read_size(self, nbytes: int) -> None:
        transport = self._sized_transport
        if transport is not None:
            transport.max_size = nbytes  # type: ignore[attr-defined]

    def _waiting_for_headers(self) -> bool:
        """No request is queued or being handled: bytes now are the next request's headers."""
        return (
            not self._request_in_progress
            and not self._messages
            and not self._force_close
            and self.transport is not None
        )

    def _start_header_clock(self) -> None:
        loop = self._loop
        self._header_deadline = loop.time() + self._header_timeout
        if self._header_handle is None:
            self._header_handle = loop.call_at(self._header_deadline, self._on_header_timer)

    def _on_header_timer(self) -> None:
        self._header_handle = None
        deadline = self._header_deadline
        if not deadline:
            return
        if self._loop.time() < deadline:
            # The deadline moved on since this timer was set (a later request).
            self._header_handle = self._loop.call_at(deadline, self._on_header_timer)
            return
        self._header_deadline = 0.0
        if self._waiting_for_headers():
            self.log_debug("request headers not complete within %gs: closing", self._header_timeout)
            self.force_close()

    async def finish_response(
        self, request: web.BaseRequest, resp: web.StreamResponse, start_time: float | None
    ) -> tuple[web.StreamResponse, bool]:
        """Finish the answer as aiohttp does, then call ``on_request_done`` (if any)."""
        try:
            return await super().finish_response(request, resp, start_time)
        finally:
            if self._on_request_done is not None:
                self._on_request_done()

    def handle_error(
        self,
        request: web.BaseRequest,
        status: int = 500,
        exc: BaseException | None = None,
        message: str | None = None,
    ) -> web.StreamResponse:
        """The answer to a request aiohttp could not parse or handle: a JSON error, then close.

        aiohttp calls this with 400 for a request it cannot parse (``exc`` is
        the parser's ``HttpProcessingError``), 500 and 504 for a handler that
        raised or timed out. It logs (the server log's filter in proxy/_app.py
        keeps the bytes out) and raises ``ConnectionError`` when part of an
        answer was already sent, as aiohttp does; the answer has ``status``, an
        OpenAI-shaped JSON error naming the kind of fault (never ``message`` or
        the exception's text: they quote request bytes) and ``Connection: close``.
        """
        # aiohttp's own handling (log, the already-sent check); its text answer is dropped.
        super().handle_error(request, status, exc, message)
        if status == 400:
            code = "malformed_request"
            text = next(
                (words for kind, words in _MALFORMED if isinstance(exc, kind)),
                "malformed HTTP request",
            )
        else:
            code, text = "internal_error", f"internal proxy error (HTTP {status})"
        resp = web.Response(
            status=status,
            body=error_body(Protocol.OPENAI, status, text, code=code),
            content_type="application/json",
            # Said explicitly: aiohttp answers an unparsed request as HTTP/1.0,
            # where it sends no Connection field for a close.
            headers={hdrs.CONNECTION: "close"},
        )
        resp.force_close()
        return resp

    def connection_lost(self, exc: BaseException | None) -> None:
        """Cancel the header timer, then let aiohttp tear the connection down."""
        if self._header_handle is not None:
            self._header_handle.cancel()
            self._header_handle = None
        self._header_deadline = 0.0
        self._sized_transport = None
        self._body_arriving = None
        super().connection_lost(exc)


class _Server(web.Server):
    """``web.Server`` whose connections are :class:`HeaderDeadlineHandler` protocols.

    Requests whose ``Expect`` is not ``100-continue`` go to ``expect_refusal``
    instead of the application (RFC 9110 section 10.1.1: such an expectation may
    be answered 417).
    """

    def __init__(
        self,
        handler: Callable[[web.BaseRequest], Awaitable[web.StreamResponse]],
        *args: Any,
        header_timeout: float,
        expect_refusal: ExpectRefusal | None,
        on_request_done: Callable[[], object] | None = None,
        **kwargs: Any,
    ) -> None:
        def guarded(request: web.BaseRequest) -> Awaitable[web.StreamResponse]:
            # Returns the handler's coroutine instead of awaiting it: a frame of
            # its own would be held for as long as the request runs (a stream).
            expect = request.headers.get(hdrs.EXPECT)
            if expect is not None and expect.strip().lower() != "100-continue":
                assert expect_refusal is not None
                return expect_refusal(request)
            return handler(request)

        super().__init__(handler if expect_refusal is None else guarded, *args, **kwargs)
        self._header_timeout = header_timeout
        self._on_request_done = on_request_done

    def __call__(self) -> RequestHandler:
        return HeaderDeadlineHandler(
            self,
            loop=self._loop,
            header_timeout=self._header_timeout,
            on_request_done=self._on_request_done,
            **self._kwargs,
        )


class ProxyRunner(web.AppRunner):
    """``web.AppRunner`` whose server enforces ``header_timeout`` (seconds) on every request.

    ``expect_refusal`` (optional) answers every request whose ``Expect`` is not
    ``100-continue``, before routing. ``on_request_done`` (optional) is called
    after every answer is finished. Other keyword arguments are ``web.AppRunner``'s.

    Raises:
        ValueError: ``header_timeout`` is not positive.
    """

    __slots__ = ("_expect_refusal", "_header_timeout", "_on_request_done")

    def __init__(
        self,
        app: web.Application,
        *,
        header_timeout: float,
        expect_refusal: ExpectRefusal | None = None,
        on_request_done: Callable[[], object] | None = None,
        **kwargs: Any,
    ) -> None:
        if header_timeout <= 0:
            raise ValueError(f"header_timeout must be > 0 seconds, got {header_timeout}")
        super().__init__(app, **kwargs)
        self._header_timeout = header_timeout
        self._expect_refusal = expect_refusal
        self._on_request_done = on_request_done

    async def _make_server(self) -> web.Server:
        # AppRunner builds the app's server (start-up signals, frozen router);
        # the same server, with the deadline protocol as its connection factory.
        base = await super()._make_server()
        return _Server(
            base.request_handler,
            request_factory=base.request_factory,
            handler_cancellation=base.handler_cancellation,
            header_timeout=self._header_timeout,
            expect_refusal=self._expect_refusal,
            on_request_done=self._on_request_done,
            **base._kwargs,
        )

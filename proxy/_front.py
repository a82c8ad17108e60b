"""The HTTP/1.1 server edge's I/O: the connection driver and the listener.

Replaces aiohttp's server for the proxy (its request handler, router,
middlewares and response classes cost ~120 µs of CPU per request, more than all
of this proxy's own per-request logic). What HTTP/1.1 decides (framing,
keep-alive, pipelining, the linger, the 400 of bad bytes, the one deadline) is
:class:`proxy._http1.ServerConnection`'s; this module moves bytes and runs
handlers:

* :class:`ClientConnection`: one client connection, driving its machine. One request
  is handled at a time, in a task of its own (pipelined requests wait, in order,
  and reading pauses behind a few); a client that hangs up cancels its handler's
  task. One timer per connection, re-armed lazily, at the machine's
  :meth:`~proxy._http1.ServerConnection.next_deadline`: request headers complete
  within ``header_timeout`` seconds of their first piece (docs/design.md §3; a
  slowloris client is closed without an answer), an idle keep-alive connection
  closed after ``keepalive_timeout`` seconds, a linger after
  :data:`proxy._http1.LINGER_TIMEOUT`. A :class:`FlowControl` records why reading
  is paused (a body piled up unread, pipelined requests queued) and whether
  writing is.
* The listener that accepts connections is :mod:`proxy._listener`'s.

A handler gets a :class:`proxy._request.Request` (head, body stream, connection)
and returns an answer: a :class:`proxy._answer.SmallAnswer` (a small, complete
one; it is only a value here, written by :meth:`ClientConnection._write_response`) or
a :class:`proxy._stream_answer.StreamAnswer` it has prepared and written itself.

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
import contextvars
import logging
import typing
from collections.abc import Awaitable, Callable
from typing import Final, cast

from ._answer import SmallAnswer
from ._coding import MIN_PIECE_BYTES, io_piece_bytes
from ._gc import drop_transport_cycle
from ._http1 import (
    END,
    NEED_DATA,
    PAUSED,
    After,
    BadRequest,
    RequestHead,
    Response,
    ServerConnection,
    ServerState,
    closing_answer,
    refusal_status,
)
from ._protocols import Protocol, error_body
from ._request import BodyStream, ClientBodyError, ClientFramingError, Request
from ._stream_answer import StreamAnswer

__all__ = [
    "HEAD_READ_BYTES",
    "MAX_READ_BYTES",
    "SMALL_BODY_BYTES",
    "Answer",
    "BodyStream",
    "ClientBodyError",
    "ClientConnection",
    "ClientFramingError",
    "FlowControl",
    "Handler",
    "Listener",
    "Paused",
    "Request",
    "StreamAnswer",
]

log = logging.getLogger("context_proxy.server")
# The connection timer's context: one shared empty one, not a copy of the arming
# handler's (the copy costs per arm, and would hold the handler's context variables,
# its exchange id, past its end for up to the keep-alive time).
_TIMER_CONTEXT: Final = contextvars.Context()

# Enum members read on every request, as module constants: an Enum class attribute
# is looked up through the enum metaclass's __getattr__ hook, many times a global's cost.
_IDLE: Final = ServerState.IDLE
_IN_HEAD: Final = ServerState.IN_HEAD
_CLOSING: Final = ServerState.CLOSING
_CLOSED: Final = ServerState.CLOSED
_AFTER_NEXT: Final = After.NEXT
_AFTER_WAIT: Final = After.WAIT
_AFTER_LINGER: Final = After.LINGER
_AFTER_REFUSE: Final = After.REFUSE

HEAD_READ_BYTES: Final = MIN_PIECE_BYTES
"""Bytes per socket read while no body with a declared length is arriving (16 KiB), and
per parse while a read holds more than a body's rest (pipelined requests).

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

SEND_TIMEOUT: Final = 60.0
"""Seconds a client may take nothing of what was written to it (its socket full) before the
connection is closed as a hang-up (nginx's ``send_timeout``): a client that stopped reading
without closing would otherwise hold its exchange, its upstream connection and two
descriptors for as long as it lives. A slow reader that takes something within it is waited
for; gaps between the upstream's events do not count (nothing is waiting to be taken)."""

SHED_TIMEOUT: Final = 5.0
"""Seconds a connection accepted from the descriptor reserve may take to send its request
head (and stay idle before it), instead of ``header_timeout`` / ``keepalive_timeout``: the
reserve is a few descriptors, a silent client must not hold one for long."""

Answer = SmallAnswer | StreamAnswer
Handler = Callable[[Request], Awaitable[Answer]]
"""A request handler: the answer to return (a :class:`SmallAnswer`, or a
:class:`StreamAnswer` it has prepared)."""


def _internal_error_answer() -> bytes:
    """The 500 of a handler's bug (OpenAI shape: no route is known here), closing."""
    body = error_body(Protocol.OPENAI, 500, "internal proxy error", code="internal_error")
    return closing_answer(500, body)


class Listener(typing.Protocol):
    """What a connection needs of the listener that accepted it
    (:class:`proxy._listener.FrontServer`; see its arguments)."""

    loop: asyncio.AbstractEventLoop
    clock: Callable[[], float]  # the loop's time (one bound method for every connection)
    handler: Handler
    shed_handler: Handler
    header_timeout: float
    keepalive_timeout: float
    on_request_done: Callable[[], object] | None
    draining: Callable[[], bool]

    def made(self, conn: ClientConnection) -> None:
        """``conn`` has its transport (its ``connection_made``)."""

    def lost(self, conn: ClientConnection) -> None:
        """``conn`` is closed (its ``connection_lost``)."""


# ---------------------------------------------------------------------- flow control


class Paused:
    """Why a connection's reading is paused: the bits of :attr:`FlowControl.reading_paused`
    (plain ints: an ``enum.Flag``'s operators are Python code, on the per-request path)."""

    BODY: Final = 1
    """The request body's unread bytes are over :data:`proxy._request.BODY_HIGH_WATER`."""
    QUEUE: Final = 2
    """Pipelined requests wait behind the one being answered (:data:`proxy._http1.PAUSED`)."""
    ANY: Final = BODY | QUEUE


class FlowControl:
    """Why a connection's transport is paused, both ways, and the one drain waiter.

    Reading pauses on the first reason and resumes when the last one is gone;
    writing is paused between the transport's ``pause_writing`` and
    ``resume_writing`` (its buffer over its high-water mark), and :meth:`drain`
    waits for that.
    """

    __slots__ = ("_drain_waiter", "reading_paused", "transport", "writing_paused")

    def __init__(self) -> None:
        self.transport: asyncio.Transport | None = None
        # The reasons reading is paused, Paused bits (0: it is not); read it, do not set it.
        self.reading_paused = 0
        self.writing_paused = False
        self._drain_waiter: asyncio.Future[None] | None = None

    def pause_reading(self, reason: int) -> None:
        """Add ``reason``; the transport stops reading on the first one."""
        before = self.reading_paused
        if reason & before:
            return
        self.reading_paused = before | reason
        transport = self.transport
        if not before and transport is not None:
            transport.pause_reading()

    def resume_reading(self, reason: int = Paused.ANY) -> None:
        """Drop ``reason`` (default: every reason); the transport reads on without any."""
        before = self.reading_paused
        if not reason & before:
            return
        self.reading_paused = before & ~reason
        transport = self.transport
        if not self.reading_paused and transport is not None and not transport.is_closing():
            transport.resume_reading()

    def pause_writing(self) -> None:
        """The transport's buffer is full (its protocol's ``pause_writing``)."""
        self.writing_paused = True

    def resume_writing(self) -> None:
        """The transport's buffer drained (its protocol's ``resume_writing``)."""
        self.writing_paused = False
        waiter = self._drain_waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    async def drain(self) -> None:
        """Wait until writing is not paused.

        Raises:
            ConnectionResetError: the connection is lost, or is lost meanwhile.
        """
        if not self.writing_paused:
            if self.transport is None:
                raise ConnectionResetError("the client closed the connection")
            return
        waiter = self._drain_waiter = asyncio.get_running_loop().create_future()
        try:
            await waiter
        finally:
            self._drain_waiter = None

    def lost(self) -> None:
        """The connection is gone: a waiting :meth:`drain` raises ``ConnectionResetError``."""
        self.transport = None
        waiter = self._drain_waiter
        if waiter is not None and not waiter.done():
            waiter.set_exception(ConnectionResetError("the client closed the connection"))


# ---------------------------------------------------------------------- connection


class ClientConnection(asyncio.Protocol):
    """One client connection: drives its :class:`~proxy._http1.ServerConnection`, runs
    its requests' handlers one at a time, writes their answers."""

    __slots__ = (
        "__weakref__",
        "_current",
        "_flow",
        "_loop",
        "_parsing",
        "_queue",
        "_server",
        "_sized",
        "_task",
        "_timer",
        "http",
        "shed",
        "transport",
    )

    def __init__(self, server: Listener, *, shed: bool = False) -> None:
        self._server = server
        # Accepted from the descriptor reserve: one answer (a probe's, or a 503), then closed.
        self.shed = shed
        self._loop = server.loop
        self.transport: asyncio.Transport | None = None
        header = server.header_timeout
        self.http = ServerConnection(
            server.clock,
            header_timeout=min(header, SHED_TIMEOUT) if shed else header,
            keepalive_timeout=SHED_TIMEOUT if shed else server.keepalive_timeout,
            slice_bytes=HEAD_READ_BYTES,
            one_answer=shed,
        )
        self._flow = FlowControl()
        # The request whose body is being parsed; the one being handled; those waiting
        # (the machine's pipelined heads, as requests).
        self._parsing: Request | None = None
        self._current: Request | None = None
        self._queue: list[Request] = []
        self._task: asyncio.Task[None] | None = None
        self._timer: asyncio.TimerHandle | None = None
        self._sized = False

    # -- asyncio.Protocol

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # uvloop's transports are not asyncio.Transport subclasses, only alike.
        self.transport = self._flow.transport = transport = cast(asyncio.Transport, transport)
        self._server.made(self)
        # Only where max_size is the CPython class attribute the read loop uses:
        # an instance attribute then overrides it for this connection alone.
        if isinstance(getattr(type(transport), "max_size", None), int):
            self._sized = True
            transport.max_size = HEAD_READ_BYTES  # type: ignore[attr-defined]
        self._arm()

    def data_received(self, data: bytes) -> None:
        http = self.http
        if self.transport is None:
            return
        waiting = http.state is _IDLE
        http.receive_data(data)
        self._pump()
        if waiting and http.state is _IN_HEAD:
            # Headers not complete in this segment: the slowloris clock runs (once per
            # head: later pieces do not push it back).
            self._start_header_clock()

    def _pump(self) -> None:
        """Take the machine's events until it needs data or pauses."""
        http = self.http
        for _ in range(http.pending_bound()):
            event = http.next_event()
            if isinstance(event, bytes):
                assert self._parsing is not None
                self._parsing.content.feed(event)
            elif event is END:
                parsing = self._parsing
                if parsing is not None:  # None: a request without a body (already at EOF)
                    parsing.content.feed_eof()
                    self._parsing = None
                    if self._sized and self.transport is not None:  # _set_read_size, inline
                        self.transport.max_size = HEAD_READ_BYTES  # type: ignore[attr-defined]
            elif isinstance(event, RequestHead):
                self._head(event)
            elif event is NEED_DATA:
                if self._flow.reading_paused & Paused.QUEUE:
                    self._flow.resume_reading(Paused.QUEUE)
                return
            elif event is PAUSED:
                self._flow.pause_reading(Paused.QUEUE)
                return
            elif isinstance(event, BadRequest):
                self._malformed(event.words)
            # Trailers: not relayed (the body reader has no place for them).

    def connection_lost(self, exc: BaseException | None) -> None:
        drop_transport_cycle(self.transport)
        self.transport = None
        self._server.lost(self)
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        self.http.connection_lost()
        gone = ClientBodyError("the client closed the connection")
        for request in (self._parsing, self._current, *self._queue):
            if request is not None:
                request.content.set_exception(gone)
        self._queue = []
        self._parsing = None
        self._flow.lost()
        task = self._task
        if task is not None and not task.done():
            # The client hung up: its handler stops (the upstream request is closed on the way out).
            task.cancel()

    def pause_writing(self) -> None:
        self._flow.pause_writing()

    def resume_writing(self) -> None:
        self._flow.resume_writing()

    # -- writing (the Link of requests and answers)

    @property
    def writing_paused(self) -> bool:
        """The transport's buffer is over its high-water mark."""
        return self._flow.writing_paused

    def write(self, data: bytes) -> None:
        """Hand ``data`` to the transport (dropped once the connection is lost)."""
        transport = self.transport
        # Not after close(): asyncio would still send it (a 500 spliced into a cut answer).
        if transport is not None and not transport.is_closing():
            transport.write(data)

    async def drain(self) -> None:
        """Wait until the client has taken what was written (backpressure).

        Raises:
            ConnectionResetError: the connection was lost meanwhile, or the client took
                nothing for :data:`SEND_TIMEOUT` seconds (it is closed).
        """
        flow = self._flow
        transport = self.transport
        if flow.writing_paused and transport is not None:
            left = transport.get_write_buffer_size() + 1
            # Each pass waits SEND_TIMEOUT at most (a timer only while paused); another
            # only if the client took something meanwhile (the buffer shrank).
            while flow.writing_paused and transport.get_write_buffer_size() < left:
                left = transport.get_write_buffer_size()
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(SEND_TIMEOUT):
                        await flow.drain()
            if flow.writing_paused:
                self.abort()
                raise ConnectionResetError("the client took nothing for too long")
        elif self.transport is None:
            raise ConnectionResetError("the client closed the connection")

    def send_head(self, head: Response) -> bytes:
        """The bytes of an answer's head; a draining server closes the connection after it.

        Raises:
            ValueError: a field holds CR or LF.
        """
        if self._server.draining():
            self.http.close_after_answer()
        return self.http.send(head)

    def close_after_answer(self) -> None:
        """Close the connection once the current answer is out (no keep-alive)."""
        self.http.close_after_answer()

    # -- reading

    def pause_for_body(self) -> None:
        """Unread body bytes piled up: stop reading the socket until they are read."""
        if self.transport is not None:
            self._flow.pause_reading(Paused.BODY)

    def body_drained(self) -> None:
        """The handler caught up with the body: read on."""
        flow = self._flow
        if flow.reading_paused & Paused.BODY:
            flow.resume_reading(Paused.BODY)

    def _set_read_size(self, nbytes: int) -> None:
        transport = self.transport
        if transport is not None:
            transport.max_size = nbytes  # type: ignore[attr-defined]

    def _head(self, head: RequestHead) -> None:
        request = Request(head, self)
        if head.expects_body:
            self._parsing = request
            declared = head.content_length
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

    def _malformed(self, words: str) -> None:
        log.warning("%s: malformed request (%s)", self._peer(), words)
        parsing = self._parsing
        if parsing is not None:
            parsing.content.set_exception(ClientFramingError(words))
            self._parsing = None
        if self.http.state is _CLOSING:  # nothing ahead of the fault to answer
            self._refuse(words)

    def _refuse(self, words: str) -> None:
        status = refusal_status(words)
        code = "malformed_request" if status == 400 else "not_implemented"
        self.write(closing_answer(status, error_body(Protocol.OPENAI, status, words, code=code)))
        self._close()

    def _peer(self) -> str:
        transport = self.transport
        peer = transport.get_extra_info("peername") if transport is not None else None
        return f"{peer[0]}:{peer[1]}" if isinstance(peer, tuple) and len(peer) >= 2 else "client"

    # -- handling

    def _start(self, request: Request) -> None:
        self._current = request
        self._task = self._loop.create_task(self._serve(request))

    async def _serve(self, request: Request) -> None:
        """The request's task: the handler's answer out, then :meth:`_finished` (one
        coroutine a request: the answer is not a coroutine of its own)."""
        server = self._server
        try:
            try:
                answer = await (server.shed_handler if self.shed else server.handler)(request)
            except asyncio.CancelledError as exc:
                self._close()
                # The task keeps the error it ended with, and the traceback every frame
                # the cancel went through, the handler's own task among their locals: a
                # cycle holding the whole exchange until a collection. Re-raised without
                # it, the traceback is this frame alone.
                exc.__traceback__ = None
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
                    self.write(_internal_error_answer())
                # Closed either way: an answer that had begun is cut, not spliced; after a
                # 500 the rest of the request may be unread.
                self._close()
                return
            try:
                if request.answer is not None and answer is not request.answer:
                    # An error answer after a streamed one began: truncated, not spliced.
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
        finally:
            # Every way out: a hang-up (cancelled) and a handler's bug included.
            self._finished(request)

    async def _write_response(self, request: Request, resp: SmallAnswer) -> None:
        if self.transport is None:
            return  # the client hung up as its handler answered (an orderly stop's 503)
        http = self.http
        if resp.close:
            http.close_after_answer()
        body = resp.body
        try:
            head = self.send_head(
                Response(resp.status, resp.headers, length=len(body), reason=resp.reason)
            )
        except ValueError:
            # A field with a line break (a handler's bug): never an answer split in two.
            log.error(
                "%s %s: an answer's header field holds a line break", request.method, request.path
            )
            self.write(_internal_error_answer())
            self._close()
            return
        # No body bytes to a HEAD request or for a 1xx/204/304 (the machine's framing).
        piece = http.send(body)
        http.send(END)
        self.write(head + piece if piece else head)
        await self.drain()

    def _finished(self, request: Request) -> None:
        server = self._server
        self._task = None
        self._current = None
        request.answer = None
        request.content.release()
        request._conn = None
        if server.on_request_done is not None:
            server.on_request_done()
        http = self.http
        transport = self.transport
        if transport is None or transport.is_closing():
            if http.state is not _CLOSED:
                http.close_after_answer()
                http.finish_answer()
            return
        if server.draining():
            http.close_after_answer()
        after = http.finish_answer()
        if after is _AFTER_NEXT:
            self._start(self._queue.pop(0))
            self._pump()  # what waited unparsed behind the full queue, if anything
        elif after is _AFTER_WAIT:
            if http.state is _IN_HEAD:
                self._start_header_clock()
            else:
                self._arm()
        elif after is _AFTER_LINGER:
            # The answer is out, the request body is not: its rest is dropped as it comes,
            # then the connection closes (the client's end, or the linger deadline), so that
            # the client reads the answer first.
            self._parsing = None
            self._queue = []
            self._flow.resume_reading()
            self._arm()
        elif after is _AFTER_REFUSE:
            self._refuse(http.refusal or "malformed HTTP request")
        else:
            self._close()

    def _close(self) -> None:
        transport = self.transport
        if transport is not None and not transport.is_closing():
            transport.close()

    # -- the one timer

    def _start_header_clock(self) -> None:
        """The next request's head came in part: it must be complete within ``header_timeout``."""
        self._arm()

    def _arm(self) -> None:
        """Arm the timer for the machine's deadline (lazily: one armed for a nearer one stays
        and, on firing, re-arms for the deadline then)."""
        deadline = self.http.next_deadline()
        if deadline is None:
            return
        timer = self._timer
        if timer is not None and timer.when() > deadline:
            # Armed for a later deadline (the keep-alive one): a nearer one needs its own.
            timer.cancel()
            timer = None
        if timer is None:
            self._timer = self._loop.call_at(deadline, self._on_timer, context=_TIMER_CONTEXT)

    def _on_timer(self) -> None:
        self._timer = None
        http = self.http
        deadline = http.next_deadline()
        if deadline is None or self.transport is None:
            return
        if self._loop.time() < deadline:
            # The deadline moved on since this timer was set (a later request).
            self._timer = self._loop.call_at(deadline, self._on_timer, context=_TIMER_CONTEXT)
            return
        if http.state is _IN_HEAD:
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

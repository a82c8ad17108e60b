"""HTTP/1.1 connection state machines, sans-I/O: bytes and scalars in, bytes and events out.

No sockets, no event loop, no clock of their own (a caller passes ``now``, in
seconds of any monotonic clock, where a deadline depends on it): the drivers
(:mod:`proxy._upstream` for the client side) own the transport and one timer,
and ask the machine what the bytes mean, what to write, whether the connection
may carry another message and when it must be woken.

Each side's progress is a :class:`ClientState` per direction (ours: what we send,
theirs: what the peer sends), moved only through one transition table; a move
the table does not have raises :class:`StateError` (a bug in the driver, as
h11's ``LocalProtocolError``). The bytes themselves are parsed by llhttp
(``httptools``): status line, fields, chunked and length framing. The limits
llhttp lacks (field line length, field count, head size) are ours.

Errors found in the peer's bytes are events (:class:`Fault`), in our own words,
never the peer's bytes (a header value may hold a secret).
"""

from __future__ import annotations

import enum
from collections.abc import Iterable
from typing import Final, NoReturn

import httptools

__all__ = [
    "CLIENT_KEEPALIVE_TIMEOUT",
    "MAX_FIELDS",
    "MAX_LINE_BYTES",
    "MAX_RESPONSE_HEAD_BYTES",
    "NEED_DATA",
    "ClientConnection",
    "ClientEvent",
    "ClientState",
    "EndOfMessage",
    "Expiry",
    "Fault",
    "Request",
    "ResponseHead",
    "StateError",
    "encode_head",
    "keep_alive_timeout",
]

# ---------------------------------------------------------------- shared

#: Longest header field line accepted (name, ``": "``, value), bytes. The same bound as
#: aiohttp's and nginx's default (8 KiB less the line end).
MAX_LINE_BYTES: Final = 8190
#: Most header fields accepted in one head (and, apart, in one trailer section).
MAX_FIELDS: Final = 128
#: Bytes a response head may take in all, however it is split.
MAX_RESPONSE_HEAD_BYTES: Final = MAX_FIELDS * (MAX_LINE_BYTES + 2)


class StateError(Exception):
    """The caller asked for a move the state it is in does not allow (a driver bug)."""


class ClientState(enum.Enum):
    """Where one direction of a connection is (h11's states, with the client's wait)."""

    #: Ours: no request under way, one may start. Theirs: nothing was asked.
    IDLE = "idle"
    #: Ours: the request head is sent, body bytes follow.
    SEND_BODY = "send body"
    #: Theirs: a request was sent, its final head has not come (1xx answers stay here).
    AWAIT_HEAD = "await head"
    #: Theirs: the final head came, body bytes follow.
    BODY = "body"
    #: This direction's message ended cleanly.
    DONE = "done"
    #: Ours: the request was abandoned part-way (the upload stopped): never reused.
    MUST_CLOSE = "must close"
    #: Theirs: the peer closed the connection.
    CLOSED = "closed"
    #: Theirs: the peer's bytes broke the protocol (a :class:`Fault` said why).
    ERROR = "error"

    # The table is looked up several times a request: hash by identity (in C), not
    # by name (Enum's own __hash__ is Python code); members are singletons anyway.
    __hash__ = object.__hash__


class _Move(enum.Enum):
    """What moves a state (the table's columns)."""

    HEAD_WITH_BODY = "head with body"
    HEAD_ALONE = "head alone"
    BODY = "body"
    END = "end"
    ABANDON = "abandon"
    ASKED = "asked"  # ours sent a head: theirs now awaits the answer
    INTERIM = "interim"
    FINAL = "final"
    PEER_CLOSED = "peer closed"
    FAULT = "fault"
    NEXT = "next"  # both done and kept alive: both start over

    __hash__ = object.__hash__  # as ClientState's


_C = ClientState
_M = _Move
# The members as plain globals for the per-request code: an Enum member read through
# its class costs a metaclass lookup (about 60 ns in CPython 3.11), a global ~5 ns.
_S_IDLE = ClientState.IDLE
_S_SEND_BODY = ClientState.SEND_BODY
_S_AWAIT_HEAD = ClientState.AWAIT_HEAD
_S_BODY = ClientState.BODY
_S_DONE = ClientState.DONE
_S_MUST_CLOSE = ClientState.MUST_CLOSE
_S_CLOSED = ClientState.CLOSED
_S_ERROR = ClientState.ERROR
_M_HEAD_WITH_BODY = _Move.HEAD_WITH_BODY
_M_HEAD_ALONE = _Move.HEAD_ALONE
_M_BODY = _Move.BODY
_M_END = _Move.END
_M_ABANDON = _Move.ABANDON
_M_ASKED = _Move.ASKED
_M_INTERIM = _Move.INTERIM
_M_FINAL = _Move.FINAL
_M_PEER_CLOSED = _Move.PEER_CLOSED
_M_FAULT = _Move.FAULT
_M_NEXT = _Move.NEXT

#: Our (the request's) transitions: (state, move) -> next state.
_OURS: Final[dict[tuple[ClientState, _Move], ClientState]] = {
    (_C.IDLE, _M.HEAD_WITH_BODY): _C.SEND_BODY,
    (_C.IDLE, _M.HEAD_ALONE): _C.DONE,
    (_C.SEND_BODY, _M.BODY): _C.SEND_BODY,
    (_C.SEND_BODY, _M.END): _C.DONE,
    (_C.SEND_BODY, _M.ABANDON): _C.MUST_CLOSE,
    (_C.DONE, _M.NEXT): _C.IDLE,
}

#: Their (the response's) transitions. A close or a fault may come in any state but
#: the last two (an answer may come before the request has been sent in full).
_THEIRS: Final[dict[tuple[ClientState, _Move], ClientState]] = {
    (_C.IDLE, _M.ASKED): _C.AWAIT_HEAD,
    (_C.AWAIT_HEAD, _M.INTERIM): _C.AWAIT_HEAD,
    (_C.AWAIT_HEAD, _M.FINAL): _C.BODY,
    (_C.BODY, _M.END): _C.DONE,
    (_C.DONE, _M.NEXT): _C.IDLE,
    **{(state, _M.PEER_CLOSED): _C.CLOSED for state in (_C.IDLE, _C.AWAIT_HEAD, _C.BODY, _C.DONE)},
    **{(state, _M.FAULT): _C.ERROR for state in (_C.IDLE, _C.AWAIT_HEAD, _C.BODY, _C.DONE)},
}


def _illegal(state: ClientState, move: _Move) -> NoReturn:
    """A move the table has no entry for. (Moves are written ``TABLE.get((state, move))
    or _illegal(state, move)``: a lookup, no call, on the per-request path; states are
    truthy.)"""
    raise StateError(f"cannot {move.value} in state {state.value}")


def encode_head(start_line: str, fields: Iterable[tuple[str, str]]) -> bytes:
    """A message head: ``start_line``, the fields, the blank line; UTF-8 (other bytes kept
    by ``surrogateescape``, as the field parser decodes them).

    Raises:
        ValueError: the start line, a field name or a value holds CR or LF (it would
            split the head: RFC 9112 section 2.2, RFC 9110 section 5.5).
    """
    lines = [f"{name}: {value}\r\n" for name, value in fields]
    block = "".join(lines)
    # Each line holds exactly one CR and one LF: any more came from a name or a value
    # (one count over the block, not four scans a field).
    if (
        block.count("\n") != len(lines)
        or block.count("\r") != len(lines)
        or "\n" in start_line
        or "\r" in start_line
    ):
        raise ValueError("a header field holds a line break")
    return f"{start_line}\r\n{block}\r\n".encode("utf-8", "surrogateescape")


# ---------------------------------------------------------------- client side

#: Seconds an idle kept connection is kept for the next request (aiohttp's default),
#: unless the upstream's ``Keep-Alive: timeout=N`` says less.
CLIENT_KEEPALIVE_TIMEOUT: Final = 15.0


class Request:
    """A request head to send: ``method``, its bytes (``data``, encoded once, so a resend
    costs nothing) and whether it asks to ``close`` the connection after the answer
    (the caller says so, as it wrote the ``Connection`` field; RFC 9112 section 9.6).

    Raises:
        ValueError: a field holds a line break (:func:`encode_head`).
    """

    __slots__ = ("close", "data", "method")

    def __init__(
        self, method: str, target: str, fields: Iterable[tuple[str, str]], *, close: bool = False
    ) -> None:
        self.data = encode_head(f"{method} {target} HTTP/1.1", fields)
        self.method = method
        self.close = close


class ResponseHead:
    """A response head: ``status``, ``fields`` (name, value pairs, as sent, decoded), and
    whether it is ``interim`` (1xx: the final one follows; 101 is a :class:`Fault`)."""

    __slots__ = ("fields", "interim", "status")

    def __init__(self, status: int, fields: list[tuple[str, str]], interim: bool) -> None:
        self.status = status
        self.fields = fields
        self.interim = interim

    def __repr__(self) -> str:
        return f"ResponseHead({self.status}, {len(self.fields)} fields, interim={self.interim})"


class EndOfMessage:
    """The response's body ended; ``trailers`` are a chunked body's trailer fields."""

    __slots__ = ("trailers",)

    def __init__(self, trailers: list[tuple[str, str]]) -> None:
        self.trailers = trailers

    def __repr__(self) -> str:
        return f"EndOfMessage({len(self.trailers)} trailers)"


#: The end of a body without trailers (one object for all: it holds nothing).
_END: Final = EndOfMessage([])


class Fault:
    """The connection's bytes are unusable from here: ``words`` (ours) say why, and
    ``closed`` says the peer closed it (rather than sent something wrong)."""

    __slots__ = ("closed", "words")

    def __init__(self, words: str, *, closed: bool) -> None:
        self.words = words
        self.closed = closed

    def __repr__(self) -> str:
        return f"Fault({self.words!r}, closed={self.closed})"


class _NeedData:
    def __repr__(self) -> str:
        return "NEED_DATA"


#: :meth:`ClientConnection.next_event`'s answer when nothing more can be said yet.
NEED_DATA: Final = _NeedData()

ClientEvent = ResponseHead | bytes | EndOfMessage | Fault


class Expiry(enum.Enum):
    """What a passed :meth:`ClientConnection.next_deadline` means."""

    #: Kept idle for its keep-alive time: close it.
    IDLE = "idle"
    #: A reader waited ``idle_read_s`` seconds for body bytes that did not come.
    READ = "read"


_BYTES_AFTER: Final = "upstream sent bytes after its answer"
_HEAD_UNPARSED: Final = "upstream sent a response head that could not be parsed"
_LINE_LIMIT: Final = (
    f"upstream response headers over the parser's limit ({MAX_LINE_BYTES} bytes a line)"
)
_HEAD_LIMIT: Final = (
    f"upstream response headers over the parser's limit ({MAX_RESPONSE_HEAD_BYTES} bytes in all)"
)


class _Stop(Exception):
    """Raised in a llhttp callback to stop parsing (the fault is queued already)."""


class ClientConnection:
    """The client side of one HTTP/1.1 connection, one request at a time (no pipelining).

    Sending: :meth:`send_head` (a :class:`Request`'s bytes; ``body_bytes`` is the
    length its ``Content-Length`` field declares), :meth:`send_body` for each
    piece the caller writes itself (the bytes go out as they are: the body is
    length-framed), :meth:`send_end`; :meth:`abandon` when the upload stops
    part-way (an answer came first), which rules out reuse.

    Receiving: :meth:`receive_data` with the bytes read (``b""``: the peer
    closed), then :meth:`next_event` until :data:`NEED_DATA`: a
    :class:`ResponseHead` (1xx ones too), body bytes (``bytes``), :class:`EndOfMessage`, or
    a :class:`Fault` after which nothing more comes. A response to ``HEAD`` ends
    at its head; 204, 304 and a length-framed body end at their framing's end; a
    response with neither length nor chunked coding ends when the peer closes
    (RFC 9112 section 6.3). Bytes after a complete answer are a fault (nothing
    was asked). A 101 (protocol switch) is a fault: nothing the proxy sends asks
    for one.

    Reuse: :attr:`reusable` once both messages ended and both sides allow it
    (HTTP/1.1 without ``Connection: close``, or ``keep-alive`` in HTTP/1.0; not
    after ``HEAD``, whose body llhttp would wait for; a ``Keep-Alive: timeout``
    over a second); :meth:`start_next` then starts over.

    Deadlines (seconds, the caller's clock): :meth:`next_deadline` is when the
    caller must call :meth:`expired` next: the keep-alive time of an idle kept
    connection, or ``idle_read_s`` after a reader began to wait
    (:meth:`reader_waits`) for body bytes.

    Limits: a field line over :data:`MAX_LINE_BYTES`, more than
    :data:`MAX_FIELDS` fields, or a head over :data:`MAX_RESPONSE_HEAD_BYTES` is a
    :class:`Fault`; trailer fields are held to the line and count limits.

    Raises (every method that moves a state):
        StateError: the move is not allowed in the current state.
    """

    __slots__ = (
        "_body_bytes",
        "_declared",
        "_events",
        "_fields",
        "_head_bytes",
        "_head_only",
        "_idle_since",
        "_our_close",
        "_parser",
        "_since_field",
        "_waiting_since",
        "buffered_bytes",
        "ended",
        "idle_read_s",
        "keep_alive",
        "keep_alive_s",
        "our_state",
        "status",
        "their_state",
        "until_close",
    )

    def __init__(self, *, idle_read_s: float = float("inf")) -> None:
        self._parser = httptools.HttpResponseParser(self)
        #: Seconds a reader may wait for body bytes (:meth:`reader_waits`).
        self.idle_read_s = idle_read_s
        self.our_state = _S_IDLE
        self.their_state = _S_IDLE
        self._idle_since: float | None = None
        self._reset()

    def _reset(self) -> None:
        self._events: list[ClientEvent | list[bytes]] = []
        #: Body bytes parsed and not yet taken (a reader's backlog: pause reading above
        #: a bound).
        self.buffered_bytes = 0
        self._fields: list[tuple[str, str]] = []
        self._head_bytes = 0
        self._since_field = 0
        self._head_only = False
        self._our_close = False
        self._declared = 0
        self._body_bytes = 0
        self._waiting_since: float | None = None
        #: The final response's status (0 until it came).
        self.status = 0
        #: Whether the response allows reuse (see :attr:`reusable`).
        self.keep_alive = False
        #: Seconds the connection may idle before its next request (the upstream's
        #: ``Keep-Alive: timeout=N`` less a second, at most :data:`CLIENT_KEEPALIVE_TIMEOUT`).
        self.keep_alive_s = CLIENT_KEEPALIVE_TIMEOUT
        #: Whether the response's body ends only with the connection.
        self.until_close = False
        #: Whether the response's end was parsed (its event may not be taken yet).
        self.ended = False

    # ---- sending

    def send_head(self, head: Request, body_bytes: int = 0) -> bytes:
        """The request head's bytes (``body_bytes``: the declared body length, bytes).

        Raises:
            StateError: a request is under way already.
        """
        self.our_state = _OURS.get(
            (self.our_state, _M_HEAD_WITH_BODY if body_bytes else _M_HEAD_ALONE)
        ) or _illegal(self.our_state, _M_HEAD_WITH_BODY if body_bytes else _M_HEAD_ALONE)
        self.their_state = _THEIRS.get((self.their_state, _M_ASKED)) or _illegal(
            self.their_state, _M_ASKED
        )
        self._idle_since = None
        self._head_only = head.method == "HEAD"
        self._declared = body_bytes
        self._our_close = head.close
        # The last answer's Keep-Alive timeout bounded the idle time just ended; this
        # answer says its own (or nothing: the default).
        self.keep_alive_s = CLIENT_KEEPALIVE_TIMEOUT
        return head.data

    def send_body(self, nbytes: int) -> None:
        """``nbytes`` more body bytes went out (written by the caller, unframed).

        Raises:
            StateError: no body is being sent, or this passes the declared length.
        """
        self.our_state = _OURS.get((self.our_state, _M_BODY)) or _illegal(self.our_state, _M_BODY)
        self._body_bytes += nbytes
        if self._body_bytes > self._declared:
            raise StateError(f"body over its declared {self._declared} bytes")

    def send_end(self) -> bytes:
        """The request's end: ``b""`` (a length-framed body needs no more bytes).

        Raises:
            StateError: no body is being sent, or it is short of its declared length.
        """
        if self._body_bytes != self._declared:
            raise StateError(f"body of {self._body_bytes} bytes, {self._declared} declared")
        self.our_state = _OURS.get((self.our_state, _M_END)) or _illegal(self.our_state, _M_END)
        return b""

    def abandon(self) -> None:
        """The upload stopped part-way: the connection must not carry another request."""
        if self.our_state is _S_SEND_BODY:
            self.our_state = _OURS.get((self.our_state, _M_ABANDON)) or _illegal(
                self.our_state, _M_ABANDON
            )

    # ---- receiving

    def receive_data(self, data: bytes) -> None:
        """Parse ``data``, the next bytes read (``b""``: the peer closed). Nothing is
        parsed after a fault or a close."""
        state = self.their_state
        if state is _S_ERROR or state is _S_CLOSED:
            return
        if not data:
            self._peer_closed()
            return
        if state is _S_DONE or state is _S_IDLE:
            self._fault(_BYTES_AFTER, closed=False)
            return
        in_head = state is _S_AWAIT_HEAD
        if in_head:
            self._head_bytes += len(data)
            self._since_field += len(data)
        try:
            self._parser.feed_data(data)
        except httptools.HttpParserUpgrade:
            self._fault("upstream switched protocols", closed=False)
        except httptools.HttpParserCallbackError as exc:
            if self.their_state is not _S_ERROR:  # not a _Stop: a bug of ours
                raise exc.__context__ or exc from None
        except httptools.HttpParserError:
            state = self.their_state
            if state is _S_DONE:
                self._fault(_BYTES_AFTER, closed=False)
            elif state is _S_BODY:
                self._fault("upstream body framing is broken", closed=False)
            elif state is _S_AWAIT_HEAD:
                self._fault(_HEAD_UNPARSED, closed=False)
        if self.their_state is _S_AWAIT_HEAD:
            # One line still growing (llhttp gathers it whole before calling back), or
            # a head growing past its size.
            if self._since_field > 2 * MAX_LINE_BYTES:
                self._fault(_LINE_LIMIT, closed=False)
            elif self._head_bytes > MAX_RESPONSE_HEAD_BYTES:
                self._fault(_HEAD_LIMIT, closed=False)
        if self._events:
            self._waiting_since = None  # the reader has something: its wait ended

    def _peer_closed(self) -> None:
        state = self.their_state
        if state is _S_BODY and self.until_close:
            self._end()
        elif state is _S_AWAIT_HEAD:
            self._fault("upstream closed the connection before answering", closed=True)
            return
        elif state is _S_BODY:
            self._fault("upstream closed the connection mid-answer", closed=True)
            return
        self.their_state = _THEIRS.get((self.their_state, _M_PEER_CLOSED)) or _illegal(
            self.their_state, _M_PEER_CLOSED
        )

    def _fault(self, words: str, *, closed: bool) -> None:
        if self.their_state is _S_ERROR:
            return
        self.their_state = _THEIRS.get((self.their_state, _M_FAULT)) or _illegal(
            self.their_state, _M_FAULT
        )
        self._events.append(Fault(words, closed=closed))

    def _end(self) -> None:
        self.their_state = _THEIRS.get((self.their_state, _M_END)) or _illegal(
            self.their_state, _M_END
        )
        self.ended = True
        fields = self._fields
        if fields:
            self._events.append(EndOfMessage(fields))
            self._fields = []
        else:
            self._events.append(_END)

    def next_event(self) -> ClientEvent | _NeedData:
        """The next event parsed (body pieces parsed since the last one joined into one
        ``bytes``), or :data:`NEED_DATA`."""
        events = self._events
        if not events:
            return NEED_DATA
        event = events.pop(0)
        if isinstance(event, list):
            self.buffered_bytes = 0
            return event[0] if len(event) == 1 else b"".join(event)
        return event

    @property
    def has_events(self) -> bool:
        """Whether :meth:`next_event` has something other than :data:`NEED_DATA`."""
        return bool(self._events)

    @property
    def received_nothing(self) -> bool:
        """Whether not one byte of an answer to this request came (it may be resent)."""
        return self._head_bytes == 0 and self.status == 0

    # ---- reuse and deadlines

    @property
    def reusable(self) -> bool:
        """Whether the connection may carry the next request: both messages ended, every
        body byte was taken (the end itself need not be), and both sides allow it."""
        return (
            self.our_state is _S_DONE
            and self.their_state is _S_DONE
            and self.keep_alive
            and not self._our_close
            and self.keep_alive_s > 0
            and not self.buffered_bytes
        )

    def start_next(self, now: float) -> None:
        """Start over for the next request; ``now`` starts the keep-alive time.

        Raises:
            StateError: the connection is not :attr:`reusable`.
        """
        if not self.reusable:
            raise StateError("the connection is not reusable")
        self.our_state = _OURS.get((self.our_state, _M_NEXT)) or _illegal(self.our_state, _M_NEXT)
        self.their_state = _THEIRS.get((self.their_state, _M_NEXT)) or _illegal(
            self.their_state, _M_NEXT
        )
        keep_alive_s = self.keep_alive_s
        self._reset()
        self.keep_alive_s = keep_alive_s
        self._idle_since = now

    def reader_waits(self, now: float) -> None:
        """A reader waits for body bytes from ``now`` on (until :meth:`receive_data` gives
        it an event): :meth:`next_deadline` is ``idle_read_s`` later."""
        if self._waiting_since is None:
            self._waiting_since = now

    def next_deadline(self) -> float | None:
        """When :meth:`expired` must be asked next (the caller's clock); ``None``: never."""
        if self._idle_since is not None:
            return self._idle_since + self.keep_alive_s
        if self._waiting_since is not None:
            return self._waiting_since + self.idle_read_s
        return None

    def expired(self, now: float) -> Expiry | None:
        """What passed by ``now``: the idle connection's keep-alive time, a reader's wait."""
        deadline = self.next_deadline()
        if deadline is None or now < deadline:
            return None
        if self._idle_since is not None:
            return Expiry.IDLE
        self._waiting_since = None
        return Expiry.READ

    # ---- llhttp callbacks (called by feed_data; an exception stops the parse)

    def on_message_begin(self) -> None:
        if self.their_state is not _S_AWAIT_HEAD:
            # A second answer (or a body after HEAD's head, or after a 204's): nothing
            # asked for it, and the connection cannot be framed any further.
            self._fault(_BYTES_AFTER, closed=False)
            raise _Stop

    def on_header(self, name: bytes, value: bytes) -> None:
        if len(name) + len(value) + 2 > MAX_LINE_BYTES:
            self._fault(_LINE_LIMIT, closed=False)
            raise _Stop
        self._since_field = 0
        fields = self._fields
        if len(fields) >= MAX_FIELDS:
            self._fault(
                "upstream response headers over the parser's limit (too many fields)",
                closed=False,
            )
            raise _Stop
        # As aiohttp's parser decodes them: encode_head turns them back to the same
        # bytes (UTF-8 text stays UTF-8, other bytes survive too).
        fields.append(
            (name.decode("utf-8", "surrogateescape"), value.decode("utf-8", "surrogateescape"))
        )

    def on_headers_complete(self) -> None:
        parser = self._parser
        status = parser.get_status_code()
        fields = self._fields
        self._fields = []
        if status == 101:
            self._fault("upstream switched protocols", closed=False)
            raise _Stop
        if 100 <= status < 200:
            self.their_state = _THEIRS.get((self.their_state, _M_INTERIM)) or _illegal(
                self.their_state, _M_INTERIM
            )
            self._events.append(ResponseHead(status, fields, True))
            return
        self.their_state = _THEIRS.get((self.their_state, _M_FINAL)) or _illegal(
            self.their_state, _M_FINAL
        )
        self.status = status
        self.keep_alive = parser.should_keep_alive()
        chunked = content_length = False
        for name, value in fields:
            lowered = name.lower()
            if lowered == "transfer-encoding":
                # Chunked framing only when chunked is the last coding (RFC 9112 section 6.3).
                chunked = value.rsplit(",", 1)[-1].strip().lower() == "chunked"
            elif lowered == "content-length":
                content_length = True
            elif lowered == "keep-alive":
                self.keep_alive_s = keep_alive_timeout(value)
        self._events.append(ResponseHead(status, fields, False))
        if self._head_only:
            # No body follows, whatever Content-Length says; llhttp would wait for one,
            # so the connection is not reused.
            self.keep_alive = False
            self._end()
        elif status not in (204, 304):
            self.until_close = not (chunked or content_length)
            if self.until_close:
                self.keep_alive = False

    def on_body(self, body: bytes) -> None:
        if self.their_state is not _S_BODY:
            # After a HEAD's head, which llhttp cannot be told has no body.
            self._fault(_BYTES_AFTER, closed=False)
            raise _Stop
        events = self._events
        last = events[-1] if events else None
        if isinstance(last, list):
            last.append(body)
        else:
            events.append([body])
        self.buffered_bytes += len(body)

    def on_message_complete(self) -> None:
        if self.their_state is _S_BODY:
            self._end()


def keep_alive_timeout(value: str) -> float:
    """Seconds to keep an idle connection, from a ``Keep-Alive`` field's ``timeout=N``.

    One second less than the upstream says (its timer and ours start apart), within
    [0, :data:`CLIENT_KEEPALIVE_TIMEOUT`]; :data:`CLIENT_KEEPALIVE_TIMEOUT` when it says nothing
    usable. RFC 2068 section 19.7.1.1 defines the field (Node sends ``timeout=5``).
    """
    for part in value.split(","):
        name, _, number = part.partition("=")
        if name.strip().lower() == "timeout":
            try:
                seconds = float(number.strip().strip('"'))  # a quoted-string is allowed
            except ValueError:
                return CLIENT_KEEPALIVE_TIMEOUT
            return max(0.0, min(CLIENT_KEEPALIVE_TIMEOUT, seconds - 1.0))
    return CLIENT_KEEPALIVE_TIMEOUT

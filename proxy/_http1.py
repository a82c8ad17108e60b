"""HTTP/1.1 without I/O: bytes in, events out; events to send, bytes out.

Nothing here touches a socket, a loop or a clock of its own (the server side is
given one to read): the drivers (:mod:`proxy._front` for the client-facing edge,
:mod:`proxy._upstream` for the upstream one) move the bytes, this module decides.
Three sections:

* **Shared**: the one set of limits (:data:`MAX_LINE_BYTES`, :data:`MAX_FIELDS`,
  :data:`MAX_HEAD_BYTES`, :data:`MAX_RESPONSE_HEAD_BYTES`) and the one head
  serializer, :func:`field_lines`, whose one check keeps a CR or LF in a name or a
  value from splitting a head (RFC 9112 §5: a field line ends at CRLF, so a line
  break inside one would start a field, or a message, of the sender's choosing).
* **Server side**: :class:`RequestFraming` (llhttp through ``httptools`` parses,
  strictly; our own limits on top, since llhttp has none) and
  :class:`ServerConnection`, the connection's state machine: a
  :class:`ServerState` with an explicit transition table (an illegal move raises
  :class:`StateError`, as h11's ``_state.py`` does); :meth:`ServerConnection.receive_data`
  then :meth:`~ServerConnection.next_event` gives a :class:`RequestHead`, body
  pieces (``bytes``), :class:`Trailers`, :data:`END`, a :class:`BadRequest`, or
  :data:`NEED_DATA` / :data:`PAUSED`; :meth:`~ServerConnection.send` turns a
  :class:`Response`, :class:`InformationalResponse`, body bytes or :data:`END`
  into bytes; :meth:`~ServerConnection.finish_answer` says what follows an answer
  (:class:`After`), :meth:`~ServerConnection.next_deadline` when the connection's
  one deadline is. Keep-alive and ``Connection: close`` (RFC 9112 §9.3, §9.6),
  ``Expect: 100-continue`` (RFC 9110 §10.1.1), pipelining (RFC 9112 §9.3.2), the
  linger before a close and protocol upgrades (RFC 9110 §7.8) are decided here.
* **Client side**: :class:`ClientConnection`, an upstream connection's machine, one
  request at a time: per direction a :class:`ClientState` (ours: what we send,
  theirs: what the upstream sends) moved only through the tables
  :data:`CLIENT_OURS` and :data:`CLIENT_THEIRS` (an illegal move raises
  :class:`StateError`); :meth:`~ClientConnection.send_head` turns a
  :class:`Request` into bytes, :meth:`~ClientConnection.receive_data` then
  :meth:`~ClientConnection.next_event` gives a :class:`ResponseHead` (1xx too), body
  ``bytes``, an :class:`EndOfMessage` (trailers) or a :class:`Fault` (our words,
  never the upstream's bytes). Response framing (RFC 9112 §6.3: length, chunked,
  until the close, 204/304/HEAD), reuse (:attr:`~ClientConnection.reusable`, the
  ``Keep-Alive: timeout``) and the connection's deadlines (the idle keep-alive, a
  reader's wait: :meth:`~ClientConnection.next_deadline`) are decided here.
"""

from __future__ import annotations

import collections
import contextlib
import email.utils
import enum
import http
import time
import urllib.parse
from collections.abc import Callable, ItemsView, Iterable, Sequence
from typing import Final, NoReturn

import httptools
from multidict import CIMultiDict, CIMultiDictProxy

__all__ = [
    "CLIENT_KEEPALIVE_TIMEOUT",
    "CLIENT_OURS",
    "CLIENT_THEIRS",
    "END",
    "KEEPALIVE_TIMEOUT",
    "LINGER_TIMEOUT",
    "MAX_FIELDS",
    "MAX_HEAD_BYTES",
    "MAX_LINE_BYTES",
    "MAX_RESPONSE_HEAD_BYTES",
    "NEED_DATA",
    "PAUSED",
    "QUEUED_MAX",
    "UNSUPPORTED_TRANSFER_CODING",
    "After",
    "BadRequest",
    "ClientConnection",
    "ClientEvent",
    "ClientState",
    "EndOfMessage",
    "Expiry",
    "Fault",
    "InformationalResponse",
    "MalformedRequest",
    "Request",
    "RequestFraming",
    "RequestHead",
    "Response",
    "ResponseHead",
    "ServerConnection",
    "ServerState",
    "StateError",
    "Trailers",
    "bodiless",
    "closing_answer",
    "field_lines",
    "keep_alive_timeout",
    "refusal_status",
]


# ====================================================================== Shared

MAX_LINE_BYTES: Final = 8190
"""Longest request target, and longest header field line (name and value), in bytes
(aiohttp's and nginx's default: 8 KiB less the line end)."""

MAX_FIELDS: Final = 128
"""Most header fields in one head (a chunked body's trailer fields count apart)."""

MAX_HEAD_BYTES: Final = 64 * 1024
"""Largest request head in bytes (request line, fields, line ends). llhttp buffers an
unfinished field itself: this bounds what a never-ending line can make it hold."""

MAX_RESPONSE_HEAD_BYTES: Final = MAX_FIELDS * (MAX_LINE_BYTES + 2)
"""Largest response head in bytes an upstream may send, however it is split: as many
fields as :data:`MAX_FIELDS`, each as long as :data:`MAX_LINE_BYTES` (an upstream's
head is trusted further than a client's)."""


_REITERABLE: Final = (list, tuple, ItemsView)
"""Field collections :func:`field_lines` can iterate twice as given (a tuple built
once: ``list | tuple | ItemsView`` in the call built a union each time)."""


def field_lines(fields: Iterable[tuple[str, str]], count: int) -> bytes:
    """``name: value\\r\\n`` for each of ``fields`` (``count`` of them), as one block.

    Names are encoded as latin-1 (they are tokens, RFC 9110 §5.1), values as UTF-8
    with ``surrogateescape`` (a value decoded so from the wire goes back byte for byte).

    Raises:
        ValueError: a name or a value holds CR or LF (RFC 9112 §5: it would end the
            field line early and let the rest of it be read as another field or message).
        UnicodeEncodeError: a name is not latin-1.
    """
    # Iterated twice when not ASCII: a one-pass iterable is made a list first.
    pairs = fields if isinstance(fields, _REITERABLE) else list(fields)
    text = "\r\n".join(map(": ".join, pairs))
    if text:
        text += "\r\n"
    if text.isascii():
        # Nearly always: ASCII is both latin-1 and UTF-8, so one encode does the block.
        block = text.encode("ascii")
    else:
        block = b"".join(
            [
                b"%s: %s\r\n" % (name.encode("latin-1"), value.encode("utf-8", "surrogateescape"))
                for name, value in pairs
            ]
        )
    # Each field line holds exactly one CR and one LF: any more came from a name or
    # a value (one count over the block, not a scan per field).
    if block.count(b"\n") != count or block.count(b"\r") != count:
        raise ValueError("a header field contains CR or LF")
    return block


# ====================================================================== Server side

KEEPALIVE_TIMEOUT: Final = 75.0
"""Seconds an idle keep-alive connection is kept (aiohttp's default, which clients know)."""

LINGER_TIMEOUT: Final = 10.0
"""Seconds a connection closing after an answer keeps reading (and dropping) the rest of an
unread request body (aiohttp's ``lingering_time``): closed at once, the client's bytes still
arriving would be answered with a reset, which loses it the answer (a 413) it has not read yet."""

QUEUED_MAX: Final = 4
"""Pipelined requests parsed ahead of the one being answered before parsing pauses
(:data:`PAUSED`: the driver stops reading; the bytes already read wait unparsed)."""


#: The fault of a request whose ``Transfer-Encoding`` is more than ``chunked``: a 501.
UNSUPPORTED_TRANSFER_CODING: Final = "a transfer coding other than chunked is not implemented"


def _codings(values: list[str]) -> list[str]:
    """The transfer codings named by ``Transfer-Encoding`` values, lowercased, in order."""
    return [c.strip().lower() for value in values for c in value.split(",") if c.strip()]


def refusal_status(words: str) -> int:
    """The status of the answer to a :class:`BadRequest` saying ``words``: 501 for a
    transfer coding the proxy does not implement (RFC 9112 §6.1), else 400."""
    return 501 if words == UNSUPPORTED_TRANSFER_CODING else 400


class MalformedRequest(Exception):
    """The client's bytes are not an HTTP/1.1 request we accept.

    ``str(exc)`` is the proxy's own words for the fault (never the parser's
    message, which quotes request bytes: a header with its API key). ``events``
    are those the same feed completed before the fault (a whole request pipelined
    ahead of the bad bytes is still a request to answer and to commit).
    """

    def __init__(self, words: str, events: list[Event] | None = None) -> None:
        super().__init__(words)
        self.events: list[Event] = events or []


class RequestHead:
    """A parsed request head.

    Attributes:
        method: ``"POST"``, as sent.
        raw_path: the target's path as sent (percent-escapes kept); an
            absolute-form target (``http://host/path``) is reduced to its path.
        path: ``raw_path`` percent-decoded (what routes match on).
        query_string: the target's query as sent, without ``?`` (``""``: none).
        headers: the fields, names case-insensitive, values decoded as UTF-8
            with ``surrogateescape`` (any byte survives a round trip).
        version: ``(1, 1)`` or ``(1, 0)``.
        keep_alive: the client allows the connection to be kept (RFC 9112 §9.3).
        content_length: the declared ``Content-Length`` in bytes, or None.
        chunked: the body is chunked (``Transfer-Encoding``).
        expects_body: a body follows the head (declared or chunked, even empty).
    """

    __slots__ = (
        "chunked",
        "content_length",
        "expects_body",
        "headers",
        "keep_alive",
        "method",
        "path",
        "query_string",
        "raw_path",
        "version",
    )

    def __init__(
        self,
        method: str,
        target: str,
        headers: CIMultiDictProxy[str],
        version: tuple[int, int],
        keep_alive: bool,
        content_length: int | None,
        chunked: bool,
    ) -> None:
        self.method = method
        # An origin-form target starts with "/" (nearly all): no startswith (its argument
        # parsing) for it.
        if target[:1] != "/" and target.startswith(("http://", "https://")):
            # Absolute form (RFC 9112 §3.2.2): the host is not ours to pick.
            parts = urllib.parse.urlsplit(target)
            raw_path, query = parts.path or "/", parts.query
        else:
            raw_path, _, query = target.partition("?")
            if "#" in raw_path:  # never sent by a client, nearly: no partition for nothing
                raw_path, _, _ = raw_path.partition("#")
        self.raw_path = raw_path
        self.path = urllib.parse.unquote(raw_path) if "%" in raw_path else raw_path
        self.query_string = query
        self.headers = headers
        self.version = version
        self.keep_alive = keep_alive
        self.content_length = content_length
        self.chunked = chunked
        self.expects_body = chunked or content_length is not None


class _End:
    __slots__ = ()

    def __repr__(self) -> str:
        return "END"


END: Final = _End()
"""The event after the last body piece of a request (a request without a body too)."""


class Trailers:
    """The trailer fields of a chunked request body (RFC 9112 §7.1.2), before its :data:`END`.

    Attributes:
        fields: ``(name, value)`` pairs as sent (values decoded as a head's are).
    """

    __slots__ = ("fields",)

    def __init__(self, fields: list[tuple[str, str]]) -> None:
        self.fields = fields

    def __repr__(self) -> str:
        return f"Trailers({len(self.fields)} fields)"


Event = RequestHead | bytes | Trailers | _End
"""What :class:`RequestFraming` completes from the bytes it is fed."""


class RequestFraming:
    """Sans-I/O request framing of one connection: :meth:`feed` bytes, get events.

    Events, in order for each request: its :class:`RequestHead`, zero or more
    body pieces (``bytes``, chunked framing removed; content codings left
    alone), its :class:`Trailers` if a chunked body had some, then :data:`END`.
    Pipelined requests follow each other.

    llhttp (``httptools``) parses, strictly: both ``Content-Length`` and
    ``Transfer-Encoding`` (RFC 9112 §6.3), a bad chunk size, a control character
    in a field are faults. Limits of our own (llhttp has none): a request target
    or header field over :data:`MAX_LINE_BYTES`, more than :data:`MAX_FIELDS`
    fields, a head over :data:`MAX_HEAD_BYTES` (a chunked body's trailer fields
    too, and the bytes of chunk framing that bring no body).

    Raises (from :meth:`feed`):
        MalformedRequest: the bytes are not a request we accept; the connection
            must close after answering 400. The events the feed completed before
            the fault are its ``events``.
    """

    __slots__ = (
        "_body_here",
        "_ended_here",
        "_field_bytes",
        "_fields",
        "_head_bytes",
        "_in_message",
        "_parser",
        "_priming",
        "_quiet_bytes",
        "_url",
        "events",
        "in_head",
        "upgraded",
    )

    def __init__(self) -> None:
        self._parser = httptools.HttpRequestParser(self)
        self._url = b""
        self._fields: list[tuple[str, str]] = []
        # Bytes of the current head fed in pieces, and parsed in fields (both bounded).
        self._head_bytes = 0
        self._field_bytes = 0
        # Between a request's first byte and its end.
        self._in_message = False
        # A request ended in the current feed (a head after it began there too).
        self._ended_here = False
        # Body bytes came in the current feed; bytes fed in a body since the last did.
        self._body_here = False
        self._quiet_bytes = 0
        self.events: list[Event] = []
        # Between a request's first byte and the end of its head.
        self.in_head = False
        # The client asked for a protocol upgrade (or CONNECT): nothing after it is parsed.
        self.upgraded = False
        # A fresh parser is fed a head of our own that emits no event (see _reframe).
        self._priming = False

    def feed(self, data: bytes | memoryview) -> list[Event]:
        """Parse ``data``; the events it completed (see the class docstring)."""
        if self.upgraded:
            return []
        # A feed that starts in a head (or between requests) and leaves it incomplete
        # was head bytes whole: llhttp buffers an unfinished field, this bounds it.
        starts_in_head = self.in_head or not self._in_message
        self._ended_here = False
        self._body_here = False
        try:
            try:
                self._parser.feed_data(data)
            except httptools.HttpParserUpgrade as exc:
                rest = data[exc.args[0] :]
                if not self._reframe():
                    raise
                # The rest is the body, then any request pipelined behind it (bounded: each
                # pass consumes at least the head before it).
                while True:
                    try:
                        self._parser.feed_data(rest)
                        break
                    except httptools.HttpParserUpgrade as again:
                        rest = rest[again.args[0] :]
                        if not self._reframe():
                            raise
        except httptools.HttpParserUpgrade:
            # An Upgrade (websocket) or CONNECT without a body: answered as a plain
            # request, then the connection closes (the bytes after it are not HTTP/1.1).
            self.upgraded = True
        except httptools.HttpParserCallbackError as exc:
            cause = exc.__context__
            raise self._fault(
                str(cause) if isinstance(cause, MalformedRequest) else "malformed HTTP request"
            ) from None
        except httptools.HttpParserInvalidMethodError:
            raise self._fault("malformed request line") from None
        except httptools.HttpParserInvalidURLError:
            raise self._fault("malformed request target") from None
        except httptools.HttpParserError:
            raise self._fault("malformed HTTP request") from None
        if self.in_head:
            if starts_in_head and not self._ended_here:
                self._head_bytes += len(data)
            else:
                # The head began behind other requests in this read (pipelined): of its
                # bytes only the parsed ones are known. Its unfinished field is bounded
                # by the read, and the next reads count whole.
                self._head_bytes = self._field_bytes + len(self._url)
            if self._head_bytes > MAX_HEAD_BYTES:
                raise self._fault("the request head is over the size limit")
        elif self._in_message:
            # In a body, reads that bring none of it are chunked framing or trailer
            # fields, which httptools buffers whole (a never-ending trailer line grew
            # without bound: the body reader's idle clock saw nothing come): bounded too.
            self._quiet_bytes = 0 if self._body_here else self._quiet_bytes + len(data)
            if self._quiet_bytes > MAX_HEAD_BYTES:
                raise self._fault("the request's trailer fields are over the size limit")
        events, self.events = self.events, []
        return events

    def close(self) -> None:
        """The connection is gone: nothing more is fed; drops the parser (idempotent).

        The parser keeps this object's bound ``on_*`` callbacks, and this object the
        parser: a reference cycle that only the cyclic collector would free, with
        every object of the connection hanging off it. Dropped, reference counting
        frees the connection the moment it closes.
        """
        with contextlib.suppress(AttributeError):  # closed already
            del self._parser

    def _fault(self, words: str) -> MalformedRequest:
        """The fault ``words``, carrying the events this feed completed before it."""
        events, self.events = self.events, []
        return MalformedRequest(words, events)

    def _reframe(self) -> bool:
        """Ignore the Upgrade of a request with a body (RFC 9110 §7.8: a server may);
        whether it did.

        curl ``--http2`` and Java's HttpClient ask for h2c on a POST and send its body
        at once. httptools has skipped that body (llhttp says "upgrade" at the end of
        the head) and ended the message: its END goes, and a fresh parser frames the
        body, primed with a head of the same framing that emits no event.
        """
        events = self.events
        if len(events) < 2 or events[-1] is not END:
            return False
        head = events[-2]
        if not isinstance(head, RequestHead) or not head.expects_body or head.method == "CONNECT":
            return False
        del events[-1]
        framing = (
            b"Transfer-Encoding: chunked"
            if head.chunked
            else b"Content-Length: %d" % (head.content_length or 0)
        )
        self._parser = httptools.HttpRequestParser(self)
        self._priming = True
        self._parser.feed_data(b"POST / HTTP/1.1\r\n%s\r\n\r\n" % framing)
        return True

    # llhttp callbacks (httptools calls them by name during feed_data)

    def on_message_begin(self) -> None:
        self.in_head = True
        self._in_message = True
        self._field_bytes = 0
        self._url = b""
        self._fields = []

    def on_url(self, url: bytes) -> None:
        self._url += url
        if len(self._url) > MAX_LINE_BYTES:
            raise MalformedRequest("a request line or header field is over the size limit")

    def on_header(self, name: bytes, value: bytes) -> None:
        # Called once a field: the three limits are tested in one condition, and only a
        # field over one of them goes on to _over_limit, which says which (in this order).
        size = len(name) + len(value)
        fields = self._fields
        # A head parsed in one feed is counted here (the feed count sees unfinished ones).
        field_bytes = self._field_bytes = self._field_bytes + size + 4
        if size > MAX_LINE_BYTES or len(fields) >= MAX_FIELDS or field_bytes > MAX_HEAD_BYTES:
            self._over_limit(size, len(fields))
        # Values as UTF-8 with surrogateescape: any byte survives the round trip upstream.
        fields.append((name.decode("latin-1"), value.decode("utf-8", "surrogateescape")))

    def _over_limit(self, size: int, count: int) -> NoReturn:
        """The fault of a header field of ``size`` bytes after ``count`` fields, one of
        :meth:`on_header`'s limits passed."""
        if size > MAX_LINE_BYTES:
            raise MalformedRequest("a request line or header field is over the size limit")
        if count >= MAX_FIELDS:
            raise MalformedRequest("too many header fields")
        raise MalformedRequest("the request head is over the size limit")

    def on_headers_complete(self) -> None:
        if self._priming:  # our own head (_reframe): the body that follows is the request's
            self._priming = False
            self._fields = []
            self._url = b""
            self.in_head = False
            return
        parser = self._parser
        headers = CIMultiDictProxy(CIMultiDict(self._fields))
        self._fields = []
        self._head_bytes = 0
        version = parser.get_http_version()
        hosts = headers.getall("Host", ())
        if len(hosts) != 1:  # one lookup for both rules, the usual one Host passes it
            if not hosts and version != "1.0":
                # RFC 9112 §3.2: a server MUST answer 400 to an HTTP/1.1 request without Host.
                raise MalformedRequest("an HTTP/1.1 request without a Host field")
            if hosts:
                # RFC 9112 §3.2: a request with more than one Host field is answered 400.
                raise MalformedRequest("a request with more than one Host field")
        declared = headers.get("Content-Length")
        chunked = "Transfer-Encoding" in headers
        if chunked:
            if _codings(headers.getall("Transfer-Encoding")) != ["chunked"]:
                # RFC 9112 §6.1: a transfer coding the server does not implement is a 501,
                # and the body cannot be framed, so the connection closes after it.
                raise MalformedRequest(UNSUPPORTED_TRANSFER_CODING)
            declared = None
        self.events.append(
            RequestHead(
                parser.get_method().decode("ascii"),
                self._url.decode("utf-8", "surrogateescape"),
                headers,
                (1, 0) if version == "1.0" else (1, 1),
                parser.should_keep_alive(),
                # llhttp has checked it: digits only, one value, not with chunked.
                None if declared is None else int(declared),
                chunked,
            )
        )
        self._url = b""
        self.in_head = False

    def on_body(self, body: bytes) -> None:
        self._body_here = True
        self.events.append(body)

    def on_message_complete(self) -> None:
        self._in_message = False
        self._ended_here = True
        self._quiet_bytes = 0
        if self._fields:  # fields after the head's end: a chunked body's trailers
            self.events.append(Trailers(self._fields))
            self._fields = []
        self.events.append(END)


class BadRequest:
    """The client's bytes stopped being a request we accept: the last event of the connection.

    The events before it (whole requests pipelined ahead of the bad bytes) are still
    requests to answer, in order; the 400 (:func:`closing_answer`) follows them.

    Attributes:
        words: the proxy's own words for the fault (never the client's bytes: a
            header can hold an API key).
    """

    __slots__ = ("words",)

    def __init__(self, words: str) -> None:
        self.words = words

    def __repr__(self) -> str:
        return f"BadRequest({self.words!r})"


class _Signal:
    """A :meth:`ServerConnection.next_event` answer that is no event: nothing more to give."""

    __slots__ = ("_name",)

    def __init__(self, name: str) -> None:
        self._name = name

    def __repr__(self) -> str:
        return self._name


NEED_DATA: Final = _Signal("NEED_DATA")
"""No event until more bytes are received (every byte so far is parsed, or dropped)."""

PAUSED: Final = _Signal("PAUSED")
"""No event until an answer finishes: :data:`QUEUED_MAX` requests wait behind the one
being answered. The driver stops reading; bytes received meanwhile are kept unparsed."""

ServerEvent = RequestHead | bytes | Trailers | _End | BadRequest | _Signal
"""What :meth:`ServerConnection.next_event` returns."""


class Response:
    """An answer's head, to :meth:`ServerConnection.send`.

    Args:
        status: the HTTP status (a 1xx other than through
            :class:`InformationalResponse` is not sent).
        headers: end-to-end fields; no framing or ``Connection`` field (those are
            the machine's).
        length: the body's length in bytes, stated as ``Content-Length`` (to a
            ``HEAD`` request too: the length a ``GET`` would get, RFC 9110 §9.3.2,
            and no body is sent); None: not known when the head leaves (chunked to
            an HTTP/1.1 client, the connection's end to an HTTP/1.0 one; no framing
            field for a ``HEAD`` request).
        reason: the reason phrase; None: the status's standard one.
    """

    __slots__ = ("headers", "length", "reason", "status")

    def __init__(
        self,
        status: int,
        headers: CIMultiDict[str] | CIMultiDictProxy[str],
        *,
        length: int | None = None,
        reason: str | None = None,
    ) -> None:
        self.status = status
        self.headers = headers
        self.length = length
        self.reason = reason


class InformationalResponse:
    """``100 Continue`` (RFC 9110 §15.2.1), to :meth:`ServerConnection.send` before the
    final answer: the client may send the body it held back on ``Expect: 100-continue``."""

    __slots__ = ()


class StateError(Exception):
    """A move the connection's state does not allow (the driver's bug, not the client's)."""


class ServerState(enum.Enum):
    """Where a client connection is in its request cycle (see :data:`SERVER_TRANSITIONS`)."""

    # Members are singletons: identity is equality, and hashing by it keeps the table's
    # lookups in C (Enum's own __hash__ is Python code, a few of them per request).
    __hash__ = object.__hash__

    IDLE = "idle"
    """No request being answered and none begun: the keep-alive clock runs."""
    IN_HEAD = "in head"
    """No request being answered, a head begun: the header clock runs (slowloris)."""
    RESPONSE = "response"
    """A request is being answered; its head not sent yet."""
    SEND_BODY = "send body"
    """The answer's head is sent; its body goes on."""
    DONE = "done"
    """The answer's end is sent; :meth:`ServerConnection.finish_answer` comes next."""
    LINGERING = "lingering"
    """The last answer is out, the request body is not: its rest is read and dropped."""
    CLOSING = "closing"
    """Nothing more is read or answered: the driver closes the connection."""
    CLOSED = "closed"
    """The connection is gone."""


_S = ServerState
# The members as module constants: a hot path reads a global, not an Enum class
# attribute (a lookup through the enum's metaclass, several times dearer).
_IDLE: Final = _S.IDLE
_IN_HEAD: Final = _S.IN_HEAD
_RESPONSE: Final = _S.RESPONSE
_SEND_BODY: Final = _S.SEND_BODY
_DONE: Final = _S.DONE
_LINGERING: Final = _S.LINGERING
_CLOSING: Final = _S.CLOSING
_CLOSED: Final = _S.CLOSED
_ANSWERING: Final = frozenset({_S.RESPONSE, _S.SEND_BODY, _S.DONE})
_READING: Final = frozenset({_S.IDLE, _S.IN_HEAD} | _ANSWERING)
_AFTER_ANSWER: Final = frozenset({_S.IDLE, _S.IN_HEAD, _S.RESPONSE, _S.LINGERING, _S.CLOSING})

SERVER_TRANSITIONS: Final[dict[ServerState, frozenset[ServerState]]] = {
    _S.IDLE: frozenset({_S.IN_HEAD, _S.RESPONSE, _S.CLOSING, _S.CLOSED}),
    _S.IN_HEAD: frozenset({_S.RESPONSE, _S.CLOSING, _S.CLOSED}),
    _S.RESPONSE: frozenset({_S.SEND_BODY, _S.CLOSED} | _AFTER_ANSWER),
    _S.SEND_BODY: frozenset({_S.DONE, _S.CLOSED} | _AFTER_ANSWER),
    _S.DONE: frozenset({_S.CLOSED} | _AFTER_ANSWER),
    _S.LINGERING: frozenset({_S.CLOSING, _S.CLOSED}),
    _S.CLOSING: frozenset({_S.CLOSED}),
    _S.CLOSED: frozenset(),
}
"""Each state's legal next states; any other move raises :class:`StateError`.

An answer's end goes to IDLE/IN_HEAD (kept alive), RESPONSE (the next pipelined
request), LINGERING or CLOSING; RESPONSE -> RESPONSE is that too (an answer that
ended without a head: the handler's bug, closed or not by the driver)."""


class After(enum.Enum):
    """What the driver does once an answer is finished (:meth:`ServerConnection.finish_answer`)."""

    NEXT = "next"
    """Answer the next pipelined request (already parsed)."""
    WAIT = "wait"
    """Keep the connection and wait for a request (see :meth:`ServerConnection.next_deadline`)."""
    LINGER = "linger"
    """Keep reading and dropping the unread request body until the client's end or the
    linger deadline, then close: a client still sending reads the answer first."""
    CLOSE = "close"
    """Close the connection."""
    REFUSE = "refuse"
    """Send the 400 of the :class:`BadRequest` (:func:`closing_answer`), then close."""


_AFTER_NEXT: Final = After.NEXT
_AFTER_WAIT: Final = After.WAIT
_AFTER_LINGER: Final = After.LINGER
_AFTER_CLOSE: Final = After.CLOSE
_AFTER_REFUSE: Final = After.REFUSE


_STATUS_LINES: Final = {
    s.value: b"HTTP/1.1 %d %s\r\n" % (s.value, s.phrase.encode("latin-1", "replace"))
    for s in http.HTTPStatus
}
"""The status line of each known status with its standard reason phrase, built once."""

_CONTINUE: Final = b"HTTP/1.1 100 Continue\r\n\r\n"


class _DateLine:
    """``Date: ...\\r\\n`` (RFC 9110 §6.6.1), formatted once a second (its resolution)."""

    __slots__ = ("_line", "_second")

    def __init__(self) -> None:
        self._second = 0
        self._line = b""

    def line(self) -> bytes:
        now = int(time.time())
        if now != self._second:
            self._second = now
            self._line = b"Date: %s\r\n" % email.utils.formatdate(now, usegmt=True).encode()
        return self._line


_DATE: Final = _DateLine()


def bodiless(status: int) -> bool:
    """RFC 9110 §6.4.1: 1xx, 204 and 304 answers have no content (and no framing field)."""
    return status < 200 or status in (204, 304)


def answer_head(
    status: int,
    reason: str | None,
    headers: CIMultiDict[str] | CIMultiDictProxy[str],
    framing: bytes,
) -> bytes:
    """An answer's status line and fields, a ``Date`` unless ``headers`` has one, then
    ``framing`` (our own framing and ``Connection`` lines) and the blank line.

    Raises:
        ValueError: a field name or value contains CR or LF (see :func:`field_lines`).
    """
    line = _STATUS_LINES.get(status) if reason is None else None
    if line is None:
        line = b"HTTP/1.1 %d %s\r\n" % (status, (reason or "").encode("latin-1", "replace"))
    fields = field_lines(headers.items(), len(headers))
    date = b"" if "Date" in headers else _DATE.line()
    return b"%s%s%s%s\r\n" % (line, fields, date, framing)


def closing_answer(status: int, body: bytes) -> bytes:
    """A whole JSON answer that closes the connection (a 400 for bad bytes, a handler's
    500): written outside the request cycle, the connection's last bytes."""
    return (
        answer_head(
            status,
            None,
            CIMultiDict({"Content-Type": "application/json"}),
            b"Content-Length: %d\r\nConnection: close\r\n" % len(body),
        )
        + body
    )


class ServerConnection:
    """One client connection's HTTP/1.1 state (RFC 9112), without I/O.

    Feed it what the socket reads (:meth:`receive_data`), then take events
    (:meth:`next_event`) until :data:`NEED_DATA` or :data:`PAUSED`. Requests are
    answered one at a time, in order (RFC 9112 §9.3.2): the first
    :class:`RequestHead` starts an answer (state RESPONSE); :meth:`send` gives the
    bytes of its head, body and end; :meth:`finish_answer` ends it and says what
    follows. Heads parsed meanwhile are pipelined requests, answered next; past
    :data:`QUEUED_MAX` of them parsing pauses.

    Decided here: whether the connection is kept after an answer (RFC 9112 §9.3:
    not after an HTTP/1.0 request, a ``Connection: close``, an upgrade or CONNECT
    request, a body not received whole, :meth:`close_after_answer`, or the one
    answer of a ``one_answer`` connection), the ``Connection: close`` that says so
    (RFC 9112 §9.6), the answer's framing, the ``100 Continue`` (never to an
    HTTP/1.0 client, RFC 9110 §10.1.1), a linger after an answer sent before the
    request body was read, and the one deadline (:meth:`next_deadline`).

    Args:
        clock: the driver's clock, in seconds (the loop's ``time``); read only
            when a deadline starts.
        header_timeout: seconds a request head may take from its first piece.
        keepalive_timeout: seconds an idle connection is kept (from its start or
            the end of its last answer).
        slice_bytes: bytes parsed at a time when a read holds more than a body's
            rest (many pipelined requests stop being parsed behind a full queue).
        one_answer: close after the first answer (a connection accepted from the
            descriptor reserve).

    Raises:
        StateError: from any method, a move the current state does not allow.
    """

    __slots__ = (
        "_ahead",
        "_body_left",
        "_broken",
        "_chunked",
        "_clock",
        "_events",
        "_framing",
        "_header_timeout",
        "_held",
        "_keepalive_timeout",
        "_must_close",
        "_next",
        "_no_body",
        "_since",
        "_slice_bytes",
        "_unended",
        "state",
    )

    def __init__(
        self,
        clock: Callable[[], float],
        *,
        header_timeout: float,
        keepalive_timeout: float = KEEPALIVE_TIMEOUT,
        slice_bytes: int = 16 * 1024,
        one_answer: bool = False,
    ) -> None:
        self._clock = clock
        self._header_timeout = header_timeout
        self._keepalive_timeout = keepalive_timeout
        self._slice_bytes = slice_bytes
        self._framing = RequestFraming()
        # The current state (read it; only the machine's moves change it).
        self.state = _IDLE
        self._since = clock()
        # Heads taken and not answered yet: [0] is the one being answered, the rest wait.
        self._ahead: collections.deque[RequestHead] = collections.deque()
        # The last head taken whose END is not taken yet (its body is arriving).
        self._unended: RequestHead | None = None
        # Declared body bytes of _unended not parsed yet (sizes the parse slices).
        self._body_left = 0
        # Events parsed and not taken yet, from _next on.
        self._events: Sequence[Event | BadRequest] = ()
        self._next = 0
        # Bytes received and not parsed yet (parsing paused, or parsed a slice at a time).
        self._held: bytes | memoryview = b""
        # The words of a BadRequest parsed: nothing after it is parsed.
        self._broken: str | None = None
        self._must_close = one_answer
        # The answer being sent: chunked framing; no body bytes go out.
        self._chunked = False
        self._no_body = False

    # -- state

    def _set(self, new: ServerState) -> None:
        if new not in SERVER_TRANSITIONS[self.state]:
            raise StateError(f"{self.state.value} -> {new.value} is not a legal move")
        if new is _IDLE or new is _IN_HEAD or new is _LINGERING:
            self._since = self._clock()
        self.state = new

    @property
    def current(self) -> RequestHead | None:
        """The head of the request being answered, if one is."""
        return self._ahead[0] if self.state in _ANSWERING else None

    @property
    def body_left(self) -> int:
        """Declared body bytes of the request being received not received yet."""
        return self._body_left

    @property
    def refusal(self) -> str | None:
        """The words of the :class:`BadRequest` parsed, if one was (its 400 says them)."""
        return self._broken

    def pending_bound(self) -> int:
        """An upper bound on the events :meth:`next_event` can give before :data:`NEED_DATA`
        or :data:`PAUSED` (a driver's loop bound): those parsed, two a byte held (a head
        and its end take more bytes than that; a body piece at least one), and two more."""
        return len(self._events) - self._next + 2 * len(self._held) + 2

    def next_deadline(self) -> float | None:
        """When (``clock`` seconds) the connection is closed unless something happens
        first; None: no deadline (an answer is being sent, or the connection closes).

        IDLE: ``keepalive_timeout`` after it became idle; IN_HEAD: ``header_timeout``
        after the head began (later pieces do not push it back); LINGERING:
        :data:`LINGER_TIMEOUT` after the answer.
        """
        state = self.state
        if state is _IDLE:
            return self._since + self._keepalive_timeout
        if state is _IN_HEAD:
            return self._since + self._header_timeout
        if state is _LINGERING:
            return self._since + LINGER_TIMEOUT
        return None

    # -- receiving

    def receive_data(self, data: bytes) -> None:
        """Bytes read from the client (parsed by :meth:`next_event`).

        Dropped while lingering, closing, or after a :class:`BadRequest`.

        Raises:
            StateError: the connection is closed.
        """
        state = self.state
        if state is _CLOSED:
            raise StateError("bytes received on a closed connection")
        if self._broken is not None or state is _LINGERING or state is _CLOSING:
            return
        held = self._held
        self._held = bytes(held) + data if held else data

    def next_event(self) -> ServerEvent:
        """The next event (see the class docstring), or :data:`NEED_DATA` / :data:`PAUSED`.

        A :class:`BadRequest` taken while no request is being answered moves the
        connection to CLOSING (the driver sends its 400 and closes); taken while one
        is, the 400 follows the requests ahead of it (:meth:`finish_answer`).
        """
        index = self._next
        events = self._events
        if index >= len(events):
            signal = self._parse_more()
            if signal is not None:
                return signal
            events = self._events
            index = 0
        self._next = index + 1
        event = events[index]
        # What the event changes (inline: the hot path is a few events a request).
        if isinstance(event, bytes):
            self._body_left -= len(event)
        elif event is END:
            self._unended = None
            self._body_left = 0
        elif isinstance(event, RequestHead):
            self._ahead.append(event)
            if event.expects_body:
                self._unended = event
                self._body_left = event.content_length or 0
            state = self.state
            if state is _IDLE or state is _IN_HEAD:
                self.state = _RESPONSE  # a move the table allows from both
        elif isinstance(event, BadRequest):
            self._broken = event.words
            self._held = b""
            if self.state not in _ANSWERING:
                self._set(_CLOSING)
        return event

    def _parse_more(self) -> _Signal | None:
        """Every parsed event is taken (their bytes go): parse on. None: new events are in
        :attr:`_events`; else :data:`NEED_DATA` or :data:`PAUSED`."""
        self._events = ()
        self._next = 0
        held = self._held
        if not held:  # the usual end of a read: nothing left to parse
            if len(self._ahead) > QUEUED_MAX and self._broken is None and self.state in _ANSWERING:
                return PAUSED
            if self.state is _IDLE and self._framing.in_head:
                self._set(_IN_HEAD)  # a head begun while idle: its clock starts
            return NEED_DATA
        # Bounded: each pass parses at least a slice of what is held.
        for _ in range(len(held) // self._slice_bytes + 1):
            if self._broken is not None or self.state not in _READING:
                return NEED_DATA
            if len(self._ahead) > QUEUED_MAX:
                return PAUSED
            if not self._held:
                break
            self._parse_slice()
            if self._events:
                return None
        if self.state is _IDLE and self._framing.in_head:
            self._set(_IN_HEAD)  # a head begun while idle: its clock starts
        return NEED_DATA

    def _parse_slice(self) -> None:
        """Parse what is held: a declared body's rest in one piece (one body event), the
        rest :attr:`_slice_bytes` at a time."""
        held = self._held
        left, end = self._body_left, self._slice_bytes
        if left > end:
            end = left
        if end >= len(held):
            piece, self._held = held, b""
        else:
            view = held if isinstance(held, memoryview) else memoryview(held)
            piece, self._held = view[:end], view[end:]
        framing = self._framing
        try:
            self._events = framing.feed(piece)
        except MalformedRequest as exc:
            # What came before the fault is answered first: a whole request ahead of
            # the bad bytes is answered (and committed) before the 400 that closes.
            self._events = [*exc.events, BadRequest(str(exc))]
            self._held = b""
        if framing.upgraded:
            # The bytes after an Upgrade or CONNECT head are not HTTP/1.1: the request
            # is answered as a plain one, then the connection closes.
            self._must_close = True
            self._held = b""

    # -- sending

    def close_after_answer(self) -> None:
        """Close the connection once the current answer is out (no keep-alive)."""
        self._must_close = True

    def will_close(self) -> bool:
        """Whether the connection closes after the current answer (see the class docstring)."""
        if self._must_close:
            return True
        head = self._ahead[0] if self._ahead and self.state in _ANSWERING else None
        return (
            head is None or not head.keep_alive or head.version < (1, 1) or (head is self._unended)
        )

    def send(self, event: Response | InformationalResponse | bytes | _End) -> bytes:
        """The bytes of ``event`` for the request being answered.

        A :class:`Response` (state RESPONSE -> SEND_BODY) gets its framing: none for
        a 1xx/204/304 status (RFC 9110 §6.4.1), ``Content-Length`` for a known
        length, else no framing field for ``HEAD``, ``Transfer-Encoding: chunked``
        to an HTTP/1.1 client (RFC 9112 §7.1), or the connection's end to an
        HTTP/1.0 one (RFC 9112 §6.3, then it closes); and ``Connection: close`` when
        the connection closes after it. Body bytes (SEND_BODY) are framed as the head
        said (nothing for an answer without content; an empty piece is nothing, never
        the chunked end); :data:`END` (SEND_BODY -> DONE) is the chunked last chunk.
        An :class:`InformationalResponse` (RESPONSE) is ``100 Continue``, or nothing
        to an HTTP/1.0 client.

        Raises:
            StateError: the state does not allow ``event``.
            ValueError: a field of a :class:`Response` holds CR or LF (the state stays
                RESPONSE: another answer, a 500, may be sent instead).
        """
        state = self.state
        if isinstance(event, bytes):
            if state is not _SEND_BODY:
                raise StateError(f"body bytes sent in state {state.value}")
            if self._no_body or not event:
                return b""
            if self._chunked:
                return b"%x\r\n%s\r\n" % (len(event), event)
            return event
        if event is END:
            if state is not _SEND_BODY:
                raise StateError(f"the end of an answer sent in state {state.value}")
            self.state = _DONE  # the table's one move from SEND_BODY but CLOSED
            return b"0\r\n\r\n" if self._chunked and not self._no_body else b""
        if state is not _RESPONSE:
            raise StateError(f"{type(event).__name__} sent in state {state.value}")
        head = self._ahead[0]
        if isinstance(event, InformationalResponse):
            return _CONTINUE if head.version >= (1, 1) else b""
        assert isinstance(event, Response)  # bytes and END are handled above
        status, length = event.status, event.length
        empty = status < 200 or status == 204 or status == 304  # bodiless(), inline
        no_body = empty or head.method == "HEAD"
        chunked = False
        if empty:
            framing = b""
        elif length is not None:
            framing = b"Content-Length: %d\r\n" % length
        elif no_body:
            framing = b""
        elif head.version >= (1, 1):
            chunked = True
            framing = b"Transfer-Encoding: chunked\r\n"
        else:
            self._must_close = True
            framing = b""
        if (
            self._must_close
            or not head.keep_alive
            or head.version < (1, 1)
            or head is self._unended
        ):  # will_close(), inline
            framing += b"Connection: close\r\n"
        out = answer_head(status, event.reason, event.headers, framing)
        self._chunked, self._no_body = chunked, no_body
        self.state = _SEND_BODY  # checked above: RESPONSE
        return out

    def finish_answer(self) -> After:
        """The current answer is over (sent whole, or not: the driver closes then); what next.

        Raises:
            StateError: no answer is in progress.
        """
        if self.state not in _ANSWERING:
            raise StateError(f"no answer to finish in state {self.state.value}")
        head = self._ahead.popleft()
        # will_close(), inline (its head is the one being answered: state is _ANSWERING).
        close = (
            self._must_close
            or not head.keep_alive
            or head.version < (1, 1)
            or head is self._unended
        )
        self._chunked = self._no_body = False
        if head is self._unended:
            if self._broken is None:
                self._linger()
                return _AFTER_LINGER
            self._set(_CLOSING)
            return _AFTER_CLOSE
        if close:
            self._set(_CLOSING)
            return _AFTER_CLOSE
        if self._ahead:
            self._set(_RESPONSE)
            return _AFTER_NEXT
        if self._broken is not None:
            self._set(_CLOSING)
            return _AFTER_REFUSE
        self._set(_IN_HEAD if self._framing.in_head else _IDLE)
        return _AFTER_WAIT

    def _linger(self) -> None:
        self._set(_LINGERING)
        self._ahead.clear()
        self._unended = None
        self._events = ()
        self._next = 0
        self._held = b""

    def connection_lost(self) -> None:
        """The connection is gone (any state but CLOSED)."""
        self._set(_CLOSED)
        self._ahead.clear()
        self._events = ()
        self._next = 0
        self._held = b""
        self._framing.close()  # its parser and it form a cycle (RequestFraming.close)


# ====================================================================== Client side


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
CLIENT_OURS: Final[dict[tuple[ClientState, _Move], ClientState]] = {
    (_C.IDLE, _M.HEAD_WITH_BODY): _C.SEND_BODY,
    (_C.IDLE, _M.HEAD_ALONE): _C.DONE,
    (_C.SEND_BODY, _M.BODY): _C.SEND_BODY,
    (_C.SEND_BODY, _M.END): _C.DONE,
    (_C.SEND_BODY, _M.ABANDON): _C.MUST_CLOSE,
    (_C.DONE, _M.NEXT): _C.IDLE,
}

#: Their (the response's) transitions. A close or a fault may come in any state but
#: the last two (an answer may come before the request has been sent in full).
CLIENT_THEIRS: Final[dict[tuple[ClientState, _Move], ClientState]] = {
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


#: Seconds an idle kept connection is kept for the next request (aiohttp's default),
#: unless the upstream's ``Keep-Alive: timeout=N`` says less.
CLIENT_KEEPALIVE_TIMEOUT: Final = 15.0


class Request:
    """A request head to send: ``method``, its bytes (``data``, encoded once, so a resend
    costs nothing) and whether it asks to ``close`` the connection after the answer
    (the caller says so, as it wrote the ``Connection`` field; RFC 9112 section 9.6).
    The fields are written by :func:`field_lines`; the request line is UTF-8 (raw
    bytes kept by ``surrogateescape``, as a target is decoded).

    Raises:
        ValueError: the method, the target, a field name or a value holds CR or LF
            (:func:`field_lines`), or a name is not latin-1.
    """

    __slots__ = ("close", "data", "method")

    def __init__(
        self, method: str, target: str, fields: list[tuple[str, str]], *, close: bool = False
    ) -> None:
        line = f"{method} {target} HTTP/1.1\r\n"
        if line.count("\n") != 1 or line.count("\r") != 1:
            raise ValueError("a request line contains CR or LF")
        self.data = (
            line.encode("utf-8", "surrogateescape") + field_lines(fields, len(fields)) + b"\r\n"
        )
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
_NO_TRAILERS: Final = EndOfMessage([])


class Fault:
    """The connection's bytes are unusable from here: ``words`` (ours) say why, and
    ``closed`` says the peer closed it (rather than sent something wrong)."""

    __slots__ = ("closed", "words")

    def __init__(self, words: str, *, closed: bool) -> None:
        self.words = words
        self.closed = closed

    def __repr__(self) -> str:
        return f"Fault({self.words!r}, closed={self.closed})"


ClientEvent = ResponseHead | bytes | EndOfMessage | Fault


class Expiry(enum.Enum):
    """What a passed :meth:`ClientConnection.next_deadline` means."""

    #: Kept idle for its keep-alive time: close it.
    IDLE = "idle"
    #: A reader waited ``idle_read_s`` seconds for body bytes that did not come.
    READ = "read"
    #: The ``head_due`` given to ``send_head`` passed before the final response head
    #: came and the request's body went out: :attr:`ClientConnection.late`.
    HEAD = "head"


_BYTES_AFTER: Final = "upstream sent bytes after its answer"
_HEAD_UNPARSED: Final = "upstream sent a response head that could not be parsed"
_HEAD_LATE: Final = "upstream sent no response headers in time"
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
    connection, the final head's ``head_due`` (:meth:`send_head`), or
    ``idle_read_s`` after a reader began to wait (:meth:`reader_waits`) for body bytes.

    Limits: a field line over :data:`MAX_LINE_BYTES`, more than
    :data:`MAX_FIELDS` fields, or a head over :data:`MAX_RESPONSE_HEAD_BYTES` is a
    :class:`Fault`; trailer fields are held to the line and count limits.

    Raises (every method that moves a state):
        StateError: the move is not allowed in the current state.
    """

    __slots__ = (
        "_body",
        "_body_bytes",
        "_declared",
        "_events",
        "_fields",
        "_framing",
        "_head_bytes",
        "_head_due",
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
        "late",
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
        #: The body pieces at the end of ``_events`` (the list the next piece joins), if any.
        self._body: list[bytes] | None = None
        #: Body bytes parsed and not yet taken (a reader's backlog: pause reading above
        #: a bound).
        self.buffered_bytes = 0
        #: The head's (or trailers') fields as llhttp gave them: name, value, name, ...
        #: (decoded all at once at the head's end: see _decoded).
        self._fields: list[bytes] = []
        #: Where in ``_fields`` the names that may frame the answer are (see on_header).
        self._framing: list[int] = []
        self._head_bytes = 0
        self._head_due: float | None = None
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
        #: Whether ``head_due`` (:meth:`send_head`) passed first (:data:`Expiry.HEAD`).
        self.late = False

    # ---- sending

    def send_head(
        self, head: Request, body_bytes: int = 0, *, head_due: float | None = None
    ) -> bytes:
        """The request head's bytes (``body_bytes``: the declared body length, bytes).
        ``head_due``: when the final response head must have come and the body gone
        out (the caller's clock, seconds; ``None``: no bound), a deadline of
        :meth:`next_deadline`.

        Raises:
            StateError: a request is under way already.
        """
        self.our_state = CLIENT_OURS.get(
            (self.our_state, _M_HEAD_WITH_BODY if body_bytes else _M_HEAD_ALONE)
        ) or _illegal(self.our_state, _M_HEAD_WITH_BODY if body_bytes else _M_HEAD_ALONE)
        self.their_state = CLIENT_THEIRS.get((self.their_state, _M_ASKED)) or _illegal(
            self.their_state, _M_ASKED
        )
        self._idle_since = None
        self._head_only = head.method == "HEAD"
        self._declared = body_bytes
        self._head_due = head_due
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
        self.our_state = CLIENT_OURS.get((self.our_state, _M_BODY)) or _illegal(
            self.our_state, _M_BODY
        )
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
        self.our_state = CLIENT_OURS.get((self.our_state, _M_END)) or _illegal(
            self.our_state, _M_END
        )
        if self.their_state is not _S_AWAIT_HEAD:
            self._head_due = None  # the head came before the body's end
        return b""

    def abandon(self) -> None:
        """The upload stopped part-way: the connection must not carry another request."""
        if self.our_state is _S_SEND_BODY:
            self.our_state = CLIENT_OURS.get((self.our_state, _M_ABANDON)) or _illegal(
                self.our_state, _M_ABANDON
            )
            if self.their_state is not _S_AWAIT_HEAD:
                self._head_due = None

    def close(self) -> None:
        """The connection is gone (closed, or it never connected): nothing more is
        received; drops the parser (idempotent). The parser keeps this object's bound
        ``on_*`` callbacks and this object the parser: a cycle only the cyclic
        collector would free, with every event and field still held here."""
        with contextlib.suppress(AttributeError):  # closed already
            del self._parser

    # ---- receiving

    def receive_data(self, data: bytes) -> None:
        """Parse ``data``, the next bytes read (``b""``: the peer closed). Nothing is
        parsed after a fault or a close, and no bytes may come after :meth:`close`."""
        state = self.their_state
        if state is _S_ERROR or state is _S_CLOSED:
            return
        if not data:
            self._peer_closed()
            self.close()  # nothing comes after the peer's close
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
        self.their_state = CLIENT_THEIRS.get((self.their_state, _M_PEER_CLOSED)) or _illegal(
            self.their_state, _M_PEER_CLOSED
        )

    def _fault(self, words: str, *, closed: bool) -> None:
        if self.their_state is _S_ERROR:
            return
        self.their_state = CLIENT_THEIRS.get((self.their_state, _M_FAULT)) or _illegal(
            self.their_state, _M_FAULT
        )
        self._body = None
        self._events.append(Fault(words, closed=closed))

    def _end(self) -> None:
        self.their_state = CLIENT_THEIRS.get((self.their_state, _M_END)) or _illegal(
            self.their_state, _M_END
        )
        self.ended = True
        self._body = None
        fields = self._fields
        if fields:
            self._events.append(EndOfMessage(_decoded(fields)))
            self._fields = []
        else:
            self._events.append(_NO_TRAILERS)

    def next_event(self) -> ClientEvent | _Signal:
        """The next event parsed (body pieces parsed since the last one joined into one
        ``bytes``), or :data:`NEED_DATA`."""
        events = self._events
        if not events:
            return NEED_DATA
        event = events.pop(0)
        if isinstance(event, list):
            if event is self._body:
                self._body = None  # the next piece starts a list of its own
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
        self.our_state = CLIENT_OURS.get((self.our_state, _M_NEXT)) or _illegal(
            self.our_state, _M_NEXT
        )
        self.their_state = CLIENT_THEIRS.get((self.their_state, _M_NEXT)) or _illegal(
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
        due = self._head_due
        if self._waiting_since is not None:
            read_due = self._waiting_since + self.idle_read_s
            return read_due if due is None or read_due < due else due
        return due

    def expired(self, now: float) -> Expiry | None:
        """What passed by ``now``: the idle connection's keep-alive time, the final head's
        deadline (:attr:`late`; a :class:`Fault` is queued: nothing more is parsed), a
        reader's wait."""
        deadline = self.next_deadline()
        if deadline is None or now < deadline:
            return None
        if self._idle_since is not None:
            return Expiry.IDLE
        due = self._head_due
        if due is not None and now >= due:
            self._head_due = None
            self.late = True
            self._fault(_HEAD_LATE, closed=False)
            return Expiry.HEAD
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
        size = len(name)
        if size + len(value) + 2 > MAX_LINE_BYTES:
            self._fault(_LINE_LIMIT, closed=False)
            raise _Stop
        self._since_field = 0
        fields = self._fields
        if len(fields) >= _MAX_FIELD_BYTES:
            self._fault(
                "upstream response headers over the parser's limit (too many fields)",
                closed=False,
            )
            raise _Stop
        if size in _FRAMING_SIZES:
            # Maybe a field on_headers_complete reads: it looks at these only, not at
            # every field. (llhttp takes only token bytes in a name, ASCII: lowering it
            # keeps its length.)
            self._framing.append(len(fields))
        # Bytes, as they came: the head's are decoded at once at its end (one call per
        # head, not two per field).
        fields += (name, value)

    def on_headers_complete(self) -> None:
        parser = self._parser
        status = parser.get_status_code()
        fields = _decoded(self._fields)
        self._fields = []
        framing = self._framing
        if framing:
            self._framing = []
        if status == 101:
            self._fault("upstream switched protocols", closed=False)
            raise _Stop
        self._body = None
        if 100 <= status < 200:
            self.their_state = CLIENT_THEIRS.get((self.their_state, _M_INTERIM)) or _illegal(
                self.their_state, _M_INTERIM
            )
            self._events.append(ResponseHead(status, fields, True))
            return
        self.their_state = CLIENT_THEIRS.get((self.their_state, _M_FINAL)) or _illegal(
            self.their_state, _M_FINAL
        )
        if self.our_state is not _S_SEND_BODY:
            self._head_due = None  # in time (an upload under way stays bounded)
        self.status = status
        self.keep_alive = parser.should_keep_alive()
        chunked = content_length = False
        for at in framing:  # (the fields of a framing name's length, in order)
            name, value = fields[at >> 1]
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
        # The list the pieces since the last next_event join, kept at hand: no look at
        # the events' last one (and its type) per piece.
        pieces = self._body
        if pieces is None:
            pieces = self._body = [body]
            self._events.append(pieces)
        else:
            pieces.append(body)
        self.buffered_bytes += len(body)

    def on_message_complete(self) -> None:
        if self.their_state is _S_BODY:
            self._end()


#: ``_fields`` holds a name and a value per field.
_MAX_FIELD_BYTES: Final = 2 * MAX_FIELDS
#: The lengths of the names on_headers_complete reads: keep-alive, content-length,
#: transfer-encoding.
_FRAMING_SIZES: Final = frozenset({10, 14, 17})


def _decoded(raw: list[bytes]) -> list[tuple[str, str]]:
    """``(name, value)`` pairs of llhttp's name, value, ... bytes, decoded as aiohttp's
    parser decodes them: field_lines turns them back to the same bytes (UTF-8 text
    stays UTF-8, other bytes survive too).

    All in one decode, joined by NUL (one decode per head, not two per field): NUL is
    ASCII, so each piece decodes as it would alone. llhttp refuses a NUL in a name or
    value; should one be there, the count of pieces tells, and each is decoded apart.
    """
    if not raw:
        return []
    parts = b"\x00".join(raw).decode("utf-8", "surrogateescape").split("\x00")
    if len(parts) != len(raw):
        parts = [piece.decode("utf-8", "surrogateescape") for piece in raw]
    pairs = iter(parts)
    return list(zip(pairs, pairs, strict=True))


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

"""The server side against h11's (proxy/_http1.py): the same byte streams, the same requests.

h11 is an independent HTTP/1.1 implementation (a test dependency only). Fed the
same bytes, cut at the same places, both must give the same request heads
(method, target, version, fields), bodies, trailer fields and keep-alive decision
for each request, or both refuse the stream. Generated streams (hypothesis) are
requests a client may send, pipelined and cut anywhere; adversarial ones are the
classic smuggling and parsing traps. Where we deliberately differ from h11 the
case says so, and why, and pins our behaviour.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass, field

import h11
import pytest
from hypothesis import given
from hypothesis import strategies as st
from multidict import CIMultiDict

from proxy._http1 import (
    END,
    MAX_HEAD_BYTES,
    NEED_DATA,
    PAUSED,
    After,
    BadRequest,
    RequestHead,
    Response,
    ServerConnection,
    Trailers,
)

Fields = tuple[tuple[bytes, bytes], ...]


@dataclass
class Seen:
    """One complete request as a parser saw it."""

    method: bytes
    target: bytes
    version: bytes
    fields: Fields
    body: bytes = b""
    trailers: Fields = ()
    closes: bool = False


@dataclass
class Outcome:
    """The complete requests up to the first that closes the connection; refused or not."""

    requests: list[Seen] = field(default_factory=list)
    refused: bool = False


def _fields(pairs: Sequence[tuple[str, str]]) -> Fields:
    return tuple(
        (n.lower().encode("latin-1"), v.encode("utf-8", "surrogateescape")) for n, v in pairs
    )


def ours(pieces: Sequence[bytes]) -> Outcome:
    """Our machine fed ``pieces``; each request answered (an empty 200) once it ended."""
    conn = ServerConnection(lambda: 0.0, header_timeout=30.0)
    out = Outcome()
    current: Seen | None = None
    ended: list[Seen] = []
    for piece in pieces:
        conn.receive_data(piece)
        for _ in range(10_000):  # bounded: a piece holds fewer events
            event = conn.next_event()
            if event is NEED_DATA or event is PAUSED:
                break
            if isinstance(event, RequestHead):
                target = event.raw_path + (f"?{event.query_string}" if event.query_string else "")
                current = Seen(
                    event.method.encode(),
                    target.encode("utf-8", "surrogateescape"),
                    b"%d.%d" % event.version,
                    _fields(list(event.headers.items())),
                )
            elif isinstance(event, bytes):
                assert current is not None
                current.body += event
            elif isinstance(event, Trailers):
                assert current is not None
                current.trailers = _fields(event.fields)
            elif event is END:
                assert current is not None
                ended.append(current)
                current = None
            elif isinstance(event, BadRequest):
                # Refused unless a request ahead of the fault closes the connection first.
                for seen in ended:
                    if _answer(conn, seen, out):
                        return out
                out.refused = True
                return out
        # Answer what has ended, in order (pipelined requests wait for each other).
        for seen in ended:
            if _answer(conn, seen, out):
                return out
        ended = []
    return out


def _answer(conn: ServerConnection, seen: Seen, out: Outcome) -> bool:
    """Answer ``seen``; whether the connection ends after it."""
    conn.send(Response(200, CIMultiDict(), length=0))
    conn.send(END)
    after = conn.finish_answer()
    seen.closes = after is After.CLOSE
    out.requests.append(seen)
    if after is After.REFUSE:  # kept, but the bytes after it are refused
        out.refused = True
    return after is After.CLOSE or after is After.REFUSE


def theirs(pieces: Sequence[bytes]) -> Outcome:
    """h11's server side fed ``pieces``, answering each request as ours does."""
    conn = h11.Connection(h11.SERVER, max_incomplete_event_size=MAX_HEAD_BYTES)
    out = Outcome()
    current: Seen | None = None
    todo = list(pieces)
    try:
        for _ in range(10_000):  # bounded: each pass takes an event or a piece
            event = conn.next_event()
            if event is h11.NEED_DATA:
                if not todo:
                    return out
                conn.receive_data(todo.pop(0))
            elif isinstance(event, h11.Request):
                current = Seen(
                    event.method,
                    event.target,
                    event.http_version,
                    tuple((n, v) for n, v in event.headers),
                )
            elif isinstance(event, h11.Data):
                assert current is not None
                current.body += event.data
            elif isinstance(event, h11.EndOfMessage):
                assert current is not None
                current.trailers = tuple((n, v) for n, v in event.headers)
                conn.send(h11.Response(status_code=200, headers=[("Content-Length", "0")]))
                conn.send(h11.EndOfMessage())
                current.closes = conn.our_state is h11.MUST_CLOSE
                out.requests.append(current)
                current = None
                if conn.our_state is h11.MUST_CLOSE:
                    return out
                conn.start_next_cycle()
            else:
                return out  # PAUSED (an upgrade), ConnectionClosed: nothing more is a request
    except h11.RemoteProtocolError:
        out.refused = True
    return out


def cut(data: bytes, points: Sequence[int]) -> list[bytes]:
    edges = sorted({p % (len(data) + 1) for p in points} | {0, len(data)})
    return [data[a:b] for a, b in itertools.pairwise(edges)] or [b""]


# ---------------------------------------------------------------------- generated streams

TCHAR = "!#$%&'*+-.^_`|~0123456789abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ"
OURS_TO_SET = {"host", "content-length", "transfer-encoding", "connection", "upgrade", "expect"}

names = st.text(TCHAR, min_size=1, max_size=16).filter(lambda n: n.lower() not in OURS_TO_SET)
values = st.text(
    st.characters(min_codepoint=0x21, max_codepoint=0x7E), min_size=0, max_size=20
).map(lambda v: v.replace("  ", " ")) | st.just("a b  c")
segments = st.text("abcdefgxyz0123456789-._~%20", min_size=0, max_size=8)


@st.composite
def requests(draw: st.DrawFn) -> bytes:
    method = draw(st.sampled_from(["GET", "POST", "PUT", "PATCH", "DELETE", "OPTIONS"]))
    path = "/" + "/".join(draw(st.lists(segments, max_size=3)))
    query = draw(st.none() | st.text("abc=&xyz", min_size=1, max_size=8))
    target = path + (f"?{query}" if query else "")
    version = draw(st.sampled_from(["1.1", "1.1", "1.0"]))
    fields = [(n, v.strip()) for n, v in draw(st.lists(st.tuples(names, values), max_size=5))]
    if version == "1.1" or draw(st.booleans()):
        fields.insert(draw(st.integers(0, len(fields))), ("Host", "example.test"))
    connection = draw(st.sampled_from([None, "close", "keep-alive", "Keep-Alive, x-y"]))
    if connection is not None:
        fields.append(("Connection", connection))
    framing = draw(st.sampled_from(["none", "length", "chunked"]))
    body = b""
    if framing == "length":
        content = draw(st.binary(max_size=300))
        fields.append(("Content-Length", str(len(content))))
        body = content
    elif framing == "chunked" and version == "1.1":
        fields.append(("Transfer-Encoding", "chunked"))
        chunks = draw(st.lists(st.binary(min_size=1, max_size=100), max_size=4))
        body = b"".join(b"%x\r\n%s\r\n" % (len(c), c) for c in chunks) + b"0\r\n"
        trailers = draw(st.lists(st.tuples(names, values), max_size=2))
        body += b"".join(f"{n}: {v.strip()}\r\n".encode() for n, v in trailers) + b"\r\n"
    head = f"{method} {target} HTTP/{version}\r\n" + "".join(f"{n}: {v}\r\n" for n, v in fields)
    return head.encode() + b"\r\n" + body


@given(
    st.lists(requests(), min_size=1, max_size=3),
    st.lists(st.integers(min_value=0, max_value=5_000), max_size=6),
)
def test_generated_streams_give_the_same_requests_as_h11(
    stream: list[bytes], points: list[int]
) -> None:
    pieces = cut(b"".join(stream), points)
    mine, h11s = ours(pieces), theirs(pieces)
    assert mine == h11s
    assert not mine.refused  # every generated stream is a valid one
    assert len(mine.requests) >= 1


# ---------------------------------------------------------------------- adversarial streams

H = b"Host: x\r\n"

SAME: dict[str, bytes] = {
    "no Host in HTTP/1.1 (RFC 9112 §3.2)": b"GET / HTTP/1.1\r\n\r\n",
    "HTTP/1.0 without Host is fine": b"GET / HTTP/1.0\r\n\r\n",
    "space before the colon (RFC 9112 §5.1)": b"GET / HTTP/1.1\r\n" + H + b"A : b\r\n\r\n",
    "a signed Content-Length": b"POST / HTTP/1.1\r\n" + H + b"Content-Length: +1\r\n\r\nx",
    "two different Content-Lengths": (
        b"POST / HTTP/1.1\r\n" + H + b"Content-Length: 1\r\nContent-Length: 2\r\n\r\nxx"
    ),
    "a negative chunk size": (
        b"POST / HTTP/1.1\r\n" + H + b"Transfer-Encoding: chunked\r\n\r\n-1\r\nx\r\n0\r\n\r\n"
    ),
    "a chunk size that is not hex": (
        b"POST / HTTP/1.1\r\n" + H + b"Transfer-Encoding: chunked\r\n\r\nzz\r\nx\r\n0\r\n\r\n"
    ),
    "chunk data longer than its size": (
        b"POST / HTTP/1.1\r\n" + H + b"Transfer-Encoding: chunked\r\n\r\n1\r\nxyz\r\n0\r\n\r\n"
    ),
    "a NUL in a field value": b"GET / HTTP/1.1\r\n" + H + b"A: b\x00c\r\n\r\n",
    "a field line without a colon": b"GET / HTTP/1.1\r\n" + H + b"just words\r\n\r\n",
    "pipelined, then garbage": b"GET /a HTTP/1.1\r\n" + H + b"\r\nBAD\x00 / HTTP/1.1\r\n\r\n",
    "pipelined behind Connection: close (the rest is never a request)": (
        b"GET /a HTTP/1.1\r\n" + H + b"Connection: close\r\n\r\nGET /b HTTP/1.1\r\n" + H + b"\r\n"
    ),
    "a chunk extension": (
        b"POST / HTTP/1.1\r\n" + H + b"Transfer-Encoding: chunked\r\n\r\n2;ext=1\r\nhi\r\n0\r\n\r\n"
    ),
    "trailer fields": (
        b"POST / HTTP/1.1\r\n" + H + b"Transfer-Encoding: chunked\r\n\r\n2\r\nhi\r\n0\r\n"
        b"X-Sum: 9\r\nX-Other: a b\r\n\r\n"
    ),
    "a field value with obs-text bytes": b"GET / HTTP/1.1\r\n" + H + b"A: caf\xc3\xa9 \xff\r\n\r\n",
    "an HTTP/1.0 keep-alive is not kept": (
        b"GET /a HTTP/1.0\r\nConnection: keep-alive\r\n\r\nGET /b HTTP/1.0\r\n\r\n"
    ),
    "Connection: close in a list": b"GET / HTTP/1.1\r\n" + H + b"Connection: x, close\r\n\r\n",
}


@pytest.mark.parametrize("name", sorted(SAME))
@pytest.mark.parametrize("step", [None, 1, 7])
def test_adversarial_streams_get_the_same_verdict_as_from_h11(name: str, step: int | None) -> None:
    data = SAME[name]
    pieces = [data] if step is None else [data[i : i + step] for i in range(0, len(data), step)]
    assert ours(pieces) == theirs(pieces), name


# Where we deliberately differ: each pinned (ours, h11's), with the reason.
DIFFERENT: dict[str, tuple[bytes, str]] = {
    "an HTTP version other than 1.x": (
        b"GET / HTTP/2.7\r\n" + H + b"\r\n",
        "h11 takes any version and answers as 1.1; llhttp (and we) refuse a major version "
        "other than 1 (RFC 9110 §2.5: its framing is not HTTP/1.1's, so nothing after the "
        "head can be read safely)",
    ),
    "bare LF line ends": (
        b"GET / HTTP/1.1\nHost: x\n\n",
        "RFC 9112 §2.2 lets a recipient accept a bare LF; we do not: a proxy that reads LF "
        "where the upstream or another hop reads CRLF is a request-smuggling vector",
    ),
    "obs-fold": (
        b"GET / HTTP/1.1\r\n" + H + b"A: b\r\n c\r\n\r\n",
        "RFC 9112 §5.2 lets a server either reject a folded line with 400 or unfold it; h11 "
        "unfolds, llhttp (and we) reject: the field is relayed upstream, and unfolding "
        "would change its bytes",
    ),
    "Content-Length and Transfer-Encoding": (
        b"POST / HTTP/1.1\r\n" + H + b"Content-Length: 3\r\nTransfer-Encoding: chunked\r\n\r\n"
        b"0\r\n\r\n",
        "RFC 9112 §6.1: such a message 'ought to be handled as an error'; h11 lets chunked "
        "win, we refuse it (the classic smuggling pair)",
    ),
    "two equal Content-Lengths": (
        b"POST / HTTP/1.1\r\n" + H + b"Content-Length: 1\r\nContent-Length: 1\r\n\r\nx",
        "RFC 9110 §8.6 allows a recipient to accept repeated equal values; llhttp's strict "
        "mode (and we) refuse any repetition",
    ),
}

# Where h11 refuses and we accept (ours is the accepted side; see each reason).
H11_STRICTER: dict[str, tuple[bytes, str]] = {
    "an empty line before the request line": (
        b"\r\nGET / HTTP/1.1\r\n" + H + b"\r\n",
        "RFC 9112 §2.2: a server SHOULD ignore at least one empty line before the request "
        "line (a client's stray CRLF after a previous body); h11 refuses it",
    ),
    "two Host fields": (
        b"GET / HTTP/1.1\r\n" + H + b"Host: y\r\n\r\n",
        "RFC 9112 §3.2 requires a 400; llhttp and the driver accept it today (the first "
        "Host is not used for routing: the upstream is the route's). Pinned so that a fix "
        "is a visible change",
    ),
    "a request line without a version": (
        b"GET /\r\n" + H + b"\r\n",
        "llhttp reads it as an HTTP/0.9-style line and the fields after it; it is answered "
        "as HTTP/1.1 and the connection closes after (llhttp says no keep-alive). Not a "
        "choice of ours: pinned so that refusing it is a visible change",
    ),
}


@pytest.mark.parametrize("name", sorted(DIFFERENT))
def test_we_refuse_what_h11_accepts_where_we_mean_to(name: str) -> None:
    data, _why = DIFFERENT[name]
    mine, h11s = ours([data]), theirs([data])
    assert mine.refused and not mine.requests
    assert not h11s.refused and h11s.requests


@pytest.mark.parametrize("name", sorted(H11_STRICTER))
def test_we_accept_what_h11_refuses_where_we_mean_to(name: str) -> None:
    data, _why = H11_STRICTER[name]
    mine, h11s = ours([data]), theirs([data])
    assert not mine.refused and [r.method for r in mine.requests] == [b"GET"]
    assert h11s.refused


def test_heads_over_our_limits_are_refused_by_both() -> None:
    # Both limits are 64 KiB here (h11's is set to ours): the same verdict.
    big = (
        b"GET / HTTP/1.1\r\n" + H + b"".join(b"X-%d: %s\r\n" % (i, b"v" * 600) for i in range(120))
    )
    assert len(big) > MAX_HEAD_BYTES
    mine, h11s = ours([big[i : i + 4096] for i in range(0, len(big), 4096)]), theirs([big])
    assert mine.refused and h11s.refused


def test_a_field_line_over_our_line_limit_is_refused_though_h11_has_no_line_limit() -> None:
    # Deliberate: MAX_LINE_BYTES (8190, aiohttp's and nginx's) bounds one field; h11 only
    # bounds the whole head. A 9 KB field is a head h11 accepts and we refuse.
    data = b"GET / HTTP/1.1\r\n" + H + b"X-Long: " + b"v" * 9000 + b"\r\n\r\n"
    assert ours([data]).refused
    assert not theirs([data]).refused

"""The upstream client (proxy/_upstream.py): the framing alone, then the pool on real sockets.

The framing tests feed bytes and read what was found (no sockets, h11-style).
The pool tests use small raw-socket upstreams on 127.0.0.1 for what a real
upstream does to a client: keep-alive, idle closes, answers before the body is
sent, answers faster than they are read, silence, TLS.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
import ssl
import weakref
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any, Final

import pytest
from hypothesis import given
from hypothesis import strategies as st
from multidict import CIMultiDict, MultiDict

from proxy import _connect, _http1
from proxy._http1 import (
    MAX_LINE_BYTES,
    ClientConnection,
    EndOfMessage,
    Fault,
    Request,
    ResponseHead,
)
from proxy._http1 import MAX_RESPONSE_HEAD_BYTES as MAX_HEAD_BYTES
from proxy._upstream import (
    READ_HIGH_WATER_BYTES,
    AnswerCut,
    BadResponseHead,
    ConnectFailed,
    IdleReadTimeout,
    PoolBusy,
    ServerDisconnected,
    UpstreamPool,
    UpstreamTarget,
)
from tests.support.upstream import Scripted, chunked, read_request, self_signed

# ------------------------------------------------------------------ framing (sans-I/O)


class _Fed:
    """What the client machine made of an answer's bytes (the old framing's view of it)."""

    def __init__(self, *, head_only: bool = False) -> None:
        self.conn = ClientConnection()
        self.conn.send_head(Request("HEAD" if head_only else "GET", "/", []))
        self.status = 0
        self.fields: list[tuple[str, str]] = []
        self.body = b""
        self.complete = False
        self.error: str | None = None
        self.closed = False

    def feed(self, data: bytes) -> None:
        self.conn.receive_data(data)
        for _ in range(len(data) + 8):  # bounded: at most one event per byte, and the end
            event = self.conn.next_event()
            if isinstance(event, ResponseHead):
                if not event.interim:
                    self.status, self.fields = event.status, event.fields
            elif isinstance(event, bytes):
                self.body += event
            elif isinstance(event, EndOfMessage):
                self.complete = True
            elif isinstance(event, Fault):
                self.error, self.closed = event.words, event.closed
            else:
                return

    def eof(self) -> None:
        self.feed(b"")

    def take(self) -> bytes:
        body, self.body = self.body, b""
        return body


def _fed(data: bytes, *, step: int = 0, head_only: bool = False) -> _Fed:
    framing = _Fed(head_only=head_only)
    if step:
        for start in range(0, len(data), step):
            framing.feed(data[start : start + step])
    else:
        framing.feed(data)
    return framing


def test_a_length_framed_answer_fed_byte_by_byte() -> None:
    framing = _fed(b"HTTP/1.1 200 OK\r\nContent-Length: 5\r\nX-Trace: a b\r\n\r\nhello", step=1)
    assert (framing.status, framing.complete) == (200, True)
    assert framing.fields == [("Content-Length", "5"), ("X-Trace", "a b")]
    assert framing.take() == b"hello" and framing.take() == b""
    assert framing.conn.reusable and framing.error is None


def test_a_chunked_answer_split_anywhere_ends_with_its_last_chunk() -> None:
    wire = b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n" + chunked(b"data: 1\n\n", b"x")
    for step in (1, 3, 7, len(wire)):
        framing = _fed(wire[:-5], step=step)
        assert framing.take() == b"data: 1\n\nx" and not framing.complete
        framing.feed(wire[-5:])
        assert framing.complete and framing.error is None


def test_interim_answers_are_skipped_for_the_final_one() -> None:
    framing = _fed(
        b"HTTP/1.1 100 Continue\r\n\r\nHTTP/1.1 103 Early Hints\r\nLink: </a>\r\n\r\n"
        b"HTTP/1.1 429 Too Many Requests\r\nRetry-After: 3\r\nContent-Length: 2\r\n\r\n{}"
    )
    assert framing.status == 429 and framing.fields[0] == ("Retry-After", "3")
    assert framing.take() == b"{}" and framing.complete


def test_an_answer_without_framing_ends_when_the_upstream_closes() -> None:
    framing = _fed(b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\n\r\ndata: 1\n\n")
    assert framing.conn.until_close and not framing.complete
    framing.eof()
    assert framing.complete and framing.error is None and framing.take() == b"data: 1\n\n"


@pytest.mark.parametrize(
    ("wire", "words"),
    [
        (b"HTTP/1.1 200 OK\r\nContent-Le", "closed the connection before answering"),
        (b"HTTP/1.1 200 OK\r\nContent-Length: 9\r\n\r\nabc", "closed the connection mid-answer"),
        (b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n3\r\nabc\r\n", "mid-answer"),
    ],
    ids=["before-head", "short-length", "no-last-chunk"],
)
def test_a_close_before_the_framing_ends_is_an_error(wire: bytes, words: str) -> None:
    framing = _fed(wire)
    framing.eof()
    assert framing.closed and not framing.complete
    assert framing.error is not None and words in framing.error


@pytest.mark.parametrize(
    ("wire", "words"),
    [
        (
            b"HTTP/1.1 200 OK\r\nX-Big: " + b"t" * 20_000 + b"\r\n\r\n",
            f"limit ({MAX_LINE_BYTES} bytes a line)",
        ),
        (
            b"HTTP/1.1 200 OK\r\n" + b"".join(b"X-%d: 1\r\n" % i for i in range(200)) + b"\r\n",
            "limit (too many fields)",
        ),
        (b"NOT HTTP\r\n\r\n", "could not be parsed"),
        (b"HTTP/1.1 101 Switching Protocols\r\nUpgrade: x\r\n\r\n", "switched protocols"),
        (
            b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\nabc\r\n",
            "body framing is broken",
        ),
        (b"HTTP/1.1 200 OK\r\nContent-Length: 1\r\n\r\nab", "bytes after its answer"),
    ],
    ids=["long-line", "many-fields", "garbage", "upgrade", "bad-chunk", "extra-bytes"],
)
def test_bad_heads_and_framing_are_errors_in_our_own_words(wire: bytes, words: str) -> None:
    framing = _fed(wire)
    if framing.error is None:  # the extra byte comes in a feed of its own
        framing.feed(b"x")
    assert framing.error is not None and words in framing.error
    # Never the upstream's bytes (a header value may be a secret).
    assert "ttt" not in framing.error


def test_a_header_line_that_never_ends_is_refused_soon() -> None:
    """One field line growing forever (llhttp gathers a line whole before calling back):
    refused within a few lines' worth of bytes, not at the head's total limit."""
    framing = _Fed()
    framing.feed(b"HTTP/1.1 200 OK\r\nX-Slow: ")
    fed = 0
    while framing.error is None and fed <= 2 * MAX_HEAD_BYTES:  # bounded
        framing.feed(b"a" * 4096)
        fed += 4096
    assert framing.error is not None and f"({MAX_LINE_BYTES} bytes a line)" in framing.error
    assert fed <= 2 * MAX_LINE_BYTES + 4096


def test_a_head_answer_has_no_body_and_its_connection_is_not_reused() -> None:
    framing = _fed(b"HTTP/1.1 200 OK\r\nContent-Length: 99\r\n\r\n", head_only=True)
    assert framing.complete and framing.take() == b"" and not framing.conn.reusable


def test_the_next_request_starts_a_clean_answer() -> None:
    framing = _fed(b"HTTP/1.1 200 OK\r\nContent-Length: 1\r\n\r\na")
    framing.take()
    framing.conn.start_next(0.0)
    framing.conn.send_head(Request("GET", "/", []))
    framing.complete = False
    framing.feed(b"HTTP/1.1 404 Not Found\r\nContent-Length: 0\r\n\r\n")
    assert (framing.status, framing.complete, framing.fields) == (
        404,
        True,
        [("Content-Length", "0")],
    )


# ------------------------------------------------------------------ the pool on sockets

Serve = Callable[[asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]]


def _server(serve: Serve, *, context: ssl.SSLContext | None = None) -> Scripted:
    """A loopback server running ``serve`` per connection (:class:`Scripted`, which
    counts ``connections`` and ``closed``); ``context`` makes it https."""

    async def script(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, n: int) -> None:
        await serve(reader, writer)

    return Scripted(script, tls=context)


def _echo(fields: bytes = b"") -> Serve:
    """A ``serve`` answering every request on the connection with its own body, until the
    client closes; ``fields`` (header lines, each ending in CRLF) go in every answer."""

    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        for _ in range(100):  # bounded
            _head, body = await read_request(reader)
            writer.write(
                b"HTTP/1.1 200 OK\r\n%sContent-Length: %d\r\n\r\n%s" % (fields, len(body), body)
            )
            await writer.drain()

    return serve


_keep_alive_ok: Final = _echo()


@contextlib.asynccontextmanager
async def _pool(**options: Any) -> AsyncIterator[UpstreamPool]:
    pool = UpstreamPool(
        connect_timeout=options.pop("connect_timeout", 5.0),
        idle_read=options.pop("idle_read", 5.0),
        max_connections=options.pop("max_connections", 0),
    )
    try:
        yield pool
    finally:
        await pool.close()


async def _body(*pieces: bytes) -> AsyncIterator[memoryview]:
    for piece in pieces:
        yield memoryview(piece)


async def _post(
    pool: UpstreamPool, port: int, body: bytes, *, scheme: str = "http", host: str = "127.0.0.1"
) -> bytes:
    target = UpstreamTarget(f"{scheme}://{host}:{port}")
    fields = {"Content-Length": str(len(body)), "Content-Type": "application/json"}
    # In 256 KiB slices, as the exchange sends a body.
    pieces = [body[i : i + 262144] for i in range(0, len(body), 262144)]
    answer = await pool.request(target, "POST", "/v1/x", fields, lambda: _body(*pieces), len(body))
    try:
        data = b""
        for _ in range(10_000):  # bounded
            piece = await answer.read()
            if not piece:
                break
            data += piece
        return data
    finally:
        answer.release()


async def test_connections_are_kept_and_reused_between_requests() -> None:
    async with _server(_keep_alive_ok) as upstream, _pool() as pool:
        answers = [await _post(pool, upstream.port, b'{"n":%d}' % i) for i in range(3)]
        assert answers == [b'{"n":0}', b'{"n":1}', b'{"n":2}']
        assert upstream.connections == 1
        assert (pool.idle_connections, pool.connections_in_use) == (1, 0)


async def test_an_idle_connection_is_closed_after_the_keep_alive_time(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(_http1, "CLIENT_KEEPALIVE_TIMEOUT", 0.05)
    async with _server(_keep_alive_ok) as upstream, _pool() as pool:
        await _post(pool, upstream.port, b"{}")
        for _ in range(1000):  # bounded: ~10 s (a loaded machine)
            if upstream.closed == 1:
                break
            await asyncio.sleep(0.01)
        assert upstream.closed == 1 and pool.idle_connections == 0


async def test_a_connection_the_upstream_closed_while_idle_is_not_used_again() -> None:
    async def one_then_close(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        _head, body = await read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body))
        await writer.drain()

    async with _server(one_then_close) as upstream, _pool() as pool:
        assert await _post(pool, upstream.port, b"1") == b"1"
        for _ in range(1000):  # bounded (10 s): the pool hears the close
            if pool.idle_connections == 0:
                break
            await asyncio.sleep(0.01)
        assert await _post(pool, upstream.port, b"2") == b"2"
        assert upstream.connections == 2


async def test_max_connections_makes_a_request_wait_for_a_free_connection() -> None:
    release = asyncio.Event()

    async def slow(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        for _ in range(10):  # bounded
            await read_request(reader)
            writer.write(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n1\r\na\r\n")
            await writer.drain()
            await asyncio.wait_for(release.wait(), 10)
            writer.write(b"0\r\n\r\n")
            await writer.drain()

    async with _server(slow) as upstream, _pool(max_connections=1) as pool:
        first = asyncio.create_task(_post(pool, upstream.port, b"{}"))
        await asyncio.sleep(0.1)
        second = asyncio.create_task(_post(pool, upstream.port, b"{}"))
        await asyncio.sleep(0.1)
        assert pool.connections_in_use == 1 and not second.done()
        release.set()
        assert await asyncio.wait_for(first, 5) == b"a"
        assert await asyncio.wait_for(second, 5) == b"a"
        assert upstream.connections == 1  # the second request took the kept connection


async def test_an_answer_not_read_pauses_the_upstream_socket() -> None:
    """Backpressure: what is buffered stays near the high-water mark, however much the
    upstream has to send; reading resumes it."""
    total = 8 * 1024 * 1024
    sent = 0

    async def fire_hose(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        nonlocal sent
        await read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n" % total)
        piece = b"x" * 65536
        while sent < total:
            writer.write(piece)
            await writer.drain()
            sent += len(piece)

    async with _server(fire_hose) as upstream, _pool() as pool:
        target = UpstreamTarget(f"http://127.0.0.1:{upstream.port}")
        answer = await pool.request(target, "GET", "/", {})
        await asyncio.sleep(0.5)
        conn = answer._conn
        assert conn is not None
        # The kernel's socket buffers hold the rest; the upstream is blocked sending.
        assert conn.machine.buffered_bytes <= READ_HIGH_WATER_BYTES + 256 * 1024
        assert sent < total
        received = 0
        for _ in range(100_000):  # bounded
            piece = await answer.read()
            if not piece:
                break
            received += len(piece)
        assert received == total and answer.at_eof
        answer.release()


async def test_an_answer_before_the_body_is_sent_ends_the_upload() -> None:
    """An upstream refusing a large body at once (413) and reading no more: the answer
    is relayed, the upload stops instead of waiting on a full socket, and the
    connection is not kept (the upstream did not read the request to its end)."""

    async def refuse(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.readuntil(b"\r\n\r\n")
        writer.write(b"HTTP/1.1 413 Payload Too Large\r\nContent-Length: 2\r\n\r\n{}")
        await writer.drain()
        await asyncio.sleep(3)  # reads nothing more, keeps the connection open

    body = b"a" * (64 * 1024 * 1024)
    async with _server(refuse) as upstream, _pool() as pool:
        target = UpstreamTarget(f"http://127.0.0.1:{upstream.port}")
        fields = {"Content-Length": str(len(body))}
        pieces = [body[i : i + 262144] for i in range(0, len(body), 262144)]
        answer = await asyncio.wait_for(
            pool.request(target, "POST", "/", fields, lambda: _body(*pieces), len(body)), 2
        )
        assert answer.status == 413
        assert await answer.read() == b"{}"
        answer.release()
        assert pool.idle_connections == 0


async def test_silence_mid_answer_is_an_idle_read_timeout() -> None:
    async def stall(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 10\r\n\r\nabc")
        await writer.drain()
        await asyncio.sleep(3)

    async with _server(stall) as upstream, _pool(idle_read=0.2) as pool:
        target = UpstreamTarget(f"http://127.0.0.1:{upstream.port}")
        answer = await pool.request(target, "GET", "/", {})
        assert await answer.read() == b"abc"
        with pytest.raises(IdleReadTimeout):
            await asyncio.wait_for(answer.read(), 2)
        answer.close()


async def test_a_close_mid_answer_is_an_answer_cut() -> None:
    async def cut(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 10\r\n\r\nabc")
        await writer.drain()

    async with _server(cut) as upstream, _pool() as pool:
        target = UpstreamTarget(f"http://127.0.0.1:{upstream.port}")
        answer = await pool.request(target, "GET", "/", {})
        with pytest.raises(AnswerCut, match="mid-answer"):
            for _ in range(10):  # bounded
                await asyncio.wait_for(answer.read(), 2)
        answer.close()


async def test_a_close_before_the_head_is_a_server_disconnected() -> None:
    async def hang_up(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)

    async with _server(hang_up) as upstream, _pool() as pool:
        with pytest.raises(ServerDisconnected, match="before answering"):
            await _post(pool, upstream.port, b"{}")
        assert pool.connections_in_use == 0


async def test_a_bad_head_is_refused_in_our_words() -> None:
    async def secret(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\nX-Key: sk-" + b"s" * 9000 + b"\r\n\r\n")
        await writer.drain()

    async with _server(secret) as upstream, _pool() as pool:
        with pytest.raises(BadResponseHead) as raised:
            await _post(pool, upstream.port, b"{}")
        assert "limit" in str(raised.value) and "sk-" not in str(raised.value)


async def test_a_refused_connect_says_where() -> None:
    async with _server(_keep_alive_ok) as upstream:
        port = upstream.port
    async with _pool() as pool:
        with pytest.raises(ConnectFailed) as raised:
            await _post(pool, port, b"{}")
        assert str(raised.value) == f"upstream refused the connection at 127.0.0.1:{port}"
        assert isinstance(raised.value.os_error, ConnectionRefusedError)


async def test_the_request_head_carries_the_fields_and_what_the_proxy_adds() -> None:
    heads: list[bytes] = []

    async def record(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        head, _body = await read_request(reader)
        heads.append(head)
        writer.write(b"HTTP/1.1 204 No Content\r\n\r\n")
        await writer.drain()

    async with _server(record) as upstream, _pool() as pool:
        target = UpstreamTarget(f"http://127.0.0.1:{upstream.port}/base/")
        fields = {"X-Api-Key": "k", "Content-Length": "2"}
        path = target.request_target("/v1/messages", "beta=true")
        answer = await pool.request(target, "POST", path, fields, lambda: _body(b"{}"), 2)
        assert answer.status == 204 and await answer.read() == b""
        answer.release()
        with pytest.raises(ValueError):
            await pool.request(target, "GET", "/", {"X-Bad": "a\r\nX-Injected: 1"})
    (head,) = heads
    lines = head.split(b"\r\n")
    assert lines[0] == b"POST /base/v1/messages?beta=true HTTP/1.1"
    assert f"Host: 127.0.0.1:{upstream.port}".encode() in lines
    assert b"X-Api-Key: k" in lines and b"Accept-Encoding: gzip, deflate, br" in lines
    assert b"User-Agent: context-proxy" in lines


_FIELD_NAMES = st.sampled_from(["Accept", "accept", "USER-AGENT", "User-Agent", "X-Api-Key", "a"])
_FIELD_VALUES = st.text(alphabet="ab \r\n\u00e9\udcff", max_size=6)


def _latin1(name: str) -> bool:
    try:
        name.encode("latin-1")
    except UnicodeEncodeError:
        return False
    return True


@given(st.lists(st.tuples(_FIELD_NAMES | _FIELD_VALUES, _FIELD_VALUES), max_size=6))
def test_the_request_head_of_any_mapping_is_the_head_of_the_relay_s_own_fields(
    pairs: list[tuple[str, str]],
) -> None:
    # The relay's fields (a case-insensitive multidict) are looked up by name; any other
    # mapping is scanned. Same head, or the same refusal of a line break or a bad name.
    target = UpstreamTarget("http://127.0.0.1:8000")
    outcomes: list[bytes | str] = []
    for fields in (CIMultiDict(pairs), MultiDict(pairs)):
        try:
            outcomes.append(target.request_head("POST", "/v1/x", fields).data)
        except ValueError as exc:
            outcomes.append(str(exc))
    assert outcomes[0] == outcomes[1]
    if any(not _latin1(name) for name, _ in pairs):
        # A name is a token (RFC 9110 section 5.1): one that is not even latin-1 is refused.
        assert isinstance(outcomes[0], str) and "latin-1" in outcomes[0]
    elif any("\r" in part or "\n" in part for pair in pairs for part in pair):
        assert outcomes[0] == "a header field contains CR or LF"
    else:
        head = outcomes[0]
        assert isinstance(head, bytes) and head.endswith(b"\r\n\r\n")
        names = {name.lower() for name, _ in pairs}
        assert (b"\r\nAccept: */*\r\n" in head) == ("accept" not in names)
        assert (b"\r\nUser-Agent: context-proxy\r\n" in head) == ("user-agent" not in names)


async def test_https_upstreams_are_verified_and_kept_alive(tmp_path: Path) -> None:
    cert, key = self_signed(tmp_path)
    server = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    server.load_cert_chain(cert, key)
    async with _server(_keep_alive_ok, context=server) as upstream:
        async with _pool() as pool:
            # The system's trust store does not know this certificate: refused.
            with pytest.raises(ConnectFailed, match="TLS certificate could not be verified"):
                await _post(pool, upstream.port, b"{}", scheme="https", host="localhost")
        async with _pool() as pool:
            client = ssl.create_default_context(cafile=str(cert))
            pool.connector.tls_context = client
            for n in range(2):
                body = b'{"n":%d}' % n
                assert (
                    await _post(pool, upstream.port, body, scheme="https", host="localhost") == body
                )
        # One connection kept for both requests (the refused handshake never reached serve).
        assert upstream.connections == 1


def test_the_pool_works_on_uvloop() -> None:
    """``event_loop = "uvloop"`` gives the pool uvloop's transports (not asyncio classes):
    keep-alive, a large upload under backpressure, and a cut answer behave the same."""
    uvloop = pytest.importorskip("uvloop")

    async def scenario() -> None:
        async with _server(_keep_alive_ok) as upstream, _pool() as pool:
            body = b"u" * (4 * 1024 * 1024)
            assert await _post(pool, upstream.port, body) == body
            assert await _post(pool, upstream.port, b"{}") == b"{}"
            assert upstream.connections == 1

        async def cut(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            await read_request(reader)
            writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 10\r\n\r\nabc")
            await writer.drain()

        async with _server(cut) as upstream, _pool() as pool:
            with pytest.raises(AnswerCut):
                await asyncio.wait_for(_post(pool, upstream.port, b"{}"), 5)

    with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
        runner.run(scenario())


# ------------------------------------------------------------------ kept connections, retried


async def test_a_kept_connection_closed_unanswered_is_replaced_and_the_request_sent_again() -> None:
    """The upstream's keep-alive timer crosses the next request: it closes without a byte
    of answer. The request goes once more on a new connection; on a new connection the
    same close is the error it is."""
    seen: list[bytes] = []

    async def close_second(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        for n in range(10):  # bounded
            _head, body = await read_request(reader)
            seen.append(body)
            if n == 1:
                return  # the second request on this connection: closed unanswered
            writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body))
            await writer.drain()

    async with _server(close_second) as upstream, _pool() as pool:
        assert await _post(pool, upstream.port, b"1") == b"1"
        assert await _post(pool, upstream.port, b"2") == b"2"
        assert seen == [b"1", b"2", b"2"] and upstream.connections == 2

    async def never(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)

    async with _server(never) as upstream, _pool() as pool:
        with pytest.raises(ServerDisconnected):
            await _post(pool, upstream.port, b"{}")
        assert upstream.connections == 1  # a new connection: not tried again


async def test_a_408_on_a_kept_connection_is_not_the_answer() -> None:
    """Node, nginx and Apache send 408 on a connection they time out as idle; crossing
    the next request, it answers nothing that request asked."""

    async def time_out_idle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        for n in range(10):  # bounded
            _head, body = await read_request(reader)
            if n == 1:
                writer.write(b"HTTP/1.1 408 Request Timeout\r\nConnection: close\r\n\r\n")
                await writer.drain()
                return
            writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body))
            await writer.drain()

    async with _server(time_out_idle) as upstream, _pool() as pool:
        assert await _post(pool, upstream.port, b"1") == b"1"
        assert await _post(pool, upstream.port, b"2") == b"2"
        assert upstream.connections == 2


async def test_no_free_connection_in_time_is_the_pools_limit_not_the_upstreams() -> None:
    async def hold(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n")
        await writer.drain()
        await asyncio.sleep(3)

    async with _server(hold) as upstream, _pool(max_connections=1) as pool:
        target = UpstreamTarget(f"http://127.0.0.1:{upstream.port}")
        holder = await pool.request(target, "GET", "/", {})
        with pytest.raises(PoolBusy, match="all 1 upstream connections are in use"):
            await pool.request(target, "GET", "/", {}, head_timeout=0.2)
        holder.close()
        assert upstream.connections == 1


async def test_a_waiter_cancelled_as_it_is_woken_passes_the_free_connection_on() -> None:
    release = asyncio.Event()

    async def answer_on_release(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        for _ in range(10):  # bounded
            await read_request(reader)
            await asyncio.wait_for(release.wait(), 10)
            writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\n{}")
            await writer.drain()

    async with _server(answer_on_release) as upstream, _pool(max_connections=1) as pool:
        first = asyncio.create_task(_post(pool, upstream.port, b"a"))
        await asyncio.sleep(0.05)
        second = asyncio.create_task(_post(pool, upstream.port, b"b"))
        third = asyncio.create_task(_post(pool, upstream.port, b"c"))
        await asyncio.sleep(0.05)
        release.set()
        for _ in range(500):  # bounded: until the first answer frees its connection
            if first.done():
                break
            await asyncio.sleep(0)
        second.cancel()  # in the turn its wake-up came
        assert await asyncio.wait_for(third, 3) == b"{}"
        assert await first == b"{}"


async def test_a_success_head_before_the_body_is_read_does_not_stop_the_upload() -> None:
    """A server that opens its stream first and reads the body afterwards gets all of it
    (RFC 9112 section 9.3: only an answer refusing the body ends the upload)."""
    got: list[int] = []

    async def stream_first(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        head = await reader.readuntil(b"\r\n\r\n")
        length = int(head.lower().split(b"content-length: ")[1].split(b"\r\n")[0])
        writer.write(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n1\r\na\r\n")
        await writer.drain()
        await asyncio.sleep(0.2)  # the proxy's socket fills meanwhile: its upload waits
        got.append(len(await reader.readexactly(length)))
        writer.write(b"0\r\n\r\n")
        await writer.drain()

    body = b"b" * (16 * 1024 * 1024)
    async with _server(stream_first) as upstream, _pool() as pool:
        assert await asyncio.wait_for(_post(pool, upstream.port, body), 10) == b"a"
    assert got == [len(body)]


@pytest.mark.parametrize(
    ("field", "seconds"),
    [("timeout=5, max=1000", 4.0), ("max=3", 15.0), ("timeout=60", 15.0), ("timeout=x", 15.0)],
)
def test_the_upstreams_keep_alive_timeout_bounds_the_idle_time(field: str, seconds: float) -> None:
    """Node sends ``Keep-Alive: timeout=5`` and closes at 5 s: a connection idle longer
    is not offered to the next request (a second of margin)."""
    framing = _fed(
        b"HTTP/1.1 200 OK\r\nKeep-Alive: %s\r\nContent-Length: 0\r\n\r\n" % field.encode()
    )
    assert framing.conn.keep_alive_s == seconds


async def test_a_connection_the_upstream_keeps_a_second_or_less_is_not_kept() -> None:
    async with _server(_echo(b"Keep-Alive: timeout=1\r\n")) as upstream, _pool() as pool:
        assert await _post(pool, upstream.port, b"1") == b"1"
        assert pool.idle_connections == 0
        assert await _post(pool, upstream.port, b"2") == b"2"
        assert upstream.connections == 2


async def test_a_kept_connection_is_closed_a_keep_alive_time_after_its_last_use() -> None:
    """The idle deadline runs from the connection's last answer, not its first: one
    used again before its deadline stays past it, then goes once idle that long."""
    # Each sleep is 0.8 s inside a deadline: a loaded machine's late wake-up is not a failure
    # (a late sleep only goes further past the first deadline, which the test needs anyway).
    async with _server(_echo(b"Keep-Alive: timeout=3\r\n")) as upstream, _pool() as pool:
        assert await _post(pool, upstream.port, b"1") == b"1"  # kept for 2 s (3 less 1)
        await asyncio.sleep(1.2)
        assert await _post(pool, upstream.port, b"2") == b"2"  # the same connection
        await asyncio.sleep(1.2)  # past the first deadline, inside the second
        assert pool.idle_connections == 1
        for _ in range(1000):  # bounded: 10 s (a loaded machine)
            if pool.idle_connections == 0:
                break
            await asyncio.sleep(0.01)
        assert pool.idle_connections == 0
        assert upstream.connections == 1


async def test_an_answer_with_gaps_under_the_idle_bound_never_times_out() -> None:
    """The bound is the silence between two reads, not the time since the first:
    pieces every 0.15 s for over a second pass an idle bound of 0.4 s."""

    async def trickle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n")
        for _ in range(8):
            writer.write(b"1\r\nx\r\n")
            await writer.drain()
            await asyncio.sleep(0.15)
        writer.write(b"0\r\n\r\n")
        await writer.drain()

    async with _server(trickle) as upstream, _pool(idle_read=0.4) as pool:
        assert await asyncio.wait_for(_post(pool, upstream.port, b"{}"), 10) == b"x" * 8


async def test_a_closed_connection_is_not_kept_alive_by_its_read_timer() -> None:
    async def stall(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 10\r\n\r\n")
        await writer.drain()
        await asyncio.sleep(3)

    freed: list[str] = []
    async with _server(stall) as upstream, _pool(idle_read=60) as pool:
        target = UpstreamTarget(f"http://127.0.0.1:{upstream.port}")
        answer = await pool.request(target, "GET", "/", {})
        read = asyncio.create_task(answer.read())
        await asyncio.sleep(0.05)  # the read waits: its timer is armed
        conn = answer._conn
        assert conn is not None
        weakref.finalize(conn, freed.append, "connection")
        del conn
        read.cancel()
        answer.close()
        with contextlib.suppress(asyncio.CancelledError):
            await read
        del read, answer
        for _ in range(1000):  # bounded (10 s): the transport lets go on its next loop turn
            if freed:
                break
            await asyncio.sleep(0.01)
    assert freed == ["connection"]


def test_address_families_alternate_the_first_family_first() -> None:
    v6 = [(socket.AF_INET6, 1, 6, (f"::{n}", 1, 0, 0)) for n in (1, 2)]
    v4 = [(socket.AF_INET, 1, 6, (f"10.0.0.{n}", 1)) for n in (1, 2, 3)]
    order = [a[3][0] for a in _connect._interleave([*v6, *v4])]
    assert order == ["::1", "10.0.0.1", "::2", "10.0.0.2", "10.0.0.3"]


async def test_a_host_name_is_resolved_once_per_ttl_and_every_address_failing_says_refused(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Two addresses, both refusing: the error is the first address's (refused, in our
    words, naming the host); a second connect within the TTL asks no resolver."""
    async with _server(_keep_alive_ok) as upstream:
        port = upstream.port  # closed on leaving: both addresses refuse
    loop = asyncio.get_running_loop()
    asked: list[str] = []

    async def resolve(host: str, *args: Any, **kwargs: Any) -> Any:
        asked.append(host)
        return [
            (socket.AF_INET, socket.SOCK_STREAM, 6, "", ("127.0.0.1", port)),
            (socket.AF_INET, socket.SOCK_STREAM, 6, "", ("127.0.0.1", port)),
        ]

    monkeypatch.setattr(loop, "getaddrinfo", resolve)
    async with _pool() as pool:
        for _ in range(2):
            with pytest.raises(ConnectFailed) as raised:
                await _post(pool, port, b"{}", host="upstream.test")
            assert str(raised.value) == f"upstream refused the connection at upstream.test:{port}"
    assert asked == ["upstream.test"]


# -----------------------------------------------------------------------------
# A ``Keep-Alive`` timeout given as a quoted string is honoured.
#
# RFC 2068 section 19.7.1.1 defines ``keep-alive-param = attribute "=" value``,
# whose value may be a quoted-string (as in ``Keep-Alive: timeout="5"``). Read as
# no timeout, the connection would be kept the pool's own 15 s, and every reuse
# between 5 and 15 s idle would cross the upstream's close.


@pytest.mark.parametrize("value", ['timeout="5"', 'timeout="5", max=100'])
def test_a_quoted_keep_alive_timeout_bounds_the_idle_time(value: str) -> None:
    conn = ClientConnection()
    conn.send_head(Request("GET", "/", []))
    conn.receive_data(
        b"HTTP/1.1 200 OK\r\nKeep-Alive: %s\r\nContent-Length: 0\r\n\r\n" % value.encode()
    )
    assert conn.ended and conn.keep_alive
    assert conn.keep_alive_s == 4.0

"""The server edge on real sockets (proxy/_front.py, _listener.py, _request.py).

With handlers of the test's own, or a proxy in front of the emulator: framing of
answers (``HEAD`` included), keep-alive and its idle deadline, body
backpressure, a refusal lingering for a client still uploading, pipelined heads
and their memory, h2c upgrade requests, ``Expect``, a client that hangs up
cancelling its handler, and shutdown. Each section below keeps the account of
the finding it pins.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import socket
import time
import tracemalloc
from collections.abc import AsyncIterator
from typing import Final

import anthropic
import openai
import pytest
import uvloop
from multidict import CIMultiDict

from proxy import _front, _http1
from proxy._answer import SmallAnswer
from proxy._front import Handler, StreamAnswer
from proxy._http1 import END, MAX_HEAD_BYTES, MalformedRequest, RequestFraming, RequestHead
from proxy._listener import FrontServer
from proxy._request import BODY_HIGH_WATER, Request
from proxy.testing import Harness, proxy_with_emulator
from tests.exchange.test_commit_refused import Recorder
from tests.support.e2e import CHAT_PATH, RawClient, exact_body, stream_body, wait_until
from tests.support.upstream import Scripted, proxy_for, read_request

# -----------------------------------------------------------------------------
# The server edge's connection driver on real sockets (proxy/_front.py), with handlers of
# the test's own: framing of answers, keep-alive, its idle deadline, body backpressure, a
# client that hangs up cancelling its handler, shutdown.


@contextlib.asynccontextmanager
async def serving(handler: Handler, **options: float) -> AsyncIterator[tuple[FrontServer, int]]:
    server = FrontServer(handler, header_timeout=options.pop("header_timeout", 5.0), **options)
    port = await server.start("127.0.0.1", 0)
    try:
        yield server, port
    finally:
        await server.shutdown(grace=1.0)


async def exchange(
    port: int, data: bytes, *, until_close: bool = False, head_only: bool = False
) -> bytes:
    """Send ``data``; read one answer (its head alone, or everything until the server closes)."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        writer.write(data)
        if until_close:
            async with asyncio.timeout(5):
                return await reader.read(-1)
        async with asyncio.timeout(5):
            head = await reader.readuntil(b"\r\n\r\n")
            if head_only:
                return head
            length = int(head.lower().split(b"content-length: ")[1].split(b"\r\n")[0])
            return head + await reader.readexactly(length)
    finally:
        writer.close()


async def small(request: Request) -> SmallAnswer:
    return SmallAnswer(body=b"hello", content_type="text/plain")


async def test_a_small_answer_has_its_length_a_date_and_no_body_for_head() -> None:
    async with serving(small) as (_, port):
        got = await exchange(port, b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")
        head = await exchange(port, b"HEAD / HTTP/1.1\r\nHost: x\r\n\r\n", head_only=True)
    assert got.startswith(b"HTTP/1.1 200 OK\r\n") and got.endswith(b"\r\n\r\nhello")
    assert b"Content-Length: 5\r\n" in got and b"\r\nDate: " in got
    assert b"Content-Length: 5\r\n" in head and head.endswith(b"\r\n\r\n")


async def streamed(request: Request) -> StreamAnswer:
    answer = StreamAnswer(200, CIMultiDict({"Content-Type": "text/event-stream"}))
    await answer.prepare(request)
    for n in range(3):
        await answer.write(b"data: %d\n\n" % n)
    await answer.write_eof()
    return answer


async def whole(request: Request) -> StreamAnswer:
    answer = StreamAnswer(200, CIMultiDict({"Content-Type": "application/json"}))
    await answer.prepare(request)
    await answer.write_eof(b'{"ok":true}')
    return answer


async def test_a_stream_is_chunked_to_http11_and_ends_with_the_connection_to_http10() -> None:
    async with serving(streamed) as (_, port):
        new = await exchange(
            port, b"GET / HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n", until_close=True
        )
        old = await exchange(port, b"GET / HTTP/1.0\r\n\r\n", until_close=True)
    assert b"Transfer-Encoding: chunked\r\n" in new
    assert new.endswith(
        b"\r\n\r\n9\r\ndata: 0\n\n\r\n9\r\ndata: 1\n\n\r\n9\r\ndata: 2\n\n\r\n0\r\n\r\n"
    )
    assert b"Transfer-Encoding" not in old and b"Content-Length" not in old
    assert old.endswith(b"\r\n\r\ndata: 0\n\ndata: 1\n\ndata: 2\n\n")


async def test_an_answer_whole_at_its_head_goes_with_its_length_in_one_piece() -> None:
    async with serving(whole) as (_, port):
        got = await exchange(port, b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")
    assert b"Content-Length: 11\r\n" in got and b"chunked" not in got
    assert got.endswith(b'\r\n\r\n{"ok":true}')


async def test_requests_share_a_kept_connection_and_an_idle_one_is_closed() -> None:
    async with serving(small, keepalive_timeout=0.3) as (server, port):
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        try:
            for _ in range(3):
                writer.write(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")
                async with asyncio.timeout(5):
                    head = await reader.readuntil(b"\r\n\r\n")
                    await reader.readexactly(5)
                assert b"Connection: close" not in head
            assert len(server.connections) == 1
            async with asyncio.timeout(5):
                assert await reader.read(-1) == b""  # closed by the idle deadline
        finally:
            writer.close()


async def test_an_unread_body_pauses_the_client_instead_of_piling_up() -> None:
    gate = asyncio.Event()
    seen: list[int] = []

    async def slow_reader(request: Request) -> SmallAnswer:
        await gate.wait()
        total = 0
        while chunk := await request.content.read(65536):
            total += len(chunk)
        seen.append(total)
        return SmallAnswer(body=b"done")

    size = 32 * 1024 * 1024
    async with serving(slow_reader) as (server, port):
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        try:
            writer.write(b"POST / HTTP/1.1\r\nHost: x\r\nContent-Length: %d\r\n\r\n" % size)
            sent = 0
            piece = b"x" * (1024 * 1024)
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(1.0):
                    while sent < size:  # bounded: stops when the proxy stops reading
                        writer.write(piece)
                        sent += len(piece)
                        await writer.drain()
            (conn,) = server.connections
            buffered = sum(len(p) for p in conn._current.content._parts)  # type: ignore[union-attr]
            assert sent < size, "the upload was never held back"
            assert buffered <= 1024 * 1024, buffered
            gate.set()
            writer.write(b"x" * (size - sent))
            async with asyncio.timeout(10):
                head = await reader.readuntil(b"\r\n\r\n")
            assert head.startswith(b"HTTP/1.1 200")
        finally:
            writer.close()
    assert seen == [size]


async def test_a_client_that_hangs_up_cancels_its_handler() -> None:
    started = asyncio.Event()
    outcome: list[str] = []

    async def waits(request: Request) -> SmallAnswer:
        started.set()
        try:
            await asyncio.sleep(30)
        except asyncio.CancelledError:
            outcome.append("cancelled")
            raise
        return SmallAnswer(body=b"late")

    done: list[int] = []
    server = FrontServer(waits, header_timeout=5.0, on_request_done=lambda: done.append(1))
    port = await server.start("127.0.0.1", 0)
    try:
        _, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")
        async with asyncio.timeout(5):
            await started.wait()
        writer.close()
        for _ in range(1000):  # bounded: 10 s (a loaded machine)
            if outcome and done:
                break
            await asyncio.sleep(0.01)
        assert outcome == ["cancelled"]
        assert not server.connections
        assert done == [1], "an answer ended by a hang-up is done too (the idle trim runs)"
    finally:
        await server.shutdown(grace=1.0)


async def test_a_client_that_shuts_only_its_sending_side_is_taken_as_gone() -> None:
    """Deliberate, and surprising: a client that sends a whole request and then shuts its
    sending side (``shutdown(SHUT_WR)``, ``nc -N``) gets no answer. Its FIN is the one sign
    of a hang-up the socket gives (a client that closed entirely sends the same FIN
    first), and a gone client must cost nothing from that moment on (docs/design.md), so
    its handler is cancelled and the connection closed, as aiohttp's server did."""
    started = asyncio.Event()
    outcome: list[str] = []

    async def answers_soon(request: Request) -> SmallAnswer:
        started.set()
        try:
            await asyncio.sleep(0.5)
        except asyncio.CancelledError:
            outcome.append("cancelled")
            raise
        return SmallAnswer(body=b"late")

    async with serving(answers_soon) as (server, port):
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        try:
            writer.write(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")
            async with asyncio.timeout(5):
                await started.wait()
            writer.write_eof()
            async with asyncio.timeout(5):
                answer = await reader.read(-1)
        finally:
            writer.close()
        assert answer == b""
        assert outcome == ["cancelled"]
        await wait_until(lambda: not server.connections, "the connection is closed")


async def test_an_answer_returned_after_the_client_hung_up_is_dropped_without_an_error(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """The app answers a cancel that is an orderly stop (the drain) with a 503 instead of
    raising. When the client hangs up after the drain's cancel and before the handler
    runs on, the hang-up's own cancel is absorbed by the first, and that 503 comes back
    for a connection already gone. It is dropped: writing its head raised ``StateError``
    out of the request's task, logged as "Task exception was never retrieved"."""
    started = asyncio.Event()

    async def stops_in_order(request: Request) -> SmallAnswer:
        started.set()
        try:
            await asyncio.sleep(30)
        except asyncio.CancelledError:
            task = asyncio.current_task()
            assert task is not None
            task.uncancel()  # as the app does for an orderly stop
            return SmallAnswer(503, body=b"stopping", close=True)
        return SmallAnswer(body=b"late")

    done: list[int] = []
    server = FrontServer(stops_in_order, header_timeout=5.0, on_request_done=lambda: done.append(1))
    port = await server.start("127.0.0.1", 0)
    try:
        _, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")
        async with asyncio.timeout(5):
            await started.wait()
        (conn,) = server.connections
        task = conn.task
        assert task is not None
        writer.transport.abort()
        await wait_until(lambda: task.done(), "the handler's task ended")
        assert task.exception() is None
        assert done == [1]
        await wait_until(lambda: not server.connections, "the connection is gone")
    finally:
        await server.shutdown(grace=1.0)


async def test_a_client_that_takes_nothing_of_its_answer_is_cut_at_the_send_timeout(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A client that stops reading without closing (a stuck process, a suspended agent)
    fills its socket: the stream waits for it to make room. With no bound it waited
    forever, holding its exchange, its upstream connection and two descriptors (the
    upstream's idle-read deadline does not run: nothing is being read). Taking nothing
    for ``SEND_TIMEOUT`` seconds (nginx's ``send_timeout``) ends it as a hang-up."""
    monkeypatch.setattr(_front, "SEND_TIMEOUT", 0.5, raising=False)
    outcome: list[str] = []

    async def endless(request: Request) -> StreamAnswer:
        answer = StreamAnswer(200, CIMultiDict({"Content-Type": "text/event-stream"}))
        await answer.prepare(request)
        try:
            for _ in range(100_000):  # bounded: far more than any socket buffer
                await answer.write(b"data: " + b"x" * 16_000 + b"\n\n")
        except ConnectionError:
            outcome.append("cut")
            raise
        return answer

    async with serving(endless) as (server, port):
        _, writer = await asyncio.open_connection("127.0.0.1", port)
        try:
            writer.transport.pause_reading()  # it reads nothing from here on
            writer.write(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")
            started = time.monotonic()
            await wait_until(lambda: bool(outcome), "the stream was cut")
            elapsed = time.monotonic() - started
            await wait_until(lambda: not server.connections, "the connection is closed")
        finally:
            writer.close()
    assert outcome == ["cut"]
    assert elapsed < 8.0, elapsed  # the 0.5 s bound once the socket filled (loaded machine)


async def test_a_slow_reader_that_keeps_taking_its_answer_is_not_cut(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The send timeout is about a client taking nothing: one reading slowly but steadily
    (here 40 KiB/s, through small socket buffers) gets its whole answer, however long the
    transport's buffer takes to fall to its low-water mark."""
    monkeypatch.setattr(_front, "SEND_TIMEOUT", 0.5, raising=False)
    outcome: list[str] = []
    piece = b"x" * 2048
    pieces = 60

    async def steady(request: Request) -> StreamAnswer:
        transport = request.transport
        assert transport is not None
        transport.get_extra_info("socket").setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 8192)
        answer = StreamAnswer(200, CIMultiDict({"Content-Type": "text/plain"}))
        await answer.prepare(request)
        try:
            for _ in range(pieces):
                await answer.write(piece)
            await answer.write_eof()
        except ConnectionError:
            outcome.append("cut")
            raise
        outcome.append("done")
        return answer

    async with serving(steady) as (_server, port):
        sock = socket.socket()
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 8192)
        sock.setblocking(False)
        await asyncio.get_running_loop().sock_connect(sock, ("127.0.0.1", port))
        reader, writer = await asyncio.open_connection(sock=sock, limit=4096)
        received = 0
        try:
            writer.write(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")
            async with asyncio.timeout(30):
                for _ in range(10_000):  # bounded: 4 KiB every 0.1 s until the end
                    data = await reader.read(4096)
                    if not data or outcome:
                        break
                    received += len(data)
                    await asyncio.sleep(0.1)
        finally:
            writer.close()
    assert outcome == ["done"], f"{received} bytes taken before the cut"


async def test_shutdown_closes_idle_connections_and_lets_a_busy_one_finish() -> None:
    release = asyncio.Event()

    async def busy(request: Request) -> SmallAnswer:
        await release.wait()
        return SmallAnswer(body=b"finished")

    server = FrontServer(busy, header_timeout=5.0)
    port = await server.start("127.0.0.1", 0)
    idle_r, idle_w = await asyncio.open_connection("127.0.0.1", port)
    busy_r, busy_w = await asyncio.open_connection("127.0.0.1", port)
    busy_w.write(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")
    await asyncio.sleep(0.05)
    stopping = asyncio.create_task(server.shutdown(grace=5.0))
    async with asyncio.timeout(5):
        assert await idle_r.read(-1) == b""
    release.set()
    async with asyncio.timeout(5):
        answer = await busy_r.read(-1)
        await stopping
    assert answer.startswith(b"HTTP/1.1 200") and b"Connection: close\r\n" in answer
    assert answer.endswith(b"finished")
    idle_w.close()
    busy_w.close()


async def test_a_handler_that_raises_gets_its_client_a_json_500_and_the_answer_is_done() -> None:
    done: list[int] = []

    async def broken(request: Request) -> SmallAnswer:
        raise RuntimeError("a bug")

    server = FrontServer(broken, header_timeout=5.0, on_request_done=lambda: done.append(1))
    port = await server.start("127.0.0.1", 0)
    try:
        got = await exchange(port, b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n", until_close=True)
    finally:
        await server.shutdown(grace=1.0)
    head, _, body = got.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 500 ") and b"Connection: close" in head
    assert b'"code":"internal_error"' in body.replace(b" ", b"") and b"a bug" not in body
    assert done == [1]


@pytest.mark.parametrize(
    "field", [("X-Bad", "a\r\nInjected: yes"), ("X-Bad", "a\nb"), ("X\rY", "1")]
)
async def test_a_field_with_a_line_break_never_splits_the_answer(field: tuple[str, str]) -> None:
    async def splitting(request: Request) -> SmallAnswer:
        return SmallAnswer(body=b"x", headers={field[0]: field[1]})

    async with serving(splitting) as (_, port):
        got = await exchange(port, b"GET / HTTP/1.1\r\nHost: x\r\n\r\n", until_close=True)
    assert b"Injected" not in got
    assert got.startswith(b"HTTP/1.1 500 ")


# -----------------------------------------------------------------------------
# The answer to a ``HEAD`` request relayed from an upstream (proxy/_front.py, ``StreamAnswer``).
#
# RFC 9110 §8.6: a server MUST NOT send ``Content-Length`` in an answer to
# ``HEAD`` unless it equals the length a ``GET`` would get. The relay writes no
# body for a ``HEAD`` (the upstream sent none), so the count of bytes written
# is 0 whatever the resource's size: the proxy said ``Content-Length: 0`` for a
# file the upstream said was 1234 bytes. A client asking its size with ``HEAD``
# was told it is empty. (The upstream's own length cannot be passed on: the
# proxy decodes content codings.) The kept connection still serves the next
# request.


async def test_a_head_answer_does_not_claim_an_empty_body() -> None:
    async def files(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, n: int) -> None:
        for _ in range(10):  # bounded
            head, _body = await read_request(reader)
            if head.startswith(b"HEAD "):
                writer.write(
                    b"HTTP/1.1 200 OK\r\nContent-Type: text/plain\r\nContent-Length: 1234\r\n\r\n"
                )
            else:
                writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\n{}")
            await writer.drain()

    async with Scripted(files) as upstream, proxy_for(upstream.url) as url:
        host, _, port = url.removeprefix("http://").partition(":")
        reader, writer = await asyncio.open_connection(host, int(port))
        try:
            writer.write(
                b"HEAD /v1/files/f1/content HTTP/1.1\r\nHost: x\r\n\r\n"
                b"GET /v1/models HTTP/1.1\r\nHost: x\r\n\r\n"
            )
            async with asyncio.timeout(5):
                head = await reader.readuntil(b"\r\n\r\n")
                after = await reader.readuntil(b"\r\n\r\n")
                body = await reader.readexactly(2)
        finally:
            writer.close()
    assert head.startswith(b"HTTP/1.1 200 OK\r\n")
    assert b"content-length: 0\r\n" not in head.lower()
    assert after.startswith(b"HTTP/1.1 200 OK\r\n") and body == b"{}"


# -----------------------------------------------------------------------------
# A whole request pipelined ahead of malformed bytes is answered and committed.
#
# The client's bytes may arrive in one read or several: the outcome must not
# depend on where the segments fall. Before, a request and the bad bytes behind
# it in one read were dropped together (no answer, no commit); in two reads the
# whole body was thrown away and the request booked as a client gone mid-body.


GARBAGE: Final = b"\x00GARBAGE\r\n\r\n"


async def _exchange(h: Harness, pieces: list[bytes]) -> bytes:
    """Send ``pieces`` (0.2 s apart) on one connection; all the proxy answered."""
    host, _, port = h.url.removeprefix("http://").partition(":")
    reader, writer = await asyncio.open_connection(host, int(port))
    try:
        for i, piece in enumerate(pieces):
            if i:
                await asyncio.sleep(0.2)
            writer.write(piece)
        async with asyncio.timeout(10):
            return await reader.read(-1)  # the proxy closes after its 400
    finally:
        writer.close()


def _post(body: bytes, length: int | None = None) -> bytes:
    return (
        b"POST %s HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        b"Content-Length: %d\r\n\r\n"
        % (CHAT_PATH.encode(), len(body) if length is None else length)
    )


@pytest.mark.parametrize("split", [False, True], ids=["one-read", "head-then-rest"])
async def test_a_request_pipelined_ahead_of_garbage_is_answered_and_committed(
    split: bool,
) -> None:
    body = exact_body(CHAT_PATH, 300)
    head = _post(body)
    pieces = [head, body + GARBAGE] if split else [head + body + GARBAGE]
    recorder = Recorder()
    async with proxy_with_emulator(plugins=[recorder]) as h:
        answer = await _exchange(h, pieces)
        await h.settle()
        assert answer.startswith(b"HTTP/1.1 200 OK\r\n"), answer[:200]
        assert answer.count(b"HTTP/1.1 400 ") == 1 and b"malformed_request" in answer
        assert [(r.outcome.value, r.status, r.request_bytes) for r in recorder.records] == [
            ("ok", 200, len(body))
        ]
        assert not h.state.exchanges


@pytest.mark.parametrize("split", [False, True], ids=["one-read", "head-then-rest"])
async def test_a_content_length_shorter_than_the_body_is_judged_on_the_declared_bytes(
    split: bool,
) -> None:
    """The declared 250 bytes are the request (cut JSON: 400 invalid_json, committed);
    the 50 after them are a malformed next request (400, close)."""
    body = exact_body(CHAT_PATH, 300)
    head = _post(body, 250)
    pieces = [head, body] if split else [head + body]
    recorder = Recorder()
    async with proxy_with_emulator(plugins=[recorder]) as h:
        answer = await _exchange(h, pieces)
        await h.settle()
        assert b"invalid_json" in answer and b"malformed_request" in answer, answer
        assert [
            (r.outcome.value, r.status, r.error, r.request_bytes) for r in recorder.records
        ] == [("rejected", 400, "invalid_json", 250)]


async def test_a_request_queued_behind_one_in_flight_is_answered_before_the_400() -> None:
    """The first request streams for a while; the second and the bad bytes come
    meanwhile: both requests are answered and committed, then the 400 closes."""
    slow = exact_body(CHAT_PATH, 300)
    quick = exact_body(CHAT_PATH, 200)
    first = (
        b"POST %s HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        b"x-emulator: stall_headers=0.5\r\nContent-Length: %d\r\n\r\n"
        % (CHAT_PATH.encode(), len(slow))
    ) + slow
    recorder = Recorder()
    async with proxy_with_emulator(plugins=[recorder]) as h:
        answer = await _exchange(h, [first, _post(quick) + quick + GARBAGE])
        await h.settle()
        assert answer.count(b"HTTP/1.1 200 OK\r\n") == 2, answer[:300]
        assert answer.rindex(b"HTTP/1.1 400 ") > answer.rindex(b"HTTP/1.1 200 OK")
        assert [(r.outcome.value, r.request_bytes) for r in recorder.records] == [
            ("ok", len(slow)),
            ("ok", len(quick)),
        ]


# -----------------------------------------------------------------------------
# An ``Expect`` other than ``100-continue`` is a 417 on every route, never a 500.
#
# Found by the HTTP fuzzer (tests/e2e/test_properties_http.py): aiohttp's own answer
# echoes the value into its 417 text and fails with a 500 when the value is not
# valid UTF-8 (``Expect: \x80``), on every route that is not the proxy's /v1 one,
# matched or not.


@pytest.mark.parametrize("value", [b"\x80", b"bogus", b"100-continue, x"])
async def test_an_unknown_expectation_is_417_on_every_path(value: bytes) -> None:
    async with proxy_with_emulator() as h:
        port = int(h.url.rsplit(":", 1)[1])
        for target, shape in [
            (b"/", "openai"),
            (b"/nope", "openai"),
            (b"/healthz", "openai"),
            (b"/admin/shutdown", "openai"),
            (b"/v1/chat/completions", "openai"),
            (b"/v1/messages?beta=true", "anthropic"),
        ]:
            reader, writer = await asyncio.open_connection("127.0.0.1", port)
            try:
                writer.write(
                    b"POST "
                    + target
                    + b" HTTP/1.1\r\nHost: 127.0.0.1\r\nExpect: "
                    + value
                    + b"\r\nContent-Length: 2\r\n\r\n{}"
                )
                async with asyncio.timeout(10):
                    head = await reader.readuntil(b"\r\n\r\n")
                    length = int(head.lower().split(b"content-length: ")[1].split(b"\r\n")[0])
                    body = json.loads(await reader.readexactly(length))
            finally:
                writer.close()
            assert head.startswith(b"HTTP/1.1 417 "), (target, head[:40])
            error = body["error"]
            assert error["message"] == "only Expect: 100-continue is supported"
            assert (body.get("type") == "error") == (shape == "anthropic")
        # The shutdown route was refused, not run.
        assert not h.state.draining


# -----------------------------------------------------------------------------
# A body paused for backpressure and never read (proxy/_front.py, ``BodyStream``).
#
# Unread body bytes over the high water pause reading the socket until the
# handler reads them. A handler may answer without reading a body that has all
# arrived (a 404 for an unknown ``/v1/`` route, a 405): the connection is kept
# (nothing of the request is left on the wire), but when the last read had
# brought the buffer over the high water, reading stayed paused. The client's
# next request on the kept connection was never read: it waited until the
# keep-alive timeout closed the connection (75 s). Both event loops.


BODY = b"x" * (BODY_HIGH_WATER + 100)  # over the high water in the read that ends it


async def _unread_then_next() -> list[bytes]:
    async def not_found(request: Request) -> SmallAnswer:
        if request.method == "POST":
            for _ in range(1000):  # bounded (10 s): the body arrives, and is not read
                if request.content.is_eof():
                    break
                await asyncio.sleep(0.01)
        return SmallAnswer(status=404, body=b"none")

    server = FrontServer(not_found, header_timeout=5.0)
    port = await server.start("127.0.0.1", 0)
    answers = []
    try:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(
            b"POST /v1/nowhere HTTP/1.1\r\nHost: x\r\nContent-Length: %d\r\n\r\n" % len(BODY)
        )
        writer.write(BODY)
        async with asyncio.timeout(3):
            answers.append(await reader.readuntil(b"none"))
            writer.write(b"GET /v1/nowhere HTTP/1.1\r\nHost: x\r\n\r\n")
            answers.append(await reader.readuntil(b"none"))
        writer.close()
    finally:
        await server.shutdown(grace=1.0)
    return answers


@pytest.mark.parametrize("loop", ["asyncio", "uvloop"])
def test_a_kept_connection_reads_on_after_an_unread_body_over_the_high_water(loop: str) -> None:
    factory = uvloop.new_event_loop if loop == "uvloop" else asyncio.new_event_loop
    with asyncio.Runner(loop_factory=factory) as runner:
        first, second = runner.run(_unread_then_next())
    assert first.startswith(b"HTTP/1.1 404 ") and b"Connection: close" not in first
    assert second.startswith(b"HTTP/1.1 404 ")


# -----------------------------------------------------------------------------
# A refusal sent before the body was read reaches a client still uploading (proxy/_front.py).
#
# The proxy refuses some requests from their head alone (413 for a declared
# length over ``max_body_bytes``, 415, 503 busy) and closes the connection, as
# the rest of the body cannot be told from a next request. A client such as the
# openai or anthropic SDK writes its whole body before it reads: a close with
# its bytes still arriving makes the kernel answer them with a reset, and the
# client sees a connection error (and retries, uploading again) instead of the
# 413. So the connection lingers, reading and dropping what comes, until the
# client is done or ``LINGER_TIMEOUT`` seconds have passed (aiohttp's server
# did the same for 10 s). Real SDKs and sockets on 127.0.0.1; every wait bounded.


LIMIT = 1024 * 1024
BIG = "x" * (8 * LIMIT)  # far more than the kernel's socket buffers take at once


async def test_the_sdks_get_the_413_of_a_body_over_the_limit_not_a_connection_error() -> None:
    async with proxy_with_emulator(max_body_bytes=LIMIT) as h:
        oai = openai.AsyncOpenAI(base_url=f"{h.url}/v1", api_key="sk-linger", max_retries=0)
        ant = anthropic.AsyncAnthropic(base_url=h.url, api_key="sk-linger", max_retries=0)
        try:
            with pytest.raises(openai.APIStatusError) as chat:
                await oai.chat.completions.create(
                    model="m", messages=[{"role": "user", "content": BIG}]
                )
            with pytest.raises(anthropic.APIStatusError) as messages:
                await ant.messages.create(
                    model="m", max_tokens=8, messages=[{"role": "user", "content": BIG}]
                )
        finally:
            await oai.close()
            await ant.close()
        assert chat.value.status_code == 413 and messages.value.status_code == 413
        assert h.emulator.stats == []


async def test_a_lingering_connection_is_closed_at_the_linger_timeout(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(_http1, "LINGER_TIMEOUT", 0.5)
    async with proxy_with_emulator(max_body_bytes=LIMIT) as h:
        host, _, port = h.url.removeprefix("http://").partition(":")
        reader, writer = await asyncio.open_connection(host, int(port))
        try:
            writer.write(
                f"POST {CHAT_PATH} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                f"Content-Length: {100 * LIMIT}\r\n\r\n".encode()
            )
            async with asyncio.timeout(5.0):
                head = await reader.readuntil(b"\r\n\r\n")
                started = time.monotonic()
                assert head.startswith(b"HTTP/1.1 413")
                length = int(head.lower().partition(b"content-length:")[2].split(b"\r\n")[0])
                await reader.readexactly(length)
                closed = asyncio.ensure_future(reader.read(1))
                # The client goes on uploading, a KiB per 20 ms (bounded: at least 10 s).
                for _ in range(500):
                    if closed.done():
                        break
                    try:
                        writer.write(b"x" * 1024)
                        await writer.drain()
                    except ConnectionError:
                        break
                    await asyncio.sleep(0.02)
                with contextlib.suppress(ConnectionError):
                    assert await closed == b""
                elapsed = time.monotonic() - started
        finally:
            writer.close()
        # Cut at the linger timeout (0.5 s), not by the client's 10 s of uploading; the
        # upper bound is generous for a loaded machine.
        assert 0.4 <= elapsed < 6.0, elapsed
        await wait_until(lambda: not h.state.exchanges, "no exchange is left")


async def test_a_request_pipelined_behind_a_refused_expect_is_taken_as_its_body(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Deliberate: a head with ``Expect: 100-continue`` whose declared body is over the
    limit gets its 413 (with ``Connection: close``) instead of ``100 Continue``. The
    client may still send that body (RFC 9110 §10.1.1 lets it), so what follows on the
    connection is read as the body and dropped while it lingers: a request a client
    pipelines behind it is never answered, and the connection closes at the linger
    timeout. The 413 said so: such a client retries on a new connection."""
    monkeypatch.setattr(_http1, "LINGER_TIMEOUT", 0.5)
    async with proxy_with_emulator(max_body_bytes=LIMIT) as h:
        host, _, port = h.url.removeprefix("http://").partition(":")
        reader, writer = await asyncio.open_connection(host, int(port))
        try:
            writer.write(
                f"POST {CHAT_PATH} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                f"Expect: 100-continue\r\nContent-Length: {2 * LIMIT}\r\n\r\n".encode()
            )
            async with asyncio.timeout(5.0):
                head = await reader.readuntil(b"\r\n\r\n")
            assert head.startswith(b"HTTP/1.1 413")
            assert b"connection: close" in head.lower()
            body = stream_body(CHAT_PATH)
            writer.write(
                f"POST {CHAT_PATH} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                f"Content-Length: {len(body)}\r\n\r\n".encode()
                + body
            )
            async with asyncio.timeout(5.0):
                rest = await reader.read(-1)
        finally:
            writer.close()
        length = int(head.lower().partition(b"content-length:")[2].split(b"\r\n")[0])
        # Nothing follows the 413's body: the pipelined request was dropped as body bytes.
        assert len(rest) == length
        assert h.emulator.stats == []
        await wait_until(lambda: not h.state.exchanges, "no exchange is left")


# -----------------------------------------------------------------------------
# The head limit (proxy/_front.py, ``MAX_HEAD_BYTES``) against pipelined requests.
#
# A client that pipelines (or any client whose next request follows a body in
# one read: uvloop reads up to 256 KiB at once) has the start of its next
# request's head at the end of a read full of earlier requests. Those bytes are
# not that head's: counted as such, the connection got a 400 "request head is
# over the size limit" for a 30-byte head. A head that really grows past the
# limit is still refused.


GET = b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n"
POST = b"POST /v1/x HTTP/1.1\r\nHost: x\r\nContent-Length: %d\r\n\r\n"


def test_a_read_full_of_pipelined_requests_ending_in_a_head_is_not_an_oversized_head() -> None:
    framing = RequestFraming()
    many = GET * (2 * MAX_HEAD_BYTES // len(GET))
    events = framing.feed(many + GET[:20])
    assert sum(isinstance(e, RequestHead) for e in events) == many.count(b"GET ")
    (head, _end) = framing.feed(GET[20:])
    assert isinstance(head, RequestHead) and head.path == "/health"


def test_a_large_body_then_the_next_head_in_one_read_is_not_an_oversized_head() -> None:
    framing = RequestFraming()
    body = b"x" * (2 * MAX_HEAD_BYTES)
    framing.feed(POST % len(body) + body + GET[:20])
    (head, _end) = framing.feed(GET[20:])
    assert isinstance(head, RequestHead) and head.path == "/health"


def test_a_head_begun_behind_a_request_that_grows_past_the_limit_is_still_refused() -> None:
    framing = RequestFraming()
    framing.feed(GET + b"GET / HTTP/1.1\r\nHost: x\r\nX-Endless: ")
    with pytest.raises(MalformedRequest, match="over the size limit"):
        for _ in range(MAX_HEAD_BYTES // 1024 + 2):  # bounded: one more than the limit
            framing.feed(b"a" * 1024)
    framing = RequestFraming()
    fields = b"".join(b"X-Pad-%d: %s\r\n" % (i, b"p" * 1000) for i in range(100))
    with pytest.raises(MalformedRequest, match="over the size limit"):
        framing.feed(GET + b"GET / HTTP/1.1\r\nHost: x\r\n" + fields)


async def _pipeline(count: int) -> bytes:
    """``count`` GETs written at once on one connection; what came back."""

    async def ok(request: Request) -> SmallAnswer:
        return SmallAnswer(body=b"ok")

    server = FrontServer(ok, header_timeout=5.0)
    port = await server.start("127.0.0.1", 0)
    got = b""
    try:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(GET * count)
        async with asyncio.timeout(10):
            for _ in range(100 * count):  # bounded
                if got.count(b"HTTP/1.1 ") >= count:
                    break
                piece = await reader.read(65536)
                if not piece:
                    break
                got += piece
        writer.close()
    finally:
        await server.shutdown(grace=1.0)
    return got


@pytest.mark.parametrize("loop", ["asyncio", "uvloop"])
def test_a_pipelining_client_gets_every_answer(loop: str) -> None:
    """uvloop reads what the socket holds, up to 256 KiB: the pipeline arrives in one read."""
    count = 3 * MAX_HEAD_BYTES // len(GET)
    factory = uvloop.new_event_loop if loop == "uvloop" else asyncio.new_event_loop
    with asyncio.Runner(loop_factory=factory) as runner:
        got = runner.run(_pipeline(count))
    assert b" 400 " not in got
    assert got.count(b"HTTP/1.1 200 OK") == count


# -----------------------------------------------------------------------------
# Memory of a connection flooded with pipelined requests (proxy/_front.py).
#
# One request is handled at a time; those pipelined behind it wait in a queue,
# and reading pauses once a few wait. But a single read was parsed whole: on
# uvloop a read takes all the socket holds, up to 256 KiB, which is ~6,000
# requests of a 40-byte head, each a ~1 KiB object (head, fields, body stream)
# once parsed. 256 KiB sent made ~6.5 MiB resident per connection: a client
# could make the proxy hold 25 times what it sends. A read is now parsed a
# slice at a time and the parse stops behind a full queue; the rest waits as
# the bytes it is. Every request is still answered, in order.


GET_NUMBERED = b"GET /health HTTP/1.1\r\nHost: x\r\nA: %d\r\n\r\n"
COUNT = 10_000
PIECES = 10


async def _flood() -> tuple[list[int], int]:
    """COUNT numbered GETs written as fast as the socket takes them; the numbers in
    the answers, in order, and the traced peak (bytes) while they are served."""

    async def numbered(request: Request) -> SmallAnswer:
        await asyncio.sleep(0)
        return SmallAnswer(body=b"<%s>" % request.headers["A"].encode())

    server = FrontServer(numbered, header_timeout=5.0)
    port = await server.start("127.0.0.1", 0)
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    per_piece = COUNT // PIECES

    async def send() -> None:
        for n in range(PIECES):
            first = n * per_piece
            writer.write(b"".join(GET_NUMBERED % (first + i) for i in range(per_piece)))
            await writer.drain()

    numbers: list[int] = []
    tracemalloc.start()
    sending = asyncio.ensure_future(send())
    try:
        rest = b""
        async with asyncio.timeout(30):
            for _ in range(COUNT):  # bounded
                if len(numbers) >= COUNT:
                    break
                piece = await reader.read(1 << 16)
                if not piece:
                    break
                rest += piece
                *bodies, rest = rest.split(b">")
                numbers += [int(body.rpartition(b"<")[2]) for body in bodies]
        peak = tracemalloc.get_traced_memory()[1]
        await sending
    finally:
        tracemalloc.stop()
        writer.close()
        await server.shutdown(grace=1.0)
    return numbers, peak


@pytest.mark.parametrize("loop", ["asyncio", "uvloop"])
def test_a_pipelined_flood_is_answered_in_order_in_bounded_memory(loop: str) -> None:
    factory = uvloop.new_event_loop if loop == "uvloop" else asyncio.new_event_loop
    with asyncio.Runner(loop_factory=factory) as runner:
        bodies, peak = runner.run(_flood())
    assert bodies == list(range(COUNT))
    # The client's writes and reads are traced too (~0.3 MiB).
    assert peak < 2 * 1024 * 1024, f"peak {peak / 2**20:.1f} MiB"


# -----------------------------------------------------------------------------
# Shutting the server edge down loses no byte of an answer that ended in time (proxy/_front.py).
#
# A client behind a slow link reads an answer slower than the proxy writes it:
# when the handler is done, the last bytes (up to asyncio's low-water mark, or
# more) still sit in the transport's buffer, flushed as the client takes them.
# :meth:`FrontServer.shutdown` gives busy connections ``grace`` seconds to
# finish their answer; that includes those bytes, else the client gets a stream
# without its end (no ``[DONE]``, no last chunk). The slow link is a small
# kernel send buffer on the server's socket and a small receive window on the
# client's; real sockets on 127.0.0.1, every wait bounded.


PIECE = b"x" * 16 * 1024
SLOW_PIECES = 32  # 512 KiB: far more than the slow link's buffers hold
WITHIN = 10.0


async def _long_answer(request: Request) -> StreamAnswer:
    transport = request.transport
    assert transport is not None
    # The slow link: the kernel holds little, the rest waits in the transport's buffer.
    transport.get_extra_info("socket").setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 8192)
    answer = StreamAnswer(200, CIMultiDict({"Content-Type": "text/event-stream"}))
    await answer.prepare(request)
    for _ in range(SLOW_PIECES):
        await answer.write(PIECE)
    await answer.write_eof(b"data: [DONE]\n\n")
    return answer


def _dechunk(data: bytes) -> bytes:
    body = bytearray()
    while True:
        size_line, _, data = data.partition(b"\r\n")
        size = int(size_line, 16)
        if size == 0:
            assert data == b"\r\n", "the last chunk is not the end of the answer"
            return bytes(body)
        body += data[:size]
        assert data[size : size + 2] == b"\r\n"
        data = data[size + 2 :]


async def test_an_answer_that_ended_in_the_grace_reaches_a_slow_client_whole() -> None:
    server = FrontServer(_long_answer, header_timeout=5.0)
    port = await server.start("127.0.0.1", 0)
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    sock.setblocking(False)
    loop = asyncio.get_running_loop()
    shutdown: asyncio.Task[None] | None = None
    try:
        await loop.sock_connect(sock, ("127.0.0.1", port))
        await loop.sock_sendall(sock, b"GET /stream HTTP/1.1\r\nHost: x\r\n\r\n")
        await asyncio.sleep(0.3)  # the handler now waits on the slow client
        shutdown = asyncio.create_task(server.shutdown(grace=WITHIN / 2))
        received = bytearray()
        async with asyncio.timeout(WITHIN):
            while piece := await loop.sock_recv(sock, 65536):
                received += piece
            await shutdown
    finally:
        sock.close()
        if shutdown is not None and not shutdown.done():
            shutdown.cancel()
    head, _, body = bytes(received).partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 200") and b"Transfer-Encoding: chunked" in head
    assert _dechunk(body) == PIECE * SLOW_PIECES + b"data: [DONE]\n\n"
    assert not server.connections


# -----------------------------------------------------------------------------
# A request asking for h2c with its body is answered as HTTP/1.1, body and all (proxy/_front.py).
#
# curl ``--http2`` on an ``http://`` URL and Java's HttpClient (HTTP/2 by
# default) send ``Connection: Upgrade, HTTP2-Settings`` and ``Upgrade: h2c`` on
# a POST, with its body right behind the head. The proxy upgrades to nothing;
# RFC 9110 §7.8 lets a server ignore the field, and aiohttp's server did: the
# request is an ordinary one, its body read whole, the connection kept. llhttp
# reports the upgrade at the end of the head and httptools then skips the body,
# so the framing must take the body back itself.


H2C = (
    "Connection: Upgrade, HTTP2-Settings\r\nUpgrade: h2c\r\n"
    "HTTP2-Settings: AAMAAABkAARAAAAAAAIAAAAA\r\n"
)


def _post_upgrade(body: bytes, framing: str) -> bytes:
    return (f"POST {CHAT_PATH} HTTP/1.1\r\nHost: x\r\n{H2C}{framing}\r\n").encode() + body


def test_the_body_of_an_h2c_upgrade_request_is_framed_and_the_next_request_too() -> None:
    body = b'{"model":"m"}'
    sized = _post_upgrade(body, f"Content-Length: {len(body)}\r\n")
    chunked = _post_upgrade(
        b"%x\r\n%s\r\n0\r\n\r\n" % (len(body), body), "Transfer-Encoding: chunked\r\n"
    )
    get = b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n"
    for data in (sized + get, chunked + get):
        for step in (None, 1):
            framing = RequestFraming()
            events: list[object] = []
            if step is None:
                events = list(framing.feed(data))
            else:
                for i in range(len(data)):
                    events += framing.feed(data[i : i + 1])
            heads = [e for e in events if isinstance(e, RequestHead)]
            assert [h.path for h in heads] == [CHAT_PATH, "/healthz"]
            assert b"".join(e for e in events if isinstance(e, bytes)) == body
            assert [e for e in events if e is END] == [END, END]
            assert not framing.upgraded


async def test_an_h2c_upgrade_post_gets_its_answer_on_a_kept_connection() -> None:
    async with proxy_with_emulator() as h:
        body = stream_body(CHAT_PATH, stream=False)
        client = await RawClient.connect(h.url)
        try:
            await client.send(_post_upgrade(body, f"Content-Length: {len(body)}\r\n"))
            async with asyncio.timeout(5.0):
                head = await client.read_head()
                answer = json.loads(await client.read_body(head))
                await client.request("GET", "/healthz", b"")
                again = await client.read_head()
                await client.read_body(again)
        finally:
            await client.close()
        assert head.status == 200 and answer["object"] == "chat.completion"
        assert again.status == 200
        assert h.emulator.stats[0].body_bytes == len(body)

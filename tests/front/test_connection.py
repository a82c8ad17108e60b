"""The server edge's connection driver on real sockets (proxy/_front.py), with handlers of
the test's own: framing of answers, keep-alive, its idle deadline, body backpressure, a
client that hangs up cancelling its handler, shutdown."""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator
from typing import Final

import pytest
from multidict import CIMultiDict

from proxy._answer import SmallAnswer
from proxy._front import Handler, Request, StreamAnswer
from proxy._listener import FrontServer
from proxy.testing import Harness, proxy_with_emulator
from tests.exchange.test_commit_refused import Recorder
from tests.support.e2e import CHAT_PATH, exact_body
from tests.support.upstream import Scripted, proxy_for, read_request

pytestmark = pytest.mark.asyncio


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

"""The server edge's connection driver on real sockets (proxy/_front.py), with handlers of
the test's own: framing of answers, keep-alive, its idle deadline, body backpressure, a
client that hangs up cancelling its handler, shutdown."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator

import pytest
from multidict import CIMultiDict

from proxy._answer import SmallAnswer
from proxy._front import Handler, Request, StreamAnswer
from proxy._listener import FrontServer

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

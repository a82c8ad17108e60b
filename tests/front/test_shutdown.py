"""Shutting the server edge down loses no byte of an answer that ended in time (proxy/_front.py).

A client behind a slow link reads an answer slower than the proxy writes it:
when the handler is done, the last bytes (up to asyncio's low-water mark, or
more) still sit in the transport's buffer, flushed as the client takes them.
:meth:`FrontServer.shutdown` gives busy connections ``grace`` seconds to
finish their answer; that includes those bytes, else the client gets a stream
without its end (no ``[DONE]``, no last chunk). The slow link is a small
kernel send buffer on the server's socket and a small receive window on the
client's; real sockets on 127.0.0.1, every wait bounded.
"""

from __future__ import annotations

import asyncio
import socket

from multidict import CIMultiDict

from proxy._front import Request, StreamAnswer
from proxy._listener import FrontServer

PIECE = b"x" * 16 * 1024
PIECES = 32  # 512 KiB: far more than the slow link's buffers hold
WITHIN = 10.0


async def _long_answer(request: Request) -> StreamAnswer:
    transport = request.transport
    assert transport is not None
    # The slow link: the kernel holds little, the rest waits in the transport's buffer.
    transport.get_extra_info("socket").setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 8192)
    answer = StreamAnswer(200, CIMultiDict({"Content-Type": "text/event-stream"}))
    await answer.prepare(request)
    for _ in range(PIECES):
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
    assert _dechunk(body) == PIECE * PIECES + b"data: [DONE]\n\n"
    assert not server.connections

"""A body paused for backpressure and never read (proxy/_front.py, ``BodyStream``).

Unread body bytes over the high water pause reading the socket until the
handler reads them. A handler may answer without reading a body that has all
arrived (a 404 for an unknown ``/v1/`` route, a 405): the connection is kept
(nothing of the request is left on the wire), but when the last read had
brought the buffer over the high water, reading stayed paused. The client's
next request on the kept connection was never read: it waited until the
keep-alive timeout closed the connection (75 s). Both event loops.
"""

from __future__ import annotations

import asyncio

import pytest
import uvloop

from proxy._answer import SmallAnswer
from proxy._listener import FrontServer
from proxy._request import BODY_HIGH_WATER, Request

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

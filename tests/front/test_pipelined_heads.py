"""The head limit (proxy/_front.py, ``MAX_HEAD_BYTES``) against pipelined requests.

A client that pipelines (or any client whose next request follows a body in
one read: uvloop reads up to 256 KiB at once) has the start of its next
request's head at the end of a read full of earlier requests. Those bytes are
not that head's: counted as such, the connection got a 400 "request head is
over the size limit" for a 30-byte head. A head that really grows past the
limit is still refused.
"""

from __future__ import annotations

import asyncio

import pytest
import uvloop

from proxy._answer import SmallAnswer
from proxy._front import Request
from proxy._http1 import MAX_HEAD_BYTES, MalformedRequest, RequestFraming, RequestHead
from proxy._listener import FrontServer

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

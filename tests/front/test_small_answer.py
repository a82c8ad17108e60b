"""The small answer value (proxy/_answer.py) as a client sees it on the wire from
the server edge (proxy/_front.py): its body, fields, reason and ``close``."""

from __future__ import annotations

import asyncio
import json

import pytest

from proxy._answer import JSON_TYPE, SmallAnswer
from proxy._front import Handler, Request
from proxy._listener import FrontServer


async def _answers(handler: Handler, request: bytes) -> bytes:
    """Everything the server sends on one connection for ``request`` until it closes
    or 2 s of quiet pass (a kept-alive connection sends nothing more)."""
    server = FrontServer(handler, header_timeout=5.0)
    port = await server.start("127.0.0.1", 0)
    try:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        try:
            writer.write(request)
            got = b""
            for _ in range(1000):  # bounded: each read returns data or ends
                try:
                    async with asyncio.timeout(2):
                        piece = await reader.read(65536)
                except TimeoutError:
                    return got + b"<open>"
                if not piece:
                    return got + b"<closed>"
                got += piece
            raise AssertionError("the server did not stop sending")
        finally:
            writer.close()
    finally:
        await server.shutdown(grace=1.0)


GET = b"GET / HTTP/1.1\r\nHost: x\r\n\r\n"


@pytest.mark.asyncio
async def test_a_json_answer_has_its_body_type_and_keeps_the_connection() -> None:
    async def handler(request: Request) -> SmallAnswer:
        return SmallAnswer.json({"status": "ready", "n": [1, 2]}, status=202)

    got = await _answers(handler, GET)
    head, _, rest = got.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 202 Accepted\r\n")
    assert b"\r\nContent-Type: application/json; charset=utf-8" in head
    body = rest.removesuffix(b"<open>")
    assert rest.endswith(b"<open>") and json.loads(body) == {"status": "ready", "n": [1, 2]}
    assert b"\r\nContent-Length: %d" % len(body) in head
    assert b"Connection: close" not in head


@pytest.mark.asyncio
async def test_close_ends_the_connection_after_the_answer() -> None:
    async def handler(request: Request) -> SmallAnswer:
        return SmallAnswer(
            503, body=b"{}", headers={"Retry-After": "5"}, content_type=JSON_TYPE, close=True
        )

    got = await _answers(handler, GET)
    head, _, rest = got.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 503 Service Unavailable\r\n")
    assert b"\r\nRetry-After: 5\r\n" in head and b"\r\nConnection: close" in head
    assert rest == b"{}<closed>"


@pytest.mark.asyncio
async def test_a_reason_of_its_own_and_a_text_body() -> None:
    async def gone(request: Request) -> SmallAnswer:
        return SmallAnswer(499, reason="Client Closed Request")

    async def text(request: Request) -> SmallAnswer:
        return SmallAnswer.text("context-proxy\n")

    assert (await _answers(gone, GET)).startswith(b"HTTP/1.1 499 Client Closed Request\r\n")
    got = await _answers(text, GET)
    assert b"\r\nContent-Type: text/plain; charset=utf-8" in got
    assert got.endswith(b"\r\n\r\ncontext-proxy\n<open>")


def test_a_content_type_given_twice_is_refused() -> None:
    with pytest.raises(ValueError, match="content_type"):
        SmallAnswer(body=b"x", headers={"content-type": "a/b"}, content_type="c/d")


def test_its_repr_shows_no_field_value_or_body() -> None:
    answer = SmallAnswer(body=b"secret-body", headers={"X-Api-Key": "sk-secret"})
    assert "secret" not in repr(answer) and "11 B" in repr(answer)

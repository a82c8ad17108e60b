"""The answer to a ``HEAD`` request relayed from an upstream (proxy/_front.py, ``StreamAnswer``).

RFC 9110 §8.6: a server MUST NOT send ``Content-Length`` in an answer to
``HEAD`` unless it equals the length a ``GET`` would get. The relay writes no
body for a ``HEAD`` (the upstream sent none), so the count of bytes written
is 0 whatever the resource's size: the proxy said ``Content-Length: 0`` for a
file the upstream said was 1234 bytes. A client asking its size with ``HEAD``
was told it is empty. (The upstream's own length cannot be passed on: the
proxy decodes content codings.) The kept connection still serves the next
request.
"""

from __future__ import annotations

import asyncio

import pytest

from tests.support.upstream import Scripted, proxy_for, read_request

pytestmark = pytest.mark.asyncio


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

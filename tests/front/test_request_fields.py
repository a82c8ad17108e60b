"""Request heads RFC 9112 says to refuse: two ``Host`` fields (§3.2), a transfer coding
other than ``chunked`` (§6.1). Real sockets on 127.0.0.1, the proxy in this process."""

from __future__ import annotations

import asyncio
import gzip
import json
from typing import Final

from proxy.testing import proxy_with_emulator

BOUND_S: Final = 5.0


async def _exchange(url: str, data: bytes) -> bytes:
    host, port = url.removeprefix("http://").split(":")
    reader, writer = await asyncio.open_connection(host, int(port))
    try:
        writer.write(data)
        async with asyncio.timeout(BOUND_S):
            return await reader.read()  # the proxy closes after its answer
    finally:
        writer.close()


async def test_two_host_fields_are_a_400() -> None:
    async with proxy_with_emulator() as h:
        raw = await _exchange(h.url, b"GET /healthz HTTP/1.1\r\nHost: a\r\nHost: b\r\n\r\n")
    head, _, body = raw.partition(b"\r\n\r\n")
    assert head.split(b"\r\n")[0] == b"HTTP/1.1 400 Bad Request"
    assert json.loads(body)["error"]["code"] == "malformed_request"


async def test_a_gzip_transfer_coding_is_a_501_and_the_connection_closes() -> None:
    inner = gzip.compress(b'{"model":"m","messages":[{"role":"user","content":"hi"}]}')
    chunk = b"%x\r\n" % len(inner) + inner + b"\r\n0\r\n\r\n"
    async with proxy_with_emulator() as h:
        raw = await _exchange(
            h.url,
            b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\n"
            b"Transfer-Encoding: gzip, chunked\r\n\r\n" + chunk,
        )
    head, _, body = raw.partition(b"\r\n\r\n")
    assert head.split(b"\r\n")[0] == b"HTTP/1.1 501 Not Implemented"
    assert b"connection: close" in head.lower()
    assert json.loads(body)["error"]["code"] == "not_implemented"

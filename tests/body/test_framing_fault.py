"""A client that breaks a chunked body's framing, and stays connected, is refused, not gone.

Real sockets on 127.0.0.1: the proxy runs in this process in front of its emulator.
"""

from __future__ import annotations

import asyncio
import json
from typing import Final

import pytest

from proxy.testing import proxy_with_emulator

HEAD: Final = (
    b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer sk-test\r\n"
    b"Content-Type: application/json\r\nTransfer-Encoding: chunked\r\n\r\n"
)
BOUND_S: Final = 5.0


@pytest.mark.parametrize(
    "broken",
    [b"zz\r\n", b"2\r\n{}xx\r\n0\r\n\r\n", b"fffffffffffffffffffffff\r\nxxxx"],
    ids=["bad-size", "data-over-size", "huge-size"],
)
async def test_a_broken_chunked_body_is_a_malformed_request_not_a_hang_up(broken: bytes) -> None:
    async with proxy_with_emulator() as h:
        host, port = h.url.removeprefix("http://").split(":")
        reader, writer = await asyncio.open_connection(host, int(port))
        try:
            writer.write(HEAD + broken)
            async with asyncio.timeout(BOUND_S):
                raw = await reader.read()  # the proxy closes after the answer
        finally:
            writer.close()
        await h.settle()
        head, _, body = raw.partition(b"\r\n\r\n")
        lines = head.split(b"\r\n")
        assert lines[0] == b"HTTP/1.1 400 Bad Request"
        assert b"connection: close" in head.lower()
        error = json.loads(body)["error"]
        assert error["code"] == "malformed_request"
        assert "framing is broken" in error["message"]
        assert h.metric("context_proxy_client_disconnects_total", phase="reading") in (None, 0.0)
        booked = h.metric(
            "context_proxy_requests_total", protocol="openai-chat", code="400", outcome="rejected"
        )
        assert booked == 1

"""The 415 for an unknown ``Content-Encoding`` names the accepted codings, never the value.

Real sockets on 127.0.0.1, the proxy in this process.
"""

from __future__ import annotations

import asyncio
import json
from typing import Final

from proxy.testing import proxy_with_emulator

BOUND_S: Final = 5.0


async def test_the_415_does_not_echo_the_content_encoding_value() -> None:
    async with proxy_with_emulator() as h:
        host, port = h.url.removeprefix("http://").split(":")
        reader, writer = await asyncio.open_connection(host, int(port))
        try:
            writer.write(
                b"POST /v1/messages HTTP/1.1\r\nHost: x\r\nContent-Encoding: x-secret-value\r\n"
                b"Content-Length: 2\r\n\r\n{}"
            )
            async with asyncio.timeout(BOUND_S):
                raw = await reader.read()
        finally:
            writer.close()
    head, _, body = raw.partition(b"\r\n\r\n")
    assert head.split(b"\r\n")[0] == b"HTTP/1.1 415 Unsupported Media Type"
    assert b"secret" not in raw
    message = json.loads(body)["error"]["message"]
    assert "gzip" in message and "zstd" in message

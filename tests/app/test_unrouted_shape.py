"""A 404 for an unroutable path under ``/v1/messages`` comes in Anthropic's error shape.

Real sockets on 127.0.0.1, the proxy in this process.
"""

from __future__ import annotations

import asyncio
import json
from typing import Final

from proxy.testing import proxy_with_emulator

BOUND_S: Final = 5.0


async def test_an_unroutable_messages_path_is_answered_in_anthropics_shape() -> None:
    async with proxy_with_emulator() as h:
        host, port = h.url.removeprefix("http://").split(":")
        reader, writer = await asyncio.open_connection(host, int(port))
        try:
            writer.write(
                b"POST /v1/messages/../x HTTP/1.1\r\nHost: x\r\nConnection: close\r\n"
                b"Content-Length: 2\r\n\r\n{}"
            )
            async with asyncio.timeout(BOUND_S):
                raw = await reader.read()
        finally:
            writer.close()
    head, _, body = raw.partition(b"\r\n\r\n")
    assert head.split(b"\r\n")[0] == b"HTTP/1.1 404 Not Found"
    answer = json.loads(body)
    assert answer["type"] == "error" and answer["error"]["type"] == "not_found_error"

"""Header value bytes cross the proxy unchanged in both directions, UTF-8 or not.

Header values are bytes (RFC 9110 section 5.5: obs-text is any byte >= 0x80),
and real ones carry UTF-8 (a file name, a user's display name). A request's
``X-Odd: café ✓`` reaches the upstream as the client's bytes, and an upstream's
``X-Up: café ✓`` reaches the client as the upstream's bytes, not re-encoded
into mojibake (``cafÃ©``).
"""

from __future__ import annotations

import asyncio
import json

from tests.support.upstream import Scripted, json_answer, proxy_app, read_request


async def test_non_ascii_header_value_bytes_cross_the_proxy_unchanged_both_ways() -> None:
    heads: list[bytes] = []

    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, n: int) -> None:
        head, _ = await read_request(reader)
        heads.append(head)
        writer.write(json_answer(extra="X-Up: café ✓\r\n".encode()))
        await writer.drain()

    body = json.dumps({"model": "m", "messages": [{"role": "user", "content": "x"}]}).encode()
    async with Scripted(serve) as upstream, proxy_app(upstream.url) as (url, _app):
        reader, writer = await asyncio.open_connection("127.0.0.1", int(url.rsplit(":", 1)[1]))
        writer.write(
            b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nX-Odd: caf\xc3\xa9 \xe2\x9c\x93\r\n"
            b"Content-Type: application/json\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body)
        )
        head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 5)
        writer.close()
    assert b"\r\nX-Odd: caf\xc3\xa9 \xe2\x9c\x93\r\n" in heads[0]  # request side: kept
    up_line = [line for line in head.split(b"\r\n") if line.lower().startswith(b"x-up:")]
    assert up_line == ["X-Up: café ✓".encode()], f"the client got {up_line!r}"

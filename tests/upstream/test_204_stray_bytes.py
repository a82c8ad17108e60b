"""A 204 answer followed by stray bytes reaches the client as the complete answer it is.

A 204 has no body (RFC 9110 section 15.3.5), yet a misbehaving upstream or a
middlebox may append one anyway. The bytes after the head belong to no answer,
so the connection cannot be framed any further and is not kept; but the 204
itself was whole: the client gets it, and the exchange is not concluded (nor
logged) as a failed stream.
"""

from __future__ import annotations

import asyncio
import json
import logging

import pytest

from tests.support.e2e import RawClient
from tests.support.upstream import Scripted, proxy_app, read_request


async def test_a_204_with_stray_bytes_reaches_the_client_and_is_not_logged_as_failed(
    caplog: pytest.LogCaptureFixture,
) -> None:
    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, n: int) -> None:
        await read_request(reader)
        writer.write(b"HTTP/1.1 204 No Content\r\n\r\nstray")
        await writer.drain()
        await asyncio.sleep(1)

    caplog.set_level(logging.INFO, logger="context_proxy")
    body = json.dumps({"model": "m", "messages": [{"role": "user", "content": "x"}]}).encode()
    async with Scripted(serve) as upstream, proxy_app(upstream.url) as (url, _app):
        client = await RawClient.connect(url)
        await client.request("POST", "/v1/chat/completions", body, [("Authorization", "Bearer k")])
        head = await client.read_head()
        await client.close()
    assert head.status == 204
    failed = [r.getMessage() for r in caplog.records if "failed" in r.getMessage()]
    assert failed == [], failed

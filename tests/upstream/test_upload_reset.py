"""An upstream that resets its connection mid-upload ends the upload at once.

An upstream may reset a connection while a large body is still going up (a
load balancer's body-size limit, a crashed worker). The client gets a 502 in
its protocol shape, the pool's connection is freed, and the proxy stops
writing the rest of the body into the dead transport: asyncio logs
"socket.send() raised exception." for every write after the fifth on a lost
connection, which for a 20 MB body would be dozens of warnings per failure.
"""

from __future__ import annotations

import asyncio
import json
import logging
import socket
import struct

from tests.support.e2e import RawClient, wait_until
from tests.support.upstream import Scripted, pool_of, proxy_app


async def test_a_reset_mid_upload_is_a_502_and_no_write_goes_to_the_dead_socket() -> None:
    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, n: int) -> None:
        await reader.readuntil(b"\r\n\r\n")
        await reader.readexactly(1_000_000)
        sock = writer.get_extra_info("socket")
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        writer.transport.abort()  # RST

    body = json.dumps(
        {"model": "m", "stream": True, "messages": [{"role": "user", "content": "x" * 20_000_000}]}
    ).encode()
    records: list[logging.LogRecord] = []

    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            records.append(record)

    keep = Keep(logging.WARNING)
    logging.getLogger("asyncio").addHandler(keep)
    async with Scripted(serve) as upstream, proxy_app(upstream.url) as (url, app):
        client = await RawClient.connect(url)
        await client.request(
            "POST", "/v1/chat/completions", body, [("Authorization", "Bearer sk-x")]
        )
        head = await client.read_head()
        answer = json.loads(await client.read_body(head))
        await client.close()
        assert head.status == 502 and "error" in answer
        pool = pool_of(app)
        await wait_until(lambda: pool.connections_in_use == 0, "the connection freed", within=5.0)
    logging.getLogger("asyncio").removeHandler(keep)
    spam = [r for r in records if "socket.send() raised exception" in r.getMessage()]
    assert spam == [], f"{len(spam)} asyncio warnings: the upload went on writing to a lost socket"

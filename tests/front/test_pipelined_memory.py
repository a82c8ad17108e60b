"""Memory of a connection flooded with pipelined requests (proxy/_front.py).

One request is handled at a time; those pipelined behind it wait in a queue,
and reading pauses once a few wait. But a single read was parsed whole: on
uvloop a read takes all the socket holds, up to 256 KiB, which is ~6,000
requests of a 40-byte head, each a ~1 KiB object (head, fields, body stream)
once parsed. 256 KiB sent made ~6.5 MiB resident per connection: a client
could make the proxy hold 25 times what it sends. A read is now parsed a
slice at a time and the parse stops behind a full queue; the rest waits as
the bytes it is. Every request is still answered, in order.
"""

from __future__ import annotations

import asyncio
import tracemalloc

import pytest
import uvloop

from proxy._answer import SmallAnswer
from proxy._front import Request
from proxy._listener import FrontServer

GET = b"GET /health HTTP/1.1\r\nHost: x\r\nA: %d\r\n\r\n"
COUNT = 10_000
PIECES = 10


async def _flood() -> tuple[list[int], int]:
    """COUNT numbered GETs written as fast as the socket takes them; the numbers in
    the answers, in order, and the traced peak (bytes) while they are served."""

    async def numbered(request: Request) -> SmallAnswer:
        await asyncio.sleep(0)
        return SmallAnswer(body=b"<%s>" % request.headers["A"].encode())

    server = FrontServer(numbered, header_timeout=5.0)
    port = await server.start("127.0.0.1", 0)
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    per_piece = COUNT // PIECES

    async def send() -> None:
        for n in range(PIECES):
            first = n * per_piece
            writer.write(b"".join(GET % (first + i) for i in range(per_piece)))
            await writer.drain()

    numbers: list[int] = []
    tracemalloc.start()
    sending = asyncio.ensure_future(send())
    try:
        rest = b""
        async with asyncio.timeout(30):
            for _ in range(COUNT):  # bounded
                if len(numbers) >= COUNT:
                    break
                piece = await reader.read(1 << 16)
                if not piece:
                    break
                rest += piece
                *bodies, rest = rest.split(b">")
                numbers += [int(body.rpartition(b"<")[2]) for body in bodies]
        peak = tracemalloc.get_traced_memory()[1]
        await sending
    finally:
        tracemalloc.stop()
        writer.close()
        await server.shutdown(grace=1.0)
    return numbers, peak


@pytest.mark.parametrize("loop", ["asyncio", "uvloop"])
def test_a_pipelined_flood_is_answered_in_order_in_bounded_memory(loop: str) -> None:
    factory = uvloop.new_event_loop if loop == "uvloop" else asyncio.new_event_loop
    with asyncio.Runner(loop_factory=factory) as runner:
        bodies, peak = runner.run(_flood())
    assert bodies == list(range(COUNT))
    # The client's writes and reads are traced too (~0.3 MiB).
    assert peak < 2 * 1024 * 1024, f"peak {peak / 2**20:.1f} MiB"

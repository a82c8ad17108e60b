"""On uvloop (``event_loop = "uvloop"``) a host's dead first address is raced too.

The pool resolves a host name through the loop and races the addresses itself
(staggered ``sock_connect`` attempts, then ``create_connection(sock=...)``), so
uvloop, whose ``create_connection`` has no race of its own, gets it too. The
sandbox has no host name with two addresses, so the test gives one through
``loop.getaddrinfo`` (as the asyncio test does).
"""

from __future__ import annotations

import asyncio
import time

import uvloop

from proxy._upstream import UpstreamPool, UpstreamTarget
from tests.support.upstream import Scripted, black_hole, dead_first, json_answer, read_request


async def _dead_first_address() -> tuple[float, int]:
    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, n: int) -> None:
        await read_request(reader)
        writer.write(json_answer())
        await writer.drain()

    async with Scripted(serve) as upstream:
        port = upstream.port
        with black_hole(port):
            loop = asyncio.get_running_loop()
            loop.getaddrinfo = dead_first(loop, "upstream.test", port)  # type: ignore[method-assign]
            pool = UpstreamPool(connect_timeout=10.0, idle_read=5.0, max_connections=0)
            started = time.monotonic()
            try:
                answer = await pool.request(
                    UpstreamTarget(f"http://upstream.test:{port}"), "GET", "/", {}
                )
                status = answer.status
                answer.close()
            finally:
                await pool.close()
            return time.monotonic() - started, status


def test_a_dead_first_address_is_raced_on_uvloop() -> None:
    with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
        took, status = runner.run(_dead_first_address())
    assert status == 200
    # The race (0.25 s delay), not the dead address's whole 10 s connect timeout.
    assert took < 5.0, f"{took:.1f} s to connect"

"""A host name's addresses raced (happy eyeballs, RFC 8305) on asyncio and on uvloop.

A dead first address (SYNs dropped, as on a network where IPv6 is routed nowhere)
costs the race's head start, not ``upstream_connect_timeout``.
"""

from __future__ import annotations

import asyncio
import time

import openai
import pytest
import uvloop

from proxy._upstream import UpstreamPool, UpstreamTarget
from tests.support.upstream import (
    Scripted,
    black_hole,
    dead_first,
    json_answer,
    proxy_app,
    read_request,
)

# -----------------------------------------------------------------------------
# An upstream host name whose first address is dead is reached on its next address at once.
#
# ``api.anthropic.com`` and ``api.openai.com`` have AAAA records; on a network
# where IPv6 is routed nowhere (SYNs dropped) the first address ``getaddrinfo``
# gives never answers. The pool races the next address after 250 ms (happy
# eyeballs, RFC 8305), as aiohttp's connector does, instead of waiting on the
# dead one until ``upstream_connect_timeout`` and failing the request with a 504
# on every new connection.
#
# The dead address here is a loopback listener whose accept queue is full (the
# kernel drops further SYNs); the host name resolves to it first, then to the
# real upstream on the same port.


async def test_a_dead_first_address_falls_back_to_the_next_one_within_two_seconds() -> None:
    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, n: int) -> None:
        for _ in range(10):  # bounded
            await read_request(reader)
            writer.write(json_answer())
            await writer.drain()

    async with Scripted(serve) as upstream:
        port = upstream.port
        with black_hole(port), pytest.MonkeyPatch.context() as patch:
            await asyncio.sleep(0.1)
            loop = asyncio.get_running_loop()
            patch.setattr(loop, "getaddrinfo", dead_first(loop, "upstream.test", port))
            async with (
                proxy_app(f"http://upstream.test:{port}", upstream_connect_timeout=4.0) as (
                    url,
                    _app,
                ),
                openai.AsyncOpenAI(
                    base_url=f"{url}/v1", api_key="sk-x", max_retries=0, timeout=20
                ) as sdk,
            ):
                started = time.monotonic()
                try:
                    answer = await sdk.chat.completions.create(
                        model="m", messages=[{"role": "user", "content": "hello"}]
                    )
                except openai.APIStatusError as exc:
                    raise AssertionError(
                        f"{exc.status_code} after {time.monotonic() - started:.1f} s: {exc.message}"
                    ) from None
    # The connect timeout bounds the whole connect: without the race the dead first
    # address takes all of it and the answer is a 504, so success proves the fallback.
    assert answer.choices[0].message.content == "hi"


# -----------------------------------------------------------------------------
# On uvloop (``event_loop = "uvloop"``) a host's dead first address is raced too.
#
# The pool resolves a host name through the loop and races the addresses itself
# (staggered ``sock_connect`` attempts, then ``create_connection(sock=...)``), so
# uvloop, whose ``create_connection`` has no race of its own, gets it too. The
# sandbox has no host name with two addresses, so the test gives one through
# ``loop.getaddrinfo`` (as the asyncio test does).


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

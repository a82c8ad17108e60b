"""A request waiting for a free connection that is cancelled ends as cancelled, never as a 500.

``upstream_max_connections`` queues requests. A waiter whose task is cancelled (its
client hung up, its header timeout fired, the drain at shutdown) may have its
cancelled future popped off the queue by a place coming free in the same loop
turn, before the waiter's own clean-up runs. That clean-up must still end as a
cancellation (a 503 at shutdown, a 503 naming the limit on timeout), and leave
no reservation behind.
"""

from __future__ import annotations

import asyncio
import json
import random

import pytest

from proxy._upstream import UpstreamPool, UpstreamTarget
from tests.support.e2e import RawClient
from tests.support.upstream import (
    SSE_HEAD,
    Scripted,
    chat_sse_events,
    chunk,
    json_answer,
    pool_of,
    proxy_app,
    read_request,
)

BODY = json.dumps({"model": "m", "messages": [{"role": "user", "content": "x"}]}).encode()
STREAM_BODY = json.dumps(
    {"model": "m", "stream": True, "messages": [{"role": "user", "content": "x"}]}
).encode()
AUTH = [("Authorization", "Bearer k")]
QUEUED = 10


async def test_a_waiter_cancelled_as_a_place_frees_raises_cancelled_not_value_error() -> None:
    """``max_connections=1``: A holds it, B and C wait. B is cancelled, and in the
    same turn A's answer is released (the place goes past B's cancelled future to C).
    B ends cancelled, C is served, nothing stays reserved."""

    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, n: int) -> None:
        for _ in range(10):  # bounded
            await read_request(reader)
            writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\n{}")
            await writer.drain()

    async with Scripted(serve) as upstream:
        target = UpstreamTarget(upstream.url)
        pool = UpstreamPool(connect_timeout=5, idle_read=5, max_connections=1)
        try:
            a = await pool.request(target, "GET", "/", {})
            b = asyncio.create_task(pool.request(target, "GET", "/", {}))
            c = asyncio.create_task(pool.request(target, "GET", "/", {}))
            await asyncio.sleep(0.05)
            assert await a.read() == b"{}"
            assert await a.read() == b""
            b.cancel()  # B's client hangs up ...
            a.release()  # ... as A's connection comes free, in the same loop turn
            b_result, c_result = await asyncio.wait_for(
                asyncio.gather(b, c, return_exceptions=True), 5
            )
            assert isinstance(b_result, asyncio.CancelledError), repr(b_result)
            assert not isinstance(c_result, BaseException), repr(c_result)
            c_result.release()
            policy = pool._policy
            assert (policy.reserved, pool.connections_in_use, policy.waiters) == (0, 0, 0)
        finally:
            await pool.close()


async def test_requests_queued_at_shutdown_get_503_not_500() -> None:
    """``upstream_max_connections=1`` and one long stream on it, ten requests queued.
    The proxy shuts down: the drain cancels them all at once. Each queued client gets
    the 503 "proxy shutting down" (on main most get a 500 "internal proxy error": the
    stream's connection comes free in the same turn and pops their cancelled futures)."""

    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, n: int) -> None:
        await read_request(reader)
        writer.write(SSE_HEAD + chunk(chat_sse_events()[0]))
        await writer.drain()
        await asyncio.sleep(8)  # a long stream

    statuses: list[tuple[int, bytes]] = []
    async with Scripted(serve) as upstream:
        async with proxy_app(
            upstream.url, upstream_max_connections=1, upstream_header_timeout=30
        ) as (url, app):
            holder = await RawClient.connect(url)
            await holder.request("POST", "/v1/chat/completions", STREAM_BODY, AUTH)
            assert (await holder.read_head()).status == 200
            queued = []
            for _ in range(QUEUED):
                client = await RawClient.connect(url)
                await client.request("POST", "/v1/chat/completions", STREAM_BODY, AUTH)
                queued.append(client)
            for _ in range(500):  # bounded (10 s): until all three wait in the pool
                if pool_of(app)._policy.waiters == QUEUED:
                    break
                await asyncio.sleep(0.02)
            assert pool_of(app)._policy.waiters == QUEUED
            # Leaving the block drains (grace 1 s) and cancels what still runs.
        for client in queued:
            head = await client.read_head()
            statuses.append((head.status, await client.read_body(head)))
            await client.close()
        holder.abort()
    assert [status for status, _ in statuses] == [503] * QUEUED, statuses


@pytest.mark.timeout(120)
async def test_200_waiters_with_random_hang_ups_get_no_500_and_leak_no_place() -> None:
    """``upstream_max_connections=4``, 200 requests at once, 40 % of the clients hang up
    while queued, the rest may wait out a 0.4 s header timeout. Every answer is a 200,
    a 503 naming the limit or a 504; none is a 500. Afterwards no place is reserved,
    none in use, and a new request still gets a connection."""
    rng = random.Random(3)

    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, n: int) -> None:
        for _ in range(1000):  # bounded
            await read_request(reader)
            await asyncio.sleep(rng.uniform(0, 0.06))
            writer.write(json_answer())
            await writer.drain()

    statuses: list[int] = []
    async with (
        Scripted(serve) as upstream,
        proxy_app(upstream.url, upstream_max_connections=4, upstream_header_timeout=0.4) as (
            url,
            app,
        ),
    ):
        pool = pool_of(app)

        async def one() -> None:
            client = await RawClient.connect(url)
            await client.request("POST", "/v1/chat/completions", BODY, AUTH)
            if rng.random() < 0.4:
                await asyncio.sleep(rng.uniform(0, 0.3))
                client.abort()
                return
            head = await client.read_head()
            await client.read_body(head)
            statuses.append(head.status)
            await client.close()

        await asyncio.gather(*(one() for _ in range(200)))
        for _ in range(500):  # bounded (10 s): the hung-up handlers finish
            if pool.connections_in_use == 0 and not pool._policy.waiters:
                break
            await asyncio.sleep(0.02)
        assert (pool._policy.reserved, pool.connections_in_use, pool._policy.waiters) == (0, 0, 0)
        after = await RawClient.connect(url)
        await after.request("POST", "/v1/chat/completions", BODY, AUTH)
        assert (await after.read_head()).status == 200
        await after.close()
    assert 500 not in statuses, f"{statuses.count(500)} of {len(statuses)} answers were a 500"


async def test_a_waiter_failed_by_pool_close_and_cancelled_in_that_turn_frees_no_place() -> None:
    """``max_connections=1``: A holds it, B waits. The pool closes (B's future gets
    ``PoolClosed``) and B's client hangs up in the same turn. B's clean-up must not
    take the close for a handed place: on main ``_reserved`` ends at -1 (one place
    more than the limit for whoever uses the pool next)."""

    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, n: int) -> None:
        await read_request(reader)
        await asyncio.sleep(3)

    async with Scripted(serve) as upstream:
        target = UpstreamTarget(upstream.url)
        pool = UpstreamPool(connect_timeout=5, idle_read=5, max_connections=1)
        a = asyncio.create_task(pool.request(target, "GET", "/", {}))
        await asyncio.sleep(0.05)
        b = asyncio.create_task(pool.request(target, "GET", "/", {}))
        await asyncio.sleep(0.05)
        closing = asyncio.create_task(pool.close())
        await asyncio.sleep(0)  # the close's first step fails B's future ...
        b.cancel()  # ... and B's client hangs up before B runs
        await closing
        await asyncio.gather(a, b, return_exceptions=True)
    assert pool._policy.reserved == 0

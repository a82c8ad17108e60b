"""Requests waiting for a free upstream connection under ``upstream_max_connections``.

Past the limit a request waits in the pool. The waiters are served first come,
first served: a place that comes free goes to the first waiter, not to a request
that arrives in the same loop turn, so under steady load no request is
overtaken again and again until its ``upstream_header_timeout``. A waiter whose
client hangs up just as it is woken passes the place on. A request that waits
out its header timeout is not told the upstream was slow: the upstream never
saw it, the proxy's own limit was the cause.
"""

from __future__ import annotations

import asyncio
import json

import pytest

from proxy._upstream import UpstreamPool, UpstreamTarget
from tests.support.e2e import RawClient
from tests.support.upstream import (
    SSE_HEAD,
    Scripted,
    chat_sse_events,
    chunk,
    proxy_app,
    read_request,
)


async def test_a_waiter_keeps_its_place_when_a_newcomer_arrives_as_the_connection_frees() -> None:
    """``max_connections=1``: B queues first, then D; the connection frees up and C
    arrives in the same loop turn. B is served before D."""

    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, n: int) -> None:
        for _ in range(10):  # bounded
            await read_request(reader)
            writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\n{}")
            await writer.drain()

    order: list[str] = []
    async with Scripted(serve) as upstream:
        target = UpstreamTarget(upstream.url)
        pool = UpstreamPool(connect_timeout=5, idle_read=5, max_connections=1)

        async def get(name: str) -> None:
            answer = await pool.request(target, "GET", "/", {})
            order.append(name)
            for _ in range(10):  # bounded
                if not await answer.read():
                    break
            answer.release()

        try:
            first = await pool.request(target, "GET", "/", {})
            b = asyncio.create_task(get("B"))
            await asyncio.sleep(0.05)
            d = asyncio.create_task(get("D"))
            await asyncio.sleep(0.05)
            for _ in range(10):  # bounded
                if not await first.read():
                    break
            c = asyncio.create_task(get("C"))  # scheduled before B's wake-up runs
            first.release()
            await asyncio.wait_for(asyncio.gather(b, c, d), 5)
        finally:
            await pool.close()
    assert order.index("B") < order.index("D"), f"served in the order {order}"


async def test_a_waiter_cancelled_as_it_is_woken_passes_the_free_connection_on() -> None:
    """``max_connections=1``: A holds the connection, B and C wait. A's answer ends
    (one waiter, B, is woken) and in the same loop turn B's client hangs up (its
    task is cancelled). C gets the free connection."""
    release = asyncio.Event()

    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, n: int) -> None:
        for _ in range(10):  # bounded
            await read_request(reader)
            await asyncio.wait_for(release.wait(), 10)
            writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\n{}")
            await writer.drain()

    async with Scripted(serve) as upstream:
        target = UpstreamTarget(upstream.url)
        pool = UpstreamPool(connect_timeout=5, idle_read=5, max_connections=1)

        async def get() -> bytes:
            answer = await pool.request(target, "GET", "/", {})
            try:
                data = b""
                for _ in range(100):  # bounded
                    piece = await answer.read()
                    if not piece:
                        return data
                    data += piece
                return data
            finally:
                answer.release()

        try:
            a = asyncio.create_task(pool.request(target, "GET", "/", {}))
            await asyncio.sleep(0.05)
            b = asyncio.create_task(get())
            c = asyncio.create_task(get())
            await asyncio.sleep(0.05)
            assert pool.connections_in_use == 1 and not b.done() and not c.done()
            release.set()
            answer = await asyncio.wait_for(a, 5)
            assert await answer.read() == b"{}"
            assert await answer.read() == b""
            answer.release()  # wakes B (the first waiter) ...
            b.cancel()  # ... whose client hung up in the same loop turn
            # C must get the free connection: the upstream answers at once now.
            done, _ = await asyncio.wait({c}, timeout=3)
            assert c in done, (
                "C still waits for a connection although none is in use "
                f"(in use {pool.connections_in_use}, idle {pool.idle_connections})"
            )
            assert c.result() == b"{}"
        finally:
            for task in (b, c):
                task.cancel()
            await asyncio.gather(b, c, return_exceptions=True)
            await pool.close()


async def test_a_request_queued_past_its_header_timeout_is_not_blamed_on_the_upstream(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """``upstream_max_connections=1`` and one long stream on the only connection: a
    second request waits in the pool until ``upstream_header_timeout``, never reaches
    the upstream, gets a 503 that does not say the upstream sent no headers in time,
    and is logged once."""

    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, n: int) -> None:
        await read_request(reader)
        writer.write(SSE_HEAD + chunk(chat_sse_events()[0]))
        await writer.drain()
        await asyncio.sleep(5)  # a long stream

    body = json.dumps(
        {"model": "m", "stream": True, "messages": [{"role": "user", "content": "x"}]}
    ).encode()
    async with (
        Scripted(serve) as upstream,
        proxy_app(upstream.url, upstream_max_connections=1, upstream_header_timeout=0.5) as (
            url,
            _app,
        ),
    ):
        holder = await RawClient.connect(url)
        await holder.request("POST", "/v1/chat/completions", body, [("Authorization", "Bearer k")])
        assert (await holder.read_head()).status == 200
        queued = await RawClient.connect(url)
        await queued.request("POST", "/v1/chat/completions", body, [("Authorization", "Bearer k")])
        head = await queued.read_head()
        message = json.loads(await queued.read_body(head))["error"]["message"]
        holder.abort()
        await queued.close()
    assert upstream.connections == 1  # the queued request never reached the upstream
    assert head.status == 503
    assert "upstream sent no response headers" not in message, (head.status, message)
    said = [r for r in caplog.records if "upstream connections are in use" in r.getMessage()]
    assert len(said) == 1, [r.getMessage() for r in said]

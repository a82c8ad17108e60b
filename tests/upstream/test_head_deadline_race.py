"""The bound on an upstream answer's head (proxy/_upstream.py, ``asyncio.timeout``) against a head
that came in time but was read in the loop turn its deadline fell in.

A busy event loop (a burst of other streams, a long GC pause) runs the socket's
read callbacks and the timers that fell due meanwhile in one turn. A head that
arrived before the deadline is then in hand when the timer fires: the request
must get it, not a ``HeadTimeout`` (a 504 blaming an upstream that answered in
time). The upstream runs in the test's loop; the loop is blocked on purpose,
right after the head is written, until past the deadline.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator

import pytest

from proxy._upstream import UpstreamPool, UpstreamTarget
from tests.support.upstream import Scripted, read_request

pytestmark = pytest.mark.asyncio

HEAD_TIMEOUT = 0.3


async def test_a_head_in_hand_when_its_deadline_fires_is_the_answer_not_a_timeout() -> None:
    async def late_loop(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, n: int) -> None:
        await read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\n{}")  # in time...
        # ...then the loop is busy past the deadline (blocked on purpose).
        time.sleep(HEAD_TIMEOUT + 0.2)  # noqa: ASYNC251
        await asyncio.sleep(5)

    async with Scripted(late_loop) as upstream:
        pool = UpstreamPool(connect_timeout=5, idle_read=5, max_connections=0)
        try:
            answer = await pool.request(
                UpstreamTarget(upstream.url), "GET", "/", {}, head_timeout=HEAD_TIMEOUT
            )
            assert answer.status == 200
            assert await asyncio.wait_for(answer.read(), 5) == b"{}"
            answer.release()
        finally:
            await pool.close()


async def test_a_head_that_never_came_is_still_a_timeout_and_a_cancel_still_a_cancel() -> None:
    async def silent(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, n: int) -> None:
        await read_request(reader)
        await asyncio.sleep(5)

    async with Scripted(silent) as upstream:
        pool = UpstreamPool(connect_timeout=5, idle_read=5, max_connections=0)
        target = UpstreamTarget(upstream.url)
        try:
            started = time.monotonic()
            with pytest.raises(TimeoutError):  # HeadTimeout is one
                await pool.request(target, "GET", "/", {}, head_timeout=HEAD_TIMEOUT)
            # The head deadline, not the upstream's 5 s of silence (generous for load).
            assert time.monotonic() - started < HEAD_TIMEOUT + 3.0
            # A client's hang-up in the turn the deadline fires stays a cancel.
            task = asyncio.ensure_future(
                pool.request(target, "GET", "/", {}, head_timeout=HEAD_TIMEOUT)
            )
            loop = asyncio.get_running_loop()
            loop.call_at(loop.time() + HEAD_TIMEOUT, task.cancel)
            with pytest.raises(asyncio.CancelledError):
                await asyncio.wait_for(task, 5)
        finally:
            await pool.close()


async def test_an_upload_to_an_upstream_that_answered_then_stopped_reading_stays_bounded() -> None:
    """A 2xx head during the upload does not end the bound: the upload is still under way."""

    async def answer_then_stall(
        reader: asyncio.StreamReader, writer: asyncio.StreamWriter, n: int
    ) -> None:
        await reader.readuntil(b"\r\n\r\n")
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\n{}")
        await asyncio.sleep(5)  # never reads the body

    body = b"x" * (32 * 1024 * 1024)  # far more than the socket buffers take

    async def pieces() -> AsyncIterator[memoryview]:
        view = memoryview(body)
        for start in range(0, len(body), 262144):
            yield view[start : start + 262144]

    async with Scripted(answer_then_stall) as upstream:
        pool = UpstreamPool(connect_timeout=5, idle_read=5, max_connections=0)
        fields = {"Content-Length": str(len(body))}
        try:
            started = time.monotonic()
            with pytest.raises(TimeoutError):
                await asyncio.wait_for(
                    pool.request(
                        UpstreamTarget(upstream.url),
                        "POST",
                        "/",
                        fields,
                        pieces,
                        len(body),
                        head_timeout=HEAD_TIMEOUT,
                    ),
                    8,
                )
            # The head deadline (0.3 s), not this wait_for's 8 s nor the upstream's 5 s stall.
            assert time.monotonic() - started < 4
        finally:
            await pool.close()

"""The upstream pool's policy (proxy/_upstream.py), on real sockets of our own.

Who waits for a free connection under ``upstream_max_connections`` and in which
order, a waiter cancelled, what a bound running out blames, the head bound
against a head read in the loop turn its deadline fell in, a kept connection
lost to the keep-alive race (replaced, the request sent again) and the window
after which a request is never sent twice. Each section below keeps the account
of the finding it pins.
"""

from __future__ import annotations

import asyncio
import json
import random
import time
from collections.abc import AsyncIterator
from typing import Any

import openai
import pytest
from openai.types.chat import ChatCompletionMessageParam

from proxy._upstream import UpstreamPool, UpstreamTarget
from tests.support.e2e import RawClient
from tests.support.upstream import (
    SSE_HEAD,
    Script,
    Scripted,
    black_hole,
    chat_sse_events,
    chunk,
    json_answer,
    pool_of,
    proxy_app,
    proxy_for,
    read_request,
)

# -----------------------------------------------------------------------------
# Requests waiting for a free upstream connection under ``upstream_max_connections``.
#
# Past the limit a request waits in the pool. The waiters are served first come,
# first served: a place that comes free goes to the first waiter, not to a request
# that arrives in the same loop turn, so under steady load no request is
# overtaken again and again until its ``upstream_header_timeout``. A waiter whose
# client hangs up just as it is woken passes the place on. A request that waits
# out its header timeout is not told the upstream was slow: the upstream never
# saw it, the proxy's own limit was the cause.


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


# -----------------------------------------------------------------------------
# The bound ``upstream_header_timeout`` running out is blamed on what was going on.
#
# ``pool.request`` tells "no free connection" (503 naming
# ``upstream_max_connections``) from "no head in time" (504). A header timeout that
# fires during a slow connect is not about a connection limit (there may be none),
# and a resend queued behind other requests past its timeout is the limit's, not a
# silent upstream's.


async def test_a_header_timeout_during_a_connect_is_not_a_connection_limit_503() -> None:
    """No connection limit (0), a black-holed upstream, a header timeout (1 s) shorter
    than the connect timeout (10 s): a 504 about the connect, not a 503 saying
    "all 0 upstream connections are in use"."""
    with black_hole() as port:
        async with (
            proxy_app(
                f"http://127.0.0.2:{port}",
                upstream_connect_timeout=10.0,
                upstream_header_timeout=1.0,
            ) as (url, _app),
            openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="sk-x", max_retries=0) as sdk,
        ):
            try:
                await sdk.chat.completions.create(
                    model="m", messages=[{"role": "user", "content": "hello"}]
                )
            except openai.APIStatusError as exc:
                status, message = exc.status_code, str(exc.message)
            else:  # pragma: no cover - the upstream never answers
                raise AssertionError("a black-holed upstream answered")
    assert "upstream_max_connections" not in message, (status, message)
    assert status == 504, (status, message)


async def test_a_resend_queued_past_its_header_timeout_is_not_blamed_on_the_upstream() -> None:
    """``upstream_max_connections=1``. A's request goes out on a kept connection and
    gets the idle 408: it is to be resent on a new connection, but B took the place
    meanwhile and holds it with a long stream. A waits out its header timeout in the
    queue: the upstream never saw the resend, so it is the 503 naming the limit, not
    a 504 "upstream sent no response headers in time"."""
    b_may_go = asyncio.Event()

    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, n: int) -> None:
        if n == 0:
            await read_request(reader)
            writer.write(json_answer())
            await writer.drain()
            await read_request(reader)  # A's second request, on the kept connection
            b_may_go.set()
            await asyncio.sleep(0.2)  # B queues meanwhile
            writer.write(b"HTTP/1.1 408 Request Timeout\r\nContent-Length: 0\r\n\r\n")
            await writer.drain()
            return
        await read_request(reader)  # B: a long stream
        writer.write(SSE_HEAD + chunk(chat_sse_events()[0]))
        await writer.drain()
        await asyncio.sleep(5)

    plain = json.dumps({"model": "m", "messages": [{"role": "user", "content": "x"}]}).encode()
    stream = json.dumps(
        {"model": "m", "stream": True, "messages": [{"role": "user", "content": "x"}]}
    ).encode()
    auth = [("Authorization", "Bearer k")]
    async with (
        Scripted(serve) as upstream,
        proxy_app(upstream.url, upstream_max_connections=1, upstream_header_timeout=1.0) as (
            url,
            _app,
        ),
    ):
        a = await RawClient.connect(url)
        await a.request("POST", "/v1/chat/completions", plain, auth)
        head = await a.read_head()
        assert head.status == 200
        await a.read_body(head)
        await a.request("POST", "/v1/chat/completions", plain, auth)
        await asyncio.wait_for(b_may_go.wait(), 5)
        b = await RawClient.connect(url)
        await b.request("POST", "/v1/chat/completions", stream, auth)
        head = await a.read_head()
        message = json.loads(await a.read_body(head))["error"]["message"]
        b.abort()
        await a.close()
    assert "upstream sent no response headers" not in message, (head.status, message)
    assert head.status == 503, (head.status, message)


# -----------------------------------------------------------------------------
# A kept connection the upstream closes as it is reused is replaced and the request sent again.
#
# Node, uvicorn and gunicorn close idle keep-alive connections after 2-5 s; the
# proxy keeps them 15 s. When the upstream's close (or the ``408 Request
# Timeout`` that Node, Apache and nginx send first) crosses the proxy's next
# request on the wire, the upstream has not acted on that request, and its body
# is still in the proxy's memory: the request goes out once more on a new
# connection, as Go's net/http does (RFC 9112 section 9.3.1), and the client never
# sees the race as a 502 or a 408.


async def _fifty_chats(serve: Script) -> list[str]:
    """50 back-to-back chat requests from one SDK client through a proxy in front of
    ``serve``; the failures as ``"status: message"``."""
    failures: list[str] = []
    async with (
        Scripted(serve) as upstream,
        proxy_for(upstream.url) as url,
        openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="sk-x", max_retries=0) as sdk,
    ):
        for _ in range(50):  # bounded
            try:
                await sdk.chat.completions.create(
                    model="m",
                    messages=[{"role": "user", "content": "hello"}],
                )
            except openai.APIStatusError as exc:
                failures.append(f"{exc.status_code}: {exc.message}")
    return failures


async def test_a_kept_connection_the_upstream_closes_unanswered_is_replaced() -> None:
    """The upstream's keep-alive timer fires as the second request arrives: it closes
    the connection without reading or answering it. The client gets the answer
    from a new connection, and the one after it too."""

    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, n: int) -> None:
        if n == 0:
            await read_request(reader)
            writer.write(json_answer())
            await writer.drain()
            # The keep-alive timer fires as the next request arrives: close unanswered.
            await reader.read(1)
            return
        for _ in range(10):  # bounded
            await read_request(reader)
            writer.write(json_answer())
            await writer.drain()

    async with (
        Scripted(serve) as upstream,
        proxy_for(upstream.url) as url,
        openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="sk-x", max_retries=0) as sdk,
    ):
        messages: list[ChatCompletionMessageParam] = [{"role": "user", "content": "hello"}]
        first = await sdk.chat.completions.create(model="m", messages=messages)
        assert first.choices[0].message.content == "hi"
        try:
            second = await sdk.chat.completions.create(model="m", messages=messages)
        except openai.APIStatusError as exc:
            raise AssertionError(
                f"stale kept connection reached the client as {exc.status_code}: {exc.message}"
            ) from None
        assert second.choices[0].message.content == "hi"
        third = await sdk.chat.completions.create(model="m", messages=messages)
        assert third.choices[0].message.content == "hi"


async def test_an_upstream_closing_each_connection_soon_after_its_answer_costs_no_502() -> None:
    """The upstream closes each connection 2 ms after its answer, without
    ``Connection: close`` (a short keep-alive timer, a front end recycling
    connections). 50 back-to-back requests from one SDK client all succeed,
    although the proxy often reuses a connection whose close is in flight
    (without the retry, about half of them were a 502)."""

    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, n: int) -> None:
        await read_request(reader)
        writer.write(json_answer())
        await writer.drain()
        await asyncio.sleep(0.002)

    failures = await _fifty_chats(serve)
    assert failures == [], f"{len(failures)} of 50 requests failed, first: {failures[0]}"


async def test_a_408_sent_on_an_idle_kept_connection_is_not_taken_as_the_next_answer() -> None:
    """Node (headersTimeout / requestTimeout), Apache and nginx send ``408 Request
    Timeout`` on an idle keep-alive connection before closing it. When that crosses
    the proxy's next request, the 408 is no answer to it: the request is sent again
    and the client never gets the 408."""

    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, n: int) -> None:
        await read_request(reader)
        writer.write(json_answer())
        await writer.drain()
        await asyncio.sleep(0.002)
        writer.write(
            b"HTTP/1.1 408 Request Timeout\r\nConnection: close\r\nContent-Length: 0\r\n\r\n"
        )
        await writer.drain()

    failures = await _fifty_chats(serve)
    assert failures == [], f"{len(failures)} of 50 requests failed, first: {failures[0]}"


async def test_a_get_on_a_kept_connection_the_upstream_is_closing_is_sent_again() -> None:
    """GET /v1/models (like Claude Code's HEAD preconnect) is idempotent: on a kept
    connection that turns out closed it is sent once more on a new one (RFC 9112
    section 9.3.1), so 50 back-to-back GETs all succeed."""

    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, n: int) -> None:
        await read_request(reader)
        writer.write(json_answer(b'{"object":"list","data":[]}'))
        await writer.drain()
        await asyncio.sleep(0.002)

    async with (
        Scripted(serve) as upstream,
        proxy_for(upstream.url) as url,
        openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="sk-x", max_retries=0) as sdk,
    ):
        failures: list[str] = []
        for _ in range(50):  # bounded
            try:
                await sdk.models.list()
            except openai.APIStatusError as exc:
                failures.append(f"{exc.status_code}: {exc.message}")
    assert failures == [], f"{len(failures)} of 50 GETs failed, first: {failures[0]}"


# -----------------------------------------------------------------------------
# A POST the upstream read whole and worked on is not sent to it a second time.
#
# The resend on a new connection exists for the keep-alive race: the
# upstream's idle timer closes the kept connection as the proxy's next request
# crosses it on the wire, so the upstream never read it. Its test shape is an
# upstream that closes within milliseconds. But "closed with no byte of answer"
# on a kept connection also happens after the upstream *did* read the request
# and acted on it: a worker killed by its own timeout (gunicorn's 30 s), an
# out-of-memory kill, a crash on this very request, a deploy. Resending then
# runs a billed LLM generation (or a tool side effect) twice, and sends a request
# that crashes the upstream straight into the next worker. Go's client resends a
# POST only when nothing of it was written (or it carries an Idempotency-Key);
# the proxy's bound (the close came within ``RESEND_WINDOW_S`` of the request's
# first byte, about a round trip) keeps the race covered without this.


async def test_a_request_the_upstream_held_for_a_second_then_dropped_is_not_resent() -> None:
    seen: list[tuple[int, int]] = []

    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, n: int) -> None:
        for i in range(10):  # bounded
            await read_request(reader)
            seen.append((n, i))
            if (n, i) == (0, 1):
                await asyncio.sleep(1.0)  # generating the answer ...
                return  # ... and the worker dies: closed, not a byte sent
            writer.write(json_answer())
            await writer.drain()

    async with (
        Scripted(serve) as upstream,
        proxy_for(upstream.url) as url,
        openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="sk-x", max_retries=0) as sdk,
    ):
        messages: list[openai.types.chat.ChatCompletionMessageParam] = [
            {"role": "user", "content": "run the migration"}
        ]
        await sdk.chat.completions.create(model="m", messages=messages)
        try:
            await sdk.chat.completions.create(model="m", messages=messages)
        except openai.APIStatusError as exc:
            assert exc.status_code == 502, exc
    assert seen == [(0, 0), (0, 1)], f"the upstream got the second request {len(seen) - 1} times"


# -----------------------------------------------------------------------------
# A request waiting for a free connection that is cancelled ends as cancelled, never as a 500.
#
# ``upstream_max_connections`` queues requests. A waiter whose task is cancelled (its
# client hung up, its header timeout fired, the drain at shutdown) may have its
# cancelled future popped off the queue by a place coming free in the same loop
# turn, before the waiter's own clean-up runs. That clean-up must still end as a
# cancellation (a 503 at shutdown, a 503 naming the limit on timeout), and leave
# no reservation behind.


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


# -----------------------------------------------------------------------------
# The bound on an upstream answer's head (proxy/_upstream.py, ``asyncio.timeout``) against a head
# that came in time but was read in the loop turn its deadline fell in.
#
# A busy event loop (a burst of other streams, a long GC pause) runs the socket's
# read callbacks and the timers that fell due meanwhile in one turn. A head that
# arrived before the deadline is then in hand when the timer fires: the request
# must get it, not a ``HeadTimeout`` (a 504 blaming an upstream that answered in
# time). The upstream runs in the test's loop; the loop is blocked on purpose,
# right after the head is written, until past the deadline.


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


async def test_a_kept_connection_gone_silent_times_out_at_the_head_deadline() -> None:
    """On a kept connection the head's deadline rides on the connection's one timer,
    armed for the keep-alive time: that firing first (1 s here) is not the deadline,
    and the deadline (2 s) still fires."""
    head_timeout = 2.0

    async def once_then_silent(
        reader: asyncio.StreamReader, writer: asyncio.StreamWriter, n: int
    ) -> None:
        await read_request(reader)
        # Keep-Alive: timeout=2 -> the pool keeps the connection idle 1 s at most.
        writer.write(b"HTTP/1.1 200 OK\r\nKeep-Alive: timeout=2\r\nContent-Length: 2\r\n\r\n{}")
        await read_request(reader)
        await asyncio.sleep(10)

    async with Scripted(once_then_silent) as upstream:
        pool = UpstreamPool(connect_timeout=5, idle_read=5, max_connections=0)
        target = UpstreamTarget(upstream.url)
        try:
            answer = await pool.request(target, "GET", "/", {}, head_timeout=head_timeout)
            assert await asyncio.wait_for(answer.read(), 5) == b"{}"
            answer.release()
            assert pool.idle_connections == 1
            started = time.monotonic()
            with pytest.raises(TimeoutError):  # HeadTimeout is one
                await asyncio.wait_for(
                    pool.request(target, "GET", "/", {}, head_timeout=head_timeout), 8
                )
            elapsed = time.monotonic() - started
            assert upstream.connections == 1  # the kept connection carried it
            assert head_timeout - 0.05 <= elapsed < head_timeout + 3.0
            assert pool.connections_in_use == 0 and pool.idle_connections == 0
        finally:
            await pool.close()


async def test_requests_on_a_kept_connection_arm_no_timer_of_their_own(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The head deadline of a request on a kept connection is the connection's one timer,
    armed already (for the keep-alive time): no timeout context, no timer handle."""

    async def answering(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, n: int) -> None:
        while True:
            await read_request(reader)
            writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\n{}")

    async with Scripted(answering) as upstream:
        pool = UpstreamPool(connect_timeout=5, idle_read=5, max_connections=0)
        target = UpstreamTarget(upstream.url)
        loop = asyncio.get_running_loop()
        made: list[str] = []
        real_timeout, real_at, real_call_at = asyncio.timeout, asyncio.timeout_at, loop.call_at

        def timeout(delay: float | None) -> asyncio.Timeout:
            made.append("timeout")
            return real_timeout(delay)

        def timeout_at(when: float | None) -> asyncio.Timeout:
            made.append("timeout_at")
            return real_at(when)

        def call_at(when: float, *args: Any, **kwargs: Any) -> asyncio.TimerHandle:
            made.append("call_at")
            return real_call_at(when, *args, **kwargs)

        try:
            async with asyncio.timeout(20):  # the bound on it all, made before counting
                for n in range(4):
                    if n == 1:  # the connection is made and kept: count from here
                        monkeypatch.setattr(asyncio, "timeout", timeout)
                        monkeypatch.setattr(asyncio, "timeout_at", timeout_at)
                        monkeypatch.setattr(loop, "call_at", call_at)
                    answer = await pool.request(target, "GET", "/", {}, head_timeout=HEAD_TIMEOUT)
                    assert await answer.read() == b"{}"
                    answer.release()
            assert upstream.connections == 1
            assert made == []
        finally:
            monkeypatch.undo()
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

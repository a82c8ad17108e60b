"""The upstream pool's policy (proxy/_upstream.py), on real sockets of our own.

Who waits for a free connection under ``upstream_max_connections`` and in which
order, what a bound running out blames, a kept connection lost to the keep-alive
race (replaced, the request sent again) and the window after which a request is
never sent twice. Each section below keeps the account of the finding it pins.
"""

from __future__ import annotations

import asyncio
import json

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

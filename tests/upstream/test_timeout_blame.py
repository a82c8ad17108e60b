"""The bound ``upstream_header_timeout`` running out is blamed on what was going on.

``pool.request`` tells "no free connection" (503 naming
``upstream_max_connections``) from "no head in time" (504). A header timeout that
fires during a slow connect is not about a connection limit (there may be none),
and a resend queued behind other requests past its timeout is the limit's, not a
silent upstream's.
"""

from __future__ import annotations

import asyncio
import json

import openai

from tests.support.e2e import RawClient
from tests.support.upstream import (
    SSE_HEAD,
    Scripted,
    black_hole,
    chat_sse_events,
    chunk,
    json_answer,
    proxy_app,
    read_request,
)


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

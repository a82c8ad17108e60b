"""An upstream that sends its 200 head before it reads the request body still gets all of it.

A streaming server may open its event stream first (an aiohttp handler that
``prepare()``s its response before ``await request.json()``) and read the body
afterwards. A client may stop sending the body only on an error answer (RFC
9112 section 9.3, RFC 9110 section 15); a 2xx head means "go on", so the
upload continues and the stream completes instead of hanging, both sides
waiting, until the idle-read timeout.
"""

from __future__ import annotations

import asyncio

import openai

from tests.support.upstream import (
    SSE_HEAD,
    Scripted,
    chat_sse_events,
    chunk,
    chunked,
    content_length,
    proxy_app,
)


async def test_a_200_head_before_the_body_is_read_does_not_stop_the_upload() -> None:
    got = asyncio.get_running_loop().create_future()

    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, n: int) -> None:
        head = await reader.readuntil(b"\r\n\r\n")
        length = content_length(head)
        first, last, done = chat_sse_events()
        writer.write(SSE_HEAD + chunk(first))  # the head (and an event) first ...
        await writer.drain()
        body = await reader.readexactly(length)  # ... then the body
        if not got.done():
            got.set_result(len(body))
        writer.write(chunked(last, done))
        await writer.drain()

    big = "x" * 30_000_000
    async with (
        Scripted(serve) as upstream,
        proxy_app(upstream.url, upstream_idle_read_timeout=5.0) as (url, _app),
        openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="sk-x", max_retries=0, timeout=30) as sdk,
    ):
        stream = await sdk.chat.completions.create(
            model="m",
            messages=[{"role": "user", "content": big}],
            stream=True,
        )
        finishes = []
        try:
            async for event in stream:
                if event.choices and event.choices[0].finish_reason:
                    finishes.append(event.choices[0].finish_reason)
        except openai.APIError as exc:
            raise AssertionError(
                f"upstream got {got.result() if got.done() else 'no complete'} body; "
                f"stream failed: {exc}"
            ) from None
    assert got.done() and got.result() > 30_000_000
    assert finishes == ["stop"]

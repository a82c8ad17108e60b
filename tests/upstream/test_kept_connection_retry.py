"""A kept connection the upstream closes as it is reused is replaced and the request sent again.

Node, uvicorn and gunicorn close idle keep-alive connections after 2-5 s; the
proxy keeps them 15 s. When the upstream's close (or the ``408 Request
Timeout`` that Node, Apache and nginx send first) crosses the proxy's next
request on the wire, the upstream has not acted on that request, and its body
is still in the proxy's memory: the request goes out once more on a new
connection, as Go's net/http does (RFC 9112 section 9.3.1), and the client never
sees the race as a 502 or a 408.
"""

from __future__ import annotations

import asyncio

import openai
from openai.types.chat import ChatCompletionMessageParam

from tests.support.upstream import Script, Scripted, json_answer, proxy_for, read_request


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

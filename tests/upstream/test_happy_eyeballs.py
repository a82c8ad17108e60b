"""An upstream host name whose first address is dead is reached on its next address at once.

``api.anthropic.com`` and ``api.openai.com`` have AAAA records; on a network
where IPv6 is routed nowhere (SYNs dropped) the first address ``getaddrinfo``
gives never answers. The pool races the next address after 250 ms (happy
eyeballs, RFC 8305), as aiohttp's connector does, instead of waiting on the
dead one until ``upstream_connect_timeout`` and failing the request with a 504
on every new connection.

The dead address here is a loopback listener whose accept queue is full (the
kernel drops further SYNs); the host name resolves to it first, then to the
real upstream on the same port.
"""

from __future__ import annotations

import asyncio
import time

import openai
import pytest

from tests.support.upstream import (
    Scripted,
    black_hole,
    dead_first,
    json_answer,
    proxy_app,
    read_request,
)


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

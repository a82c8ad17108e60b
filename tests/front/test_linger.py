"""A refusal sent before the body was read reaches a client still uploading (proxy/_front.py).

The proxy refuses some requests from their head alone (413 for a declared
length over ``max_body_bytes``, 415, 503 busy) and closes the connection, as
the rest of the body cannot be told from a next request. A client such as the
openai or anthropic SDK writes its whole body before it reads: a close with
its bytes still arriving makes the kernel answer them with a reset, and the
client sees a connection error (and retries, uploading again) instead of the
413. So the connection lingers, reading and dropping what comes, until the
client is done or ``LINGER_TIMEOUT`` seconds have passed (aiohttp's server
did the same for 10 s). Real SDKs and sockets on 127.0.0.1; every wait bounded.
"""

from __future__ import annotations

import asyncio
import contextlib
import time

import anthropic
import openai
import pytest

from proxy import _http1
from proxy.testing import proxy_with_emulator
from tests.support.e2e import CHAT_PATH, wait_until

LIMIT = 1024 * 1024
BIG = "x" * (8 * LIMIT)  # far more than the kernel's socket buffers take at once


async def test_the_sdks_get_the_413_of_a_body_over_the_limit_not_a_connection_error() -> None:
    async with proxy_with_emulator(max_body_bytes=LIMIT) as h:
        oai = openai.AsyncOpenAI(base_url=f"{h.url}/v1", api_key="sk-linger", max_retries=0)
        ant = anthropic.AsyncAnthropic(base_url=h.url, api_key="sk-linger", max_retries=0)
        try:
            with pytest.raises(openai.APIStatusError) as chat:
                await oai.chat.completions.create(
                    model="m", messages=[{"role": "user", "content": BIG}]
                )
            with pytest.raises(anthropic.APIStatusError) as messages:
                await ant.messages.create(
                    model="m", max_tokens=8, messages=[{"role": "user", "content": BIG}]
                )
        finally:
            await oai.close()
            await ant.close()
        assert chat.value.status_code == 413 and messages.value.status_code == 413
        assert h.emulator.stats == []


async def test_a_lingering_connection_is_closed_at_the_linger_timeout(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(_http1, "LINGER_TIMEOUT", 0.5)
    async with proxy_with_emulator(max_body_bytes=LIMIT) as h:
        host, _, port = h.url.removeprefix("http://").partition(":")
        reader, writer = await asyncio.open_connection(host, int(port))
        try:
            writer.write(
                f"POST {CHAT_PATH} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                f"Content-Length: {100 * LIMIT}\r\n\r\n".encode()
            )
            async with asyncio.timeout(5.0):
                head = await reader.readuntil(b"\r\n\r\n")
                started = time.monotonic()
                assert head.startswith(b"HTTP/1.1 413")
                length = int(head.lower().partition(b"content-length:")[2].split(b"\r\n")[0])
                await reader.readexactly(length)
                closed = asyncio.ensure_future(reader.read(1))
                # The client goes on uploading, a KiB per 20 ms (bounded: at least 10 s).
                for _ in range(500):
                    if closed.done():
                        break
                    try:
                        writer.write(b"x" * 1024)
                        await writer.drain()
                    except ConnectionError:
                        break
                    await asyncio.sleep(0.02)
                with contextlib.suppress(ConnectionError):
                    assert await closed == b""
                elapsed = time.monotonic() - started
        finally:
            writer.close()
        # Cut at the linger timeout (0.5 s), not by the client's 10 s of uploading; the
        # upper bound is generous for a loaded machine.
        assert 0.4 <= elapsed < 6.0, elapsed
        await wait_until(lambda: not h.state.exchanges, "no exchange is left")

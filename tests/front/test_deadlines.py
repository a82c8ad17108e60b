"""Slow clients have deadlines: request headers (``header_timeout``) and bodies (``body_timeout``).

A client that sends its headers one byte at a time, or trickles its body one
byte per less than ``body_idle_timeout``, would otherwise hold a connection,
a handler and a buffer for as long as it likes. Small settings keep the tests
short; every wait is bounded.
"""

from __future__ import annotations

import asyncio
import json
import time

import pytest

from proxy._front import ClientConnection
from proxy.testing import proxy_with_emulator
from tests.support.e2e import ANTHROPIC_PATH, CHAT_PATH, RawClient, exact_body, wait_until

HEADER_TIMEOUT = 0.6
BODY_TIMEOUT = 2.0
# The idle timeout is 10 steps: a step delayed 0.9 s by a loaded machine is still not idle.
IDLE = 1.0
STEP = 0.1  # seconds between two trickled bytes: well under the idle timeout


def _head(target: str, length: int) -> bytes:
    return (
        f"POST {target} HTTP/1.1\r\nHost: 127.0.0.1\r\n"
        f"Content-Type: application/json\r\nContent-Length: {length}\r\n\r\n"
    ).encode()


async def _trickle(client: RawClient, data: bytes, within: float) -> tuple[int, float, bytes]:
    """Send ``data`` a byte per STEP until the proxy answers or closes.

    Returns (bytes sent, seconds until the proxy answered or closed, the
    response with its ``Content-Length`` body): ``b""`` is a close without an
    answer. (After an answer the proxy lingers a while reading the unsent rest
    before it closes; the response is complete before that.)
    """
    started = time.monotonic()
    reply = asyncio.ensure_future(client.reader.read(1))
    sent = 0
    try:
        async with asyncio.timeout(within):
            for byte in range(len(data)):
                try:
                    await client.send(data[byte : byte + 1])
                except ConnectionError:
                    break
                sent += 1
                done, _ = await asyncio.wait([reply], timeout=STEP)
                if done:
                    break
            first = await reply
            elapsed = time.monotonic() - started
            rest = b""
            if first:
                rest = await client.reader.readuntil(b"\r\n\r\n")
                length = int(rest.lower().partition(b"content-length:")[2].split(b"\r\n")[0])
                rest += await client.reader.readexactly(length)
    finally:
        reply.cancel()
    return sent, elapsed, first + rest


async def test_headers_sent_a_byte_at_a_time_are_cut_at_the_header_deadline() -> None:
    async with proxy_with_emulator(header_timeout=HEADER_TIMEOUT) as h:
        # Far more header bytes than fit in the deadline at one byte per STEP.
        head = _head(CHAT_PATH, 10).replace(b"\r\n\r\n", b"\r\nX-Pad: " + b"p" * 100 + b"\r\n\r\n")
        client = await RawClient.connect(h.url)
        try:
            sent, elapsed, reply = await _trickle(client, head, within=10 * HEADER_TIMEOUT)
        finally:
            await client.close()
        assert reply == b""  # closed without an answer: there is no request to answer
        assert sent < len(head), "the proxy kept a connection whose headers never completed"
        # The deadline fires (the trickle would go on for 10x it); upper bound generous.
        assert HEADER_TIMEOUT * 0.9 <= elapsed < HEADER_TIMEOUT + 3.0
        await wait_until(lambda: not h.state.exchanges, "no exchange is left")
        assert h.emulator.stats == []


async def test_the_header_deadline_applies_to_every_request_of_a_keep_alive_connection() -> None:
    async with proxy_with_emulator(header_timeout=HEADER_TIMEOUT) as h:
        body = exact_body(CHAT_PATH, 2_000)
        client = await RawClient.connect(h.url)
        try:
            # Prompt requests, with idle gaps longer than the deadline between them:
            # an idle keep-alive connection is not a slow client.
            for _ in range(2):
                await client.request("POST", CHAT_PATH, body)
                head = await client.read_head()
                assert head.status == 200
                await client.read_body(head)
                await asyncio.sleep(HEADER_TIMEOUT * 1.5)
            # The third request's headers trickle: cut like a first request's.
            head_bytes = _head(CHAT_PATH, len(body))
            sent, elapsed, reply = await _trickle(client, head_bytes, 10 * HEADER_TIMEOUT)
        finally:
            await client.close()
        assert (reply, sent < len(head_bytes)) == (b"", True)
        assert elapsed < HEADER_TIMEOUT + 3.0
        assert len(h.emulator.stats) == 2


async def test_a_body_trickled_under_the_idle_timeout_gets_408_at_the_body_deadline() -> None:
    async with proxy_with_emulator(body_timeout=BODY_TIMEOUT, body_idle_timeout=IDLE) as h:
        body = exact_body(ANTHROPIC_PATH, 400)
        client = await RawClient.connect(h.url)
        try:
            await client.send(_head(ANTHROPIC_PATH, len(body)))
            sent, elapsed, reply = await _trickle(client, body, within=20 * BODY_TIMEOUT)
        finally:
            await client.close()
        status_line, _, rest = reply.partition(b"\r\n")
        payload = json.loads(rest.partition(b"\r\n\r\n")[2])
        assert status_line.split(b" ")[1] == b"408"
        # In the route's protocol shape (Anthropic here), saying which deadline.
        assert payload["type"] == "error"
        assert payload["error"]["message"] == (
            f"request body not received within {BODY_TIMEOUT:g} seconds"
        )
        assert sent < len(body)
        assert BODY_TIMEOUT * 0.9 <= elapsed < BODY_TIMEOUT + 4.0
        await wait_until(lambda: not h.state.exchanges, "no exchange is left")
        assert h.emulator.stats == []


@pytest.mark.parametrize("name", ["header_timeout", "body_timeout"])
def test_deadlines_are_settings_with_documented_defaults(name: str) -> None:
    from proxy._config import ConfigError, Settings, load_settings

    assert getattr(Settings(), name) == {"header_timeout": 30.0, "body_timeout": 600.0}[name]
    env = {f"CONTEXT_PROXY_{name.upper()}": "2.5"}
    assert getattr(load_settings(environ=env), name) == 2.5
    # The error names the variable the bad value came from (issue 12, item 6).
    with pytest.raises(ConfigError, match=f"CONTEXT_PROXY_{name.upper()}"):
        load_settings(environ={f"CONTEXT_PROXY_{name.upper()}": "0"})


async def test_headers_that_arrive_whole_start_no_clock(monkeypatch: pytest.MonkeyPatch) -> None:
    started: list[float] = []
    start_clock = ClientConnection._start_header_clock

    def counting(handler: ClientConnection) -> None:
        started.append(time.monotonic())
        start_clock(handler)

    monkeypatch.setattr(ClientConnection, "_start_header_clock", counting)
    async with proxy_with_emulator(header_timeout=HEADER_TIMEOUT) as h:
        body = exact_body(CHAT_PATH, 2_000)
        client = await RawClient.connect(h.url)
        try:
            for _ in range(20):
                await client.request("POST", CHAT_PATH, body)
                head = await client.read_head()
                assert head.status == 200
                await client.read_body(head)
            assert started == []  # no clock read, no timer, for 20 prompt requests
            # Headers in two pieces: the first piece starts the one clock.
            head_bytes = _head(CHAT_PATH, len(body))
            await client.send(head_bytes[:10])
            await wait_until(lambda: len(started) == 1, "the header clock started")
            await client.send(head_bytes[10:] + body)
            head = await client.read_head()
            assert head.status == 200
            await client.read_body(head)
        finally:
            await client.close()
        assert len(started) == 1

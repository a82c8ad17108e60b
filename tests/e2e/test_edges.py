"""End to end: hang-ups in every phase, SSE edge cases relayed byte for byte, backpressure.

"Byte-identical" means: the client got exactly as many bytes as the emulator's
record says it sent for that very request (``bytes_sent``), with the same
xxh3_128 digest (``sent_digest``).
"""

from __future__ import annotations

import asyncio
import time
import tracemalloc

import aiohttp
import anthropic
import openai
import pytest
import xxhash
from anthropic.types import MessageParam
from openai.types.chat import ChatCompletionUserMessageParam

from proxy._emulator import DEFAULT_TEXT, Script, start_emulator
from proxy.testing import Harness
from tests.support.e2e import (
    ANTHROPIC_PATH,
    CHAT_PATH,
    RESPONSES_PATH,
    SECRET,
    WAIT_S,
    RawClient,
    sse_events,
    stream_body,
    wait_until,
)

OAI_USER: list[ChatCompletionUserMessageParam] = [{"role": "user", "content": "hi"}]
ANT_USER: list[MessageParam] = [{"role": "user", "content": "hi"}]
PATHS = [CHAT_PATH, RESPONSES_PATH, ANTHROPIC_PATH]
PATH_IDS = ["chat", "responses", "messages"]
# Events up to and including the first text delta, per protocol (emulator defaults):
# chat: role chunk, delta; Responses: created, in_progress, output_item.added,
# content_part.added, delta; Anthropic: message_start, content_block_start, ping, delta.
FIRST_DELTA_AT = {CHAT_PATH: 2, RESPONSES_PATH: 5, ANTHROPIC_PATH: 4}
FIRST_DELTA_TEXT = b"Hello fr"  # DEFAULT_TEXT split in 3 deltas


async def fetch(http: aiohttp.ClientSession, url: str, path: str, script: str) -> bytes:
    """POST a streaming request for ``path`` with ``script`` and return the body bytes."""
    async with http.post(
        url + path,
        data=stream_body(path),
        headers={"x-emulator": script, "Content-Type": "application/json"},
    ) as resp:
        assert resp.status == 200
        assert resp.content_type == "text/event-stream"
        return await resp.read()


async def assert_serves_normally(harness: Harness, http: aiohttp.ClientSession) -> None:
    """A full stream on each protocol still works, and no exchange is left behind."""
    for path in PATHS:
        raw = await fetch(http, harness.url, path, "chunks=3")
        events = sse_events(raw)
        assert events[-1][1] == "[DONE]" or events[-1][0] in ("response.completed", "message_stop")
    await wait_until(lambda: not harness.state.exchanges, "done with every exchange")


# ----------------------------------------------------------------- hang-ups


@pytest.mark.parametrize("hangup", ["reset", "close"])
@pytest.mark.parametrize("path", PATHS, ids=PATH_IDS)
@pytest.mark.parametrize("phase", ["upstream_headers", "first_byte", "mid_stream"])
async def test_client_gone_aborts_the_upstream_request(
    harness: Harness, http: aiohttp.ClientSession, phase: str, path: str, hangup: str
) -> None:
    emulator = harness.emulator
    script = {
        "upstream_headers": "stall_headers=30",
        "first_byte": "hold=first; stall_after=0",
        "mid_stream": f"hold=mid; stall_after={FIRST_DELTA_AT[path]}",
    }[phase]
    client = await RawClient.connect(harness.url)
    await client.request("POST", path, stream_body(path), [("x-emulator", script)])
    if phase == "upstream_headers":
        await emulator.wait_received(1, WAIT_S)
    elif phase == "first_byte":
        record = await emulator.wait_holding(1, WAIT_S)
        assert record.headers_sent and record.events_sent == 0
    else:
        head = await client.read_head()
        assert head.status == 200
        got = bytearray()
        async for chunk in client.iter_body(head):
            got += chunk
            if FIRST_DELTA_TEXT in got:
                break
        await emulator.wait_holding(1, WAIT_S)
    if hangup == "reset":
        client.abort()
    else:
        await client.close()
    record = await emulator.wait_aborted(1, WAIT_S)
    assert not record.finished
    await assert_serves_normally(harness, http)


# ----------------------------------------------------------------- SSE edge cases


@pytest.mark.parametrize("script", ["chunks=3", "gzip=1; long_line=200000", "split_utf8=1"])
async def test_emulator_sent_digest_is_what_a_client_reads(
    http: aiohttp.ClientSession, script: str
) -> None:
    """The yardstick of the byte-identity tests below (emulator alone, no proxy)."""
    async with await start_emulator() as emulator:
        raw = await fetch(http, emulator.url, ANTHROPIC_PATH, script)
        record = await emulator.wait_closed(1, WAIT_S)
    assert record.sent_digest == xxhash.xxh3_128_hexdigest(raw)
    assert (record.bytes_sent == len(raw)) is ("gzip" not in script)


EDGE_CASES = [
    ("long_line", CHAT_PATH, "long_line=3000000", b'"content":"0123456789abcdefghij'),
    ("long_line", ANTHROPIC_PATH, "long_line=3000000", b'"text":"0123456789abcdefghij'),
    ("split_utf8", CHAT_PATH, "split_utf8=1", "\u20ac".encode()),
    ("split_utf8", RESPONSES_PATH, "split_utf8=1", "\u20ac".encode()),
    ("split_utf8", ANTHROPIC_PATH, "split_utf8=1", "\u20ac".encode()),
    ("crlf", RESPONSES_PATH, "crlf=1", b"\r\n\r\n"),
    ("crlf", ANTHROPIC_PATH, "crlf=1", b"\r\n\r\n"),
    ("comments", CHAT_PATH, "comments=1", b"\n: keep-alive\n\n"),
    ("ping", CHAT_PATH, "ping=1", b": ping\n\n"),
    ("ping", ANTHROPIC_PATH, "ping=1", b'event: ping\ndata: {"type":"ping"}\n\n'),
    ("unknown_event", CHAT_PATH, "unknown_event=1", b"event: emulator.unknown\n"),
    ("unknown_event", RESPONSES_PATH, "unknown_event=1", b"event: emulator.unknown\n"),
    ("unknown_event", ANTHROPIC_PATH, "unknown_event=1", b"event: emulator.unknown\n"),
    *[
        (
            "everything",
            path,
            "crlf=1; comments=1; ping=1; unknown_event=1; split_utf8=1; long_line=300000",
            b"event: emulator.unknown\r\n",
        )
        for path in PATHS
    ],
]


@pytest.mark.parametrize(
    ("path", "script", "marker"),
    [case[1:] for case in EDGE_CASES],
    ids=[f"{case[0]}-{dict(zip(PATHS, PATH_IDS, strict=True))[case[1]]}" for case in EDGE_CASES],
)
async def test_sse_edge_cases_are_relayed_byte_identical(
    harness: Harness, http: aiohttp.ClientSession, path: str, script: str, marker: bytes
) -> None:
    proxied = await fetch(http, harness.url, path, script)
    record = await harness.emulator.wait_closed(1, WAIT_S)
    assert record.finished and record.status == 200
    assert len(proxied) == record.bytes_sent
    assert xxhash.xxh3_128_hexdigest(proxied) == record.sent_digest
    assert marker in proxied  # the edge case is really in the stream
    if "long_line" in script:
        size = int(script.rsplit("long_line=", 1)[1])
        assert max(len(line) for line in proxied.splitlines()) > size


async def test_sdks_read_edge_case_streams_through_the_proxy(harness: Harness) -> None:
    long_split = Script(long_line=3_000_000, split_utf8=True)
    async with openai.AsyncOpenAI(
        base_url=harness.openai_base_url, api_key=SECRET, max_retries=0, timeout=20
    ) as client:
        stream = await client.chat.completions.create(
            model="m",
            messages=OAI_USER,
            stream=True,
            extra_headers={"x-emulator": "long_line=3000000; split_utf8=1; ping=1; comments=1"},
        )
        text = "".join([c.choices[0].delta.content or "" async for c in stream if c.choices])
        assert text == long_split.expected_text()
        assert len(text) > 3_000_000 and text.endswith(" \u20ac")
        async with client.responses.stream(
            model="m",
            input="hi",
            extra_headers={"x-emulator": "crlf=1; comments=1; unknown_event=1; split_utf8=1"},
        ) as events:
            final = await events.get_final_response()
        assert final.output_text == DEFAULT_TEXT + " \u20ac"
    async with (
        anthropic.AsyncAnthropic(
            base_url=harness.url, api_key=SECRET, max_retries=0, timeout=20
        ) as ant_client,
        ant_client.messages.stream(
            model="m",
            max_tokens=8,
            messages=ANT_USER,
            extra_headers={"x-emulator": "crlf=1; ping=1; unknown_event=1; split_utf8=1"},
        ) as ant_stream,
    ):
        pieces = [piece async for piece in ant_stream.text_stream]
    assert "".join(pieces) == DEFAULT_TEXT + " \u20ac"


# ----------------------------------------------------------------- backpressure

# Loopback socket buffers on both hops hold ~9 MB between them on Linux (send
# buffers autotune up to net.ipv4.tcp_wmem's 4 MB); the answer must be well
# above that for a stall to prove anything.
ANSWER_BYTES = 32_000_000


async def test_slow_client_backpressures_the_upstream(
    harness: Harness, http: aiohttp.ClientSession
) -> None:
    """A client that stops reading stops the upstream read: the emulator's writes stall far
    below the answer's size and the proxy buffers nothing of it; then the client reads all
    of it, byte for byte."""
    emulator = harness.emulator
    script = f"long_line={ANSWER_BYTES}"
    # A small receive window makes the stall show up early on the client's side.
    client = await RawClient.connect(harness.url, rcvbuf=64 * 1024)
    tracemalloc.start()
    try:
        baseline = tracemalloc.get_traced_memory()[0]
        tracemalloc.reset_peak()
        await client.request("POST", CHAT_PATH, stream_body(CHAT_PATH), [("x-emulator", script)])
        head = await client.read_head()
        assert head.status == 200
        await emulator.wait_events(1, 2, WAIT_S)  # the huge delta is being written
        # Nothing signals "the writes stopped"; watch the emulator's byte count
        # until it stays still for 0.3 s (bounded: 5 s).
        stalled_at, still_since = -1, time.monotonic()
        deadline = still_since + 5.0
        while time.monotonic() < deadline:
            sent = emulator.record(1).bytes_sent
            if sent != stalled_at:
                stalled_at, still_since = sent, time.monotonic()
            elif time.monotonic() - still_since >= 0.3:
                break
            await asyncio.sleep(0.05)  # a sampling interval, not a synchronization
        else:
            pytest.fail(f"the emulator never stalled (at {stalled_at} bytes)")
        peak = tracemalloc.get_traced_memory()[1] - baseline
    finally:
        tracemalloc.stop()
    assert 0 < stalled_at < ANSWER_BYTES // 2, f"stalled at {stalled_at} bytes"
    assert not emulator.record(1).finished
    (exchange,) = harness.state.exchanges.values()
    assert exchange.held_bytes().total == 0  # the request body went at the release boundary
    # Python-level allocations in the whole process (proxy, emulator, client) while
    # ~half the answer passed: a proxy that buffered the answer would show it here.
    assert peak < 8 << 20, f"{peak} bytes allocated while the client did not read"

    received = bytearray()
    async for chunk in client.iter_body(head):
        received += chunk
    await client.close()
    record = await emulator.wait_closed(1, WAIT_S)
    assert record.finished
    assert len(received) == record.bytes_sent > ANSWER_BYTES
    assert xxhash.xxh3_128_hexdigest(received) == record.sent_digest
    assert received.endswith(b"\n\ndata: [DONE]\n\n")
    assert max(len(line) for line in received.split(b"\n")) > ANSWER_BYTES

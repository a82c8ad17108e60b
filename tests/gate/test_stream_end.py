"""End to end: the stream end rule and wrong upstream answers, with the real SDKs as clients.

Each upstream here is a small raw-socket server of our own (the emulator cannot
send a terminal event without its blank line, end a body mid-event cleanly, or
answer with a header over the parser's limit). The proxy runs in this process.

R1: once the terminal event was relayed, what follows goes out as is and nothing
is added, even when the upstream never ended that event with a blank line (the
anthropic SDK's own fixtures end so). R2: a body that ends before the terminal
event, cleanly (HTTP/1.0 close-delimited, chunked with its end marker) or not,
reaches the client as its complete events byte for byte plus one in-band error
event the SDK raises as its API error; the unterminated fragment is not relayed.
"""

from __future__ import annotations

import asyncio
import contextlib
import gzip
import json
import socket
import threading
import time
from collections.abc import AsyncIterator
from typing import Any, Final

import aiohttp
import anthropic
import openai
import pytest

from plugins.fold import FoldPlugin
from proxy import _protocols as protocols
from proxy._plugins import Plugin, PrepareContext
from proxy._protocols import Protocol
from tests.support.e2e import ANTHROPIC_PATH, CHAT_PATH, RESPONSES_PATH
from tests.support.lifetime import Recorder, conversation
from tests.support.upstream import (
    SSE_HEAD,
    HoldingUpstream,
    RawUpstream,
    Scripted,
    chunked,
    proxy_app,
    proxy_for,
    read_request,
)

KEY: Final = "sk-stream-end-test"
BOUND_S: Final = 10.0


def _event(name: str | None, payload: dict[str, Any]) -> bytes:
    head = f"event: {name}\n".encode() if name else b""
    return head + b"data: " + json.dumps(payload, separators=(",", ":")).encode() + b"\n\n"


_CHUNK: Final = {"id": "c1", "object": "chat.completion.chunk", "created": 0, "model": "m"}
_RESPONSE: Final = {"id": "r1", "object": "response", "created_at": 0, "model": "m", "output": []}
_MESSAGE: Final = {
    "id": "msg_1",
    "type": "message",
    "role": "assistant",
    "model": "m",
    "content": [],
    "stop_reason": None,
    "stop_sequence": None,
    "usage": {"input_tokens": 3, "output_tokens": 1},
}

#: Per protocol: the events of a short answer "Hello", the last one being the terminal event.
STREAMS: Final[dict[str, list[bytes]]] = {
    CHAT_PATH: [
        _event(None, {**_CHUNK, "choices": [{"index": 0, "delta": {"role": "assistant"}}]}),
        _event(None, {**_CHUNK, "choices": [{"index": 0, "delta": {"content": "Hel"}}]}),
        _event(
            None,
            {
                **_CHUNK,
                "choices": [{"index": 0, "delta": {"content": "lo"}, "finish_reason": "stop"}],
            },
        ),
        b"data: [DONE]\n\n",
    ],
    RESPONSES_PATH: [
        _event(
            "response.created",
            {"type": "response.created", "sequence_number": 0, "response": {**_RESPONSE}},
        ),
        _event(
            "response.output_text.delta",
            {
                "type": "response.output_text.delta",
                "item_id": "i1",
                "output_index": 0,
                "content_index": 0,
                "delta": "Hel",
                "sequence_number": 1,
            },
        ),
        _event(
            "response.output_text.delta",
            {
                "type": "response.output_text.delta",
                "item_id": "i1",
                "output_index": 0,
                "content_index": 0,
                "delta": "lo",
                "sequence_number": 2,
            },
        ),
        _event(
            "response.completed",
            {
                "type": "response.completed",
                "sequence_number": 3,
                "response": {**_RESPONSE, "status": "completed"},
            },
        ),
    ],
    ANTHROPIC_PATH: [
        _event("message_start", {"type": "message_start", "message": _MESSAGE}),
        _event(
            "content_block_start",
            {
                "type": "content_block_start",
                "index": 0,
                "content_block": {"type": "text", "text": ""},
            },
        ),
        _event(
            "content_block_delta",
            {
                "type": "content_block_delta",
                "index": 0,
                "delta": {"type": "text_delta", "text": "Hel"},
            },
        ),
        _event(
            "content_block_delta",
            {
                "type": "content_block_delta",
                "index": 0,
                "delta": {"type": "text_delta", "text": "lo"},
            },
        ),
        _event("content_block_stop", {"type": "content_block_stop", "index": 0}),
        _event(
            "message_delta",
            {
                "type": "message_delta",
                "delta": {"stop_reason": "end_turn"},
                "usage": {"output_tokens": 2},
            },
        ),
        # The anthropic SDK's recorded fixtures carry no event: line and no final newline.
        b'data: {"type":"message_stop"}\n\n',
    ],
}
PATHS: Final = list(STREAMS)
IDS: Final = ["chat", "responses", "messages"]
PROTOCOL: Final = {
    CHAT_PATH: Protocol.CHAT,
    RESPONSES_PATH: Protocol.RESPONSES,
    ANTHROPIC_PATH: Protocol.MESSAGES,
}


def framed(body: bytes, framing: str) -> bytes:
    """A whole upstream answer carrying ``body`` as an event stream.

    ``chunked``: chunked with its end marker (a clean end); ``close``: HTTP/1.0,
    delimited by the close (a clean end); ``length``: a ``Content-Length`` that
    matches (a clean end); ``cut``: chunked without its end marker.
    """
    if framing == "chunked":
        return SSE_HEAD + chunked(body)
    if framing == "close":
        return b"HTTP/1.0 200 OK\r\nContent-Type: text/event-stream\r\n\r\n" + body
    if framing == "length":
        return (
            b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\n"
            b"Content-Length: %d\r\n\r\n%s" % (len(body), body)
        )
    assert framing == "cut"
    return SSE_HEAD + chunked(body)[: -len(b"0\r\n\r\n")]


async def sdk_text(path: str, url: str) -> tuple[str, list[Any]]:
    """Stream one answer through the SDK of ``path``'s protocol: (text, events yielded)."""
    events: list[Any] = []
    text = ""
    if path == ANTHROPIC_PATH:
        async with anthropic.AsyncAnthropic(base_url=url, api_key=KEY, max_retries=0) as claude:
            stream = await claude.messages.create(
                model="m", max_tokens=16, messages=[{"role": "user", "content": "hi"}], stream=True
            )
            async for ev in stream:
                events.append(ev)
                if ev.type == "content_block_delta" and ev.delta.type == "text_delta":
                    text += ev.delta.text
        return text, events
    async with openai.AsyncOpenAI(base_url=f"{url}/v1", api_key=KEY, max_retries=0) as client:
        if path == CHAT_PATH:
            chunks = await client.chat.completions.create(
                model="m", messages=[{"role": "user", "content": "hi"}], stream=True
            )
            async for chunk in chunks:
                events.append(chunk)
                if chunk.choices and chunk.choices[0].delta.content:
                    text += chunk.choices[0].delta.content
        else:
            stream = await client.responses.create(model="m", input="hi", stream=True)
            async for ev in stream:
                events.append(ev)
                if ev.type == "response.output_text.delta":
                    text += ev.delta
    return text, events


def request_for(path: str) -> bytes:
    if path == RESPONSES_PATH:
        return json.dumps({"model": "m", "input": "hi", "stream": True}).encode()
    payload: dict[str, Any] = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
    if path == ANTHROPIC_PATH:
        payload["max_tokens"] = 16
    return json.dumps({**payload, "stream": True}).encode()


async def raw_body(url: str, path: str) -> bytes:
    """The proxy's answer body for a streaming request, as bytes (no SDK in between)."""
    async with (
        aiohttp.ClientSession() as http,
        http.post(url + path, data=request_for(path)) as resp,
    ):
        assert resp.status == 200
        return await resp.read()


# ------------------------------------------------------------------------------ R1


@pytest.mark.parametrize("framing", ["chunked", "close", "length"])
@pytest.mark.parametrize("ending", [b"", b"\n"], ids=["no-newline", "one-newline"])
@pytest.mark.parametrize("path", PATHS, ids=IDS)
async def test_r1_a_terminal_event_without_its_blank_line_ends_the_answer(
    path: str, ending: bytes, framing: str
) -> None:
    *body, last = STREAMS[path]
    sent = b"".join(body) + last.removesuffix(b"\n\n") + ending
    # Directly, each SDK accepts this stream; through the proxy it must too.
    async with RawUpstream(lambda target: framed(sent, framing)) as upstream:
        text, events = await sdk_text(path, upstream.url)
        assert text == "Hello"
        async with proxy_for(upstream.url) as url:
            assert await sdk_text(path, url) == (text, events)
            # Byte for byte what the upstream sent: nothing completed, nothing appended.
            assert await raw_body(url, path) == sent


@pytest.mark.parametrize("line_end", [b"\n", b"\r\n"], ids=["lf", "crlf"])
@pytest.mark.parametrize("path", PATHS, ids=IDS)
async def test_r1_a_terminal_event_without_its_blank_line_on_an_open_connection_ends_soon(
    path: str, line_end: bytes
) -> None:
    """The upstream sends the terminal event's data line (its line end included) but
    no blank line and keeps the connection open: the client's answer ends within the
    terminal-event grace, not after the upstream idle read timeout (300 s)."""
    *body, last = STREAMS[path]
    sent = b"".join(body) + last.removesuffix(b"\n\n") + line_end
    for client in ("sdk", "raw"):
        async with (
            HoldingUpstream(sent, hold_s=BOUND_S * 3) as upstream,
            proxy_for(upstream.url) as url,
        ):
            loop = asyncio.get_running_loop()
            began = loop.time()
            async with asyncio.timeout(BOUND_S):
                if client == "sdk":
                    assert (await sdk_text(path, url))[0] == "Hello"
                else:
                    assert await raw_body(url, path) == sent
            assert loop.time() - began < BOUND_S / 2


@pytest.mark.parametrize("path", PATHS, ids=IDS)
async def test_r1_bytes_after_the_terminal_event_are_relayed_as_is(path: str) -> None:
    sent = b"".join(STREAMS[path]) + b": trailing comment\n\ndata: junk"
    async with (
        RawUpstream(lambda target: framed(sent, "chunked")) as upstream,
        proxy_for(upstream.url) as url,
    ):
        assert (await sdk_text(path, url))[0] == "Hello"
        assert await raw_body(url, path) == sent


# ------------------------------------------------------------------------------ R2


@pytest.mark.parametrize("framing", ["chunked", "close", "length", "cut"])
@pytest.mark.parametrize("path", PATHS, ids=IDS)
async def test_r2_a_body_ending_mid_event_gets_one_error_the_sdk_raises(
    path: str, framing: str
) -> None:
    """The upstream dies in the middle of its third event: in one chunk with two complete
    events (a relay forwarding whole chunks would pass the fragment on)."""
    events = STREAMS[path]
    complete = b"".join(events[:2])
    fragment = events[2][: len(events[2]) // 2]
    message = (
        "upstream stream failed: upstream closed the connection mid-answer"
        if framing == "cut"
        else "upstream stream ended without its final event"
    )
    # Responses: numbered after the last relayed event (1).
    error = protocols.inband_error(PROTOCOL[path], message, sequence_number=2)
    async with (
        RawUpstream(lambda target: framed(complete + fragment, framing)) as upstream,
        proxy_for(upstream.url) as url,
    ):
        assert await raw_body(url, path) == complete + error
        if path == CHAT_PATH:
            with pytest.raises(openai.APIError, match=message):
                await sdk_text(path, url)
        elif path == ANTHROPIC_PATH:
            with pytest.raises(anthropic.APIStatusError, match=message):
                await sdk_text(path, url)
        else:
            # The openai SDK yields a Responses error event typed, as it comes.
            text, got = await sdk_text(path, url)
            assert text == "Hel"
            assert got[-1].type == "error" and got[-1].message == message
            assert got[-1].sequence_number == 2


# ------------------------------------------------------------------ wrong answers


def _html(target: str) -> bytes:
    page = b"<html><body>Captive portal: please log in</body></html>"
    return (
        b"HTTP/1.1 200 OK\r\nContent-Type: text/html; charset=utf-8\r\n"
        b"Content-Length: %d\r\n\r\n%s" % (len(page), page)
    )


@pytest.mark.parametrize("path", PATHS, ids=IDS)
async def test_an_html_answer_to_a_streaming_request_is_a_502_naming_it(path: str) -> None:
    async with RawUpstream(_html) as upstream, proxy_for(upstream.url) as url:
        sdk_error = anthropic.APIStatusError if path == ANTHROPIC_PATH else openai.APIStatusError
        with pytest.raises(sdk_error) as raised:
            await sdk_text(path, url)
        assert raised.value.status_code == 502
        assert "200" in str(raised.value) and "text/html" in str(raised.value)
        async with (
            aiohttp.ClientSession() as http,
            http.post(url + path, data=request_for(path)) as resp,
        ):
            body = await resp.read()
            assert resp.status == 502 and resp.content_type == "application/json"
        assert b"Captive portal" not in body


def _huge_header(target: str) -> bytes:
    return (
        b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nX-Trace: "
        + b"t" * 20_000
        + b"\r\nContent-Length: 0\r\n\r\n"
    )


async def test_upstream_headers_over_the_parser_limit_are_a_502_saying_so() -> None:
    async with RawUpstream(_huge_header) as upstream, proxy_for(upstream.url) as url:
        with pytest.raises(openai.APIStatusError) as raised:
            await sdk_text(CHAT_PATH, url)
        assert raised.value.status_code == 502
        assert "header" in raised.value.message and "limit" in raised.value.message
        assert "unreachable" not in raised.value.message


def _gzipped(body: bytes, content_type: str, *, cut: int) -> bytes:
    packed = gzip.compress(body)[:-cut] if cut else gzip.compress(body)
    return (
        b"HTTP/1.1 200 OK\r\nContent-Type: %s\r\nContent-Encoding: gzip\r\n"
        b"Content-Length: %d\r\n\r\n%s" % (content_type.encode(), len(packed), packed)
    )


@pytest.mark.parametrize("path", PATHS, ids=IDS)
async def test_a_truncated_gzip_stream_ends_with_an_error_event(path: str) -> None:
    """The HTTP framing is complete (Content-Length matches) but the gzip trailer is
    missing: the answer is not complete, whatever the framing says."""
    events = STREAMS[path]
    complete = b"".join(events[:2])
    # Cut the 8-byte trailer (CRC32, size): all the events decode, the stream does not end.
    reply = _gzipped(complete, "text/event-stream", cut=8)
    message = "upstream stream failed: truncated gzip body"
    async with RawUpstream(lambda target: reply) as upstream, proxy_for(upstream.url) as url:
        error = protocols.inband_error(PROTOCOL[path], message, sequence_number=2)
        assert await raw_body(url, path) == complete + error


async def test_a_truncated_gzip_json_answer_is_cut_not_relayed_as_complete() -> None:
    answer = json.dumps(
        {
            "id": "c1",
            "object": "chat.completion",
            "choices": [
                {
                    "index": 0,
                    "message": {"role": "assistant", "content": "Hello"},
                    "finish_reason": "stop",
                }
            ],
        }
    ).encode()
    whole = _gzipped(answer, "application/json", cut=0)
    truncated = _gzipped(answer, "application/json", cut=8)
    plain = json.dumps({"model": "m", "messages": [{"role": "user", "content": "hi"}]}).encode()
    async with aiohttp.ClientSession() as http:
        async with (
            RawUpstream(lambda target: whole) as upstream,
            proxy_for(upstream.url) as url,
            http.post(url + CHAT_PATH, data=plain) as resp,
        ):
            assert resp.status == 200 and await resp.read() == answer
        async with (
            RawUpstream(lambda target: truncated) as upstream,
            proxy_for(upstream.url) as url,
        ):
            async with http.post(url + CHAT_PATH, data=plain) as resp:
                assert resp.status == 200
                with pytest.raises(aiohttp.ClientPayloadError):
                    await resp.read()
            async with openai.AsyncOpenAI(base_url=f"{url}/v1", api_key=KEY, max_retries=0) as sdk:
                with pytest.raises(openai.APIConnectionError):
                    await sdk.chat.completions.create(
                        model="m", messages=[{"role": "user", "content": "hi"}]
                    )


# ------------------------------------------------------- no refold for a gone client


class Levels(Plugin):
    """Records the fold level of every prepare run."""

    name = "levels"

    def __init__(self) -> None:
        self.levels: list[int] = []

    async def prepare(self, ctx: PrepareContext) -> bool:
        self.levels.append(ctx.fold_level)
        return False


_OVERFLOW: Final = json.dumps(
    {
        "error": {
            "message": "This model's maximum context length is 8192 tokens",
            "type": "invalid_request_error",
            "param": "messages",
            "code": "context_length_exceeded",
        }
    }
).encode()


@contextlib.asynccontextmanager
async def overflow_upstream(
    client_gone: threading.Event,
) -> AsyncIterator[tuple[str, threading.Event]]:
    """Answers the first request with a 400 overflow, then blocks this event loop until
    the client has hung up, so the proxy sees both in one turn of its loop: the answer
    first, the hang-up before its handler runs again (before the cancellation lands)."""
    answered = threading.Event()

    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, n: int) -> None:
        await read_request(reader)
        writer.write(
            b"HTTP/1.1 400 Bad Request\r\nContent-Type: application/json\r\n"
            b"Content-Length: %d\r\n\r\n%s" % (len(_OVERFLOW), _OVERFLOW)
        )
        answered.set()
        # Blocking on purpose: nothing else on this loop may run until the client is gone.
        client_gone.wait(BOUND_S)
        time.sleep(0.05)  # noqa: ASYNC251  # the hang-up must reach the proxy's socket first
        await writer.drain()  # a hang-up here ends the script quietly (Scripted)

    async with Scripted(serve) as upstream:
        yield upstream.url, answered


def _hang_up_after(url: str, body: bytes, answered: threading.Event, gone: threading.Event) -> None:
    """A blocking client in its own thread: send the request, hang up once it was answered."""
    host, port = url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=BOUND_S) as sock:
        sock.sendall(
            b"POST %s HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            b"Content-Length: %d\r\n\r\n%s" % (CHAT_PATH.encode(), len(body), body)
        )
        answered.wait(BOUND_S)
    gone.set()


async def test_no_refold_once_the_client_is_gone_even_before_the_cancel_lands() -> None:
    levels, recorder = Levels(), Recorder()
    gone = threading.Event()
    body = json.dumps(conversation(CHAT_PATH)).encode()
    async with (
        overflow_upstream(gone) as (upstream_url, answered),
        proxy_app(upstream_url, plugins=[levels, FoldPlugin(), recorder]) as (url, _app),
    ):
        client = asyncio.to_thread(_hang_up_after, url, body, answered, gone)
        await asyncio.wait_for(client, BOUND_S)
        (record,) = await recorder.wait(1)
    assert record.outcome == "client_gone"
    assert levels.levels == [0]
    assert record.refolds == 0


async def test_a_declined_refold_loses_nothing_of_a_coded_answer() -> None:
    """One gzip chunk decodes to several pieces; the overflow in the first asks for a
    refold, which nothing can shrink (no plugin): every later piece still goes out."""
    failed = _event(
        "response.failed",
        {
            "type": "response.failed",
            "sequence_number": 1,
            "response": {
                **_RESPONSE,
                "status": "failed",
                "error": {"code": "context_length_exceeded", "message": "too long"},
            },
        },
    )
    created = STREAMS[RESPONSES_PATH][0]
    stream = created + failed + b": " + b"x" * 600_000 + b"\n\n" + b": the end\n\n"
    packed = gzip.compress(stream)
    reply = (
        b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nContent-Encoding: gzip\r\n"
        b"Content-Length: %d\r\n\r\n%s" % (len(packed), packed)
    )
    async with RawUpstream(lambda target: reply) as upstream, proxy_for(upstream.url) as url:
        assert await raw_body(url, RESPONSES_PATH) == stream
        # Prepare ran again at level 1 and changed nothing: one upstream request.
        assert len(upstream.heads) == 1

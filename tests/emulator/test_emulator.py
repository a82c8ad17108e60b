"""The local upstream emulator (proxy/_emulator.py): real SDKs, every script key, instrumentation.

Everything runs on loopback against a real emulator on an ephemeral port. SSE is
parsed by the small independent reader of ``tests.support.e2e``, not by the proxy's framer.
"""

from __future__ import annotations

import asyncio
import gzip
import itertools
import json
import re
import signal
import sys
import time
import tracemalloc
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import anthropic
import openai
import pytest
import xxhash
from anthropic.types import MessageParam
from anthropic.types.beta import BetaMessageParam
from openai.types.chat import ChatCompletionUserMessageParam

from proxy import _emulator as emulator
from proxy._emulator import (
    DEFAULT_TEXT,
    EmulatorServer,
    EmulatorWaitError,
    Script,
    ScriptError,
    build_emulator_app,
    parse_script,
    script_help,
    start_emulator,
)
from proxy._protocols._overflow import is_overflow_payload
from tests.support.e2e import WAIT_S, Event, request_body, sse_events
from tests.support.process import Proc

CHAT = "/v1/chat/completions"
RESPONSES = "/v1/responses"
MESSAGES = "/v1/messages"
SECRET = "sk-test-SECRET-never-logged-0123456789"
OAI_USER: list[ChatCompletionUserMessageParam] = [{"role": "user", "content": "hi"}]
ANT_USER: list[MessageParam] = [{"role": "user", "content": "hi"}]
BETA_USER: list[BetaMessageParam] = [{"role": "user", "content": "hi"}]

TEN_SECONDS = aiohttp.ClientTimeout(total=10)


@pytest.fixture
async def server() -> AsyncIterator[EmulatorServer]:
    async with await start_emulator() as srv:
        yield srv


@pytest.fixture
async def http() -> AsyncIterator[aiohttp.ClientSession]:
    async with aiohttp.ClientSession(timeout=TEN_SECONDS) as session:
        yield session


def body_for(path: str, *, stream: bool = False, **extra: Any) -> dict[str, Any]:
    """``request_body`` as these tests send it: not streamed, model ``claude-test``/``gpt-test``."""
    model = "claude-test" if path == MESSAGES else "gpt-test"
    return request_body(path, model, stream=stream, **extra)


def delta_texts(path: str, events: list[Event]) -> list[str]:
    out: list[str] = []
    for name, data in events:
        if data == "[DONE]" or name == "emulator.unknown":
            continue
        obj = json.loads(data)
        if path == CHAT:
            for choice in obj["choices"]:
                if choice["delta"].get("content"):
                    out.append(choice["delta"]["content"])
        elif path == RESPONSES and obj["type"] == "response.output_text.delta":
            out.append(obj["delta"])
        elif path == MESSAGES and obj["type"] == "content_block_delta":
            out.append(obj["delta"]["text"])
    return out


async def post(
    http: aiohttp.ClientSession,
    server: EmulatorServer,
    path: str,
    body: dict[str, Any],
    script: str | None = None,
    **headers: str,
) -> tuple[aiohttp.ClientResponse, bytes]:
    hdrs = dict(headers)
    if script is not None:
        hdrs["x-emulator"] = script
    async with http.post(server.url + path, json=body, headers=hdrs) as resp:
        return resp, await resp.read()


async def read_events(resp: aiohttp.ClientResponse, buf: bytearray, count: int) -> list[Event]:
    """Read from an open stream until at least ``count`` events have arrived (≤ 2 s)."""
    async with asyncio.timeout(2):
        for _ in range(10_000):
            events = sse_events(bytes(buf))
            if len(events) >= count:
                return events
            chunk = await resp.content.readany()
            assert chunk, "stream ended early"
            buf += chunk
    raise AssertionError("unreachable")


def openai_client(server: EmulatorServer, **kw: Any) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=server.url + "/v1", api_key=SECRET, max_retries=0, **kw)


def anthropic_client(server: EmulatorServer, **kw: Any) -> anthropic.AsyncAnthropic:
    return anthropic.AsyncAnthropic(base_url=server.url, api_key=SECRET, max_retries=0, **kw)


# ----------------------------------------------------------------- real SDKs


async def test_openai_chat_non_stream_text_and_usage(server: EmulatorServer) -> None:
    client = openai_client(server)
    reply = await client.chat.completions.create(
        model="gpt-test", messages=OAI_USER, extra_headers={"x-emulator": "cache_read=7"}
    )
    record = server.stats[-1]
    assert reply.choices[0].message.content == DEFAULT_TEXT
    assert reply.choices[0].finish_reason == "stop"
    assert reply.model == "gpt-test"
    assert reply.usage is not None
    assert reply.usage.prompt_tokens == record.body_bytes // 4
    assert reply.usage.completion_tokens == 3
    assert reply.usage.prompt_tokens_details is not None
    assert reply.usage.prompt_tokens_details.cached_tokens == 7


async def test_openai_chat_stream_with_include_usage(server: EmulatorServer) -> None:
    client = openai_client(server)
    stream = await client.chat.completions.create(
        model="gpt-test", messages=OAI_USER, stream=True, stream_options={"include_usage": True}
    )
    chunks = [chunk async for chunk in stream]
    record = server.stats[-1]
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == DEFAULT_TEXT
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "stop"
    assert chunks[-1].choices == []
    assert chunks[-1].usage is not None
    assert chunks[-1].usage.prompt_tokens == record.body_bytes // 4
    assert chunks[-1].usage.completion_tokens == 3
    assert record.finished and not record.aborted_by_peer


async def test_openai_responses_non_stream(server: EmulatorServer) -> None:
    client = openai_client(server)
    reply = await client.responses.create(model="gpt-test", input="hi")
    assert reply.output_text == DEFAULT_TEXT
    assert reply.status == "completed"
    assert reply.usage is not None
    assert reply.usage.input_tokens == server.stats[-1].body_bytes // 4
    assert reply.usage.output_tokens == 3


async def test_openai_responses_stream_helper_accumulates(server: EmulatorServer) -> None:
    client = openai_client(server)
    kinds: list[str] = []
    async with client.responses.stream(
        model="gpt-test", input="hi", extra_headers={"x-emulator": "chunks=4; cache_read=2"}
    ) as stream:
        async for event in stream:
            kinds.append(event.type)
        final = await stream.get_final_response()
    assert final.output_text == DEFAULT_TEXT
    assert final.usage is not None
    assert final.usage.output_tokens == 4
    assert final.usage.input_tokens_details.cached_tokens == 2
    assert kinds == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
        *["response.output_text.delta"] * 4,
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.completed",
    ]


async def test_anthropic_beta_stream_and_count_tokens(server: EmulatorServer) -> None:
    client = anthropic_client(server)
    async with client.beta.messages.stream(
        model="claude-test",
        max_tokens=16,
        messages=BETA_USER,
        extra_query={"beta": "true"},
        extra_headers={"x-emulator": "cache_read=3"},
    ) as stream:
        pieces = [text async for text in stream.text_stream]
        final = await stream.get_final_message()
    record = server.stats[-1]
    assert record.path == MESSAGES and record.query == "beta=true"
    assert "".join(pieces) == DEFAULT_TEXT
    assert final.content[0].type == "text" and final.content[0].text == DEFAULT_TEXT
    assert final.stop_reason == "end_turn"
    assert final.usage.output_tokens == 3
    assert final.usage.input_tokens == record.body_bytes // 4
    assert final.usage.cache_read_input_tokens == 3

    counted = await client.messages.count_tokens(model="claude-test", messages=ANT_USER)
    assert counted.input_tokens == server.stats[-1].body_bytes // 4


async def test_anthropic_non_stream(server: EmulatorServer) -> None:
    client = anthropic_client(server)
    message = await client.messages.create(
        model="claude-test",
        max_tokens=16,
        messages=ANT_USER,
        extra_headers={"x-emulator": "chunks=2; text=caf%C3%A9"},
    )
    assert message.content[0].type == "text" and message.content[0].text == "café"
    assert message.usage.output_tokens == 2


async def test_sdks_raise_on_overflow(server: EmulatorServer) -> None:
    headers = {"x-emulator": "overflow_above=10"}
    with pytest.raises(openai.BadRequestError) as oai:
        await openai_client(server).chat.completions.create(
            model="gpt-test", messages=OAI_USER, extra_headers=headers
        )
    assert oai.value.code == "context_length_exceeded"
    with pytest.raises(anthropic.BadRequestError) as ant:
        await anthropic_client(server).messages.create(
            model="claude-test",
            max_tokens=16,
            messages=ANT_USER,
            extra_headers=headers,
        )
    assert "prompt is too long" in str(ant.value)


async def test_openai_sdk_reads_gzip_answer(server: EmulatorServer) -> None:
    reply = await openai_client(server).chat.completions.create(
        model="gpt-test", messages=OAI_USER, extra_headers={"x-emulator": "gzip=1"}
    )
    assert reply.choices[0].message.content == DEFAULT_TEXT


# ----------------------------------------------------------------- scripts


def test_parse_script_reads_every_kind_and_round_trips() -> None:
    script = parse_script(
        "chunks=5; delay=0.25; text=a%3Bb%20%E2%82%AC; status=503; plain; hold=k-1; "
        "stall_after=2; crlf=true; gzip=0; empty_times=1; CACHE_READ=4"
    )
    assert script.chunks == 5 and script.delay == 0.25
    assert script.text == "a;b €"
    assert script.status == 503 and script.plain is True
    assert script.hold == "k-1" and script.stall_after == 2
    assert script.crlf is True and script.gzip is False
    assert script.empty_times == 1 and script.cache_read == 4
    assert parse_script(script.to_header()) == script
    assert parse_script("chunks=2", base=Script(delay=1.0)) == Script(chunks=2, delay=1.0)


@pytest.mark.parametrize(
    "header",
    [
        "bogus=1",
        "chunks=2; chunks=3",
        "chunks=0",
        "chunks=x",
        "delay=-1",
        "delay=nan",
        "status=200",
        "stall_after=2",
        "hold=a/b",
        "text=",
        "text=%FF",
        "crlf=maybe",
        "long_line",
    ],
)
def test_parse_script_rejects(header: str) -> None:
    with pytest.raises(ScriptError):
        parse_script(header)


def test_every_key_is_documented() -> None:
    table = script_help()
    doc = emulator.__doc__ or ""
    for f in Script.__dataclass_fields__:
        assert f"| `{f}` |" in table
        assert f"``{f}=" in doc or f"``{f}``" in doc, f


@pytest.mark.parametrize(
    ("path", "shape"), [(CHAT, "openai"), (RESPONSES, "openai"), (MESSAGES, "anthropic")]
)
async def test_bad_script_is_400_in_protocol_shape(
    server: EmulatorServer, http: aiohttp.ClientSession, path: str, shape: str
) -> None:
    resp, raw = await post(http, server, path, body_for(path), "nope=1")
    assert resp.status == 400
    error = json.loads(raw)
    if shape == "openai":
        assert set(error["error"]) == {"message", "type", "param", "code"}
        assert "nope" in error["error"]["message"]
    else:
        assert error["type"] == "error"
        assert error["error"]["type"] == "invalid_request_error"
        assert "nope" in error["error"]["message"]


async def test_default_script_applies_and_header_overrides() -> None:
    async with (
        await start_emulator(default_script=Script(chunks=2, text="abcd")) as srv,
        aiohttp.ClientSession(timeout=TEN_SECONDS) as http,
    ):
        _, raw = await post(http, srv, CHAT, body_for(CHAT, stream=True))
        assert delta_texts(CHAT, sse_events(raw)) == ["ab", "cd"]
        _, raw = await post(http, srv, CHAT, body_for(CHAT, stream=True), "chunks=4")
        assert delta_texts(CHAT, sse_events(raw)) == ["a", "b", "c", "d"]


@pytest.mark.parametrize("path", [CHAT, RESPONSES, MESSAGES])
async def test_chunks_and_text(
    server: EmulatorServer, http: aiohttp.ClientSession, path: str
) -> None:
    _, raw = await post(http, server, path, body_for(path, stream=True), "chunks=7; text=ab%C3%A9")
    deltas = delta_texts(path, sse_events(raw))
    assert len(deltas) == 7 and all(deltas)
    assert "".join(deltas) == Script(chunks=7, text="abé").expected_text() == "abé" * 3


async def test_delay_spaces_the_deltas(server: EmulatorServer, http: aiohttp.ClientSession) -> None:
    arrivals: list[float] = []
    buf = bytearray()
    async with http.post(
        server.url + CHAT, json=body_for(CHAT, stream=True), headers={"x-emulator": "delay=0.1"}
    ) as resp:
        async for chunk in resp.content.iter_any():
            buf += chunk
            arrivals.append(time.monotonic())
            if len(delta_texts(CHAT, sse_events(bytes(buf)))) == 1:
                first = time.monotonic()
    assert "".join(delta_texts(CHAT, sse_events(bytes(buf)))) == DEFAULT_TEXT
    assert arrivals[-1] - first >= 0.19


@pytest.mark.parametrize(
    ("path", "status", "kind"),
    [
        (CHAT, 429, "requests"),
        (CHAT, 500, "server_error"),
        (RESPONSES, 401, "invalid_request_error"),
        (MESSAGES, 529, "overloaded_error"),
        (MESSAGES, 403, "permission_error"),
    ],
)
async def test_status_error_shapes(
    server: EmulatorServer, http: aiohttp.ClientSession, path: str, status: int, kind: str
) -> None:
    resp, raw = await post(
        http, server, path, body_for(path, stream=True), f"status={status}; retry_after=3"
    )
    assert resp.status == status
    assert resp.headers["Retry-After"] == "3"
    assert resp.content_type == "application/json"
    error = json.loads(raw)
    if path == MESSAGES:
        assert error["type"] == "error" and error["error"]["type"] == kind
    else:
        assert error["error"]["type"] == kind


async def test_status_plain(server: EmulatorServer, http: aiohttp.ClientSession) -> None:
    resp, raw = await post(http, server, CHAT, body_for(CHAT), "status=502; plain=1")
    assert resp.status == 502
    assert resp.content_type == "text/plain"
    assert raw == b"Bad Gateway"


async def test_overflow_chat_exact_shape(
    server: EmulatorServer, http: aiohttp.ClientSession
) -> None:
    body = body_for(CHAT, stream=True)
    resp, raw = await post(http, server, CHAT, body, "overflow_above=20")
    tokens = server.stats[-1].body_bytes // 4
    assert resp.status == 400
    assert json.loads(raw) == {
        "error": {
            "message": "This model's maximum context length is 128000 tokens. However, your "
            f"messages resulted in {tokens} tokens. Please reduce the length of the messages.",
            "type": "invalid_request_error",
            "param": "messages",
            "code": "context_length_exceeded",
        }
    }
    resp, _ = await post(http, server, CHAT, body, "overflow_above=100000")
    assert resp.status == 200


async def test_overflow_anthropic(server: EmulatorServer, http: aiohttp.ClientSession) -> None:
    resp, raw = await post(
        http, server, MESSAGES, body_for(MESSAGES), "overflow_above=1; context=50"
    )
    tokens = server.stats[-1].body_bytes // 4
    assert resp.status == 400
    error = json.loads(raw)
    assert error["type"] == "error"
    assert error["error"] == {
        "type": "invalid_request_error",
        "message": f"prompt is too long: {tokens} tokens > 50 maximum",
    }


async def test_overflow_responses_stream_is_in_band(
    server: EmulatorServer, http: aiohttp.ClientSession
) -> None:
    resp, raw = await post(
        http, server, RESPONSES, body_for(RESPONSES, stream=True), "overflow_above=1"
    )
    assert resp.status == 200
    assert resp.content_type == "text/event-stream"
    events = sse_events(raw)
    assert [name for name, _ in events] == [
        "response.created",
        "response.in_progress",
        "response.failed",
    ]
    failed = json.loads(events[-1][1])
    assert failed["sequence_number"] == 2
    assert failed["response"]["status"] == "failed"
    assert failed["response"]["error"]["code"] == "context_length_exceeded"

    resp, raw = await post(http, server, RESPONSES, body_for(RESPONSES), "overflow_above=1")
    assert resp.status == 400
    assert json.loads(raw)["error"]["code"] == "context_length_exceeded"
    assert json.loads(raw)["error"]["param"] == "input"


@pytest.mark.parametrize("path", [CHAT, RESPONSES, MESSAGES])
async def test_overflow_plain_is_vllm_text(
    server: EmulatorServer, http: aiohttp.ClientSession, path: str
) -> None:
    resp, raw = await post(
        http, server, path, body_for(path, stream=True), "overflow_above=1; plain=1"
    )
    tokens = server.stats[-1].body_bytes // 4
    assert resp.status == 400 and resp.content_type == "text/plain"
    assert raw.decode().startswith(
        f"This model's maximum context length is 128000 tokens. However, you requested "
        f"{tokens} tokens ({tokens} in the messages, 0 in the completion)."
    )


async def test_stall_headers(server: EmulatorServer, http: aiohttp.ClientSession) -> None:
    async with http.post(
        server.url + CHAT, json=body_for(CHAT), headers={"x-emulator": "stall_headers=0.3"}
    ) as resp:
        record = server.stats[-1]
        assert record.received
        assert record.headers_sent_at is not None
        assert record.headers_sent_at - record.started_at >= 0.29
        assert json.loads(await resp.read())["choices"][0]["message"]["content"] == DEFAULT_TEXT


async def test_stall_after_pauses_between_events(
    server: EmulatorServer, http: aiohttp.ClientSession
) -> None:
    buf = bytearray()
    stamps: list[tuple[int, float]] = []
    async with http.post(
        server.url + MESSAGES,
        json=body_for(MESSAGES, stream=True),
        headers={"x-emulator": "stall_after=2; stall=0.25"},
    ) as resp:
        async for chunk in resp.content.iter_any():
            buf += chunk
            stamps.append((len(sse_events(bytes(buf))), time.monotonic()))
    at_two = min(t for n, t in stamps if n >= 2)
    at_three = min(t for n, t in stamps if n >= 3)
    assert at_three - at_two >= 0.24
    assert sse_events(bytes(buf))[-1][0] == "message_stop"


async def test_hold_until_released_over_http(
    server: EmulatorServer, http: aiohttp.ClientSession
) -> None:
    buf = bytearray()
    async with http.post(
        server.url + RESPONSES,
        json=body_for(RESPONSES, stream=True),
        headers={"x-emulator": "hold=mem-1"},
    ) as resp:
        events = await read_events(resp, buf, 1)
        record = await server.wait_holding(1, WAIT_S)
        assert record.events_sent == 1 and len(events) == 1
        assert not record.finished
        async with http.post(server.url + "/_emulator/release/mem-1") as rel:
            assert rel.status == 200
        buf += await resp.read()
    events = sse_events(bytes(buf))
    assert events[-1][0] == "response.completed"
    assert "".join(delta_texts(RESPONSES, events)) == DEFAULT_TEXT
    record = await server.wait_closed(1, WAIT_S)
    assert record.finished and record.holding is None


async def test_hold_release_latches_and_pause_point_zero(
    server: EmulatorServer, http: aiohttp.ClientSession
) -> None:
    server.release("early")
    _, raw = await post(http, server, CHAT, body_for(CHAT, stream=True), "hold=early")
    assert sse_events(raw)[-1][1] == "[DONE]"

    async with http.post(
        server.url + CHAT,
        json=body_for(CHAT, stream=True),
        headers={"x-emulator": "hold=zero; stall_after=0"},
    ) as resp:
        assert resp.status == 200  # headers arrived while held
        record = await server.wait_holding(2, WAIT_S)
        assert record.events_sent == 0
        server.release("zero")
        assert sse_events(await resp.read())[-1][1] == "[DONE]"


async def test_hold_on_json_answer_sends_the_head_first(
    server: EmulatorServer, http: aiohttp.ClientSession
) -> None:
    async with http.post(
        server.url + MESSAGES, json=body_for(MESSAGES), headers={"x-emulator": "hold=j"}
    ) as resp:
        head = await resp.content.readany()
        await server.wait_holding(1, WAIT_S)
        assert head.endswith(b'"text":"')
        server.release("j")
        rest = await resp.read()
    assert json.loads(head + rest)["content"][0]["text"] == DEFAULT_TEXT


async def test_close_releases_holds_and_cuts_stalls_short() -> None:
    srv = await start_emulator()
    async with aiohttp.ClientSession(timeout=TEN_SECONDS) as http:
        held = http.post(
            srv.url + CHAT, json=body_for(CHAT, stream=True), headers={"x-emulator": "hold=never"}
        )
        stalled = http.post(
            srv.url + MESSAGES,
            json=body_for(MESSAGES, stream=True),
            headers={"x-emulator": "stall=60"},
        )
        async with held as r1, stalled as r2:
            await srv.wait_holding(1, WAIT_S)
            await srv.wait_events(2, 1, WAIT_S)
            started = time.monotonic()
            reads = asyncio.gather(r1.read(), r2.read())
            await srv.close()
            raw1, raw2 = await reads
            assert time.monotonic() - started < WAIT_S  # not the 60 s stall
    assert sse_events(raw1)[-1][1] == "[DONE]"
    assert sse_events(raw2)[-1][0] == "message_stop"
    assert srv.record(1).finished and srv.record(2).finished


@pytest.mark.parametrize("path", [CHAT, MESSAGES])
async def test_cut_after_aborts_without_terminal_event(
    server: EmulatorServer, http: aiohttp.ClientSession, path: str
) -> None:
    buf = bytearray()
    async with http.post(
        server.url + path, json=body_for(path, stream=True), headers={"x-emulator": "cut_after=2"}
    ) as resp:
        with pytest.raises(aiohttp.ClientPayloadError):
            async for chunk in resp.content.iter_any():
                buf += chunk
    assert len(sse_events(bytes(buf))) == 2
    record = await server.wait_closed(1, WAIT_S)
    assert record.cut_by_emulator and not record.finished and not record.aborted_by_peer


async def test_cut_after_on_json_answer(
    server: EmulatorServer, http: aiohttp.ClientSession
) -> None:
    async with http.post(
        server.url + CHAT, json=body_for(CHAT), headers={"x-emulator": "cut_after=1"}
    ) as resp:
        assert resp.status == 200
        with pytest.raises(aiohttp.ClientPayloadError):
            await resp.read()


async def test_peer_abort_is_detected_within_a_second(
    server: EmulatorServer, http: aiohttp.ClientSession
) -> None:
    buf = bytearray()
    resp = await http.post(
        server.url + MESSAGES,
        json=body_for(MESSAGES, stream=True),
        headers={"x-emulator": "hold=forever"},
    )
    await read_events(resp, buf, 1)
    await server.wait_holding(1, WAIT_S)
    resp.close()
    record = await server.wait_aborted(1, WAIT_S)
    assert not record.finished and record.closed


async def test_peer_abort_during_delay(server: EmulatorServer, http: aiohttp.ClientSession) -> None:
    buf = bytearray()
    resp = await http.post(
        server.url + CHAT, json=body_for(CHAT, stream=True), headers={"x-emulator": "delay=30"}
    )
    await read_events(resp, buf, 2)  # role chunk + first delta; the next waits 30 s
    resp.close()
    record = await server.wait_aborted(1, WAIT_S)
    assert record.events_sent == 2


@pytest.mark.parametrize("path", [CHAT, RESPONSES, MESSAGES])
async def test_long_line(server: EmulatorServer, http: aiohttp.ClientSession, path: str) -> None:
    size = 300_000
    _, raw = await post(http, server, path, body_for(path, stream=True), f"long_line={size}")
    events = sse_events(raw)
    deltas = delta_texts(path, events)
    assert [len(d) for d in deltas] == [len(deltas[0]), size, *[len(d) for d in deltas[2:]]]
    assert len(deltas) == 4
    assert "".join(deltas) == Script(long_line=size).expected_text()
    # The delta's data line; Responses' done/completed events repeat the whole text, longer.
    delta_line = min(len(line) for line in raw.split(b"\n") if len(line) > size)
    assert delta_line < size + 400
    if path == RESPONSES:
        done = next(json.loads(d) for n, d in events if n == "response.output_text.done")
        assert done["text"] == "".join(deltas)


async def test_long_json_answer_has_exact_content_length(
    server: EmulatorServer, http: aiohttp.ClientSession
) -> None:
    resp, raw = await post(http, server, CHAT, body_for(CHAT), "long_line=200000")
    assert resp.content_length == len(raw)
    content = json.loads(raw)["choices"][0]["message"]["content"]
    assert content == Script(long_line=200_000).expected_text()


async def test_split_utf8_arrives_split(
    server: EmulatorServer, http: aiohttp.ClientSession
) -> None:
    chunks: list[bytes] = []
    async with http.post(
        server.url + MESSAGES,
        json=body_for(MESSAGES, stream=True),
        headers={"x-emulator": "split_utf8=1"},
    ) as resp:
        async for chunk in resp.content.iter_any():
            chunks.append(chunk)
    euro = "\u20ac".encode()
    assert any(
        a.endswith(euro[:1]) and b.startswith(euro[1:]) for a, b in itertools.pairwise(chunks)
    ), chunks
    deltas = delta_texts(MESSAGES, sse_events(b"".join(chunks)))
    assert deltas[-1] == " \u20ac" and len(deltas) == 4


async def test_crlf(server: EmulatorServer, http: aiohttp.ClientSession) -> None:
    _, raw = await post(http, server, RESPONSES, body_for(RESPONSES, stream=True), "crlf=1")
    assert raw.count(b"\r\n\r\n") == len(sse_events(raw)) == 11
    assert re.search(rb"[^\r]\n", raw) is None


async def test_comments_and_ping_for_openai(
    server: EmulatorServer, http: aiohttp.ClientSession
) -> None:
    _, raw = await post(http, server, CHAT, body_for(CHAT, stream=True), "comments=1; ping=1")
    events = sse_events(raw)
    # role chunk, 3 deltas, finish chunk, [DONE]
    assert raw.count(b": keep-alive\n\n") == len(events) == 6
    assert raw.count(b": ping\n\n") == 3


async def test_anthropic_pings(server: EmulatorServer, http: aiohttp.ClientSession) -> None:
    _, plain_raw = await post(http, server, MESSAGES, body_for(MESSAGES, stream=True))
    assert [n for n, _ in sse_events(plain_raw)].count("ping") == 1
    _, raw = await post(http, server, MESSAGES, body_for(MESSAGES, stream=True), "ping=1")
    assert [n for n, _ in sse_events(raw)].count("ping") == 4


@pytest.mark.parametrize("path", [CHAT, RESPONSES, MESSAGES])
async def test_unknown_event(
    server: EmulatorServer, http: aiohttp.ClientSession, path: str
) -> None:
    _, raw = await post(http, server, path, body_for(path, stream=True), "unknown_event=1")
    events = sse_events(raw)
    names = [n for n, _ in events]
    assert names.count("emulator.unknown") == 1
    before = events[: names.index("emulator.unknown")]
    assert len(delta_texts(path, before)) == 1
    if path == RESPONSES:
        numbers = [json.loads(d)["sequence_number"] for _, d in events]
        assert numbers == list(range(len(events)))


async def test_gzip_stream_on_the_wire(server: EmulatorServer) -> None:
    async with (
        aiohttp.ClientSession(auto_decompress=False, timeout=TEN_SECONDS) as raw_http,
        raw_http.post(
            server.url + RESPONSES,
            json=body_for(RESPONSES, stream=True),
            headers={"x-emulator": "gzip=1"},
        ) as resp,
    ):
        wire = await resp.read()
    assert resp.headers["Content-Encoding"] == "gzip"
    assert wire[:2] == b"\x1f\x8b"
    events = sse_events(gzip.decompress(wire))
    assert "".join(delta_texts(RESPONSES, events)) == DEFAULT_TEXT


@pytest.mark.parametrize("path", [CHAT, RESPONSES, MESSAGES])
async def test_empty_stream_is_well_formed(
    server: EmulatorServer, http: aiohttp.ClientSession, path: str
) -> None:
    body = body_for(path, stream=True, stream_options={"include_usage": True})
    _, raw = await post(http, server, path, body, "empty=1")
    events = sse_events(raw)
    assert delta_texts(path, events) == []
    last = events[-1]
    if path == CHAT:
        assert last[1] == "[DONE]"
        assert json.loads(events[-2][1])["usage"]["completion_tokens"] == 0
        assert json.loads(events[-3][1])["choices"][0]["finish_reason"] == "stop"
    elif path == RESPONSES:
        completed = json.loads(last[1])["response"]
        assert completed["output"] == [] and completed["usage"]["output_tokens"] == 0
    else:
        assert [n for n, _ in events] == ["message_start", "ping", "message_delta", "message_stop"]
        assert json.loads(events[2][1])["usage"]["output_tokens"] == 0


async def test_empty_json_answers(server: EmulatorServer, http: aiohttp.ClientSession) -> None:
    _, raw = await post(http, server, CHAT, body_for(CHAT), "empty=1")
    assert json.loads(raw)["choices"][0]["message"]["content"] == ""
    _, raw = await post(http, server, RESPONSES, body_for(RESPONSES), "empty=1")
    assert json.loads(raw)["output"] == []
    _, raw = await post(http, server, MESSAGES, body_for(MESSAGES), "empty=1")
    assert json.loads(raw)["content"] == []


async def test_empty_times_counts_per_key(
    server: EmulatorServer, http: aiohttp.ClientSession
) -> None:
    async def text(key: str) -> str:
        _, raw = await post(
            http, server, CHAT, body_for(CHAT), "empty_times=1", **{"x-emulator-key": key}
        )
        return str(json.loads(raw)["choices"][0]["message"]["content"])

    assert await text("a") == ""
    assert await text("a") == DEFAULT_TEXT
    assert await text("b") == ""


async def test_usage_key_forces_chat_usage_chunk(
    server: EmulatorServer, http: aiohttp.ClientSession
) -> None:
    _, raw = await post(http, server, CHAT, body_for(CHAT, stream=True))
    assert all("usage" not in json.loads(d) for _, d in sse_events(raw)[:-1])
    _, raw = await post(http, server, CHAT, body_for(CHAT, stream=True), "usage=1")
    usage_chunk = json.loads(sse_events(raw)[-2][1])
    assert usage_chunk["choices"] == [] and usage_chunk["usage"]["completion_tokens"] == 3


# ----------------------------------------------------------------- bodies and stats


async def test_stats_record(server: EmulatorServer, http: aiohttp.ClientSession) -> None:
    async def chunked_body() -> AsyncIterator[bytes]:
        yield b'{"model": "m-1", '
        yield b'"messages": [], "stream": false}'

    headers = {
        "Authorization": f"Bearer {SECRET}",
        "x-api-key": SECRET,
        "anthropic-version": "2023-06-01",
        "anthropic-beta": "b-1",
        "x-claude-code-session-id": "sess-9",
        "Content-Type": "application/json",
    }
    async with http.post(
        server.url + MESSAGES + "?beta=true", data=chunked_body(), headers=headers
    ) as resp:
        assert resp.status == 200
        await resp.read()
    async with http.get(server.url + "/_emulator/stats") as resp:
        text = await resp.text()
    assert SECRET not in text
    [record] = json.loads(text)["requests"]
    raw = b'{"model": "m-1", "messages": [], "stream": false}'
    assert record["id"] == 1 and record["method"] == "POST"
    assert record["path"] == MESSAGES and record["query"] == "beta=true"
    assert record["body_bytes"] == len(raw)
    assert record["body_digest"] == xxhash.xxh3_128(raw).hexdigest()
    assert record["chunked"] is True and record["content_length"] is None
    assert record["headers"]["authorization"] == "Bearer \u2026"
    assert record["headers"]["x-api-key"] == "sk-test\u2026"
    assert record["headers"]["anthropic-beta"] == "b-1"
    assert record["headers"]["x-claude-code-session-id"] == "sess-9"
    assert record["model"] == "m-1" and record["stream"] is False
    assert record["finished"] is True and record["aborted_by_peer"] is False
    assert record["started_at"] <= record["closed_at"]

    async with http.post(server.url + "/_emulator/reset") as resp:
        assert resp.status == 200
    assert server.stats == []
    await post(http, server, CHAT, body_for(CHAT))
    assert [r.id for r in server.stats] == [1]


async def test_gzip_request_body_is_counted_decoded(
    server: EmulatorServer, http: aiohttp.ClientSession
) -> None:
    raw = json.dumps(body_for(CHAT, stream=True)).encode()
    async with http.post(
        server.url + CHAT,
        data=gzip.compress(raw),
        headers={"Content-Encoding": "gzip", "Content-Type": "application/json"},
    ) as resp:
        events = sse_events(await resp.read())
    record = server.stats[-1]
    assert record.content_encoding == "gzip"
    assert record.body_bytes == len(raw)
    assert record.body_digest == xxhash.xxh3_128(raw).hexdigest()
    assert "".join(delta_texts(CHAT, events)) == DEFAULT_TEXT


async def test_malformed_json_is_400(server: EmulatorServer, http: aiohttp.ClientSession) -> None:
    async with http.post(server.url + CHAT, data=b'{"model": ') as resp:
        error = await resp.json()
    assert resp.status == 400
    assert error["error"]["type"] == "invalid_request_error"
    async with http.post(server.url + MESSAGES, data=b"[1, 2]") as resp:
        error = await resp.json()
    assert resp.status == 400 and error["type"] == "error"


async def test_large_body_is_scanned_not_held(
    server: EmulatorServer, http: aiohttp.ClientSession
) -> None:
    filler = "x" * (emulator.PARSE_LIMIT + 1024 * 1024)
    raw = (
        '{"model": "big-model", "messages": [{"role": "user", "content": "'
        + filler
        + '\\"stream\\": false"}], "stream": true}'
    ).encode()
    del filler
    view = memoryview(raw)

    async def slices() -> AsyncIterator[memoryview]:
        # Slices with a declared length, so the client holds no copy of its own.
        for start in range(0, len(raw), 256 * 1024):
            yield view[start : start + 256 * 1024]

    headers = {"Content-Type": "application/json", "Content-Length": str(len(raw))}
    tracemalloc.start()
    try:
        async with http.post(server.url + RESPONSES, data=slices(), headers=headers) as resp:
            events = sse_events(await resp.read())
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    record = server.stats[-1]
    assert record.body_bytes == len(raw)
    assert record.body_digest == xxhash.xxh3_128(raw).hexdigest()
    assert record.model == "big-model" and record.stream is True
    assert json.loads(events[-1][1])["response"]["model"] == "big-model"
    assert json.loads(events[-1][1])["response"]["usage"]["input_tokens"] == len(raw) // 4
    assert peak < len(raw) // 4, f"peak {peak} bytes while reading a {len(raw)} byte body"


async def test_models_and_root(server: EmulatorServer, http: aiohttp.ClientSession) -> None:
    async with http.get(server.url + "/v1/models") as resp:
        assert (await resp.json())["object"] == "list"
    async with http.get(
        server.url + "/v1/models", headers={"anthropic-version": "2023-06-01"}
    ) as resp:
        assert (await resp.json())["data"][0]["type"] == "model"
    async with http.head(server.url + "/") as resp:
        assert resp.status == 200
    async with http.get(server.url + "/") as resp:
        assert await resp.text() == "ok\n"
    assert [r.method for r in server.stats] == ["GET", "GET", "HEAD", "GET"]


async def test_wait_helpers_fail_fast_and_time_out(
    server: EmulatorServer, http: aiohttp.ClientSession
) -> None:
    await post(http, server, CHAT, body_for(CHAT))
    started = time.monotonic()
    with pytest.raises(EmulatorWaitError):
        await server.wait_aborted(1, 30.0)
    assert time.monotonic() - started < WAIT_S  # failed fast, did not wait the 30 s
    with pytest.raises(TimeoutError):
        await server.wait_received(99, 0.05)
    assert (await server.wait_headers_sent(1, 0.05)).status == 200


def test_build_app_has_the_routes() -> None:
    app = build_emulator_app()
    paths = {(r.method, r.resource.canonical) for r in app.router.routes() if r.resource}
    for route in [
        ("POST", CHAT),
        ("POST", RESPONSES),
        ("POST", MESSAGES),
        ("POST", "/v1/messages/count_tokens"),
        ("GET", "/v1/models"),
        ("HEAD", "/"),
        ("GET", "/_emulator/stats"),
        ("POST", "/_emulator/reset"),
        ("POST", "/_emulator/release/{key}"),
    ]:
        assert route in paths


async def test_run_emulator_serves_until_sigterm() -> None:
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        "-c",
        "from proxy._emulator import run_emulator; run_emulator('127.0.0.1', 0)",
        stdout=asyncio.subprocess.PIPE,
    )
    try:
        assert proc.stdout is not None
        async with asyncio.timeout(10):
            line = (await proc.stdout.readline()).decode()
        url = line.rsplit(" ", 1)[-1].strip()
        assert re.fullmatch(r"http://127\.0\.0\.1:\d+", url), line
        async with aiohttp.ClientSession(timeout=TEN_SECONDS) as http, http.get(url + "/") as resp:
            assert resp.status == 200
        proc.send_signal(signal.SIGTERM)
        async with asyncio.timeout(5):
            assert await proc.wait() == 0
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()


async def test_client_gone_mid_body_is_a_peer_abort(server: EmulatorServer) -> None:
    _, writer = await asyncio.open_connection("127.0.0.1", server.port)
    writer.write(
        b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        b"Content-Length: 100000\r\n\r\n" + b'{"model": "m", "messages": ['
    )
    await writer.drain()
    await server.state.wait_for(1, lambda r: r.body_bytes > 0, "reading its body", WAIT_S)
    writer.close()
    await writer.wait_closed()
    record = await server.wait_aborted(1, WAIT_S)
    assert not record.received and record.body_digest is None and not record.headers_sent


# -----------------------------------------------------------------------------
# `emulate --context-window-tokens N`: prompts above N tokens get the overflow error.


async def test_cli_window_rejects_longer_prompts_in_each_protocol() -> None:
    proc = await Proc.start("emulator", "emulate", "--port", "0", "--context-window-tokens", "100")
    try:
        url = (await proc.wait_line(r"listening on (http://\S+)", within=30))[1]
        async with aiohttp.ClientSession() as http:
            for path in ("/v1/chat/completions", "/v1/messages", "/v1/responses"):
                small = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
                async with http.post(url + path, json=small) as resp:
                    assert resp.status == 200, path
                big = {"model": "m", "messages": [{"role": "user", "content": "x" * 800}]}
                async with http.post(url + path, json=big) as resp:
                    body = await resp.read()
                    assert resp.status == 400, path
                    assert is_overflow_payload(400, resp.content_type, body), path
                    message = json.loads(body)["error"]["message"]
                    assert "100" in message, message
    finally:
        await proc.stop()

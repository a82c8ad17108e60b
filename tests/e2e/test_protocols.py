"""End to end through the proxy: the real SDKs, routing, headers, logs, upstream failures.

Every test runs a real proxy in front of the upstream emulator on 127.0.0.1
(ephemeral ports) and talks to it with the installed ``openai`` / ``anthropic``
SDKs, ``aiohttp`` or :class:`~tests.support.e2e.RawClient`. The emulator's
records say what reached the upstream.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from collections.abc import AsyncIterator, Callable
from typing import Any

import aiohttp
import anthropic
import openai
import pytest
import xxhash
from aiohttp import web
from anthropic.types import MessageParam
from anthropic.types.beta import BetaMessageParam
from openai.types.chat import ChatCompletionUserMessageParam

from proxy._emulator import DEFAULT_TEXT, EmulatorServer, start_emulator
from proxy.testing import Harness, proxy_with_emulator
from tests.support.e2e import (
    ANTHROPIC_PATH,
    CHAT_PATH,
    COUNT_TOKENS_PATH,
    RESPONSES_PATH,
    SECRET,
    WAIT_S,
    LogWaiter,
    RawClient,
    sse_events,
    stream_body,
    wait_until,
)
from tests.support.ports import free_port, serve_app
from tests.support.upstream import proxy_for

OAI_USER: list[ChatCompletionUserMessageParam] = [{"role": "user", "content": "hi"}]
ANT_USER: list[MessageParam] = [{"role": "user", "content": "hi"}]
BETA_USER: list[BetaMessageParam] = [{"role": "user", "content": "hi"}]


def openai_client(base_url: str) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=base_url, api_key=SECRET, max_retries=0, timeout=20)


def anthropic_client(base_url: str) -> anthropic.AsyncAnthropic:
    return anthropic.AsyncAnthropic(base_url=base_url, api_key=SECRET, max_retries=0, timeout=20)


def assert_openai_error(payload: Any, *, type_: str) -> str:
    """The OpenAI error shape; returns the message."""
    assert set(payload) == {"error"}
    error = payload["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["type"] == type_
    assert isinstance(error["message"], str) and error["message"]
    return str(error["message"])


def assert_anthropic_error(payload: Any, *, type_: str) -> str:
    """The Anthropic error shape; returns the message."""
    assert payload["type"] == "error"
    assert set(payload["error"]) == {"type", "message"}
    assert payload["error"]["type"] == type_
    assert isinstance(payload["error"]["message"], str) and payload["error"]["message"]
    return str(payload["error"]["message"])


# ----------------------------------------------------------------- real SDKs


async def test_openai_chat_stream_text_and_usage(harness: Harness) -> None:
    async with openai_client(harness.openai_base_url) as client:
        stream = await client.chat.completions.create(
            model="gpt-e2e",
            messages=OAI_USER,
            stream=True,
            stream_options={"include_usage": True},
            extra_headers={"x-emulator": "chunks=5; cache_read=4"},
        )
        chunks = [chunk async for chunk in stream]
    record = harness.emulator.stats[-1]
    assert record.path == CHAT_PATH and record.finished and not record.aborted_by_peer
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == DEFAULT_TEXT
    usage = chunks[-1].usage
    assert usage is not None and chunks[-1].choices == []
    assert usage.prompt_tokens == record.body_bytes // 4 > 0
    assert usage.completion_tokens == 5
    assert usage.prompt_tokens_details is not None
    assert usage.prompt_tokens_details.cached_tokens == 4


async def test_openai_responses_stream_text_and_usage(harness: Harness) -> None:
    async with (
        openai_client(harness.openai_base_url) as client,
        client.responses.stream(
            model="gpt-e2e", input="hi", extra_headers={"x-emulator": "chunks=4; cache_read=2"}
        ) as stream,
    ):
        deltas = [
            event.delta async for event in stream if event.type == "response.output_text.delta"
        ]
        final = await stream.get_final_response()
    record = harness.emulator.stats[-1]
    assert record.path == RESPONSES_PATH and record.stream is True and record.finished
    assert "".join(deltas) == final.output_text == DEFAULT_TEXT
    assert len(deltas) == 4
    assert final.status == "completed"
    assert final.usage is not None
    assert final.usage.input_tokens == record.body_bytes // 4 > 0
    assert final.usage.output_tokens == 4
    assert final.usage.input_tokens_details.cached_tokens == 2


async def test_openai_non_streaming_chat_and_responses(harness: Harness) -> None:
    async with openai_client(harness.openai_base_url) as client:
        chat = await client.chat.completions.create(
            model="gpt-e2e", messages=OAI_USER, extra_headers={"x-emulator": "text=caf%C3%A9"}
        )
        chat_record = harness.emulator.stats[-1]
        reply = await client.responses.create(model="gpt-e2e", input="hi")
        reply_record = harness.emulator.stats[-1]
    assert chat.choices[0].message.content == "café"
    assert chat.usage is not None
    assert chat.usage.prompt_tokens == chat_record.body_bytes // 4 > 0
    assert chat.usage.completion_tokens == 3
    assert reply.output_text == DEFAULT_TEXT
    assert reply.usage is not None
    assert reply.usage.input_tokens == reply_record.body_bytes // 4 > 0
    assert reply.usage.output_tokens == 3
    assert chat_record.stream is False and reply_record.stream is False


async def test_anthropic_beta_stream_keeps_query_and_usage(harness: Harness) -> None:
    async with (
        anthropic_client(harness.url) as client,
        client.beta.messages.stream(
            model="claude-e2e",
            max_tokens=16,
            messages=BETA_USER,
            extra_query={"beta": "true"},
            extra_headers={"x-emulator": "chunks=6; cache_read=3"},
        ) as stream,
    ):
        pieces = [text async for text in stream.text_stream]
        final = await stream.get_final_message()
    record = harness.emulator.stats[-1]
    assert record.path == ANTHROPIC_PATH and record.query == "beta=true"
    assert record.finished and not record.aborted_by_peer
    assert "".join(pieces) == DEFAULT_TEXT and len(pieces) == 6
    assert final.stop_reason == "end_turn"
    assert final.usage.input_tokens == record.body_bytes // 4 > 0
    assert final.usage.output_tokens == 6
    assert final.usage.cache_read_input_tokens == 3


async def test_anthropic_non_streaming_and_count_tokens(harness: Harness) -> None:
    async with anthropic_client(harness.url) as client:
        message = await client.messages.create(model="claude-e2e", max_tokens=16, messages=ANT_USER)
        message_record = harness.emulator.stats[-1]
        counted = await client.messages.count_tokens(model="claude-e2e", messages=ANT_USER)
        count_record = harness.emulator.stats[-1]
        beta_counted = await client.beta.messages.count_tokens(
            model="claude-e2e", messages=BETA_USER, extra_query={"beta": "true"}
        )
        beta_record = harness.emulator.stats[-1]
    assert message.content[0].type == "text" and message.content[0].text == DEFAULT_TEXT
    assert message.usage.input_tokens == message_record.body_bytes // 4 > 0
    assert message.usage.output_tokens == 3
    assert count_record.path == COUNT_TOKENS_PATH and count_record.query == ""
    assert counted.input_tokens == count_record.body_bytes // 4 > 0
    assert beta_record.path == COUNT_TOKENS_PATH and beta_record.query == "beta=true"
    assert beta_counted.input_tokens == beta_record.body_bytes // 4


# ----------------------------------------------------------------- routes


async def test_root_answers_at_once_without_the_upstream(
    harness: Harness, http: aiohttp.ClientSession
) -> None:
    # An exchange stuck upstream must not delay the connectivity probe.
    stuck = asyncio.ensure_future(
        http.post(
            harness.url + CHAT_PATH,
            data=stream_body(CHAT_PATH),
            headers={"x-emulator": "stall_headers=30", "Content-Type": "application/json"},
        )
    )
    try:
        await harness.emulator.wait_received(1, WAIT_S)
        loop = asyncio.get_running_loop()
        started = loop.time()
        async with http.head(harness.url + "/") as head:
            assert head.status == 200
            assert await head.read() == b""
        async with http.get(harness.url + "/") as get:
            assert get.status == 200
            assert (await get.text()).strip()
        assert loop.time() - started < 1.0
    finally:
        stuck.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await stuck
    assert [record.path for record in harness.emulator.stats] == [CHAT_PATH]


@contextlib.asynccontextmanager
async def two_upstreams() -> AsyncIterator[tuple[str, EmulatorServer, EmulatorServer]]:
    """A proxy whose OpenAI and Anthropic upstreams are two different emulators."""
    async with (
        await start_emulator() as oai,
        await start_emulator() as ant,
        proxy_for(oai.url, upstream_anthropic=ant.url) as url,
    ):
        yield url, oai, ant


@pytest.mark.parametrize(
    ("headers", "upstream"),
    [
        ({}, "openai"),
        ({"Authorization": f"Bearer {SECRET}"}, "openai"),
        ({"anthropic-version": "2023-06-01"}, "anthropic"),
        ({"x-api-key": SECRET}, "anthropic"),
    ],
)
async def test_models_is_forwarded_verbatim_to_the_right_upstream(
    http: aiohttp.ClientSession, headers: dict[str, str], upstream: str
) -> None:
    async with two_upstreams() as (url, oai, ant):
        target, other = (oai, ant) if upstream == "openai" else (ant, oai)
        async with http.get(url + "/v1/models", headers=headers) as resp:
            proxied = await resp.read()
            proxied_type = resp.headers["Content-Type"]
            assert resp.status == 200
        async with http.get(target.url + "/v1/models", headers=headers) as direct:
            assert proxied == await direct.read()
            assert proxied_type == direct.headers["Content-Type"]
        assert [(r.method, r.path) for r in target.stats] == [("GET", "/v1/models")] * 2
        assert other.stats == []
    shape = json.loads(proxied)
    assert shape["data"][0]["id"] == "emulator-1"
    # The emulator picks the Anthropic list shape by anthropic-version alone.
    assert ("has_more" in shape) is ("anthropic-version" in headers)


async def test_sdks_list_models_through_the_proxy() -> None:
    async with two_upstreams() as (url, oai, ant):
        async with openai_client(url + "/v1") as oai_client:
            oai_models = [m.id async for m in oai_client.models.list()]
        async with anthropic_client(url) as ant_client:
            ant_models = [m.id async for m in ant_client.models.list()]
        assert oai_models == ant_models == ["emulator-1"]
        assert [r.path for r in oai.stats] == [r.path for r in ant.stats] == ["/v1/models"]


async def test_protocol_routes_go_to_their_upstream(http: aiohttp.ClientSession) -> None:
    async with two_upstreams() as (url, oai, ant):
        for path in (CHAT_PATH, RESPONSES_PATH, ANTHROPIC_PATH, COUNT_TOKENS_PATH):
            async with http.post(url + path, data=stream_body(path, stream=False)) as resp:
                assert resp.status == 200, await resp.text()
        assert [r.path for r in oai.stats] == [CHAT_PATH, RESPONSES_PATH]
        assert [r.path for r in ant.stats] == [ANTHROPIC_PATH, COUNT_TOKENS_PATH]


# ----------------------------------------------------------------- headers

E2E_HEADERS = [
    ("Authorization", f"Bearer {SECRET}"),
    ("x-api-key", SECRET),
    ("anthropic-version", "2023-06-01"),
    ("anthropic-beta", "prompt-caching-2024-07-31,interleaved-thinking-2025-05-14"),
    ("x-claude-code-session-id", "cc-session-e2e"),
    ("session-id", "codex-session-e2e"),
]


async def test_end_to_end_headers_reach_the_emulator(
    harness: Harness, http: aiohttp.ClientSession
) -> None:
    async with http.post(
        harness.url + ANTHROPIC_PATH + "?beta=true",
        data=stream_body(ANTHROPIC_PATH),
        headers=E2E_HEADERS,
    ) as resp:
        assert resp.status == 200
        await resp.read()
    seen = harness.emulator.stats[-1].headers
    # The emulator keeps only the first 7 characters of credentials.
    assert seen["authorization"] == "Bearer \u2026"
    assert seen["x-api-key"] == SECRET[:7] + "\u2026"
    assert seen["anthropic-version"] == "2023-06-01"
    assert seen["anthropic-beta"] == dict(E2E_HEADERS)["anthropic-beta"]
    assert seen["x-claude-code-session-id"] == "cc-session-e2e"
    assert seen["session-id"] == "codex-session-e2e"


HOP_BY_HOP = [
    ("Connection", "keep-alive, X-Hop-Custom"),
    ("X-Hop-Custom", "listed-in-connection"),
    ("Keep-Alive", "timeout=30"),
    ("TE", "trailers"),
    ("Trailer", "X-Checksum"),
    ("Proxy-Authorization", "Basic cHJveHk6c2VjcmV0"),
    ("Proxy-Connection", "keep-alive"),
]


async def test_hop_by_hop_headers_stop_at_the_proxy() -> None:
    """RFC 9110 section 7.6.1: hop-by-hop fields, and those named in Connection, are not
    forwarded in either direction; end-to-end fields are, unchanged."""
    seen: list[dict[str, str]] = []

    async def upstream(request: web.Request) -> web.StreamResponse:
        seen.append({k.lower(): v for k, v in request.headers.items()})
        body = await request.content.read()
        seen[-1]["x-body-length"] = str(len(body))
        return web.json_response(
            {"ok": True},
            headers={
                "Connection": "keep-alive, X-Resp-Hop",
                "X-Resp-Hop": "listed-in-connection",
                "Keep-Alive": "timeout=5",
                "Proxy-Authenticate": 'Basic realm="upstream"',
                "X-End-To-End": "kept",
            },
        )

    app = web.Application()
    app.router.add_post(CHAT_PATH, upstream)
    async with serve_app(app) as upstream_url:
        body = stream_body(CHAT_PATH, stream=False)
        async with proxy_for(upstream_url) as url:
            client = await RawClient.connect(url)
            try:
                # Chunked framing is hop-by-hop too: the upstream must get a Content-Length.
                client.send_head(
                    "POST",
                    CHAT_PATH,
                    [
                        ("Content-Type", "application/json"),
                        ("Transfer-Encoding", "chunked"),
                        *E2E_HEADERS,
                        *HOP_BY_HOP,
                    ],
                )
                await client.send(b"%x\r\n%s\r\n0\r\n\r\n" % (len(body), body))
                head = await client.read_head()
                payload = await client.read_body(head)
            finally:
                await client.close()
    assert head.status == 200 and json.loads(payload) == {"ok": True}
    (got,) = seen
    for name, value in E2E_HEADERS:
        assert got[name.lower()] == value
    for name in ("x-hop-custom", "keep-alive", "te", "trailer", "proxy-authorization"):
        assert name not in got, name
    assert "proxy-connection" not in got
    assert "x-hop-custom" not in got.get("connection", "").lower()
    assert "transfer-encoding" not in got
    assert got["content-length"] == got["x-body-length"] == str(len(body))
    assert got["host"] == upstream_url.removeprefix("http://")
    assert head.headers["X-End-To-End"] == "kept"
    for name in ("X-Resp-Hop", "Keep-Alive", "Proxy-Authenticate"):
        assert name not in head.headers, name


async def test_api_key_never_logged(
    caplog: pytest.LogCaptureFixture, http: aiohttp.ClientSession
) -> None:
    caplog.set_level(logging.DEBUG)
    auth = {"Authorization": f"Bearer {SECRET}", "x-api-key": SECRET}
    async with proxy_with_emulator(max_body_bytes=4096, upstream_header_timeout=0.3) as h:
        scripts = [
            (CHAT_PATH, None, 200),  # a full stream
            (ANTHROPIC_PATH, "cut_after=3", 200),  # a stream that dies: in-band error
            (RESPONSES_PATH, "status=401", 401),  # an upstream error
            (CHAT_PATH, "stall_headers=5", 504),  # no upstream headers in time
        ]
        for path, script, status in scripts:
            headers = dict(auth, **({"x-emulator": script} if script else {}))
            async with http.post(h.url + path, data=stream_body(path), headers=headers) as resp:
                assert resp.status == status
                await resp.read()
        async with http.post(h.url + CHAT_PATH, data=b"x" * 5000, headers=auth) as resp:
            assert resp.status == 413
        with LogWaiter("context_proxy", "before the body completed") as gone:
            client = await RawClient.connect(h.url)
            client.send_head("POST", CHAT_PATH, [*auth.items(), ("Content-Length", "1000")])
            await client.send(b'{"model": ')
            await wait_until(lambda: bool(h.state.exchanges), "reading the body")
            client.abort()
            await gone.wait(2.0)
    proxy_records = [r for r in caplog.records if r.name.startswith("context_proxy")]
    assert len([r for r in proxy_records if r.levelno >= logging.WARNING]) >= 3
    pieces = {SECRET, SECRET[7:23], SECRET[-16:]}
    for record in caplog.records:
        text = record.getMessage() + repr(record.args) + (record.exc_text or "")
        if record.exc_info is not None:
            text += logging.Formatter().formatException(record.exc_info)
        for piece in pieces:
            assert piece not in text, (record.name, record.levelname)


# ----------------------------------------------------------------- upstream failures


async def test_unreachable_upstream_is_502_in_the_client_protocol(
    http: aiohttp.ClientSession,
) -> None:
    port = free_port()  # nothing listens there: refused
    dead = f"http://127.0.0.1:{port}"
    # Plain words with the configured address, not the HTTP client's class name.
    said = f"upstream refused the connection at 127.0.0.1:{port}"
    async with proxy_for(dead) as url:
        async with http.post(url + CHAT_PATH, data=stream_body(CHAT_PATH)) as resp:
            assert resp.status == 502
            body = await resp.json()
            assert_openai_error(body, type_="server_error")
            assert body["error"]["message"] == said
        async with http.post(url + ANTHROPIC_PATH, data=stream_body(ANTHROPIC_PATH)) as resp:
            assert resp.status == 502
            body = await resp.json()
            assert_anthropic_error(body, type_="api_error")
            assert body["error"]["message"] == said
        async with openai_client(url + "/v1") as client:
            with pytest.raises(openai.InternalServerError) as oai:
                await client.chat.completions.create(model="m", messages=OAI_USER)
        assert oai.value.status_code == 502
        async with anthropic_client(url) as ant_client:
            with pytest.raises(anthropic.InternalServerError) as ant:
                await ant_client.messages.create(model="m", max_tokens=8, messages=ANT_USER)
        assert ant.value.status_code == 502


@pytest.mark.parametrize(
    ("path", "check"),
    [
        (CHAT_PATH, lambda p: assert_openai_error(p, type_="server_error")),
        (RESPONSES_PATH, lambda p: assert_openai_error(p, type_="server_error")),
        (ANTHROPIC_PATH, lambda p: assert_anthropic_error(p, type_="timeout_error")),
    ],
    ids=["chat", "responses", "messages"],
)
async def test_no_upstream_headers_in_time_is_504_and_aborts_upstream(
    http: aiohttp.ClientSession, path: str, check: Callable[[Any], str]
) -> None:
    async with proxy_with_emulator(upstream_header_timeout=0.5) as h:
        loop = asyncio.get_running_loop()
        started = loop.time()
        async with http.post(
            h.url + path, data=stream_body(path), headers={"x-emulator": "stall_headers=5"}
        ) as resp:
            assert resp.status == 504
            check(await resp.json())
        # The 0.5 s header timeout, not the 5 s stall (upper bound generous for load).
        assert 0.5 <= loop.time() - started < 4.0
        record = await h.emulator.wait_aborted(1, WAIT_S)
        assert not record.headers_sent


async def test_stream_cut_midway_raises_in_each_sdk(harness: Harness) -> None:
    cut = {"x-emulator": "cut_after=3"}
    got: list[str] = []
    async with openai_client(harness.openai_base_url) as client:
        stream = await client.chat.completions.create(
            model="m", messages=OAI_USER, stream=True, extra_headers=cut
        )
        with pytest.raises(openai.APIError, match="upstream"):
            async for chunk in stream:
                got.extend(c.delta.content or "" for c in chunk.choices)
        assert got and "".join(got) != DEFAULT_TEXT  # some text came, then the error

        events = await client.responses.create(
            model="m", input="hi", stream=True, extra_headers={"x-emulator": "cut_after=5"}
        )
        kinds = [event.type async for event in events]
        assert kinds[-1] == "error"
        assert "response.output_text.delta" in kinds and "response.completed" not in kinds

    async with anthropic_client(harness.url) as ant_client:
        ant_stream = await ant_client.messages.create(
            model="m", max_tokens=8, messages=ANT_USER, stream=True, extra_headers=cut
        )
        seen: list[str] = []
        with pytest.raises(anthropic.APIStatusError, match="upstream"):
            async for event in ant_stream:
                seen.append(event.type)
        assert "message_start" in seen and "message_stop" not in seen
    records = harness.emulator.stats
    assert len(records) == 3 and all(r.cut_by_emulator for r in records)


@pytest.mark.parametrize(
    ("path", "script"),
    [
        (CHAT_PATH, "status=429; retry_after=7"),
        (RESPONSES_PATH, "status=500"),
        (ANTHROPIC_PATH, "status=529; retry_after=3"),
        (ANTHROPIC_PATH, "status=403"),
        (CHAT_PATH, "status=503; plain=1"),
    ],
)
async def test_upstream_errors_pass_through(
    harness: Harness, http: aiohttp.ClientSession, path: str, script: str
) -> None:
    status = int(script.split(";")[0].removeprefix("status="))
    async with http.post(
        harness.url + path, data=stream_body(path), headers={"x-emulator": script}
    ) as resp:
        body = await resp.read()
        assert resp.status == status
        assert resp.headers.get("Retry-After") == (
            script.rsplit("retry_after=", 1)[1] if "retry_after" in script else None
        )
        assert resp.content_type == ("text/plain" if "plain" in script else "application/json")
    record = await harness.emulator.wait_closed(1, WAIT_S)
    assert record.status == status and record.finished
    assert len(body) == record.bytes_sent
    assert xxhash.xxh3_128_hexdigest(body) == record.sent_digest


async def test_sdks_see_upstream_status_errors(harness: Harness) -> None:
    async with openai_client(harness.openai_base_url) as client:
        with pytest.raises(openai.RateLimitError) as oai:
            await client.chat.completions.create(
                model="m", messages=OAI_USER, extra_headers={"x-emulator": "status=429"}
            )
    assert oai.value.status_code == 429 and oai.value.code == "rate_limit_exceeded"
    async with anthropic_client(harness.url) as ant_client:
        with pytest.raises(anthropic.APIStatusError) as ant:
            await ant_client.messages.create(
                model="m",
                max_tokens=8,
                messages=ANT_USER,
                extra_headers={"x-emulator": "status=529"},
            )
    assert ant.value.status_code == 529
    assert isinstance(ant.value.body, dict)
    assert ant.value.body["error"]["type"] == "overloaded_error"


async def test_gzip_upstream_still_gives_a_valid_response(
    harness: Harness, http: aiohttp.ClientSession
) -> None:
    gz = {"x-emulator": "gzip=1"}
    async with openai_client(harness.openai_base_url) as client:
        stream = await client.chat.completions.create(
            model="m", messages=OAI_USER, stream=True, extra_headers=gz
        )
        text = "".join([c.choices[0].delta.content or "" async for c in stream if c.choices])
        reply = await client.responses.create(model="m", input="hi", extra_headers=gz)
    assert text == DEFAULT_TEXT
    assert reply.output_text == DEFAULT_TEXT
    async with anthropic_client(harness.url) as ant_client:
        message = await ant_client.messages.create(
            model="m", max_tokens=8, messages=ANT_USER, extra_headers=gz
        )
    assert message.content[0].type == "text" and message.content[0].text == DEFAULT_TEXT
    # On the wire: the proxy decoded the upstream's gzip, so it must not claim it.
    async with (
        aiohttp.ClientSession(auto_decompress=False) as raw_http,
        raw_http.post(
            harness.url + ANTHROPIC_PATH, data=stream_body(ANTHROPIC_PATH), headers=gz
        ) as resp,
    ):
        wire = await resp.read()
        assert "Content-Encoding" not in resp.headers
    assert sse_events(wire)[-1][0] == "message_stop"
    records = harness.emulator.stats
    assert len(records) == 4 and all(r.finished for r in records)

"""OpenTelemetry traces (issue 24 item 5), through the real proxy, emulator and SDKs.

Spans go to the SDK's ``InMemorySpanExporter`` (a provider handed to the app),
or, for the process, over OTLP/HTTP to a collector on a loopback port,
configured by ``OTEL_*`` variables only. The W3C trace context is checked as
a raw-socket upstream receives it.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import os
import signal
import subprocess
import sys
import textwrap
from collections.abc import AsyncIterator, Iterator
from typing import Any, cast

import aiohttp
import anthropic
import openai
import pytest
from aiohttp import web
from multidict import CIMultiDict
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind, StatusCode

from plugins.fold import FoldPlugin
from proxy._check import check_config
from proxy._emulator import DEFAULT_TEXT, start_emulator
from proxy._tracing import MISSING_EXTRA
from proxy._upstream import UpstreamTarget
from proxy.testing import Harness, ProxyStartError, proxy_process, proxy_with_emulator
from tests.support.lifetime import CHAT, WAIT_S, Recorder, conversation, encode
from tests.support.ports import serve_app
from tests.support.process import Proc
from tests.support.upstream import Scripted, read_request

API_KEY = "sk-tracing-secret-key-0123456789"
SESSION = "tracing-session-42"
#: A client's W3C trace context (W3C Trace Context §3.2, §3.3).
CLIENT_TRACE = "0af7651916cd43dd8448eb211c80319c"
CLIENT_SPAN = "b7ad6b7169203331"
TRACEPARENT = f"00-{CLIENT_TRACE}-{CLIENT_SPAN}-01"
TRACESTATE = "vendor=opaque-value"
BAGGAGE = "tenant=blue"


@pytest.fixture
def spans() -> Iterator[tuple[TracerProvider, InMemorySpanExporter]]:
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    yield provider, exporter
    provider.shutdown()


async def finished(exporter: InMemorySpanExporter, servers: int = 1) -> list[ReadableSpan]:
    """The spans once ``servers`` server spans ended (the handler ends its span
    after the client has its answer)."""
    async with asyncio.timeout(WAIT_S):
        while True:
            got = list(exporter.get_finished_spans())
            if sum(s.kind is SpanKind.SERVER for s in got) >= servers:
                return got
            await asyncio.sleep(0.01)


def split(got: list[ReadableSpan]) -> tuple[ReadableSpan, list[ReadableSpan]]:
    """The one server span and its client spans in start order (each a child of it)."""
    (server,) = [s for s in got if s.kind is SpanKind.SERVER]
    clients = sorted((s for s in got if s.kind is SpanKind.CLIENT), key=lambda s: s.start_time or 0)
    assert server.context is not None
    for client in clients:
        assert client.parent is not None and client.context is not None
        assert client.parent.span_id == server.context.span_id
        assert client.context.trace_id == server.context.trace_id
    return server, clients


def attrs(span: ReadableSpan) -> dict[str, Any]:
    return dict(span.attributes or {})


def no_secrets(got: list[ReadableSpan]) -> None:
    """No attribute value holds the key, the raw session id or a prompt."""
    for span in got:
        for value in attrs(span).values():
            text = str(value)
            assert API_KEY not in text and SESSION not in text and "turn 0" not in text


async def test_a_chat_stream_is_a_server_span_with_gen_ai_attributes(
    spans: tuple[TracerProvider, InMemorySpanExporter],
) -> None:
    provider, exporter = spans
    recorder = Recorder()
    async with (
        proxy_with_emulator(plugins=[recorder], tracing="otel", tracer_provider=provider) as h,
        openai.AsyncOpenAI(
            base_url=h.openai_base_url,
            api_key=API_KEY,
            max_retries=0,
            default_headers={"x-emulator": "usage=1; cache_read=7", "x-session-id": SESSION},
        ) as client,
    ):
        text = ""
        chunks = await client.chat.completions.create(
            model="trace-model",
            messages=[{"role": "user", "content": "turn 0: hello"}],
            stream=True,
            stream_options={"include_usage": True},
        )
        async for chunk in chunks:
            for choice in chunk.choices:
                text += choice.delta.content or ""
        (record,) = await recorder.wait(1)
        got = await finished(exporter)
    assert text == DEFAULT_TEXT
    server, (attempt,) = split(got)
    assert server.name == "chat trace-model"
    assert record.input_tokens and record.output_tokens
    assert attrs(server) | {"client.port": 0} == {
        "http.request.method": "POST",
        "url.path": CHAT,
        "url.scheme": "http",
        "client.address": "127.0.0.1",
        "client.port": 0,
        "http.response.status_code": 200,
        "http.request.body.size": record.request_bytes,
        "http.response.body.size": record.response_bytes,
        "gen_ai.provider.name": "openai",
        "gen_ai.system": "openai",
        "gen_ai.operation.name": "chat",
        "gen_ai.request.model": "trace-model",
        "gen_ai.response.model": "trace-model",
        "gen_ai.usage.input_tokens": record.input_tokens,
        "gen_ai.usage.output_tokens": record.output_tokens,
        "gen_ai.usage.cache_read.input_tokens": 7,
        "context_proxy.exchange.id": record.exchange_id,
        "context_proxy.protocol": "openai-chat",
        "context_proxy.stream": True,
        "context_proxy.outcome": "ok",
        "context_proxy.fold_level": 0,
        "context_proxy.refolds": 0,
        "context_proxy.resends": 0,
        "context_proxy.session.digest": hashlib.sha256(SESSION.encode()).hexdigest()[:16],
    }
    assert server.status.status_code is StatusCode.UNSET
    assert attempt.name == f"POST {CHAT}"
    assert attrs(attempt)["context_proxy.attempt.reason"] == "first"
    assert attrs(attempt)["http.response.status_code"] == 200
    assert attrs(attempt)["server.address"] == "127.0.0.1"
    no_secrets(got)


async def test_an_anthropic_stream_reports_cache_tokens(
    spans: tuple[TracerProvider, InMemorySpanExporter],
) -> None:
    provider, exporter = spans
    recorder = Recorder()
    async with (
        proxy_with_emulator(plugins=[recorder], tracing="otel", tracer_provider=provider) as h,
        anthropic.AsyncAnthropic(
            base_url=h.url,
            api_key=API_KEY,
            max_retries=0,
            default_headers={"x-emulator": "cache_read=11"},
        ) as claude,
        claude.messages.stream(
            model="claude-trace",
            max_tokens=64,
            messages=[{"role": "user", "content": "hello"}],
        ) as stream,
    ):
        assert await stream.get_final_text() == DEFAULT_TEXT
        (record,) = await recorder.wait(1)
        got = await finished(exporter)
    server, (_attempt,) = split(got)
    assert server.name == "chat claude-trace"
    a = attrs(server)
    assert (a["gen_ai.provider.name"], a["gen_ai.system"]) == ("anthropic", "anthropic")
    assert a["gen_ai.usage.input_tokens"] == record.input_tokens
    assert a["gen_ai.usage.output_tokens"] == record.output_tokens
    assert a["gen_ai.usage.cache_read.input_tokens"] == 11
    assert a["gen_ai.usage.cache_creation.input_tokens"] == 0
    assert a["gen_ai.response.model"] == "claude-trace"
    assert "context_proxy.session.digest" not in a  # no session id: none made up


async def test_a_refold_is_a_second_attempt_span(
    spans: tuple[TracerProvider, InMemorySpanExporter],
) -> None:
    provider, exporter = spans
    body = encode(conversation(CHAT))
    async with (
        proxy_with_emulator(plugins=[FoldPlugin()], tracing="otel", tracer_provider=provider) as h,
        aiohttp.ClientSession() as http,
        http.post(
            h.url + CHAT,
            data=body,
            headers={"x-emulator": "overflow_above=100000", "Content-Type": "application/json"},
        ) as resp,
    ):
        assert resp.status == 200
        await resp.read()
        got = await finished(exporter)
    server, (first, second) = split(got)
    assert [attrs(s)["context_proxy.attempt.reason"] for s in (first, second)] == [
        "first",
        "refold",
    ]
    assert [attrs(s)["context_proxy.fold_level"] for s in (first, second)] == [0, 1]
    assert [attrs(s)["http.response.status_code"] for s in (first, second)] == [400, 200]
    assert (
        attrs(first)["http.request.body.size"] > 100_000 >= attrs(second)["http.request.body.size"]
    )
    assert first.status.status_code is StatusCode.ERROR
    assert second.status.status_code is StatusCode.UNSET
    a = attrs(server)
    assert (a["context_proxy.fold_level"], a["context_proxy.refolds"]) == (1, 1)
    assert a["context_proxy.outcome"] == "ok"
    no_secrets(got)


async def test_each_resend_of_an_empty_answer_is_an_attempt_span(
    spans: tuple[TracerProvider, InMemorySpanExporter],
) -> None:
    provider, exporter = spans
    async with (
        proxy_with_emulator(
            tracing="otel", tracer_provider=provider, fake_completion_retries=2
        ) as h,
        aiohttp.ClientSession() as http,
        http.post(
            h.url + CHAT,
            data=encode(conversation(CHAT)),
            headers={"x-emulator": "empty_times=2", "x-emulator-key": "traced-resend"},
        ) as resp,
    ):
        assert resp.status == 200
        await resp.read()
        got = await finished(exporter)
    server, attempts = split(got)
    assert len(h.emulator.stats) == 3
    assert [attrs(s)["context_proxy.attempt.reason"] for s in attempts] == [
        "first",
        "resend",
        "resend",
    ]
    assert [attrs(s)["context_proxy.attempt"] for s in attempts] == [1, 2, 3]
    assert attrs(server)["context_proxy.resends"] == 2


def point_openai_at(h: Harness, url: str) -> None:
    """Send the harness proxy's OpenAI exchanges to ``url`` instead of the emulator."""
    assert h.state.upstream is not None
    targets = cast(dict[str, UpstreamTarget], h.state.upstream.targets)
    targets["openai"] = UpstreamTarget(url)


async def test_an_unreachable_upstream_is_a_failed_attempt(
    spans: tuple[TracerProvider, InMemorySpanExporter],
) -> None:
    provider, exporter = spans
    # A port nobody listens on: bound, then closed.
    probe = await asyncio.start_server(lambda r, w: None, "127.0.0.1", 0)
    port = probe.sockets[0].getsockname()[1]
    probe.close()
    await probe.wait_closed()
    async with proxy_with_emulator(tracing="otel", tracer_provider=provider) as h:
        point_openai_at(h, f"http://127.0.0.1:{port}")
        async with (
            aiohttp.ClientSession() as http,
            http.post(h.url + CHAT, data=encode(conversation(CHAT, turns=2))) as resp,
        ):
            assert resp.status == 502
        got = await finished(exporter)
    server, (attempt,) = split(got)
    assert attrs(attempt)["error.type"] == "upstream_unreachable"
    assert "http.response.status_code" not in attrs(attempt)
    assert attempt.status.status_code is StatusCode.ERROR
    assert attrs(server)["error.type"] == "upstream_unreachable"
    assert server.status.status_code is StatusCode.ERROR


# ---------------------------------------------------------------- trace context upstream


@pytest.fixture
async def raw_upstream() -> AsyncIterator[tuple[str, list[CIMultiDict[str]]]]:
    """A bare-socket HTTP/1.1 upstream: records each request's header fields as they
    came on the wire, answers a small chat completion and closes."""
    seen: list[CIMultiDict[str]] = []
    answer = json.dumps(
        {
            "id": "c1",
            "object": "chat.completion",
            "model": "m-2026-12-01",
            "usage": {"prompt_tokens": 12, "completion_tokens": 1},
            "choices": [
                {
                    "index": 0,
                    "message": {"role": "assistant", "content": "hi"},
                    "finish_reason": "stop",
                }
            ],
        }
    ).encode()

    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, n: int) -> None:
        async with asyncio.timeout(WAIT_S):
            head, _ = await read_request(reader)
            fields: CIMultiDict[str] = CIMultiDict()
            for line in head.decode("latin-1").split("\r\n")[1:]:
                if line:
                    name, _, value = line.partition(":")
                    fields.add(name.strip(), value.strip())
            seen.append(fields)
            writer.write(
                b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\n"
                b"Connection: close\r\nContent-Length: %d\r\n\r\n%s" % (len(answer), answer)
            )
            await writer.drain()

    async with Scripted(serve) as upstream:
        yield upstream.url, seen


async def _ask(url: str, headers: dict[str, str]) -> None:
    body = encode(conversation(CHAT, turns=2, stream=False))
    async with (
        aiohttp.ClientSession() as http,
        http.post(url + CHAT, data=body, headers=headers) as resp,
    ):
        assert resp.status == 200
        await resp.read()


@pytest.mark.parametrize("client_sent", [True, False], ids=["client-traceparent", "none"])
async def test_without_tracing_the_trace_context_passes_untouched(
    client_sent: bool, raw_upstream: tuple[str, list[CIMultiDict[str]]]
) -> None:
    url, seen = raw_upstream
    headers = {"traceparent": TRACEPARENT, "tracestate": TRACESTATE} if client_sent else {}
    async with proxy_with_emulator() as h:
        assert h.state.tracing is None
        point_openai_at(h, url)
        await _ask(h.url, headers)
    (fields,) = seen
    if client_sent:
        assert fields.getall("traceparent") == [TRACEPARENT]
        assert fields.getall("tracestate") == [TRACESTATE]
    else:
        assert "traceparent" not in fields and "tracestate" not in fields


async def test_with_tracing_the_upstream_gets_the_attempt_as_parent(
    raw_upstream: tuple[str, list[CIMultiDict[str]]],
    spans: tuple[TracerProvider, InMemorySpanExporter],
) -> None:
    provider, exporter = spans
    url, seen = raw_upstream
    async with proxy_with_emulator(tracing="otel", tracer_provider=provider) as h:
        point_openai_at(h, url)
        await _ask(
            h.url, {"traceparent": TRACEPARENT, "tracestate": TRACESTATE, "baggage": BAGGAGE}
        )
        await _ask(h.url, {})
        got = await finished(exporter, servers=2)
    servers = sorted((s for s in got if s.kind is SpanKind.SERVER), key=lambda s: s.start_time or 0)
    attempts = sorted(
        (s for s in got if s.kind is SpanKind.CLIENT), key=lambda s: s.start_time or 0
    )
    # The client's context is the parent of the exchange's span ...
    joined, fresh = servers
    assert joined.parent is not None and joined.parent.is_remote
    assert format(joined.parent.span_id, "016x") == CLIENT_SPAN
    assert format(joined.context.trace_id, "032x") == CLIENT_TRACE
    assert fresh.parent is None  # no context from the client: a new trace
    # The model that answered, as its answer names it (not the one asked for).
    assert attrs(joined)["gen_ai.request.model"] == "lifetime-model"
    assert attrs(joined)["gen_ai.response.model"] == "m-2026-12-01"
    # ... and each attempt's context went upstream in place of the client's, once.
    for fields, attempt in zip(seen, attempts, strict=True):
        (traceparent,) = fields.getall("traceparent")
        ctx = attempt.context
        assert traceparent == f"00-{ctx.trace_id:032x}-{ctx.span_id:016x}-{ctx.trace_flags:02x}"
    assert format(attempts[0].context.trace_id, "032x") == CLIENT_TRACE
    assert seen[0].getall("tracestate") == [TRACESTATE]
    assert seen[0].getall("baggage") == [BAGGAGE]  # carried on, once
    assert "tracestate" not in seen[1] and "baggage" not in seen[1]


async def test_with_the_sdk_disabled_the_trace_context_passes_untouched(
    raw_upstream: tuple[str, list[CIMultiDict[str]]], monkeypatch: pytest.MonkeyPatch
) -> None:
    # The proxy's own provider, from the environment: OTEL_SDK_DISABLED makes no spans.
    monkeypatch.setenv("OTEL_SDK_DISABLED", "true")
    monkeypatch.setenv("OTEL_TRACES_EXPORTER", "none")
    url, seen = raw_upstream
    async with proxy_with_emulator(tracing="otel") as h:
        assert h.state.tracing is not None
        point_openai_at(h, url)
        await _ask(h.url, {"traceparent": TRACEPARENT, "tracestate": TRACESTATE})
        await _ask(h.url, {})
    first, second = seen
    assert first.getall("traceparent") == [TRACEPARENT]
    assert first.getall("tracestate") == [TRACESTATE]
    assert "traceparent" not in second


def test_check_reports_a_missing_exporter_or_sdk(monkeypatch: pytest.MonkeyPatch) -> None:
    env = {"CONTEXT_PROXY_TRACING": "otel"}
    assert check_config(environ=env).problems == ()
    (problem,) = check_config(environ=env | {"OTEL_TRACES_EXPORTER": "zipkin_json"}).problems
    assert problem.startswith("OTEL_TRACES_EXPORTER: exporter 'zipkin_json'")
    (problem,) = check_config(environ=env | {"OTEL_EXPORTER_OTLP_PROTOCOL": "grpc"}).problems
    assert "opentelemetry-exporter-otlp-proto-grpc" in problem
    monkeypatch.setitem(sys.modules, "opentelemetry.sdk.trace", None)  # as if not installed
    assert check_config(environ=env).problems == (MISSING_EXTRA,)


# ------------------------------------------------------------------------- the process


def test_off_imports_no_opentelemetry_after_a_full_exchange() -> None:
    script = textwrap.dedent(
        """
        import asyncio, sys
        import aiohttp
        from proxy.testing import proxy_with_emulator

        async def main():
            async with proxy_with_emulator() as h, aiohttp.ClientSession() as http:
                body = b'{"model":"m","stream":true,"messages":[{"role":"user","content":"hi"}]}'
                async with http.post(h.url + "/v1/chat/completions", data=body) as resp:
                    assert resp.status == 200, resp.status
                    assert b"[DONE]" in await resp.read()
                await h.settle()
            print(sorted(m for m in sys.modules if m.split(".")[0] == "opentelemetry"))

        asyncio.run(main())
        """
    )
    env = {k: v for k, v in os.environ.items() if not k.startswith("CONTEXT_PROXY_")}
    done = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=60, env=env
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[]"


async def test_enabled_without_the_extra_is_a_start_up_error_naming_it() -> None:
    # The interpreter as it is without the extra: every opentelemetry import fails.
    command = [
        sys.executable,
        "-c",
        "import sys; sys.modules['opentelemetry'] = None; "
        "from proxy._cli import main; main(prog_name='context-proxy')",
    ]
    with pytest.raises(ProxyStartError) as failed:
        async with proxy_process(command=command, env={"CONTEXT_PROXY_TRACING": "otel"}):
            pass
    assert failed.value.returncode == 1
    assert MISSING_EXTRA in failed.value.output
    assert "Traceback" not in failed.value.output


async def test_the_process_exports_over_otlp_as_the_otel_variables_say() -> None:
    posts: list[bytes] = []

    async def collect(request: web.Request) -> web.Response:
        assert request.content_type == "application/x-protobuf"
        posts.append(await request.read())
        return web.Response(body=b"", content_type="application/x-protobuf")

    app = web.Application()
    app.router.add_post("/v1/traces", collect)
    async with serve_app(app) as collector:
        emulator = await start_emulator()
        env = {
            "OTEL_SERVICE_NAME": "proxy-under-test",
            "OTEL_EXPORTER_OTLP_ENDPOINT": collector,
            "OTEL_TRACES_EXPORTER": "otlp",
            "NO_PROXY": "127.0.0.1",
        }
        try:
            async with proxy_process(
                "--upstream-openai", emulator.url, "--no-access-log", "--tracing", "otel", env=env
            ) as proxy:
                async with openai.AsyncOpenAI(
                    base_url=proxy.url + "/v1", api_key=API_KEY, max_retries=0
                ) as client:
                    reply = await client.chat.completions.create(
                        model="otlp-model", messages=[{"role": "user", "content": "hi"}]
                    )
                assert reply.choices[0].message.content == DEFAULT_TEXT
                assert await proxy.stop() == 0  # the batch is exported at shutdown
        finally:
            await emulator.close()
    names: list[tuple[str, str]] = []
    for post in posts:
        request = ExportTraceServiceRequest.FromString(post)
        for resource_spans in request.resource_spans:
            resource = {a.key: a.value.string_value for a in resource_spans.resource.attributes}
            for scope_spans in resource_spans.scope_spans:
                assert scope_spans.scope.name == "context_proxy"
                names += [(resource["service.name"], s.name) for s in scope_spans.spans]
    assert sorted(names) == [
        ("proxy-under-test", f"POST {CHAT}"),
        ("proxy-under-test", "chat otlp-model"),
    ]


async def test_a_refused_request_is_a_server_span_without_attempts(
    spans: tuple[TracerProvider, InMemorySpanExporter],
) -> None:
    provider, exporter = spans
    async with (
        proxy_with_emulator(tracing="otel", tracer_provider=provider, max_body_bytes=1024) as h,
        aiohttp.ClientSession() as http,
        http.post(h.url + CHAT, data=encode(conversation(CHAT, turns=2))) as resp,
    ):
        assert resp.status == 413
        got = await finished(exporter)
    server, attempts = split(got)
    assert attempts == []
    a = attrs(server)
    assert (a["http.response.status_code"], a["context_proxy.outcome"]) == (413, "rejected")
    assert a["error.type"] == "rejected"
    assert server.status.status_code is StatusCode.UNSET  # a 4xx is the client's error
    assert h.emulator.stats == []


async def test_a_responses_stream_names_the_model_that_answered(
    spans: tuple[TracerProvider, InMemorySpanExporter],
) -> None:
    provider, exporter = spans
    recorder = Recorder()
    async with (
        proxy_with_emulator(plugins=[recorder], tracing="otel", tracer_provider=provider) as h,
        openai.AsyncOpenAI(base_url=h.openai_base_url, api_key=API_KEY, max_retries=0) as client,
    ):
        text = ""
        events = await client.responses.create(model="resp-model", input="hello", stream=True)
        async for event in events:
            if event.type == "response.output_text.delta":
                text += event.delta
            elif event.type == "response.completed":
                answered = event.response.model
        (record,) = await recorder.wait(1)
        got = await finished(exporter)
    assert text == DEFAULT_TEXT
    server, (_attempt,) = split(got)
    a = attrs(server)
    assert server.name == "chat resp-model"
    assert a["gen_ai.response.model"] == answered
    assert a["gen_ai.usage.input_tokens"] == record.input_tokens
    assert a["context_proxy.protocol"] == "openai-responses"


# -----------------------------------------------------------------------------
# A client's malformed trace headers cost no log line (``serve --tracing otel``).
#
# OpenTelemetry's propagators warned of every over-long ``traceparent`` and every
# over-long ``baggage``: one WARNING per request, for anyone who can reach the proxy.


HEADERS = [
    {"traceparent": "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01" + "x" * 600},
    {"traceparent": "zz-not-a-trace-context"},
    {"baggage": ",".join(f"k{i}=v" for i in range(200))},  # over 180 members
]


async def test_malformed_trace_headers_are_served_without_a_log_line_each() -> None:
    emulator = await start_emulator()
    proc, port = await Proc.serve(
        emulator.url,
        env={
            "CONTEXT_PROXY_TRACING": "otel",
            "OTEL_TRACES_EXPORTER": "none",
            "CONTEXT_PROXY_LOG_LEVEL": "info",
        },
    )
    try:
        async with aiohttp.ClientSession() as http:
            for extra in HEADERS * 3:
                async with http.post(
                    f"http://127.0.0.1:{port}/v1/chat/completions",
                    json={"model": "m", "messages": [{"role": "user", "content": "hi"}]},
                    headers={"authorization": "Bearer k", **extra},
                ) as answer:
                    assert answer.status == 200
                    await answer.read()
        proc.proc.send_signal(signal.SIGTERM)
        assert await proc.wait_exit(15) == 0
    finally:
        await proc.stop()
        await emulator.close()
    assert "context-proxy stopped" in proc.output
    assert "opentelemetry" not in proc.output, proc.output

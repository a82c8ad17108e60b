"""Tests for proxy/protocols: routing, error shapes, overflow, event classes, usage.

Error and in-band error shapes are proven against the REAL installed SDKs: the
bytes are served through an in-process ``httpx2.MockTransport`` (no socket) to
``openai.OpenAI`` / ``anthropic.Anthropic``, and the test asserts what the
SDK raises or yields. Stream samples are validated with the SDKs' own models.
"""

from __future__ import annotations

import json
import random
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import anthropic
import httpx2
import openai
import pydantic
import pytest
from anthropic.types import RawMessageStreamEvent
from anthropic.types.shared import ErrorResponse
from openai.types.chat import ChatCompletion, ChatCompletionChunk
from openai.types.responses import Response, ResponseErrorEvent, ResponseStreamEvent

from proxy._protocols import (
    Protocol,
    Route,
    UsageMeter,
    UsageReport,
    error_body,
    event_type,
    inband_error,
    is_output_event,
    is_overflow_event,
    is_overflow_response,
    is_terminal_event,
    route,
)
from proxy._sse import SSEEvent, SSEFramer

Handler = Callable[[httpx2.Request], httpx2.Response]
JSON = dict[str, Any]


# -- helpers ----------------------------------------------------------------


def openai_client(handler: Handler) -> openai.OpenAI:
    transport = httpx2.MockTransport(handler)
    return openai.OpenAI(
        api_key="sk-test",
        base_url="http://127.0.0.1:9/v1",
        http_client=httpx2.Client(transport=transport),
        max_retries=0,
    )


def anthropic_client(handler: Handler) -> anthropic.Anthropic:
    transport = httpx2.MockTransport(handler)
    return anthropic.Anthropic(
        api_key="sk-ant-test",
        base_url="http://127.0.0.1:9",
        http_client=httpx2.Client(transport=transport),
        max_retries=0,
    )


def serve(status: int, body: bytes, content_type: str) -> Handler:
    def handler(request: httpx2.Request) -> httpx2.Response:
        return httpx2.Response(status, headers={"content-type": content_type}, content=body)

    return handler


def sse(*events: tuple[str | None, JSON | str]) -> bytes:
    """Serialize events the way the upstreams do (one data line, blank line)."""
    out = []
    for name, payload in events:
        data = payload if isinstance(payload, str) else json.dumps(payload)
        out.append((f"event: {name}\n" if name else "") + f"data: {data}\n\n")
    return "".join(out).encode()


def frame(stream: bytes, chunk: int = 1024, max_data: int = 1 << 20) -> list[SSEEvent]:
    framer = SSEFramer(max_data=max_data)
    events: list[SSEEvent] = []
    for i in range(0, len(stream), chunk):
        events += framer.feed(stream[i : i + chunk])
    return events + framer.close()


def one(payload: JSON | str, name: str | None = None) -> SSEEvent:
    (event,) = frame(sse((name, payload)))
    return event


def meter_of(protocol: Protocol, events: Iterable[SSEEvent]) -> UsageMeter:
    meter = UsageMeter(protocol)
    for event in events:
        meter.feed_event(event)
    return meter


# -- realistic wire samples -------------------------------------------------


def chat_chunk(delta: JSON, finish: str | None = None, **extra: Any) -> JSON:
    return {
        "id": "chatcmpl-AZk1",
        "object": "chat.completion.chunk",
        "created": 1733000000,
        "model": "gpt-4o-2024-08-06",
        "system_fingerprint": "fp_7f6be3efb0",
        "choices": [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}],
        "usage": None,
        **extra,
    }


CHAT_USAGE = {
    "prompt_tokens": 1117,
    "completion_tokens": 46,
    "total_tokens": 1163,
    "prompt_tokens_details": {"cached_tokens": 1024, "audio_tokens": 0},
    "completion_tokens_details": {
        "reasoning_tokens": 0,
        "audio_tokens": 0,
        "accepted_prediction_tokens": 0,
        "rejected_prediction_tokens": 0,
    },
}
CHAT_ROLE = chat_chunk({"role": "assistant", "content": "", "refusal": None})
CHAT_TEXT = chat_chunk({"content": "Hello"})
CHAT_TOOL = chat_chunk(
    {
        "tool_calls": [
            {
                "index": 0,
                "id": "call_abc",
                "type": "function",
                "function": {"name": "read_file", "arguments": ""},
            }
        ]
    }
)
CHAT_REFUSAL = chat_chunk({"refusal": "I can't help with that."})
CHAT_REASONING = chat_chunk({"reasoning_content": "Let me think."})  # vLLM / DeepSeek
CHAT_FINISH = chat_chunk({}, "stop")
CHAT_USAGE_CHUNK = {**chat_chunk({}), "choices": [], "usage": CHAT_USAGE}
CHAT_STREAM = b": OPENROUTER PROCESSING\n\n" + sse(
    (None, CHAT_ROLE),
    (None, CHAT_TEXT),
    (None, CHAT_TOOL),
    (None, CHAT_FINISH),
    (None, CHAT_USAGE_CHUNK),
    (None, "[DONE]"),
)


def response_obj(status: str, output: list[JSON], usage: JSON | None, **extra: Any) -> JSON:
    return {
        "id": "resp_67ccd2bed1ec8190b14f964abc0542670bb6a6b452d3795b",
        "object": "response",
        "created_at": 1741476542,
        "status": status,
        "error": None,
        "incomplete_details": None,
        "instructions": "You are a coding agent.",
        "max_output_tokens": None,
        "model": "gpt-4.1-2025-04-14",
        "output": output,
        "parallel_tool_calls": True,
        "previous_response_id": None,
        "reasoning": {"effort": None, "summary": None},
        "store": True,
        "temperature": 1.0,
        "text": {"format": {"type": "text"}},
        "tool_choice": "auto",
        "tools": [],
        "top_p": 1.0,
        "truncation": "disabled",
        "usage": usage,
        "user": None,
        "metadata": {},
        **extra,
    }


RESPONSES_USAGE = {
    "input_tokens": 36,
    "input_tokens_details": {"cached_tokens": 12, "cache_write_tokens": 0},
    "output_tokens": 87,
    "output_tokens_details": {"reasoning_tokens": 0},
    "total_tokens": 123,
}


def message_item(text: str, status: str = "completed") -> JSON:
    return {
        "id": "msg_67ccd2bf17f0819081ff3bb2cf6508e60bb6a6b452d3795b",
        "type": "message",
        "status": status,
        "role": "assistant",
        "content": [{"type": "output_text", "text": text, "annotations": []}],
    }


def responses_stream(text: str) -> list[tuple[str, JSON]]:
    item = message_item("", "in_progress")
    item["content"] = []
    item_id = item["id"]
    return [
        ("response.created", {"type": "response.created", "sequence_number": 0,
                              "response": response_obj("in_progress", [], None)}),
        ("response.in_progress", {"type": "response.in_progress", "sequence_number": 1,
                                  "response": response_obj("in_progress", [], None)}),
        ("response.output_item.added", {"type": "response.output_item.added",
                                        "sequence_number": 2, "output_index": 0, "item": item}),
        ("response.content_part.added", {
            "type": "response.content_part.added", "sequence_number": 3, "item_id": item_id,
            "output_index": 0, "content_index": 0,
            "part": {"type": "output_text", "text": "", "annotations": []}}),
        ("response.output_text.delta", {
            "type": "response.output_text.delta", "sequence_number": 4, "item_id": item_id,
            "output_index": 0, "content_index": 0, "delta": text, "logprobs": []}),
        ("response.completed", {
            "type": "response.completed", "sequence_number": 5,
            "response": response_obj("completed", [message_item(text)], RESPONSES_USAGE)}),
    ]  # fmt: skip


RESPONSES_FAILED_OVERFLOW = {
    "type": "response.failed",
    "sequence_number": 2,
    "response": response_obj(
        "failed",
        [],
        None,
        error={
            "code": "context_length_exceeded",
            "message": "Your input exceeds the context window of this model. "
            "Please adjust your input and try again.",
        },
    ),
}
RESPONSES_FAILED_SERVER = {
    "type": "response.failed",
    "sequence_number": 2,
    "response": response_obj(
        "failed", [], None, error={"code": "server_error", "message": "The server had an error."}
    ),
}

ANTHROPIC_MESSAGE_START = {
    "type": "message_start",
    "message": {
        "id": "msg_01XFDUDYJgAACzvnptvVoYEL",
        "type": "message",
        "role": "assistant",
        "content": [],
        "model": "claude-sonnet-4-6",
        "stop_reason": None,
        "stop_sequence": None,
        "usage": {
            "input_tokens": 25,
            "cache_creation_input_tokens": 100,
            "cache_read_input_tokens": 2000,
            "output_tokens": 1,
        },
    },
}
ANTHROPIC_EVENTS: list[tuple[str, JSON]] = [
    ("message_start", ANTHROPIC_MESSAGE_START),
    ("content_block_start",
     {"type": "content_block_start", "index": 0, "content_block": {"type": "text", "text": ""}}),
    ("ping", {"type": "ping"}),
    ("content_block_delta",
     {"type": "content_block_delta", "index": 0, "delta": {"type": "text_delta", "text": "Hi"}}),
    ("content_block_stop", {"type": "content_block_stop", "index": 0}),
    ("message_delta", {"type": "message_delta",
                       "delta": {"stop_reason": "end_turn", "stop_sequence": None},
                       "usage": {"output_tokens": 15}}),
    ("message_stop", {"type": "message_stop"}),
]  # fmt: skip
ANTHROPIC_STREAM = sse(*ANTHROPIC_EVENTS)


def test_samples_are_valid_sdk_objects() -> None:
    """The samples below are shaped like the real wire: the SDK models accept them."""
    for chunk in (CHAT_ROLE, CHAT_TEXT, CHAT_TOOL, CHAT_REFUSAL, CHAT_FINISH, CHAT_USAGE_CHUNK):
        ChatCompletionChunk.model_validate(chunk)
    adapter: pydantic.TypeAdapter[Any] = pydantic.TypeAdapter(ResponseStreamEvent)
    for _, payload in responses_stream("Hello"):
        adapter.validate_python(payload)
    anthropic_adapter: pydantic.TypeAdapter[Any] = pydantic.TypeAdapter(RawMessageStreamEvent)
    for name, payload in ANTHROPIC_EVENTS:
        if name != "ping":
            anthropic_adapter.validate_python(payload)


# -- route ------------------------------------------------------------------

ANTHROPIC_HEADERS = {"x-api-key": "sk-ant-x", "anthropic-version": "2023-06-01"}
ANTHROPIC_ROUTE = Route(Protocol.ANTHROPIC, "anthropic")


@pytest.mark.parametrize(
    ("method", "path", "headers", "expected"),
    [
        ("POST", "/v1/chat/completions", {}, Route(Protocol.CHAT, "openai")),
        ("post", "/v1/chat/completions", {}, Route(Protocol.CHAT, "openai")),
        ("POST", "/v1/responses", {}, Route(Protocol.RESPONSES, "openai")),
        ("POST", "/v1/messages", ANTHROPIC_HEADERS, Route(Protocol.MESSAGES, "anthropic")),
        ("POST", "/v1/messages?beta=true", {}, Route(Protocol.MESSAGES, "anthropic")),
        ("POST", "/v1/messages/count_tokens", {}, Route(Protocol.COUNT_TOKENS, "anthropic")),
        ("POST", "/v1/messages/count_tokens?beta=1", {}, Route(Protocol.COUNT_TOKENS, "anthropic")),
        ("GET", "/v1/chat/completions", {}, Route(Protocol.OPENAI, "openai")),
        ("GET", "/v1/messages", {}, Route(Protocol.ANTHROPIC, "anthropic")),
        ("GET", "/v1/responses/resp_123", {}, Route(Protocol.OPENAI, "openai")),
        ("POST", "/v1/responses/resp_123/cancel", {}, Route(Protocol.OPENAI, "openai")),
        ("POST", "/v1/messages/batches", {}, Route(Protocol.ANTHROPIC, "anthropic")),
        ("GET", "/v1/models", {}, Route(Protocol.OPENAI, "openai")),
        ("GET", "/v1/models", {"Authorization": "Bearer sk"}, Route(Protocol.OPENAI, "openai")),
        ("GET", "/v1/models", {"anthropic-version": "2023-06-01"}, ANTHROPIC_ROUTE),
        ("GET", "/v1/models", {"X-Api-Key": "sk-ant"}, Route(Protocol.ANTHROPIC, "anthropic")),
        ("GET", "/v1/models", {"x-api-key": ""}, Route(Protocol.OPENAI, "openai")),
        ("POST", "/v1/embeddings", {}, Route(Protocol.OPENAI, "openai")),
        ("POST", "/v1/chat/completions/", {}, Route(Protocol.OPENAI, "openai")),
        ("GET", "/health", {}, None),
        ("GET", "/v1", {}, None),
        ("POST", "/v2/chat/completions", {}, None),
        ("GET", "/v1/../admin/shutdown", {}, None),
        ("GET", "/v1/%2E%2E/admin", {}, None),
    ],
)  # fmt: skip
def test_route(method: str, path: str, headers: Mapping[str, str], expected: Route | None) -> None:
    assert route(method, path, headers) == expected


def test_protocol_values_are_stable() -> None:
    assert [p.value for p in Protocol] == [
        "openai-chat",
        "openai-responses",
        "anthropic-messages",
        "anthropic-count-tokens",
        "openai",
        "anthropic",
    ]
    assert {p for p in Protocol if p.is_exchange} == {
        Protocol.CHAT,
        Protocol.RESPONSES,
        Protocol.MESSAGES,
        Protocol.COUNT_TOKENS,
    }


# -- error_body, proven through the SDKs -------------------------------------

MESSAGE = 'request body too large: limit is 32 MiB "quoted"\nsecond line, ünïcode'


@pytest.mark.parametrize(
    ("status", "exc", "kind"),
    [
        (400, openai.BadRequestError, "invalid_request_error"),
        (401, openai.AuthenticationError, "authentication_error"),
        (403, openai.PermissionDeniedError, "permission_error"),
        (404, openai.NotFoundError, "not_found_error"),
        (408, openai.APIStatusError, "invalid_request_error"),
        (413, openai.APIStatusError, "invalid_request_error"),
        (415, openai.APIStatusError, "invalid_request_error"),
        (429, openai.RateLimitError, "rate_limit_error"),
        (500, openai.InternalServerError, "server_error"),
        (503, openai.InternalServerError, "server_error"),
    ],
)
@pytest.mark.parametrize("protocol", [Protocol.CHAT, Protocol.RESPONSES, Protocol.OPENAI])
def test_openai_error_body_through_sdk(
    protocol: Protocol, status: int, exc: type[openai.APIStatusError], kind: str
) -> None:
    body = error_body(protocol, status, MESSAGE, code="request_too_large")
    client = openai_client(serve(status, body, "application/json"))
    with pytest.raises(openai.APIStatusError) as info:
        client.chat.completions.create(model="m", messages=[{"role": "user", "content": "x"}])
    err = info.value
    assert type(err) is exc
    assert err.status_code == status
    assert err.type == kind
    assert err.code == "request_too_large"
    assert err.param is None
    assert MESSAGE in err.message
    assert json.loads(body) == {
        "error": {"message": MESSAGE, "type": kind, "param": None, "code": "request_too_large"}
    }


def test_openai_error_body_code_defaults_to_null() -> None:
    body = json.loads(error_body(Protocol.CHAT, 400, "bad"))
    assert body["error"]["code"] is None


@pytest.mark.parametrize(
    ("status", "exc", "kind"),
    [
        (400, anthropic.BadRequestError, "invalid_request_error"),
        (401, anthropic.AuthenticationError, "authentication_error"),
        (402, anthropic.APIStatusError, "billing_error"),
        (403, anthropic.PermissionDeniedError, "permission_error"),
        (404, anthropic.NotFoundError, "not_found_error"),
        (408, anthropic.APIStatusError, "invalid_request_error"),
        (413, anthropic.APIStatusError, "request_too_large"),
        (429, anthropic.RateLimitError, "rate_limit_error"),
        (500, anthropic.InternalServerError, "api_error"),
        (503, anthropic.InternalServerError, "api_error"),
        (504, anthropic.InternalServerError, "timeout_error"),
        (529, anthropic.OverloadedError, "overloaded_error"),
    ],
)
@pytest.mark.parametrize("protocol", [Protocol.MESSAGES, Protocol.COUNT_TOKENS, Protocol.ANTHROPIC])
def test_anthropic_error_body_through_sdk(
    protocol: Protocol, status: int, exc: type[anthropic.APIStatusError], kind: str
) -> None:
    body = error_body(protocol, status, MESSAGE, code="ignored")
    client = anthropic_client(serve(status, body, "application/json"))
    with pytest.raises(anthropic.APIStatusError) as info:
        client.messages.create(
            model="claude-sonnet-4-6", max_tokens=8, messages=[{"role": "user", "content": "x"}]
        )
    err = info.value
    assert isinstance(err, exc)
    assert err.status_code == status
    expected = {"type": "error", "error": {"type": kind, "message": MESSAGE}}
    assert err.body == expected
    assert json.loads(body) == expected
    if kind != "request_too_large":  # documented by Anthropic, not in the SDK's ErrorType
        ErrorResponse.model_validate(expected)


# -- inband_error, proven through the SDKs -----------------------------------

STREAM_DIED = "upstream closed the stream before it completed"


@pytest.mark.parametrize("protocol", list(Protocol))
def test_inband_error_is_one_complete_terminal_event(protocol: Protocol) -> None:
    raw = inband_error(protocol, STREAM_DIED)
    assert raw.endswith(b"\n\n")
    framer = SSEFramer()
    (event,) = framer.feed(raw)
    assert (event.start, event.end) == (0, len(raw))
    assert framer.pending_bytes == 0
    assert is_terminal_event(protocol, event)
    assert not is_output_event(protocol, event)
    assert not is_overflow_event(protocol, event)


def test_chat_inband_error_raises_in_openai_sdk() -> None:
    stream = sse((None, CHAT_ROLE), (None, CHAT_TEXT)) + inband_error(
        Protocol.CHAT, STREAM_DIED, code="upstream_stream_error"
    )
    client = openai_client(serve(200, stream, "text/event-stream"))
    received: list[str | None] = []
    with pytest.raises(openai.APIError) as info:
        for chunk in client.chat.completions.create(
            model="m", messages=[{"role": "user", "content": "x"}], stream=True
        ):
            received.append(chunk.choices[0].delta.content)
    assert received == ["", "Hello"]
    assert info.value.message == STREAM_DIED
    assert info.value.code == "upstream_stream_error"
    assert info.value.type == "server_error"


def test_responses_inband_error_is_sdk_error_event() -> None:
    events = responses_stream("Hi")[:5]
    stream = sse(*events) + inband_error(
        Protocol.RESPONSES, STREAM_DIED, code="upstream_stream_error", sequence_number=5
    )
    client = openai_client(serve(200, stream, "text/event-stream"))
    received = list(client.responses.create(model="gpt-4.1", input="x", stream=True))
    assert [e.type for e in received] == [name for name, _ in events] + ["error"]
    last = received[-1]
    assert isinstance(last, ResponseErrorEvent)
    assert (last.code, last.message, last.param, last.sequence_number) == (
        "upstream_stream_error",
        STREAM_DIED,
        None,
        5,
    )
    (framed,) = frame(inband_error(Protocol.RESPONSES, STREAM_DIED))
    ResponseErrorEvent.model_validate_json(framed.data)  # strict shape check


@pytest.mark.parametrize("protocol", [Protocol.MESSAGES, Protocol.ANTHROPIC])
def test_anthropic_inband_error_raises_in_anthropic_sdk(protocol: Protocol) -> None:
    stream = sse(*ANTHROPIC_EVENTS[:4]) + inband_error(protocol, STREAM_DIED)
    client = anthropic_client(serve(200, stream, "text/event-stream"))
    received: list[str] = []
    with pytest.raises(anthropic.APIStatusError) as info:
        for event in client.messages.create(
            model="claude-sonnet-4-6",
            max_tokens=8,
            messages=[{"role": "user", "content": "x"}],
            stream=True,
        ):
            received.append(event.type)
    assert received == ["message_start", "content_block_start", "content_block_delta"]
    assert info.value.body == {
        "type": "error",
        "error": {"type": "api_error", "message": STREAM_DIED},
    }


# -- overflow -----------------------------------------------------------------


def jbody(obj: object) -> bytes:
    return json.dumps(obj).encode()


VLLM_OLD = (
    "This model's maximum context length is 32768 tokens. However, you requested 33000 tokens "
    "(32000 in the messages, 1000 in the completion). Please reduce the length of the messages "
    "or completion."
)

OVERFLOW_CASES: list[tuple[str, Protocol, int, str | None, bytes, bool]] = [
    ("openai chat", Protocol.CHAT, 400, "application/json", jbody({"error": {
        "message": "This model's maximum context length is 128000 tokens. However, your messages "
        "resulted in 130532 tokens. Please reduce the length of the messages.",
        "type": "invalid_request_error", "param": "messages", "code": "context_length_exceeded"}}),
     True),
    ("openai responses", Protocol.RESPONSES, 400, "application/json", jbody({"error": {
        "message": "Your input exceeds the context window of this model. Please adjust your input "
        "and try again.", "type": "invalid_request_error", "param": "input",
        "code": "context_length_exceeded"}}), True),
    ("openai code only", Protocol.CHAT, 400, "application/json; charset=utf-8", jbody({"error": {
        "message": "Too long.", "type": "invalid_request_error", "param": None,
        "code": "context_length_exceeded"}}), True),
    ("anthropic prompt too long", Protocol.MESSAGES, 400, "application/json", jbody({
        "type": "error", "error": {"type": "invalid_request_error",
                                   "message": "prompt is too long: 208310 tokens > 200000 maximum"},
        "request_id": "req_011CSHoEeqs5C35K2UUqR7Fy"}), True),
    ("anthropic request_too_large is bytes", Protocol.MESSAGES, 413, "application/json", jbody({
        "type": "error", "error": {
            "type": "request_too_large",
            "message": "Request exceeds the maximum allowed number of bytes."}}),
     False),
    ("anthropic other 400", Protocol.MESSAGES, 400, "application/json", jbody({
        "type": "error", "error": {"type": "invalid_request_error",
                                   "message": "max_tokens: Field required"}}), False),
    ("vllm old top-level", Protocol.CHAT, 400, "application/json", jbody({
        "object": "error", "message": VLLM_OLD, "type": "BadRequestError", "param": None,
        "code": 400}), True),
    ("vllm nested", Protocol.CHAT, 400, "application/json", jbody({"error": {
        "message": VLLM_OLD, "type": "BadRequestError", "param": None, "code": 400}}), True),
    ("vllm v1 decoder prompt", Protocol.CHAT, 400, "application/json", jbody({"error": {
        "message": "The decoder prompt (length 40000) is longer than the maximum model length of "
        "32768. Make sure that `max_model_len` is no smaller than the number of text tokens.",
        "type": "BadRequestError", "param": None, "code": 400}}), True),
    ("vllm encoder prompt is not history", Protocol.CHAT, 400, "application/json", jbody({"error": {
        "message": "The encoder prompt (length 9000) is longer than the maximum model length "
        "of 8192.",
        "type": "BadRequestError", "param": None, "code": 400}}), False),
    ("vllm max_tokens alone too large", Protocol.CHAT, 400, "application/json", jbody({"error": {
        "message": "'max_tokens' or 'max_completion_tokens' is too large: 40000. This model's "
        "maximum context length is 32768 tokens and your request has 120 input tokens "
        "(40000 > 32768 - 120).", "type": "BadRequestError", "param": None, "code": 400}}), False),
    ("vllm max_tokens plus long input", Protocol.CHAT, 400, "application/json", jbody({"error": {
        "message": "'max_tokens' or 'max_completion_tokens' is too large: 8000. This model's "
        "maximum context length is 32768 tokens and your request has 30000 input tokens "
        "(8000 > 32768 - 30000).", "type": "BadRequestError", "param": None, "code": 400}}), True),
    ("sglang input longer", Protocol.CHAT, 400, "application/json", jbody({
        "object": "error", "message": "The input (400013 tokens) is longer than the model's "
        "context length (262144 tokens).", "type": "BadRequestError", "param": None, "code": 400}),
     True),
    ("sglang requested count", Protocol.RESPONSES, 400, "application/json", jbody({"error": {
        "message": "Requested token count exceeds the model's maximum context length of 131072 "
        "tokens.", "type": "BadRequestError", "code": 400}}), True),
    ("plain text vllm", Protocol.CHAT, 400, "text/plain", VLLM_OLD.encode(), True),
    ("plain text bedrock", Protocol.MESSAGES, 400, "text/plain",
     b"Input is too long for requested model.", True),
    ("plain text llama.cpp", Protocol.CHAT, 400, None,
     b"the request exceeds the available context size, try increasing it", True),
    ("fastapi detail 422", Protocol.CHAT, 422, "application/json",
     jbody({"detail": "prompt is too long"}), True),
    ("json string", Protocol.CHAT, 400, "application/json", b'"prompt is too long"', True),
    ("plain bad request", Protocol.CHAT, 400, "text/plain", b"Bad Request", False),
    ("openai invalid model", Protocol.CHAT, 400, "application/json", jbody({"error": {
        "message": "Invalid value for 'model'", "type": "invalid_request_error", "param": "model",
        "code": "invalid_value"}}), False),
    ("rate limit is never overflow", Protocol.CHAT, 429, "application/json", jbody({"error": {
        "message": "Request too large for gpt-4o on tokens per min (TPM): Limit 30000, Requested "
        "50000. This model's maximum context length is 128000 tokens.",
        "type": "tokens", "param": None, "code": "rate_limit_exceeded"}}), False),
    ("5xx is never overflow", Protocol.CHAT, 500, "text/plain", VLLM_OLD.encode(), False),
    ("auth", Protocol.MESSAGES, 401, "application/json", jbody({
        "type": "error",
        "error": {"type": "authentication_error", "message": "invalid x-api-key"}}),
     False),
    ("nginx 413 html", Protocol.CHAT, 413, "text/html",
     b"<html><head><title>413 Request Entity Too Large</title></head></html>", False),
    ("empty", Protocol.CHAT, 400, "application/json", b"", False),
]  # fmt: skip


@pytest.mark.parametrize(
    ("protocol", "status", "content_type", "body", "expected"),
    [case[1:] for case in OVERFLOW_CASES],
    ids=[case[0] for case in OVERFLOW_CASES],
)
def test_is_overflow_response(
    protocol: Protocol, status: int, content_type: str | None, body: bytes, expected: bool
) -> None:
    assert is_overflow_response(protocol, status, content_type, body) is expected


GARBAGE = [
    b"\xff\xfe\x00",
    b"{",
    b"[" * 100_000,
    b'{"error": ' * 50_000,
    b"null",
    b"[1, 2, 3]",
    b'{"error": [1, 2, {"message": 5}]}',
    b'{"error": {"message": {"nested": true}, "code": 7}}',
    b'{"detail": [{"msg": null}]}',
    b'{"error": "\xff"}',
    b"\x00" * 100_000,
]


@pytest.mark.parametrize("protocol", list(Protocol))
def test_overflow_classifier_never_raises_on_garbage(protocol: Protocol) -> None:
    rng = random.Random(1234)
    bodies = GARBAGE + [rng.randbytes(rng.randrange(0, 2048)) for _ in range(200)]
    for body in bodies:
        for content_type in ("application/json", "text/plain", None):
            assert is_overflow_response(protocol, 400, content_type, body) is False


def test_overflow_looks_at_head_of_huge_body_only() -> None:
    body = b"x" * (1 << 20) + b" prompt is too long"
    assert not is_overflow_response(Protocol.MESSAGES, 400, "text/plain", body)
    assert is_overflow_response(Protocol.MESSAGES, 400, "text/plain", body[-40:])


@pytest.mark.parametrize(
    ("protocol", "event", "expected"),
    [
        (Protocol.RESPONSES, one(RESPONSES_FAILED_OVERFLOW, "response.failed"), True),
        (Protocol.RESPONSES, one(RESPONSES_FAILED_OVERFLOW), True),  # unnamed: data.type
        (Protocol.RESPONSES, one(RESPONSES_FAILED_SERVER, "response.failed"), False),
        (
            Protocol.RESPONSES,
            one({"type": "error", "code": "context_length_exceeded", "message": "Too long.",
                 "param": None, "sequence_number": 1}, "error"),
            True,
        ),
        (
            Protocol.RESPONSES,
            one({"type": "error", "code": "rate_limit_exceeded", "message": "Slow down.",
                 "param": None, "sequence_number": 1}, "error"),
            False,
        ),
        (Protocol.RESPONSES, frame(sse(*responses_stream("x")))[-1], False),
        (
            Protocol.CHAT,
            one({"error": {"message": VLLM_OLD, "type": "BadRequestError", "code": 400}}),
            True,
        ),
        (
            Protocol.CHAT,
            one({"error": {"message": "x", "type": "invalid_request_error",
                           "code": "context_length_exceeded"}}),
            True,
        ),
        (Protocol.CHAT, one({"error": {"message": "Internal error", "code": 500}}), False),
        (Protocol.CHAT, one(CHAT_TEXT), False),
        (Protocol.CHAT, one("[DONE]"), False),
        (
            Protocol.MESSAGES,
            one({"type": "error", "error": {
                "type": "invalid_request_error",
                "message": "prompt is too long: 210000 tokens > 200000 maximum"}}, "error"),
            True,
        ),
        (
            Protocol.MESSAGES,
            one({"type": "error", "error": {"type": "overloaded_error", "message": "Overloaded"}},
                "error"),
            False,
        ),
        (Protocol.MESSAGES, one(ANTHROPIC_MESSAGE_START, "message_start"), False),
    ],
)  # fmt: skip
def test_is_overflow_event(protocol: Protocol, event: SSEEvent, expected: bool) -> None:
    assert is_overflow_event(protocol, event) is expected


# -- output / terminal ----------------------------------------------------------


@pytest.mark.parametrize(
    ("payload", "expected"),
    [
        (CHAT_ROLE, False),
        (chat_chunk({"content": ""}), False),
        (chat_chunk({"content": None, "tool_calls": []}), False),
        (CHAT_TEXT, True),
        (CHAT_TOOL, True),
        (CHAT_REFUSAL, True),
        (CHAT_REASONING, True),
        (chat_chunk({"reasoning": "hmm"}), True),
        (CHAT_FINISH, False),
        (CHAT_USAGE_CHUNK, False),
        ("[DONE]", False),
        ("not json", False),
    ],
)
def test_chat_output_events(payload: JSON | str, expected: bool) -> None:
    assert is_output_event(Protocol.CHAT, one(payload)) is expected


def test_responses_output_events() -> None:
    events = frame(sse(*responses_stream("Hello")))
    assert [is_output_event(Protocol.RESPONSES, e) for e in events] == [
        False,  # created
        False,  # in_progress
        True,  # output_item.added
        True,  # content_part.added
        True,  # output_text.delta
        False,  # completed
    ]
    for name in (
        "response.function_call_arguments.delta",
        "response.reasoning_summary_text.delta",
        "response.reasoning_text.delta",
        "response.refusal.delta",
    ):
        assert is_output_event(Protocol.RESPONSES, one({"type": name}, name))
    assert not is_output_event(Protocol.RESPONSES, one({"type": "keepalive"}, "keepalive"))


def test_anthropic_output_events() -> None:
    events = frame(ANTHROPIC_STREAM)
    assert [(e.event, is_output_event(Protocol.MESSAGES, e)) for e in events] == [
        ("message_start", False),
        ("content_block_start", True),
        ("ping", False),
        ("content_block_delta", True),
        ("content_block_stop", True),
        ("message_delta", False),
        ("message_stop", False),
    ]


def test_terminal_events_per_protocol() -> None:
    chat = frame(CHAT_STREAM)
    assert [is_terminal_event(Protocol.CHAT, e) for e in chat] == [False] * 5 + [True]
    responses = frame(sse(*responses_stream("Hello")))
    assert [is_terminal_event(Protocol.RESPONSES, e) for e in responses] == [False] * 5 + [True]
    for name in ("response.incomplete", "response.failed", "error"):
        assert is_terminal_event(Protocol.RESPONSES, one({"type": name}, name))
    messages = frame(ANTHROPIC_STREAM)
    assert [is_terminal_event(Protocol.MESSAGES, e) for e in messages] == [False] * 6 + [True]
    assert is_terminal_event(
        Protocol.MESSAGES,
        one({"type": "error", "error": {"type": "overloaded_error", "message": "x"}}, "error"),
    )
    assert is_terminal_event(Protocol.CHAT, one({"error": {"message": "boom"}}))


def test_event_type_falls_back_to_data_type() -> None:
    assert event_type(one({"type": "message_stop"})) == "message_stop"
    assert event_type(one({"type": "message_stop"}, "other")) == "other"
    assert event_type(one("not json")) is None


# -- usage --------------------------------------------------------------------


def test_chat_usage_matches_sdk() -> None:
    client = openai_client(serve(200, CHAT_STREAM, "text/event-stream"))
    chunks = list(
        client.chat.completions.create(
            model="m", messages=[{"role": "user", "content": "x"}], stream=True
        )
    )
    sdk_usage = chunks[-1].usage
    assert sdk_usage is not None and sdk_usage.prompt_tokens_details is not None
    meter = meter_of(Protocol.CHAT, frame(CHAT_STREAM, chunk=7))
    assert (
        (meter.input_tokens, meter.output_tokens, meter.cache_read_tokens)
        == (
            sdk_usage.prompt_tokens,
            sdk_usage.completion_tokens,
            sdk_usage.prompt_tokens_details.cached_tokens,
        )
        == (1117, 46, 1024)
    )


def test_chat_without_usage_reports_none() -> None:
    stream = sse((None, CHAT_ROLE), (None, CHAT_TEXT), (None, CHAT_FINISH), (None, "[DONE]"))
    meter = meter_of(Protocol.CHAT, frame(stream))
    assert (meter.input_tokens, meter.output_tokens, meter.cache_read_tokens) == (None,) * 3


def test_chat_continuous_usage_last_wins() -> None:
    usage = [
        {"prompt_tokens": 10, "completion_tokens": n, "total_tokens": 10 + n} for n in (1, 2, 3)
    ]
    stream = sse(*[(None, chat_chunk({"content": "a"}, usage=u)) for u in usage])
    meter = meter_of(Protocol.CHAT, frame(stream))
    assert (meter.input_tokens, meter.output_tokens, meter.cache_read_tokens) == (10, 3, None)


def test_chat_three_megabyte_delta_costs_nothing_and_counts_as_output() -> None:
    big = chat_chunk({"content": "x" * 3_000_000})
    stream = sse((None, CHAT_ROLE), (None, big), (None, CHAT_USAGE_CHUNK), (None, "[DONE]"))
    framer = SSEFramer()
    events: list[SSEEvent] = []
    for i in range(0, len(stream), 1024):
        events += framer.feed(stream[i : i + 1024])
        assert framer.retained_bytes <= 1 << 20
    delta = events[1]
    assert len(events) == 4
    assert delta.truncated and delta.data_size > 3_000_000
    assert [is_output_event(Protocol.CHAT, e) for e in events] == [False, True, False, False]
    meter = meter_of(Protocol.CHAT, events)
    assert (meter.input_tokens, meter.output_tokens) == (1117, 46)


def test_chat_usage_from_body() -> None:
    body = {
        "id": "chatcmpl-1",
        "object": "chat.completion",
        "created": 1733000000,
        "model": "gpt-4o",
        "choices": [
            {
                "index": 0,
                "message": {"role": "assistant", "content": "Hi", "refusal": None},
                "logprobs": None,
                "finish_reason": "stop",
            }
        ],
        "usage": CHAT_USAGE,
    }
    ChatCompletion.model_validate(body)
    meter = UsageMeter(Protocol.CHAT)
    meter.feed_json(jbody(body))
    assert (meter.input_tokens, meter.output_tokens, meter.cache_read_tokens) == (1117, 46, 1024)


def test_responses_usage_matches_sdk_even_when_completed_event_is_large() -> None:
    text = "y" * 200_000  # response.completed embeds the whole output: > 64 KiB
    stream = sse(*responses_stream(text))
    client = openai_client(serve(200, stream, "text/event-stream"))
    final = list(client.responses.create(model="gpt-4.1", input="x", stream=True))[-1]
    assert final.type == "response.completed"
    sdk_usage = final.response.usage
    assert sdk_usage is not None
    events = frame(stream)
    assert events[-1].data_size > 64 * 1024
    meter = meter_of(Protocol.RESPONSES, events)
    assert (
        (meter.input_tokens, meter.output_tokens, meter.cache_read_tokens)
        == (
            sdk_usage.input_tokens,
            sdk_usage.output_tokens,
            sdk_usage.input_tokens_details.cached_tokens,
        )
        == (36, 87, 12)
    )


def test_responses_incomplete_usage_and_body() -> None:
    incomplete = {
        "type": "response.incomplete",
        "sequence_number": 9,
        "response": response_obj(
            "incomplete",
            [],
            {**RESPONSES_USAGE, "output_tokens": 4096},
            incomplete_details={"reason": "max_output_tokens"},
        ),
    }
    meter = meter_of(Protocol.RESPONSES, [one(incomplete, "response.incomplete")])
    assert (meter.input_tokens, meter.output_tokens) == (36, 4096)
    body = response_obj("completed", [message_item("Hi")], RESPONSES_USAGE)
    Response.model_validate(body)
    meter = UsageMeter(Protocol.RESPONSES)
    meter.feed_json(jbody(body))
    assert (meter.input_tokens, meter.output_tokens, meter.cache_read_tokens) == (36, 87, 12)


def test_responses_ignores_usage_shaped_data_in_other_events() -> None:
    fake = {"type": "response.output_text.delta", "response": {"usage": RESPONSES_USAGE}}
    meter = meter_of(Protocol.RESPONSES, [one(fake, "response.output_text.delta")])
    assert meter.input_tokens is None


def test_anthropic_usage_matches_sdk_and_normalizes_input() -> None:
    client = anthropic_client(serve(200, ANTHROPIC_STREAM, "text/event-stream"))
    sdk_events = list(
        client.messages.create(
            model="claude-sonnet-4-6",
            max_tokens=64,
            messages=[{"role": "user", "content": "x"}],
            stream=True,
        )
    )
    start = sdk_events[0]
    delta = sdk_events[-2]
    assert start.type == "message_start" and delta.type == "message_delta"
    meter = meter_of(Protocol.MESSAGES, frame(ANTHROPIC_STREAM, chunk=5))
    # Anthropic's input_tokens excludes cached tokens; the meter reports the whole prompt.
    usage = start.message.usage
    assert meter.input_tokens == usage.input_tokens + (usage.cache_read_input_tokens or 0) + (
        usage.cache_creation_input_tokens or 0
    )
    assert meter.input_tokens == 2125
    assert meter.cache_read_tokens == 2000
    assert meter.output_tokens == delta.usage.output_tokens == 15


def test_anthropic_cache_writes_and_their_lifetime_split_are_metered() -> None:
    """Cache writes are billed apart from reads (1.25x for 5 minutes, 2x for 1 hour):
    the meter keeps ``cache_creation_input_tokens`` and its ``cache_creation`` split
    as the SDK reads them."""
    start = {
        **ANTHROPIC_MESSAGE_START,
        "message": {
            **ANTHROPIC_MESSAGE_START["message"],
            "usage": {
                "input_tokens": 25,
                "cache_creation_input_tokens": 1500,
                "cache_read_input_tokens": 4000,
                "cache_creation": {
                    "ephemeral_5m_input_tokens": 1000,
                    "ephemeral_1h_input_tokens": 500,
                },
                "output_tokens": 1,
            },
        },
    }
    stream = sse(
        ("message_start", start),
        ("message_delta", {"type": "message_delta", "delta": {"stop_reason": "end_turn"},
                           "usage": {"output_tokens": 9}}),
        ("message_stop", {"type": "message_stop"}),
    )  # fmt: skip
    client = anthropic_client(serve(200, stream, "text/event-stream"))
    events = list(
        client.messages.create(
            model="claude-sonnet-4-6",
            max_tokens=64,
            messages=[{"role": "user", "content": "x"}],
            stream=True,
        )
    )
    sdk = events[0]
    assert sdk.type == "message_start"
    split = sdk.message.usage.cache_creation
    assert split is not None
    meter = meter_of(Protocol.MESSAGES, frame(stream, chunk=7))
    assert meter.totals() == UsageReport(
        input_tokens=25 + 1500 + 4000,
        output_tokens=9,
        cache_read_tokens=sdk.message.usage.cache_read_input_tokens,
        cache_write_tokens=sdk.message.usage.cache_creation_input_tokens,
        cache_write_5m_tokens=split.ephemeral_5m_input_tokens,
        cache_write_1h_tokens=split.ephemeral_1h_input_tokens,
        response_model=sdk.message.model,
    )
    assert meter.cache_write_tokens == 1500


def test_openai_reports_no_cache_writes() -> None:
    meter = meter_of(Protocol.CHAT, [one(CHAT_USAGE_CHUNK)])
    totals = meter.totals()
    assert totals.cache_read_tokens == meter.cache_read_tokens
    assert (totals.cache_write_tokens, totals.cache_write_1h_tokens) == (None, None)


def test_anthropic_message_delta_cumulative_counts_win() -> None:
    stream = sse(
        ("message_start", ANTHROPIC_MESSAGE_START),
        ("message_delta", {"type": "message_delta", "delta": {"stop_reason": None},
                           "usage": {"output_tokens": 5}}),
        ("message_delta", {"type": "message_delta", "delta": {"stop_reason": "end_turn"},
                           "usage": {"input_tokens": 40, "cache_read_input_tokens": 2000,
                                     "output_tokens": 30}}),
    )  # fmt: skip
    meter = meter_of(Protocol.MESSAGES, frame(stream))
    assert (meter.input_tokens, meter.output_tokens, meter.cache_read_tokens) == (2140, 30, 2000)


def test_anthropic_usage_from_body_and_count_tokens_is_not_usage() -> None:
    body = {
        "id": "msg_1",
        "type": "message",
        "role": "assistant",
        "content": [{"type": "text", "text": "Hi"}],
        "model": "claude-sonnet-4-5",
        "stop_reason": "end_turn",
        "stop_sequence": None,
        "usage": {"input_tokens": 12, "output_tokens": 6, "cache_read_input_tokens": 0},
    }
    meter = UsageMeter(Protocol.MESSAGES)
    meter.feed_json(jbody(body))
    assert (meter.input_tokens, meter.output_tokens, meter.cache_read_tokens) == (12, 6, 0)
    counter = UsageMeter(Protocol.COUNT_TOKENS)
    counter.feed_json(b'{"input_tokens": 2095}')
    assert counter.input_tokens is None


@pytest.mark.parametrize("protocol", list(Protocol))
def test_usage_meter_never_raises_on_garbage(protocol: Protocol) -> None:
    meter = UsageMeter(protocol)
    for body in [*GARBAGE, b'{"usage": "lots"}', b'{"usage": {"prompt_tokens": [1]}}']:
        meter.feed_json(body)
        for event in frame(b"data: " + body.replace(b"\n", b"") + b"\n\n"):
            meter.feed_event(event)
    for name in ("message_start", "message_delta", "response.completed"):
        meter.feed_event(one('{"usage": {"input_tokens": "many"', name))
    assert (meter.input_tokens, meter.output_tokens, meter.cache_read_tokens) == (None,) * 3

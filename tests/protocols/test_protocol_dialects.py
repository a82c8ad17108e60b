"""The per-protocol dialect table: complete, and in agreement with what the code does (pure)."""

from __future__ import annotations

import json

import pytest

from proxy import _protocols as protocols
from proxy._protocols import DIALECTS, Protocol, UsageMeter, dialect
from proxy._session_ids import DEFAULT_SESSION_HEADERS
from proxy._sse import SSEEvent
from proxy._wire import compute_wire_metadata, digest_bytes

NAMED = (Protocol.RESPONSES, Protocol.MESSAGES, Protocol.COUNT_TOKENS, Protocol.ANTHROPIC)


def event(name: str | None, payload: object) -> SSEEvent:
    data = payload if isinstance(payload, bytes) else json.dumps(payload).encode()
    return SSEEvent(event=name, data=data, data_size=len(data), truncated=False, start=0, end=0)


def test_every_protocol_has_exactly_its_own_row() -> None:
    assert set(DIALECTS) == set(Protocol)
    for protocol, row in DIALECTS.items():
        assert row.protocol is protocol and dialect(protocol) is row
        assert row.family == protocol.upstream


@pytest.mark.parametrize("protocol", NAMED)
def test_named_terminal_events_are_exactly_the_listed_ones(protocol: Protocol) -> None:
    row = dialect(protocol)
    assert row.terminal_events and "error" in row.terminal_events
    for name in row.terminal_events:
        assert protocols.is_terminal_event(protocol, event(name, {"type": name}))
    for name in ("ping", "content_block_delta", "response.output_text.delta", "message_start"):
        assert not protocols.is_terminal_event(protocol, event(name, {"type": name}))


def test_chat_ends_on_done_or_an_error_chunk_not_on_a_name() -> None:
    assert dialect(Protocol.CHAT).terminal_events == frozenset()
    assert protocols.is_terminal_event(Protocol.CHAT, event(None, b"[DONE]"))
    assert protocols.is_terminal_event(Protocol.CHAT, event(None, {"error": {"message": "x"}}))
    assert not protocols.is_terminal_event(Protocol.CHAT, event("message_stop", {"choices": []}))


def test_in_band_errors_take_each_rows_shape() -> None:
    chat = protocols.inband_error(Protocol.CHAT, "gone", code="c", sequence_number=9)
    assert chat.startswith(b"data: {") and b'"code":"c"' in chat and b"sequence" not in chat
    responses = protocols.inband_error(Protocol.RESPONSES, "gone", code="c", sequence_number=9)
    assert responses.startswith(b"event: error\n") and b'"sequence_number":9' in responses
    anthropic = protocols.inband_error(Protocol.MESSAGES, "gone", code="c", sequence_number=9)
    assert b'"api_error"' in anthropic and b'"c"' not in anthropic
    for protocol in Protocol:
        raw = protocols.inband_error(protocol, "gone")
        assert raw.endswith(b"\n\n")


def test_session_headers_are_among_the_defaults_searched() -> None:
    for row in DIALECTS.values():
        assert set(row.session_headers) <= set(DEFAULT_SESSION_HEADERS)


@pytest.mark.parametrize("protocol", [p for p in Protocol if p.is_exchange])
def test_the_body_session_field_is_where_wire_finds_the_hint(protocol: Protocol) -> None:
    body = json.dumps(
        {
            "model": "m",
            "prompt_cache_key": "from-cache-key",
            "metadata": {"user_id": "from-user-id"},
            dialect(protocol).history_field: [{"role": "user", "content": "hi"}],
        }
    ).encode()
    meta = compute_wire_metadata(protocol, body, digest_bytes(body))
    expected = {
        "prompt_cache_key": "from-cache-key",
        "metadata.user_id": "from-user-id",
        None: None,
    }
    assert meta.session_hint == expected[dialect(protocol).session_body_field]
    assert meta.message_count == 1  # history_field is the field wire counts


def test_only_the_answering_protocols_are_metered() -> None:
    metered = {p for p, row in DIALECTS.items() if row.usage_from_event is not None}
    assert metered == {Protocol.CHAT, Protocol.RESPONSES, Protocol.MESSAGES}
    assert {p for p, row in DIALECTS.items() if row.input_excludes_cache} == {Protocol.MESSAGES}
    meter = UsageMeter(Protocol.COUNT_TOKENS)
    meter.feed_json(b'{"usage": {"input_tokens": 5, "output_tokens": 1}}')
    assert meter.input_tokens is None
    anthropic = UsageMeter(Protocol.MESSAGES)
    start = {
        "type": "message_start",
        "message": {"usage": {"input_tokens": 5, "cache_read_input_tokens": 100}},
    }
    anthropic.feed_event(event("message_start", start))
    assert anthropic.input_tokens == 105 and anthropic.cache_read_tokens == 100

"""The per-protocol dialect table: complete, and in agreement with what the code does (pure)."""

from __future__ import annotations

import json

import pytest

from proxy import _protocols as protocols
from proxy._protocols import DIALECTS, Protocol, UsageMeter, dialect
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


# Exchange protocol -> (the body field holding the history, the body's session hint);
# docs/design.md §7. Read by proxy._wire from the body's structure, not from the dialect.
BODY_FIELDS = {
    Protocol.CHAT: ("messages", None),
    Protocol.RESPONSES: ("input", "from-cache-key"),
    Protocol.MESSAGES: ("messages", "from-user-id"),
    Protocol.COUNT_TOKENS: ("messages", "from-user-id"),
}


def test_every_exchange_protocol_has_its_body_fields_listed() -> None:
    assert set(BODY_FIELDS) == {p for p in Protocol if p.is_exchange}


@pytest.mark.parametrize("protocol", sorted(BODY_FIELDS, key=lambda p: p.value))
def test_wire_reads_each_protocols_history_and_session_hint(protocol: Protocol) -> None:
    history, hint = BODY_FIELDS[protocol]
    body = json.dumps(
        {
            "model": "m",
            "prompt_cache_key": "from-cache-key",
            "metadata": {"user_id": "from-user-id"},
            history: [{"role": "user", "content": "hi"}],
        }
    ).encode()
    meta = compute_wire_metadata(protocol, body, digest_bytes(body))
    assert meta.session_hint == hint
    assert meta.message_count == 1


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

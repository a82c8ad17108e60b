"""Anthropic Messages wire shapes (pure).

References: Anthropic API docs, "Errors" (HTTP status to ``error.type``:
400 invalid_request_error, also used for unlisted 4xx; 401
authentication_error; 402 billing_error; 403 permission_error; 404
not_found_error; 413 request_too_large; 429 rate_limit_error; 500 api_error;
504 timeout_error; 529 overloaded_error) and "Streaming Messages" (event
sequence ``message_start``, ``content_block_start`` / ``_delta`` / ``_stop``,
``message_delta`` with cumulative ``usage``, ``message_stop``, ``ping``,
``error``). The ``anthropic`` SDK's stream decoder raises ``APIStatusError``
on an ``event: error``.
"""

from __future__ import annotations

from typing import Final

import msgspec

from .._sse import SSEEvent
from ._common import SMALL_EVENT, UsageReport, decode_typed, encode

__all__ = [
    "TERMINAL_EVENTS",
    "USAGE_EVENTS",
    "error_body",
    "error_code",
    "error_type",
    "inband_error",
    "is_output",
    "usage_from_body",
    "usage_from_event",
]

_ERROR_TYPES: Final = {
    400: "invalid_request_error",
    401: "authentication_error",
    402: "billing_error",
    403: "permission_error",
    404: "not_found_error",
    413: "request_too_large",
    429: "rate_limit_error",
    500: "api_error",
    504: "timeout_error",
    529: "overloaded_error",
}


def error_type(status: int) -> str:
    """Anthropic ``error.type`` for an HTTP status (table in the module docstring).

    Statuses the docs do not list: other 4xx ``invalid_request_error`` (as the
    docs say), other 5xx ``api_error``.
    """
    known = _ERROR_TYPES.get(status)
    if known is not None:
        return known
    return "api_error" if status >= 500 else "invalid_request_error"


def error_body(status: int, message: str) -> bytes:
    """``{"type": "error", "error": {"type", "message"}}`` as JSON bytes."""
    return encode({"type": "error", "error": {"type": error_type(status), "message": message}})


def inband_error(message: str) -> bytes:
    """``event: error`` with an ``api_error`` payload + blank line."""
    payload = {"type": "error", "error": {"type": "api_error", "message": message}}
    return b"event: error\ndata: " + encode(payload) + b"\n\n"


_OUTPUT_EVENTS: Final = frozenset(
    {"content_block_start", "content_block_delta", "content_block_stop"}
)
#: ``message_stop``, or ``error`` (the SDK raises on it and stops reading): end rule R1.
TERMINAL_EVENTS: Final = frozenset({"message_stop", "error"})
USAGE_EVENTS: Final = frozenset({"message_start", "message_delta"})


def is_output(kind: str | None) -> bool:
    """``content_block_start`` / ``_delta`` / ``_stop``: text, tool use or thinking."""
    return kind in _OUTPUT_EVENTS


class _CacheCreation(msgspec.Struct):
    ephemeral_5m_input_tokens: int | None = None
    ephemeral_1h_input_tokens: int | None = None


class _Usage(msgspec.Struct):
    input_tokens: int | None = None
    output_tokens: int | None = None
    cache_read_input_tokens: int | None = None
    cache_creation_input_tokens: int | None = None
    cache_creation: _CacheCreation | None = None


class _Message(msgspec.Struct):
    usage: _Usage | None = None
    model: str | None = None


class _ErrorObj(msgspec.Struct):
    type: str | None = None
    message: str | None = None


class _Event(msgspec.Struct):
    type: str | None = None
    message: _Message | None = None
    usage: _Usage | None = None
    error: _ErrorObj | None = None


_EVENT: Final = msgspec.json.Decoder(_Event, strict=False)
_MESSAGE: Final = msgspec.json.Decoder(_Message, strict=False)


def _report(usage: _Usage | None, model: str | None = None) -> UsageReport | None:
    if usage is None:
        return None
    split = usage.cache_creation
    return UsageReport(
        input_tokens=usage.input_tokens,
        output_tokens=usage.output_tokens,
        cache_read_tokens=usage.cache_read_input_tokens,
        cache_write_tokens=usage.cache_creation_input_tokens,
        cache_write_5m_tokens=None if split is None else split.ephemeral_5m_input_tokens,
        cache_write_1h_tokens=None if split is None else split.ephemeral_1h_input_tokens,
        response_model=model,
    )


def usage_from_event(event: SSEEvent, kind: str | None) -> UsageReport | None:
    """``message_start.message.usage`` or ``message_delta.usage`` (cumulative counts).

    Only small events are decoded; usage events are a few hundred bytes.
    """
    if kind not in USAGE_EVENTS or event.truncated or event.data_size > SMALL_EVENT:
        return None
    decoded = decode_typed(_EVENT, event.data)
    if decoded is None:
        return None
    if kind == "message_start":
        message = decoded.message
        return None if message is None else _report(message.usage, message.model)
    return _report(decoded.usage)


def usage_from_body(body: bytes) -> UsageReport | None:
    """Top-level ``usage`` of a non-streaming Messages body."""
    if b'"usage"' not in body:
        return None
    decoded = decode_typed(_MESSAGE, body)
    return None if decoded is None else _report(decoded.usage, decoded.model)


def error_code(event: SSEEvent, kind: str | None) -> tuple[str | None, str] | None:
    """``(error.type, error.message)`` of a small ``error`` event, else ``None``."""
    if kind != "error" or event.truncated or event.data_size > SMALL_EVENT:
        return None
    decoded = decode_typed(_EVENT, event.data)
    if decoded is None or decoded.error is None:
        return None
    return decoded.error.type, decoded.error.message or ""

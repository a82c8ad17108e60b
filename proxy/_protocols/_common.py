"""Types and helpers shared by the protocol modules (pure)."""

from __future__ import annotations

import enum
from typing import Final, Literal, NamedTuple, TypeVar

import msgspec

from .._sse import SSEEvent

__all__ = [
    "SMALL_EVENT",
    "Protocol",
    "Upstream",
    "UsageReport",
    "decode_any",
    "decode_typed",
    "encode",
    "event_type",
]

Upstream = Literal["openai", "anthropic"]

_T = TypeVar("_T")

# Events that carry usage, errors or lifecycle changes are tiny; a larger one is
# a content delta and is not worth a JSON decode.
SMALL_EVENT: Final = 64 * 1024


class Protocol(enum.StrEnum):
    """Which API an exchange speaks, decided from the request path.

    The string values are stable: plugins, metrics and records use them.
    """

    CHAT = "openai-chat"  # POST /v1/chat/completions
    RESPONSES = "openai-responses"  # POST /v1/responses
    MESSAGES = "anthropic-messages"  # POST /v1/messages
    COUNT_TOKENS = "anthropic-count-tokens"  # POST /v1/messages/count_tokens
    OPENAI = "openai"  # any other /v1/ path: forwarded verbatim to the OpenAI upstream
    ANTHROPIC = "anthropic"  # other Anthropic paths (e.g. /v1/messages/batches)

    @property
    def upstream(self) -> Upstream:
        """The upstream family that serves this protocol: ``"openai"`` or ``"anthropic"``."""
        return _UPSTREAM[self]

    @property
    def is_exchange(self) -> bool:
        """``True`` for the JSON-body protocols the proxy inspects (POST only).

        ``OPENAI`` and ``ANTHROPIC`` are verbatim passthroughs.
        """
        return self in _EXCHANGE


_UPSTREAM: Final[dict[Protocol, Upstream]] = {
    Protocol.CHAT: "openai",
    Protocol.RESPONSES: "openai",
    Protocol.OPENAI: "openai",
    Protocol.MESSAGES: "anthropic",
    Protocol.COUNT_TOKENS: "anthropic",
    Protocol.ANTHROPIC: "anthropic",
}
_EXCHANGE: Final = frozenset(
    {Protocol.CHAT, Protocol.RESPONSES, Protocol.MESSAGES, Protocol.COUNT_TOKENS}
)


class UsageReport(NamedTuple):
    """Token counts found in one event or body, as the upstream reported them.

    ``None`` means "not in this message". ``cache_read_tokens`` is Anthropic's
    ``cache_read_input_tokens`` or OpenAI's ``prompt_tokens_details`` /
    ``input_tokens_details.cached_tokens``. The cache writes are only reported by
    Anthropic: ``cache_write_tokens`` is ``cache_creation_input_tokens``, and
    ``cache_write_5m_tokens`` / ``cache_write_1h_tokens`` are its
    ``cache_creation.ephemeral_5m_input_tokens`` / ``ephemeral_1h_input_tokens``
    split by cache lifetime (written at 1.25x / 2x the input price; see
    https://docs.anthropic.com/en/docs/build-with-claude/prompt-caching).

    ``response_model`` is the ``model`` the answer names where its usage is
    (the chat chunk or body, the Responses ``response``, Anthropic's
    ``message``): the model that answered, which may differ from the one asked
    for (an alias resolved to a dated snapshot).

    The :class:`UsageMeter` also returns its totals in this shape, with
    ``input_tokens`` normalized to the whole prompt.
    """

    input_tokens: int | None = None
    output_tokens: int | None = None
    cache_read_tokens: int | None = None
    cache_write_tokens: int | None = None
    cache_write_5m_tokens: int | None = None
    cache_write_1h_tokens: int | None = None
    response_model: str | None = None


class _Typed(msgspec.Struct):
    type: str | None = None


_TYPED_DECODER: Final = msgspec.json.Decoder(_Typed, strict=False)
_ANY_DECODER: Final = msgspec.json.Decoder()
_ENCODER: Final = msgspec.json.Encoder()


def encode(obj: object) -> bytes:
    """Serialize ``obj`` (dicts, lists, str, int, None) as compact UTF-8 JSON.

    Dict key order is kept, so error bodies read in the familiar field order.
    """
    return _ENCODER.encode(obj)


def decode_any(data: bytes) -> object:
    """Decode JSON into Python objects; ``None`` when ``data`` is not valid JSON.

    Never raises. Call it only on bounded input (error bodies, small events).
    """
    try:
        return _ANY_DECODER.decode(data)
    except (msgspec.DecodeError, RecursionError):
        return None


def decode_typed(decoder: msgspec.json.Decoder[_T], data: bytes) -> _T | None:
    """Decode ``data`` with a typed msgspec decoder; ``None`` on any JSON or shape error.

    Never raises (deeply nested input raises ``RecursionError`` inside msgspec,
    which is caught too). Fields the target type does not declare are skipped
    without building objects, so this is cheap even on large payloads.
    """
    try:
        return decoder.decode(data)
    except (msgspec.DecodeError, RecursionError):
        return None


def event_type(event: SSEEvent) -> str | None:
    """The event's type: its ``event:`` field, else the ``type`` key of its JSON payload.

    Anthropic and the Responses API name every event and repeat the name as
    ``data.type``; OpenAI-compatible servers sometimes omit the ``event:``
    line, hence the fallback (a typed decode that reads only ``type``).
    Returns ``None`` when neither is available, e.g. for a truncated event.
    """
    if event.event is not None:
        return event.event
    if event.truncated or not event.data:
        return None
    typed = decode_typed(_TYPED_DECODER, event.data)
    return None if typed is None else typed.type

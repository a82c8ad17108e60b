"""OpenAI wire shapes: chat completions and Responses (pure).

References: the OpenAI API reference (error object, chat completion chunk,
Responses streaming events) and the ``openai`` Python SDK, whose stream decoder
(``openai/_streaming.py``) raises ``APIError`` on a chat ``data:`` payload with
an ``error`` key and whose ``ResponseErrorEvent`` type defines the Responses
``error`` event.
"""

from __future__ import annotations

from typing import Final

import msgspec

from .._sse import SSEEvent
from ._common import SMALL_EVENT, UsageReport, decode_typed, encode

__all__ = [
    "RESPONSES_TERMINAL",
    "RESPONSES_USAGE_EVENTS",
    "chat_error_code",
    "chat_inband_error",
    "chat_is_output",
    "chat_is_terminal",
    "chat_see",
    "chat_usage",
    "chat_usage_from_event",
    "error_body",
    "error_type",
    "responses_error_code",
    "responses_inband_error",
    "responses_is_output",
    "responses_sequence_number",
    "responses_usage_from_body",
    "responses_usage_from_event",
]

_ERROR_TYPES: Final = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    429: "rate_limit_error",
}


def error_type(status: int) -> str:
    """OpenAI ``error.type`` for an HTTP status.

    400/408/413/415/422 and other 4xx: ``invalid_request_error``; 401
    ``authentication_error``; 403 ``permission_error``; 404 ``not_found_error``;
    429 ``rate_limit_error``; 5xx ``server_error`` (the type OpenAI sends with
    its 500/503 answers).
    """
    known = _ERROR_TYPES.get(status)
    if known is not None:
        return known
    return "server_error" if status >= 500 else "invalid_request_error"


def error_body(status: int, message: str, code: str | None) -> bytes:
    """``{"error": {"message", "type", "param", "code"}}`` as JSON bytes."""
    return encode(
        {"error": {"message": message, "type": error_type(status), "param": None, "code": code}}
    )


def chat_inband_error(message: str, code: str) -> bytes:
    """``data: {"error": {...}}`` + blank line: the openai SDK raises ``APIError`` on it."""
    payload = {"error": {"message": message, "type": "server_error", "param": None, "code": code}}
    return b"data: " + encode(payload) + b"\n\n"


def responses_inband_error(message: str, code: str, sequence_number: int) -> bytes:
    """A Responses ``error`` event (SDK type ``ResponseErrorEvent``) + blank line."""
    payload = {
        "type": "error",
        "code": code,
        "message": message,
        "param": None,
        "sequence_number": sequence_number,
    }
    return b"event: error\ndata: " + encode(payload) + b"\n\n"


# -- chat completions -------------------------------------------------------


_ABSENT: Final = msgspec.Raw()


class _Delta(msgspec.Struct):
    # Raw: the emptiness test needs no decoded string (a delta may be megabytes),
    # and any JSON type is accepted. An absent field stays an empty Raw.
    content: msgspec.Raw = _ABSENT
    tool_calls: msgspec.Raw = _ABSENT
    function_call: msgspec.Raw = _ABSENT
    refusal: msgspec.Raw = _ABSENT
    reasoning_content: msgspec.Raw = _ABSENT  # vLLM, DeepSeek
    reasoning: msgspec.Raw = _ABSENT  # vLLM >= 0.10, OpenRouter


class _Choice(msgspec.Struct):
    delta: _Delta | None = None


class _ErrorObj(msgspec.Struct):
    code: str | int | None = None
    message: str | None = None


class _PromptDetails(msgspec.Struct):
    cached_tokens: int | None = None


class _ChatUsage(msgspec.Struct):
    prompt_tokens: int | None = None
    completion_tokens: int | None = None
    prompt_tokens_details: _PromptDetails | None = None


class _ChatChunk(msgspec.Struct):
    choices: list[_Choice] | None = None
    usage: _ChatUsage | None = None
    error: _ErrorObj | str | None = None


_CHUNK: Final = msgspec.json.Decoder(_ChatChunk, strict=False)


class _Named(msgspec.Struct):
    model: str | None = None


# The answer's model, read apart from the chunk: only the (rare) chunks with a usage
# pay for it, not every content delta.
_NAMED: Final = msgspec.json.Decoder(_Named, strict=False)
# The values an absent or empty delta field can take (an absent field is an empty Raw).
_EMPTY_RAW: Final = frozenset({b"", b"null", b'""', b"[]", b"{}"})
# Chat's end-of-stream sentinel, matched as a prefix as the openai SDK does
# (``sse.data.startswith("[DONE]")`` in ``openai/_streaming.py``).
_DONE: Final = b"[DONE]"
_ERROR_KEY: Final = b'"error"'


def chat_is_output(event: SSEEvent) -> bool:
    """A chat chunk whose ``choices[].delta`` carries content, tool calls, refusal or reasoning.

    An event too large to keep (``truncated``) is taken as output: only
    content deltas grow that large.
    """
    if event.truncated:
        return True
    data = event.data
    if not data or data.startswith(_DONE):
        return False
    chunk = decode_typed(_CHUNK, data)
    return chunk is not None and _has_output(chunk.choices)


def _has_output(choices: list[_Choice] | None) -> bool:
    """Whether a decoded chunk's ``choices`` carry output (see :func:`chat_is_output`)."""
    if not choices:
        return False
    for choice in choices:
        delta = choice.delta
        if delta is None:
            continue
        content = delta.content  # the usual output first: no tuple of the six for it
        if content and (len(content) > 4 or bytes(content) not in _EMPTY_RAW):
            return True
        for raw in (
            delta.tool_calls,
            delta.function_call,
            delta.refusal,
            delta.reasoning_content,
            delta.reasoning,
        ):
            # An absent field is an empty Raw, false at C speed (no len() call); only a
            # value of at most 4 bytes can be empty; len() of a Raw copies nothing.
            if raw and (len(raw) > 4 or bytes(raw) not in _EMPTY_RAW):
                return True
    return False


def chat_error_code(event: SSEEvent) -> tuple[str | None, str] | None:
    """``(code, message)`` of a small chat ``data: {"error": ...}`` chunk, else ``None``."""
    if event.truncated or event.data_size > SMALL_EVENT or _ERROR_KEY not in event.data:
        return None
    chunk = decode_typed(_CHUNK, event.data)
    if chunk is None or chunk.error is None:
        return None
    if isinstance(chunk.error, str):
        return None, chunk.error
    code = chunk.error.code
    return (code if isinstance(code, str) else None), chunk.error.message or ""


def chat_is_terminal(event: SSEEvent) -> bool:
    """``data: [DONE]``, or an error chunk (the SDK raises on it and stops reading).

    Runs on every chunk: a chunk without the bytes ``"error"`` is not passed to
    :func:`chat_error_code` (which would find no error in it either).
    """
    data = event.data
    return data.startswith(_DONE) or (_ERROR_KEY in data and chat_error_code(event) is not None)


_USAGE_KEY: Final = b'"usage"'


def chat_usage_from_event(event: SSEEvent) -> UsageReport | None:
    """Usage of a streamed chat chunk (:func:`chat_usage` of its data, up to 64 KiB).

    ``None`` for ``[DONE]`` and for a chunk the framer had to truncate.
    """
    data = event.data
    if event.truncated or data.startswith(_DONE):
        return None
    return chat_usage(data, limit=SMALL_EVENT)


def chat_usage(data: bytes, *, limit: int | None) -> UsageReport | None:
    """Usage of a chat chunk or a non-streaming chat completion body.

    ``usage.prompt_tokens``, ``usage.completion_tokens``,
    ``usage.prompt_tokens_details.cached_tokens``, and the payload's ``model``
    (decoded apart, only for a payload with a usage). ``None`` when the payload
    has no usage object, is larger than ``limit`` bytes, or is not valid JSON.
    A usage key spelled with an escape is not read: the bytes ``"usage"`` must
    be there too. They are looked for only once a usage was decoded: the typed
    decode skips what it does not need at C speed, faster than any search of
    the bytes (2-7 times faster than counting ``"usage":null``, 1.5 times than
    finding ``"usage"``), and most chunks say ``"usage":null``.
    """
    if limit is not None and len(data) > limit:
        return None
    try:
        usage = _CHUNK.decode(data).usage  # decode_typed, inlined: this runs on every chunk
    except (msgspec.DecodeError, RecursionError):
        return None
    if usage is None or _USAGE_KEY not in data:
        return None
    return _usage_report(usage, data)


def _usage_report(usage: _ChatUsage, data: bytes) -> UsageReport:
    """The report of a decoded ``usage`` of the payload ``data`` (its model decoded apart)."""
    details = usage.prompt_tokens_details
    named = decode_typed(_NAMED, data)
    return UsageReport(
        input_tokens=usage.prompt_tokens,
        output_tokens=usage.completion_tokens,
        cache_read_tokens=None if details is None else details.cached_tokens,
        response_model=None if named is None else named.model,
    )


# What chat_see says of most events, as shared tuples (none is built per event).
_NOTHING: Final = (None, False, False)
_OUTPUT: Final = (None, True, False)
_TERMINAL: Final = (None, False, True)


def chat_see(event: SSEEvent, output_seen: bool) -> tuple[UsageReport | None, bool, bool]:
    """``(chat_usage_from_event, chat_is_output, chat_is_terminal)`` of one event, at once.

    One decode of the chunk answers all three: decoding it once per question
    was most of the per-event cost of a chat stream. With ``output_seen`` the
    caller no longer asks whether the event is output, and the middle answer is
    ``False`` (the chunk's deltas are not looked at).
    """
    if event.truncated or event.data_size > SMALL_EVENT:
        # Rare (a large delta): the three answers as they are, each reading what it needs.
        output = not output_seen and chat_is_output(event)
        return chat_usage_from_event(event), output, chat_is_terminal(event)
    data = event.data  # whole: len(data) == data_size (SSEEvent), small enough for all three
    if data.startswith(_DONE):
        return _TERMINAL
    try:
        chunk = _CHUNK.decode(data)  # decode_typed, inlined: this runs on every chunk
    except (msgspec.DecodeError, RecursionError):
        return _NOTHING  # (b"" too): no usage, no output, no error in it
    output = not output_seen and _has_output(chunk.choices)
    # chat_is_terminal: an error chunk (chat_error_code finds an error in it).
    terminal = chunk.error is not None and _ERROR_KEY in data
    usage = chunk.usage
    if usage is not None and _USAGE_KEY in data:
        return _usage_report(usage, data), output, terminal
    if terminal:
        return None, output, True
    return _OUTPUT if output else _NOTHING


# -- Responses --------------------------------------------------------------

# Lifecycle events: they say where the response is, not what the model said.
_RESPONSES_LIFECYCLE: Final = frozenset(
    {
        "response.created",
        "response.in_progress",
        "response.queued",
        "response.completed",
        "response.incomplete",
        "response.failed",
    }
)
#: The events after which a Responses stream is over (end rule R1).
RESPONSES_TERMINAL: Final = frozenset(
    {"response.completed", "response.incomplete", "response.failed", "error"}
)
RESPONSES_USAGE_EVENTS: Final = frozenset(
    {"response.completed", "response.incomplete", "response.failed"}
)


def responses_is_output(kind: str | None) -> bool:
    """Any ``response.*`` event other than lifecycle ones: output items, content parts,
    text / refusal / function-call-argument / reasoning deltas, tool-call progress.

    Defined by exclusion so that event types added later count as output,
    which is the safe side (no fake-completion retry after output started).
    """
    return kind is not None and kind.startswith("response.") and kind not in _RESPONSES_LIFECYCLE


class _Sequenced(msgspec.Struct):
    sequence_number: int | None = None


_SEQUENCED: Final = msgspec.json.Decoder(_Sequenced, strict=False)


def responses_sequence_number(event: SSEEvent) -> int | None:
    """The event's top-level ``sequence_number``; ``None`` when absent or not decoded.

    Events over 64 KiB (content deltas) are not decoded: the caller counts them.
    """
    if event.truncated or event.data_size > SMALL_EVENT:
        return None
    # decode_typed, inlined: this runs on every Responses event.
    try:
        return _SEQUENCED.decode(event.data).sequence_number
    except (msgspec.DecodeError, RecursionError):
        return None


class _InputDetails(msgspec.Struct):
    cached_tokens: int | None = None


class _ResponsesUsage(msgspec.Struct):
    input_tokens: int | None = None
    output_tokens: int | None = None
    input_tokens_details: _InputDetails | None = None


class _ResponseObj(msgspec.Struct):
    usage: _ResponsesUsage | None = None
    model: str | None = None
    error: _ErrorObj | None = None


class _ResponsesEvent(msgspec.Struct):
    type: str | None = None
    response: _ResponseObj | None = None
    code: str | int | None = None
    message: str | None = None


_RESPONSES_EVENT: Final = msgspec.json.Decoder(_ResponsesEvent, strict=False)
_RESPONSE_OBJ: Final = msgspec.json.Decoder(_ResponseObj, strict=False)


def _responses_usage(response: _ResponseObj) -> UsageReport | None:
    usage = response.usage
    if usage is None:
        return None
    details = usage.input_tokens_details
    return UsageReport(
        input_tokens=usage.input_tokens,
        output_tokens=usage.output_tokens,
        cache_read_tokens=None if details is None else details.cached_tokens,
        response_model=response.model,
    )


def responses_usage_from_event(event: SSEEvent) -> UsageReport | None:
    """``response.usage`` of a ``response.completed`` / ``.incomplete`` / ``.failed`` event.

    These events embed the whole response object (output text, instructions,
    tool definitions), so they are decoded whatever their size, with a typed
    decoder that skips every field but ``usage``; an event the framer had to
    truncate has no usage to offer. Other named events are not decoded at all.
    """
    kind = event.event
    if event.truncated or (kind is not None and kind not in RESPONSES_USAGE_EVENTS):
        return None
    decoded = decode_typed(_RESPONSES_EVENT, event.data)
    if decoded is None or decoded.response is None:
        return None
    if kind is None and decoded.type not in RESPONSES_USAGE_EVENTS:
        return None  # an unnamed event: its data.type decides
    return _responses_usage(decoded.response)


def responses_usage_from_body(body: bytes) -> UsageReport | None:
    """Top-level ``usage`` of a non-streaming Responses body."""
    if b'"usage"' not in body:
        return None
    decoded = decode_typed(_RESPONSE_OBJ, body)
    return None if decoded is None else _responses_usage(decoded)


def responses_error_code(event: SSEEvent, kind: str | None) -> tuple[str | None, str] | None:
    """``(code, message)`` of a ``response.failed`` (``response.error``) or ``error`` event."""
    if event.truncated or kind not in ("response.failed", "error"):
        return None
    decoded = decode_typed(_RESPONSES_EVENT, event.data)
    if decoded is None:
        return None
    if kind == "error":
        code, message = decoded.code, decoded.message
    elif decoded.response is not None and decoded.response.error is not None:
        code, message = decoded.response.error.code, decoded.response.error.message
    else:
        return None
    return (code if isinstance(code, str) else None), message or ""

"""The three LLM wire protocols: routing, error shapes, overflow, usage (pure).

Everything here is a pure function of bytes and scalars (no I/O, no aiohttp):

* :func:`route` maps a request to a :class:`Protocol` and an upstream;
* :func:`error_body` / :func:`inband_error` build errors in the client's own
  shape, as a JSON body or as a final SSE event of a stream that died;
* :func:`is_overflow_response` / :func:`is_overflow_event` recognize a
  context-window overflow (answered by a refold at the next fold level);
* :func:`is_output_event` / :func:`is_terminal_event` classify SSE events;
* :class:`UsageMeter` reads token counts from usage events or bodies.

What differs between the protocols is data: one :class:`Dialect` per
protocol in :data:`DIALECTS` (``_dialects``); these functions look it up.

The string values of :class:`Protocol` are stable: plugins, metrics and
records use them. Protocol details live in ``_openai`` (chat completions and
Responses), ``_anthropic`` (Messages), ``_overflow`` (error wordings, shared
because OpenAI-compatible servers sit behind either route), ``_routing`` and
``_usage``; ``_common`` holds :class:`Protocol` and the JSON helpers.
"""

from __future__ import annotations

from .._sse import SSEEvent
from ._common import Protocol, Upstream, UsageReport, event_type
from ._dialects import DIALECTS, Dialect, dialect
from ._overflow import is_overflow_payload, message_says_overflow, stated_tokens
from ._routing import Route, route
from ._usage import UsageMeter

__all__ = [
    "DIALECTS",
    "STREAM_ERROR_CODE",
    "Dialect",
    "Protocol",
    "Route",
    "Upstream",
    "UsageMeter",
    "UsageReport",
    "dialect",
    "error_body",
    "event_type",
    "inband_error",
    "is_error_event",
    "is_output_event",
    "is_overflow_event",
    "is_overflow_response",
    "is_terminal_event",
    "message_says_overflow",
    "route",
    "sequence_number",
    "stated_tokens",
]

_CONTEXT_LENGTH_EXCEEDED = "context_length_exceeded"

#: The in-band error code of a stream the upstream broke (orderly stops carry their own).
STREAM_ERROR_CODE = "upstream_stream_error"


def error_body(protocol: Protocol, status: int, message: str, *, code: str | None = None) -> bytes:
    """A JSON error body in the shape the client's SDK parses.

    * OpenAI family (CHAT, RESPONSES, OPENAI):
      ``{"error": {"message", "type", "param": null, "code"}}``, ``type`` from
      the status (400/408/413/415/422 and other 4xx ``invalid_request_error``,
      401 ``authentication_error``, 403 ``permission_error``, 404
      ``not_found_error``, 429 ``rate_limit_error``, 5xx ``server_error``).
    * Anthropic family (MESSAGES, COUNT_TOKENS, ANTHROPIC):
      ``{"type": "error", "error": {"type", "message"}}``, ``type`` per
      Anthropic's error docs (413 ``request_too_large``, 504 ``timeout_error``,
      529 ``overloaded_error``, ...). This shape has no code: ``code`` is not
      sent, so put what the user must know into ``message``.

    Args:
        protocol: the client's protocol.
        status: the HTTP status the body will be sent with.
        message: human-readable text; must not contain secrets or request bodies.
        code: machine-readable code (OpenAI ``error.code``), or ``None``.

    Returns:
        UTF-8 JSON bytes; send with ``Content-Type: application/json``.
    """
    return DIALECTS[protocol].error_body(status, message, code)


def inband_error(
    protocol: Protocol,
    message: str,
    *,
    code: str = STREAM_ERROR_CODE,
    sequence_number: int = 0,
) -> bytes:
    """Complete SSE bytes (ending in a blank line) that the client's SDK raises as an error.

    For a stream that already sent its 200 headers and must end in failure
    (upstream died mid-way, proxy shutdown after the grace period):

    * CHAT (and OPENAI): ``data: {"error": {"message", "type": "server_error",
      "param": null, "code"}}`` — the ``openai`` SDK raises ``APIError`` on a
      data payload with an ``error`` key.
    * RESPONSES: ``event: error`` with ``{"type": "error", "code", "message",
      "param": null, "sequence_number"}`` — the SDK's ``ResponseErrorEvent``.
    * Anthropic family: ``event: error`` with ``{"type": "error", "error":
      {"type": "api_error", "message"}}`` — the ``anthropic`` SDK raises
      ``APIStatusError``. This shape has no code, so ``code`` is not sent.

    Args:
        protocol: the client's protocol.
        message: human-readable text; must not contain secrets or request bodies.
        code: machine-readable code (OpenAI family).
        sequence_number: the Responses event sequence number to use (one past
            the last one relayed, when known).

    Returns:
        UTF-8 SSE bytes to write after the last complete upstream event.
    """
    return DIALECTS[protocol].inband_error(message, code, sequence_number)


def is_overflow_response(
    protocol: Protocol, status: int, content_type: str | None, body: bytes
) -> bool:
    """Whether a non-2xx upstream answer is a context-window overflow.

    OpenAI 400 ``error.code == "context_length_exceeded"``; Anthropic 400
    ``invalid_request_error`` "prompt is too long..." (its 413
    ``request_too_large`` is a byte limit and is *not* an overflow); plain-text
    and non-standard JSON errors of vLLM, SGLang and other OpenAI-compatible
    servers (wordings and sources: ``proxy/_protocols/_overflow.py``). The rules
    are the same for every ``protocol``, since any OpenAI-compatible server may
    sit behind either route.

    Args:
        protocol: the exchange's protocol.
        status: upstream HTTP status.
        content_type: upstream ``Content-Type``, if any.
        body: the upstream body (only its first 64 KiB are looked at).

    Returns:
        ``True`` for an overflow. Never raises, whatever the bytes.
    """
    del protocol  # same rules for all; kept for a uniform per-protocol API
    return is_overflow_payload(status, content_type, body)


def _says_overflow(found: tuple[str | None, str] | None) -> bool:
    if found is None:
        return False
    code, message = found
    return code == _CONTEXT_LENGTH_EXCEEDED or message_says_overflow(message[:65536])


def is_overflow_event(protocol: Protocol, event: SSEEvent) -> bool:
    """Whether a streamed event reports a context-window overflow (inside a 200 stream).

    RESPONSES: ``response.failed`` whose ``response.error.code`` is
    ``context_length_exceeded`` (or whose message has an overflow wording), or
    an ``error`` event with that code. CHAT: a ``data: {"error": ...}`` chunk
    with that code or wording (OpenAI-compatible servers that fail after the
    headers). Anthropic: an ``error`` event whose message has an overflow
    wording ("prompt is too long"). Never raises.
    """
    return _says_overflow(DIALECTS[protocol].stream_error(event))


def is_error_event(protocol: Protocol, event: SSEEvent) -> bool:
    """Whether a streamed (terminal) event reports an error inside a 200 stream.

    RESPONSES: ``response.failed`` or ``error``; CHAT: a ``data: {"error": ...}``
    chunk; Anthropic: an ``error`` event. Never raises.
    """
    return DIALECTS[protocol].stream_error(event) is not None


def is_output_event(protocol: Protocol, event: SSEEvent) -> bool:
    """Whether the event carries model output (text, tool call, refusal, reasoning).

    The first such event is where output started: the release boundary, and
    the point after which a fake-completion retry is no longer possible.

    * CHAT: a chunk whose ``choices[].delta`` has non-empty ``content``,
      ``tool_calls``, ``function_call``, ``refusal``, ``reasoning_content`` or
      ``reasoning``.
    * RESPONSES: any ``response.*`` event but the lifecycle ones (``created``,
      ``in_progress``, ``queued``, ``completed``, ``incomplete``, ``failed``):
      ``response.output_item.added``, ``response.content_part.added``,
      ``response.output_text.delta``, ``response.function_call_arguments.delta``,
      ``response.reasoning_*``, ...
    * Anthropic: ``content_block_start`` / ``_delta`` / ``_stop``.

    An event too large for the framer to keep (``truncated``) and without an
    ``event:`` name counts as output: only output deltas grow that large.
    """
    return DIALECTS[protocol].is_output(event)


def is_terminal_event(protocol: Protocol, event: SSEEvent) -> bool:
    """Whether the client's SDK stops reading after this event.

    CHAT: ``data: [DONE]`` or an error chunk; RESPONSES:
    ``response.completed`` / ``.incomplete`` / ``.failed`` or ``error``;
    Anthropic: ``message_stop`` or ``error``. A stream that ends without one
    ended abnormally and deserves an :func:`inband_error`.
    """
    return DIALECTS[protocol].is_terminal(event)


def sequence_number(protocol: Protocol, event: SSEEvent) -> int | None:
    """The Responses event's ``sequence_number`` (``None`` for other protocols or when absent).

    The Responses stream numbers its events from 0; an in-band error the proxy
    appends carries the number after the last one relayed (OpenAI API reference,
    "Streaming events"). Events over 64 KiB are not decoded (``None``).
    """
    return DIALECTS[protocol].sequence_number(event)

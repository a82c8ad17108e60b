"""The per-protocol dialect table: what differs between the wire protocols, as data (pure).

docs/design.md §7. Each :class:`Protocol` has one :class:`Dialect` in
:data:`DIALECTS`: its error shapes, how its streams end and fail, where its
output starts, where its usage is. (Where a request's history and session hint
are is read by :mod:`proxy._wire`, from the body's structure.) The public functions of
:mod:`proxy._protocols` look the dialect up and call it, so adding a protocol is
adding a row here, not a branch in every function. The per-family wire details
(decoders, payload shapes, references) stay in ``_openai`` and ``_anthropic``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from types import MappingProxyType
from typing import Final

from .._sse import SSEEvent
from . import _anthropic, _openai
from ._common import Protocol, UsageReport, event_type

__all__ = ["DIALECTS", "Dialect", "dialect"]

#: What an in-stream error event says: (machine code or None, message), or None.
StreamError = tuple[str | None, str] | None


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class Dialect:
    """Everything protocol-specific about one :class:`Protocol`.

    Callables take bytes, scalars or an :class:`~proxy._sse.SSEEvent` and never
    raise on malformed input. Event names are SSE ``event:`` names (or the
    payload's ``type``).

    ``named_events`` and ``usage_events`` are pre-checks, not behaviour: they
    say when a per-event callable's answer is known without calling it, so the
    stream gate, which runs once per SSE event, can skip the call
    (``tests/gate/test_properties_gate.py`` checks each claim, and the one about
    ``stream_error``, against the callables on random events).

    Attributes:
        protocol: the protocol this row describes.
        error_body: ``(status, message, code) -> JSON bytes`` in the client's
            error shape (Anthropic's shape has no code; it is dropped).
        inband_error: ``(message, code, sequence_number) -> SSE bytes``: one
            complete error event the client's SDK raises (sequence number used
            by Responses only).
        stream_error: the error an in-stream event reports, for overflow
            classification. An event it reports on is always a terminal one
            (``is_terminal``), so only terminal events need asking.
        is_output: whether an event carries model output (the release
            boundary; no fake-completion retry after it).
        is_terminal: whether the client's SDK stops reading after the event
            (the end rule R1, docs/design.md §7).
        terminal_events: the named events that end a stream (empty for chat,
            whose end is ``data: [DONE]`` or an error chunk).
        named_events: pre-check; the protocol names its events: for an event
            with an ``event:`` name, ``is_terminal`` is the name's membership in
            ``terminal_events``, and ``usage_from_event`` reads nothing unless
            the name is in ``usage_events``.
        sequence_number: the event's ``sequence_number`` (Responses), else ``None``.
        usage_from_event / usage_from_body: token usage of a streamed event or
            a whole JSON answer; ``None`` for protocols that are not metered.
        usage_events: the named events that can carry usage (with
            ``named_events``; empty otherwise).
        input_excludes_cache: whether the reported input tokens leave out
            cached ones (Anthropic), so the meter adds them back.
        see: ``(event, output_seen) -> (usage, output, terminal)``, the answers
            of ``usage_from_event``, ``is_output`` (``False`` once
            ``output_seen``) and ``is_terminal`` at once, for a protocol whose
            events answer all three from one decode (chat); ``None``: ask each.
            Only on a metered row whose events are not named.
    """

    protocol: Protocol
    error_body: Callable[[int, str, str | None], bytes]
    inband_error: Callable[[str, str, int], bytes]
    stream_error: Callable[[SSEEvent], StreamError]
    is_output: Callable[[SSEEvent], bool]
    is_terminal: Callable[[SSEEvent], bool]
    terminal_events: frozenset[str]
    named_events: bool
    sequence_number: Callable[[SSEEvent], int | None]
    usage_from_event: Callable[[SSEEvent], UsageReport | None] | None
    usage_from_body: Callable[[bytes], UsageReport | None] | None
    usage_events: frozenset[str]
    input_excludes_cache: bool
    see: Callable[[SSEEvent, bool], tuple[UsageReport | None, bool, bool]] | None = None


# -- adapters: one signature per column ----------------------------------------


def _openai_error_body(status: int, message: str, code: str | None) -> bytes:
    return _openai.error_body(status, message, code)


def _anthropic_error_body(status: int, message: str, code: str | None) -> bytes:
    del code  # Anthropic's error shape has no code field
    return _anthropic.error_body(status, message)


def _chat_inband_error(message: str, code: str, sequence_number: int) -> bytes:
    del sequence_number  # chat chunks are not numbered
    return _openai.chat_inband_error(message, code)


def _anthropic_inband_error(message: str, code: str, sequence_number: int) -> bytes:
    del code, sequence_number  # neither exists in Anthropic's error event
    return _anthropic.inband_error(message)


def _responses_stream_error(event: SSEEvent) -> StreamError:
    return _openai.responses_error_code(event, event_type(event))


def _anthropic_stream_error(event: SSEEvent) -> StreamError:
    return _anthropic.error_code(event, event_type(event))


def _named_output(is_output_kind: Callable[[str | None], bool]) -> Callable[[SSEEvent], bool]:
    """``is_output`` of a protocol whose events are named.

    An event too large for the framer to keep (``truncated``) and without an
    ``event:`` name counts as output: only output deltas grow that large.
    """

    def is_output(event: SSEEvent) -> bool:
        kind = event_type(event)
        if kind is None and event.truncated:
            return True
        return is_output_kind(kind)

    return is_output


def _named_terminal(names: frozenset[str]) -> Callable[[SSEEvent], bool]:
    def is_terminal(event: SSEEvent) -> bool:
        kind = event.event
        return (kind if kind is not None else event_type(event)) in names

    return is_terminal


def _chat_usage_from_body(body: bytes) -> UsageReport | None:
    return _openai.chat_usage(body, limit=None)


def _anthropic_usage_from_event(event: SSEEvent) -> UsageReport | None:
    return _anthropic.usage_from_event(event, event_type(event))


def _no_sequence_number(event: SSEEvent) -> int | None:
    return None


# -- the table -------------------------------------------------------------------


def _openai_row(protocol: Protocol, *, metered: bool) -> Dialect:
    """Chat completions, and the verbatim OpenAI passthrough (which is not metered)."""
    return Dialect(
        protocol=protocol,
        error_body=_openai_error_body,
        inband_error=_chat_inband_error,
        stream_error=_openai.chat_error_code,
        is_output=_openai.chat_is_output,
        is_terminal=_openai.chat_is_terminal,
        terminal_events=frozenset(),
        named_events=False,
        sequence_number=_no_sequence_number,
        usage_from_event=_openai.chat_usage_from_event if metered else None,
        usage_from_body=_chat_usage_from_body if metered else None,
        usage_events=frozenset(),
        input_excludes_cache=False,
        see=_openai.chat_see if metered else None,
    )


def _anthropic_row(protocol: Protocol, *, metered: bool) -> Dialect:
    """Messages; count_tokens and the other Anthropic paths share its shapes."""
    return Dialect(
        protocol=protocol,
        error_body=_anthropic_error_body,
        inband_error=_anthropic_inband_error,
        stream_error=_anthropic_stream_error,
        is_output=_named_output(_anthropic.is_output),
        is_terminal=_named_terminal(_anthropic.TERMINAL_EVENTS),
        terminal_events=_anthropic.TERMINAL_EVENTS,
        named_events=True,
        sequence_number=_no_sequence_number,
        usage_from_event=_anthropic_usage_from_event if metered else None,
        usage_from_body=_anthropic.usage_from_body if metered else None,
        usage_events=_anthropic.USAGE_EVENTS if metered else frozenset(),
        input_excludes_cache=metered,
    )


DIALECTS: Final[Mapping[Protocol, Dialect]] = MappingProxyType(
    {
        Protocol.CHAT: _openai_row(Protocol.CHAT, metered=True),
        Protocol.OPENAI: _openai_row(Protocol.OPENAI, metered=False),
        Protocol.RESPONSES: Dialect(
            protocol=Protocol.RESPONSES,
            error_body=_openai_error_body,
            inband_error=_openai.responses_inband_error,
            stream_error=_responses_stream_error,
            is_output=_named_output(_openai.responses_is_output),
            is_terminal=_named_terminal(_openai.RESPONSES_TERMINAL),
            terminal_events=_openai.RESPONSES_TERMINAL,
            named_events=True,
            sequence_number=_openai.responses_sequence_number,
            usage_from_event=_openai.responses_usage_from_event,
            usage_from_body=_openai.responses_usage_from_body,
            usage_events=_openai.RESPONSES_USAGE_EVENTS,
            input_excludes_cache=False,
        ),
        Protocol.MESSAGES: _anthropic_row(Protocol.MESSAGES, metered=True),
        Protocol.COUNT_TOKENS: _anthropic_row(Protocol.COUNT_TOKENS, metered=False),
        Protocol.ANTHROPIC: _anthropic_row(Protocol.ANTHROPIC, metered=False),
    }
)
"""One :class:`Dialect` per :class:`Protocol` (every member has a row)."""


def dialect(protocol: Protocol) -> Dialect:
    """The dialect of ``protocol``.

    Raises:
        KeyError: ``protocol`` has no row (cannot happen for a :class:`Protocol`).
    """
    return DIALECTS[protocol]

"""The gate's fused per-event pass reads a stream as the protocol functions do, event by event.

:meth:`proxy._stream.StreamGate._see_all` calls the dialect's tests from locals
and skips the calls the table's pre-checks (``named_events``, ``usage_events``,
"a stream error is terminal") say cannot report anything. The oracle here is the
plain per-event reading through the public functions of :mod:`proxy._protocols`
(``UsageMeter.feed_event``, ``is_output_event``, ``is_terminal_event``,
``is_overflow_event``, ``sequence_number``), run on the events a separate
:class:`~proxy._sse.SSEFramer` finds in the same chunks. Streams are random
mixes of each protocol's real events and awkward ones (unnamed, misnamed,
escaped keys, error chunks, ``[DONE]``, broken JSON), fed cut at random places
to gates that hold the head (refold, resend) and gates that do not. The claims
of the pre-check columns are checked on their own too, against the callables
they skip.
"""

from __future__ import annotations

import itertools
import json

from hypothesis import given, settings
from hypothesis import strategies as st

from proxy import _protocols as protocols
from proxy._protocols import DIALECTS, Protocol, UsageMeter
from proxy._sse import SSEEvent, SSEFramer
from proxy._stream import GateState, StreamGate

_NAMES = [
    None,
    "message_start",
    "message_delta",
    "message_stop",
    "content_block_start",
    "content_block_delta",
    "ping",
    "error",
    "response.created",
    "response.in_progress",
    "response.output_text.delta",
    "response.completed",
    "response.incomplete",
    "response.failed",
    "emulator.unknown",
]
_OVERFLOW = "prompt is too long: 300000 tokens > 200000 maximum"
_PAYLOADS: list[object] = [
    {"choices": [{"delta": {"role": "assistant", "content": ""}}], "usage": None},
    {"choices": [{"delta": {"content": "hi"}}], "usage": None},
    {"choices": [{"delta": {}}], "usage": None},
    {"choices": [], "usage": {"prompt_tokens": 7, "completion_tokens": 2}},
    {"choices": [], "usage": {"prompt_tokens": 9, "prompt_tokens_details": {"cached_tokens": 4}}},
    {"error": {"message": "boom", "code": "context_length_exceeded"}},
    {"error": _OVERFLOW},
    {"type": "message_start", "message": {"usage": {"input_tokens": 5, "output_tokens": 1}}},
    {"type": "message_delta", "usage": {"output_tokens": 3, "cache_read_input_tokens": 2}},
    {"type": "message_stop"},
    {"type": "content_block_delta", "delta": {"type": "text_delta", "text": "x"}},
    {"type": "error", "error": {"type": "invalid_request_error", "message": _OVERFLOW}},
    {"type": "error", "code": "context_length_exceeded", "message": "no", "sequence_number": 4},
    {"type": "response.created", "sequence_number": 0, "response": {"usage": None}},
    {"type": "response.output_text.delta", "sequence_number": 3, "delta": "x"},
    {
        "type": "response.completed",
        "sequence_number": 9,
        "response": {"usage": {"input_tokens": 11, "output_tokens": 4}},
    },
    {
        "type": "response.incomplete",
        "sequence_number": 7,
        "response": {"usage": {"input_tokens": 12, "input_tokens_details": {"cached_tokens": 3}}},
    },
    {
        "type": "response.failed",
        "sequence_number": 2,
        "response": {"error": {"code": "context_length_exceeded", "message": "too long"}},
    },
]
_RAW = [
    b"[DONE]",
    b"[DONE] and more",
    b"",
    b"{not json",
    b'{"\\u0075sage": {"input_tokens": 6, "prompt_tokens": 6}, "type": "message_delta"}',
    b'{"type": "message_delta", "usage": {"output_tokens": "many"}}',
    b'{"choices": [], "usage": null, "x": {"usage": {"prompt_tokens": 1}}}',
]


def _named(payload: object) -> tuple[str | None, bytes]:
    """A payload with the name its upstream gives it (its ``type``; chat names nothing)."""
    kind = payload.get("type") if isinstance(payload, dict) else None
    return (kind if isinstance(kind, str) else None), json.dumps(payload).encode()


_SAMPLES = [_named(p) for p in _PAYLOADS] + [(None, raw) for raw in _RAW]


@st.composite
def events(draw: st.DrawFn) -> bytes:
    """One SSE event: mostly named as its upstream names it, else unnamed or misnamed;
    now and then a comment."""
    if draw(st.integers(min_value=0, max_value=12)) == 0:
        return b": keep-alive\n\n"
    name, data = draw(st.sampled_from(_SAMPLES))
    naming = draw(st.integers(min_value=0, max_value=4))
    if naming == 0:
        name = None
    elif naming == 1:
        name = draw(st.sampled_from(_NAMES))
    head = b"" if name is None else b"event: " + name.encode() + b"\n"
    return head + b"data: " + data + b"\n\n"


@st.composite
def chunked(draw: st.DrawFn) -> list[bytes]:
    stream = b"".join(draw(st.lists(events(), max_size=10)))
    cuts = sorted(
        draw(st.lists(st.integers(min_value=0, max_value=len(stream)), max_size=8, unique=True))
    )
    bounds = [0, *cuts, len(stream)]
    return [stream[a:b] for a, b in itertools.pairwise(bounds)]


class Reference:
    """What each event means, read one event at a time through the public functions."""

    def __init__(self, protocol: Protocol) -> None:
        self.protocol = protocol
        self.meter = UsageMeter(protocol)
        self.output = self.terminal = self.overflow = False
        self.next_seq = 0

    def see(self, event: SSEEvent, *, gated: bool) -> None:
        protocol = self.protocol
        self.meter.feed_event(event)
        if protocol is Protocol.RESPONSES:
            seq = protocols.sequence_number(protocol, event)
            self.next_seq = self.next_seq + 1 if seq is None else seq + 1
        if not protocol.is_exchange:
            return
        if not self.output and protocols.is_output_event(protocol, event):
            self.output = True
        elif protocols.is_terminal_event(protocol, event):
            self.terminal = True
        if gated and not self.output and protocols.is_overflow_event(protocol, event):
            self.overflow = True

    def facts(self) -> tuple[object, ...]:
        meter = self.meter
        usage = (meter.input_tokens, meter.output_tokens, meter.cache_read_tokens)
        return self.output, self.terminal, self.overflow, self.next_seq, usage


def gate_facts(gate: StreamGate) -> tuple[object, ...]:
    meter = gate._usage
    usage = (meter.input_tokens, meter.output_tokens, meter.cache_read_tokens)
    return gate._output, gate._terminal, gate._overflow, gate._next_seq, usage


@settings(max_examples=400)
@given(
    st.sampled_from(list(Protocol)),
    chunked(),
    st.booleans(),
    st.booleans(),
)
def test_the_fused_pass_agrees_with_the_per_event_reading(
    protocol: Protocol, chunks: list[bytes], can_refold: bool, may_resend: bool
) -> None:
    gate = StreamGate(
        protocol,
        status=200,
        content_type="text/event-stream",
        stream_requested=True,
        can_refold=can_refold,
        may_resend=may_resend,
    )
    gate.start()
    framer = SSEFramer()
    reference = Reference(protocol)
    for chunk in chunks:
        if gate.state in (GateState.REFOLDING, GateState.DONE):
            break
        gated = gate.state is GateState.GATED
        gate.feed(chunk)
        if gate._precounted:
            return  # the tail's terminal event was read early: a path of its own
        for event in framer.feed(chunk):
            reference.see(event, gated=gated)
        assert gate_facts(gate) == reference.facts()


@settings(max_examples=400)
@given(st.sampled_from(list(Protocol)), st.lists(events(), min_size=1, max_size=1))
def test_each_pre_check_claim_holds_for_the_callable_it_skips(
    protocol: Protocol, raw: list[bytes]
) -> None:
    row = DIALECTS[protocol]
    for event in SSEFramer().feed(raw[0]):
        report = None if row.usage_from_event is None else row.usage_from_event(event)
        if row.named_events and event.event is not None:
            assert row.is_terminal(event) == (event.event in row.terminal_events)
            if event.event not in row.usage_events:
                assert report is None
        if row.stream_error(event) is not None:
            assert row.is_terminal(event)


@settings(max_examples=400)
@given(st.sampled_from(list(Protocol)), events(), st.booleans(), st.integers(0, 2))
def test_the_fused_column_answers_as_the_three_callables(
    protocol: Protocol, raw: bytes, output_seen: bool, cut: int
) -> None:
    """``see`` (one decode an event) says what ``usage_from_event``, ``is_output`` and
    ``is_terminal`` say, for whole events and for ones the framer truncated."""
    row = DIALECTS[protocol]
    if row.see is None:
        return
    assert row.usage_from_event is not None and not row.named_events
    for event in SSEFramer(max_data=[1 << 20, 4, 0][cut]).feed(raw):
        expected = (
            row.usage_from_event(event),
            not output_seen and row.is_output(event),
            row.is_terminal(event),
        )
        assert row.see(event, output_seen) == expected


def test_the_fused_column_answers_as_the_three_callables_for_large_events() -> None:
    big = "x" * (70 * 1024)
    payloads = [
        {"choices": [{"delta": {"content": big}}], "usage": None},
        {"choices": [], "usage": {"prompt_tokens": 7}, "pad": big},
        {"error": {"message": big, "code": "context_length_exceeded"}},
        {"choices": [{"delta": {}}], "pad": big},
    ]
    row = DIALECTS[Protocol.CHAT]
    assert row.see is not None and row.usage_from_event is not None
    for payload in payloads:
        (event,) = SSEFramer().feed(b"data: " + json.dumps(payload).encode() + b"\n\n")
        for output_seen in (False, True):
            expected = (
                row.usage_from_event(event),
                not output_seen and row.is_output(event),
                row.is_terminal(event),
            )
            assert row.see(event, output_seen) == expected

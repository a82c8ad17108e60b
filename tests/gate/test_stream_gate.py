"""The stream gate (proxy/_stream.py) driven like h11's and mitmproxy's Playbook tests.

Feed bytes, compare the actions. No aiohttp, no sockets: every decision the relay
makes about an upstream answer is checked here, one action kind at a time, plus
the stream end rule (R1, R2) for each protocol.
"""

from __future__ import annotations

import json
import random
from collections.abc import Sequence

import pytest

from proxy import _protocols as protocols
from proxy import _stream as stream
from proxy._protocols import Protocol, UsageReport
from proxy._stream import (
    ERROR_BODY_CAP,
    PARTIAL_EVENT_CAP,
    TERMINAL_EOF_GRACE,
    Accept,
    Action,
    Fail,
    Finish,
    Forward,
    GateError,
    GateState,
    Linger,
    Open,
    Refold,
    Reject,
    Resend,
    StreamGate,
    Usage,
)

SSE = "text/event-stream"
NO_USAGE = Usage(UsageReport(None, None, None))
ENDED_EARLY = "upstream stream ended without its final event"


def gate(
    protocol: Protocol = Protocol.CHAT,
    *,
    status: int = 200,
    content_type: str = SSE,
    stream_requested: bool = True,
    can_refold: bool = False,
    may_resend: bool = False,
) -> StreamGate:
    return StreamGate(
        protocol,
        status=status,
        content_type=content_type,
        stream_requested=stream_requested,
        can_refold=can_refold,
        may_resend=may_resend,
    )


def event(name: str | None, payload: object) -> bytes:
    head = f"event: {name}\n".encode() if name else b""
    return head + b"data: " + json.dumps(payload).encode() + b"\n\n"


def forwarded(actions: Sequence[Action]) -> bytes:
    return b"".join(a.data for a in actions if isinstance(a, Forward))


# Events of each protocol, as the upstreams send them.
CHAT_ROLE = event(None, {"choices": [{"delta": {"role": "assistant"}}]})
CHAT_TEXT = event(None, {"choices": [{"delta": {"content": "hi"}}]})
CHAT_USAGE = event(None, {"choices": [], "usage": {"prompt_tokens": 7, "completion_tokens": 2}})
CHAT_DONE = b"data: [DONE]\n\n"
CHAT_OVERFLOW = event(None, {"error": {"message": "too long", "code": "context_length_exceeded"}})

RESP_CREATED = event("response.created", {"type": "response.created", "sequence_number": 0})
RESP_DELTA = event(
    "response.output_text.delta",
    {"type": "response.output_text.delta", "delta": "hi", "sequence_number": 1},
)
RESP_COMPLETED = event(
    "response.completed",
    {
        "type": "response.completed",
        "response": {"usage": {"input_tokens": 5, "output_tokens": 1}},
        "sequence_number": 2,
    },
)
RESP_FAILED_OVERFLOW = event(
    "response.failed",
    {
        "type": "response.failed",
        "response": {"error": {"code": "context_length_exceeded", "message": "too long"}},
        "sequence_number": 1,
    },
)

MSG_START = event(
    "message_start",
    {"type": "message_start", "message": {"usage": {"input_tokens": 3, "output_tokens": 1}}},
)
MSG_DELTA = event("content_block_delta", {"type": "content_block_delta", "index": 0})
MSG_USAGE = event("message_delta", {"type": "message_delta", "usage": {"output_tokens": 9}})
MSG_STOP = event("message_stop", {"type": "message_stop"})

STREAMS = {
    Protocol.CHAT: [CHAT_ROLE, CHAT_TEXT, CHAT_DONE],
    Protocol.RESPONSES: [RESP_CREATED, RESP_DELTA, RESP_COMPLETED],
    Protocol.MESSAGES: [MSG_START, MSG_DELTA, MSG_STOP],
}
EXCHANGES = list(STREAMS)


# ------------------------------------------------------------------ forwarding


def test_a_stream_goes_out_at_event_boundaries() -> None:
    g = gate()
    assert g.start() == [Accept(), Open()]
    assert g.state is GateState.STREAMING and g.opened
    # One event and a half: the half waits for its end.
    assert g.feed(CHAT_ROLE + CHAT_TEXT[:9]) == [Forward(CHAT_ROLE)]
    assert g.held_bytes() >= 9
    assert g.feed(CHAT_TEXT[9:]) == [Forward(CHAT_TEXT)]
    assert g.held_bytes() == 0
    assert g.feed(CHAT_DONE) == [Forward(CHAT_DONE), Linger(TERMINAL_EOF_GRACE)]
    assert g.state is GateState.TERMINAL


def test_pieces_go_out_intact_and_in_order() -> None:
    """Was a relay test with a transport that keeps what it sent: a write of a complete
    event ahead of a partial one must not cut bytes out of a buffer still being viewed."""
    g = gate(Protocol.OPENAI)
    g.start()
    pieces = [b"data: one\n\ndata: tw", b"o\n\ndata: thr", b"ee\n\n"]
    out = [g.feed(piece) for piece in pieces]
    assert out == [
        [Forward(b"data: one\n\n")],
        [Forward(b"data: two\n\n")],
        [Forward(b"data: three\n\n")],
    ]


@pytest.mark.parametrize("protocol", EXCHANGES)
def test_every_split_of_a_stream_forwards_the_same_bytes(protocol: Protocol) -> None:
    whole = b"".join(STREAMS[protocol])
    rng = random.Random(1234)
    for _ in range(200):
        cuts = sorted(rng.sample(range(1, len(whole)), rng.randint(1, 12)))
        pieces = [whole[a:b] for a, b in zip([0, *cuts], [*cuts, len(whole)], strict=True)]
        g = gate(protocol)
        actions = g.start()
        for piece in pieces:
            actions += g.feed(piece)
            # Never ahead of a complete event: what went out parses on its own
            # (R1: or it ends with the terminal event's whole data line).
            out = forwarded(actions)
            assert out.endswith(b"\n\n") or not out or g.state is GateState.TERMINAL
            assert whole.startswith(out)
        actions += g.end(clean=True)
        assert forwarded(actions) == whole
        assert actions[-1] == Finish()


def test_an_enormous_event_is_forwarded_as_it_comes() -> None:
    g = gate()
    g.start()
    big = b"data: " + b"x" * (PARTIAL_EVENT_CAP + 10)
    assert g.feed(big) == [Forward(big)]
    assert g.held_bytes() < 1 << 16
    assert g.feed(b"yy") == [Forward(b"yy")]
    # It cannot be taken back: the error event first ends it with a blank line.
    actions = g.end(clean=True)
    assert actions[0] == Forward(b"\n\n")
    assert actions[1] == Forward(protocols.inband_error(Protocol.CHAT, ENDED_EARLY))
    assert actions[-1] == Fail(ENDED_EARLY)


def test_cr_line_ends_and_comments_pass_untouched() -> None:
    g = gate()
    g.start()
    raw = b": keep-alive\r\n\r\ndata: [DONE]\r\r"
    actions = g.feed(raw)
    # The blank line ended by the last CR completes only at EOF (it may be a CRLF),
    # but the [DONE] line is whole: R1, the answer is complete (and goes out whole).
    assert actions == [Forward(raw), Linger(TERMINAL_EOF_GRACE)]
    assert g.end(clean=True) == [NO_USAGE, Finish()]


# ------------------------------------------------------------- stream end rule


@pytest.mark.parametrize("protocol", EXCHANGES)
def test_r1_what_follows_the_terminal_event_goes_out_as_is(protocol: Protocol) -> None:
    *body, last = STREAMS[protocol]
    g = gate(protocol)
    g.start()
    actions = g.feed(b"".join(body) + last + b"data: trail")
    assert actions[-1] == Linger(TERMINAL_EOF_GRACE)
    assert forwarded(actions) == b"".join(body) + last + b"data: trail"
    assert g.feed(b"ing") == [Forward(b"ing")]
    # Cut or not, the answer is complete: nothing is added.
    end = g.end(clean=False, reason="ClientPayloadError")
    assert end[-1] == Finish() and forwarded(end) == b""


@pytest.mark.parametrize("protocol", EXCHANGES)
def test_r1_an_unterminated_terminal_event_at_eof_is_the_end(protocol: Protocol) -> None:
    """The anthropic SDK's own fixtures end with ``data: {"type":"message_stop"}`` and
    no newline; the SDK accepts that, so the proxy must relay it as is and add nothing."""
    *body, last = STREAMS[protocol]
    fragment = last.removesuffix(b"\n\n")
    g = gate(protocol)
    actions = g.start() + g.feed(b"".join(body) + fragment)
    assert forwarded(actions) == b"".join(body)
    end = g.end(clean=True)
    assert forwarded(end) == fragment
    assert end[-1] == Finish()


@pytest.mark.parametrize("protocol", EXCHANGES)
@pytest.mark.parametrize("line_end", [b"\n", b"\r\n", b"\r"], ids=["lf", "crlf", "cr"])
def test_r1_a_terminal_event_whose_data_line_ended_is_the_end_without_its_blank_line(
    protocol: Protocol, line_end: bytes
) -> None:
    """An upstream that sends its terminal event's data line and then nothing (but keeps
    the connection open): the event is whole, so the gate ends the answer (Linger) now,
    not when the upstream's idle read timeout strikes."""
    *body, last = STREAMS[protocol]
    fragment = last.removesuffix(b"\n\n") + line_end
    g = gate(protocol)
    actions = g.start() + g.feed(b"".join(body))
    assert Linger(TERMINAL_EOF_GRACE) not in actions
    actions += g.feed(fragment)
    assert actions[-1] == Linger(TERMINAL_EOF_GRACE)
    assert forwarded(actions) == b"".join(body) + fragment
    # The blank line may still come: relayed, and the usage is counted once.
    later = g.feed(b"\n")
    assert later == [Forward(b"\n")]
    end = g.end(clean=True)
    assert forwarded(end) == b"" and end[-1] == Finish()
    whole = gate(protocol)
    as_sent = whole.start() + whole.feed(b"".join(STREAMS[protocol])) + whole.end(clean=True)
    assert [a for a in end if isinstance(a, Usage)] == [a for a in as_sent if isinstance(a, Usage)]


@pytest.mark.parametrize(
    ("protocol", "tail"),
    [
        (Protocol.CHAT, b"data: [DO"),  # the line is not whole
        (Protocol.CHAT, b"data: [DONE] \n"),  # not the [DONE] marker
        (Protocol.MESSAGES, b"event: message_stop\n"),  # its data has not come yet
        (Protocol.MESSAGES, b'event: message_stop\ndata: {"type": "mess\n'),  # not one object
        (Protocol.RESPONSES, b"event: response.completed\n"),
    ],
)
def test_an_unfinished_terminal_event_is_not_the_end_yet(protocol: Protocol, tail: bytes) -> None:
    *body, _ = STREAMS[protocol]
    g = gate(protocol)
    actions = g.start() + g.feed(b"".join(body) + tail)
    assert Linger(TERMINAL_EOF_GRACE) not in actions
    assert forwarded(actions) == b"".join(body)


@pytest.mark.parametrize("protocol", EXCHANGES)
@pytest.mark.parametrize("clean", [True, False])
def test_r2_a_body_ending_mid_event_drops_the_fragment_and_adds_one_error(
    protocol: Protocol, clean: bool
) -> None:
    first, second, _ = STREAMS[protocol]
    g = gate(protocol)
    actions = g.start() + g.feed(first + second[:12])
    end = g.end(clean=clean, reason="ClientPayloadError")
    message = ENDED_EARLY if clean else "upstream stream failed: ClientPayloadError"
    # Responses: the error event is numbered after the last one relayed (0).
    expected = protocols.inband_error(protocol, message, sequence_number=1)
    assert forwarded(actions) == first
    assert forwarded(end) == expected
    assert end[-1] == Fail(message)
    assert g.state is GateState.DONE and g.held_bytes() == 0


def test_r2_on_an_event_boundary_adds_only_the_error() -> None:
    g = gate(Protocol.MESSAGES)
    g.start()
    g.feed(MSG_START + MSG_USAGE)
    end = g.end(clean=True)
    assert end == [
        Forward(protocols.inband_error(Protocol.MESSAGES, ENDED_EARLY)),
        Usage(UsageReport(3, 9, None)),
        Fail(ENDED_EARLY),
    ]


def test_responses_error_counts_events_it_did_not_decode() -> None:
    """A delta over 64 KiB is not decoded: it still takes one sequence number."""
    big = event("response.output_text.delta", {"delta": "x" * 70_000, "sequence_number": 1})
    g = gate(Protocol.RESPONSES)
    g.start()
    g.feed(RESP_CREATED + big)
    end = g.end(clean=True)
    assert forwarded(end) == protocols.inband_error(
        Protocol.RESPONSES, ENDED_EARLY, sequence_number=2
    )


def test_a_passthrough_stream_has_no_end_rule() -> None:
    g = gate(Protocol.OPENAI)
    assert g.start() == [Accept(), Open()]
    g.feed(b"data: [DONE]\n\n")
    assert g.state is GateState.STREAMING  # no known grammar: no terminal event
    g.feed(b"data: par")
    assert g.end(clean=True) == [Forward(b"data: par"), NO_USAGE, Finish()]


# -------------------------------------------------- gate before first output


def test_responses_head_is_held_until_output_starts() -> None:
    g = gate(Protocol.RESPONSES, can_refold=True)
    assert g.start() == []
    assert g.state is GateState.GATED and not g.opened
    assert g.feed(RESP_CREATED + RESP_DELTA[:5]) == []
    assert g.held_bytes() >= len(RESP_CREATED) + 5
    assert g.feed(RESP_DELTA[5:]) == [Accept(), Open(), Forward(RESP_CREATED + RESP_DELTA)]
    assert g.state is GateState.STREAMING


def test_an_overflow_inside_a_held_stream_asks_for_a_refold() -> None:
    g = gate(Protocol.RESPONSES, can_refold=True)
    g.start()
    assert g.feed(RESP_CREATED) == []
    assert g.feed(RESP_FAILED_OVERFLOW) == [Refold("overflow in stream")]
    assert g.state is GateState.REFOLDING
    with pytest.raises(GateError):
        g.feed(b"data: x\n\n")
    with pytest.raises(GateError):
        g.end(clean=True)


def test_a_declined_refold_relays_the_overflow_as_it_came() -> None:
    g = gate(Protocol.RESPONSES, can_refold=True)
    g.start()
    g.feed(RESP_CREATED + RESP_FAILED_OVERFLOW)
    assert g.refold_declined() == [
        Accept(),
        Open(),
        Forward(RESP_CREATED + RESP_FAILED_OVERFLOW),
        Linger(TERMINAL_EOF_GRACE, failed=True),  # response.failed: terminal, and a failure
    ]
    with pytest.raises(GateError):
        g.refold_declined()


def test_without_a_refold_an_overflow_in_a_stream_is_relayed() -> None:
    g = gate(Protocol.RESPONSES, can_refold=False)
    assert g.start() == [Accept(), Open()]
    actions = g.feed(RESP_CREATED + RESP_FAILED_OVERFLOW)
    assert forwarded(actions) == RESP_CREATED + RESP_FAILED_OVERFLOW


def test_the_held_head_is_bounded(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(stream, "HEAD_HOLD_CAP", 64)
    g = gate(Protocol.RESPONSES, can_refold=True)
    g.start()
    lifecycle = event("response.in_progress", {"type": "response.in_progress", "pad": "p" * 80})
    assert g.feed(lifecycle) == [Accept(), Open(), Forward(lifecycle)]


# --------------------------------------------------------------------- resend


def test_a_head_over_the_hold_cap_opens_rather_than_resends(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Bytes past the cap go to the client: no resend, even for an empty completion."""
    monkeypatch.setattr(stream, "HEAD_HOLD_CAP", 8)
    g = gate(Protocol.CHAT, may_resend=True)
    g.start()
    assert g.feed(CHAT_ROLE + CHAT_DONE) == [
        Open(),
        Forward(CHAT_ROLE + CHAT_DONE),
        Linger(TERMINAL_EOF_GRACE),
    ]


def test_an_empty_completion_asks_for_a_resend() -> None:
    g = gate(Protocol.CHAT, may_resend=True)
    # Chat has no in-stream refold: the release boundary is at once.
    assert g.start() == [Accept()]
    assert g.feed(CHAT_ROLE) == []
    assert g.feed(CHAT_USAGE + CHAT_DONE) == [Resend()]
    assert g.state is GateState.DONE and g.held_bytes() == 0


def test_an_empty_body_asks_for_a_resend_only_when_it_ended_cleanly() -> None:
    g = gate(Protocol.MESSAGES, may_resend=True)
    g.start()
    g.feed(MSG_START)
    assert g.end(clean=True) == [Resend()]
    g = gate(Protocol.MESSAGES, may_resend=True)
    g.start()
    g.feed(MSG_START + MSG_DELTA[:7])
    end = g.end(clean=False, reason="TimeoutError")
    message = "upstream stream failed: TimeoutError"
    assert end == [
        Open(),
        Forward(MSG_START),
        Forward(protocols.inband_error(Protocol.MESSAGES, message)),
        Usage(UsageReport(3, 1, None)),
        Fail(message),
    ]


def test_output_opens_the_resend_gate() -> None:
    g = gate(Protocol.CHAT, may_resend=True)
    g.start()
    assert g.feed(CHAT_ROLE + CHAT_TEXT) == [Open(), Forward(CHAT_ROLE + CHAT_TEXT)]
    assert g.feed(CHAT_DONE) == [Forward(CHAT_DONE), Linger(TERMINAL_EOF_GRACE)]


def test_a_passthrough_stream_is_never_held_for_a_resend() -> None:
    g = gate(Protocol.OPENAI, may_resend=True)
    assert g.start() == [Accept(), Open()]
    g.feed(b"data: {}\n\n")
    assert g.end(clean=True)[-1] == Finish()


# ---------------------------------------------------------------- error answers

OVERFLOW_400 = json.dumps(
    {
        "error": {
            "message": "too long",
            "type": "invalid_request_error",
            "code": "context_length_exceeded",
        }
    }
).encode()


def test_an_overflow_answer_asks_for_a_refold() -> None:
    g = gate(status=400, content_type="application/json", can_refold=True)
    assert g.start() == []
    assert g.state is GateState.ERROR_HEAD
    assert g.feed(OVERFLOW_400[:10]) == []
    assert g.feed(OVERFLOW_400[10:]) == []
    assert g.end(clean=True) == [Refold("context overflow")]
    relayed = [Accept(), Open(upstream_error=True), Forward(OVERFLOW_400), NO_USAGE, Finish()]
    assert g.refold_declined() == relayed


def test_an_error_answer_without_a_refold_is_relayed_whole() -> None:
    g = gate(status=400, content_type="application/json", can_refold=False)
    g.start()
    g.feed(OVERFLOW_400)
    relayed = [Accept(), Open(upstream_error=True), Forward(OVERFLOW_400), NO_USAGE, Finish()]
    assert g.end(clean=True) == relayed


def test_a_large_error_answer_is_not_classified() -> None:
    g = gate(status=500, content_type="text/plain", can_refold=True)
    g.start()
    head = b"e" * ERROR_BODY_CAP
    assert g.feed(head) == []
    assert g.feed(b"ee") == [Accept(), Open(upstream_error=True), Forward(head + b"ee")]
    assert g.feed(b"more") == [Forward(b"more")]
    assert g.end(clean=True) == [NO_USAGE, Finish()]


def test_an_error_answer_cut_short_cuts_the_client() -> None:
    g = gate(status=503, content_type="text/event-stream", can_refold=True)
    g.start()
    g.feed(b"data: overloa")
    assert g.end(clean=False, reason="ClientPayloadError") == [
        Accept(),
        Open(upstream_error=True),
        Forward(b"data: overloa"),
        NO_USAGE,
        Fail("upstream stream failed: ClientPayloadError", cut=True),
    ]


# ------------------------------------------------------------------- JSON bodies


def test_a_json_answer_is_relayed_and_metered() -> None:
    body = json.dumps({"usage": {"prompt_tokens": 11, "completion_tokens": 4}}).encode()
    g = gate(content_type="application/json", stream_requested=False)
    assert g.start() == [Accept(), Open()]
    assert g.feed(body[:5]) == [Forward(body[:5])]
    assert g.feed(body[5:]) == [Forward(body[5:])]
    assert g.end(clean=True) == [Usage(UsageReport(11, 4, None)), Finish()]


def test_a_json_answer_cut_short_is_a_cut_not_a_complete_answer() -> None:
    g = gate(content_type="application/json", stream_requested=False)
    g.start()
    g.feed(b'{"id": "x", "cho')
    assert g.end(clean=False, reason="truncated gzip") == [
        NO_USAGE,
        Fail("upstream stream failed: truncated gzip", cut=True),
    ]


# ------------------------------------------------------------------ wrong answers


@pytest.mark.parametrize("protocol", EXCHANGES)
def test_a_streaming_request_answered_with_html_is_refused(protocol: Protocol) -> None:
    g = gate(protocol, content_type="text/html")
    actions = g.start()
    assert actions == [
        Accept(),
        Reject(
            502,
            "upstream answered a streaming request with status 200 and content type "
            "text/html, not an event stream",
        ),
    ]
    assert g.state is GateState.DONE
    with pytest.raises(GateError):
        g.feed(b"<html/>")


def test_html_is_judged_only_for_streaming_exchange_requests() -> None:
    assert gate(content_type="text/html", stream_requested=False).start() == [Accept(), Open()]
    assert gate(Protocol.OPENAI, content_type="text/html").start() == [Accept(), Open()]
    assert gate(content_type="application/problem+json").start() == [Accept(), Open()]
    assert gate(status=204, content_type="").start() == [Accept(), Open()]


# ------------------------------------------------------------------------- abort


def test_abort_ends_an_answered_stream_with_an_error_event() -> None:
    g = gate(Protocol.RESPONSES)
    g.start()
    g.feed(RESP_CREATED + RESP_DELTA + b"event: resp")
    actions = g.abort("proxy shutting down", code="proxy_shutdown")
    assert actions == [
        Forward(
            protocols.inband_error(
                Protocol.RESPONSES, "proxy shutting down", code="proxy_shutdown", sequence_number=2
            )
        ),
        NO_USAGE,
        Fail("proxy shutting down"),
    ]
    # The event names the orderly stop, not a broken upstream.
    forwarded = actions[0]
    assert isinstance(forwarded, Forward)
    assert b"proxy_shutdown" in forwarded.data and b"upstream_stream_error" not in forwarded.data
    assert g.held_bytes() == 0


def test_abort_before_the_client_was_answered_leaves_the_answer_to_the_driver() -> None:
    g = gate(Protocol.RESPONSES, can_refold=True)
    g.start()
    g.feed(RESP_CREATED)
    assert g.abort("session closed", code="session_closed") == []
    assert g.state is GateState.DONE and g.held_bytes() == 0


def test_abort_after_the_terminal_event_adds_nothing() -> None:
    g = gate(Protocol.MESSAGES)
    g.start()
    g.feed(MSG_START + MSG_STOP)
    assert g.abort("proxy shutting down", code="proxy_shutdown") == [
        Usage(UsageReport(3, 1, None)),
        Finish(),
    ]


def test_abort_of_a_json_body_cuts_it() -> None:
    g = gate(content_type="application/json", stream_requested=False)
    g.start()
    g.feed(b"{")
    assert g.abort("proxy shutting down", code="proxy_shutdown") == [
        NO_USAGE,
        Fail("proxy shutting down", cut=True),
    ]


# ------------------------------------------------------------------ misuse, usage


def test_methods_out_of_order_raise() -> None:
    g = gate()
    with pytest.raises(GateError):
        g.feed(b"x")
    with pytest.raises(GateError):
        g.end(clean=True)
    with pytest.raises(GateError):
        g.refold_declined()
    g.start()
    with pytest.raises(GateError):
        g.start()
    g.feed(CHAT_DONE)
    g.end(clean=True)
    with pytest.raises(GateError):
        g.feed(b"x")
    with pytest.raises(GateError):
        g.end(clean=True)


@pytest.mark.parametrize(
    ("protocol", "events", "usage"),
    [
        (Protocol.CHAT, [CHAT_TEXT, CHAT_USAGE, CHAT_DONE], Usage(UsageReport(7, 2, None))),
        (Protocol.RESPONSES, [RESP_DELTA, RESP_COMPLETED], Usage(UsageReport(5, 1, None))),
        (Protocol.MESSAGES, [MSG_START, MSG_USAGE, MSG_STOP], Usage(UsageReport(3, 9, None))),
    ],
)
def test_usage_is_metered_from_the_stream(
    protocol: Protocol, events: list[bytes], usage: Usage
) -> None:
    g = gate(protocol)
    g.start()
    g.feed(b"".join(events))
    assert g.end(clean=True) == [usage, Finish()]

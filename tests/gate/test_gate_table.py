"""The stream gate's transition table (proxy/_stream.py ``TRANSITIONS``), walked.

Every row is reached by at least one scenario below, and each scenario's move is
a row: the state it leaves the gate in and the kinds of action it emits, in the
row's order. Every call the table has no row for raises ``GateError`` and leaves
the gate where it was. And the table is what the gate obeys, not a description
of it: a row taken out makes the move it allowed raise.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Sequence

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from proxy import _stream as stream
from proxy._protocols import Protocol, UsageReport
from proxy._stream import (
    ERROR_BODY_CAP,
    HEAD_HOLD_CAP,
    TRANSITIONS,
    Accept,
    Action,
    ActionKind,
    Fail,
    Finish,
    Forward,
    GateError,
    GateInput,
    GateState,
    Linger,
    Move,
    Open,
    Refold,
    Reject,
    Resend,
    StreamGate,
    Usage,
)

SSE = "text/event-stream"
JSON = "application/json"


def event(name: str | None, payload: object) -> bytes:
    head = f"event: {name}\n".encode() if name else b""
    return head + b"data: " + json.dumps(payload).encode() + b"\n\n"


CHAT_TEXT = event(None, {"choices": [{"delta": {"content": "hi"}}]})
CHAT_DONE = b"data: [DONE]\n\n"
RESP_CREATED = event("response.created", {"type": "response.created", "sequence_number": 0})
RESP_DELTA = event(
    "response.output_text.delta",
    {"type": "response.output_text.delta", "delta": "hi", "sequence_number": 1},
)
RESP_OVERFLOW = event(
    "response.failed",
    {
        "type": "response.failed",
        "response": {"error": {"code": "context_length_exceeded", "message": "too long"}},
        "sequence_number": 1,
    },
)
OVERFLOW_400 = json.dumps(
    {
        "error": {
            "message": "too long",
            "type": "invalid_request_error",
            "code": "context_length_exceeded",
        }
    }
).encode()


@dataclasses.dataclass(frozen=True)
class Call:
    """One gate method call: ``on`` with its argument (bytes to feed, or clean for end)."""

    on: GateInput
    data: bytes = b""
    clean: bool = True

    def __call__(self, gate: StreamGate) -> list[Action]:
        if self.on is GateInput.START:
            return gate.start()
        if self.on is GateInput.FEED:
            return gate.feed(self.data)
        if self.on is GateInput.END:
            return gate.end(clean=self.clean, reason="" if self.clean else "reset")
        if self.on is GateInput.REFOLD_DECLINED:
            return gate.refold_declined()
        return gate.abort("proxy shutting down", code="proxy_shutdown")


START = Call(GateInput.START)
END = Call(GateInput.END)
CUT = Call(GateInput.END, clean=False)
DECLINE = Call(GateInput.REFOLD_DECLINED)
ABORT = Call(GateInput.ABORT)


def feed(data: bytes) -> Call:
    return Call(GateInput.FEED, data)


@dataclasses.dataclass(frozen=True)
class Options:
    """What a gate is made with (:class:`StreamGate`'s arguments)."""

    protocol: Protocol = Protocol.CHAT
    status: int = 200
    content_type: str = SSE
    stream_requested: bool = True
    can_refold: bool = False
    may_resend: bool = False

    def gate(self) -> StreamGate:
        return StreamGate(
            self.protocol,
            status=self.status,
            content_type=self.content_type,
            stream_requested=self.stream_requested,
            can_refold=self.can_refold,
            may_resend=self.may_resend,
        )


@dataclasses.dataclass(frozen=True)
class Scenario:
    """A gate made with ``options``, driven through ``before``; ``last`` is the move observed."""

    options: Options
    before: Sequence[Call]
    last: Call

    def gate(self) -> StreamGate:
        """A gate driven through ``before``."""
        gate = self.options.gate()
        for call in self.before:
            call(gate)
        return gate

    def run(self) -> tuple[GateState, list[Action], GateState]:
        """``(state before the last call, its actions, state after it)``."""
        gate = self.gate()
        before = gate.state
        actions = self.last(gate)
        return before, actions, gate.state


CHAT = Options()
RESENDING = Options(may_resend=True)
REFOLDABLE = Options(Protocol.RESPONSES, can_refold=True)
PLAIN = Options(content_type=JSON, stream_requested=False)
ERROR = Options(status=400, content_type=JSON)
ERROR_REFOLDABLE = Options(status=400, content_type=JSON, can_refold=True)
BIG_ERROR = b"e" * (ERROR_BODY_CAP + 1)

SCENARIOS: dict[str, Scenario] = {
    # NEW
    "html to a stream request": Scenario(Options(content_type="text/html"), [], START),
    "an error status": Scenario(ERROR, [], START),
    "a stream that may be resent": Scenario(RESENDING, [], START),
    "a stream that may be refolded": Scenario(REFOLDABLE, [], START),
    "a plain stream": Scenario(CHAT, [], START),
    "a JSON answer": Scenario(PLAIN, [], START),
    "aborted before the head": Scenario(CHAT, [], ABORT),
    # ERROR_HEAD
    "part of an error body": Scenario(ERROR, [START], feed(OVERFLOW_400[:10])),
    "an error body over the cap": Scenario(ERROR_REFOLDABLE, [START], feed(BIG_ERROR)),
    "an overflow answer": Scenario(ERROR_REFOLDABLE, [START, feed(OVERFLOW_400)], END),
    "an overflow answer, no refold": Scenario(ERROR, [START, feed(OVERFLOW_400)], END),
    "an error answer cut": Scenario(ERROR, [START, feed(OVERFLOW_400[:10])], CUT),
    "aborted while an error is held": Scenario(ERROR, [START], ABORT),
    # GATED
    "a held head": Scenario(RESENDING, [START], feed(CHAT_TEXT[:5])),
    "an overflow event": Scenario(REFOLDABLE, [START, feed(RESP_CREATED)], feed(RESP_OVERFLOW)),
    "an empty completion": Scenario(RESENDING, [START], feed(CHAT_DONE)),
    "output opens the gate": Scenario(RESENDING, [START], feed(CHAT_TEXT)),
    "a head over its cap": Scenario(RESENDING, [START], feed(b"data: " + b"x" * HEAD_HOLD_CAP)),
    "output and the end at once": Scenario(REFOLDABLE, [START], feed(RESP_DELTA + RESP_OVERFLOW)),
    "an empty stream ends": Scenario(RESENDING, [START], END),
    "a held head is cut": Scenario(RESENDING, [START, feed(CHAT_TEXT[:5])], CUT),
    "aborted while gated": Scenario(RESENDING, [START, feed(CHAT_TEXT[:5])], ABORT),
    # REFOLDING
    "a declined stream refold": Scenario(
        REFOLDABLE, [START, feed(RESP_CREATED + RESP_OVERFLOW)], DECLINE
    ),
    "a declined answer refold": Scenario(
        ERROR_REFOLDABLE, [START, feed(OVERFLOW_400), END], DECLINE
    ),
    "aborted while refolding": Scenario(REFOLDABLE, [START, feed(RESP_OVERFLOW)], ABORT),
    # STREAMING
    "events go out": Scenario(CHAT, [START], feed(CHAT_TEXT)),
    "the terminal event": Scenario(CHAT, [START, feed(CHAT_TEXT)], feed(CHAT_DONE)),
    "R2: the stream ends early": Scenario(CHAT, [START, feed(CHAT_TEXT)], END),
    "R1: terminal without its blank line": Scenario(
        CHAT, [START, feed(CHAT_TEXT)], feed(CHAT_DONE[:-1])
    ),
    "R1: terminal at EOF": Scenario(CHAT, [START, feed(CHAT_TEXT + CHAT_DONE[:-2])], END),
    "a JSON answer ends": Scenario(PLAIN, [START, feed(b"{}")], END),
    "a JSON answer is cut": Scenario(PLAIN, [START, feed(b"{")], CUT),
    "aborted mid-stream": Scenario(CHAT, [START, feed(CHAT_TEXT)], ABORT),
    # TERMINAL
    "bytes after the terminal event": Scenario(CHAT, [START, feed(CHAT_DONE)], feed(b": x\n\n")),
    "the end after the terminal event": Scenario(CHAT, [START, feed(CHAT_DONE)], CUT),
    "aborted after the terminal event": Scenario(CHAT, [START, feed(CHAT_DONE)], ABORT),
    # DONE
    "aborted when done": Scenario(CHAT, [START, feed(CHAT_DONE), END], ABORT),
}


def _row(before: GateState, on: GateInput, after: GateState) -> Move:
    rows = [m for m in TRANSITIONS if (m.state, m.on, m.to) == (before, on, after)]
    assert len(rows) == 1, f"{len(rows)} rows for {before.value} --{on.value}--> {after.value}"
    return rows[0]


def _in_row_order(kinds: Sequence[ActionKind], allowed: Sequence[ActionKind]) -> bool:
    """Whether ``kinds`` follow ``allowed``'s order, each at most once but Forward."""
    position = 0
    for kind in kinds:
        while position < len(allowed) and allowed[position] is not kind:
            position += 1
        if position == len(allowed):
            return False
        if kind is not ActionKind.FORWARD:
            position += 1
    return True


@pytest.mark.parametrize("name", list(SCENARIOS))
def test_each_move_is_a_row_of_the_table(name: str) -> None:
    before, actions, after = SCENARIOS[name].run()
    row = _row(before, SCENARIOS[name].last.on, after)
    kinds = [action.kind for action in actions]
    assert _in_row_order(kinds, row.actions), f"{kinds} not within {row.actions} ({row.when})"


def test_every_row_is_reached() -> None:
    reached = set()
    for scenario in SCENARIOS.values():
        before, _, after = scenario.run()
        reached.add((before, scenario.last.on, after))
    rows = {(m.state, m.on, m.to) for m in TRANSITIONS}
    assert reached == rows


def test_rows_are_unique_and_every_state_has_a_way_out() -> None:
    rows = [(m.state, m.on, m.to) for m in TRANSITIONS]
    assert len(rows) == len(set(rows))
    for state in GateState:
        assert any(m.state is state and m.on is GateInput.ABORT for m in TRANSITIONS)
    # Only DONE is final: from every other state some row goes elsewhere.
    for state in set(GateState) - {GateState.DONE}:
        assert any(m.state is state and m.to is not state for m in TRANSITIONS)


def _gate_in(state: GateState) -> StreamGate:
    """A gate left in ``state``: a new one, or by the first scenario that ends there."""
    if state is GateState.NEW:
        return CHAT.gate()
    for scenario in SCENARIOS.values():
        gate = scenario.gate()
        scenario.last(gate)
        if gate.state is state:
            return gate
    raise AssertionError(f"no scenario ends in {state.value}")


REFUSED = [
    (state, on)
    for state in GateState
    for on in GateInput
    if not any(m.state is state and m.on is on for m in TRANSITIONS)
]


def test_the_refused_calls_are_the_driver_bugs() -> None:
    """The table refuses exactly what the gate's contract calls misuse."""
    refused = {(state.value, on.value) for state, on in REFUSED}
    assert refused == {
        *(
            (state, "start")
            for state in ("error_head", "gated", "refolding", "streaming", "terminal", "done")
        ),
        *((state, "feed") for state in ("new", "refolding", "done")),
        *((state, "end") for state in ("new", "refolding", "done")),
        *(
            (state, "refold_declined")
            for state in ("new", "error_head", "gated", "streaming", "terminal", "done")
        ),
    }


@pytest.mark.parametrize(("state", "on"), REFUSED, ids=lambda x: str(x.value))
def test_a_call_with_no_row_raises_and_changes_nothing(state: GateState, on: GateInput) -> None:
    gate = _gate_in(state)
    held = gate.held_bytes()
    with pytest.raises(GateError, match=f"{on.value}\\(\\) in state {state.value}"):
        Call(on, b"data: x\n\n")(gate)
    assert gate.state is state and gate.held_bytes() == held


def test_the_gate_obeys_the_table_not_its_own_branches(monkeypatch: pytest.MonkeyPatch) -> None:
    """Without the STREAMING --feed--> TERMINAL row, the terminal event is a gate bug."""
    nexts = dict(stream._NEXT)
    nexts[GateState.STREAMING, GateInput.FEED] = frozenset({GateState.STREAMING})
    monkeypatch.setattr(stream, "_NEXT", nexts)
    gate = CHAT.gate()
    gate.start()
    assert gate.feed(CHAT_TEXT) == [Forward(CHAT_TEXT)]  # the row still there: allowed
    with pytest.raises(GateError, match="from streaming to terminal"):
        gate.feed(CHAT_DONE)


def test_each_action_names_its_kind() -> None:
    usage = Usage(UsageReport(None, None, None))
    actions: list[Action] = [
        Accept(),
        Open(),
        Forward(b""),
        Refold("r"),
        Resend(),
        Linger(0.5),
        usage,
        Finish(),
        Fail("f"),
        Reject(502, "r"),
    ]
    assert [a.kind for a in actions] == list(ActionKind)


# ------------------------------------------------------- random walks (hypothesis)

MSG_START = event("message_start", {"type": "message_start", "message": {"usage": {}}})
MSG_DELTA = event("content_block_delta", {"type": "content_block_delta", "index": 0})
MSG_STOP = event("message_stop", {"type": "message_stop"})
MSG_OVERFLOW = event(
    "error",
    {"type": "error", "error": {"type": "invalid_request_error", "message": "prompt is too long"}},
)
RESP_COMPLETED = event(
    "response.completed", {"type": "response.completed", "response": {}, "sequence_number": 2}
)
CHAT_OVERFLOW = event(None, {"error": {"message": "too long", "code": "context_length_exceeded"}})
PIECES = [
    CHAT_TEXT,
    CHAT_DONE,
    CHAT_OVERFLOW,
    RESP_CREATED,
    RESP_DELTA,
    RESP_OVERFLOW,
    RESP_COMPLETED,
    MSG_START,
    MSG_DELTA,
    MSG_STOP,
    MSG_OVERFLOW,
    OVERFLOW_400,
    b": keep-alive\n\n",
    b"data: [DONE]",
    b"{}",
]


@st.composite
def calls(draw: st.DrawFn) -> Call:
    on = draw(st.sampled_from(list(GateInput)))
    if on is GateInput.FEED:
        data = b"".join(draw(st.lists(st.sampled_from(PIECES), max_size=4)))
        cut = draw(st.integers(min_value=0, max_value=len(data)))
        return feed(data[:cut] if draw(st.booleans()) else data)
    return Call(on, clean=draw(st.booleans()))


@settings(max_examples=300, deadline=None)
@given(
    st.builds(
        Options,
        protocol=st.sampled_from(list(Protocol)),
        status=st.sampled_from([200, 204, 400, 500]),
        content_type=st.sampled_from([SSE, JSON, "text/html", ""]),
        stream_requested=st.booleans(),
        can_refold=st.booleans(),
        may_resend=st.booleans(),
    ),
    st.lists(calls(), max_size=12),
)
def test_any_sequence_of_calls_moves_only_along_the_table(
    options: Options, sequence: list[Call]
) -> None:
    gate = options.gate()
    for call in [START, *sequence]:
        before = gate.state
        if (before, call.on) in REFUSED:
            with pytest.raises(GateError):
                call(gate)
            assert gate.state is before
            continue
        actions = call(gate)
        row = _row(before, call.on, gate.state)
        kinds = [action.kind for action in actions]
        assert _in_row_order(kinds, row.actions), f"{kinds} not within {row.actions}"

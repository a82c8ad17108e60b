"""Every decision the relay makes about one upstream answer, as a pure state machine.

The relay (:mod:`proxy._relay`) does the I/O; a :class:`StreamGate` decides.
One gate is made per upstream answer (a refold or resend makes a new one). The
driver feeds it the answer's decoded body bytes as they arrive and tells it
how the body ended; the gate returns :data:`Action` objects, which the driver
performs in order. The gate never reads a socket, a clock or the exchange;
it can be tested by feeding bytes and comparing the actions (h11 style).

What the gate decides:

* **Event-boundary forwarding.** SSE bytes go to the client up to the last
  complete event; an unfinished event waits in the *tail* for its end, up to
  :data:`PARTIAL_EVENT_CAP` bytes (a larger one goes out as it comes, so memory
  stays bounded).
* **The gate before first output.** While a refold (Responses: an overflow
  may arrive inside a 200 stream as ``response.failed``) or a fake-completion
  resend (a stream that ends without any output) is still possible, the
  answer's head is *held*, up to :data:`HEAD_HOLD_CAP` bytes, and the client
  has not been answered yet.
* **Overflow and the refold / resend decision**, for error answers (the first
  :data:`ERROR_BODY_CAP` bytes are held and classified) and inside streams.
* **Terminal events and the stream end rule** (docs/design.md §7):
  R1, once the route's terminal event was relayed the answer is complete:
  what follows goes out as is and nothing is added, even if the upstream never
  ended the terminal event with a blank line. R2, a body that ends before the
  terminal event, cleanly or not: every complete event was forwarded byte for
  byte, an unterminated trailing fragment is dropped (an SSE client would
  discard it, WHATWG HTML "event stream interpretation"), and one in-band
  error event in the protocol's shape ends the stream.
* **Wrong answers**: a 2xx answer to a streaming request whose content type is
  neither an event stream nor JSON is refused with a 502 (its body is not
  relayed).
* **Usage metering** from usage events or a JSON body of up to
  :data:`USAGE_JSON_CAP` bytes.

States and transitions are data, as in h11's ``_state.py``: :data:`TRANSITIONS`
lists every move the gate can make, one :class:`Move` a row (from which
:class:`GateState`, on which :class:`GateInput`, to which state, the kinds of
action it may emit, and when). A call the table has no row for raises
:class:`GateError` before anything happens (``feed`` after the end, ``start``
twice, ``refold_declined`` outside REFOLDING: a driver bug); a call that would
end in a state its rows do not list raises :class:`GateError` too (a gate bug).
"""

from __future__ import annotations

import dataclasses
import enum
import json
from collections.abc import Callable, Mapping
from types import MappingProxyType
from typing import ClassVar, Final

from . import _protocols as protocols
from ._protocols import Protocol
from ._sse import SSEEvent, SSEFramer

__all__ = [
    "ERROR_BODY_CAP",
    "HEAD_HOLD_CAP",
    "PARTIAL_EVENT_CAP",
    "TERMINAL_EOF_GRACE",
    "TRANSITIONS",
    "USAGE_JSON_CAP",
    "Accept",
    "Action",
    "ActionKind",
    "Fail",
    "Finish",
    "Forward",
    "GateError",
    "GateInput",
    "GateState",
    "Linger",
    "Move",
    "Open",
    "Refold",
    "Reject",
    "Resend",
    "StreamGate",
    "Usage",
]

#: Bytes of an upstream error body held to classify it (overflow or not).
ERROR_BODY_CAP: Final = 1 << 20
#: Bytes of a stream's head held back while a refold or resend is still possible.
HEAD_HOLD_CAP: Final = 4 << 20
#: Bytes of one unfinished SSE event held back before it is forwarded anyway.
PARTIAL_EVENT_CAP: Final = 1 << 20
#: Bytes of a non-streaming JSON answer kept to read its usage.
USAGE_JSON_CAP: Final = 1 << 20
#: Seconds to wait for the upstream's end of body once the terminal SSE event was relayed.
#: A healthy upstream ends it within a round trip (the connection then stays pooled);
#: one that keeps it open must not keep the client's complete answer from ending.
TERMINAL_EOF_GRACE: Final = 0.5

_SSE: Final = "text/event-stream"


# --------------------------------------------------------------------- actions


class ActionKind(enum.Enum):
    """What an :data:`Action` asks of the driver; each action class has one (``kind``)."""

    ACCEPT = "accept"
    OPEN = "open"
    FORWARD = "forward"
    REFOLD = "refold"
    RESEND = "resend"
    LINGER = "linger"
    USAGE = "usage"
    FINISH = "finish"
    FAIL = "fail"
    REJECT = "reject"


@dataclasses.dataclass(frozen=True, slots=True)
class Accept:
    """The release boundary: no refold can follow (call ``Exchange.accept``)."""

    kind: ClassVar[ActionKind] = ActionKind.ACCEPT


@dataclasses.dataclass(frozen=True, slots=True)
class Open:
    """Answer the client with this upstream answer's status and headers.

    ``upstream_error``: the answer is the upstream's own error (status >= 400),
    relayed as it came; the exchange's outcome says so.
    """

    kind: ClassVar[ActionKind] = ActionKind.OPEN

    upstream_error: bool = False


@dataclasses.dataclass(frozen=True, slots=True)
class Forward:
    """Write ``data`` to the client (with backpressure), exactly these bytes."""

    kind: ClassVar[ActionKind] = ActionKind.FORWARD

    data: bytes


@dataclasses.dataclass(frozen=True, slots=True)
class Refold:
    """A context overflow: re-prepare at the next fold level and send again.

    The driver must not refold once the client has gone. When the refold does
    not shrink the body, it calls :meth:`StreamGate.refold_declined` and goes on
    reading this answer.

    ``prompt_tokens`` and ``window_tokens`` are the figures the upstream's error
    states (the rejected prompt's size and the context window, in tokens), or
    ``None`` where its wording states none (an overflow event inside a stream).
    """

    kind: ClassVar[ActionKind] = ActionKind.REFOLD

    reason: str
    prompt_tokens: int | None = None
    window_tokens: int | None = None


@dataclasses.dataclass(frozen=True, slots=True)
class Resend:
    """An empty completion: send the same body again (fake-completion retry).

    Nothing was sent to the client; the driver closes this answer.
    """

    kind: ClassVar[ActionKind] = ActionKind.RESEND


@dataclasses.dataclass(frozen=True, slots=True)
class Linger:
    """The terminal event was relayed: read on for at most ``seconds``, then end.

    ``failed``: the terminal event reports an error in band (Responses'
    ``response.failed`` or ``error``, a chat error chunk, Anthropic's ``error``):
    the exchange is booked ``upstream_error`` though its status was 200.
    """

    kind: ClassVar[ActionKind] = ActionKind.LINGER

    seconds: float
    failed: bool = False


@dataclasses.dataclass(frozen=True, slots=True)
class Usage:
    """Token counts the upstream reported for this answer (``None``: not reported);
    see :meth:`protocols.UsageMeter.totals`."""

    kind: ClassVar[ActionKind] = ActionKind.USAGE

    tokens: protocols.UsageReport


@dataclasses.dataclass(frozen=True, slots=True)
class Finish:
    """The answer is complete; stop reading the upstream."""

    kind: ClassVar[ActionKind] = ActionKind.FINISH


@dataclasses.dataclass(frozen=True, slots=True)
class Fail:
    """The answer failed after the client was answered: book ``message``.

    ``cut``: the body is not an event stream, so no error event could be
    appended; close the client's connection so it sees a truncated body.
    """

    kind: ClassVar[ActionKind] = ActionKind.FAIL

    message: str
    cut: bool = False


@dataclasses.dataclass(frozen=True, slots=True)
class Reject:
    """Answer the client with this error (protocol shape) instead of the upstream's answer."""

    kind: ClassVar[ActionKind] = ActionKind.REJECT

    status: int
    message: str


Action = Accept | Open | Forward | Refold | Resend | Linger | Usage | Finish | Fail | Reject


class GateState(enum.Enum):
    """Where a :class:`StreamGate` is; :data:`TRANSITIONS` says where it may go."""

    NEW = "new"
    ERROR_HEAD = "error_head"
    GATED = "gated"
    REFOLDING = "refolding"
    STREAMING = "streaming"
    TERMINAL = "terminal"
    DONE = "done"

    # The table is looked up a few times per answer: hash by identity (in C), not by
    # name (Enum's own __hash__ is Python code); members are singletons anyway.
    __hash__ = object.__hash__


class GateInput(enum.Enum):
    """What the driver tells a :class:`StreamGate`: one member per method (its name)."""

    START = "start"
    FEED = "feed"
    END = "end"
    REFOLD_DECLINED = "refold_declined"
    ABORT = "abort"

    __hash__ = object.__hash__  # as GateState's


class GateError(RuntimeError):
    """A gate method called in a state where :data:`TRANSITIONS` has no row for it
    (a driver bug), or a move the table does not list (a gate bug)."""


@dataclasses.dataclass(frozen=True, slots=True)
class Move:
    """One row of :data:`TRANSITIONS`.

    From ``state``, on ``on``, the gate goes to ``to``, emitting actions of the
    kinds in ``actions`` only (in the order listed, each at most once, except
    :class:`Forward`, which may repeat); ``when`` says in which case.
    """

    state: GateState
    on: GateInput
    to: GateState
    actions: tuple[ActionKind, ...]
    when: str


_S, _I, _K = GateState, GateInput, ActionKind

#: Every move a gate makes (docs/design.md §7 for R1 and R2). One row per
#: (from, input, to); a row's ``when`` lists its cases.
# fmt: off
TRANSITIONS: Final[tuple[Move, ...]] = (
    # -- start(): the answer's head
    Move(_S.NEW, _I.START, _S.DONE, (_K.ACCEPT, _K.REJECT),
         "a 2xx to a streaming exchange request, neither an event stream nor JSON: a 502"),
    Move(_S.NEW, _I.START, _S.ERROR_HEAD, (),
         "status >= 400: the body is held (up to ERROR_BODY_CAP) to classify it"),
    Move(_S.NEW, _I.START, _S.GATED, (_K.ACCEPT,),
         "a 2xx exchange event stream while a refold or a resend is possible; Accept "
         "unless a refold is"),
    Move(_S.NEW, _I.START, _S.STREAMING, (_K.ACCEPT, _K.OPEN),
         "anything else"),
    Move(_S.NEW, _I.ABORT, _S.DONE, (),
         "before the head: the driver answers the client with an error"),
    # -- ERROR_HEAD: an error answer, held whole while it may be an overflow
    Move(_S.ERROR_HEAD, _I.FEED, _S.ERROR_HEAD, (),
         "the held body is within ERROR_BODY_CAP"),
    Move(_S.ERROR_HEAD, _I.FEED, _S.STREAMING, (_K.ACCEPT, _K.OPEN, _K.FORWARD),
         "the held body outgrew ERROR_BODY_CAP: no overflow answer; relayed as it comes"),
    Move(_S.ERROR_HEAD, _I.END, _S.REFOLDING, (_K.REFOLD,),
         "a clean end, the body is an overflow answer, a refold is possible"),
    Move(_S.ERROR_HEAD, _I.END, _S.DONE,
         (_K.ACCEPT, _K.OPEN, _K.FORWARD, _K.USAGE, _K.FINISH, _K.FAIL),
         "otherwise: the answer goes out whole, then Finish; Fail (cut) if it ended unclean"),
    Move(_S.ERROR_HEAD, _I.ABORT, _S.DONE, (),
         "the client was not answered: the driver answers it with an error"),
    # -- GATED: a stream's head, held while a refold or a resend may follow
    Move(_S.GATED, _I.FEED, _S.GATED, (),
         "no output, no terminal event, the head within HEAD_HOLD_CAP"),
    Move(_S.GATED, _I.FEED, _S.REFOLDING, (_K.REFOLD,),
         "an overflow event while a refold is possible"),
    Move(_S.GATED, _I.FEED, _S.DONE, (_K.RESEND,),
         "the terminal event with no output, the head within HEAD_HOLD_CAP, a resend "
         "possible (an empty completion)"),
    Move(_S.GATED, _I.FEED, _S.STREAMING, (_K.ACCEPT, _K.OPEN, _K.FORWARD),
         "output, an overflow that cannot be refolded, or a head over HEAD_HOLD_CAP"),
    Move(_S.GATED, _I.FEED, _S.TERMINAL, (_K.ACCEPT, _K.OPEN, _K.FORWARD, _K.LINGER),
         "the terminal event, where no resend follows (R1: the answer is complete)"),
    Move(_S.GATED, _I.END, _S.DONE,
         (_K.RESEND, _K.ACCEPT, _K.OPEN, _K.FORWARD, _K.USAGE, _K.FINISH, _K.FAIL),
         "a clean end with no output and a resend possible: Resend; otherwise the head "
         "goes out, then as STREAMING's end"),
    Move(_S.GATED, _I.ABORT, _S.DONE, (),
         "the client was not answered: the driver answers it with an error"),
    # -- REFOLDING: the driver re-prepares; a refold that does not shrink is declined
    Move(_S.REFOLDING, _I.REFOLD_DECLINED, _S.TERMINAL,
         (_K.ACCEPT, _K.OPEN, _K.FORWARD, _K.LINGER),
         "a stream: the held head and its overflow event go out as they came"),
    Move(_S.REFOLDING, _I.REFOLD_DECLINED, _S.DONE,
         (_K.ACCEPT, _K.OPEN, _K.FORWARD, _K.USAGE, _K.FINISH),
         "an error answer (read whole): it goes out as it came"),
    Move(_S.REFOLDING, _I.ABORT, _S.DONE, (),
         "the client was not answered: the driver answers it with an error"),
    # -- STREAMING: relayed event by event (or as bytes, not an event stream)
    Move(_S.STREAMING, _I.FEED, _S.STREAMING, (_K.FORWARD,),
         "the complete events (the unfinished one waits, up to PARTIAL_EVENT_CAP)"),
    Move(_S.STREAMING, _I.FEED, _S.TERMINAL, (_K.FORWARD, _K.LINGER),
         "the terminal event (R1): it and what is held go out"),
    Move(_S.STREAMING, _I.END, _S.DONE, (_K.FORWARD, _K.USAGE, _K.FINISH, _K.FAIL),
         "the terminal event unterminated at EOF (R1), or not an exchange stream: the "
         "tail, Usage, Finish; an exchange stream without its terminal event (R2): the "
         "in-band error event, Usage, Fail; a plain body cut: Usage, Fail (cut)"),
    Move(_S.STREAMING, _I.ABORT, _S.DONE, (_K.FORWARD, _K.USAGE, _K.FAIL),
         "the in-band error event and Fail; Fail (cut) for a body that is not a stream"),
    # -- TERMINAL: complete (R1); what follows goes out as it comes, nothing is added
    Move(_S.TERMINAL, _I.FEED, _S.TERMINAL, (_K.FORWARD,),
         "whatever follows the terminal event"),
    Move(_S.TERMINAL, _I.END, _S.DONE, (_K.USAGE, _K.FINISH),
         "any end, clean or not"),
    Move(_S.TERMINAL, _I.ABORT, _S.DONE, (_K.USAGE, _K.FINISH),
         "the answer is complete: nothing is added"),
    # -- DONE
    Move(_S.DONE, _I.ABORT, _S.DONE, (),
         "nothing left to do"),
)
# fmt: on


def _next_states() -> Mapping[tuple[GateState, GateInput], frozenset[GateState]]:
    """``(state, input) -> the states the input may leave the gate in``, from the rows."""
    found: dict[tuple[GateState, GateInput], set[GateState]] = {}
    for move in TRANSITIONS:
        found.setdefault((move.state, move.on), set()).add(move.to)
    return MappingProxyType({key: frozenset(states) for key, states in found.items()})


_NEXT: Final = _next_states()


def _refusing(on: GateInput) -> tuple[GateState, ...]:
    """The states with no row for ``on`` (a tuple: ``in`` on it is an identity scan)."""
    return tuple(state for state in GateState if (state, on) not in _NEXT)


# The states in which feed() and end() have no meaning (tuples built once, not per call).
_NOT_FED: Final = _refusing(GateInput.FEED)
_NOT_ENDED: Final = _refusing(GateInput.END)


def _is_json(content_type: str) -> bool:
    return content_type == "application/json" or content_type.endswith("+json")


# ------------------------------------------------------------------------ gate


class StreamGate:
    """The decisions for one upstream answer, fed bytes, returning actions.

    Args:
        protocol: the exchange's protocol.
        status: the upstream's HTTP status.
        content_type: the upstream's media type, lowercase, without parameters
            (``""`` when absent).
        stream_requested: the request asked for a stream (``"stream": true``).
        can_refold: a refold at the next fold level is still possible.
        may_resend: a fake-completion resend is still possible.

    Call :meth:`start` once, then :meth:`feed` per chunk of the decoded body,
    then :meth:`end`. Every method returns the actions to perform, in order.
    """

    __slots__ = (
        "_accepted",
        "_buf",
        "_can_refold",
        "_exchange",
        "_failed",
        "_framer",
        "_json_head",
        "_may_resend",
        "_next_seq",
        "_opened",
        "_output",
        "_overflow",
        "_precounted",
        "_protocol",
        "_row",
        "_sequence_number",
        "_spilled",
        "_state",
        "_status",
        "_terminal",
        "_usage",
        "content_type",
        "stream_requested",
    )

    def __init__(
        self,
        protocol: Protocol,
        *,
        status: int,
        content_type: str,
        stream_requested: bool,
        can_refold: bool,
        may_resend: bool,
    ) -> None:
        self._protocol = protocol
        # The protocol's per-event tests, looked up once per answer, not once per event.
        row = self._row = protocols.DIALECTS[protocol]
        self._exchange = protocol.is_exchange
        self._sequence_number = row.sequence_number if protocol is Protocol.RESPONSES else None
        self._status = status
        self.content_type = content_type
        self.stream_requested = stream_requested
        self._can_refold = can_refold
        self._may_resend = may_resend
        self._state = GateState.NEW
        self._framer: SSEFramer | None = None
        # GATED / ERROR_HEAD: the held head; STREAMING: the unfinished event (the tail).
        self._buf = bytearray()
        self._json_head: bytearray | None = None
        self._usage = protocols.UsageMeter(protocol)
        self._opened = self._accepted = False
        self._output = self._terminal = self._overflow = False
        # The terminal event seen so far reports an error in band.
        self._failed = False
        # Part of the unfinished event already went out (it outgrew PARTIAL_EVENT_CAP).
        self._spilled = False
        # Events whose usage was read from the tail before their blank line arrived.
        self._precounted = 0
        self._next_seq = 0

    # ------------------------------------------------------------ public state

    @property
    def state(self) -> GateState:
        """The current :class:`GateState`."""
        return self._state

    @property
    def opened(self) -> bool:
        """Whether :class:`Open` was emitted (the client got headers)."""
        return self._opened

    @property
    def framed(self) -> bool:
        """Whether the answer is relayed event by event (SSE), not as plain bytes."""
        return self._framer is not None

    def held_bytes(self) -> int:
        """Bytes of the answer the gate holds now: the held head or the partial-event
        tail, and the JSON head kept for usage."""
        held = len(self._buf)
        if self._json_head is not None:
            held += len(self._json_head)
        return held

    # ----------------------------------------------------------------- inputs

    def start(self) -> list[Action]:
        """The answer's headers arrived: the first decision.

        Raises:
            GateError: if called twice.
            Also for a move no row of :data:`TRANSITIONS` lists (a gate bug).
        """
        self._expect(GateInput.START)
        return self._moved(GateState.NEW, GateInput.START, self._start())

    def _start(self) -> list[Action]:
        protocol, status = self._protocol, self._status
        is_sse = self.content_type == _SSE
        if status >= 400:
            self._state = GateState.ERROR_HEAD
            return []
        if (
            self._exchange
            and self.stream_requested
            and 200 <= status < 300
            and status != 204
            and not is_sse
            and not _is_json(self.content_type)
        ):
            self._state = GateState.DONE
            self._accepted = True
            shown = self.content_type or "none"
            return [
                Accept(),
                Reject(
                    502,
                    f"upstream answered a streaming request with status {status} "
                    f"and content type {shown}, not an event stream",
                ),
            ]
        if is_sse:
            self._framer = SSEFramer()
        else:
            self._json_head = bytearray()
        # Only the exchange protocols have a known stream grammar (output, terminal event);
        # a passthrough stream (e.g. a stored response replayed) is relayed as it comes.
        defer_accept = is_sse and protocol is Protocol.RESPONSES and self._can_refold
        if not defer_accept:
            self._can_refold = False
        if is_sse and self._exchange and (defer_accept or self._may_resend):
            self._state = GateState.GATED
            return [] if defer_accept else self._accept([])
        self._may_resend = False
        return self._open([])

    def feed(self, chunk: bytes | bytearray | memoryview) -> list[Action]:
        """The next bytes of the (decoded) body.

        Raises:
            GateError: before :meth:`start`, after the end, or while a refold is pending.
            Also for a move no row of :data:`TRANSITIONS` lists (a gate bug).
        """
        state = self._state
        if state in _NOT_FED:
            raise GateError(f"feed() in state {state.value}")
        if not chunk:
            return []
        data = bytes(chunk)
        if state is GateState.ERROR_HEAD:
            self._buf += data
            if len(self._buf) <= ERROR_BODY_CAP:
                return []
            # Too large to classify: not an overflow answer; relay it as it comes.
            return self._moved(state, GateInput.FEED, self._open([]))
        framer = self._framer
        if framer is None:
            json_head = self._json_head
            if json_head is not None:
                if len(json_head) + len(data) <= USAGE_JSON_CAP:
                    json_head += data
                else:
                    self._json_head = None
            return [Forward(data)]
        self._see_all(framer.feed(data))
        if state is GateState.TERMINAL:
            return [Forward(data)]
        if state is GateState.GATED:
            self._buf += data
            self._probe_tail(framer)
            return self._moved(state, GateInput.FEED, self._settle([]))
        buf = self._buf
        pending = framer.pending_bytes
        if not buf and pending == 0:
            # On an event boundary with nothing held (the usual case): no copy.
            self._spilled = False
            actions = self._after_feed([Forward(data)])
        else:
            buf += data
            self._probe_tail(framer)
            actions = self._after_feed([])
        if self._state is not state:  # the terminal event: checked off the per-event path
            self._moved(state, GateInput.FEED, actions)
        return actions

    def refold_declined(self) -> list[Action]:
        """The refold asked for by :class:`Refold` did not shrink the body: relay this answer.

        Raises:
            GateError: outside REFOLDING.
            Also for a move no row of :data:`TRANSITIONS` lists (a gate bug).
        """
        self._expect(GateInput.REFOLD_DECLINED)
        self._can_refold = False
        if self._framer is None:
            # An error answer, read whole: it goes to the client as it came.
            self._state = GateState.ERROR_HEAD
            actions = self._end_error_head(clean=True)
        else:
            self._state = GateState.GATED
            actions = self._settle([])
        return self._moved(GateState.REFOLDING, GateInput.REFOLD_DECLINED, actions)

    def end(self, *, clean: bool, reason: str = "") -> list[Action]:
        """The body ended: ``clean`` by its own framing, else cut (``reason`` says how).

        Raises:
            GateError: before :meth:`start`, after the end, or while a refold is pending.
            Also for a move no row of :data:`TRANSITIONS` lists (a gate bug).
        """
        state = self._state
        if state in _NOT_ENDED:
            raise GateError(f"end() in state {state.value}")
        return self._moved(state, GateInput.END, self._end(state, clean, reason))

    def _end(self, state: GateState, clean: bool, reason: str) -> list[Action]:
        if state is GateState.ERROR_HEAD:
            return self._end_error_head(clean=clean, reason=reason)
        actions: list[Action] = []
        framer = self._framer
        if framer is not None:
            # A final event ended by a lone CR only completes at EOF.
            self._see_all(framer.close())
        if state is GateState.GATED:
            if clean and not self._output and self._may_resend:
                self._drop()
                return [Resend()]
            self._may_resend = False
            self._open(actions)
            self._forward_ready(actions)
        if self._state is GateState.TERMINAL:
            return self._finish(actions)
        if framer is None:
            if not clean:
                return self._fail(actions, self._failure(reason), cut=True)
            if self._json_head is not None:
                self._usage.feed_json(bytes(self._json_head))
            return self._finish(actions)
        if not self._exchange:
            # No known grammar: nothing to judge; the tail goes out as it came.
            self._flush(actions)
            return self._finish(actions)
        if self._buf and self._tail_is_terminal():
            # R1: the terminal event without its blank line; the SDK accepts it.
            self._flush(actions)
            return self._finish(actions)
        # R2: drop the unfinished event, end with the protocol's error event.
        self._buf = bytearray()
        if clean:
            message = "upstream stream ended without its final event"
        else:
            message = self._failure(reason)
        return self._fail(actions, message)

    def abort(self, message: str, *, code: str) -> list[Action]:
        """Stop now (e.g. the proxy shuts down) and end the client's answer well-formed.

        ``code`` is the in-band error's machine-readable code (e.g.
        ``"session_closed"``, ``"proxy_shutdown"``; see :func:`protocols.inband_error`).

        Returns ``[]`` when the client was not answered yet (the driver answers
        it with an error response instead); otherwise the error event and
        :class:`Fail`, or a ``Fail(cut=True)`` for a body that is not an event stream.
        Valid in every state (in DONE it does nothing).

        Raises:
            GateError: a move no row of :data:`TRANSITIONS` lists (a gate bug).
        """
        state = self._state
        if state is GateState.DONE or not self._opened:
            self._drop()
            actions: list[Action] = []
        elif state is GateState.TERMINAL:
            actions = self._finish([])  # R1: the answer is complete; add nothing
        else:
            self._buf = bytearray()
            actions = self._fail([], message, cut=self._framer is None, code=code)
        return self._moved(state, GateInput.ABORT, actions)

    # -------------------------------------------------------------- internals

    def _expect(self, on: GateInput) -> None:
        """Refuse ``on`` in a state :data:`TRANSITIONS` has no row for (a driver bug)."""
        if (self._state, on) not in _NEXT:
            raise GateError(f"{on.value}() in state {self._state.value}")

    def _moved(self, before: GateState, on: GateInput, actions: list[Action]) -> list[Action]:
        """Check that ``on`` took the gate from ``before`` where a row of
        :data:`TRANSITIONS` goes; returns ``actions``.

        Raises:
            GateError: no row goes there (a gate bug; the answer cannot be trusted).
        """
        if self._state not in _NEXT.get((before, on), ()):
            raise GateError(
                f"{on.value}() moved the gate from {before.value} to {self._state.value}, "
                "a move no row of TRANSITIONS lists"
            )
        return actions

    def _see_all(self, events: list[SSEEvent]) -> None:
        """Note what complete events mean: usage, sequence number, output, terminal, overflow.

        The per-event path of every answer, fused on purpose (a Python call costs
        more than the C-level tests that make most calls needless): the
        dialect's tests are called straight from locals, and the table's
        pre-checks skip the calls that cannot report anything (see
        :class:`~proxy._protocols.Dialect`): a named event outside
        ``usage_events`` carries no usage, a named event is terminal by its
        name, and only a terminal event can report a stream error (an
        overflow). Only the first output event matters (gate, resend); after it
        no event is asked whether it is output.
        """
        if not events:
            return
        row = self._row
        if row.see is not None:
            self._see_each(row.see, events)
            return
        meter = self._usage
        usage_of = row.usage_from_event
        usage_events = row.usage_events
        named = row.named_events
        terminal_events = row.terminal_events
        is_output = row.is_output
        is_terminal = row.is_terminal
        sequence_number = self._sequence_number
        exchange = self._exchange
        gated = self._state is GateState.GATED
        output, terminal = self._output, self._terminal
        precounted, next_seq = self._precounted, self._next_seq
        for event in events:
            name = event.event if named else None
            if precounted:
                precounted -= 1  # its usage was read by _probe_tail
            elif usage_of is not None and (name is None or name in usage_events):
                report = usage_of(event)
                if report is not None:
                    meter.merge(report)
            if sequence_number is not None:
                seq = sequence_number(event)
                next_seq = next_seq + 1 if seq is None else seq + 1
            if not exchange:
                continue
            if not output:
                if is_output(event):
                    output = True
                elif (name in terminal_events) if name is not None else is_terminal(event):
                    terminal = True
                    self._failed = protocols.is_error_event(self._protocol, event)
                    if gated and protocols.is_overflow_event(self._protocol, event):
                        self._overflow = True
            elif not terminal:
                terminal = (name in terminal_events) if name is not None else is_terminal(event)
                if terminal:
                    self._failed = protocols.is_error_event(self._protocol, event)
        self._output, self._terminal = output, terminal
        self._precounted, self._next_seq = precounted, next_seq

    def _see_each(
        self,
        see: Callable[[SSEEvent, bool], tuple[protocols.UsageReport | None, bool, bool]],
        events: list[SSEEvent],
    ) -> None:
        """:meth:`_see_all` for a dialect that answers the three questions of an event
        at once (:attr:`~proxy._protocols.Dialect.see`: chat; metered, unnamed, no
        sequence numbers, an exchange): one call and one decode an event, not three."""
        meter = self._usage
        gated = self._state is GateState.GATED
        output, terminal = self._output, self._terminal
        precounted = self._precounted
        for event in events:
            report, is_output, is_terminal = see(event, output)
            if precounted:
                precounted -= 1  # its usage was read by _probe_tail
            elif report is not None:
                meter.merge(report)
            if not output:
                if is_output:
                    output = True
                elif is_terminal:
                    terminal = True
                    self._failed = protocols.is_error_event(self._protocol, event)
                    if gated and protocols.is_overflow_event(self._protocol, event):
                        self._overflow = True
            elif not terminal and is_terminal:
                terminal = True
                self._failed = protocols.is_error_event(self._protocol, event)
        self._output, self._terminal = output, terminal
        self._precounted = precounted

    def _settle(self, actions: list[Action]) -> list[Action]:
        """GATED after a feed: hold on, refold, resend or open the gate."""
        if self._overflow and self._can_refold:
            self._state = GateState.REFOLDING
            actions.append(Refold("overflow in stream"))
            return actions
        # An overflow that cannot be refolded goes to the client as the upstream sent it;
        # a byte that went to the client ends any chance of a resend.
        opening = self._output or self._overflow or len(self._buf) > HEAD_HOLD_CAP
        if not opening and self._terminal and self._may_resend:
            self._drop()
            actions.append(Resend())
            return actions
        if opening or self._terminal:
            self._may_resend = self._can_refold = False
            self._open(actions)
            return self._after_feed(actions)
        return actions

    def _accept(self, actions: list[Action]) -> list[Action]:
        if not self._accepted:
            self._accepted = True
            actions.append(Accept())
        self._can_refold = False
        return actions

    def _open(self, actions: list[Action]) -> list[Action]:
        self._accept(actions)
        self._opened = True
        self._state = GateState.STREAMING
        actions.append(Open(upstream_error=self._status >= 400))
        if self._framer is None and self._buf:
            # An error head (not framed): it goes out whole.
            actions.append(Forward(bytes(self._buf)))
            self._buf = bytearray()
        return actions

    def _after_feed(self, actions: list[Action]) -> list[Action]:
        """STREAMING: forward complete events; on the terminal one, flush and linger."""
        if self._terminal and self._exchange:
            # R1: the answer is complete; whatever follows goes out as it comes.
            self._flush(actions)
            self._state = GateState.TERMINAL
            actions.append(Linger(TERMINAL_EOF_GRACE, failed=self._failed))
            return actions
        self._forward_ready(actions)
        return actions

    def _forward_ready(self, actions: list[Action]) -> None:
        """Forward the buffer up to the last complete event; keep the unfinished one."""
        framer = self._framer
        buf = self._buf
        if not buf:
            return
        if framer is None:
            actions.append(Forward(bytes(buf)))
            self._buf = bytearray()
            return
        pending = framer.pending_bytes
        if pending > PARTIAL_EVENT_CAP:
            # An enormous event: forward what we have; memory stays bounded.
            self._spilled = True
            actions.append(Forward(bytes(buf)))
            self._buf = bytearray()
            return
        ready = len(buf) - pending
        if ready < 0:
            return  # the spilled event's rest: it waits like any unfinished event
        self._spilled = False
        if ready > 0:
            actions.append(Forward(bytes(buf[:ready])))
            self._buf = buf[ready:]

    def _flush(self, actions: list[Action]) -> None:
        if self._buf:
            actions.append(Forward(bytes(self._buf)))
            self._buf = bytearray()

    def _probe_tail(self, framer: SSEFramer) -> None:
        """R1 before the blank line: is the unfinished event a complete terminal one?

        An upstream may send its terminal event without the blank line and keep
        the connection open; waiting for the blank line (or EOF) would keep the
        client's complete answer open until the idle read timeout. The tail
        counts as the terminal event when its last line is a ``data`` line whose
        line end arrived and the data is whole: ``[DONE]`` or one JSON object.
        Then the gate is terminal: the tail goes out and :class:`Linger` follows.
        """
        if self._terminal or self._spilled or not self._exchange:
            return
        buf = self._buf
        pending = framer.pending_bytes
        if not 0 < pending <= len(buf) or buf[-1] not in b"\r\n":
            return
        tail = bytes(buf[-pending:])
        last_line = tail.rstrip(b"\r\n").replace(b"\r", b"\n").rpartition(b"\n")[2]
        if not last_line.startswith(b"data"):
            return
        probe = SSEFramer()
        events = probe.feed(tail + b"\n\n")
        events += probe.close()
        if len(events) != 1:
            return
        (event,) = events
        if not (protocols.is_terminal_event(self._protocol, event) and _whole_data(event.data)):
            return
        self._terminal = True
        self._failed = protocols.is_error_event(self._protocol, event)
        self._usage.feed_event(event)
        self._precounted = 1

    def _tail_is_terminal(self) -> bool:
        """Whether the unterminated tail, ended by a blank line, holds the terminal event."""
        if self._spilled:
            return False
        probe = SSEFramer()
        events = probe.feed(bytes(self._buf) + b"\n\n")
        events += probe.close()
        if not any(protocols.is_terminal_event(self._protocol, event) for event in events):
            return False
        for event in events:
            self._usage.feed_event(event)
        return True

    def _end_error_head(self, *, clean: bool, reason: str = "") -> list[Action]:
        head = bytes(self._buf)
        if (
            clean
            and self._can_refold
            and protocols.is_overflow_response(
                self._protocol, self._status, self.content_type, head
            )
        ):
            self._state = GateState.REFOLDING
            prompt, window = protocols.stated_tokens(head)
            return [Refold("context overflow", prompt, window)]
        actions = self._open([])
        if not clean:
            return self._fail(actions, self._failure(reason), cut=True)
        return self._finish(actions)

    def _failure(self, reason: str) -> str:
        return f"upstream stream failed: {reason}" if reason else "upstream stream failed"

    def _usage_action(self) -> Usage:
        return Usage(self._usage.totals())

    def _drop(self) -> None:
        """DONE: let go of every buffer (the head or tail, the JSON head, the framer's)."""
        self._state = GateState.DONE
        self._buf = bytearray()
        self._json_head = None
        if self._framer is not None:
            self._framer.close()

    def _finish(self, actions: list[Action]) -> list[Action]:
        self._drop()
        actions.append(self._usage_action())
        actions.append(Finish())
        return actions

    def _fail(
        self,
        actions: list[Action],
        message: str,
        *,
        cut: bool = False,
        code: str = protocols.STREAM_ERROR_CODE,
    ) -> list[Action]:
        self._drop()
        if not cut and self._framer is not None:
            if self._spilled:
                # Part of the event already went out: end it so the error parses on its own.
                actions.append(Forward(b"\n\n"))
            actions.append(
                Forward(
                    protocols.inband_error(
                        self._protocol, message, code=code, sequence_number=self._next_seq
                    )
                )
            )
        actions.append(self._usage_action())
        actions.append(Fail(message, cut=cut or self._framer is None))
        return actions


def _whole_data(data: bytes) -> bool:
    """Whether an event's data is complete on its own: ``[DONE]`` or one JSON object."""
    if data == b"[DONE]":
        return True
    try:
        return isinstance(json.loads(data), dict)
    except ValueError:  # JSONDecodeError, UnicodeDecodeError
        return False

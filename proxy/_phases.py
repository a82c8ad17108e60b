"""The phases of an exchange and every legal move between them (docs/design.md §1).

Pure data: :class:`Phase`, the :data:`TRANSITIONS` table and the error an
illegal move raises. :class:`proxy._exchange.Exchange` moves through the table;
nothing else decides a move.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping
from typing import Final

__all__ = ["TRANSITIONS", "IllegalTransition", "Phase"]


class Phase(enum.Enum):
    """Where an exchange is in its life.

    Phases move forward in the order listed, with two loops back: a refold
    goes from ``sent`` to ``prepared`` again, and a fake-completion resend
    from ``accepted`` to ``sent``.
    """

    READING = "reading"
    PARSED = "parsed"
    PREPARED = "prepared"
    SENT = "sent"
    ACCEPTED = "accepted"
    STREAMING = "streaming"
    COMMITTED = "committed"
    CLOSED = "closed"

    # Members are singletons compared by identity: object's hash (C) instead of
    # Enum's (a Python call), as every phase move looks the table up.
    __hash__ = object.__hash__


_EARLY_END: Final = frozenset({Phase.COMMITTED, Phase.CLOSED})

#: Every legal phase move: ``TRANSITIONS[old]`` is the set of phases ``old`` may go to.
#: Forward along the list, plus the loops: ``sent → prepared`` (a refold re-runs
#: prepare after an overflow), ``accepted → sent`` (a fake-completion resend of an
#: accepted stream) and ``sent → sent`` (a resend of a Responses stream held before
#: acceptance). A request without a body goes from ``reading`` straight to ``sent``,
#: a passthrough body from ``parsed``. A refold that shrank nothing goes from
#: ``prepared`` to ``accepted``: the upstream's answer to the last send stands
#: (its error goes to the client). Any phase before ``committed`` may end early
#: (an error answer, a client gone) in ``committed`` or ``closed``.
TRANSITIONS: Final[Mapping[Phase, frozenset[Phase]]] = {
    Phase.READING: frozenset({Phase.PARSED, Phase.SENT}) | _EARLY_END,
    Phase.PARSED: frozenset({Phase.PREPARED, Phase.SENT}) | _EARLY_END,
    Phase.PREPARED: frozenset({Phase.SENT, Phase.ACCEPTED}) | _EARLY_END,
    Phase.SENT: frozenset({Phase.PREPARED, Phase.SENT, Phase.ACCEPTED}) | _EARLY_END,
    Phase.ACCEPTED: frozenset({Phase.SENT, Phase.STREAMING}) | _EARLY_END,
    Phase.STREAMING: _EARLY_END,
    Phase.COMMITTED: frozenset({Phase.CLOSED}),
    Phase.CLOSED: frozenset(),
}


class IllegalTransition(RuntimeError):
    """A phase move that :data:`TRANSITIONS` does not allow (a bug in the caller)."""

    def __init__(self, exchange_id: str, old: Phase, new: Phase) -> None:
        super().__init__(f"{exchange_id}: illegal phase move {old.value} -> {new.value}")
        self.old = old
        self.new = new

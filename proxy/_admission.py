"""Admission before a request body is read, and the reading budget while it is.

:func:`admit` is the one decision taken before a byte of body is read: whether
the proxy takes the request at all (a drain, the descriptor reserve), whether
its declared size and coding are acceptable (413, 415), and whether the
budgets for bodies in flight can take it now (``max_reading_bytes`` for the
heap, ``max_spool_bytes`` for the spool; docs/design.md §1 step 1, §2 "the
spool"). A client that sent ``Expect: 100-continue`` gets its ``100 Continue``
only once :func:`admit` let the request in (RFC 9110 §10.1.1), so a refusal goes
out instead of the interim answer and the upload never starts; a client that
did not ask gets the same refusal, and the connection closes on the unread
body. :class:`ReadingAccount` then charges the bytes as they arrive.
"""

from __future__ import annotations

from typing import Final, NamedTuple

from ._body import BodyBusy, check_content_length
from ._exchange import Exchange
from ._http1 import RequestHead
from ._protocols import Protocol
from ._refusals import CommitBacklog, Draining, SessionRequired, Shed
from ._spool import SpoolBusy
from ._state import AppState

__all__ = ["BodyAdmission", "ReadingAccount", "admit", "admit_session", "over_reading_budget"]

#: Methods whose request is read as a body even when the head frames none.
_BODY_METHODS: Final = frozenset({"POST", "PUT", "PATCH"})


class BodyAdmission(NamedTuple):
    """A body :func:`admit` let in (immutable; a NamedTuple, built in one C call).

    Attributes:
        declared: the declared ``Content-Length`` in bytes (0: none declared).
        encoding: the ``Content-Encoding`` fields joined with ``", "`` (``None``: none).
    """

    declared: int
    encoding: str | None


def admit(state: AppState, head: RequestHead, *, shed: bool = False) -> BodyAdmission | None:
    """Let the request in, or raise the refusal to answer before its body is read.

    ``shed``: the connection came from the descriptor reserve. Returns the
    body's admission, or ``None`` when the request has no body to read. Checks
    nothing that needs the body (the session, which a body may name, is the
    app's, after the read). Counts a spool refusal in ``state.spool.busy``.

    Raises:
        Draining: the proxy is shutting down (503 ``proxy_shutdown``).
        Shed: ``shed`` (503 ``fd_reserve``).
        proxy._body.BodyError: 413 ``too_large`` for a declared length over
            ``max_body_bytes``; 415 for a coding the proxy cannot decode; 503
            ``busy`` when ``max_reading_bytes`` cannot take the body now; 503
            ``spool_busy`` when ``max_spool_bytes`` cannot.
    """
    if state.draining:
        raise Draining()
    if shed:
        raise Shed()
    if head.method not in _BODY_METHODS and not head.expects_body:
        return None
    settings = state.settings
    codings = head.headers.getall("Content-Encoding", [])
    encoding = ", ".join(codings) if codings else None
    check_content_length(head.content_length, encoding, settings.max_body_bytes)
    declared = head.content_length or 0
    spool = state.spool
    # A body the spool takes from its first byte (a plain declared length over the
    # threshold) never takes heap: max_spool_bytes admits it, not the heap budget.
    spooled_at_once = encoding is None and spool.wants(declared)
    if not spooled_at_once and over_reading_budget(state, declared):
        raise BodyBusy()
    if not spool.admits(declared):
        spool.busy += 1
        raise SpoolBusy()
    return BodyAdmission(declared, encoding)


def admit_session(state: AppState, protocol: Protocol, sid: str | None) -> None:
    """Let the request in once its session is known (after the body, which may name it).

    The session's tombstone is checked on entering its admission
    (:meth:`proxy._state.AppState.admitted`), not here.

    Raises:
        SessionRequired: ``require_session`` is set, the route is an exchange and
            no session id was found (400 ``session_required``).
        CommitBacklog: the session's pending commits and its exchanges in flight
            reach ``max_pending_commits`` (503 ``commit_backlog``).
    """
    settings = state.settings
    if sid is None:
        if settings.require_session and protocol.is_exchange:
            raise SessionRequired()
        return
    backlog = settings.max_pending_commits
    # The session's commits are booked one at a time under its lock: a hook slower
    # than the session's request rate would queue records without bound. Its
    # exchanges in flight count too: each one's commit is on its way.
    if backlog and state.commits.pending_for(sid) + state.registry.in_flight_of(sid) >= backlog:
        raise CommitBacklog(backlog)


def over_reading_budget(state: AppState, declared: int) -> bool:
    """Whether a body declaring ``declared`` bytes cannot fit in ``max_reading_bytes`` now.

    ``state.reading_bytes`` counts bytes *received* by the reads in progress (a
    declaration reserves no memory, so it is not charged); a body whose declared
    size would not fit next to them is refused before its upload. One body is
    always admitted (the limit per body is ``max_body_bytes``).
    """
    reading = state.reading_bytes
    return reading > 0 and reading + declared > state.settings.max_reading_bytes


class ReadingAccount:
    """Charges one body read's received heap bytes to the shared ``max_reading_bytes`` budget.

    ``grow`` is the reader's ``on_growth`` callback: the bytes the body buffer
    grew by are charged as they arrive, to the app's total and the exchange's
    held bytes. Past the budget, a read that shares it with others ends with
    :class:`~proxy._body.BodyBusy` (503); a read alone may grow to ``max_body_bytes``.
    ``spooled`` is called when the body moves to the spool: what it charged is
    returned and its later bytes are the spool's (``max_spool_bytes``), not the
    heap budget's, since they no longer take memory. ``settle`` returns
    everything charged (idempotent); call it in ``finally``.
    """

    __slots__ = ("_charged", "_ex", "_spooled", "_state")

    def __init__(self, state: AppState, ex: Exchange) -> None:
        self._state = state
        self._ex = ex
        self._charged = 0
        self._spooled = False

    def spooled(self) -> None:
        """The body now lives in the spool: stop charging the heap budget for it."""
        self._spooled = True
        self.settle()

    def grow(self, nbytes: int) -> None:
        """The body buffer grew by ``nbytes`` bytes.

        Raises:
            proxy._body.BodyBusy: the budget is spent and other reads share it.
        """
        state = self._state
        self._ex.count_received(nbytes)
        if self._spooled:
            return
        self._charged += nbytes
        state.reading_bytes += nbytes
        if (
            state.reading_bytes > state.settings.max_reading_bytes
            and state.reading_bytes > self._charged
        ):
            raise BodyBusy()

    def settle(self) -> None:
        """Return everything charged to the budget (idempotent)."""
        self._state.reading_bytes -= self._charged
        self._charged = 0

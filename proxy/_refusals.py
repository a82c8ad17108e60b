"""One table from the errors an exchange can end with to the answers the client gets.

Every way the proxy refuses or fails an exchange before its answer is relayed
is a row of :data:`ANSWERS`: the status, the error code, the outcome booked,
whether the connection closes after it, whether an answer already begun is cut
instead, and the side effect the app performs (a counter, a rate-limited log
line). :func:`rule_for` finds an error's row along its class hierarchy (the
most specific row wins); :func:`resolve` turns row and error into the
:class:`Refusal` the app answers with (proxy/_app.py). The answer itself is JSON
in the client's protocol shape (docs/design.md §7); a 503 carries
``Retry-After``.

The refusals decided by the proxy itself (a drain, the descriptor reserve, a
missing session id, a session's commit backlog) are the exceptions defined
here, raised by the admission steps (proxy/_admission.py, proxy/_app.py), so
they go through the same table as the errors of the body reader, the parser,
the registry and the proxy's own bugs.
"""

from __future__ import annotations

import dataclasses
import enum
from collections.abc import Mapping
from typing import Final

from ._body import BodyError, BodyFraming, BodyIncomplete, BodyMemory
from ._cancel import PROXY_SHUTDOWN
from ._fdlimit import EXHAUSTED_MESSAGE
from ._plugins import Outcome
from ._sessions import SessionClosed
from ._spool import SpoolFull, SpoolNoDescriptor
from ._wire import WireError

__all__ = [
    "ANSWERS",
    "COMMIT_BACKLOG",
    "CommitBacklog",
    "Draining",
    "Effect",
    "Refusal",
    "Refused",
    "Rule",
    "SessionRequired",
    "Shed",
    "resolve",
    "rule_for",
]

#: The error code of a request refused because its session's commits are behind
#: (``max_pending_commits``); such a refusal is not booked (proxy/_app.py, ``_book``).
COMMIT_BACKLOG: Final = "commit_backlog"


class Refused(Exception):
    """A refusal the proxy decides itself; its message is safe to show the client."""


class Draining(Refused):
    """The proxy is shutting down: no new exchange starts (docs/design.md §6)."""

    def __init__(self) -> None:
        super().__init__(PROXY_SHUTDOWN.message)


class Shed(Refused):
    """The connection came from the descriptor reserve (proxy/_fdlimit.py): no body is read."""

    def __init__(self) -> None:
        super().__init__(EXHAUSTED_MESSAGE)


class SessionRequired(Refused):
    """``require_session`` is set and the request names no session."""

    def __init__(self) -> None:
        super().__init__("a session id is required")


class CommitBacklog(Refused):
    """The session has ``backlog`` (``max_pending_commits``) commits pending or on their way."""

    def __init__(self, backlog: int) -> None:
        plural = "" if backlog == 1 else "s"
        super().__init__(f"the session's bookkeeping is behind ({backlog} pending commit{plural})")


class Effect(enum.Enum):
    """What the app does beside answering (counters and logs live in the app's state)."""

    NONE = "none"
    #: The client hung up mid-body: outcome ``client_gone``, a warning, a disconnect counted.
    GONE_MID_BODY = "gone_mid_body"
    #: Memory could not be had: ``context_proxy_memory_refused_total``, one line per 10 s.
    MEMORY = "memory"
    #: The spool's disk is full: ``context_proxy_spool_full_total``.
    SPOOL_FULL = "spool_full"
    #: No descriptor left: ``context_proxy_fd_exhausted_total``.
    FD_EXHAUSTED = "fd_exhausted"
    #: A bug: logged with the raising code's location (never the error's text), counted.
    INTERNAL = "internal"


@dataclasses.dataclass(frozen=True, slots=True)
class Rule:
    """One row of :data:`ANSWERS`.

    Attributes:
        status: the HTTP status; ``None``: the error's own (a
            :class:`~proxy._body.BodyError`'s ``status``).
        code: the error code in the body and the record; ``None``: the error's
            ``kind``.
        message: the message for the client; ``None``: the error's own text
            (made safe to show where it is raised). ``{exchange}`` stands for
            the exchange id.
        outcome: the outcome booked.
        close: the connection closes after the answer: the request's body may
            not have been read to its end (RFC 9112 §9.6).
        cut: once the answer has begun (``streaming``), close the connection
            instead, so the client sees a cut answer, not a spliced one.
        retry_after: ``Retry-After`` is the error's (a tombstone's remaining
            TTL) instead of the ``retry_after`` setting.
        effect: what the app does beside answering.
    """

    status: int | None
    code: str | None
    outcome: Outcome = Outcome.REJECTED
    message: str | None = None
    close: bool = False
    cut: bool = False
    retry_after: bool = False
    effect: Effect = Effect.NONE


#: Error class -> its answer. Looked up along the error's class hierarchy, so a
#: subclass without a row of its own answers as its closest listed base; ``Exception``
#: is the last resort (a bug: 500). A body error closes the connection: the rest of
#: the body was never read, and draining it would cost what the refusal saved.
ANSWERS: Final[Mapping[type[BaseException], Rule]] = {
    Draining: Rule(503, PROXY_SHUTDOWN.code),
    Shed: Rule(503, "fd_reserve", close=True, effect=Effect.FD_EXHAUSTED),
    SessionRequired: Rule(400, "session_required"),
    CommitBacklog: Rule(503, COMMIT_BACKLOG),
    SessionClosed: Rule(503, "session_closed", message="session closed", retry_after=True),
    WireError: Rule(400, "invalid_json"),
    BodyIncomplete: Rule(None, None, close=True, effect=Effect.GONE_MID_BODY),
    # The client broke the framing but is still there: a refusal, not a hang-up.
    BodyFraming: Rule(None, None, close=True),
    BodyMemory: Rule(None, None, close=True, effect=Effect.MEMORY),
    SpoolFull: Rule(None, None, close=True, effect=Effect.SPOOL_FULL),
    SpoolNoDescriptor: Rule(None, None, close=True, effect=Effect.FD_EXHAUSTED),
    BodyError: Rule(None, None, close=True),
    # Past the body read (its own MemoryError is a BodyMemory): parsing the body, a
    # plugin's prepare, the relay. Pressure, not a bug: a 503 to retry.
    MemoryError: Rule(
        503,
        BodyMemory.kind,
        Outcome.ERROR,
        message=BodyMemory().message,
        close=True,
        cut=True,
        effect=Effect.MEMORY,
    ),
    Exception: Rule(
        500,
        "internal_error",
        Outcome.ERROR,
        message="internal proxy error (exchange {exchange})",
        close=True,
        cut=True,
        effect=Effect.INTERNAL,
    ),
}


@dataclasses.dataclass(frozen=True, slots=True)
class Refusal:
    """An error's answer, resolved: what to send and book (all of it safe to show).

    ``retry_after`` is a ``Retry-After`` value in whole seconds, or ``None`` for
    the ``retry_after`` setting (sent with every 503).
    """

    status: int
    code: str
    message: str
    rule: Rule
    retry_after: str | None = None


def rule_for(error: BaseException) -> Rule:
    """The row of :data:`ANSWERS` for ``error``: its own class's, else its closest base's.

    Raises:
        KeyError: ``error`` is no ``Exception`` (a ``BaseException`` such as a
            cancellation is control flow, not an error to answer).
    """
    for cls in type(error).__mro__:
        rule = ANSWERS.get(cls)
        if rule is not None:
            return rule
    raise KeyError(type(error).__name__)


def resolve(error: BaseException, exchange_id: str) -> Refusal:
    """The :class:`Refusal` for ``error`` in exchange ``exchange_id``.

    Raises:
        KeyError: as :func:`rule_for`.
        ValueError: a row leaves the status or code to an error that has none
            (a row for a class that is no :class:`~proxy._body.BodyError`).
    """
    rule = rule_for(error)
    status, code = rule.status, rule.code
    if status is None or code is None:
        if not isinstance(error, BodyError):
            raise ValueError(f"{type(error).__name__}: its row names no status or code")
        status = error.status if status is None else status
        code = error.kind if code is None else code
    message = str(error) if rule.message is None else rule.message.format(exchange=exchange_id)
    retry_after = None
    if rule.retry_after and isinstance(error, SessionClosed):
        # Retrying is pointless until the tombstone expires: say when that is.
        retry_after = error.retry_after_header
    return Refusal(status, code, message, rule, retry_after)

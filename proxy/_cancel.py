"""Why a handler was cancelled: an orderly stop, or the client gone.

Two kinds of cancellation reach an exchange's task. An orderly stop (a
session shutdown, the process drain) carries a marker as the cancel message,
and the client still gets a well-formed end in its own protocol. Any other
cancellation means the client hung up: the server edge (:mod:`proxy._front`)
cancels the handler's task when its connection is lost.
"""

from __future__ import annotations

import asyncio
import dataclasses
from typing import Final

from ._sessions import shutdown_cause

__all__ = [
    "PROXY_SHUTDOWN",
    "SESSION_CLOSED",
    "SHUTDOWN_CANCEL",
    "OrderlyStop",
    "orderly_cancel_reason",
]


@dataclasses.dataclass(frozen=True, slots=True)
class OrderlyStop:
    """Why an exchange was stopped on purpose: text for people, a code for programs.

    ``code`` is what the client's error carries (OpenAI ``error.code``, a
    Responses error event's ``code``); the Anthropic shape has no code field,
    so there only ``message`` says it.
    """

    message: str
    code: str


#: A ``DELETE /admin/sessions/{id}`` (or a cluster close) cut the exchange.
SESSION_CLOSED: Final = OrderlyStop("session closed", "session_closed")
#: The process drain's grace ran out.
PROXY_SHUTDOWN: Final = OrderlyStop("proxy shutting down", "proxy_shutdown")

#: Prefix of the cancellation message of an orderly stop (see :func:`orderly_cancel_reason`).
SHUTDOWN_CANCEL: Final = "context-proxy: proxy shutting down"


def orderly_cancel_reason(exc: asyncio.CancelledError) -> OrderlyStop | None:
    """Why the handler was cancelled, if it was an orderly stop; ``None`` otherwise.

    An orderly stop is a session shutdown (the registry cancels with a
    :class:`~proxy._sessions.SessionShutdown` marker: :data:`SESSION_CLOSED`) or
    the process drain (:data:`SHUTDOWN_CANCEL`: :data:`PROXY_SHUTDOWN`).
    """
    if shutdown_cause(exc) is not None:
        return SESSION_CLOSED
    if exc.args and exc.args[0] == SHUTDOWN_CANCEL:
        return PROXY_SHUTDOWN
    return None

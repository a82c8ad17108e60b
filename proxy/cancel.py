"""Why a handler was cancelled: an orderly stop, or the client gone.

Two kinds of cancellation reach an exchange's task. An orderly stop (a
session shutdown, the process drain) carries a marker as the cancel message,
and the client still gets a well-formed end in its own protocol. Any other
cancellation means the client hung up (aiohttp's handler cancellation).
"""

from __future__ import annotations

import asyncio
from typing import Final

from .sessions import shutdown_cause

__all__ = ["SHUTDOWN_CANCEL", "orderly_cancel_reason"]

#: Prefix of the cancellation message of an orderly stop (see :func:`orderly_cancel_reason`).
SHUTDOWN_CANCEL: Final = "context-proxy: proxy shutting down"


def orderly_cancel_reason(exc: asyncio.CancelledError) -> str | None:
    """Why the handler was cancelled, if it was an orderly stop; ``None`` otherwise.

    An orderly stop is a session shutdown (the registry cancels with a
    :class:`~proxy.sessions.SessionShutdown` marker: ``"session closed"``) or
    the process drain (:data:`SHUTDOWN_CANCEL`: ``"proxy shutting down"``).
    """
    if shutdown_cause(exc) is not None:
        return "session closed"
    if exc.args and exc.args[0] == SHUTDOWN_CANCEL:
        return "proxy shutting down"
    return None

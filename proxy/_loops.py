"""The event loop a server process runs on: asyncio's, or uvloop when asked for and importable.

uvloop (libuv under asyncio's API; the ``uvloop`` extra) does the socket work in
C: at 50 concurrent 1 KB requests it cuts about 15 % of the proxy's CPU per
request, but as much of the naive proxy's on the same loop, and an open stream
costs ~5 KiB more (``context-proxy bench overhead --event-loop uvloop``). A
platform without it (not installed, Windows) falls back to asyncio's loop.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Coroutine
from typing import Any, Final, Literal, TypeVar

__all__ = ["EVENT_LOOPS", "EventLoopName", "loop_factory", "run"]

EventLoopName = Literal["uvloop", "asyncio"]
#: The accepted values of the ``event_loop`` setting.
EVENT_LOOPS: Final[tuple[EventLoopName, ...]] = ("uvloop", "asyncio")

_T = TypeVar("_T")
log = logging.getLogger(__name__)


def loop_factory(name: EventLoopName) -> tuple[Callable[[], asyncio.AbstractEventLoop], str]:
    """``(factory, used)``: a new-loop factory for ``name`` and the loop it really makes.

    ``"uvloop"`` gives ``uvloop.new_event_loop`` when uvloop imports, else
    asyncio's default loop with ``used == "asyncio"``.
    """
    if name == "uvloop":
        try:
            import uvloop
        except ImportError:
            return asyncio.new_event_loop, "asyncio"
        return uvloop.new_event_loop, "uvloop"
    return asyncio.new_event_loop, "asyncio"


def run(main: Coroutine[Any, Any, _T], name: EventLoopName) -> _T:
    """Run ``main`` to completion on a new loop of kind ``name`` (see :func:`loop_factory`)."""
    factory, used = loop_factory(name)
    if used != name:
        log.warning("event_loop = %r is not importable here: running on %r", name, used)
    with asyncio.Runner(loop_factory=factory) as runner:
        return runner.run(main)

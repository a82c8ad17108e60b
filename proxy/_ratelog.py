"""A warning that recurs at the rate of requests, logged at most once per window with a count.

Under memory pressure every upload may fail the same way; one line per
request would add log volume exactly when the process can least afford it.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable

__all__ = ["RateLimitedWarning"]


class RateLimitedWarning:
    """One WARNING per ``window`` seconds for a recurring condition, then a summary.

    :meth:`hit` logs ``message`` at once if the last line is ``window``
    seconds old or more; hits in between are only counted, and once the window
    ends (on the event loop's timer, or at the next hit) one line says how many
    there were (``... (N in the last 10s)``). ``message`` is a fixed text of
    the caller's (no request data: never a header value or body byte).
    ``clock`` is monotonic seconds.

    Args:
        logger: where the lines go.
        message: the condition's words, e.g. ``"upload refused: out of memory"``.
        window: seconds between lines (> 0).

    Raises:
        ValueError: ``window`` is not positive.
    """

    __slots__ = ("_clock", "_last", "_logger", "_message", "_suppressed", "_timer", "window")

    def __init__(
        self,
        logger: logging.Logger,
        message: str,
        *,
        window: float = 10.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if window <= 0:
            raise ValueError("window must be > 0 seconds")
        self._logger = logger
        self._message = message
        self.window = window
        self._clock = clock
        self._last = float("-inf")
        self._suppressed = 0
        self._timer: asyncio.TimerHandle | None = None

    def hit(self) -> bool:
        """Count one occurrence; whether a line was written for it."""
        now = self._clock()
        if now - self._last >= self.window:
            self._write(now, first=True)
            return True
        self._suppressed += 1
        if self._timer is None:
            try:
                loop = asyncio.get_running_loop()
            except RuntimeError:
                return False  # no loop: the next hit after the window writes the count
            self._timer = loop.call_later(self._last + self.window - now, self._flush)
        return False

    def _flush(self) -> None:
        self._timer = None
        if self._suppressed:
            self._write(self._clock(), first=False)

    def _write(self, now: float, *, first: bool) -> None:
        count, self._suppressed = self._suppressed, 0
        if first and self._timer is not None:
            self._timer.cancel()
            self._timer = None
        if count:
            # A hit past the window that finds a count not yet written counts itself in.
            total = count + 1 if first else count
            self._logger.warning("%s (%d in the last %gs)", self._message, total, self.window)
        else:
            self._logger.warning("%s", self._message)
        self._last = now

    def close(self) -> None:
        """Cancel the pending summary (its count is dropped)."""
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

"""The cyclic garbage collector's settings for a server process (CPython's ``gc`` module).

Why (measured with ``context-proxy bench overhead --slow-streams 4000``, Python 3.11):
a full collection (the oldest generation) visits every container object the process
tracks and stops the event loop while it runs. An open stream keeps about 100 of
them (connection protocols and parsers, their bound callbacks, transports, timer
handles with their contexts, the coroutine chain, the exchange's objects), so at
4,000 open streams a full collection visits ~400,000 objects: 150-450 ms on a
loaded 2-core machine, and every stream's next event waits that long.

CPython runs one when the oldest generation has seen ``threshold2`` (default 10)
collections of the middle one *and* the objects that reached it since the last
full collection are over a quarter of those that were there (``gc`` docs,
"gc.set_threshold"). While streams open (a burst of clients, or the steady
arrival of new ones), every opened stream's objects reach the oldest generation,
so the default made a full collection about every second of a 4,000-stream
ramp, each one longer than the last: six pauses of 40-480 ms in four seconds.

Two settings, applied once at start-up by :func:`tune_collector`:

* **Freeze what start-up made** (``gc.freeze()``): modules, classes, settings and
  the import machinery's objects (~48,000 on this proxy) live as long as the
  process; moved to the permanent generation, no collection visits them again.
* **Full collections ten times rarer** (``threshold2`` 100 instead of 10): the
  young generations are collected as before (most cycles die young: a gen-0 or
  gen-1 pass takes under a millisecond to a few), the full pass waits for 100
  middle-generation passes. Garbage cycles that lived long enough to reach the
  oldest generation wait longer before they are freed; the proxy's buffers are
  released by reference counting, not by the collector (docs/design.md §2), so
  this moves no request memory's lifetime.

And one habit, :class:`IdleCollector`: a full collection when the proxy is quiet
(no answer ended for a moment: the allocator's idle trim, proxy/_alloc.py) with
few exchanges in flight, at most every ``min_interval`` seconds. Then it visits
few objects (milliseconds), frees the cycles that reached the oldest generation,
and starts the count of middle-generation passes again, so the next burst of
streams does not find a full collection already due.
"""

from __future__ import annotations

import gc
import time
from collections.abc import Callable
from typing import Final

__all__ = ["FULL_COLLECTION_EVERY", "IdleCollector", "drop_transport_cycle", "tune_collector"]

#: Collections of the middle generation between two full collections, at least.
FULL_COLLECTION_EVERY: Final = 100


def tune_collector() -> None:
    """Collect once, freeze every object alive now, and make full collections rarer.

    Call it once, in the server process, after the imports and before serving
    (objects made later are collected as usual). The young generations'
    thresholds are left as they are. Raises nothing.
    """
    gc.collect()
    gc.freeze()
    young, middle, _ = gc.get_threshold()
    gc.set_threshold(young, middle, FULL_COLLECTION_EVERY)


def drop_transport_cycle(transport: object) -> None:
    """Break the reference cycle a closed asyncio socket transport keeps; call it from
    the protocol's ``connection_lost``. Raises nothing.

    CPython 3.11's selector transport keeps its own bound method (``_read_ready_cb``,
    the read callback chosen for the protocol), so the transport, its socket object and
    its ``extra`` dict outlive the connection until a collection finds them (3.12 drops
    it in ``_call_connection_lost``). No read comes after ``connection_lost``: the
    transport removed its reader before scheduling it. Other transports (uvloop's,
    TLS) have no such attribute and are left alone.
    """
    if getattr(transport, "_read_ready_cb", None) is not None:
        transport._read_ready_cb = None  # type: ignore[attr-defined]


class IdleCollector:
    """A full collection at quiet moments, when it is cheap; call it when the proxy is quiet.

    ``in_flight`` returns the number of exchanges in flight now. A call collects
    (``gc.collect()``, every generation) only when at most ``max_in_flight`` are,
    and ``min_interval`` seconds (by ``clock``) have passed since the last
    collection it ran, or since it was made: a short-lived embedded proxy (a
    test's) never pays for one. Raises nothing.
    """

    __slots__ = ("_clock", "_in_flight", "_last", "collections", "max_in_flight", "min_interval")

    def __init__(
        self,
        in_flight: Callable[[], int],
        *,
        max_in_flight: int = 16,
        min_interval: float = 30.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._in_flight = in_flight
        self.max_in_flight = max_in_flight
        self.min_interval = min_interval
        self._clock = clock
        self._last = clock()
        #: Full collections this collector ran.
        self.collections = 0

    def __call__(self) -> bool:
        """Collect now if the proxy is quiet enough; returns whether it collected."""
        if self._clock() - self._last < self.min_interval:
            return False
        if self._in_flight() > self.max_in_flight:
            return False
        gc.collect()
        self._last = self._clock()
        self.collections += 1
        return True

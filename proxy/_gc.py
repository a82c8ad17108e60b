"""The cyclic garbage collector's settings for a server process (CPython's ``gc`` module).

Why (measured with ``context-proxy bench overhead --slow-streams 4000``, Python 3.11):
a full collection (the oldest generation) visits every container object the process
tracks and stops the event loop while it runs. An open stream keeps about 90 of
them (connection protocols and parsers, their bound callbacks, transports, timer
handles with their contexts, the coroutine chain, the exchange's objects), so at
4,000 open streams a full collection visits ~400,000 objects: 150-450 ms on a
loaded 2-core machine, and every stream's next event waits that long.

**The proxy makes no garbage cycles**: an exchange's objects, its connections'
included, are freed by reference counting the moment it ends
(``tests/resources/test_cycles.py`` runs every kind of exchange with the collector
off and ``gc.collect()`` finds nothing; the cycles CPython 3.11 and httptools would
leave are broken where they are made, see :func:`drop_transport_cycle`). So a full
collection finds (nearly) nothing to free and is almost pure pause; what it is still
for is the cycles a plugin or a library might make.

CPython runs one when the oldest generation has seen ``threshold2`` (default 10)
collections of the middle one *and* the objects that reached it since the last
full collection are over a quarter of those that were there (``gc`` docs,
"gc.set_threshold"). Young collections run every 700 tracked objects made and not
freed (``threshold0``; the middle one every 10 of those), and 4,000 streams
opening make ~380,000: with the default, a full collection about every second of
a 4,000-stream ramp, each one longer than the last (six pauses of 40-480 ms in
four seconds). Streaming on, the objects that live from one event to the next
(read waiters, buffers) keep the young collections going: ~4 middle-generation
passes a second at 4,000 events a second, measured.

When a full collection runs, then:

* **Start-up's objects are out of it** (``gc.freeze()`` by :func:`tune_collector`):
  modules, classes, settings and the import machinery's objects (~48,000 on this
  proxy) live as long as the process; in the permanent generation no collection
  visits them again.
* **When the proxy is quiet** (:class:`IdleCollector` called by the allocator's
  idle trim, proxy/_alloc.py: no answer ended for a moment) with at most
  ``max_in_flight`` exchanges in flight, at most every ``min_interval`` (30) s.
  Then it visits few objects (milliseconds) and starts CPython's counts again,
  so the next burst of streams does not find a full collection already due.
* **Automatically, a hundred times rarer than CPython's default**
  (``threshold2`` :data:`FULL_COLLECTION_EVERY` = 1,000 instead of 10): at 4,000
  streaming streams that is one every ~4 minutes instead of every ~25 s (the
  100 of before: a pause inside most 15 s measurement windows of the benchmark).
  This is also the bound on growth: at most ~7 million objects (700 x 10 x
  1,000) reach the oldest generation between two full collections, whatever the
  clock says, and fewer when they are not a quarter of what is there.
* **At least every** ``max_interval`` (:data:`MAX_FULL_INTERVAL`, 600) **s**, busy
  or not (:meth:`IdleCollector.start`): the safety valve on time, so that cycles
  a plugin makes under constant load (the proxy never quiet, the counts rising
  slowly) live at most ten minutes. One timer per process; a quiet collection
  pushes it back.

The proxy's buffers are released by reference counting, not by the collector
(docs/design.md §2): none of this moves a request's memory lifetime.
"""

from __future__ import annotations

import asyncio
import gc
import time
import typing
from collections.abc import Callable
from typing import Final

__all__ = [
    "FULL_COLLECTION_EVERY",
    "MAX_FULL_INTERVAL",
    "IdleCollector",
    "drop_transport_cycle",
    "tune_collector",
]

#: Collections of the middle generation between two automatic full collections, at least.
FULL_COLLECTION_EVERY: Final = 1000
#: Seconds between two full collections, at most (:meth:`IdleCollector.start`).
MAX_FULL_INTERVAL: Final = 600.0


class _Timer(typing.Protocol):
    def cancel(self) -> None: ...


#: ``call_later(delay, callback)``: the event loop's, or a test's.
Schedule = Callable[[float, Callable[[], None]], _Timer]


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
    """When full collections run beyond CPython's own: when the proxy is quiet, and at
    least every ``max_interval`` seconds (see the module docstring).

    ``in_flight`` returns the number of exchanges in flight now. A call (the quiet
    hook) collects (``gc.collect()``, every generation) only when at most
    ``max_in_flight`` are, and ``min_interval`` seconds (by ``clock``) have passed
    since the last collection it ran, or since it was made: a short-lived embedded
    proxy (a test's) never pays for one. After :meth:`start`, a timer also collects
    once ``max_interval`` seconds passed since the last collection it ran, however
    busy the proxy is. Raises nothing.
    """

    __slots__ = (
        "_clock",
        "_in_flight",
        "_last",
        "_schedule",
        "_timer",
        "collections",
        "max_in_flight",
        "max_interval",
        "min_interval",
        "valve_collections",
    )

    def __init__(
        self,
        in_flight: Callable[[], int],
        *,
        max_in_flight: int = 16,
        min_interval: float = 30.0,
        max_interval: float = MAX_FULL_INTERVAL,
        clock: Callable[[], float] = time.monotonic,
        schedule: Schedule | None = None,
    ) -> None:
        self._in_flight = in_flight
        self.max_in_flight = max_in_flight
        self.min_interval = min_interval
        self.max_interval = max_interval
        self._clock = clock
        # None: the running loop's call_later, looked up by start().
        self._schedule = schedule
        self._timer: _Timer | None = None
        self._last = clock()
        #: Full collections this collector ran (quiet ones and the valve's).
        self.collections = 0
        #: Of those, the ones the ``max_interval`` timer ran.
        self.valve_collections = 0

    def __call__(self) -> bool:
        """Collect now if the proxy is quiet enough; returns whether it collected."""
        if self._clock() - self._last < self.min_interval:
            return False
        if self._in_flight() > self.max_in_flight:
            return False
        self._collect()
        return True

    def _collect(self) -> None:
        gc.collect()
        self._last = self._clock()
        self.collections += 1

    def start(self) -> None:
        """Arm the ``max_interval`` timer (on the running event loop unless ``schedule``
        was given); idempotent. Without a running loop or schedule, does nothing."""
        if self._timer is None:
            self._arm(self.max_interval - (self._clock() - self._last))

    @property
    def armed(self) -> bool:
        """Whether the ``max_interval`` timer is armed (between :meth:`start` and :meth:`stop`)."""
        return self._timer is not None

    def stop(self) -> None:
        """Cancel the timer (at shutdown); idempotent."""
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def _arm(self, delay: float) -> None:
        schedule = self._schedule
        if schedule is None:
            try:
                schedule = asyncio.get_running_loop().call_later
            except RuntimeError:
                return
        self._timer = schedule(max(delay, 0.0), self._on_timer)

    def _on_timer(self) -> None:
        self._timer = None
        left = self.max_interval - (self._clock() - self._last)
        if left > 0:
            # A quiet collection ran meanwhile: the interval counts from it.
            self._arm(left)
            return
        self._collect()
        self.valve_collections += 1
        self._arm(self.max_interval)

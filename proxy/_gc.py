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
"""

from __future__ import annotations

import gc
from typing import Final

__all__ = ["FULL_COLLECTION_EVERY", "tune_collector"]

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

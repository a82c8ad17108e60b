"""Give the memory of released request bodies back to the operating system (glibc malloc).

Why this exists (measured with ``context-proxy bench memory --sequential``): after
a large exchange is released, the proxy's RSS can stay up by a whole body size,
although Python freed every buffer (tracemalloc agrees). Three things cause it,
two of them glibc behaviours (``mallopt(3)``, "M_MMAP_THRESHOLD" and
"M_TRIM_THRESHOLD"):

1. **Dynamic mmap threshold.** Blocks of at least ``M_MMAP_THRESHOLD`` bytes
   (128 KiB at start) get their own ``mmap`` and go back to the kernel on
   ``free``. But freeing such a block *raises* the threshold to its size (up to
   32 MiB on 64-bit), so from the second large request on, body buffers below
   32 MiB come from the heap, and a freed heap block is only returned when it
   sits at the very top of the heap. The 16 MiB body of request 2 then stays
   resident forever. Fix: set the threshold explicitly (:meth:`Allocator.tune`),
   which turns the dynamic adjustment off.
2. **Fragmented heap.** A plugin that reads the body makes the proxy parse it:
   hundreds of thousands of strings and dicts below any mmap threshold, spread
   over the heap. Freed, they leave free chunks between live ones; only
   ``malloc_trim(0)`` hands those pages back (it ``madvise``\\ s every free page
   of every arena, not just the top; glibc >= 2.8). Fix: :meth:`Allocator.released`
   after an exchange let go of a large body, and after a body was read (each of
   its bytes passed through a socket read, a parser copy and a read piece, all
   freed by then: about 0.1 of the body left resident while it is sent and,
   when a resend is armed, kept).
3. **An idle process keeps freed heap.** A request's socket reads, parser
   copies, send buffers and answer events (and the first request's lazy
   imports) are small blocks, freed but resident; below ``trim_min_bytes``
   nothing trims them. An idle proxy would hold them for good, and the next
   large request would reuse them without its RSS growing (which flatters any
   measurement taken against that idle RSS). Fix: the server calls
   :meth:`Allocator.idle` whenever an answer ends (and once started), and
   ``idle_after`` seconds later, if no answer ended since, the heap is
   trimmed: one lazily re-armed timer, one trim per quiet period. Under load
   answers keep ending and it never fires; with streams open and nothing
   ending (a burst of long answers) it trims once.

``malloc_trim`` walks every free chunk of every arena while holding its lock, on
the event loop's thread: measured 30-400 µs on the ~45 MB heap of a proxy that
just served a 1 MiB body, a few milliseconds on a 100 MB heap, tens on a very
fragmented 500 MB one. So a release trims only once at least
``trim_min_bytes`` were released, and trims take at most ``max_share`` of the
time: after a trim that took *d* seconds the next waits ``d / max_share``
(and at least ``min_interval``); a release inside that wait schedules one
deferred trim on the running event loop. A release of ``trim_now_bytes`` or
more always trims at once: receiving, hashing and parsing a body that large
costs more than the trim, and the memory it pins matters most.

Releases below ``trim_min_bytes`` still leave freed heap behind, and so do the
socket reads and parser copies of many small requests at once: after a burst
of 500 streams opening together, ~2 KiB a stream that only a trim hands back,
and no answer ends to start the idle trim. So once releases stop for
``quiet_after`` seconds (the burst is over: the streams are idle), one trim
runs, whatever the byte counters say: at most one per quiet period, and none
while the process stays idle (only a release arms the timer; it costs one
counter per release).

On a C library without these functions (musl, macOS, Windows) every method is
a no-op that returns ``False``.
"""

from __future__ import annotations

import asyncio
import ctypes
import ctypes.util
import logging
import time
from collections.abc import Callable
from typing import Final, Protocol

__all__ = ["DEFAULT_IDLE_AFTER", "DEFAULT_MMAP_THRESHOLD", "Allocator", "LibC", "load_libc"]

log = logging.getLogger("context_proxy.alloc")

#: The ``mallopt`` parameter number of the mmap threshold, from glibc's ``<malloc.h>``.
M_MMAP_THRESHOLD: Final = -3
#: Blocks of this many bytes or more get their own mapping (freed at once).
#: Large enough that the edges' socket reads and body pieces (<= 256 KiB) stay on the fast heap.
DEFAULT_MMAP_THRESHOLD: Final = 1 << 20
#: Seconds after the last exchange ended at which an idle process trims its freed heap.
DEFAULT_IDLE_AFTER: Final = 0.1


class LibC(Protocol):
    """The two glibc functions used (a ``ctypes.CDLL`` satisfies it; tests pass a fake)."""

    def mallopt(self, param: int, value: int, /) -> int:
        """Set a malloc parameter; returns 1 on success, 0 on error."""

    def malloc_trim(self, pad: int, /) -> int:
        """Return free memory to the OS; returns 1 if any was released, else 0."""


def load_libc() -> LibC | None:
    """The process's glibc, or ``None`` when the C library lacks ``malloc_trim``/``mallopt``."""
    name = ctypes.util.find_library("c") or "libc.so.6"
    try:
        libc = ctypes.CDLL(name)
        libc.malloc_trim.argtypes = [ctypes.c_size_t]
        libc.malloc_trim.restype = ctypes.c_int
        libc.mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
        libc.mallopt.restype = ctypes.c_int
    except (OSError, AttributeError):
        return None
    found: LibC = libc
    return found


class Allocator:
    """Allocator hygiene for one process: call :meth:`tune` at start-up, :meth:`released`
    whenever an exchange drops a buffer, :meth:`idle` whenever an answer ends.

    Build it with :meth:`for_process` (the running C library) or pass ``libc``.

    Args:
        libc: the C library; ``None`` disables everything.
        trim_min_bytes: bytes released (summed since the last trim) before a
            release trims. Default 256 KiB (a body under glibc's 1 MiB mmap
            threshold is on the heap: without a trim it stays resident while its
            answer streams); smaller releases wait for the idle trim.
        trim_now_bytes: bytes released at which a trim runs at once, whatever
            the wait (default 8 MiB).
        max_share: the largest share of time spent trimming (default 0.01): a
            trim that took *d* seconds delays the next release trim by ``d / max_share``.
        min_interval: the least seconds between two release trims (default 0).
        idle_after: seconds from :meth:`idle` to the idle trim (default 0.1).
        quiet_after: seconds without a release after which the heap is trimmed once
            (default 1.0).
        clock: monotonic clock in seconds (injectable for tests); scheduled
            trims wait on the event loop's clock, which must run at its pace.

    Counters: ``trims`` (``malloc_trim`` calls made), ``pending`` (bytes released
    since the last trim).
    """

    __slots__ = (
        "_clock",
        "_idle",
        "_idle_since",
        "_libc",
        "_next",
        "_quiet",
        "_quiet_mark",
        "_releases",
        "_scheduled",
        "idle_after",
        "max_share",
        "min_interval",
        "on_idle",
        "pending",
        "quiet_after",
        "trim_min_bytes",
        "trim_now_bytes",
        "trims",
    )

    def __init__(
        self,
        libc: LibC | None,
        *,
        trim_min_bytes: int = 256 << 10,
        trim_now_bytes: int = 8 << 20,
        max_share: float = 0.01,
        min_interval: float = 0.0,
        idle_after: float = DEFAULT_IDLE_AFTER,
        quiet_after: float = 1.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._libc = libc
        self.trim_min_bytes = trim_min_bytes
        self.trim_now_bytes = trim_now_bytes
        self.max_share = max_share
        self.min_interval = min_interval
        self.idle_after = idle_after
        self.quiet_after = quiet_after
        self._clock = clock
        # Clock time before which a release does not trim (the duty-cycle wait).
        self._next = -float("inf")
        self._scheduled: asyncio.TimerHandle | None = None
        # The idle trim: when the last exchange ended, and its timer (at most one,
        # re-armed when it fires early).
        self._idle_since = -float("inf")
        self._idle: asyncio.TimerHandle | None = None
        # The quiet timer: releases counted, and their count when it was armed.
        self._quiet: asyncio.TimerHandle | None = None
        self._releases = 0
        self._quiet_mark = 0
        self.pending = 0
        self.trims = 0
        #: Called (no arguments) when the idle trim runs: other work that is cheap
        #: while the process is quiet (the server's idle garbage collection, proxy/_gc.py).
        self.on_idle: Callable[[], object] | None = None

    @classmethod
    def for_process(cls) -> Allocator:
        """An allocator on this process's C library (:func:`load_libc`), default thresholds."""
        return cls(load_libc())

    @property
    def available(self) -> bool:
        """Whether the C library offers ``mallopt`` and ``malloc_trim``."""
        return self._libc is not None

    def tune(self, mmap_threshold: int = DEFAULT_MMAP_THRESHOLD) -> bool:
        """Fix glibc's mmap threshold at ``mmap_threshold`` bytes (turning off its dynamic
        raise, see the module docstring). Call once, before serving. Returns success."""
        libc = self._libc
        if libc is None:
            return False
        ok = bool(libc.mallopt(M_MMAP_THRESHOLD, mmap_threshold))
        if not ok:
            log.warning("mallopt(M_MMAP_THRESHOLD, %d) failed", mmap_threshold)
        return ok

    def released(self, nbytes: int) -> bool:
        """An exchange just dropped ``nbytes`` bytes of buffers (raw, parsed, outbound,
        or the read pieces of an ``nbytes``-byte body).

        Trims now when ``trim_now_bytes`` were released since the last trim, or
        ``trim_min_bytes`` and the duty-cycle wait is over; otherwise, with
        ``trim_min_bytes`` released, schedules one trim for when the wait ends
        (on the running event loop, if any). Either way it arms the quiet timer
        (see the module docstring). Returns whether it trimmed now.
        """
        if self._libc is None or nbytes <= 0:
            return False
        self.pending += nbytes
        self._releases += 1
        if self._quiet is None:
            self._arm_quiet()
        if self.pending < self.trim_min_bytes:
            return False
        wait = self._next - self._clock()
        if wait <= 0 or self.pending >= self.trim_now_bytes:
            self.trim()
            return True
        if self._scheduled is None:
            try:
                loop = asyncio.get_running_loop()
            except RuntimeError:
                return False
            self._scheduled = loop.call_later(wait, self._deferred)
        return False

    def _arm_quiet(self) -> None:
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            return
        self._quiet_mark = self._releases
        self._quiet = loop.call_later(self.quiet_after, self._on_quiet)

    def _on_quiet(self) -> None:
        # Re-armed lazily (one timer however many releases): a release since it was
        # armed means the burst goes on.
        self._quiet = None
        if self._releases != self._quiet_mark:
            self._arm_quiet()
        else:
            self.trim()

    def _deferred(self) -> None:
        self._scheduled = None
        if self.pending >= self.trim_min_bytes:
            self.trim()

    def idle(self) -> None:
        """An answer just ended: trim ``idle_after`` seconds from now, unless :meth:`idle`
        is called again first (then from that call). Needs a running loop."""
        if self._libc is None:
            return
        self._idle_since = self._clock()
        if self._idle is None:
            self._arm_idle(self.idle_after)

    def _arm_idle(self, delay: float) -> None:
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            return
        self._idle = loop.call_later(delay, self._on_idle)

    def _on_idle(self) -> None:
        self._idle = None
        now = self._clock()
        # Quiet for idle_after since the last idle() call, and within the duty cycle.
        left = max(self._idle_since + self.idle_after, self._next) - now
        if left > 0:
            self._arm_idle(left)
            return
        if self.on_idle is not None:
            self.on_idle()
        self.trim()

    def trim(self) -> bool:
        """``malloc_trim(0)`` now, whatever the counters say; returns whether memory went back."""
        libc = self._libc
        if libc is None:
            return False
        start = self._clock()
        self.pending = 0
        self.trims += 1
        self._cancel_timers()
        returned = bool(libc.malloc_trim(0))
        end = self._clock()
        self._next = end + max(self.min_interval, (end - start) / self.max_share)
        return returned

    def close(self) -> None:
        """Cancel scheduled trims and the quiet timer (at shutdown; the loop is about to close)."""
        self._cancel_timers()
        if self._quiet is not None:
            self._quiet.cancel()
            self._quiet = None

    def _cancel_timers(self) -> None:
        if self._scheduled is not None:
            self._scheduled.cancel()
            self._scheduled = None
        if self._idle is not None:
            self._idle.cancel()
            self._idle = None

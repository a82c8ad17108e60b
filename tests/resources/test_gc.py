"""The server's garbage-collector settings (proxy/_gc.py): no full collection while
thousands of streams open, what start-up made is out of every collection, and a full
collection while the proxy is quiet.

The settings are process-wide: those checks run in a fresh interpreter.
"""

from __future__ import annotations

import asyncio
import gc
import subprocess
import sys
import time
import weakref
from collections.abc import Callable

from proxy._alloc import Allocator
from proxy._gc import FULL_COLLECTION_EVERY, IdleCollector
from tests.support.lifetime import CHAT, RawConn, closed_port_url, proxy_at
from tests.support.upstream import HoldingUpstream, chat_sse_events

# 4,000 streams opening, each keeping ~100 container objects (what an open stream
# holds: protocols, parsers, callbacks, timers, coroutines): prints the number of
# full collections that ran meanwhile.
_RAMP = """
import gc, sys
from proxy._gc import tune_collector
if sys.argv[1] == "tuned":
    tune_collector()
full = []
gc.callbacks.append(
    lambda phase, info: full.append(1) if phase == "stop" and info["generation"] == 2 else None
)
streams = [[[] for _ in range(100)] for _ in range(4000)]
print(len(full))
"""

# ``context-proxy serve`` up to the point where it would start the event loop.
_SERVE = """
import gc, sys
import proxy._cli as cli
def run(main, name):
    main.close()
    print(gc.get_threshold()[2], gc.get_freeze_count())
cli.run_loop = run
cli.main(["serve", "--port", "0"], standalone_mode=False)
"""


def _python(code: str, *args: str) -> str:
    done = subprocess.run(
        [sys.executable, "-c", code, *args], capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0, done.stderr
    return done.stdout.strip()


def test_thousands_of_streams_opening_cause_no_full_collection() -> None:
    # Each full collection visits every object the process tracks; at 4,000 open
    # streams that stopped the event loop for 40-480 ms, six times in a 4 s ramp.
    assert int(_python(_RAMP, "default")) >= 3  # CPython's own thresholds
    assert int(_python(_RAMP, "tuned")) == 0


def test_serve_freezes_start_up_objects_and_spaces_full_collections() -> None:
    threshold2, frozen = _python(_SERVE).split()
    # A hundred times CPython's 10: at 4,000 streaming streams, one every ~4 minutes.
    assert int(threshold2) == FULL_COLLECTION_EVERY == 1000
    # The imports' modules, classes and functions: tens of thousands of objects.
    assert int(frozen) > 10_000


class _Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


class _Cycle:
    """An object that refers to itself: only the collector frees it."""

    def __init__(self) -> None:
        self.me = self


def test_idle_collector_frees_cycles_only_when_quiet_and_few_exchanges_are_in_flight() -> None:
    clock = _Clock()
    in_flight = [40]
    collector = IdleCollector(lambda: in_flight[0], max_in_flight=16, clock=clock)
    gc.disable()  # only the idle collector may free the cycle here
    try:
        cycle = weakref.ref(_Cycle())
        assert cycle() is not None
        clock.now += 10.0
        in_flight[0] = 0
        assert collector() is False  # not 30 s since it was made: a short-lived proxy
        clock.now += 25.0
        in_flight[0] = 40
        assert collector() is False  # busy: a full collection would visit every stream
        assert cycle() is not None
        in_flight[0] = 16
        assert collector() is True
        assert cycle() is None and collector.collections == 1
        clock.now += 29.0
        in_flight[0] = 0
        assert collector() is False  # at most one every 30 s
        clock.now += 1.0
        assert collector() is True and collector.collections == 2
    finally:
        gc.enable()


class _Timer:
    def __init__(self, delay: float, callback: Callable[[], None]) -> None:
        self.delay = delay
        self.callback = callback
        self.cancelled = False

    def cancel(self) -> None:
        self.cancelled = True


def test_the_valve_collects_at_least_every_max_interval_however_busy() -> None:
    """Under constant load the proxy is never quiet: the timer still runs a full
    collection once ``max_interval`` passed since the last one (a quiet one counts)."""
    clock = _Clock()
    timers: list[_Timer] = []

    def schedule(delay: float, callback: Callable[[], None]) -> _Timer:
        timers.append(_Timer(delay, callback))
        return timers[-1]

    in_flight = [4000]
    collector = IdleCollector(
        lambda: in_flight[0], max_interval=600.0, clock=clock, schedule=schedule
    )
    gc.disable()  # only the collector may free the cycles here
    try:
        collector.start()
        collector.start()  # idempotent: one timer
        assert [t.delay for t in timers] == [600.0] and collector.armed
        cycle = weakref.ref(_Cycle())
        clock.now += 600.0
        assert collector() is False  # the quiet hook: too busy
        timers[-1].callback()
        assert cycle() is None, "busy as it is, the valve collected"
        assert (collector.collections, collector.valve_collections) == (1, 1)
        assert timers[-1].delay == 600.0  # and re-armed for the next interval
        clock.now += 300.0
        in_flight[0] = 0
        assert collector() is True  # a quiet collection meanwhile...
        clock.now += 300.0
        cycle = weakref.ref(_Cycle())
        timers[-1].callback()
        assert cycle() is not None and collector.valve_collections == 1  # ...pushes it back
        assert timers[-1].delay == 300.0
        clock.now += 300.0
        timers[-1].callback()
        assert cycle() is None and collector.valve_collections == 2
        collector.stop()
        assert timers[-1].cancelled and not collector.armed
        collector.stop()  # idempotent
    finally:
        gc.enable()


async def test_a_running_proxy_arms_the_valve_and_its_drain_disarms_it() -> None:
    async with proxy_at(closed_port_url()) as proxy:
        collector = proxy.state.collector
        assert collector.armed and collector.max_interval == 600.0
    assert not collector.armed  # no timer keeps a stopped proxy's state alive


async def test_streams_without_a_session_keep_the_quiet_collection_away() -> None:
    """Open streams make the proxy busy whether or not they belong to a session: a full
    collection then would visit each stream's objects and delay its next event."""
    streams = 20
    async with (
        HoldingUpstream(chat_sse_events()[0], hold_s=30.0) as upstream,
        proxy_at(upstream.url) as proxy,
    ):
        collector = proxy.state.collector
        collector.min_interval = 0.0  # no wait since the last collection: only load decides
        collector.max_in_flight = streams // 2
        body = b'{"model": "m", "stream": true, "messages": []}'
        conns = [await RawConn.open(proxy.url) for _ in range(streams)]
        try:
            for conn in conns:
                await conn.send_head(CHAT, len(body), {})
                await conn.send(body)
            for conn in conns:
                await conn.read_until(b"data: ")
            assert collector() is False and collector.collections == 0
        finally:
            for conn in conns:
                conn.abort()
        deadline = time.monotonic() + 10.0
        while proxy.state.exchanges:
            assert time.monotonic() < deadline, "the hung-up exchanges did not end"
            await asyncio.sleep(0.01)
        assert collector() is True and collector.collections == 1


class _LibC:
    def __init__(self) -> None:
        self.trimmed = asyncio.Event()

    def mallopt(self, param: int, value: int, /) -> int:
        return 1

    def malloc_trim(self, pad: int, /) -> int:
        self.trimmed.set()
        return 1


async def test_the_allocators_idle_trim_runs_its_idle_hook() -> None:
    libc = _LibC()
    alloc = Allocator(libc, idle_after=0.01)
    calls: list[int] = []
    alloc.on_idle = lambda: calls.append(alloc.trims)
    alloc.idle()  # an answer ended; nothing else ends after it
    async with asyncio.timeout(10):
        await libc.trimmed.wait()
    assert calls == [0]  # once, with the trim
    alloc.close()

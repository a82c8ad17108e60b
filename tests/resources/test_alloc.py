"""proxy/_alloc.py: when the allocator is tuned and trimmed, with a fake C library and
(smoke only) the real one."""

from __future__ import annotations

import asyncio
import sys

import pytest

from proxy._alloc import DEFAULT_MMAP_THRESHOLD, M_MMAP_THRESHOLD, Allocator, load_libc

MiB = 1 << 20


class FakeLibC:
    """Records calls; ``trimmed`` is set on every ``malloc_trim``, which advances
    ``clock`` (if given) by ``trim_seconds`` (what a trim costs)."""

    def __init__(self, clock: Clock | None = None, trim_seconds: float = 0.0) -> None:
        self.mallopt_calls: list[tuple[int, int]] = []
        self.trims = 0
        self.trimmed = asyncio.Event()
        self.clock = clock
        self.trim_seconds = trim_seconds

    def mallopt(self, param: int, value: int, /) -> int:
        self.mallopt_calls.append((param, value))
        return 1

    def malloc_trim(self, pad: int, /) -> int:
        assert pad == 0
        self.trims += 1
        self.trimmed.set()
        if self.clock is not None:
            self.clock.now += self.trim_seconds
        return 1


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_tune_fixes_the_mmap_threshold() -> None:
    libc = FakeLibC()
    assert Allocator(libc).tune() is True
    assert libc.mallopt_calls == [(M_MMAP_THRESHOLD, DEFAULT_MMAP_THRESHOLD)]


def test_small_releases_do_not_trim_until_they_add_up() -> None:
    libc = FakeLibC()
    alloc = Allocator(libc, trim_min_bytes=MiB, clock=Clock())
    assert alloc.released(MiB // 2) is False
    assert alloc.released(0) is False
    assert libc.trims == 0
    assert alloc.released(MiB // 2) is True
    assert (libc.trims, alloc.trims, alloc.pending) == (1, 1, 0)


def test_trims_are_rate_limited_unless_the_release_is_large() -> None:
    libc = FakeLibC()
    clock = Clock()
    alloc = Allocator(
        libc, trim_min_bytes=MiB, trim_now_bytes=8 * MiB, min_interval=1.0, clock=clock
    )
    assert alloc.released(2 * MiB) is True
    clock.now += 0.5
    # Within the interval and no loop to defer to: kept pending, not trimmed.
    assert alloc.released(2 * MiB) is False
    assert (libc.trims, alloc.pending) == (1, 2 * MiB)
    # A large release trims at once, whatever the interval.
    assert alloc.released(8 * MiB) is True
    assert (libc.trims, alloc.pending) == (2, 0)
    clock.now += 1.0
    assert alloc.released(MiB) is True
    assert libc.trims == 3


async def test_a_release_inside_the_interval_trims_when_it_ends() -> None:
    libc = FakeLibC()
    alloc = Allocator(libc, trim_min_bytes=MiB, min_interval=0.05)
    assert alloc.released(MiB) is True
    libc.trimmed.clear()
    assert alloc.released(MiB) is False
    assert alloc.released(MiB) is False  # one deferred trim, not two
    async with asyncio.timeout(5):
        await libc.trimmed.wait()
    assert (libc.trims, alloc.pending) == (2, 0)
    alloc.close()


async def test_close_cancels_a_deferred_trim() -> None:
    libc = FakeLibC()
    alloc = Allocator(libc, trim_min_bytes=MiB, min_interval=3600)
    alloc.released(MiB)
    alloc.released(MiB)
    alloc.close()
    assert alloc.trim() is True  # a direct trim still works after close
    assert libc.trims == 2


async def test_releases_that_stop_are_trimmed_once_after_the_quiet_period() -> None:
    """Small releases never reach trim_min_bytes; once they stop for quiet_after
    seconds (the burst is over), one trim hands the freed heap back, and an idle
    process is not trimmed again."""
    libc = FakeLibC()
    loop = asyncio.get_running_loop()
    alloc = Allocator(libc, trim_min_bytes=MiB, quiet_after=0.2)
    for _ in range(3):
        assert alloc.released(40_000) is False
        last = loop.time()
        await asyncio.sleep(0.01)
    async with asyncio.timeout(5):
        await libc.trimmed.wait()
    assert loop.time() - last >= 0.2  # not before the releases had stopped that long
    assert (libc.trims, alloc.pending) == (1, 0)
    await asyncio.sleep(0.5)
    assert libc.trims == 1
    alloc.close()


async def test_close_cancels_the_quiet_trim() -> None:
    libc = FakeLibC()
    alloc = Allocator(libc, quiet_after=0.05)
    alloc.released(1000)
    alloc.close()
    await asyncio.sleep(0.2)
    assert libc.trims == 0


def test_trims_take_at_most_their_share_of_the_time() -> None:
    clock = Clock()
    # A trim that takes 2 ms: at a 1 % share the next release trim waits 200 ms.
    libc = FakeLibC(clock, trim_seconds=0.002)
    alloc = Allocator(
        libc, trim_min_bytes=MiB, trim_now_bytes=64 * MiB, max_share=0.01, clock=clock
    )
    assert alloc.released(MiB) is True
    clock.now += 0.150
    assert alloc.released(MiB) is False  # no loop to defer to: kept pending
    assert (libc.trims, alloc.pending) == (1, MiB)
    clock.now += 0.060
    assert alloc.released(MiB) is True
    assert (libc.trims, alloc.pending) == (2, 0)


def test_a_body_under_the_mmap_threshold_trims_when_released() -> None:
    # A 600 KB body lives on the heap (below glibc's 1 MiB mmap threshold): by
    # default its release trims, or it would stay resident while its answer streams.
    libc = FakeLibC()
    alloc = Allocator(libc, clock=Clock())
    assert alloc.released(600_000) is True
    assert libc.trims == 1


async def test_idle_trims_once_nothing_ended_for_idle_after() -> None:
    libc = FakeLibC()
    # idle_after is 50 of the loop's 10 ms steps: a step a loaded machine wakes up to 0.49 s
    # late is still not a quiet period.
    alloc = Allocator(libc, idle_after=0.5)
    loop = asyncio.get_running_loop()
    alloc.idle()
    started = loop.time()
    # Answers keep ending for 0.6 s (longer than idle_after): each pushes the trim back.
    while loop.time() - started < 0.6:
        await asyncio.sleep(0.01)
        alloc.idle()
        assert libc.trims == 0
    async with asyncio.timeout(5):
        await libc.trimmed.wait()
    assert loop.time() - started >= 0.6 + 0.5 - 0.005  # the loop's clock granularity
    assert libc.trims == 1
    await asyncio.sleep(0.1)
    assert libc.trims == 1  # one trim per quiet period, not a periodic timer
    alloc.close()


async def test_close_cancels_the_idle_trim() -> None:
    libc = FakeLibC()
    alloc = Allocator(libc, idle_after=0.01)
    alloc.idle()
    alloc.close()
    await asyncio.sleep(0.05)
    assert libc.trims == 0


def test_without_a_c_library_everything_is_a_no_op() -> None:
    alloc = Allocator(None)
    assert not alloc.available
    assert alloc.tune() is False
    assert alloc.released(64 * MiB) is False
    alloc.idle()
    assert alloc.trim() is False
    assert alloc.trims == 0


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc only")
def test_real_glibc_can_be_trimmed() -> None:
    if load_libc() is None:
        pytest.skip("C library without malloc_trim (not glibc)")
    alloc = Allocator.for_process()
    assert alloc.available
    # tune() is not called: it would change the allocator of the whole test process.
    garbage = [bytes(2000) for _ in range(10_000)]
    del garbage
    alloc.trim()
    assert alloc.trims == 1

"""proxy/_alloc.py: when the allocator is tuned and trimmed, with a fake C library and
(smoke only) the real one."""

from __future__ import annotations

import asyncio
import sys

import pytest

from proxy._alloc import DEFAULT_MMAP_THRESHOLD, M_MMAP_THRESHOLD, Allocator, load_libc

MiB = 1 << 20


class FakeLibC:
    """Records calls; ``trimmed`` is set on every ``malloc_trim``."""

    def __init__(self) -> None:
        self.mallopt_calls: list[tuple[int, int]] = []
        self.trims = 0
        self.trimmed = asyncio.Event()

    def mallopt(self, param: int, value: int, /) -> int:
        self.mallopt_calls.append((param, value))
        return 1

    def malloc_trim(self, pad: int, /) -> int:
        assert pad == 0
        self.trims += 1
        self.trimmed.set()
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
    alloc = Allocator(libc, trim_min_bytes=MiB, trim_now_bytes=8 * MiB, clock=clock)
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


def test_without_a_c_library_everything_is_a_no_op() -> None:
    alloc = Allocator(None)
    assert not alloc.available
    assert alloc.tune() is False
    assert alloc.released(64 * MiB) is False
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

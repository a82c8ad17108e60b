"""TombstoneSet: TTL on an injected clock, count cap, remaining TTL (pure, no sockets).

Also the registry's side of the seam: a registry given another store uses it for
admission, Retry-After figures and the tombstone count.
"""

from __future__ import annotations

import math

import pytest

from proxy._sessions import SessionClosed, SessionRegistry
from proxy._tombstones import TombstoneSet, TombstoneStore


class FakeClock:
    """A monotonic clock (seconds) moved by hand."""

    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_a_tombstone_lives_exactly_its_ttl_on_the_injected_clock() -> None:
    clock = FakeClock()
    tombs = TombstoneSet(ttl=30.0, cap=10, clock=clock)
    tombs.add("s")
    assert "s" in tombs and tombs.remaining_ttl("s") == 30.0 and tombs.count() == 1
    clock.now += 29.5
    assert "s" in tombs and tombs.remaining_ttl("s") == pytest.approx(0.5)
    clock.now += 0.5
    assert "s" not in tombs and tombs.remaining_ttl("s") is None and tombs.count() == 0
    assert "never-added" not in tombs and tombs.remaining_ttl("never-added") is None


def test_re_adding_restarts_the_ttl_and_discard_drops_it() -> None:
    clock = FakeClock()
    tombs = TombstoneSet(ttl=10.0, cap=10, clock=clock)
    tombs.add("s")
    clock.now += 8
    tombs.add("s")
    assert tombs.remaining_ttl("s") == 10.0 and tombs.count() == 1
    tombs.discard("s")
    tombs.discard("s")  # idempotent
    assert "s" not in tombs and tombs.count() == 0


def test_the_count_cap_bounds_memory_and_drops_the_oldest_first() -> None:
    clock = FakeClock()
    tombs = TombstoneSet(ttl=600.0, cap=3, clock=clock)
    for i in range(1000):
        tombs.add(f"s{i}")
        clock.now += 0.001
    assert tombs.count() == 3
    assert [f"s{i}" in tombs for i in (996, 997, 998, 999)] == [False, True, True, True]


def test_a_cap_or_ttl_of_zero_keeps_nothing() -> None:
    no_room = TombstoneSet(ttl=60.0, cap=0, clock=FakeClock())
    no_room.add("s")
    assert "s" not in no_room and no_room.count() == 0 and no_room.remaining_ttl("s") is None
    no_time = TombstoneSet(ttl=0.0, cap=10, clock=FakeClock())
    no_time.add("s")
    assert "s" not in no_time and no_time.count() == 0


@pytest.mark.parametrize(("ttl", "cap"), [(-1.0, 1), (math.inf, 1), (math.nan, 1), (1.0, -1)])
def test_bad_limits_are_refused(ttl: float, cap: int) -> None:
    with pytest.raises(ValueError, match="tombstone_"):
        TombstoneSet(ttl=ttl, cap=cap)


class DictStore:
    """Another TombstoneStore (as a shared, cluster-wide store would be): a dict of TTLs."""

    def __init__(self) -> None:
        self.left: dict[str, float] = {}

    @property
    def ttl(self) -> float:
        return 42.0

    def add(self, sid: str) -> None:
        self.left[sid] = self.ttl

    def discard(self, sid: str) -> None:
        self.left.pop(sid, None)

    def remaining_ttl(self, sid: str) -> float | None:
        return self.left.get(sid)

    def __contains__(self, sid: object) -> bool:
        return sid in self.left

    def count(self) -> int:
        return len(self.left)

    def items(self) -> list[tuple[str, float]]:
        return list(self.left.items())


async def test_the_registry_uses_an_injected_store_for_admission_and_counts() -> None:
    store = DictStore()
    store_view: TombstoneStore = store  # the fake satisfies the protocol (mypy checks)
    registry = SessionRegistry(idle_cap=10, tombstones=store_view)
    store.left["elsewhere"] = 7.25  # tombstoned by another node
    with pytest.raises(SessionClosed) as refused:
        registry.admit("elsewhere")
    assert refused.value.retry_after == 7.25 and refused.value.retry_after_header == "8"
    assert registry.is_tombstoned("elsewhere") and registry.tombstone_count == 1

    result = await registry.shutdown_session("local", timeout=1.0)
    assert not result.already_closed and store.left["local"] == 42.0
    assert (await registry.shutdown_session("local", timeout=1.0)).already_closed


def test_the_registry_takes_either_a_store_or_its_settings() -> None:
    with pytest.raises(TypeError):
        SessionRegistry(idle_cap=1)
    with pytest.raises(TypeError):
        SessionRegistry(idle_cap=1, tombstone_ttl=1.0, tombstone_cap=1, tombstones=DictStore())


def test_retry_after_header_rounds_up_to_whole_seconds() -> None:
    assert SessionClosed("s", 0.01).retry_after_header == "1"
    assert SessionClosed("s", 59.0).retry_after_header == "59"
    assert SessionClosed("s", 0.0).retry_after_header == "0"

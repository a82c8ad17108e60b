"""The ledger plugin: hash gate, debounced SQLite persistence, restart, damaged databases."""

from __future__ import annotations

import sqlite3
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest

from plugins.ledger import GateOutcome, LedgerError, LedgerPlugin, hash_gate
from proxy import ExchangeRecord
from proxy.testing import make_record

DIGEST_A = "a" * 32
DIGEST_B = "b" * 32
DIGEST_C = "c" * 32
NEVER = 3600.0  # a debounce that never fires during a test: flushes are explicit


def saved_rows(path: Path) -> dict[str, tuple[Any, ...]]:
    """``{session_id: (digest, comparable, revision_epoch, dirty, requests, bytes_in,
    bytes_out)}`` as another process reading the ledger file would see it."""
    conn = sqlite3.connect(path)
    try:
        rows = conn.execute(
            "SELECT session_id, digest, comparable, revision_epoch, dirty, requests,"
            " bytes_in, bytes_out FROM sessions"
        ).fetchall()
    finally:
        conn.close()
    return {row[0]: tuple(row[1:]) for row in rows}


@pytest.fixture
def db_path(tmp_path: Path) -> Path:
    return tmp_path / "ledger.db"


@pytest.fixture
async def ledger(db_path: Path) -> AsyncIterator[LedgerPlugin]:
    plugin = LedgerPlugin(path=str(db_path), debounce=NEVER, lock_timeout=0.05)
    await plugin.startup()
    yield plugin
    await plugin.shutdown()


# -- the gate as a pure function ---------------------------------------------------------


@pytest.mark.parametrize(
    ("saved", "digest", "comparable", "expected"),
    [
        (None, DIGEST_A, True, GateOutcome.FIRST),
        ((DIGEST_A, True), DIGEST_A, True, GateOutcome.IDENTICAL),
        ((DIGEST_A, True), DIGEST_B, True, GateOutcome.REFORMAT),
        ((DIGEST_A, False), DIGEST_B, False, GateOutcome.REFORMAT),
        ((DIGEST_A, True), DIGEST_B, False, GateOutcome.REVISION),
        ((DIGEST_A, False), DIGEST_B, True, GateOutcome.REVISION),
    ],
)
def test_hash_gate_classifies(
    saved: tuple[str, bool] | None, digest: str, comparable: bool, expected: GateOutcome
) -> None:
    assert hash_gate(saved, digest, comparable) is expected


# -- every branch of the gate through the plugin -----------------------------------------


async def test_first_request_saves_digest_at_epoch_zero_not_dirty(
    ledger: LedgerPlugin, db_path: Path
) -> None:
    await ledger.commit(make_record())
    assert ledger.session_state("s1") == {
        "digest": DIGEST_A[:12],
        "comparable": True,
        "revision_epoch": 0,
        "dirty": False,
        "requests": 1,
        "bytes_in": 1000,
        "bytes_out": 500,
        "last_activity": 1_700_000_001.5,
        "saved": False,
    }
    assert ledger.flush_scheduled
    await ledger.flush()
    assert ledger.writes == 1
    assert not ledger.flush_scheduled
    assert ledger.session_state("s1")["saved"] is True
    assert saved_rows(db_path) == {"s1": (DIGEST_A, 1, 0, 0, 1, 1000, 500)}


async def test_identical_retry_is_not_dirty_and_schedules_no_write(
    ledger: LedgerPlugin, db_path: Path
) -> None:
    await ledger.commit(make_record())
    await ledger.flush()

    await ledger.commit(make_record(exchange_id="x2"))

    state = ledger.session_state("s1")
    assert state["dirty"] is False
    assert state["revision_epoch"] == 0
    assert state["requests"] == 2  # counted in memory
    assert not ledger.flush_scheduled
    assert ledger.writes == 1
    assert saved_rows(db_path)["s1"][4] == 1  # the disk did not move


async def test_reformat_saves_the_new_digest_without_dirtying(
    ledger: LedgerPlugin, db_path: Path
) -> None:
    await ledger.commit(make_record())
    await ledger.flush()

    await ledger.commit(make_record(wire_digest=DIGEST_B))

    state = ledger.session_state("s1")
    assert (state["digest"], state["revision_epoch"], state["dirty"]) == (DIGEST_B[:12], 0, False)
    assert ledger.flush_scheduled
    await ledger.flush()
    assert saved_rows(db_path)["s1"][:4] == (DIGEST_B, 1, 0, 0)


async def test_verdict_flip_bumps_the_epoch_and_marks_dirty(
    ledger: LedgerPlugin, db_path: Path
) -> None:
    await ledger.commit(make_record())
    await ledger.commit(make_record(wire_digest=DIGEST_B, comparable=False))

    state = ledger.session_state("s1")
    assert (state["revision_epoch"], state["dirty"], state["comparable"]) == (1, True, False)

    # Flipping back is a change of shape too.
    await ledger.commit(make_record(wire_digest=DIGEST_C, comparable=True))
    assert ledger.session_state("s1")["revision_epoch"] == 2
    await ledger.flush()
    assert saved_rows(db_path)["s1"][:4] == (DIGEST_C, 1, 2, 1)


@pytest.mark.parametrize(
    "record",
    [
        make_record(session_id=None, wire_digest=DIGEST_B, comparable=False),
        make_record(outcome="client_gone", wire_digest=DIGEST_B, comparable=False),
        make_record(outcome="upstream_error", status=400, wire_digest=DIGEST_B, comparable=False),
    ],
    ids=["no-session", "client-gone", "upstream-error"],
)
async def test_records_without_session_or_not_ok_leave_the_gate_alone(
    ledger: LedgerPlugin, record: ExchangeRecord
) -> None:
    await ledger.commit(make_record())
    await ledger.flush()
    before = dict(ledger.session_state("s1"))

    await ledger.commit(record)

    assert ledger.session_state("s1") == before
    assert not ledger.flush_scheduled


async def test_mark_clean_clears_dirty_only_at_the_given_epoch(ledger: LedgerPlugin) -> None:
    await ledger.commit(make_record())
    await ledger.commit(make_record(wire_digest=DIGEST_B, comparable=False))  # epoch 1
    await ledger.commit(make_record(wire_digest=DIGEST_C, comparable=True))  # epoch 2

    # A consumer that rebuilt from epoch 1 is already behind: the session stays dirty.
    assert await ledger.mark_clean("s1", epoch=1) is False
    assert ledger.session_state("s1")["dirty"] is True
    assert await ledger.mark_clean("s1", epoch=2) is True
    assert ledger.session_state("s1")["dirty"] is False
    assert await ledger.mark_clean("s1") is False  # already clean
    assert await ledger.mark_clean("unknown") is False


# -- restart and memory bound ------------------------------------------------------------


async def test_saved_gate_holds_across_a_restart(db_path: Path) -> None:
    first = LedgerPlugin(path=str(db_path), debounce=NEVER)
    await first.startup()
    await first.commit(make_record())
    await first.commit(make_record(wire_digest=DIGEST_B, comparable=False))  # epoch 1, dirty
    await first.shutdown()  # flushes

    second = LedgerPlugin(path=str(db_path), debounce=NEVER)
    await second.startup()
    try:
        state = second.session_state("s1")
        assert (state["digest"], state["revision_epoch"], state["dirty"]) == (
            DIGEST_B[:12],
            1,
            True,
        )
        # The client retries the last request after the restart: identical, no write.
        await second.commit(make_record(wire_digest=DIGEST_B, comparable=False))
        assert not second.flush_scheduled
        assert second.session_state("s1")["revision_epoch"] == 1
        # A flip continues from the saved epoch, not from 0.
        await second.commit(make_record(wire_digest=DIGEST_C, comparable=True))
        assert second.session_state("s1")["revision_epoch"] == 2
    finally:
        await second.shutdown()
    assert saved_rows(db_path)["s1"][:5] == (DIGEST_C, 1, 2, 1, 4)


async def test_session_closed_writes_counters_and_forgets_but_gate_still_holds(
    ledger: LedgerPlugin, db_path: Path
) -> None:
    await ledger.commit(make_record())
    await ledger.flush()
    await ledger.commit(make_record())  # identical retry: counters only, no write scheduled
    writes = ledger.writes

    await ledger.session_closed("s1")

    assert ledger.writes == writes + 1
    assert saved_rows(db_path)["s1"][4] == 2
    assert ledger.session_state("s1") == {}
    assert ledger.sessions_in_memory == 0

    # The id comes back (e.g. the session was evicted as idle): the saved gate applies.
    await ledger.commit(make_record())
    assert not ledger.flush_scheduled
    assert ledger.session_state("s1")["requests"] == 3


async def test_memory_holds_at_most_cache_sessions_saved_sessions(db_path: Path) -> None:
    plugin = LedgerPlugin(path=str(db_path), debounce=NEVER, cache_sessions=2)
    await plugin.startup()
    try:
        for sid in ("s1", "s2", "s3"):
            await plugin.commit(make_record(session_id=sid))
        # Nothing is saved yet, so nothing may be dropped.
        assert plugin.sessions_in_memory == 3
        await plugin.flush()
        await plugin.commit(make_record(session_id="s4"))
        assert plugin.sessions_in_memory == 2
        assert plugin.session_state("s1") == {}  # least recently active went first
        await plugin.flush()
        # A dropped session is read back on its next commit: identical, no write.
        await plugin.commit(make_record(session_id="s1"))
        assert plugin.session_state("s1")["requests"] == 2
        assert not plugin.flush_scheduled
        assert plugin.sessions_in_memory == 2
    finally:
        await plugin.shutdown()
    assert set(saved_rows(db_path)) == {"s1", "s2", "s3", "s4"}


async def test_startup_preloads_only_the_most_recent_sessions(db_path: Path) -> None:
    first = LedgerPlugin(path=str(db_path), debounce=NEVER)
    await first.startup()
    for n, sid in enumerate(("old", "mid", "new")):
        await first.commit(make_record(session_id=sid, started_at=1000.0 + n))
    await first.shutdown()

    second = LedgerPlugin(path=str(db_path), debounce=NEVER, cache_sessions=2)
    await second.startup()
    try:
        assert second.sessions_in_memory == 2
        assert second.session_state("old") == {}
        assert second.session_state("new")["requests"] == 1
    finally:
        await second.shutdown()


# -- debounce ----------------------------------------------------------------------------


async def test_burst_of_100_commits_is_one_write(ledger: LedgerPlugin, db_path: Path) -> None:
    for n in range(100):
        # Alternate digests so that every commit is a real gate change.
        await ledger.commit(make_record(exchange_id=f"x{n}", wire_digest=f"{n:032x}"))
    assert ledger.writes == 0
    await ledger.flush()
    assert ledger.writes == 1
    assert saved_rows(db_path)["s1"][4] == 100


async def test_debounce_timer_writes_every_pending_session_in_one_transaction(
    db_path: Path,
) -> None:
    plugin = LedgerPlugin(path=str(db_path), debounce=0.01)
    await plugin.startup()
    try:
        for sid in ("s1", "s2", "s3"):
            await plugin.commit(make_record(session_id=sid))
        assert plugin.flush_scheduled
        await plugin.wait_written()  # the timer fires by itself; no explicit flush
        assert plugin.writes == 1
        assert not plugin.flush_scheduled
        assert set(saved_rows(db_path)) == {"s1", "s2", "s3"}
    finally:
        await plugin.shutdown()


async def test_shutdown_writes_what_is_pending(db_path: Path) -> None:
    plugin = LedgerPlugin(path=str(db_path), debounce=NEVER)
    await plugin.startup()
    await plugin.commit(make_record())
    await plugin.commit(make_record())  # identical: counters only
    await plugin.shutdown()
    assert saved_rows(db_path) == {"s1": (DIGEST_A, 1, 0, 0, 2, 2000, 1000)}


async def test_failed_write_keeps_sessions_unsaved_and_is_retried(
    ledger: LedgerPlugin, db_path: Path
) -> None:
    await ledger.commit(make_record())
    blocker = sqlite3.connect(db_path, isolation_level=None)
    try:
        blocker.execute("BEGIN EXCLUSIVE")
        with pytest.raises(LedgerError, match="is locked"):
            await ledger.flush()
        assert ledger.write_errors == 1
        assert ledger.session_state("s1")["saved"] is False
    finally:
        blocker.execute("ROLLBACK")
        blocker.close()
    await ledger.flush()
    assert ledger.session_state("s1")["saved"] is True
    assert saved_rows(db_path) == {"s1": (DIGEST_A, 1, 0, 0, 1, 1000, 500)}


# -- database problems at start-up -------------------------------------------------------


def write_garbage(path: Path) -> bytes:
    garbage = b"this is not a SQLite database\n" * 200
    path.write_bytes(garbage)
    return garbage


def file_bytes(path: Path) -> bytes:
    return path.read_bytes()


def damage_a_btree_page(path: Path) -> None:
    """Fold the WAL into the main file, then scribble over the middle of page 6."""
    conn = sqlite3.connect(path)
    conn.execute("PRAGMA wal_checkpoint(TRUNCATE)")
    conn.close()
    assert path.stat().st_size > 8 * 4096
    with path.open("r+b") as fh:
        fh.seek(5 * 4096 + 100)
        fh.write(b"\xff" * 500)


async def test_garbage_file_is_reported_corrupt_not_reset(db_path: Path) -> None:
    garbage = write_garbage(db_path)
    plugin = LedgerPlugin(path=str(db_path), lock_timeout=0.05)
    with pytest.raises(LedgerError, match=rf"ledger database {db_path} is corrupt"):
        await plugin.startup()
    assert file_bytes(db_path) == garbage


async def test_damaged_page_fails_the_quick_check(db_path: Path) -> None:
    first = LedgerPlugin(path=str(db_path), debounce=NEVER)
    await first.startup()
    for n in range(2000):
        await first.commit(make_record(session_id=f"s{n:05}", started_at=float(n)))
    await first.shutdown()
    damage_a_btree_page(db_path)

    plugin = LedgerPlugin(path=str(db_path), lock_timeout=0.05)
    with pytest.raises(LedgerError, match="is corrupt"):
        await plugin.startup()


@pytest.mark.parametrize("wal", [False, True], ids=["rollback-journal", "wal"])
async def test_database_locked_by_another_connection_fails_startup(
    db_path: Path, wal: bool
) -> None:
    if wal:  # an existing ledger (WAL mode): readers pass, the write probe must catch it
        existing = LedgerPlugin(path=str(db_path))
        await existing.startup()
        await existing.shutdown()
    blocker = sqlite3.connect(db_path, isolation_level=None)
    try:
        if not wal:
            blocker.execute("CREATE TABLE other (x)")
        blocker.execute("BEGIN EXCLUSIVE")
        plugin = LedgerPlugin(path=str(db_path), lock_timeout=0.05)
        with pytest.raises(LedgerError, match=rf"ledger database {db_path} is locked"):
            await plugin.startup()
    finally:
        blocker.execute("ROLLBACK")
        blocker.close()


async def test_foreign_database_is_refused(db_path: Path) -> None:
    conn = sqlite3.connect(db_path)
    conn.execute("CREATE TABLE notes (body TEXT)")
    conn.commit()
    conn.close()
    plugin = LedgerPlugin(path=str(db_path))
    with pytest.raises(LedgerError, match="not a ledger"):
        await plugin.startup()


async def test_memory_database_works_without_a_file() -> None:
    plugin = LedgerPlugin(path=":memory:", debounce=NEVER)
    await plugin.startup()
    try:
        await plugin.commit(make_record())
        await plugin.flush()
        assert plugin.writes == 1
        assert plugin.path == ":memory:"
    finally:
        await plugin.shutdown()


async def test_commit_before_startup_raises() -> None:
    plugin = LedgerPlugin(path=":memory:")
    with pytest.raises(LedgerError, match="not started"):
        await plugin.commit(make_record())


@pytest.mark.parametrize(
    "options",
    [
        {"debounce": -1.0},
        {"debounce": float("inf")},
        {"cache_sessions": 0},
        {"lock_timeout": 0},
        {"path": ""},
    ],
)
def test_bad_options_are_rejected(options: dict[str, Any]) -> None:
    with pytest.raises(ValueError, match=next(iter(options))):
        LedgerPlugin(**options)

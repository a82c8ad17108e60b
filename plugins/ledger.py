"""The built-in ledger: per-session hash gate, persisted in SQLite (docs/design.md §5).

For every session the ledger remembers the wire digest and the comparable
verdict of the last request the upstream answered, plus a ``revision_epoch``,
a ``dirty`` flag and a few counters. Each committed exchange passes the *hash
gate* (:func:`hash_gate`):

* first request of the session: save digest and verdict, epoch 0, not dirty;
* same digest as saved: an identical retry; the gate does not move and no
  database write is scheduled (the counters move in memory only, see below);
* new digest, same verdict: a reformat; the new digest is saved, not dirty;
* verdict flipped: the history changed shape; ``revision_epoch + 1``, dirty.

``dirty`` is the signal for a downstream consumer: anything cached or
summarised from the session's history under an older epoch is stale. The
consumer rebuilds, then calls :meth:`LedgerPlugin.mark_clean` with the epoch it
rebuilt from.

Only exchanges with a session id and outcome ``ok`` pass the gate. A failed
exchange (upstream error, client gone, timeout...) proves nothing about the
history the upstream accepted, so it neither moves the gate nor counts in the
ledger's counters; the usage and jsonlog plugins see every exchange.

Persistence: SQLite (stdlib) in WAL mode. All SQLite work runs in one
dedicated worker thread with its own connection, so the event loop never
blocks on disk and the connection is never shared between threads. A gate
change marks the session unsaved and starts one debounce timer; ``debounce``
seconds later every unsaved session is written in a single transaction (a
burst of 100 commits costs one write). Counter-only changes (identical
retries) never start the timer; they ride along with the next write, and
``session_closed`` / ``shutdown`` write them explicitly. A ``kill -9`` (or a
power cut) loses what was not yet written: up to ``debounce`` seconds of gate
changes, and the counters of identical retries since the last write.
``sync = "commit"`` instead writes every commit in its own transaction with
``PRAGMA synchronous=FULL`` (fsynced) before the commit hook returns: nothing
committed is lost, at the cost of one transaction and fsync per commit
(docs/plugins.md, section 8, has the measured cost).

Cluster mode (``redis_url``, given by the proxy's own ``redis_url`` setting
unless the ``[plugin.ledger]`` table sets it): the gate is the proxy's shared
:class:`proxy.LedgerGate` from :func:`proxy.open_ledger_gate`, one Redis hash
per session passed in one atomic step, so two nodes committing for one session
at once still bump ``revision_epoch`` once. SQLite is not used then;
an identical retry writes nothing at all (its counters are not kept).
Durability is Redis's (enable AOF).

A commit in cluster mode never waits for Redis (write-behind, like the SQLite
debounce): it folds the exchange into the session's *held run*
(:class:`proxy.GateRun`, constant size however many commits it holds) and
returns; one background task sends every held run, one pipelined round trip
for all sessions, and sends again whatever arrived meanwhile. So a slow or
hung Redis holds no session lock and costs no other plugin its commit, and a
hot session's commits are not paced by Redis round trips. While Redis does not
answer (the gate's breaker is open, see ``proxy/_cluster/ledger.py``), the runs
stay held and are retried every ``redis_timeout``; the first answer applies
them all, exactly as if each commit had gone through on time. Held runs are
bounded by ``cache_sessions`` sessions: past it the oldest session's run is
dropped and counted (``gate_dropped``). One warning starts an outage, a summary
line with counts follows every 10 s while it lasts, one line ends it. What a
shutdown during an outage cannot send is counted in the log line it writes.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import enum
import itertools
import logging
import math
import os
import sqlite3
import time
import urllib.parse
from collections import OrderedDict
from collections.abc import Callable, Mapping
from typing import ClassVar, Final, TypeVar

from cachetools import LRUCache

from proxy import (
    ClusterUnavailable,
    ExchangeRecord,
    GateRun,
    LedgerGate,
    Outcome,
    Plugin,
    Scalar,
    open_ledger_gate,
)

__all__ = ["SCHEMA_VERSION", "GateOutcome", "LedgerError", "LedgerPlugin", "hash_gate"]

log = logging.getLogger("context_proxy.plugins.ledger")

SCHEMA_VERSION: Final = 1
"""``PRAGMA user_version`` of a ledger database created by this module."""

_T = TypeVar("_T")

#: Values of the ``sync`` option: debounced writes (the default), or one per commit.
_SYNC_MODES: Final = ("debounced", "commit")

# Cluster mode: sessions' held runs sent per round trip, and seconds between two
# summary lines of one outage.
_RUNS_PER_TRIP: Final = 512
_OUTAGE_SUMMARY_EVERY: Final = 10.0

# Column order of the ``sessions`` table and of every row tuple below.
_COLUMNS: Final = (
    "session_id",
    "digest",
    "comparable",
    "revision_epoch",
    "dirty",
    "requests",
    "bytes_in",
    "bytes_out",
    "last_activity",
)
_SCHEMA: Final = (
    "CREATE TABLE sessions ("
    " session_id TEXT PRIMARY KEY,"
    " digest TEXT NOT NULL,"
    " comparable INTEGER NOT NULL,"
    " revision_epoch INTEGER NOT NULL,"
    " dirty INTEGER NOT NULL,"
    " requests INTEGER NOT NULL,"
    " bytes_in INTEGER NOT NULL,"
    " bytes_out INTEGER NOT NULL,"
    " last_activity REAL NOT NULL"
    ") WITHOUT ROWID",
    "CREATE INDEX sessions_by_activity ON sessions (last_activity)",
)
_UPSERT: Final = (
    f"INSERT INTO sessions ({', '.join(_COLUMNS)}) VALUES ({', '.join('?' * len(_COLUMNS))})"
    " ON CONFLICT (session_id) DO UPDATE SET "
    + ", ".join(f"{c} = excluded.{c}" for c in _COLUMNS[1:])
)
_SELECT: Final = f"SELECT {', '.join(_COLUMNS)} FROM sessions"

# (session_id, digest, comparable, revision_epoch, dirty, requests, bytes_in, bytes_out,
#  last_activity) with SQLite's types: booleans are 0/1.
_Row = tuple[str, str, int, int, int, int, int, int, float]


class LedgerError(Exception):
    """The ledger database cannot be used: corrupt, locked, foreign schema, or a write failed.

    The message names the database path and the cause; it never contains a
    request body (the ledger never sees one).
    """


class GateOutcome(enum.Enum):
    """What the hash gate decided for one exchange."""

    FIRST = "first"
    """No saved state for the session: digest and verdict saved, epoch 0, not dirty."""
    IDENTICAL = "identical"
    """Same digest as saved: nothing changes, nothing is written."""
    REFORMAT = "reformat"
    """New digest, same verdict: the digest is saved, not dirty."""
    REVISION = "revision"
    """Verdict flipped: ``revision_epoch + 1`` and dirty."""


def hash_gate(saved: tuple[str, bool] | None, digest: str, comparable: bool) -> GateOutcome:
    """Classify a request against the session's saved ``(digest, comparable)`` (docs/design.md §5).

    ``saved`` is ``None`` for a session never seen; ``digest`` is the hex
    xxh3_128 of the request's wire bytes; ``comparable`` its verdict. Pure,
    never raises.
    """
    if saved is None:
        return GateOutcome.FIRST
    saved_digest, saved_comparable = saved
    if digest == saved_digest:
        return GateOutcome.IDENTICAL
    if comparable == saved_comparable:
        return GateOutcome.REFORMAT
    return GateOutcome.REVISION


class _Entry:
    """In-memory ledger state of one session.

    ``version`` counts changes; ``saved_version`` is the newest version known
    to be on disk. The entry may only be dropped from memory when both match.
    """

    __slots__ = (
        "bytes_in",
        "bytes_out",
        "comparable",
        "digest",
        "dirty",
        "last_activity",
        "requests",
        "revision_epoch",
        "saved_version",
        "version",
    )

    def __init__(self, digest: str, comparable: bool) -> None:
        self.digest = digest
        self.comparable = comparable
        self.revision_epoch = 0
        self.dirty = False
        self.requests = 0
        self.bytes_in = 0
        self.bytes_out = 0
        self.last_activity = 0.0
        self.version = 0
        self.saved_version = 0

    @classmethod
    def from_row(cls, row: _Row) -> _Entry:
        entry = cls(row[1], bool(row[2]))
        entry.revision_epoch = row[3]
        entry.dirty = bool(row[4])
        entry.requests = row[5]
        entry.bytes_in = row[6]
        entry.bytes_out = row[7]
        entry.last_activity = row[8]
        return entry

    def row(self, session_id: str) -> _Row:
        return (
            session_id,
            self.digest,
            int(self.comparable),
            self.revision_epoch,
            int(self.dirty),
            self.requests,
            self.bytes_in,
            self.bytes_out,
            self.last_activity,
        )

    @property
    def saved(self) -> bool:
        return self.saved_version == self.version


class _Database:
    """The SQLite side of the ledger. Every method runs in the ledger's worker thread."""

    __slots__ = ("_conn", "path")

    def __init__(self, path: str, conn: sqlite3.Connection) -> None:
        self.path = path
        self._conn = conn

    @classmethod
    def open(cls, path: str, lock_timeout: float, fsync_each: bool = False) -> _Database:
        """Open or create, check integrity and schema, and prove the file is writable.

        ``fsync_each``: ``PRAGMA synchronous=FULL``, so every transaction is on
        disk (the WAL fsynced) when its COMMIT returns (``sync = "commit"``).

        Raises:
            LedgerError: corrupt, locked, foreign schema, or cannot be opened.
        """
        conn: sqlite3.Connection | None = None
        try:
            # isolation_level=None: no implicit transactions, we issue BEGIN/COMMIT ourselves
            # so that one flush is exactly one transaction.
            conn = sqlite3.connect(
                path, timeout=lock_timeout, isolation_level=None, check_same_thread=False
            )
            problems = [str(r[0]) for r in conn.execute("PRAGMA quick_check").fetchall()]
            if problems != ["ok"]:
                # One problem per row, each possibly many lines: name the count and
                # the start of the report, not the whole report.
                first = " ".join(" ".join(problems).split())[:200]
                raise LedgerError(
                    f"ledger database {path} is corrupt: quick_check reported "
                    f"{len(problems)} problem(s): {first}"
                )
            # WAL lets the admin CLI read the ledger while the proxy writes it.
            conn.execute("PRAGMA journal_mode=WAL").fetchall()
            if fsync_each:
                # Per connection, not stored in the file: set at every open.
                conn.execute("PRAGMA synchronous=FULL")
            _ensure_schema(conn, path)
            # A reader can pass every check above while another process holds the
            # write lock; take the write lock once so that case fails here, not at
            # the first flush minutes later.
            conn.execute("BEGIN IMMEDIATE")
            conn.execute("ROLLBACK")
        except LedgerError:
            if conn is not None:
                conn.close()
            raise
        except sqlite3.Error as exc:
            if conn is not None:
                conn.close()
            raise _translate(path, exc) from exc
        return cls(path, conn)

    def load_recent(self, limit: int) -> list[_Row]:
        """The ``limit`` most recently active sessions, oldest first."""
        rows = self._conn.execute(
            f"{_SELECT} ORDER BY last_activity DESC LIMIT ?", (limit,)
        ).fetchall()
        rows.reverse()
        return rows

    def load_one(self, session_id: str) -> _Row | None:
        """The saved row of ``session_id``, or ``None``."""
        row: _Row | None = self._conn.execute(
            f"{_SELECT} WHERE session_id = ?", (session_id,)
        ).fetchone()
        return row

    def write(self, rows: list[_Row]) -> None:
        """Upsert ``rows`` in one transaction (all or nothing)."""
        conn = self._conn
        conn.execute("BEGIN IMMEDIATE")
        try:
            conn.executemany(_UPSERT, rows)
            conn.execute("COMMIT")
        except BaseException:
            if conn.in_transaction:
                conn.execute("ROLLBACK")
            raise

    def close(self) -> None:
        self._conn.close()


def _ensure_schema(conn: sqlite3.Connection, path: str) -> None:
    """Create the schema in an empty database, or verify an existing one.

    Raises:
        LedgerError: the file is a database of something else, or of a newer
            ledger version; it is never altered or reset.
    """
    version = int(conn.execute("PRAGMA user_version").fetchone()[0])
    tables = [r[0] for r in conn.execute("SELECT name FROM sqlite_master WHERE type = 'table'")]
    if version == 0 and not tables:
        conn.execute("BEGIN IMMEDIATE")
        try:
            for statement in _SCHEMA:
                conn.execute(statement)
            conn.execute(f"PRAGMA user_version = {SCHEMA_VERSION}")
            conn.execute("COMMIT")
        except BaseException:
            if conn.in_transaction:
                conn.execute("ROLLBACK")
            raise
        return
    _verify_schema(conn, path, version, tables)


def _verify_schema(conn: sqlite3.Connection, path: str, version: int, tables: list[str]) -> None:
    """Raise :class:`LedgerError` unless the database holds this version's schema."""
    if "sessions" not in tables:
        # Another program's file (a usage store pointed at by mistake, say).
        raise LedgerError(
            f"ledger database {path} holds tables {tables} and no sessions table: "
            "another program's file, not a ledger"
        )
    if version != SCHEMA_VERSION:
        raise LedgerError(
            f"ledger database {path} has schema version {version} (expected "
            f"{SCHEMA_VERSION}) and tables {tables}; not a ledger of this version"
        )
    columns = tuple(r[1] for r in conn.execute("PRAGMA table_info(sessions)"))
    if columns != _COLUMNS:
        raise LedgerError(
            f"ledger database {path} has an unexpected sessions table: columns {list(columns)}"
        )


def _check_file(path: str, lock_timeout: float) -> None:
    """Whether :meth:`_Database.open` would succeed on ``path``, opening it read-only.

    A missing file needs a writable directory (start-up creates it); an
    existing one must be readable and writable, pass ``PRAGMA quick_check`` and
    hold an empty database or this version's schema. Nothing is created or changed.

    Raises:
        LedgerError: naming the path and what is wrong.
    """
    if path == ":memory:":
        return
    if not os.path.lexists(path):
        parent = os.path.dirname(path)
        if not os.path.isdir(parent):
            raise LedgerError(
                f"ledger database {path} cannot be created: directory {parent} does not exist"
            )
        if not os.access(parent, os.W_OK | os.X_OK):
            raise LedgerError(
                f"ledger database {path} cannot be created: directory {parent} is not writable"
            )
        return
    if not os.path.isfile(path):
        raise LedgerError(f"ledger database {path} cannot be used: not a regular file")
    if not os.access(path, os.R_OK | os.W_OK):
        raise LedgerError(f"ledger database {path} cannot be used: not readable and writable")
    # No write-ahead log: no connection is open and every page is in the main file,
    # so it is read as immutable (a plain read-only open of a WAL database would
    # leave -wal and -shm files behind). With a log, another process (a running
    # proxy) has it open: share it as any reader does.
    mode = "ro" if os.path.exists(path + "-wal") else "ro&immutable=1"
    try:
        conn = sqlite3.connect(
            f"file:{urllib.parse.quote(path)}?mode={mode}", uri=True, timeout=lock_timeout
        )
    except sqlite3.Error as exc:
        raise _translate(path, exc) from exc
    try:
        problems = [str(r[0]) for r in conn.execute("PRAGMA quick_check").fetchall()]
        if problems != ["ok"]:
            first = " ".join(" ".join(problems).split())[:200]
            raise LedgerError(
                f"ledger database {path} is corrupt: quick_check reported "
                f"{len(problems)} problem(s): {first}"
            )
        version = int(conn.execute("PRAGMA user_version").fetchone()[0])
        tables = [r[0] for r in conn.execute("SELECT name FROM sqlite_master WHERE type = 'table'")]
        if version or tables:
            _verify_schema(conn, path, version, tables)
    except sqlite3.Error as exc:
        raise _translate(path, exc) from exc
    finally:
        conn.close()


def _translate(path: str, exc: sqlite3.Error) -> LedgerError:
    """A :class:`LedgerError` naming ``path`` and what kind of failure ``exc`` is."""
    code = getattr(exc, "sqlite_errorname", "")
    if code.startswith(("SQLITE_BUSY", "SQLITE_LOCKED")):
        kind = "is locked by another connection"
    elif code.startswith(("SQLITE_CORRUPT", "SQLITE_NOTADB")):
        kind = "is corrupt"
    else:
        kind = "cannot be used"
    return LedgerError(f"ledger database {path} {kind}: {exc} ({code or type(exc).__name__})")


class _Outage:
    """One Redis outage as the ledger's sender sees it (monotonic seconds)."""

    __slots__ = ("attempts", "began", "reported")

    def __init__(self, began: float) -> None:
        self.began = began
        self.reported = began
        self.attempts = 1


class LedgerPlugin(Plugin):
    """Per-session hash gate with debounced SQLite persistence (see the module docstring).

    Options (the ``[plugin.ledger]`` table):

    ``path`` (str)
        SQLite file, created if missing; ``":memory:"`` keeps nothing across
        restarts. Default ``"context-proxy-ledger.db"``.
    ``debounce`` (float, seconds, >= 0)
        Delay between the first unsaved gate change and the one transaction
        that writes every unsaved session. Default 0.5.
    ``sync`` (``"debounced"`` or ``"commit"``)
        ``"debounced"`` (default): writes as ``debounce`` says; a ``kill -9``
        loses the writes not yet made. ``"commit"``: each commit (identical
        retries too) and each ``mark_clean`` is written in its own fsynced
        transaction before it returns; ``debounce`` is then unused. A failed
        write raises from the hook (the session stays unsaved, retried by
        the next write).
    ``cache_sessions`` (int, >= 1)
        Sessions kept in memory. Start-up preloads the most recently active
        ones; beyond the cap, the least recently active *saved* sessions are
        dropped from memory. A session not in memory is looked up in the
        database on its next commit, so the gate always holds. Default 10000.
    ``lock_timeout`` (float, seconds, > 0)
        How long SQLite waits for another connection's lock before giving up.
        Default 5.0.
    ``redis_url`` (str or None)
        Keep the gate in Redis instead of SQLite (cluster mode, see above);
        ``path`` is then unused. Default: the proxy's ``redis_url`` setting.
    ``redis_timeout`` (float, seconds, > 0)
        Cluster mode: per Redis command, and between two attempts while Redis
        does not answer. Default: the proxy's ``redis_timeout`` setting (0.5).

    Raises:
        ValueError: on construction, for an out-of-range option (the proxy
            reports it as a bad plugin option).
    """

    name: ClassVar[str] = "ledger"

    def __init__(
        self,
        *,
        path: str = "context-proxy-ledger.db",
        debounce: float = 0.5,
        cache_sessions: int = 10_000,
        lock_timeout: float = 5.0,
        redis_url: str | None = None,
        sync: str = "debounced",
        redis_timeout: float = 0.5,
    ) -> None:
        if not isinstance(path, str) or not path:
            raise ValueError("path: expected a non-empty string")
        if not (isinstance(debounce, int | float) and 0 <= debounce < math.inf):
            raise ValueError(f"debounce: expected seconds >= 0, got {debounce!r}")
        if not (isinstance(cache_sessions, int) and cache_sessions >= 1):
            raise ValueError(f"cache_sessions: expected an int >= 1, got {cache_sessions!r}")
        if not (isinstance(lock_timeout, int | float) and 0 < lock_timeout < math.inf):
            raise ValueError(f"lock_timeout: expected seconds > 0, got {lock_timeout!r}")
        if sync not in _SYNC_MODES:
            raise ValueError(f"sync: expected one of {', '.join(_SYNC_MODES)}, got {sync!r}")
        # Absolute, so every error message names the file unambiguously.
        self.path: Final = path if path == ":memory:" else os.path.abspath(path)
        self.debounce: Final = float(debounce)
        self.cache_sessions: Final = cache_sessions
        self.lock_timeout: Final = float(lock_timeout)
        self.sync: Final = sync
        self.writes = 0
        """Transactions committed (one per flush that had something to write); in
        cluster mode, gate changes applied in Redis."""
        self.write_errors = 0
        """Flush transactions that failed (their sessions stay unsaved and are retried);
        in cluster mode, round trips to Redis that failed (their runs stay held)."""
        self._entries: OrderedDict[str, _Entry] = OrderedDict()  # least recently active first
        self._unsaved: dict[str, None] = {}  # an ordered set: sessions ahead of the disk
        self._timer: asyncio.Task[None] | None = None  # the pending debounce flush
        self._in_flight: set[asyncio.Task[Exception | None]] = set()
        self._executor: concurrent.futures.ThreadPoolExecutor | None = None
        self._db: _Database | None = None
        if redis_url is not None and not isinstance(redis_url, str):
            raise ValueError("redis_url: expected a redis:// URL or nothing")
        self.redis_url: Final = redis_url
        if not (isinstance(redis_timeout, int | float) and 0 < redis_timeout < math.inf):
            raise ValueError(f"redis_timeout: expected seconds > 0, got {redis_timeout!r}")
        self.redis_timeout: Final = float(redis_timeout)
        self._gate: LedgerGate | None = None  # cluster mode: the gate shared by every node
        # Cluster mode: the runs not in Redis yet, oldest session first, and their sender.
        self._held: OrderedDict[str, GateRun] = OrderedDict()
        # Runs sent whose answer is not in yet: resent as they are (same seq) until it is.
        self._doubt: dict[str, GateRun] = {}
        self._writer = os.urandom(8).hex()  # this start's name in the session hashes
        self._seq = 0
        self._wake = asyncio.Event()
        self._sender: asyncio.Task[None] | None = None
        self._outage: _Outage | None = None
        self.gate_dropped = 0
        """Cluster mode: commits whose held run was dropped (over ``cache_sessions``
        sessions held) or could not be sent at shutdown."""
        # Cluster mode: the last gate state seen per session, for session_state().
        self._seen: LRUCache[str, dict[str, Scalar]] = LRUCache(maxsize=cache_sessions)

    # -- hooks -----------------------------------------------------------------------------

    def check(self) -> None:
        """``context-proxy check``: the database could be opened, checked read-only.

        Raises:
            LedgerError: the file's directory is missing or not writable, or the
                file is not readable and writable, corrupt, or of a foreign schema.
        """
        _check_file(self.path, self.lock_timeout)

    async def startup(self) -> None:
        """Open (or create) the database, verify it, and preload recent sessions.

        Raises:
            LedgerError: already started; or the file is corrupt (``PRAGMA
                quick_check`` fails or it is not a SQLite file), locked by another
                connection for longer than ``lock_timeout``, holds a foreign
                schema, or cannot be opened. Nothing is ever reset.
        """
        if self._executor is not None or self._gate is not None:
            raise LedgerError(f"ledger {self.path}: startup() called twice")
        if self.redis_url is not None:
            self._gate = open_ledger_gate(self.redis_url, timeout=self.redis_timeout)
            self._sender = asyncio.get_running_loop().create_task(
                self._send_held(self._gate), name="ledger-gate-sender"
            )
            log.info("ledger: hash gate in Redis (cluster mode)")
            return
        # One thread: SQLite work is serialized in submission order, so a read
        # queued after a write sees it, and one connection is never shared.
        self._executor = concurrent.futures.ThreadPoolExecutor(
            max_workers=1, thread_name_prefix="context-proxy-ledger"
        )
        try:
            db = await self._run(
                _Database.open, self.path, self.lock_timeout, self.sync == "commit"
            )
            self._db = db
            rows = await self._run(db.load_recent, self.cache_sessions)
        except sqlite3.Error as exc:  # damage that quick_check let through
            await self._close()
            raise _translate(self.path, exc) from exc
        except BaseException:
            await self._close()
            raise
        for row in rows:
            self._entries[row[0]] = _Entry.from_row(row)
        log.info("ledger %s: %d session(s) loaded", self.path, len(rows))

    async def commit(self, record: ExchangeRecord) -> None:
        """Pass one finished exchange through the hash gate and count it.

        Ignores records without a session id, without a wire digest (a request
        refused before its body was parsed, a passthrough route: no history to
        compare) or with an outcome other than ``ok``. An identical retry
        updates the counters in memory only; every other gate outcome schedules
        the debounced write. With ``sync = "commit"`` every one is written
        (fsynced) before this returns.

        Raises:
            LedgerError: the plugin is not started, looking up a session not
                in memory failed, or (``sync = "commit"``) the write failed.
        """
        sid = record.session_id
        if sid is None or not record.wire_digest or record.outcome is not Outcome.OK:
            return
        if self._gate is not None:
            self._hold(sid, record)
            return
        entry = await self._lookup(sid)
        if entry is None:
            outcome = GateOutcome.FIRST
            entry = _Entry(record.wire_digest, record.comparable)
            self._entries[sid] = entry
        else:
            outcome = hash_gate(
                (entry.digest, entry.comparable), record.wire_digest, record.comparable
            )
            if outcome is GateOutcome.REVISION:
                entry.revision_epoch += 1
                entry.dirty = True
            entry.digest = record.wire_digest
            entry.comparable = record.comparable
        entry.requests += 1
        entry.bytes_in += record.request_bytes
        entry.bytes_out += record.response_bytes
        # The record's own clock (end of the exchange), not ours: deterministic and
        # never moves backwards for a session because commits run in order.
        entry.last_activity = max(entry.last_activity, record.started_at + record.duration_s)
        entry.version += 1
        self._unsaved[sid] = None
        if self.sync == "commit":
            try:
                await self._flush([sid])
            finally:
                self._trim()
            return
        if outcome is not GateOutcome.IDENTICAL:
            self._schedule()
        self._trim()

    async def session_closed(self, session_id: str) -> None:
        """Write the session's unsaved state now, then drop it from memory.

        The row stays in the database: if the id comes back, its next commit
        meets the saved gate.

        Raises:
            LedgerError: the write failed; the session stays in memory, unsaved,
                and is retried by the next flush.
        """
        self._seen.pop(session_id, None)
        if session_id not in self._entries:
            return
        await self._flush([session_id] if session_id in self._unsaved else [])
        entry = self._entries.get(session_id)
        if entry is not None and entry.saved:
            del self._entries[session_id]

    def stored_sessions(self) -> list[tuple[str, float]]:
        """The sessions in memory, loaded from the database at start-up (asked right
        after :meth:`startup`): ``(id, last activity in Unix seconds)``, least recently
        active first. None in cluster mode (the gate lives in Redis)."""
        return [(sid, entry.last_activity) for sid, entry in self._entries.items()]

    def session_state(self, session_id: str) -> Mapping[str, Scalar]:
        """The admin view of a session in memory, else ``{}``; never touches the disk.

        Keys: ``digest`` (first 12 hex digits), ``comparable``, ``revision_epoch``,
        ``dirty``, ``requests``, ``bytes_in`` / ``bytes_out`` (bytes),
        ``last_activity`` (Unix seconds), ``saved`` (False while ahead of the disk).
        """
        if self._gate is not None:
            return dict(self._seen.get(session_id, {}))
        entry = self._entries.get(session_id)
        if entry is None:
            return {}
        return {
            "digest": entry.digest[:12],
            "comparable": entry.comparable,
            "revision_epoch": entry.revision_epoch,
            "dirty": entry.dirty,
            "requests": entry.requests,
            "bytes_in": entry.bytes_in,
            "bytes_out": entry.bytes_out,
            "last_activity": entry.last_activity,
            "saved": entry.saved,
        }

    async def shutdown(self) -> None:
        """Write every unsaved session, close the database and stop the worker thread.

        Raises:
            LedgerError: the final write failed (the database is closed anyway;
                the message says how many sessions were lost).
        """
        if self._gate is not None:
            await self._stop_sending()
            gate, self._gate = self._gate, None
            await gate.close()
            return
        if self._executor is None:
            return
        try:
            await self.flush()
        except LedgerError as exc:
            lost = len(self._unsaved)
            raise LedgerError(f"{exc}; {lost} session(s) not saved at shutdown") from exc
        finally:
            await self._close()

    # -- public helpers --------------------------------------------------------------------

    async def mark_clean(self, session_id: str, *, epoch: int | None = None) -> bool:
        """Clear ``dirty`` once a consumer has rebuilt what it keyed on the history.

        With ``epoch``, clears only if the session is still at that
        ``revision_epoch``: a flip that happened while the consumer was
        rebuilding keeps the session dirty. Returns whether the flag was
        cleared (False for an unknown, already clean, or moved-on session).
        The change is written with the next debounced flush.

        Raises:
            LedgerError: the plugin is not started, or the lookup failed.
        """
        if self._gate is not None:
            try:
                return await self._gate.mark_clean(session_id, epoch)
            except ClusterUnavailable as exc:
                raise LedgerError(f"ledger: Redis unreachable: {exc}") from exc
        entry = await self._lookup(session_id)
        if entry is None or not entry.dirty:
            return False
        if epoch is not None and entry.revision_epoch != epoch:
            return False
        entry.dirty = False
        entry.version += 1
        self._unsaved[session_id] = None
        if self.sync == "commit":
            await self._flush([session_id])
        else:
            self._schedule()
        return True

    async def flush(self) -> None:
        """Write every unsaved session now and wait until every write has landed.

        Cancels the pending debounce timer. Everything unsaved when this is
        called is on disk when it returns. Safe to call concurrently; a
        cancelled caller does not cancel the write.

        In cluster mode: wait until every held run is in Redis, at most a few
        attempts (``3 x redis_timeout``); runs still held then stay held.

        Raises:
            LedgerError: a write failed (its sessions stay unsaved); in cluster
                mode, runs are still held after the wait.
        """
        if self._gate is not None:
            if not await self._settle_held(3 * self.redis_timeout):
                raise LedgerError(
                    f"ledger: Redis unreachable, {self.gate_sessions_held} session(s) held"
                )
            return
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        await self._flush(list(self._unsaved))

    async def wait_written(self) -> None:
        """Wait for the pending debounce flush (if any) and every write in flight.

        Never raises for a failed write (see ``write_errors``); for tests and
        callers that must observe the disk state without sleeping.
        """
        # asyncio.wait, not shield: it neither raises for nor cancels the awaited tasks.
        timer = self._timer
        if timer is not None:
            await asyncio.wait([timer])
        if self._in_flight:
            await asyncio.wait(set(self._in_flight))

    @property
    def flush_scheduled(self) -> bool:
        """Whether a debounce timer is pending (a gate change is waiting to be written)."""
        return self._timer is not None

    @property
    def sessions_in_memory(self) -> int:
        """How many sessions the ledger currently holds in memory (at most ``cache_sessions``
        plus those not yet saved)."""
        return len(self._entries)

    # -- internals -------------------------------------------------------------------------

    @property
    def gate_held(self) -> int:
        """Cluster mode: commits not confirmed in Redis yet (held or in doubt)."""
        runs = itertools.chain(self._held.values(), self._doubt.values())
        return sum(run.commits for run in runs)

    @property
    def gate_sessions_held(self) -> int:
        """Cluster mode: sessions with commits not confirmed in Redis yet."""
        return len(self._held.keys() | self._doubt.keys())

    def _hold(self, sid: str, record: ExchangeRecord) -> None:
        """Fold ``record`` into the session's held run (O(1)) and wake the sender."""
        run = self._held.get(sid)
        if run is None:
            if len(self._held) >= self.cache_sessions:
                _, oldest = self._held.popitem(last=False)
                self.gate_dropped += oldest.commits
            self._held[sid] = GateRun(
                sid,
                digest=record.wire_digest,
                comparable=record.comparable,
                request_bytes=record.request_bytes,
                response_bytes=record.response_bytes,
                last_activity=record.started_at + record.duration_s,
            )
        else:
            run.append(
                digest=record.wire_digest,
                comparable=record.comparable,
                request_bytes=record.request_bytes,
                response_bytes=record.response_bytes,
                last_activity=record.started_at + record.duration_s,
            )
        self._wake.set()

    async def _send_held(self, gate: LedgerGate) -> None:
        """The sender: held runs to Redis, one pipelined round trip per batch of
        sessions; on an outage retry every ``redis_timeout``.

        A run is *in doubt* from the moment it is sent until Redis answers: a timed
        out command may still run when a hung Redis resumes. In-doubt runs are
        resent, with their sequence number (Redis skips a copy it already applied),
        before any newer run of theirs is sent; newer commits meanwhile fold into
        the held run. So a session holds at most two runs, and each commit is
        applied exactly once.
        """
        while True:  # until shutdown cancels it; each pass waits for work or a retry delay
            await self._wake.wait()
            self._wake.clear()
            while self._doubt or self._held:  # bounded: each pass sends or waits
                if not self._doubt:  # the held runs, numbered, become in doubt
                    while self._held and len(self._doubt) < _RUNS_PER_TRIP:
                        sid, run = self._held.popitem(last=False)
                        self._seq += 1
                        run.seq = self._seq
                        self._doubt[sid] = run
                runs = list(itertools.islice(self._doubt.values(), _RUNS_PER_TRIP))
                try:
                    verdicts = await gate.apply_runs(self._writer, runs)
                except ClusterUnavailable as exc:
                    self.write_errors += 1
                    self._outage_step(str(exc))
                    await asyncio.sleep(self.redis_timeout)
                    continue
                except Exception as exc:
                    # Redis refused a run (a wrong-type key: a defect, not an outage).
                    # The sender must outlive it: find the run, drop it, send the rest.
                    self.write_errors += 1
                    if not await self._isolate(gate, runs, exc):
                        await asyncio.sleep(self.redis_timeout)
                    continue
                for run in runs:
                    del self._doubt[run.session_id]
                self._outage_over(runs)
                for run, verdict in zip(runs, verdicts, strict=True):
                    self.writes += (verdict.outcome != GateOutcome.IDENTICAL.value) + run.requests
                    self._seen[run.session_id] = {
                        "digest": run.digest[:12],
                        "comparable": run.comparable,
                        "revision_epoch": verdict.revision_epoch,
                        "dirty": verdict.dirty,
                        "gate": verdict.outcome,
                    }

    async def _isolate(self, gate: LedgerGate, runs: list[GateRun], first: Exception) -> bool:
        """After a trip Redis refused: send ``runs`` one by one and drop each that Redis
        refuses alone (counted in ``gate_dropped``, logged by exception class only), so
        one bad key costs its own session's commits, not every session's. Whether every
        run got an answer (``False``: Redis stopped answering meanwhile; the rest stay
        in doubt and the sender retries them as for an outage).
        """
        dropped = 0
        for run in runs:
            try:
                await gate.apply_runs(self._writer, [run])
            except ClusterUnavailable as exc:
                self._outage_step(str(exc))
                return False
            except Exception:
                dropped += 1
                self.gate_dropped += run.commits
            del self._doubt[run.session_id]
        log.error(
            "ledger: Redis refused the gate run of %d session(s) (%s); their commits "
            "dropped (gate_dropped), the other sessions' runs applied",
            dropped,
            type(first).__name__,
        )
        return True

    def _outage_step(self, cause: str) -> None:
        """One failed attempt: a warning at the first, a summary every so often."""
        now = time.monotonic()
        outage = self._outage
        if outage is None:
            self._outage = _Outage(now)
            log.warning(
                "ledger: Redis unreachable (%s); holding gate decisions in memory "
                "(%d commit(s) of %d session(s)), retrying every %.1fs",
                cause,
                self.gate_held,
                self.gate_sessions_held,
                self.redis_timeout,
            )
            return
        outage.attempts += 1
        if now - outage.reported >= _OUTAGE_SUMMARY_EVERY:
            outage.reported = now
            log.warning(
                "ledger: Redis still unreachable after %.1fs (%d attempt(s)): "
                "%d commit(s) of %d session(s) held, %d dropped",
                now - outage.began,
                outage.attempts,
                self.gate_held,
                self.gate_sessions_held,
                self.gate_dropped,
            )

    def _outage_over(self, sent: list[GateRun]) -> None:
        outage, self._outage = self._outage, None
        if outage is not None:
            # What was sent now plus what the sender sends next, without waiting.
            log.warning(
                "ledger: Redis answers again after %.1fs; %d commit(s) of %d session(s) "
                "held during the outage are being applied, %d dropped",
                time.monotonic() - outage.began,
                sum(run.commits for run in sent) + self.gate_held,
                len({run.session_id for run in sent} | self._held.keys() | self._doubt.keys()),
                self.gate_dropped,
            )

    async def _settle_held(self, within: float) -> bool:
        """Wait up to ``within`` seconds until no run is held or in flight."""
        deadline = time.monotonic() + within
        while self._held or self._doubt:  # bounded by the deadline
            if time.monotonic() >= deadline or self._sender is None or self._sender.done():
                return False
            self._wake.set()
            await asyncio.sleep(0.005)
        return True

    async def _stop_sending(self) -> None:
        """At shutdown: send what is held (bounded), then stop the sender."""
        await self._settle_held(3 * self.redis_timeout)
        sender, self._sender = self._sender, None
        if sender is not None:
            sender.cancel()
            await asyncio.wait([sender])
        lost = self.gate_held
        if lost:
            self.gate_dropped += lost
            log.warning(
                "ledger: Redis unreachable at shutdown; %d commit(s) of %d session(s) "
                "not confirmed in the gate (%d of them sent, perhaps applied)",
                lost,
                self.gate_sessions_held,
                sum(run.commits for run in self._doubt.values()),
            )
            self._held.clear()
            self._doubt.clear()

    def _run(self, fn: Callable[..., _T], *args: object) -> asyncio.Future[_T]:
        if self._executor is None:
            raise LedgerError(f"ledger {self.path}: not started")
        return asyncio.get_running_loop().run_in_executor(self._executor, fn, *args)

    async def _lookup(self, sid: str) -> _Entry | None:
        """The session's entry, from memory or else from the database (cached)."""
        entry = self._entries.get(sid)
        if entry is not None:
            self._entries.move_to_end(sid)
            return entry
        db = self._db
        if db is None:
            raise LedgerError(f"ledger {self.path}: not started")
        try:
            row = await self._run(db.load_one, sid)
        except sqlite3.Error as exc:
            raise _translate(self.path, exc) from exc
        # Another commit of the same session may have created it while we waited.
        entry = self._entries.get(sid)
        if entry is None and row is not None:
            entry = self._entries[sid] = _Entry.from_row(row)
        return entry

    def _schedule(self) -> None:
        if self._timer is None:
            self._timer = asyncio.get_running_loop().create_task(
                self._debounced(), name=f"ledger-debounce {self.path}"
            )

    async def _debounced(self) -> None:
        await asyncio.sleep(self.debounce)
        self._timer = None
        self._submit(list(self._unsaved))  # errors are logged and counted by _write

    def _submit(self, sids: list[str]) -> None:
        """Snapshot ``sids`` (on the loop) and queue one transaction writing them."""
        if not sids:
            return
        db = self._db
        if db is None:
            raise LedgerError(f"ledger {self.path}: not started")
        rows: list[_Row] = []
        versions: list[tuple[str, int]] = []
        for sid in sids:
            self._unsaved.pop(sid, None)
            entry = self._entries[sid]  # unsaved entries are never dropped from memory
            rows.append(entry.row(sid))
            versions.append((sid, entry.version))
        task = asyncio.get_running_loop().create_task(self._write(db, rows, versions))
        self._in_flight.add(task)
        task.add_done_callback(self._in_flight.discard)

    async def _write(
        self, db: _Database, rows: list[_Row], versions: list[tuple[str, int]]
    ) -> Exception | None:
        """Run one transaction; returns the failure instead of raising (nobody may await it)."""
        try:
            await self._run(db.write, rows)
        except Exception as exc:
            self.write_errors += 1
            for sid, _ in versions:
                entry = self._entries.get(sid)
                if entry is not None and not entry.saved:
                    self._unsaved[sid] = None
            error = _translate(self.path, exc) if isinstance(exc, sqlite3.Error) else exc
            log.warning(
                "ledger %s: writing %d session(s) failed: %s; kept for the next flush",
                self.path,
                len(rows),
                error,
            )
            return error
        self.writes += 1
        for sid, version in versions:
            entry = self._entries.get(sid)
            if entry is not None:
                entry.saved_version = max(entry.saved_version, version)
        return None

    async def _flush(self, sids: list[str]) -> None:
        self._submit(sids)
        if not self._in_flight:
            return
        # Earlier writes may hold older snapshots of these sessions; wait for all of
        # them so that "returned" means "on disk". asyncio.wait does not cancel the
        # writes if this caller is cancelled (a plugin_timeout must not abort a
        # transaction half way through the queue).
        tasks = set(self._in_flight)
        await asyncio.wait(tasks)
        for task in tasks:
            error = (
                LedgerError(f"ledger {self.path}: a write was cancelled")
                if task.cancelled()
                else task.result()
            )
            if error is not None:
                raise LedgerError(str(error)) from error

    def _trim(self) -> None:
        """Drop the least recently active saved sessions beyond ``cache_sessions``."""
        excess = len(self._entries) - self.cache_sessions
        if excess <= 0:
            return
        victims = []
        for sid, entry in self._entries.items():  # bounded by len(self._entries)
            if entry.saved:
                victims.append(sid)
                if len(victims) == excess:
                    break
        for sid in victims:
            del self._entries[sid]

    async def _close(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        executor, db = self._executor, self._db
        self._db = None
        if executor is None:
            return
        try:
            if db is not None:
                await asyncio.get_running_loop().run_in_executor(executor, db.close)
        finally:
            self._executor = None
            # The queue is empty by now, so the idle thread exits without a join.
            executor.shutdown(wait=False)

"""The built-in usage plugin: token usage per session and per model.

The proxy counts tokens from the protocol's usage events while it relays the
answer, without keeping any text, and hands the totals to ``commit`` as the
record's ``input_tokens``, ``output_tokens``, ``cache_read_tokens`` and
``cache_write_tokens`` (with Anthropic's 5-minute / 1-hour split where given;
``None`` when the upstream reported none). This plugin adds them up twice:

* per ``(protocol, model)``, exported as Prometheus counters
  ``context_proxy_input_tokens_total``, ``context_proxy_output_tokens_total``,
  ``context_proxy_cache_read_tokens_total`` and
  ``context_proxy_cache_write_tokens_total`` with labels ``protocol`` and
  ``model``; ``context_proxy_cache_write_lifetime_tokens_total`` splits the
  writes by cache lifetime (extra label ``ttl``: ``5m`` or ``1h``) where the
  upstream reported the split; plus the histogram ``context_proxy_cached_input_share`` of each
  exchange's cached share of its input tokens (cache reads / input tokens, 0..1),
  same labels;
* per session, for ``GET /admin/sessions/{id}``: the same totals, the 5m/1h
  split of cache writes, and ``cached_input_share`` (the session's cache reads
  over its input tokens, 0..1, or null before any input token was reported).

Cache reads and writes are billed differently (a read costs about a tenth of
an uncached input token, a write more than one), so they are counted apart.
Why a histogram and no per-session gauge: a session id label would give every
session its own series for ever (unbounded cardinality); an operator alerting on
"the prompt cache stopped hitting" reads the per-model share distribution
(e.g. the fraction of exchanges below 0.5), and looks at one session's share in
its admin view. Exchanges that reported no input tokens are not observed.

``input_tokens`` always means the whole prompt, cached tokens included: the
proxy's usage meter adds Anthropic's ``cache_read_input_tokens`` and
``cache_creation_input_tokens`` to its ``input_tokens`` so the figure compares
with OpenAI's ``prompt_tokens`` / ``input_tokens``, which already include them.

The same totals, per session and per model, answer ``GET /admin/usage``
(:meth:`UsagePlugin.usage_page`): from memory since start (at most
``max_sessions`` sessions, closed ones included), or, with a ``path``, from a
SQLite store that survives restarts. The store follows the ledger's durability
rules (``plugins/ledger.py``): one worker thread owns the connection, WAL mode;
by default the totals a commit adds are held in memory and written ``debounce``
seconds after the first of them, every key in one transaction (a ``kill -9``
loses at most that window); ``sync = "commit"`` writes each commit in its own
fsynced transaction before the hook returns. A write adds the held amounts to
the stored rows, so nothing is read back at start-up and the store holds every
session and model ever seen (one row each, about 100 bytes).

Metrics design: each proxy app has its own ``CollectorRegistry`` (several apps
live in one process in tests), so the plugin does not create global
``Counter`` objects. It keeps plain integer totals and is itself a Prometheus
collector (:meth:`UsagePlugin.collect`), rendered at scrape time by whichever
registry it is registered on: the app's, or the ``registry`` option's.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import itertools
import logging
import math
import os
import sqlite3
import urllib.parse
from collections import OrderedDict
from collections.abc import Callable, Iterator, Mapping
from typing import ClassVar, Final, TypeVar

from prometheus_client import CollectorRegistry
from prometheus_client.core import CounterMetricFamily, HistogramMetricFamily
from sortedcontainers import SortedList

from proxy import ExchangeRecord, Outcome, Plugin, Scalar, UsagePage, UsageQuery, UsageRow

__all__ = ["METRIC_NAMES", "STORE_SCHEMA_VERSION", "UsagePlugin", "UsageStoreError"]

log = logging.getLogger("context_proxy.plugins.usage")

_T = TypeVar("_T")

STORE_SCHEMA_VERSION: Final = 1
"""``PRAGMA user_version`` of a usage store created by this module."""

#: Values of the ``sync`` option, as the ledger's: debounced writes, or one per commit.
_SYNC_MODES: Final = ("debounced", "commit")
#: ``UsageQuery.by`` values and the ``kind`` column that holds them.
_KINDS: Final = ("session", "model")

_STORE_COLUMNS: Final = (
    "kind",
    "key",
    "requests",
    "input_tokens",
    "cache_read_tokens",
    "cache_write_tokens",
    "output_tokens",
    "first_seen",
    "last_seen",
)
_STORE_SCHEMA: Final = (
    "CREATE TABLE usage ("
    " kind TEXT NOT NULL,"
    " key TEXT NOT NULL,"
    " requests INTEGER NOT NULL,"
    " input_tokens INTEGER NOT NULL,"
    " cache_read_tokens INTEGER NOT NULL,"
    " cache_write_tokens INTEGER NOT NULL,"
    " output_tokens INTEGER NOT NULL,"
    " first_seen REAL NOT NULL,"
    " last_seen REAL NOT NULL,"
    " PRIMARY KEY (kind, key)"
    ") WITHOUT ROWID",
)
# A write adds what was held to the stored row: the store never needs reading back.
_ADD: Final = (
    f"INSERT INTO usage ({', '.join(_STORE_COLUMNS)})"
    f" VALUES ({', '.join('?' * len(_STORE_COLUMNS))})"
    " ON CONFLICT (kind, key) DO UPDATE SET "
    + ", ".join(
        f"{c} = {c} + excluded.{c}"
        for c in ("requests", "input_tokens", "cache_read_tokens", "cache_write_tokens")
    )
    + ", output_tokens = output_tokens + excluded.output_tokens"
    ", first_seen = min(first_seen, excluded.first_seen)"
    ", last_seen = max(last_seen, excluded.last_seen)"
)
_PAGE: Final = (
    "SELECT key, requests, input_tokens, cache_read_tokens, cache_write_tokens,"
    " output_tokens, last_seen FROM usage"
    " WHERE kind = ? AND key > ? AND last_seen >= ? ORDER BY key LIMIT ?"
)
# (kind, key, requests, input, cache read, cache write, output, first_seen, last_seen)
_StoreRow = tuple[str, str, int, int, int, int, int, float, float]

_MODEL_LABEL_CHARS: Final = 128
_LABELS: Final = ("protocol", "model")

METRIC_NAMES: Final = (
    "context_proxy_input_tokens",
    "context_proxy_output_tokens",
    "context_proxy_cache_read_tokens",
    "context_proxy_cache_write_tokens",
)
"""The counters' family names (Prometheus adds ``_total`` to each sample)."""

LIFETIME_METRIC: Final = "context_proxy_cache_write_lifetime_tokens"
"""Cache writes by lifetime (label ``ttl``: ``5m`` or ``1h``), where the upstream split them."""
_LIFETIME_LABELS: Final = (*_LABELS, "ttl")
_LIFETIME_HELP: Final = (
    "Input tokens written to the prompt cache, by cache lifetime (Anthropic's "
    "cache_creation split: 5m or 1h), where the upstream reported it."
)

SHARE_METRIC: Final = "context_proxy_cached_input_share"
"""The histogram of each exchange's cached share of input tokens (a ratio, 0..1)."""

#: Upper bounds of the share histogram's buckets (ratios); ``+Inf`` is added.
SHARE_BUCKETS: Final = (0.1, 0.25, 0.5, 0.75, 0.85, 0.9, 0.95, 0.99, 1.0)

_HELP: Final = (
    "Input (prompt) tokens reported by the upstream.",
    "Output (completion) tokens reported by the upstream.",
    "Input tokens the upstream served from its prompt cache.",
    "Input tokens the upstream wrote to its prompt cache.",
)
_SHARE_HELP: Final = "Share of an exchange's input tokens served from the prompt cache (0..1)."


class _Totals:
    """Token totals of one session or one ``(protocol, model)`` label pair."""

    __slots__ = (
        "cache_read_tokens",
        "cache_write_1h_tokens",
        "cache_write_5m_tokens",
        "cache_write_tokens",
        "input_tokens",
        "output_tokens",
        "requests",
        "share_buckets",
        "share_count",
        "share_sum",
    )

    def __init__(self) -> None:
        self.input_tokens = 0
        self.output_tokens = 0
        self.cache_read_tokens = 0
        self.cache_write_tokens = 0
        self.cache_write_5m_tokens = 0
        self.cache_write_1h_tokens = 0
        self.requests = 0
        # Share histogram (used for the per-model totals only): non-cumulative
        # counts per SHARE_BUCKETS bound, observation count and sum.
        self.share_buckets = [0] * len(SHARE_BUCKETS)
        self.share_count = 0
        self.share_sum = 0.0

    def observe_share(self, record: ExchangeRecord) -> None:
        """Add the record's cached share to the histogram, if it reported input tokens."""
        inputs = record.input_tokens or 0
        if inputs <= 0:
            return
        share = min(1.0, max(0, record.cache_read_tokens or 0) / inputs)
        for i, bound in enumerate(SHARE_BUCKETS):
            if share <= bound:
                self.share_buckets[i] += 1
                break
        self.share_count += 1
        self.share_sum += share

    def cached_share(self) -> float | None:
        """Cache reads over input tokens (0..1), None before any input token."""
        if self.input_tokens <= 0:
            return None
        return min(1.0, self.cache_read_tokens / self.input_tokens)

    def add(self, record: ExchangeRecord) -> None:
        # None (no usage reported) adds nothing; a negative count is a broken
        # upstream and must not make a counter go down.
        self.input_tokens += max(0, record.input_tokens or 0)
        self.output_tokens += max(0, record.output_tokens or 0)
        self.cache_read_tokens += max(0, record.cache_read_tokens or 0)
        self.cache_write_tokens += max(0, record.cache_write_tokens or 0)
        self.cache_write_5m_tokens += max(0, record.cache_write_5m_tokens or 0)
        self.cache_write_1h_tokens += max(0, record.cache_write_1h_tokens or 0)
        self.requests += 1


class _Seen:
    """What ``GET /admin/usage`` reports for one key: totals, first and last seen.

    ``first_seen`` / ``last_seen``: Unix seconds (end of the exchange).
    """

    __slots__ = (
        "cache_read_tokens",
        "cache_write_tokens",
        "first_seen",
        "input_tokens",
        "last_seen",
        "output_tokens",
        "requests",
    )

    def __init__(self, when: float) -> None:
        self.requests = 0
        self.input_tokens = 0
        self.cache_read_tokens = 0
        self.cache_write_tokens = 0
        self.output_tokens = 0
        self.first_seen = when
        self.last_seen = when

    def add(self, record: ExchangeRecord, when: float) -> None:
        """Count ``record`` (ended at ``when``, Unix seconds); ``None`` counts add nothing."""
        self.requests += 1
        self.input_tokens += max(0, record.input_tokens or 0)
        self.cache_read_tokens += max(0, record.cache_read_tokens or 0)
        self.cache_write_tokens += max(0, record.cache_write_tokens or 0)
        self.output_tokens += max(0, record.output_tokens or 0)
        self.first_seen = min(self.first_seen, when)
        self.last_seen = max(self.last_seen, when)

    def store_row(self, kind: str, key: str) -> _StoreRow:
        return (
            kind,
            key,
            self.requests,
            self.input_tokens,
            self.cache_read_tokens,
            self.cache_write_tokens,
            self.output_tokens,
            self.first_seen,
            self.last_seen,
        )

    def usage_row(self, key: str) -> UsageRow:
        return UsageRow(
            key=key,
            requests=self.requests,
            input_tokens=self.input_tokens,
            cached_input_tokens=self.cache_read_tokens,
            cache_write_tokens=self.cache_write_tokens,
            output_tokens=self.output_tokens,
            last_seen=self.last_seen,
        )


class UsageStoreError(Exception):
    """The usage store cannot be used: corrupt, locked, foreign schema, or a write failed.

    The message names the database path and the cause.
    """


class _Store:
    """The SQLite side of the usage plugin. Every method runs in its worker thread."""

    __slots__ = ("_conn", "path")

    def __init__(self, path: str, conn: sqlite3.Connection) -> None:
        self.path = path
        self._conn = conn

    @classmethod
    def open(cls, path: str, lock_timeout: float, fsync_each: bool) -> _Store:
        """Open or create, check integrity and schema, and prove the file is writable.

        Raises:
            UsageStoreError: corrupt, locked, foreign schema, or cannot be opened.
        """
        conn: sqlite3.Connection | None = None
        try:
            # No implicit transactions: one flush is exactly one BEGIN ... COMMIT.
            conn = sqlite3.connect(
                path, timeout=lock_timeout, isolation_level=None, check_same_thread=False
            )
            problems = [str(r[0]) for r in conn.execute("PRAGMA quick_check").fetchall()]
            if problems != ["ok"]:
                first = " ".join(" ".join(problems).split())[:200]
                raise UsageStoreError(f"usage store {path} is corrupt: {first}")
            # WAL: a reader (a backup, sqlite3 on the command line) never blocks a write.
            conn.execute("PRAGMA journal_mode=WAL").fetchall()
            if fsync_each:
                conn.execute("PRAGMA synchronous=FULL")
            _ensure_store_schema(conn, path)
            # Take the write lock once, so a file another process holds fails here,
            # at start-up, rather than at the first flush.
            conn.execute("BEGIN IMMEDIATE")
            conn.execute("ROLLBACK")
        except UsageStoreError:
            if conn is not None:
                conn.close()
            raise
        except sqlite3.Error as exc:
            if conn is not None:
                conn.close()
            raise UsageStoreError(f"usage store {path} cannot be used: {exc}") from exc
        return cls(path, conn)

    def add(self, rows: list[_StoreRow]) -> None:
        """Add ``rows`` to the stored totals in one transaction (all or nothing)."""
        conn = self._conn
        conn.execute("BEGIN IMMEDIATE")
        try:
            conn.executemany(_ADD, rows)
            conn.execute("COMMIT")
        except BaseException:
            if conn.in_transaction:
                conn.execute("ROLLBACK")
            raise

    def page(self, query: UsageQuery) -> list[UsageRow]:
        """Up to ``query.limit + 1`` rows of ``query`` (the extra one says more follow)."""
        since = -math.inf if query.since is None else query.since
        cursor = self._conn.execute(_PAGE, (query.by, query.after or "", since, query.limit + 1))
        return [
            UsageRow(
                key=key,
                requests=requests,
                input_tokens=inputs,
                cached_input_tokens=reads,
                cache_write_tokens=writes,
                output_tokens=outputs,
                last_seen=last,
            )
            for key, requests, inputs, reads, writes, outputs, last in cursor
        ]

    def close(self) -> None:
        self._conn.close()


def _ensure_store_schema(conn: sqlite3.Connection, path: str) -> None:
    """Create the schema in an empty database, or verify an existing one.

    Raises:
        UsageStoreError: the file holds something else or a newer version; it is
            never altered or reset.
    """
    version = int(conn.execute("PRAGMA user_version").fetchone()[0])
    tables = [r[0] for r in conn.execute("SELECT name FROM sqlite_master WHERE type = 'table'")]
    if version == 0 and not tables:
        conn.execute("BEGIN IMMEDIATE")
        try:
            for statement in _STORE_SCHEMA:
                conn.execute(statement)
            conn.execute(f"PRAGMA user_version = {STORE_SCHEMA_VERSION}")
            conn.execute("COMMIT")
        except BaseException:
            if conn.in_transaction:
                conn.execute("ROLLBACK")
            raise
        return
    columns = tuple(r[1] for r in conn.execute("PRAGMA table_info(usage)"))
    problem = _schema_problem(version, tables, columns)
    if problem is not None:
        raise UsageStoreError(f"usage store {path} {problem}")


def _schema_problem(version: int, tables: list[str], columns: tuple[str, ...]) -> str | None:
    """Why a non-empty file is not this version's usage store (``None``: it is).

    Said in the order an operator can act on: another program's file (say, a
    ledger's, pointed at by mistake), another version, a damaged table.
    """
    if "usage" not in tables:
        return (
            f"holds tables {tables} and no usage table: another program's file, not a usage store"
        )
    if version != STORE_SCHEMA_VERSION:
        return f"has schema version {version}, not {STORE_SCHEMA_VERSION}"
    if columns != _STORE_COLUMNS:
        return f"has an unexpected usage table: columns {list(columns)}"
    return None


class UsagePlugin(Plugin):
    """Token usage per model (Prometheus collector) and per session (admin view).

    Options (the ``[plugin.usage]`` table):

    ``max_sessions`` (int, >= 1)
        Sessions whose totals are kept; beyond it the least recently active
        one is forgotten. A closed session is forgotten at once. Default 10000.
    ``max_models`` (int, >= 1)
        Distinct ``model`` label values. The model comes from the client's
        request, so a client inventing names must not grow the metrics without
        bound: later new models are counted as ``other``. Values are cut to 128
        characters; a missing model is ``unknown``. Default 256.
    ``path`` (str or None)
        SQLite file of the usage store, created if missing; ``":memory:"`` for a
        store that lives as long as the process. Default: none, the totals of
        ``GET /admin/usage`` are kept in memory since start.
    ``debounce`` (float, seconds, >= 0)
        With ``path``: delay between the first commit not written yet and the one
        transaction that writes them all. Default 0.5.
    ``sync`` (``"debounced"`` or ``"commit"``)
        With ``path``: ``"debounced"`` (default) writes as ``debounce`` says; a
        ``kill -9`` loses the totals not written yet. ``"commit"``: each commit
        is written in its own fsynced transaction before the hook returns.
    ``lock_timeout`` (float, seconds, > 0)
        How long SQLite waits for another connection's lock. Default 5.0.

    From code only: ``registry``. If given, the plugin registers itself on it
    in :meth:`startup` and unregisters in :meth:`shutdown`, so apps built one
    after another on one registry never collide. Without it the plugin
    registers nowhere and the host exports it (it has ``collect()``).

    Raises:
        ValueError: on construction, for an option out of range.
    """

    name: ClassVar[str] = "usage"

    def __init__(
        self,
        *,
        max_sessions: int = 10_000,
        max_models: int = 256,
        path: str | None = None,
        debounce: float = 0.5,
        sync: str = "debounced",
        lock_timeout: float = 5.0,
        registry: CollectorRegistry | None = None,
    ) -> None:
        if not (isinstance(max_sessions, int) and max_sessions >= 1):
            raise ValueError(f"max_sessions: expected an int >= 1, got {max_sessions!r}")
        if not (isinstance(max_models, int) and max_models >= 1):
            raise ValueError(f"max_models: expected an int >= 1, got {max_models!r}")
        if path is not None and (not isinstance(path, str) or not path):
            raise ValueError("path: expected a non-empty string or nothing")
        if not (isinstance(debounce, int | float) and 0 <= debounce < math.inf):
            raise ValueError(f"debounce: expected seconds >= 0, got {debounce!r}")
        if sync not in _SYNC_MODES:
            raise ValueError(f"sync: expected one of {', '.join(_SYNC_MODES)}, got {sync!r}")
        if not (isinstance(lock_timeout, int | float) and 0 < lock_timeout < math.inf):
            raise ValueError(f"lock_timeout: expected seconds > 0, got {lock_timeout!r}")
        # Absolute, so every error message names the file unambiguously.
        self.path: Final = path if path in (None, ":memory:") else os.path.abspath(path)
        self.debounce: Final = float(debounce)
        self.sync: Final = sync
        self.lock_timeout: Final = float(lock_timeout)
        self.writes = 0
        """Store transactions committed."""
        self.write_errors = 0
        """Store transactions that failed (their totals are held for the next write)."""
        # Without a store: what GET /admin/usage reports, per kind, keys in LRU order
        # (sessions capped at max_sessions; models are capped by model_label).
        self._seen: dict[str, OrderedDict[str, _Seen]] = {k: OrderedDict() for k in _KINDS}
        # The same keys in key order: a page starts at its cursor in O(log n).
        self._seen_keys: dict[str, SortedList[str]] = {k: SortedList() for k in _KINDS}
        # With a store: the totals added since the last write, per (kind, key).
        self._held: dict[tuple[str, str], _Seen] = {}
        self._timer: asyncio.Task[None] | None = None
        self._in_flight: set[asyncio.Task[Exception | None]] = set()
        self._executor: concurrent.futures.ThreadPoolExecutor | None = None
        self._store: _Store | None = None
        self.max_sessions: Final = max_sessions
        self.max_models: Final = max_models
        self.registry: Final = registry
        self._registered = False
        self._sessions: OrderedDict[str, _Totals] = OrderedDict()  # least recent first
        self._by_label: dict[tuple[str, str], _Totals] = {}
        self._models: set[str] = set()

    # -- hooks -----------------------------------------------------------------------------

    def check(self) -> None:
        """``context-proxy check``: the store (if any) could be opened; read-only.

        Raises:
            UsageStoreError: the file's directory is missing or not writable, or
                the file is not a usage store of this version (or is corrupt).
        """
        path = self.path
        if path is None or path == ":memory:":
            return
        if not os.path.lexists(path):
            parent = os.path.dirname(path)
            if not (os.path.isdir(parent) and os.access(parent, os.W_OK | os.X_OK)):
                raise UsageStoreError(
                    f"usage store {path} cannot be created: directory {parent} "
                    "is missing or not writable"
                )
            return
        if not (os.path.isfile(path) and os.access(path, os.R_OK | os.W_OK)):
            raise UsageStoreError(f"usage store {path}: not a readable and writable file")
        # With a write-ahead log another process (a running proxy) has it open:
        # read it as any reader does; without one, as immutable (no -wal left behind).
        mode = "ro" if os.path.exists(path + "-wal") else "ro&immutable=1"
        try:
            conn = sqlite3.connect(
                f"file:{urllib.parse.quote(path)}?mode={mode}", uri=True, timeout=self.lock_timeout
            )
        except sqlite3.Error as exc:
            raise UsageStoreError(f"usage store {path} cannot be used: {exc}") from exc
        try:
            problems = [str(r[0]) for r in conn.execute("PRAGMA quick_check").fetchall()]
            if problems != ["ok"]:
                raise UsageStoreError(f"usage store {path} is corrupt: {problems[0][:200]}")
            version = int(conn.execute("PRAGMA user_version").fetchone()[0])
            columns = tuple(r[1] for r in conn.execute("PRAGMA table_info(usage)"))
            tables = [
                r[0] for r in conn.execute("SELECT name FROM sqlite_master WHERE type = 'table'")
            ]
            problem = _schema_problem(version, tables, columns) if version or tables else None
            if problem is not None:
                raise UsageStoreError(f"usage store {path} {problem}")
        except sqlite3.Error as exc:
            raise UsageStoreError(f"usage store {path} cannot be used: {exc}") from exc
        finally:
            conn.close()

    async def startup(self) -> None:
        """Register on ``registry`` if one was given.

        With ``path``: open (or create) the store and verify it.

        Raises:
            ValueError: another live collector on that registry already uses
                one of :data:`METRIC_NAMES` (e.g. a second usage plugin).
            UsageStoreError: the store is corrupt, locked by another connection
                for longer than ``lock_timeout``, of a foreign schema, or cannot
                be opened. Nothing is ever reset.
        """
        if self.registry is not None and not self._registered:
            self.registry.register(self)
            self._registered = True
        if self.path is None or self._executor is not None:
            return
        # One thread: writes and reads run in submission order on one connection.
        self._executor = concurrent.futures.ThreadPoolExecutor(
            max_workers=1, thread_name_prefix="context-proxy-usage"
        )
        try:
            self._store = await self._run(
                _Store.open, self.path, self.lock_timeout, self.sync == "commit"
            )
        except BaseException:
            await self._close()
            raise
        log.info("usage store %s: open", self.path)

    async def commit(self, record: ExchangeRecord) -> None:
        """Count the record's tokens, whatever its outcome.

        A failed exchange can still have been billed (a stream cut after its
        usage event), so every record counts; ``None`` counts add nothing. A
        record without a session id counts in the metrics only, and so does a
        request refused because its session was closed: the session's totals were
        forgotten in :meth:`session_closed`, and the refusal must not bring them back.
        A record without a wire digest (refused before its body was parsed, or a
        passthrough route) is not counted at all: it never reached an upstream as
        an exchange, so it has no usage, and counting it would only add series of
        zeros (model ``unknown``) and inflate a session's ``requests``.

        Raises:
            UsageStoreError: ``sync = "commit"`` and the write failed (the totals
                are held for the next write).
        """
        if not record.wire_digest:
            return
        model = self.model_label(record.model)
        refused_as_closed = _refused_as_closed(record)
        self._report(record, model, None if refused_as_closed else record.session_id)
        key = (record.protocol, model)
        totals = self._by_label.get(key)
        if totals is None:
            totals = self._by_label[key] = _Totals()
        totals.add(record)
        totals.observe_share(record)
        sid = record.session_id
        if sid is not None and not refused_as_closed:
            usage = self._sessions.get(sid)
            if usage is None:
                usage = self._sessions[sid] = _Totals()
                if len(self._sessions) > self.max_sessions:
                    self._sessions.popitem(last=False)
            else:
                self._sessions.move_to_end(sid)
            usage.add(record)
        # Last: everything in memory is counted even when this write fails.
        if self.sync == "commit" and self._store is not None:
            await self._flush()

    async def session_closed(self, session_id: str) -> None:
        """Forget the session's totals (the per-model counters keep them)."""
        self._sessions.pop(session_id, None)

    def session_state(self, session_id: str) -> Mapping[str, Scalar]:
        """The session's totals, or ``{}`` for a session not (or no longer) known.

        Keys: ``input_tokens``, ``output_tokens``, ``cache_read_tokens``,
        ``cache_write_tokens``, ``cache_write_5m_tokens``, ``cache_write_1h_tokens``
        and ``requests`` (ints), ``cached_input_share`` (float 0..1, or None
        before any input token was reported).
        """
        usage = self._sessions.get(session_id)
        if usage is None:
            return {}
        return {
            "input_tokens": usage.input_tokens,
            "output_tokens": usage.output_tokens,
            "cache_read_tokens": usage.cache_read_tokens,
            "cache_write_tokens": usage.cache_write_tokens,
            "cache_write_5m_tokens": usage.cache_write_5m_tokens,
            "cache_write_1h_tokens": usage.cache_write_1h_tokens,
            "cached_input_share": usage.cached_share(),
            "requests": usage.requests,
        }

    async def usage_page(self, query: UsageQuery) -> UsagePage:
        """Per-session or per-model totals for ``GET /admin/usage``, ascending by key.

        With a store, every total held in memory is written first, so the page
        counts every commit that returned; the read runs in the store's thread.

        Raises:
            UsageStoreError: the write before the read, or the read, failed.
        """
        if self._store is None:
            seen = self._seen[query.by]
            since = -math.inf if query.since is None else query.since
            after = self._seen_keys[query.by].irange(
                minimum=query.after, inclusive=(query.after is None, True)
            )
            # Bounded by the keys kept; a since that selects few rows walks more of them.
            recent = (key for key in after if seen[key].last_seen >= since)
            rows = [seen[key].usage_row(key) for key in itertools.islice(recent, query.limit + 1)]
        else:
            await self._flush()
            store = self._store
            try:
                rows = await self._run(store.page, query)
            except sqlite3.Error as exc:
                raise UsageStoreError(f"usage store {self.path}: read failed: {exc}") from exc
        return UsagePage(tuple(rows[: query.limit]), more=len(rows) > query.limit)

    async def flush(self) -> None:
        """Write every held total now and wait until every write has landed.

        Raises:
            UsageStoreError: a write failed (its totals stay held).
        """
        await self._flush()

    async def shutdown(self) -> None:
        """Write what is held, close the store, unregister from ``registry``.

        Raises:
            UsageStoreError: the final write failed (the store is closed anyway).
        """
        if self.registry is not None and self._registered:
            self.registry.unregister(self)
            self._registered = False
        if self._executor is None:
            return
        try:
            await self._flush()
        finally:
            await self._close()

    # -- the report and its store ----------------------------------------------------------

    def _report(self, record: ExchangeRecord, model: str, sid: str | None) -> None:
        """Count ``record`` for ``GET /admin/usage``: in memory, or held for the store."""
        when = record.started_at + record.duration_s
        keys = [("model", model)] if sid is None else [("model", model), ("session", sid)]
        for kind, key in keys:
            if self._store is not None:
                held = self._held.get((kind, key))
                if held is None:
                    held = self._held[(kind, key)] = _Seen(when)
                held.add(record, when)
                continue
            seen = self._seen[kind]
            totals = seen.get(key)
            if totals is None:
                totals = seen[key] = _Seen(when)
                self._seen_keys[kind].add(key)
                if kind == "session" and len(seen) > self.max_sessions:
                    oldest, _ = seen.popitem(last=False)
                    self._seen_keys[kind].remove(oldest)
            else:
                seen.move_to_end(key)
            totals.add(record, when)
        if self._store is not None and self.sync != "commit" and self._timer is None:
            self._timer = asyncio.get_running_loop().create_task(
                self._debounced(), name=f"usage-debounce {self.path}"
            )

    def _run(self, fn: Callable[..., _T], *args: object) -> asyncio.Future[_T]:
        if self._executor is None:
            raise UsageStoreError(f"usage store {self.path}: not started")
        return asyncio.get_running_loop().run_in_executor(self._executor, fn, *args)

    async def _debounced(self) -> None:
        await asyncio.sleep(self.debounce)
        self._timer = None
        self._submit()  # a failure is logged and counted by _write

    def _submit(self) -> None:
        """Queue one transaction adding every held total (taken off ``_held`` now)."""
        store = self._store
        if store is None or not self._held:
            return
        held, self._held = self._held, {}
        task = asyncio.get_running_loop().create_task(self._write(store, held))
        self._in_flight.add(task)
        task.add_done_callback(self._in_flight.discard)

    async def _write(self, store: _Store, held: dict[tuple[str, str], _Seen]) -> Exception | None:
        """Run one transaction; returns the failure instead of raising (nobody may await it)."""
        rows = [totals.store_row(kind, key) for (kind, key), totals in held.items()]
        try:
            await self._run(store.add, rows)
        except Exception as exc:
            self.write_errors += 1
            # Hold them again, merged with what came meanwhile, for the next write.
            for (kind, key), totals in held.items():
                now = self._held.get((kind, key))
                if now is not None:
                    _merge(totals, now)
                self._held[(kind, key)] = totals
            log.warning(
                "usage store %s: writing %d row(s) failed: %s; held for the next write",
                self.path,
                len(rows),
                type(exc).__name__,
            )
            return exc
        self.writes += 1
        return None

    async def _flush(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        self._submit()
        if not self._in_flight:
            return
        # asyncio.wait: a cancelled caller (plugin_timeout) does not abort a write.
        tasks = set(self._in_flight)
        await asyncio.wait(tasks)
        for task in tasks:
            error = (
                UsageStoreError(f"usage store {self.path}: a write was cancelled")
                if task.cancelled()
                else task.result()
            )
            if error is not None:
                raise UsageStoreError(f"usage store {self.path}: write failed: {error}") from error

    async def _close(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        executor, store = self._executor, self._store
        self._store = None
        self._executor = None
        if executor is None:
            return
        # Writes still queued are dropped (a shutdown past its budget, with the store
        # locked, waited lock_timeout for each of them in turn: one per commit under
        # sync = "commit"); only the statement running now is waited for.
        executor.shutdown(wait=False, cancel_futures=True)
        await asyncio.to_thread(executor.shutdown, wait=True)
        if store is not None:
            store.close()  # the worker thread is done: no statement runs on it now

    # -- Prometheus collector protocol -----------------------------------------------------

    def describe(self) -> Iterator[CounterMetricFamily | HistogramMetricFamily]:
        """The metric families without samples (used by a registry to check names)."""
        for name, help_text in zip(METRIC_NAMES, _HELP, strict=True):
            yield CounterMetricFamily(name, help_text, labels=_LABELS)
        yield CounterMetricFamily(LIFETIME_METRIC, _LIFETIME_HELP, labels=_LIFETIME_LABELS)
        yield HistogramMetricFamily(SHARE_METRIC, _SHARE_HELP, labels=_LABELS)

    def collect(self) -> Iterator[CounterMetricFamily | HistogramMetricFamily]:
        """The token counters and the share histogram, per ``(protocol, model)`` seen.

        May be called from a scrape thread: it copies the totals first (a dict
        copy is atomic under the GIL) and only reads ints afterwards.
        """
        snapshot = self._by_label.copy()
        families = [
            CounterMetricFamily(name, help_text, labels=_LABELS)
            for name, help_text in zip(METRIC_NAMES, _HELP, strict=True)
        ]
        lifetime = CounterMetricFamily(LIFETIME_METRIC, _LIFETIME_HELP, labels=_LIFETIME_LABELS)
        share = HistogramMetricFamily(SHARE_METRIC, _SHARE_HELP, labels=_LABELS)
        for (protocol, model), totals in sorted(snapshot.items()):
            labels = (protocol, model)
            families[0].add_metric(labels, totals.input_tokens)
            families[1].add_metric(labels, totals.output_tokens)
            families[2].add_metric(labels, totals.cache_read_tokens)
            families[3].add_metric(labels, totals.cache_write_tokens)
            if totals.cache_write_5m_tokens or totals.cache_write_1h_tokens:
                # Only where the upstream split its writes: OpenAI reports none, and
                # Anthropic's total without a split has no lifetime to name.
                lifetime.add_metric([*labels, "5m"], totals.cache_write_5m_tokens)
                lifetime.add_metric([*labels, "1h"], totals.cache_write_1h_tokens)
            counts = list(totals.share_buckets)
            buckets: list[tuple[str, float]] = []
            running = 0
            for bound, count in zip(SHARE_BUCKETS, counts, strict=True):
                running += count
                buckets.append((str(bound), running))
            buckets.append(("+Inf", totals.share_count))
            share.add_metric(list(labels), buckets, totals.share_sum)
        yield from families
        yield lifetime
        yield share

    # -- helpers ---------------------------------------------------------------------------

    def model_label(self, model: str | None) -> str:
        """The ``model`` label value for ``model``: capped in number, cut in length."""
        if not model:
            return "unknown"
        label = model[:_MODEL_LABEL_CHARS]
        if label in self._models:
            return label
        if len(self._models) >= self.max_models:
            return "other"
        self._models.add(label)
        return label


def _merge(into: _Seen, more: _Seen) -> None:
    """Add ``more``'s totals to ``into``."""
    into.requests += more.requests
    into.input_tokens += more.input_tokens
    into.cache_read_tokens += more.cache_read_tokens
    into.cache_write_tokens += more.cache_write_tokens
    into.output_tokens += more.output_tokens
    into.first_seen = min(into.first_seen, more.first_seen)
    into.last_seen = max(into.last_seen, more.last_seen)


def _refused_as_closed(record: ExchangeRecord) -> bool:
    """A request the proxy refused (503) because its session was already closed."""
    return record.outcome is Outcome.REJECTED and record.error == "session_closed"

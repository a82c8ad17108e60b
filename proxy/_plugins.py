"""The plugin API: a plugin is a plain class with documented hook methods.

Hooks, in the order an exchange meets them (docs/design.md §5):

``wants_prepare(meta, fold_level) -> bool``
    Asked first, before each prepare run. Return ``False`` when ``prepare``
    would do nothing for this request at this fold level (e.g. ``fold`` at
    level 0): the plugin's ``wants_body`` and ``prepare`` are then not called
    for this run. When every plugin declines, the run does not happen at all
    (no session lock, no body view, no hook call). Default: ``True``.
``wants_body(meta, fold_level) -> bool``
    Asked before ``prepare``. Return ``True`` only if ``prepare`` must read or
    change the parsed request body at this fold level: the proxy then decodes
    the full JSON body (a transient ~2x the body size). If no plugin wants it,
    the body is never materialized and the raw bytes are forwarded as is.
``prepare(ctx) -> bool``
    Runs under the session's lock (when the request has a session), before the
    request is sent upstream, and again at fold level +1 after each context
    overflow. Edit through ``ctx.view`` (the structural view, no copy of the
    body) or, if granted, ``ctx.body`` (the whole object). Return ``True`` if
    you changed the body; edits made through the view are sent either way.
``wants_commit(session_id) -> bool``
    Asked when an exchange ends, before its record is built. Return ``False``
    when ``commit`` would do nothing for a record of this session (``None``:
    the request has none), e.g. ``fold`` for a request without a session: its
    ``commit`` is then not called for that exchange. When no plugin takes an
    exchange's record, no record, task or session lock is spent on it (the
    commit is still counted). Default: ``True``.
``commit(record)``
    Runs under the session's lock after the response has been forwarded (or has
    failed, or the request was refused after its head), once per finished
    exchange, passthrough routes included. ``record`` is an
    :class:`ExchangeRecord` of scalars only.
``session_closed(session_id)``
    The session was shut down; flush and forget its state.
``session_state(session_id) -> Mapping[str, Scalar]``
    Scalars shown by ``GET /admin/sessions/{id}``; must not block.
``stored_sessions() -> Iterable[tuple[str, float]]``
    Asked once after ``startup``: the sessions the plugin loaded from its
    storage, as ``(session id, last activity in Unix seconds)``. The proxy
    lists them in ``/admin/sessions`` as not live until a request comes.
``usage_page(query) -> UsagePage | None``
    Token usage totals for ``GET /admin/usage`` (the built-in ``usage``
    plugin answers it); ``None``: this plugin keeps none.
``startup()`` / ``shutdown()``
    Process start and graceful stop; ``shutdown`` must flush what it keeps.
``check()``
    Only for ``context-proxy check``: raise with a one-line message if the
    plugin could not start as configured (open its storage read-only; change
    nothing, start nothing).

A hook that raises, or runs past ``plugin_timeout`` seconds, is logged with
the plugin's name and skipped; the request goes on. Plugins run in the order
the ``plugins`` setting lists them.
"""

from __future__ import annotations

import asyncio
import dataclasses
import enum
import importlib
import importlib.metadata
import inspect
import logging
import math
import operator
import re
import types
from collections.abc import Awaitable, Callable, Coroutine, Generator, Iterable, Mapping, Sequence
from typing import Any, ClassVar, Final, ParamSpec, TypeVar

from ._config import require_redis_client
from ._protocols import Protocol
from ._shared import LedgerGate, SharedSessionState
from ._structure import BodyView, Draft, ParsedHolder
from ._wire import WireMetadata

__all__ = [
    "ENTRY_POINT_GROUP",
    "BodyUnavailable",
    "ExchangeRecord",
    "Outcome",
    "Plugin",
    "PluginError",
    "PluginHost",
    "PluginInfo",
    "PrepareContext",
    "Scalar",
    "UsagePage",
    "UsageQuery",
    "UsageRow",
    "discover_plugins",
    "load_plugins",
    "open_ledger_gate",
    "open_session_state",
]

log = logging.getLogger("context_proxy.plugins")

# A TOML bare key (TOML 1.0, "Keys"): what needs no quotes in a table header.
_BARE_KEY: Final = re.compile(r"[A-Za-z0-9_-]+")

ENTRY_POINT_GROUP: Final = "context_proxy.plugins"

Scalar = str | int | float | bool | None
_SCALAR_TYPES: Final = (str, int, float, bool, type(None))


_P = ParamSpec("_P")
_T = TypeVar("_T")


class _Skipped(enum.Enum):
    SKIPPED = "skipped"


# What a dispatch returns when the hook raised or ran out of time (it was logged).
SKIPPED: Final = _Skipped.SKIPPED


class Resumed:
    """A coroutine whose first step already ran, as an awaitable: awaiting it goes on
    from the value that step yielded (the future it waits for), handing the task's
    sends and throws (a cancel) to the coroutine as a plain ``await`` would."""

    __slots__ = ("_coro", "_first")

    def __init__(self, coro: Coroutine[Any, Any, Any], first: object) -> None:
        self._coro: Coroutine[Any, Any, Any] | None = coro
        self._first = first

    def __await__(self) -> Generator[Any, Any, Any]:
        coro, yielded = self._coro, self._first
        assert coro is not None  # awaited once
        self._coro = self._first = None
        while True:
            try:
                received = yield yielded
            except GeneratorExit:
                coro.close()
                raise
            except BaseException as exc:  # a throw (a cancel) goes to the coroutine
                try:
                    yielded = coro.throw(exc)
                except StopIteration as stop:
                    return stop.value
            else:
                try:
                    yielded = coro.send(received)
                except StopIteration as stop:
                    return stop.value


async def within(call: Awaitable[_T], seconds: float) -> _T:
    """Await ``call`` for at most ``seconds`` (``math.inf``: no bound).

    The same as ``async with asyncio.timeout(seconds): await call``, the deadline
    counted from now, but the timer is armed only once ``call`` suspends: a hook
    or a commit that returns without awaiting anything costs no timer handle
    (armed and cancelled: ~6 µs of CPU). A first step that ran past the deadline
    is cut at its first suspension, as a timer armed before it would have been.
    Must run in a task.

    Raises:
        TimeoutError: ``call`` was still running ``seconds`` after the call.
        Whatever ``call`` raises.
    """
    if not math.isfinite(seconds):
        return await call
    deadline = asyncio.get_running_loop().time() + seconds
    async with asyncio.timeout(None) as clock:  # entered unarmed
        if not isinstance(call, types.CoroutineType):  # a future or another awaitable
            clock.reschedule(deadline)
            return await call
        try:
            first = call.send(None)
        except StopIteration as stop:
            return stop.value  # type: ignore[no-any-return]
        clock.reschedule(deadline)
        return await Resumed(call, first)  # type: ignore[no-any-return]


class PluginError(Exception):
    """A plugin could not be found, imported or constructed (raised at start-up)."""


class BodyUnavailable(RuntimeError):
    """``PrepareContext.body`` was read without ``wants_body`` or after the hook returned."""


# Field names per record class (a subclass may add fields): a pure memo, filled once
# per class, so validating a record does not rebuild the field list each time.
_FIELD_NAMES: Final[dict[type[ExchangeRecord], tuple[str, ...]]] = {}


def _field_names(cls: type[ExchangeRecord]) -> tuple[str, ...]:
    """Field names of the dataclass ``cls``, in declaration order."""
    names = _FIELD_NAMES.get(cls)
    if names is None:
        names = _FIELD_NAMES[cls] = tuple(f.name for f in dataclasses.fields(cls))
    return names


# The values of each record class's fields as one tuple, by ``operator.attrgetter``.
_FIELD_GETTERS: Final[dict[type[ExchangeRecord], Callable[[ExchangeRecord], tuple[Any, ...]]]] = {}


def _field_getter(cls: type[ExchangeRecord]) -> Callable[[ExchangeRecord], tuple[Any, ...]]:
    """The getter of every field of ``cls`` at once (a record has more than one)."""
    getter = _FIELD_GETTERS.get(cls)
    if getter is None:
        getter = _FIELD_GETTERS[cls] = operator.attrgetter(*_field_names(cls))
    return getter


class Outcome(enum.StrEnum):
    """What really happened to an exchange (:attr:`ExchangeRecord.outcome`).

    A ``str`` enum: the value (``"ok"``, ``"client_gone"``, ...) is what records, logs,
    the access log and the metrics' ``outcome`` label carry, so ``record.outcome == "ok"``
    and ``record.outcome is Outcome.OK`` are both true for a successful exchange.
    docs/plugins.md lists what each member means.
    """

    OK = "ok"
    CLIENT_GONE = "client_gone"
    REJECTED = "rejected"
    CANCELLED = "cancelled"
    UPSTREAM_ERROR = "upstream_error"
    UPSTREAM_TIMEOUT = "upstream_timeout"
    UPSTREAM_UNREACHABLE = "upstream_unreachable"
    STREAM_ERROR = "stream_error"
    ERROR = "error"


#: The exact types of a record's values that need no ``isinstance`` (the two enums
#: are ``str`` subclasses the proxy itself puts there).
_EXACT_SCALARS: Final = frozenset({str, int, float, bool, type(None), Protocol, Outcome})


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class ExchangeRecord:
    """What a ``commit`` hook learns about one finished exchange: scalars only.

    Sizes are bytes, times are seconds (``started_at`` is Unix time). Token
    counts come from the protocol's usage events and are ``None`` when the
    upstream reported none. ``protocol`` is a :class:`~proxy.Protocol` (a
    ``StrEnum``: JSON and logs show its string value). ``outcome`` is one of
    ``ok``, ``upstream_error``, ``client_gone``, ``upstream_unreachable``,
    ``upstream_timeout``, ``stream_error``, ``rejected``, ``cancelled``,
    ``error`` (see :class:`proxy._exchange.Outcome`).

    A record *without a digest* (``wire_digest`` ``""``, ``outbound_digest``
    ``None``) is one of a request whose body was never parsed as an exchange
    body: refused before or while it was read, not JSON, left mid-body by its
    client (``session_id`` is then ``None`` and ``request_bytes`` the decoded
    bytes received until then), or a passthrough route. It has no history to
    compare, so a hash gate must skip it. docs/plugins.md lists which requests
    are not committed at all.

    Raises:
        TypeError: on construction, if any field is not a str, int, float,
            bool or None (so no container built from the body can leak through).
    """

    exchange_id: str
    session_id: str | None
    protocol: Protocol
    path: str
    model: str | None
    stream: bool
    wire_digest: str
    comparable: bool
    message_count: int
    request_bytes: int
    outbound_bytes: int
    outbound_digest: str | None
    status: int
    outcome: Outcome
    fold_level: int
    refolds: int
    retries: int
    input_tokens: int | None
    output_tokens: int | None
    cache_read_tokens: int | None
    cache_write_tokens: int | None
    cache_write_5m_tokens: int | None
    cache_write_1h_tokens: int | None
    response_bytes: int
    started_at: float
    ttfb_s: float | None
    duration_s: float
    error: str | None

    def __post_init__(self) -> None:
        # One record per exchange: every value in one C call, and their exact types
        # checked as a set; only a value of another type (a subclass) is looked at
        # one by one.
        values = _field_getter(type(self))(self)
        if _EXACT_SCALARS.issuperset(map(type, values)):
            return
        for name, value in zip(_field_names(type(self)), values, strict=True):
            if not isinstance(value, _SCALAR_TYPES):
                raise TypeError(
                    f"ExchangeRecord.{name} must be a scalar, got {type(value).__name__}"
                )

    def as_dict(self) -> dict[str, Scalar]:
        """The record as a ``{field: scalar}`` dict (a fresh dict each call)."""
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}


class PrepareContext:
    """What a ``prepare`` hook sees: wire metadata, fold level and the request body.

    Two ways to the body (docs/design.md §5):

    ``view``
        The structural view (:class:`proxy._structure.BodyView`): history items
        and their values located by byte range in the raw buffer, each decoded
        only when asked and replaced piece by piece. The outbound body is then
        the raw buffer's slices plus the replacement pieces (peak ~1.0x the
        body). Available to every plugin while its hook runs.
    ``body``
        The whole parsed JSON object (a ``dict``), only for a plugin whose
        ``wants_body`` returned ``True``; mutate it in place. Costs a transient
        ~2x the body size (the parsed tree, then the re-serialized body).

    Both show the same request: edits made through the view are in ``body``
    for a later plugin, and changes to ``body`` are in a later plugin's view.
    Each prepare run at a new fold level starts from the body as received
    (or, once a plugin took the whole object, from that object). Reading
    either after the hook returned raises :class:`BodyUnavailable`, so a
    plugin cannot keep them.

    After an overflow (``fold_level`` >= 1) three scalars say what the upstream
    rejected: ``rejected_bytes``, the size of the body it refused (bytes), and
    ``prompt_tokens`` / ``window_tokens``, the prompt's size and the context
    window its error stated (tokens; ``None`` where the wording states none,
    e.g. an overflow event inside a Responses stream). All three are ``None``
    at fold level 0.
    """

    __slots__ = (
        "_closed",
        "_draft",
        "_open",
        "fold_level",
        "meta",
        "path",
        "prompt_tokens",
        "rejected_bytes",
        "session_id",
        "window_tokens",
    )

    def __init__(
        self,
        *,
        meta: WireMetadata,
        fold_level: int,
        session_id: str | None,
        path: str,
        body: dict[str, Any] | None = None,
        draft: Draft | None = None,
        overflow: tuple[int, int | None, int | None] | None = None,
    ) -> None:
        self.meta: Final = meta
        self.fold_level: Final = fold_level
        self.session_id: Final = session_id
        self.path: Final = path
        rejected, prompt, window = overflow if overflow is not None else (None, None, None)
        self.rejected_bytes: Final[int | None] = rejected
        self.prompt_tokens: Final[int | None] = prompt
        self.window_tokens: Final[int | None] = window
        if draft is None and body is not None:
            draft = Draft(meta.protocol, obj=ParsedHolder(body, meta.byte_length))
        self._draft = draft
        self._open = False
        self._closed = False

    @property
    def body(self) -> dict[str, Any]:
        """The parsed request body. Raises :class:`BodyUnavailable` outside the hook.

        Also raises :class:`proxy._wire.WireError` if the body is not a JSON object.
        """
        if not self._open or self._draft is None:
            raise BodyUnavailable(
                "the request body is only available inside prepare() to a plugin "
                "whose wants_body() returned True"
            )
        return self._draft.body()

    @property
    def view(self) -> BodyView:
        """The structural view of the request body. Raises :class:`BodyUnavailable`
        after prepare, or when the exchange has no body."""
        if self._closed or self._draft is None:
            raise BodyUnavailable("the body view is only available inside prepare()")
        return self._draft.view()

    def _grant(self, granted: bool) -> None:
        self._open = granted

    def _close(self) -> None:
        self._open = False
        self._closed = True
        self._draft = None


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class UsageQuery:
    """What ``GET /admin/usage`` asks a plugin's :meth:`Plugin.usage_page` for.

    ``by``: ``"session"`` (one row per session id) or ``"model"`` (per model
    label). ``since``: Unix seconds; only rows last seen at or after it, or
    ``None`` for all. ``after``: the key of the previous page's last row
    (rows come in ascending key order), ``None`` for the first page.
    ``limit``: most rows wanted (>= 1).
    """

    by: str
    since: float | None
    after: str | None
    limit: int


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class UsageRow:
    """One row of ``GET /admin/usage``: token totals of one session or model.

    Counts are tokens (``requests``: exchanges); ``cached_input_tokens`` are
    the input tokens read from the upstream's prompt cache and
    ``cache_write_tokens`` those written to it, both part of
    ``input_tokens``. ``last_seen``: Unix seconds of the end of the last
    exchange counted.
    """

    key: str
    requests: int
    input_tokens: int
    cached_input_tokens: int
    cache_write_tokens: int
    output_tokens: int
    last_seen: float


@dataclasses.dataclass(frozen=True, slots=True)
class UsagePage:
    """The answer to a :class:`UsageQuery`: ``rows`` in ascending key order, at
    most ``limit``; ``more`` when rows follow the last one."""

    rows: tuple[UsageRow, ...]
    more: bool


class Plugin:
    """Base class of a plugin; override only the hooks you need.

    The proxy constructs a plugin with the keyword arguments of its
    ``[plugin.<name>]`` table in the config file. ``name`` identifies it in
    logs, metrics and the admin view; it defaults to the class name.
    """

    name: ClassVar[str] = ""

    def wants_prepare(self, meta: WireMetadata, fold_level: int) -> bool:
        """Whether ``prepare`` has anything to do at this fold level (default: yes).

        Return ``False`` only when ``prepare`` would return ``False`` without
        reading or changing the body: ``wants_body`` and ``prepare`` are then
        skipped for this prepare run. Synchronous and instant (no I/O); an
        exception is logged and counts as ``True``.
        """
        return True

    def wants_body(self, meta: WireMetadata, fold_level: int) -> bool:
        """Whether ``prepare`` needs the parsed body at this fold level (default: no)."""
        return False

    async def prepare(self, ctx: PrepareContext) -> bool:
        """Inspect or change the request; return ``True`` if the body was changed."""
        return False

    def wants_commit(self, session_id: str | None) -> bool:
        """Whether ``commit`` has anything to do for an exchange of ``session_id``
        (``None``: it has no session); default: yes.

        Return ``False`` only when ``commit`` would return without doing anything
        for such a record: it is then not called for that exchange. Synchronous
        and instant (no I/O); an exception is logged and counts as ``True``.
        """
        return True

    async def commit(self, record: ExchangeRecord) -> None:
        """Book-keep one finished exchange. Keep only scalars from ``record``."""

    async def session_closed(self, session_id: str) -> None:
        """Forget (after flushing) everything kept for ``session_id``."""

    def session_state(self, session_id: str) -> Mapping[str, Scalar]:
        """Scalars describing ``session_id`` for the admin view (default: none)."""
        return {}

    def stored_sessions(self) -> Iterable[tuple[str, float]]:
        """Sessions loaded from storage at start-up: ``(id, last activity, Unix seconds)``.

        Asked once, right after ``startup``; synchronous, no I/O (return what
        ``startup`` loaded). Default: none.
        """
        return ()

    async def usage_page(self, query: UsageQuery) -> UsagePage | None:
        """Token usage totals for ``GET /admin/usage``; ``None`` (default): none kept."""
        return None

    async def startup(self) -> None:
        """Called once before the proxy accepts requests; raise to refuse to start."""

    async def shutdown(self) -> None:
        """Called once at graceful shutdown, after every session was closed; flush here."""

    def check(self) -> None:
        """``context-proxy check``: raise if the plugin could not start as configured.

        Called on a constructed plugin that was never started. Open storage
        read-only, create and change nothing; the exception's message (one
        line) is printed as the problem. Default: nothing to check.
        """


def _listed(plugin: Plugin) -> list[tuple[str, float]]:
    """``plugin.stored_sessions()`` read to the end (inside the failure isolation)."""
    return list(plugin.stored_sessions())


def open_ledger_gate(
    redis_url: str, *, timeout: float = 1.0, max_connections: int = 16
) -> LedgerGate:
    """The ledger's hash gate shared by every node of a cluster, kept in Redis.

    For a plugin that runs in cluster mode (it received ``redis_url``, see
    :func:`load_plugins`'s ``shared``): call it in ``startup`` and ``await
    gate.close()`` in ``shutdown``. Building the gate connects to nothing; the
    first call does. redis is imported here, on first use, so ``import proxy``
    and a plugin that may run without a cluster never load it.

    Args:
        redis_url: ``redis://host:port/db`` (or ``rediss://``, ``unix://``).
        timeout: seconds per command and for connecting, never retried (one
            command against a hung Redis costs this); a commit runs after the
            answer was sent, so a slow Redis delays bookkeeping, never a client.
        max_connections: size of the bounded connection pool (>= 2).

    Raises:
        ValueError: ``redis_url`` is not a Redis URL; ``ConfigError`` (a ValueError)
            when the Redis client (the ``cluster`` extra) is not installed.
    """
    # Imported on demand: the Redis client is a cluster-mode dependency only.
    require_redis_client("redis_url")
    from ._cluster.ledger import RedisLedgerGate

    return RedisLedgerGate(redis_url, timeout=timeout, max_connections=max_connections)


def open_session_state(
    redis_url: str, *, name: str, timeout: float = 1.0, max_connections: int = 8
) -> SharedSessionState:
    """Plugin ``name``'s per-session state shared by every node of a cluster, in Redis.

    For a plugin that runs in cluster mode (it received ``redis_url``): call it
    in ``startup`` and ``await state.close()`` in ``shutdown``. Building it
    connects to nothing; the first call does. redis is imported here, on first
    use, as for :func:`open_ledger_gate`.

    Args:
        redis_url: ``redis://host:port/db`` (or ``rediss://``, ``unix://``).
        name: the plugin's name: each plugin has its own hash per session.
        timeout: seconds per command and for connecting, never retried.
        max_connections: size of the bounded connection pool (>= 2).

    Raises:
        ValueError: ``redis_url`` is not a Redis URL.
    """
    # Imported on demand: the Redis client is a cluster-mode dependency only.
    from ._cluster.session_state import RedisSessionState

    return RedisSessionState(redis_url, name=name, timeout=timeout, max_connections=max_connections)


_HOOKS: Final = (
    "wants_prepare",
    "wants_body",
    "prepare",
    "wants_commit",
    "commit",
    "session_closed",
    "session_state",
    "stored_sessions",
    "usage_page",
    "startup",
    "shutdown",
)


def _overrides(plugin: Plugin, hook: str) -> bool:
    """Whether ``plugin`` defines ``hook`` itself rather than inheriting :class:`Plugin`'s.

    Every base hook does nothing (and never suspends), so skipping a plugin that
    does not override a hook changes nothing observable.
    """
    instance_attrs = getattr(plugin, "__dict__", None)
    if instance_attrs is not None and hook in instance_attrs:
        return True
    return getattr(type(plugin), hook, None) is not getattr(Plugin, hook)


@dataclasses.dataclass(frozen=True, slots=True)
class PluginInfo:
    """One plugin found in the config or through the entry-point group."""

    name: str
    target: str
    source: str
    version: str | None


def _plugin_name(plugin: Plugin) -> str:
    return plugin.name or type(plugin).__name__


def discover_plugins() -> list[PluginInfo]:
    """Plugins registered under the ``context_proxy.plugins`` entry-point group."""
    found: list[PluginInfo] = []
    for ep in importlib.metadata.entry_points(group=ENTRY_POINT_GROUP):
        version = ep.dist.version if ep.dist is not None else None
        dist = ep.dist.name if ep.dist is not None else "?"
        found.append(PluginInfo(ep.name, ep.value, f"entry point ({dist})", version))
    return sorted(found, key=lambda info: info.name)


def _resolve(spec: str) -> tuple[type[Plugin], str]:
    """Find the class for ``spec``: an entry-point name or ``module:Class``."""
    target = spec
    if ":" not in spec:
        for ep in importlib.metadata.entry_points(group=ENTRY_POINT_GROUP, name=spec):
            target = ep.value
            break
        else:
            raise PluginError(
                f"plugin {spec!r}: no entry point of that name and not a 'module:Class' path"
            )
    module_name, _, attr = target.partition(":")
    try:
        obj: Any = importlib.import_module(module_name)
        for part in attr.split("."):
            obj = getattr(obj, part)
    except (ImportError, AttributeError) as exc:
        raise PluginError(f"plugin {spec!r}: cannot import {target}: {exc}") from None
    if not (isinstance(obj, type) and issubclass(obj, Plugin)):
        raise PluginError(f"plugin {spec!r}: {target} is not a subclass of proxy.Plugin")
    return obj, target


def load_plugins(
    specs: Sequence[str],
    options: Mapping[str, Mapping[str, Any]],
    *,
    timeout: float,
    shared: Mapping[str, Any] | None = None,
    strict: bool = True,
) -> PluginHost:
    """Import and construct the plugins named in ``specs``, in order.

    A plugin's options table (``[plugin.<key>]`` of the config) is passed as
    keyword arguments. Its key is the entry as written in ``plugins``; an
    entry-point plugin also answers to its class's ``name``. ``shared``: proxy
    settings offered to every plugin whose constructor has a keyword parameter
    of that name, unless its table sets it (e.g. ``redis_url``, so the ledger
    joins cluster mode with the proxy). With ``strict`` (the default), a table
    no plugin of ``specs`` takes is an error: a typo must not be ignored.

    Raises:
        PluginError: a plugin is unknown, not a :class:`Plugin`, rejected its
            options or has two tables; a table belongs to no plugin. The
            message names it.
    """
    plugins: list[Plugin] = []
    taken: set[str] = set()
    for spec in specs:
        cls, target = _resolve(spec)
        keys = _table_keys(spec, cls)
        tables = [key for key in keys if key in options]
        if len(tables) > 1:
            raise PluginError(
                f"plugin {spec!r}: options in both [{_table(tables[0])}] and "
                f"[{_table(tables[1])}]; keep one"
            )
        taken.update(tables)
        kwargs = dict(options[tables[0]]) if tables else {}
        if shared:
            accepted = inspect.signature(cls).parameters
            for name, value in shared.items():
                if name in accepted and name not in kwargs:
                    kwargs[name] = value
        try:
            plugins.append(cls(**kwargs))
        except (TypeError, ValueError) as exc:
            raise PluginError(f"plugin {spec!r} ({target}): bad options: {exc}") from None
    if strict:
        for key in options:
            if key not in taken:
                raise PluginError(_unclaimed(key))
    return PluginHost(plugins, timeout=timeout)


def _table_keys(spec: str, cls: type[Plugin]) -> list[str]:
    """The option-table keys a plugin entry answers to: the entry, and an
    entry-point plugin's ``name``."""
    keys = [spec]
    if ":" not in spec and cls.name and cls.name != spec:
        keys.append(cls.name)
    return keys


def _unclaimed(key: str) -> str:
    return (
        f"[{_table(key)}]: no plugin in the plugins list takes this table "
        "(its key is the entry as written there, or an entry-point plugin's name)"
    )


def unclaimed_tables(specs: Sequence[str], options: Mapping[str, object]) -> list[str]:
    """One problem line per ``[plugin.<key>]`` table no entry of ``specs`` takes.

    An entry that cannot be resolved still owns the table keyed by the entry as
    written: loading it reports the import problem, and that table is not
    reported a second time as belonging to no plugin.
    """
    keys: set[str] = set()
    for spec in specs:
        try:
            cls, _ = _resolve(spec)
        except PluginError:
            keys.add(spec)
            continue
        keys.update(_table_keys(spec, cls))
    return [_unclaimed(key) for key in options if key not in keys]


def _table(key: str) -> str:
    """The TOML header of the options table ``key`` (quoted when not a bare key)."""
    return f"plugin.{key}" if _BARE_KEY.fullmatch(key) else f'plugin."{key}"'


class PluginHost:
    """Runs the hooks of an ordered list of plugins with isolation and a time budget.

    Which plugin implements which hook is decided once, here: for each hook the
    host keeps the plugins (in configured order) that override it, so a hook no
    plugin overrides costs nothing per request (no lookup, no coroutine, no
    timer). Hooks are therefore resolved when the host is built; a method
    attached to a plugin later is not seen.

    Every async hook call goes through one dispatch path (:meth:`_dispatch`):
    the time budget, the isolation and the failure log live there. Every
    ``run_*`` method catches a plugin's exception or timeout, logs it with the
    plugin's name (never the body) and counts it in ``failures``; it never
    raises to the caller, except for cancellation of the caller itself.

    Args:
        plugins: the plugins, in the order their hooks run.
        timeout: seconds each async hook call may take (``plugin_timeout``);
            0 or less means no limit.
    """

    __slots__ = (
        "_asks_body",
        "_asks_commit",
        "_asks_prepare",
        "_by_hook",
        "failures",
        "plugins",
        "timeout",
    )

    def __init__(self, plugins: Iterable[Plugin], *, timeout: float) -> None:
        self.plugins: tuple[Plugin, ...] = tuple(plugins)
        self.timeout = timeout if timeout > 0 else math.inf
        self.failures: dict[str, int] = {}
        self._by_hook: Final[Mapping[str, tuple[Plugin, ...]]] = {
            hook: tuple(p for p in self.plugins if _overrides(p, hook)) for hook in _HOOKS
        }
        # Per plugin with a prepare hook: whether it has a wants_prepare / wants_body to ask.
        self._asks_prepare: Final = tuple(
            _overrides(p, "wants_prepare") for p in self._by_hook["prepare"]
        )
        self._asks_body: Final = tuple(
            _overrides(p, "wants_body") for p in self._by_hook["prepare"]
        )
        # Per plugin with a commit hook: whether it has a wants_commit to ask.
        self._asks_commit: Final = tuple(
            _overrides(p, "wants_commit") for p in self._by_hook["commit"]
        )

    def implementing(self, hook: str) -> tuple[Plugin, ...]:
        """The plugins that override ``hook``, in order (``()`` for an unknown hook)."""
        return self._by_hook.get(hook, ())

    def _failed(self, plugin: Plugin, hook: str, exc: BaseException, budget: float) -> None:
        name = _plugin_name(plugin)
        self.failures[name] = self.failures.get(name, 0) + 1
        if isinstance(exc, TimeoutError):
            log.warning("plugin %s: %s exceeded its %.1fs budget; skipped", name, hook, budget)
        else:
            # The class only: the text (or a traceback's) may quote the request a hook
            # saw. A plugin author who wants the details logs them in the plugin.
            log.warning("plugin %s: %s raised %s; skipped", name, hook, type(exc).__name__)

    async def _dispatch(
        self,
        plugin: Plugin,
        hook: str,
        call: Callable[_P, Awaitable[_T]],
        *args: _P.args,
        **kwargs: _P.kwargs,
    ) -> _T | _Skipped:
        """Await one hook call within the budget; a failure is logged and returns SKIPPED.

        The budget is ``timeout`` (at least 10 s for ``shutdown``, which flushes).
        Cancellation of the caller propagates.
        """
        budget = max(self.timeout, 10.0) if hook == "shutdown" else self.timeout
        try:
            return await within(call(*args, **kwargs), budget)
        except Exception as exc:
            self._failed(plugin, hook, exc, budget)
            return SKIPPED

    def _dispatch_sync(
        self,
        plugin: Plugin,
        hook: str,
        call: Callable[_P, _T],
        *args: _P.args,
        **kwargs: _P.kwargs,
    ) -> _T | _Skipped:
        """One call of a synchronous hook (no budget: it must not block); failures as above."""
        try:
            return call(*args, **kwargs)
        except Exception as exc:
            self._failed(plugin, hook, exc, self.timeout)
            return SKIPPED

    def wants_body(self, meta: WireMetadata, fold_level: int) -> list[bool | None]:
        """Per plugin with a ``prepare`` hook (in order): its grant for this prepare run.

        ``None``: the plugin declined the run (its ``wants_prepare`` returned
        ``False``); it is not asked ``wants_body`` and its ``prepare`` is not
        called. Otherwise whether it asked for the parsed body. A plugin whose
        ``wants_prepare`` raises takes part; one whose ``wants_body`` raises
        gets no body. When every entry is ``None`` (or there is none), the
        caller may skip the run: :meth:`run_prepare` would call nothing.
        """
        answers: list[bool | None] = []
        # The calls are _dispatch_sync's, inline (a call less per plugin, every request):
        # one that raises is booked as a failure and counts as skipped.
        for plugin, asks_prepare, asks_body in zip(
            self._by_hook["prepare"], self._asks_prepare, self._asks_body, strict=True
        ):
            if asks_prepare:
                hook = plugin.wants_prepare  # looked up outside the try, as for _dispatch_sync
                try:
                    takes = hook(meta, fold_level)
                except Exception as exc:
                    self._failed(plugin, "wants_prepare", exc, self.timeout)
                else:
                    if not takes:
                        answers.append(None)
                        continue
            if asks_body:
                wants = plugin.wants_body
                try:
                    answer = wants(meta, fold_level)
                except Exception as exc:
                    self._failed(plugin, "wants_body", exc, self.timeout)
                    answer = False
                answers.append(bool(answer))
            else:
                answers.append(False)
        return answers

    async def run_prepare(self, ctx: PrepareContext, wants: Sequence[bool | None]) -> bool:
        """Run every ``prepare`` hook in order; ``True`` if any reported a change.

        ``wants`` is what :meth:`wants_body` returned for this attempt; a plugin
        whose entry is ``None`` declined the run and is not called. A plugin
        granted the body that then raised may have changed it part way, so it
        also counts as a change (the body is re-serialized, never guessed).
        """
        changed = False
        for plugin, granted in zip(self._by_hook["prepare"], wants, strict=True):
            if granted is None:
                continue
            ctx._grant(granted)
            try:
                result = await self._dispatch(plugin, "prepare", plugin.prepare, ctx)
            finally:
                ctx._grant(False)
            # A skipped plugin that held the body may have half-changed it.
            touched = granted if result is SKIPPED else bool(result)
            changed = touched or changed
        return changed

    def whole_body_edit_failed(self, wants: Sequence[bool | None], exc: BaseException) -> None:
        """Book a failure for the plugins of this prepare run that held ``ctx.body``.

        Called when the object they changed cannot be serialized (``exc``: the
        encoder's error); the caller then sends the body as it was before the
        run. The error's message is not logged: it may quote the body.
        """
        names = [
            _plugin_name(plugin)
            for plugin, granted in zip(self._by_hook["prepare"], wants, strict=True)
            if granted
        ]
        for name in names:
            self.failures[name] = self.failures.get(name, 0) + 1
        log.warning(
            "plugin %s: prepare left ctx.body that cannot be serialized (%s); "
            "the changes of this prepare run are skipped",
            ", ".join(names),
            type(exc).__name__,
        )

    def committers(self, session_id: str | None) -> tuple[Plugin, ...]:
        """The plugins whose ``commit`` takes an exchange of ``session_id``, in order:
        every one with a ``commit`` hook but those whose ``wants_commit`` returned
        ``False`` (one that raises takes part). ``()``: nothing to book."""
        hooked = self._by_hook["commit"]
        if not any(self._asks_commit):
            return hooked
        takers: list[Plugin] = []
        for plugin, asks in zip(hooked, self._asks_commit, strict=True):
            if asks:
                # _dispatch_sync, inline (a call less per plugin, every request).
                hook = plugin.wants_commit  # looked up outside the try, as for _dispatch_sync
                try:
                    takes = hook(session_id)
                except Exception as exc:
                    self._failed(plugin, "wants_commit", exc, self.timeout)
                else:
                    if not takes:
                        continue
            takers.append(plugin)
        return tuple(takers)

    async def run_commit(
        self, record: ExchangeRecord, plugins: Sequence[Plugin] | None = None
    ) -> None:
        """Run ``plugins``' ``commit`` hooks (default: every one, see :meth:`committers`)
        in order with the same immutable record."""
        for plugin in self._by_hook["commit"] if plugins is None else plugins:
            await self._dispatch(plugin, "commit", plugin.commit, record)

    async def run_session_closed(self, session_id: str) -> None:
        """Tell every plugin that ``session_id`` is closed."""
        for plugin in self._by_hook["session_closed"]:
            await self._dispatch(plugin, "session_closed", plugin.session_closed, session_id)

    def session_state(self, session_id: str) -> dict[str, dict[str, Scalar]]:
        """``{plugin name: {key: scalar}}`` for the admin view; non-scalars are dropped."""
        state: dict[str, dict[str, Scalar]] = {}
        for plugin in self._by_hook["session_state"]:
            items = self._dispatch_sync(plugin, "session_state", plugin.session_state, session_id)
            if items is SKIPPED:
                continue
            scalars = {k: v for k, v in items.items() if isinstance(v, _SCALAR_TYPES)}
            if scalars:
                state[_plugin_name(plugin)] = scalars
        return state

    def stored_sessions(self) -> dict[str, float]:
        """Every plugin's :meth:`Plugin.stored_sessions`: ``{id: last activity}``
        (Unix seconds, the latest any plugin reported); a failing plugin is
        logged and skipped."""
        merged: dict[str, float] = {}
        for plugin in self._by_hook["stored_sessions"]:
            items = self._dispatch_sync(plugin, "stored_sessions", _listed, plugin)
            if items is SKIPPED:
                continue
            for sid, last in items:
                if isinstance(sid, str) and sid and isinstance(last, int | float):
                    merged[sid] = max(float(last), merged.get(sid, -math.inf))
        return merged

    @property
    def keeps_usage(self) -> bool:
        """Whether a plugin answers :meth:`usage_page` (``GET /admin/usage``)."""
        return bool(self._by_hook["usage_page"])

    async def usage_page(self, query: UsageQuery) -> UsagePage | None:
        """The first usage-keeping plugin's answer to ``query``.

        ``None``: no plugin keeps usage, or the one asked failed or ran past
        ``plugin_timeout`` (logged and counted like any hook failure).
        """
        for plugin in self._by_hook["usage_page"]:
            page = await self._dispatch(plugin, "usage_page", plugin.usage_page, query)
            if page is SKIPPED:
                return None
            if page is not None:
                return page
        return None

    async def startup(self) -> None:
        """Start every plugin; unlike the other hooks a failure here is fatal.

        Raises:
            PluginError: naming the plugin whose ``startup`` raised.
        """
        starts = self._by_hook["startup"]
        stops = self._by_hook["shutdown"]
        started: list[Plugin] = []
        for plugin in self.plugins:
            try:
                # Not _dispatch: a startup failure is fatal, and startup has no budget.
                if any(plugin is p for p in starts):
                    await plugin.startup()
            except Exception as exc:
                # Undo what already started (files, threads, connections), newest first:
                # a plugin may have opened something in __init__, so every earlier one.
                for done in reversed(started):
                    if any(done is p for p in stops):
                        await self._dispatch(done, "shutdown", done.shutdown)
                raise PluginError(f"plugin {_plugin_name(plugin)}: startup failed: {exc}") from exc
            started.append(plugin)

    async def shutdown(self) -> None:
        """Stop every plugin (flush); failures are logged, the others still run."""
        for plugin in self._by_hook["shutdown"]:
            await self._dispatch(plugin, "shutdown", plugin.shutdown)

"""The plugin API: a plugin is a plain class with documented hook methods.

Hooks, in the order an exchange meets them (DESIGN section 5):

``wants_body(meta, fold_level) -> bool``
    Asked before ``prepare``. Return ``True`` only if ``prepare`` must read or
    change the parsed request body at this fold level: the proxy then decodes
    the full JSON body (a transient ~2x the body size). If no plugin wants it,
    the body is never materialized and the raw bytes are forwarded as is.
``prepare(ctx) -> bool``
    Runs under the session's lock (when the request has a session), before the
    request is sent upstream, and again at fold level +1 after each context
    overflow. Return ``True`` if you changed ``ctx.body``.
``commit(record)``
    Runs under the session's lock after the response has been forwarded (or has
    failed). ``record`` is an :class:`ExchangeRecord` of scalars only.
``session_closed(session_id)``
    The session was shut down; flush and forget its state.
``session_state(session_id) -> Mapping[str, Scalar]``
    Scalars shown by ``GET /admin/sessions/{id}``; must not block.
``startup()`` / ``shutdown()``
    Process start and graceful stop; ``shutdown`` must flush what it keeps.

A hook that raises, or runs past ``plugin_timeout`` seconds, is logged with
the plugin's name and skipped; the request goes on. Plugins run in the order
the ``plugins`` setting lists them.
"""

from __future__ import annotations

import asyncio
import dataclasses
import importlib
import importlib.metadata
import logging
import math
from collections.abc import Iterable, Mapping, Sequence
from typing import Any, ClassVar, Final

from .wire import WireMetadata

__all__ = [
    "ENTRY_POINT_GROUP",
    "BodyUnavailable",
    "ExchangeRecord",
    "Plugin",
    "PluginError",
    "PluginHost",
    "PluginInfo",
    "PrepareContext",
    "Scalar",
    "discover_plugins",
    "load_plugins",
]

log = logging.getLogger("context_proxy.plugins")

ENTRY_POINT_GROUP: Final = "context_proxy.plugins"

Scalar = str | int | float | bool | None
_SCALAR_TYPES: Final = (str, int, float, bool, type(None))


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


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class ExchangeRecord:
    """What a ``commit`` hook learns about one finished exchange: scalars only.

    Sizes are bytes, times are seconds (``started_at`` is Unix time). Token
    counts come from the protocol's usage events and are ``None`` when the
    upstream reported none. ``outcome`` is one of ``ok``, ``upstream_error``,
    ``client_gone``, ``upstream_unreachable``, ``upstream_timeout``,
    ``stream_error``, ``rejected``, ``cancelled``.

    Raises:
        TypeError: on construction, if any field is not a str, int, float,
            bool or None (so no container built from the body can leak through).
    """

    exchange_id: str
    session_id: str | None
    protocol: str
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
    outcome: str
    fold_level: int
    refolds: int
    retries: int
    input_tokens: int | None
    output_tokens: int | None
    cache_read_tokens: int | None
    response_bytes: int
    started_at: float
    ttfb_s: float | None
    duration_s: float
    error: str | None

    def __post_init__(self) -> None:
        # One record per exchange: the field list is cached, not rebuilt each time.
        for name in _field_names(type(self)):
            value = getattr(self, name)
            if not isinstance(value, _SCALAR_TYPES):
                raise TypeError(
                    f"ExchangeRecord.{name} must be a scalar, got {type(value).__name__}"
                )

    def as_dict(self) -> dict[str, Scalar]:
        """The record as a ``{field: scalar}`` dict (a fresh dict each call)."""
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}


class PrepareContext:
    """What a ``prepare`` hook sees: wire metadata, fold level and, on request, the body.

    ``body`` is the parsed JSON request (a ``dict``) shared by all plugins of
    this send attempt; mutate it in place. It is only available while the hook
    runs and only if the plugin's ``wants_body`` returned ``True``; reading it
    otherwise raises :class:`BodyUnavailable`, so a plugin cannot keep it.
    """

    __slots__ = ("_body", "_open", "fold_level", "meta", "path", "session_id")

    def __init__(
        self,
        *,
        meta: WireMetadata,
        fold_level: int,
        session_id: str | None,
        path: str,
        body: dict[str, Any] | None,
    ) -> None:
        self.meta: Final = meta
        self.fold_level: Final = fold_level
        self.session_id: Final = session_id
        self.path: Final = path
        self._body = body
        self._open = False

    @property
    def body(self) -> dict[str, Any]:
        """The parsed request body. Raises :class:`BodyUnavailable` outside the hook."""
        if not self._open or self._body is None:
            raise BodyUnavailable(
                "the request body is only available inside prepare() to a plugin "
                "whose wants_body() returned True"
            )
        return self._body

    def _grant(self, granted: bool) -> None:
        self._open = granted

    def _close(self) -> None:
        self._open = False
        self._body = None


class Plugin:
    """Base class of a plugin; override only the hooks you need.

    The proxy constructs a plugin with the keyword arguments of its
    ``[plugin.<name>]`` table in the config file. ``name`` identifies it in
    logs, metrics and the admin view; it defaults to the class name.
    """

    name: ClassVar[str] = ""

    def wants_body(self, meta: WireMetadata, fold_level: int) -> bool:
        """Whether ``prepare`` needs the parsed body at this fold level (default: no)."""
        return False

    async def prepare(self, ctx: PrepareContext) -> bool:
        """Inspect or change the request; return ``True`` if ``ctx.body`` was changed."""
        return False

    async def commit(self, record: ExchangeRecord) -> None:
        """Book-keep one finished exchange. Keep only scalars from ``record``."""

    async def session_closed(self, session_id: str) -> None:
        """Forget (after flushing) everything kept for ``session_id``."""

    def session_state(self, session_id: str) -> Mapping[str, Scalar]:
        """Scalars describing ``session_id`` for the admin view (default: none)."""
        return {}

    async def startup(self) -> None:
        """Called once before the proxy accepts requests; raise to refuse to start."""

    async def shutdown(self) -> None:
        """Called once at graceful shutdown, after every session was closed; flush here."""


_NOOP_COMMIT: Final = Plugin.commit


def _inherits_noop_commit(plugin: Plugin) -> bool:
    """Whether ``plugin.commit`` is the base class's no-op (not overridden anywhere)."""
    if getattr(type(plugin), "commit", None) is not _NOOP_COMMIT:
        return False
    instance_attrs = getattr(plugin, "__dict__", None)
    return instance_attrs is None or "commit" not in instance_attrs


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
    specs: Sequence[str], options: Mapping[str, Mapping[str, Any]], *, timeout: float
) -> PluginHost:
    """Import and construct the plugins named in ``specs``, in order.

    ``options[spec]`` (the ``[plugin.<spec>]`` config table) is passed as
    keyword arguments.

    Raises:
        PluginError: a plugin is unknown, not a :class:`Plugin`, or rejected its
            options; the message names it.
    """
    plugins: list[Plugin] = []
    for spec in specs:
        cls, target = _resolve(spec)
        kwargs = dict(options.get(spec, {}))
        try:
            plugins.append(cls(**kwargs))
        except (TypeError, ValueError) as exc:
            raise PluginError(f"plugin {spec!r} ({target}): bad options: {exc}") from None
    return PluginHost(plugins, timeout=timeout)


class PluginHost:
    """Runs the hooks of an ordered list of plugins with isolation and a time budget.

    Every ``run_*`` method catches a plugin's exception or timeout, logs it with
    the plugin's name (never the body) and counts it in ``failures``; it never
    raises to the caller, except for cancellation of the caller itself.
    """

    __slots__ = ("failures", "plugins", "timeout")

    def __init__(self, plugins: Iterable[Plugin], *, timeout: float) -> None:
        self.plugins: tuple[Plugin, ...] = tuple(plugins)
        self.timeout = timeout if timeout > 0 else math.inf
        self.failures: dict[str, int] = {}

    def _failed(self, plugin: Plugin, hook: str, exc: BaseException) -> None:
        name = _plugin_name(plugin)
        self.failures[name] = self.failures.get(name, 0) + 1
        if isinstance(exc, TimeoutError):
            log.warning(
                "plugin %s: %s exceeded its %.1fs budget; skipped", name, hook, self.timeout
            )
        else:
            log.warning(
                "plugin %s: %s raised %s: %s; skipped",
                name,
                hook,
                type(exc).__name__,
                exc,
                exc_info=log.isEnabledFor(logging.DEBUG),
            )

    def wants_body(self, meta: WireMetadata, fold_level: int) -> list[bool]:
        """Per plugin, whether it asked for the parsed body (a raising plugin: no)."""
        answers: list[bool] = []
        for plugin in self.plugins:
            try:
                answers.append(bool(plugin.wants_body(meta, fold_level)))
            except Exception as exc:
                self._failed(plugin, "wants_body", exc)
                answers.append(False)
        return answers

    async def run_prepare(self, ctx: PrepareContext, wants: Sequence[bool]) -> bool:
        """Run every ``prepare`` hook in order; ``True`` if any reported a change.

        A plugin granted the body that then raised may have changed it part way,
        so it also counts as a change (the body is re-serialized, never guessed).
        """
        changed = False
        for plugin, granted in zip(self.plugins, wants, strict=True):
            ctx._grant(granted)
            try:
                async with asyncio.timeout(self.timeout):
                    changed = bool(await plugin.prepare(ctx)) or changed
            except Exception as exc:
                self._failed(plugin, "prepare", exc)
                changed = changed or granted
            finally:
                ctx._grant(False)
        return changed

    async def run_commit(self, record: ExchangeRecord) -> None:
        """Run every ``commit`` hook in order with the same immutable record."""
        for plugin in self.plugins:
            if _inherits_noop_commit(plugin):
                # Plugin.commit does nothing and never suspends: skipping it saves the
                # per-exchange timeout (a timer handle) and changes nothing observable.
                continue
            try:
                async with asyncio.timeout(self.timeout):
                    await plugin.commit(record)
            except Exception as exc:
                self._failed(plugin, "commit", exc)

    async def run_session_closed(self, session_id: str) -> None:
        """Tell every plugin that ``session_id`` is closed."""
        for plugin in self.plugins:
            try:
                async with asyncio.timeout(self.timeout):
                    await plugin.session_closed(session_id)
            except Exception as exc:
                self._failed(plugin, "session_closed", exc)

    def session_state(self, session_id: str) -> dict[str, dict[str, Scalar]]:
        """``{plugin name: {key: scalar}}`` for the admin view; non-scalars are dropped."""
        state: dict[str, dict[str, Scalar]] = {}
        for plugin in self.plugins:
            try:
                items = plugin.session_state(session_id)
            except Exception as exc:
                self._failed(plugin, "session_state", exc)
                continue
            scalars = {k: v for k, v in items.items() if isinstance(v, _SCALAR_TYPES)}
            if scalars:
                state[_plugin_name(plugin)] = scalars
        return state

    async def startup(self) -> None:
        """Start every plugin; unlike the other hooks a failure here is fatal.

        Raises:
            PluginError: naming the plugin whose ``startup`` raised.
        """
        started: list[Plugin] = []
        for plugin in self.plugins:
            try:
                await plugin.startup()
            except Exception as exc:
                # Undo what already started (files, threads, connections), newest first.
                for done in reversed(started):
                    try:
                        await done.shutdown()
                    except Exception as undo_exc:
                        self._failed(done, "shutdown", undo_exc)
                raise PluginError(f"plugin {_plugin_name(plugin)}: startup failed: {exc}") from exc
            started.append(plugin)

    async def shutdown(self) -> None:
        """Stop every plugin (flush); failures are logged, the others still run."""
        for plugin in self.plugins:
            try:
                async with asyncio.timeout(max(self.timeout, 10.0)):
                    await plugin.shutdown()
            except Exception as exc:
                self._failed(plugin, "shutdown", exc)

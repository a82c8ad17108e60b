"""context-proxy: a streaming LLM proxy with a strict request-memory lifetime.

The public API: the plugin interface (:class:`Plugin`, :class:`PrepareContext`,
:class:`ExchangeRecord`, :class:`Outcome`, :class:`WireMetadata`, :class:`Protocol`,
:class:`UsageQuery`, :class:`UsagePage`, :class:`UsageRow`), the structural
view of a request body (:class:`BodyView`, :class:`Node`, :class:`EditConflict`,
:class:`WireError`), the ledger's hash gate shared by a cluster's nodes
(:class:`LedgerGate`, :class:`GateVerdict`, :class:`ClusterUnavailable`,
:func:`open_ledger_gate`) and a plugin's shared session state
(:class:`SharedSessionState`, :func:`open_session_state`), settings (:class:`Settings`,
:func:`load_settings`) and the application (:func:`build_app` and
:func:`running` to embed the proxy in a program of your own, :func:`serve` to
run it until SIGTERM). Test helpers live in
:mod:`proxy.testing` (the ``testing`` extra; importing this package loads none of
it, nor aiohttp); everything else is internal.
"""

from importlib import metadata as _metadata

from ._app import ProxyApp, build_app, running, serve
from ._config import ConfigError, Settings, load_settings
from ._plugins import (
    BodyUnavailable,
    ExchangeRecord,
    Outcome,
    Plugin,
    PrepareContext,
    Scalar,
    UsagePage,
    UsageQuery,
    UsageRow,
    open_ledger_gate,
    open_session_state,
)
from ._protocols import Protocol
from ._shared import ClusterUnavailable, GateRun, GateVerdict, LedgerGate, SharedSessionState
from ._structure import BodyView, EditConflict, Node
from ._wire import WireError, WireMetadata

__all__ = [
    "BodyUnavailable",
    "BodyView",
    "ClusterUnavailable",
    "ConfigError",
    "EditConflict",
    "ExchangeRecord",
    "GateRun",
    "GateVerdict",
    "LedgerGate",
    "Node",
    "Outcome",
    "Plugin",
    "PrepareContext",
    "Protocol",
    "ProxyApp",
    "Scalar",
    "Settings",
    "SharedSessionState",
    "UsagePage",
    "UsageQuery",
    "UsageRow",
    "WireError",
    "WireMetadata",
    "build_app",
    "load_settings",
    "open_ledger_gate",
    "open_session_state",
    "running",
    "serve",
]

__version__: str = _metadata.version("context-proxy")
"""The installed distribution's version; pyproject.toml's ``version`` is its one source."""

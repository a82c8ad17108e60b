"""context-proxy: a streaming LLM proxy with a strict request-memory lifetime.

The public API: the plugin interface (:class:`Plugin`, :class:`PrepareContext`,
:class:`ExchangeRecord`, :class:`WireMetadata`), settings (:class:`Settings`,
:func:`load_settings`) and the application (:func:`build_app` to embed the proxy
in an aiohttp server, :func:`serve` to run it until SIGTERM). Test helpers live in
:mod:`proxy.testing`; everything else is internal.
"""

from .app import build_app, serve
from .config import ConfigError, Settings, load_settings
from .plugins import BodyUnavailable, ExchangeRecord, Plugin, PrepareContext, Scalar
from .wire import WireMetadata

__all__ = [
    "BodyUnavailable",
    "ConfigError",
    "ExchangeRecord",
    "Plugin",
    "PrepareContext",
    "Scalar",
    "Settings",
    "WireMetadata",
    "build_app",
    "load_settings",
    "serve",
]

__version__ = "0.1.0"

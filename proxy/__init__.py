"""context-proxy: a streaming LLM proxy with a strict request-memory lifetime."""

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
    "load_settings",
]

__version__ = "0.1.0"

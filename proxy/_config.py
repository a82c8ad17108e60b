"""Settings: defaults < TOML file < environment < command-line flags.

Every layer produces a plain ``dict`` of field name to value; the layers are
merged in that order and validated once by :func:`msgspec.convert`, so a bad
value anywhere produces exactly one :class:`ConfigError` naming the setting
(``port: Expected `int` <= 65535``), never a traceback.
"""

from __future__ import annotations

import os
import re
import tomllib
from collections.abc import Mapping
from pathlib import Path
from typing import Annotated, Any, Literal

import msgspec

from ._egress import EgressError, ForwardProxy

__all__ = ["ENV_PREFIX", "ConfigError", "Settings", "check_settings", "load_settings"]

ENV_PREFIX = "CONTEXT_PROXY_"
CONFIG_ENV = ENV_PREFIX + "CONFIG"
"""The environment variable naming the TOML file when no ``--config`` is given."""

MiB = 1024 * 1024

_Seconds = Annotated[float, msgspec.Meta(gt=0)]
_Bytes = Annotated[int, msgspec.Meta(ge=1)]


class ConfigError(ValueError):
    """A setting is missing, malformed or out of range; ``str()`` is one line."""


def require_redis_client(setting: str) -> None:
    """Raise :class:`ConfigError` naming ``setting`` when the Redis client is not installed.

    Cluster mode needs the ``redis`` package, which ships in the ``cluster`` extra
    (``pip install 'context-proxy[cluster]'``) so a single node never installs it.
    The import is attempted (not just looked up): a client that is present but
    cannot be imported is as missing as an absent one.
    """
    try:
        import redis  # noqa: F401  (imported for the check; used by proxy._cluster)
    except ImportError:
        raise ConfigError(
            f"{setting} is set but the Redis client is not installed: "
            "pip install 'context-proxy[cluster]'"
        ) from None


class Settings(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """All settings of one proxy process.

    Durations are seconds, sizes are bytes. Field names are the TOML keys; the
    environment variable of a field is ``CONTEXT_PROXY_`` + its upper-cased name.
    """

    host: str = "127.0.0.1"
    port: Annotated[int, msgspec.Meta(ge=0, le=65535)] = 8787
    upstream_openai: str = "https://api.openai.com"
    upstream_anthropic: str = "https://api.anthropic.com"

    # Body reader (docs/design.md §3).
    max_body_bytes: _Bytes = 100 * MiB
    body_idle_timeout: _Seconds = 30.0
    # Slow clients: request headers not complete within header_timeout → the
    # connection is closed; a body not read within body_timeout → 408.
    header_timeout: _Seconds = 30.0
    body_timeout: _Seconds = 600.0
    body_chunk_bytes: Annotated[int, msgspec.Meta(ge=4096, le=16 * MiB)] = 256 * 1024
    # Admission: body bytes received by the reads in progress (a declared
    # Content-Length only reserves address space, so it is not charged); an
    # upload that cannot fit, or a read growing past it, → 503 with Retry-After.
    max_reading_bytes: _Bytes = 1024 * MiB
    # The spool (docs/design.md §2): a body over spool_above_bytes (0: never) is kept in
    # an anonymous file in spool_dir (None: the system temporary directory), read through
    # a read-only mmap; max_spool_bytes of them in flight, past it 503 with Retry-After.
    spool_above_bytes: Annotated[int, msgspec.Meta(ge=0)] = 4 * MiB
    spool_dir: str | None = None
    max_spool_bytes: _Bytes = 8 * 1024 * MiB

    # Upstream: no total timeout, it would cut a long stream.
    upstream_connect_timeout: _Seconds = 10.0
    upstream_header_timeout: _Seconds = 300.0
    upstream_idle_read_timeout: _Seconds = 300.0
    upstream_max_connections: Annotated[int, msgspec.Meta(ge=0)] = 0
    # Egress (proxy/_egress.py, docs/deploy.md "Egress proxy and private CA"): one forward
    # proxy for every upstream, over HTTPS_PROXY / HTTP_PROXY; NO_PROXY still exempts hosts.
    upstream_proxy: str | None = None
    # A PEM bundle of CA certificates trusted for upstream TLS besides the system's.
    upstream_ca_file: str | None = None

    # File descriptors (docs/deploy.md, "File descriptors"): kept free for probes, 503s and
    # upstream sockets; a new connection is served only if this many stay free after its
    # two (client + upstream), shed below, and accepting pauses under a quarter of it.
    fd_reserve: Annotated[int, msgspec.Meta(ge=4, le=1_000_000)] = 16

    # Exchange lifetime (docs/design.md §1 and §2).
    max_refolds: Annotated[int, msgspec.Meta(ge=0, le=16)] = 2
    fake_completion_retries: Annotated[int, msgspec.Meta(ge=0, le=8)] = 0

    # Plugins (docs/design.md §5).
    plugins: list[str] = msgspec.field(default_factory=lambda: ["fold"])
    plugin: dict[str, dict[str, Any]] = msgspec.field(default_factory=dict)
    plugin_timeout: _Seconds = 5.0
    # Commits of one session not booked yet (docs/plugins.md, "Time budgets"): at this
    # many its next request is refused with 503 + Retry-After instead of queueing more;
    # 0 = no bound.
    max_pending_commits: Annotated[int, msgspec.Meta(ge=0)] = 10_000

    # Sessions (docs/design.md §6).
    session_headers: list[str] = msgspec.field(
        default_factory=lambda: ["x-session-id", "x-claude-code-session-id", "session-id"]
    )
    session_from_body: bool = True
    session_from_bearer: bool = False
    require_session: bool = False
    idle_session_cap: Annotated[int, msgspec.Meta(ge=1)] = 10_000
    session_shutdown_timeout: _Seconds = 30.0
    tombstone_ttl: _Seconds = 600.0
    tombstone_cap: Annotated[int, msgspec.Meta(ge=1)] = 100_000

    # Process shutdown.
    shutdown_grace: Annotated[float, msgspec.Meta(ge=0)] = 30.0
    retry_after: Annotated[int, msgspec.Meta(ge=0)] = 5

    # Admin routes.
    admin_token: str | None = None
    admin_allow: list[str] = msgspec.field(default_factory=lambda: ["127.0.0.1", "::1"])

    # Cluster mode (docs/design.md §9, docs/cluster.md). Unset redis_url: one node,
    # in-process state, exactly the embedded behaviour.
    redis_url: str | None = None
    node_id: str | None = None  # None: hostname:port
    cluster_heartbeat_ttl: Annotated[float, msgspec.Meta(ge=0.3, le=3600)] = 15.0
    redis_timeout: _Seconds = 0.5
    redis_max_connections: Annotated[int, msgspec.Meta(ge=2, le=10_000)] = 64

    # Process: the event loop (proxy/_loops.py). uvloop (the optional extra) lowers the CPU
    # of small requests but not against the naive proxy on the same loop, and costs ~5 KiB
    # more per open stream (bench overhead), so it is opt-in; absent, it falls back.
    event_loop: Literal["uvloop", "asyncio"] = "asyncio"
    log_level: str = "INFO"
    # "text" lines or one JSON object per line (proxy/_logs.py); the access log
    # writes one line per exchange on the logger context_proxy.access.
    log_format: Literal["text", "json"] = "text"
    access_log: bool = True
    # OpenTelemetry traces (proxy/_tracing.py, the extra context-proxy[otel]), configured by
    # the standard OTEL_* variables; "off" imports nothing.
    tracing: Literal["off", "otel"] = "off"

    def __post_init__(self) -> None:
        for name in ("upstream_openai", "upstream_anthropic"):
            url = getattr(self, name)
            if not url.startswith(("http://", "https://")):
                raise ConfigError(f"{name}: expected an http:// or https:// URL, got {url!r}")
        if self.upstream_proxy is not None and self.upstream_proxy.strip():
            try:
                ForwardProxy(self.upstream_proxy, "upstream_proxy")
            except EgressError as exc:  # its words never hold the URL's credentials
                raise ConfigError(str(exc)) from None
        if self.redis_url is not None and not self.redis_url.startswith(
            ("redis://", "rediss://", "unix://")
        ):
            # The value is not echoed: a Redis URL may carry a password.
            raise ConfigError("redis_url: expected a redis://, rediss:// or unix:// URL")
        if self.redis_url is not None:
            require_redis_client("redis_url")
        if self.log_level.upper() not in {"DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL"}:
            raise ConfigError(f"log_level: unknown level {self.log_level!r}")


def _read_toml(path: Path, source: str) -> dict[str, Any]:
    """The TOML file's table; ``source`` (``config`` or the variable) starts each error."""
    try:
        with path.open("rb") as fh:
            return tomllib.load(fh)
    except FileNotFoundError:
        raise ConfigError(f"{source}: file not found: {path}") from None
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"{source}: {path}: {exc}") from None


_DEFAULTS = Settings()
_BOOLEANS = {
    "1": True,
    "true": True,
    "yes": True,
    "on": True,
    "0": False,
    "false": False,
    "no": False,
    "off": False,
}


def _env_layer(environ: Mapping[str, str]) -> dict[str, Any]:
    """Settings from ``CONTEXT_PROXY_*`` variables.

    Values are strings; scalars are converted by msgspec (``strict=False``).
    List settings take a comma-separated string; ``plugin`` takes JSON;
    booleans take true/false, 1/0, yes/no or on/off.

    Raises:
        ConfigError: a ``CONTEXT_PROXY_*`` variable names no setting (a typo
            would otherwise be ignored silently), or ``plugin`` is not JSON.
    """
    layer: dict[str, Any] = {}
    known = {ENV_PREFIX + name.upper() for name in Settings.__struct_fields__}
    for key in environ:
        if key.startswith(ENV_PREFIX) and key not in known and key != CONFIG_ENV:
            raise ConfigError(f"unknown setting: environment variable {key}")
    for name in Settings.__struct_fields__:
        raw = environ.get(ENV_PREFIX + name.upper())
        if raw is None:
            continue
        if name == "plugin":
            try:
                layer[name] = msgspec.json.decode(raw)
            except msgspec.DecodeError as exc:
                raise ConfigError(f"{name} (env {ENV_PREFIX}{name.upper()}): {exc}") from None
        elif name in ("plugins", "session_headers", "admin_allow"):
            layer[name] = [item.strip() for item in raw.split(",") if item.strip()]
        elif (
            name in ("admin_token", "redis_url", "node_id", "upstream_proxy", "upstream_ca_file")
            and raw == ""
        ):
            layer[name] = None
        elif isinstance(getattr(_DEFAULTS, name), bool):
            layer[name] = _BOOLEANS.get(raw.strip().lower(), raw)
        else:
            layer[name] = raw
    return layer


def _layers(
    config_path: str | os.PathLike[str] | None,
    environ: Mapping[str, str] | None,
    overrides: Mapping[str, Any] | None,
) -> tuple[dict[str, Any], dict[str, str]]:
    """The merged layers and, per setting, where its value came from.

    The source is what an error names: the environment variable
    (``CONTEXT_PROXY_PORT``) or the flag (``--port``); a file's settings are
    named by their key, as written in the file.

    The file is ``config_path`` (``--config``) or, when that is ``None``, the
    one ``CONTEXT_PROXY_CONFIG`` names (an empty value names none).

    Raises:
        ConfigError: the file cannot be read (one named by the environment says
            so: ``CONTEXT_PROXY_CONFIG: file not found: ...``), or an
            environment variable is unknown.
    """
    merged: dict[str, Any] = {}
    sources: dict[str, str] = {}
    environ = os.environ if environ is None else environ
    if config_path is not None:
        merged.update(_read_toml(Path(config_path), "config"))
    elif environ.get(CONFIG_ENV):
        merged.update(_read_toml(Path(environ[CONFIG_ENV]), CONFIG_ENV))
    env = _env_layer(environ)
    merged.update(env)
    sources.update({name: ENV_PREFIX + name.upper() for name in env})
    for name, value in (overrides or {}).items():
        if value is not None:
            merged[name] = value
            sources[name] = "--" + name.replace("_", "-")
    return merged, sources


def _convert(merged: Mapping[str, Any], sources: Mapping[str, str]) -> Settings:
    try:
        return msgspec.convert(merged, Settings, strict=False)
    except msgspec.ValidationError as exc:
        raise ConfigError(_one_line(str(exc), sources)) from None


def load_settings(
    config_path: str | os.PathLike[str] | None = None,
    *,
    environ: Mapping[str, str] | None = None,
    overrides: Mapping[str, Any] | None = None,
) -> Settings:
    """Build :class:`Settings` from the layers, lowest first.

    ``overrides`` are the command-line flags (``None`` values are ignored, so
    an unset flag leaves the lower layers alone).

    Raises:
        ConfigError: one line naming the offending setting, by its environment
            variable (``CONTEXT_PROXY_PORT: ...``) or flag when it came from one.
    """
    return _convert(*_layers(config_path, environ, overrides))


def check_settings(
    config_path: str | os.PathLike[str] | None = None,
    *,
    environ: Mapping[str, str] | None = None,
) -> tuple[Settings | None, list[str]]:
    """Validate every setting on its own and report each bad one (``context-proxy check``).

    Returns the settings built from the good values (defaults in place of the
    bad ones; ``None`` if the layers cannot be read at all) and one line per
    problem, in the style of :func:`load_settings`'s errors. Never raises.
    """
    try:
        merged, sources = _layers(config_path, environ, None)
    except ConfigError as exc:
        return None, [str(exc)]
    problems: list[str] = []
    good: dict[str, Any] = {}
    for name, value in merged.items():
        try:
            _convert({name: value}, sources)
        except ConfigError as exc:
            problems.append(str(exc))
        else:
            good[name] = value
    try:
        settings: Settings | None = _convert(good, sources)
    except ConfigError as exc:  # settings valid alone, not together
        problems.append(str(exc))
        settings = None
    return settings, problems


def _one_line(message: str, sources: Mapping[str, str] | None = None) -> str:
    """Turn msgspec's ``Expected `int` >= 1 - at `$.port``` into ``port: ...``.

    A setting found in ``sources`` is named by its source instead
    (``CONTEXT_PROXY_PORT: ...``).
    """
    text, sep, where = message.rpartition(" - at `$.")
    if not sep:
        if message.startswith("Object contains unknown field"):
            return f"unknown setting: {message.split('`')[1]}"
        # A check of __post_init__ already says "name: ...".
        path, colon, text = message.partition(": ")
        if not colon or path not in Settings.__struct_fields__:
            return message
    else:
        path = where.rstrip("`")
    name = re.split(r"[.\[]", path, maxsplit=1)[0]
    source = (sources or {}).get(name)
    if source is not None:
        rest = path[len(name) :]
        path = source + rest if source.startswith(ENV_PREFIX) else source
    return f"{path}: {text}"

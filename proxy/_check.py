"""``context-proxy check``: validate a configuration before a restart, like ``nginx -t``.

:func:`check_config` validates every setting on its own (one line per bad one)
and the egress (a forward proxy URL from ``upstream_proxy`` or ``HTTPS_PROXY`` and
the rest; an ``upstream_ca_file`` that cannot be read), imports every enabled
plugin and constructs it with its options, and calls each plugin's optional
``check()`` hook, which opens the plugin's storage read-only (the ledger's SQLite
file); with ``tracing = "otel"``, it finds the extra and the exporters
``OTEL_TRACES_EXPORTER`` names. Nothing is started, served or written.
"""

from __future__ import annotations

import dataclasses
import os
import tempfile
from collections.abc import Mapping

from ._config import check_settings
from ._fdlimit import reachable_nofile_limit, reserve_problem
from ._plugins import PluginError, load_plugins, unclaimed_tables
from ._relay import egress_problems, upstream_targets
from ._spool import spool_dir_problem
from ._tracing import tracing_problems

__all__ = ["CheckReport", "check_config"]


@dataclasses.dataclass(frozen=True, slots=True)
class CheckReport:
    """What :func:`check_config` found: ``problems`` (one line each) or a ``summary`` line."""

    problems: tuple[str, ...]
    summary: str

    @property
    def ok(self) -> bool:
        """Whether the configuration would start."""
        return not self.problems


def shared_files(options: Mapping[str, Mapping[str, object]]) -> list[str]:
    """A problem for every file named by the ``path`` option of two plugin tables.

    The ledger and the usage store each own their SQLite file (its schema and its
    write lock): sharing one, the second to start refuses it, so ``serve`` would stop
    at start-up although each table is fine on its own. Paths are compared after
    ``os.path.realpath``; ``":memory:"`` is never shared.
    """
    owners: dict[str, str] = {}
    problems: list[str] = []
    for table, values in options.items():
        path = values.get("path")
        if not isinstance(path, str) or path in ("", ":memory:"):
            continue
        real = os.path.realpath(path)
        first = owners.setdefault(real, table)
        if first != table:
            problems.append(
                f"plugins {first!r} and {table!r} both keep their state in {path}: "
                "give each its own file"
            )
    return problems


def check_config(
    config_path: str | os.PathLike[str] | None = None,
    *,
    environ: Mapping[str, str] | None = None,
) -> CheckReport:
    """Check the settings ``serve --config config_path`` would use, and their plugins.

    The environment layer applies as for ``serve`` (``environ`` defaults to
    ``os.environ``). Plugins are checked one by one, so every broken one is
    reported; a plugin's ``check()`` hook runs only once it was constructed.
    Never raises for a bad configuration: every problem is a line of the report.
    """
    settings, problems = check_settings(config_path, environ=environ)
    if settings is None:
        return CheckReport(tuple(problems), "")
    fd_problem = reserve_problem(settings.fd_reserve, reachable_nofile_limit())
    if fd_problem is not None:
        problems.append(fd_problem)
    if settings.spool_above_bytes > 0:
        spool_problem = spool_dir_problem(settings.spool_dir or tempfile.gettempdir())
        if spool_problem is not None:
            problems.append(spool_problem)
    # The proxy URLs (setting or HTTPS_PROXY and the rest) and upstream_ca_file.
    env = os.environ if environ is None else environ
    egress = egress_problems(settings, env)
    problems.extend(egress)
    # Where each upstream's connections go, when a proxy is in the way (never its credentials).
    routes = (
        [
            f"{name} upstream through {target.via.shown} (from {target.via.source})"
            for name, target in upstream_targets(settings, env).items()
            if target.via is not None
        ]
        if not egress
        else []
    )
    if settings.tracing == "otel":
        problems.extend(tracing_problems(env))
    constructed: list[str] = []
    for spec in settings.plugins:
        try:
            host = load_plugins(
                [spec], settings.plugin, timeout=settings.plugin_timeout, strict=False
            )
        except PluginError as exc:
            problems.append(str(exc))
            continue
        plugin = host.plugins[0]
        check = getattr(plugin, "check", None)
        if callable(check):
            try:
                check()
            except Exception as exc:
                problems.append(f"plugin {spec!r}: {' '.join(str(exc).split())}")
                continue
        constructed.append(spec)
    problems.extend(unclaimed_tables(settings.plugins, settings.plugin))
    problems.extend(shared_files(settings.plugin))
    where = os.fspath(config_path) if config_path is not None else "defaults and environment"
    summary = (
        f"{where}: settings ok, {len(constructed)} plugin(s) ok"
        f"{' (' + ', '.join(constructed) + ')' if constructed else ''},"
        f" would listen on {settings.host}:{settings.port}"
        f"{'; ' + ', '.join(routes) if routes else ''}"
    )
    return CheckReport(tuple(problems), summary)

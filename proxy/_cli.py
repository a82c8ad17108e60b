"""The ``context-proxy`` command: serve | emulate | bench | sessions | plugins."""

from __future__ import annotations

import asyncio
import json
import os
import sys
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Iterable, Iterator, Sequence
from typing import Any, Final

import click

from ._config import ConfigError, Settings, load_settings
from ._logs import setup_logging
from ._loops import run as run_loop
from ._plugins import PluginError, discover_plugins

__all__ = ["main"]

_CONFIG_HELP: Final = (
    "TOML settings file; without it, the file CONTEXT_PROXY_CONFIG names (if set)."
)


def _settings(config: str | None, **flags: Any) -> Settings:
    try:
        return load_settings(config, overrides=flags)
    except ConfigError as exc:
        raise click.ClickException(f"bad setting: {exc}") from None


def _cannot_listen(host: str, port: int, exc: OSError) -> click.ClickException:
    """One line for a start-up that could not bind: ``cannot listen on HOST:PORT: reason``.

    asyncio's message repeats the address (``error while attempting to bind on
    address ...``); the errno's own text says it once.
    """
    reason = os.strerror(exc.errno).lower() if exc.errno else str(exc)
    return click.ClickException(f"cannot listen on {host}:{port}: {reason}")


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(
    package_name="context-proxy", prog_name="context-proxy", message="%(prog)s %(version)s"
)
def main() -> None:
    """context-proxy: a streaming LLM proxy with a strict request-memory lifetime."""


@main.command()
@click.option("--config", "config", type=click.Path(dir_okay=False), help=_CONFIG_HELP)
@click.option("--host", help="Address to listen on [127.0.0.1].")
@click.option("--port", type=int, help="Port to listen on [8787].")
@click.option("--upstream-openai", help="OpenAI upstream base URL [https://api.openai.com].")
@click.option(
    "--upstream-anthropic", help="Anthropic upstream base URL [https://api.anthropic.com]."
)
@click.option("--max-body-bytes", type=int, help="Largest accepted request body, bytes [100 MiB].")
@click.option(
    "--header-timeout", type=float, help="Seconds a client may take to send its headers [30]."
)
@click.option("--body-timeout", type=float, help="Seconds a client may take to send a body [600].")
@click.option("--upstream-connect-timeout", type=float, help="Seconds to connect upstream [10].")
@click.option("--upstream-header-timeout", type=float, help="Seconds to response headers [300].")
@click.option("--upstream-idle-read-timeout", type=float, help="Seconds of upstream silence [300].")
@click.option(
    "--shutdown-grace", type=float, help="Seconds in-flight streams get at shutdown [30]."
)
@click.option("--plugin", "plugins", multiple=True, help="Plugin to enable (repeatable).")
@click.option(
    "--redis-url", help="Cluster mode: shared state in Redis (docs/cluster.md) [unset: one node]."
)
@click.option("--node-id", help="Cluster mode: this node's name [hostname:port].")
@click.option(
    "--event-loop", type=click.Choice(["asyncio", "uvloop"]), help="Event loop [asyncio]."
)
@click.option("--log-level", help="DEBUG, INFO, WARNING or ERROR [INFO].")
@click.option(
    "--log-format", type=click.Choice(["text", "json"]), help="Log lines as text or JSON [text]."
)
@click.option("--access-log/--no-access-log", default=None, help="One log line per exchange [on].")
def serve(config: str | None, plugins: tuple[str, ...], **flags: Any) -> None:
    """Run the proxy until SIGTERM/SIGINT, then drain and exit 0."""
    from ._app import serve as serve_app

    if plugins:
        flags["plugins"] = list(plugins)
    settings = _settings(config, **flags)
    setup_logging(settings.log_level, settings.log_format)
    try:
        run_loop(serve_app(settings), settings.event_loop)
    except PluginError as exc:
        raise click.ClickException(str(exc)) from None
    except ConfigError as exc:  # a setting that only the running process can judge
        raise click.ClickException(f"bad setting: {exc}") from None
    except OSError as exc:
        raise _cannot_listen(settings.host, settings.port, exc) from None


@main.command()
@click.option("--host", default="127.0.0.1", show_default=True)
@click.option("--port", default=8788, show_default=True, type=int)
@click.option(
    "--context-window-tokens",
    type=click.IntRange(min=1),
    default=None,
    help="Reject prompts above N tokens (body bytes // 4) with each protocol's overflow error.",
)
@click.option(
    "--prompt-cache",
    is_flag=True,
    help="Report cached input tokens: the prefix shared with a request of the last 5 minutes.",
)
def emulate(host: str, port: int, context_window_tokens: int | None, prompt_cache: bool) -> None:
    """Run the local upstream emulator (all three protocols, scriptable per request)."""
    from ._emulator import run_emulator
    from ._emulator_script import Script

    setup_logging("INFO")
    script = None
    if context_window_tokens is not None or prompt_cache:
        # body bytes > 4N + 3 is exactly body bytes // 4 > N, the emulator's token count.
        over = None if context_window_tokens is None else 4 * context_window_tokens + 3
        script = Script(
            overflow_above=over, context=context_window_tokens, prompt_cache=prompt_cache
        )
    try:
        run_emulator(host, port, default_script=script)
    except OSError as exc:
        raise _cannot_listen(host, port, exc) from None


@main.command()
@click.option("--port", default=8787, show_default=True, type=int, help="Proxy port.")
@click.option("--once", is_flag=True, help="Exit after the demo request instead of serving on.")
def demo(port: int, once: bool) -> None:
    """Start the emulator and the proxy, stream one answer through it, keep serving.

    The proxy listens on 127.0.0.1:PORT with both upstreams pointed at the
    built-in emulator, so clients and SDKs can be tried with no network.
    """
    from ._demo import run_demo

    setup_logging("WARNING")
    try:
        asyncio.run(run_demo(port, once=once))
    except OSError as exc:
        raise _cannot_listen("127.0.0.1", port, exc) from None
    except KeyboardInterrupt:
        pass


_BENCHMARKS = ("memory", "overhead", "concurrency", "cluster", "soak", "agent")


@main.command(
    # --help after the kind goes to the benchmark itself (context-proxy bench memory --help).
    context_settings={
        "ignore_unknown_options": True,
        "allow_extra_args": True,
        "help_option_names": [],
    }
)
@click.argument("kind", required=False)
@click.pass_context
def bench(ctx: click.Context, kind: str | None) -> None:
    """Run a benchmark: memory | overhead | concurrency (vs naive) | cluster | soak | agent.

    Arguments after KIND go to the benchmark; `context-proxy bench KIND --help`
    lists them. Needs the `bench` extra.
    """
    import importlib

    if kind not in _BENCHMARKS:
        click.echo(ctx.get_help())
        if kind not in (None, "--help", "-h"):
            raise click.BadParameter(
                f"{kind!r} is not one of {', '.join(_BENCHMARKS)}", param_hint="KIND"
            )
        return
    try:
        module = importlib.import_module(f"benchmarks.{kind}")
    except ImportError as exc:
        raise click.ClickException(
            f"benchmarks need the 'bench' extra: pip install 'context-proxy[bench]' ({exc})"
        ) from None
    sys.exit(module.main(list(ctx.args)))


def _refusal_hint(status: int, token: str | None) -> str:
    """What to do about a 403 from ``/admin/``: the peer is not in ``admin_allow``
    and no token (or a wrong one) was sent."""
    if status != 403:
        return ""
    if token:
        return ": the proxy refused this admin token (CONTEXT_PROXY_ADMIN_TOKEN or --token)"
    return ": set CONTEXT_PROXY_ADMIN_TOKEN or --token to the proxy's admin_token"


def _admin_get(url: str, token: str | None) -> Any:
    request = urllib.request.Request(url)
    if token:
        request.add_header("Authorization", f"Bearer {token}")
    try:
        with urllib.request.urlopen(request, timeout=10) as resp:
            return json.load(resp)
    except urllib.error.HTTPError as exc:
        raise click.ClickException(
            f"{url}: HTTP {exc.code}{_refusal_hint(exc.code, token)}"
        ) from None
    except OSError as exc:
        raise click.ClickException(f"{url}: {exc}") from None


#: Width of the CLI's tables: they fit a classic terminal.
TABLE_WIDTH: Final = 80

#: Widest an ellipsis column (a session id) gets: the rest of the line is for values.
ELLIPSIS_WIDTH: Final = 16


def _print_table(
    columns: Sequence[str],
    rows: Iterable[Sequence[str]],
    *,
    numeric: frozenset[str] = frozenset(),
    ellipsis: frozenset[str] = frozenset(),
) -> None:
    """A borderless rich table, at most :data:`TABLE_WIDTH` columns wide.

    Columns named in ``numeric`` never wrap (a number is never split across
    lines); columns in ``ellipsis`` are cut with an ellipsis at
    :data:`ELLIPSIS_WIDTH` characters; other long cells fold.
    """
    from rich.console import Console
    from rich.table import Table

    table = Table(box=None, pad_edge=False, header_style="bold", show_edge=False, padding=(0, 1))
    for column in columns:
        if column in numeric:
            table.add_column(column, no_wrap=True, justify="right", min_width=len(column))
        elif column in ellipsis:
            table.add_column(column, no_wrap=True, overflow="ellipsis", max_width=ELLIPSIS_WIDTH)
        else:
            table.add_column(column, overflow="fold")
    for row in rows:
        table.add_row(*row)
    console = Console(width=TABLE_WIDTH, soft_wrap=False)
    with console.capture() as captured:
        console.print(table)
    # rich pads every cell to its column's width: drop the trailing blanks.
    click.echo("\n".join(line.rstrip() for line in captured.get().splitlines()))


def _age(seconds: float) -> str:
    """``seconds`` (seconds) ago as a person reads it.

    "just now" under 5 s, then "42 s ago", "3 m ago", "2 h ago", "5 d ago" (floored).
    """
    if seconds < 5:
        return "just now"
    for unit, size in (("d", 86400.0), ("h", 3600.0), ("m", 60.0)):
        if seconds >= size:
            return f"{int(seconds // size)} {unit} ago"
    return f"{int(seconds)} s ago"


def _is_timestamp(key: str) -> bool:
    """A plugin state key holding Unix seconds (``last_activity``, ``*_at``), shown as an age."""
    return key == "last_activity" or key.endswith("_at")


def _state_cell(key: str, value: object, now: float) -> str:
    if _is_timestamp(key) and isinstance(value, (int, float)) and not isinstance(value, bool):
        return _age(max(0.0, now - float(value)))
    if isinstance(value, float):
        return f"{value:g}"
    return _cell(value)


def _cell(value: object) -> str:
    if value is None:
        return "-"
    if isinstance(value, bool):
        return "yes" if value else "no"
    return str(value)


#: Sessions asked for per ``GET /admin/sessions`` page (the proxy's largest page).
LISTING_PAGE: Final = 250


def _listing(base: str, token: str | None) -> Iterator[dict[str, Any]]:
    """Every entry of ``GET /admin/sessions``, page after page (following ``next_cursor``).

    Raises:
        click.ClickException: a page could not be read.
    """
    cursor: str | None = None
    while True:  # bounded: each page moves the cursor forward through the sessions
        query = {"limit": str(LISTING_PAGE)}
        if cursor is not None:
            query["cursor"] = cursor
        page = _admin_get(f"{base}/admin/sessions?{urllib.parse.urlencode(query)}", token)
        yield from page["sessions"]
        cursor = page.get("next_cursor")
        if cursor is None:
            return


@main.command()
@click.option("--url", default="http://127.0.0.1:8787", show_default=True, help="Proxy URL.")
@click.option(
    "--token",
    envvar="CONTEXT_PROXY_ADMIN_TOKEN",
    help="Admin bearer token [env CONTEXT_PROXY_ADMIN_TOKEN; a flag shows in ps].",
)
@click.option("--json", "as_json", is_flag=True, help="Print JSON instead of a table.")
def sessions(url: str, token: str | None, as_json: bool) -> None:
    """Print the sessions of a running proxy, with each plugin's state.

    The table has a row per session; --json prints {"sessions": [...]} with each
    session as GET /admin/sessions/{id} describes it.
    """
    base = url.rstrip("/")
    listing = list(_listing(base, token))
    details = [
        _admin_get(f"{base}/admin/sessions/{urllib.parse.quote(entry['id'], safe='')}", token)
        for entry in listing
    ]
    if as_json:
        click.echo(json.dumps({"sessions": details}, indent=2))
        return
    if not details:
        click.echo("no sessions")
        return
    rows = []
    now = time.time()
    for detail in details:
        # One plugin value per line: a cell folds between entries, never inside a number.
        # A line per plugin, then one per value: a cell folds between entries,
        # never inside a number.
        state = "\n".join(
            line
            for plugin, values in (detail.get("plugins") or {}).items()
            for line in [f"{plugin}:"]
            + [f" {key}={_state_cell(key, value, now)}" for key, value in values.items()]
        )
        idle = detail.get("idle_s")
        rows.append(
            [
                str(detail.get("id")),
                _cell(detail.get("in_flight")),
                _cell(detail.get("requests")),
                _age(float(idle)) if isinstance(idle, (int, float)) else "-",
                _cell(detail.get("tombstoned")),
                state or "-",
            ]
        )
    _print_table(
        ["id", "in_flight", "requests", "active", "closed", "plugins"],
        rows,
        numeric=frozenset({"in_flight", "requests", "active", "closed"}),
        ellipsis=frozenset({"id"}),
    )


@main.command()
@click.option("--config", "config", type=click.Path(dir_okay=False), help=_CONFIG_HELP)
def check(config: str | None) -> None:
    """Check the settings and plugins `serve` would use, like `nginx -t`; start nothing.

    Validates every setting (file and CONTEXT_PROXY_* environment), imports and
    constructs every enabled plugin with its options, and opens plugin storage
    read-only. Exit 0 with a one-line summary, or 1 with one line per problem.
    """
    from ._check import check_config

    report = check_config(config)
    if report.ok:
        click.echo(f"ok: {report.summary}")
        return
    for problem in report.problems:
        click.echo(f"problem: {problem}", err=True)
    sys.exit(1)


@main.command()
@click.option("--config", "config", type=click.Path(dir_okay=False), help=_CONFIG_HELP)
@click.option("--json", "as_json", is_flag=True, help="Print JSON instead of a table.")
def plugins(config: str | None, as_json: bool) -> None:
    """List the plugins found (config and entry points) with their versions.

    The table fits 80 columns (long names fold); --json prints
    {"plugins": [{"name", "enabled", "version", "target"}, ...]}.
    """
    settings = _settings(config)
    found = {info.name: info for info in discover_plugins()}
    enabled = set(settings.plugins)
    listed = []
    for name in sorted(found.keys() | enabled):
        info = found.get(name)
        listed.append(
            {
                "name": name,
                "enabled": name in enabled,
                "version": info.version if info else None,
                "target": info.target if info else name,
            }
        )
    if as_json:
        click.echo(json.dumps({"plugins": listed}, indent=2))
        return
    _print_table(
        ["name", "enabled", "version", "target"],
        [
            [str(p["name"]), _cell(p["enabled"]), _cell(p["version"]), str(p["target"])]
            for p in listed
        ],
    )


if __name__ == "__main__":  # pragma: no cover
    main()

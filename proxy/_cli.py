"""The ``context-proxy`` command: serve | emulate | bench | sessions | usage | top | plugins."""

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
from ._gc import tune_collector
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


class _ExtraMissing(click.ClickException):
    """A command whose optional dependencies are not installed: one line naming the extra.

    Exit code 2, as for a command the installation cannot run (click's usage errors).
    """

    exit_code = 2


def _require_testing_extra(command: str) -> None:
    """Raise :class:`_ExtraMissing` when the ``testing`` extra (aiohttp) is not installed.

    The emulator (and the demo built on it) runs on aiohttp, which the proxy
    itself does not need; the import is attempted, not looked up, so a package
    that is present but broken counts as missing.
    """
    try:
        import aiohttp  # noqa: F401  (imported for the check; used by proxy._emulator)
    except ImportError:
        raise _ExtraMissing(
            f"context-proxy {command} needs the 'testing' extra: "
            "pip install 'context-proxy[testing]'"
        ) from None


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
@click.option(
    "--plugin",
    "plugins",
    multiple=True,
    help="Plugin to enable (repeatable); replaces the default list: add --plugin fold "
    "to keep refolds.",
)
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
@click.option(
    "--tracing",
    type=click.Choice(["off", "otel"]),
    help="OpenTelemetry traces, configured by OTEL_* (extra context-proxy[otel]) [off].",
)
def serve(config: str | None, plugins: tuple[str, ...], **flags: Any) -> None:
    """Run the proxy until SIGTERM/SIGINT, then drain and exit 0."""
    from ._app import serve as serve_app

    if plugins:
        flags["plugins"] = list(plugins)
    settings = _settings(config, **flags)
    setup_logging(settings.log_level, settings.log_format)
    # After the server's imports: what they made is frozen out of every collection.
    tune_collector()
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
    """Run the local upstream emulator (all three protocols, scriptable per request).

    Needs the `testing` extra.
    """
    _require_testing_extra("emulate")
    from ._emulator import run_emulator
    from ._emulator_script import Script, window_script

    setup_logging("INFO")
    # The same collector settings as serve: a benchmark's direct figures are then the
    # emulator's own, not its full collections while thousands of streams open.
    tune_collector()
    script = None
    if context_window_tokens is not None:
        script = window_script(context_window_tokens, prompt_cache=prompt_cache)
    elif prompt_cache:
        script = Script(prompt_cache=True)
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
    built-in emulator, so clients and SDKs can be tried with no network. Other
    settings come from the config file and environment, as for `serve`. Needs
    the `testing` extra.
    """
    _require_testing_extra("demo")
    from ._demo import run_demo

    setup_logging("WARNING")
    try:
        asyncio.run(run_demo(port, once=once))
    except PluginError as exc:
        raise click.ClickException(str(exc)) from None
    except ConfigError as exc:
        raise click.ClickException(f"bad setting: {exc}") from None
    except OSError as exc:
        raise _cannot_listen("127.0.0.1", port, exc) from None
    except KeyboardInterrupt:
        pass


_BENCHMARKS = ("memory", "overhead", "concurrency", "cluster", "soak", "agent", "instructions")


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
    """Run a benchmark: memory | overhead | concurrency | cluster | soak | agent | instructions.

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


def _answered_error(exc: urllib.error.HTTPError) -> str:
    """The ``error`` of a JSON error answer (the proxy's own words), else ``""``."""
    try:
        answer = json.loads(exc.read(4096))
    except (OSError, ValueError):
        return ""
    error = answer.get("error") if isinstance(answer, dict) else None
    return f" ({error})" if isinstance(error, str) and error else ""


def _admin_get(url: str, token: str | None) -> Any:
    request = urllib.request.Request(url)
    if token:
        request.add_header("Authorization", f"Bearer {token}")
    try:
        with urllib.request.urlopen(request, timeout=10) as resp:
            return json.load(resp)
    except urllib.error.HTTPError as exc:
        hint = _refusal_hint(exc.code, token) or _answered_error(exc)
        raise click.ClickException(f"{url}: HTTP {exc.code}{hint}") from None
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
    ellipsis_width: int = ELLIPSIS_WIDTH,
) -> None:
    """A borderless rich table, at most :data:`TABLE_WIDTH` columns wide.

    Columns named in ``numeric`` never wrap (a number is never split across
    lines; a header may be given in lines, ``"cache\nread"``); columns in
    ``ellipsis`` are cut with an ellipsis at ``ellipsis_width`` characters;
    other long cells fold.
    """
    from rich.console import Console
    from rich.table import Table

    from ._top import cell

    table = Table(box=None, pad_edge=False, header_style="bold", show_edge=False, padding=(0, 1))
    for column in columns:
        if column in numeric:
            widest = max(len(line) for line in column.split("\n"))
            table.add_column(column, no_wrap=True, justify="right", min_width=widest)
        elif column in ellipsis:
            table.add_column(column, no_wrap=True, overflow="ellipsis", max_width=ellipsis_width)
        else:
            table.add_column(column, overflow="fold")
    for row in rows:
        # Cells are data (a model or session id a client chose), never markup.
        table.add_row(*(cell(value) for value in row))
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


def _session_state(detail: dict[str, Any]) -> str:
    """A session's ``state`` cell: ``closed`` (tombstoned), ``stored`` (not live) or ``live``."""
    if detail.get("tombstoned"):
        return "closed"
    return "live" if detail.get("live", True) else "stored"


#: Sessions asked for per ``GET /admin/sessions`` page (the proxy's largest page).
LISTING_PAGE: Final = 250


def _pages(
    base: str, token: str | None, route: str, items: str, query: dict[str, str]
) -> Iterator[Any]:
    """Every item under ``items`` of a paged admin ``route``, following ``next_cursor``.

    ``query`` holds the route's own parameters (``limit`` among them).

    Raises:
        click.ClickException: a page could not be read.
    """
    cursor: str | None = None
    seen: set[str] = set()
    while True:  # bounded: each page moves the cursor forward, and a repeated one stops
        page_query = query if cursor is None else {**query, "cursor": cursor}
        page = _admin_get(f"{base}{route}?{urllib.parse.urlencode(page_query)}", token)
        yield from page[items]
        cursor = page.get("next_cursor")
        if cursor is None:
            return
        if cursor in seen:
            raise click.ClickException(f"{base}{route}: the proxy repeated a page cursor")
        seen.add(cursor)


def _listing(base: str, token: str | None) -> Iterator[dict[str, Any]]:
    """Every entry of ``GET /admin/sessions``, page after page.

    Raises:
        click.ClickException: a page could not be read.
    """
    return _pages(base, token, "/admin/sessions", "sessions", {"limit": str(LISTING_PAGE)})


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

    The table has a row per session; its state is "closed" (tombstoned),
    "stored" (loaded from a plugin's storage, the ledger's, and not reached by a
    request since the start) or "live".
    --json prints {"sessions": [...]} with each session as GET /admin/sessions/{id}
    describes it.
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
                _session_state(detail),
                state or "-",
            ]
        )
    _print_table(
        ["id", "in_flight", "requests", "active", "state", "plugins"],
        rows,
        numeric=frozenset({"in_flight", "requests", "active", "state"}),
        ellipsis=frozenset({"id"}),
    )


#: Rows asked for per ``GET /admin/usage`` page (the proxy's largest page).
USAGE_PAGE: Final = 250

#: Widest a usage key (model name, session id) gets before its ellipsis: room for
#: ``claude-sonnet-4-5-20250929`` beside six numbers of up to 6 digits and an age.
USAGE_KEY_WIDTH: Final = 26

#: ``--since`` units a person types: seconds per unit.
_SINCE_UNITS: Final = {"s": 1.0, "m": 60.0, "h": 3600.0, "d": 86400.0}


def _since_query(since: str | None, now: float) -> str | None:
    """``--since`` for the proxy: ``30m``, ``24h``, ``7d`` (ago, from ``now`` in Unix
    seconds) become Unix seconds; anything else (Unix seconds, ISO-8601) goes as it is,
    for the proxy to judge."""
    if since is None:
        return None
    number, unit = since[:-1], since[-1:]
    if unit in _SINCE_UNITS and number.replace(".", "", 1).isdigit():
        return f"{now - float(number) * _SINCE_UNITS[unit]:.3f}"
    return since


def _count(tokens: int) -> str:
    """A token count in at most 5 characters past a million: whole below a million,
    then 1.2M, 12M, 123M, 1.2G... (SI prefixes, rounded)."""
    if tokens < 1_000_000:
        return str(tokens)
    text = ""
    for power, unit in enumerate(("M", "G", "T", "P"), start=2):
        value = tokens / 1000**power
        text = (f"{value:.1f}" if value < 9.95 else f"{value:.0f}") + unit
        if value < 999.5:
            break
    return text


def _usage_rows(base: str, token: str | None, by: str, since: str | None) -> Iterator[Any]:
    """Every row of ``GET /admin/usage``, page after page.

    Raises:
        click.ClickException: a page could not be read.
    """
    query = {"by": by, "limit": str(USAGE_PAGE)}
    if since is not None:
        query["since"] = since
    return _pages(base, token, "/admin/usage", "rows", query)


@main.command()
@click.option("--url", default="http://127.0.0.1:8787", show_default=True, help="Proxy URL.")
@click.option(
    "--token",
    envvar="CONTEXT_PROXY_ADMIN_TOKEN",
    help="Admin bearer token [env CONTEXT_PROXY_ADMIN_TOKEN; a flag shows in ps].",
)
@click.option("--by", type=click.Choice(["model", "session"]), default="model", show_default=True)
@click.option(
    "--since",
    help="Only rows active since: 30m, 24h, 7d ago, Unix seconds or ISO-8601 (UTC).",
)
@click.option("--json", "as_json", is_flag=True, help="Print JSON instead of a table.")
def usage(url: str, token: str | None, by: str, since: str | None, as_json: bool) -> None:
    """Print token usage per model or per session (needs the usage plugin).

    A row per model (or session), most recently active first: requests, then
    input, cache-read, cache-write and output tokens (a million and more as
    1.2M). --json prints {"by": ..., "rows": [...]} with the exact counts, each
    row as GET /admin/usage describes it.
    """
    base = url.rstrip("/")
    now = time.time()
    rows = list(_usage_rows(base, token, by, _since_query(since, now)))
    if as_json:
        click.echo(json.dumps({"by": by, "rows": rows}, indent=2))
        return
    if not rows:
        click.echo("no usage")
        return
    rows.sort(key=lambda r: float(r.get("last_seen") or 0.0), reverse=True)
    # Two-line headers leave the key column room for a dated model name.
    numbers = ("requests", "input", "cache\nread", "cache\nwrite", "output")
    fields = (
        "requests",
        "input_tokens",
        "cached_input_tokens",
        "cache_write_tokens",
        "output_tokens",
    )
    _print_table(
        [by, *numbers, "last seen"],
        [
            [
                str(r.get("key")),
                *(_count(int(r.get(field) or 0)) for field in fields),
                _age(max(0.0, now - float(r.get("last_seen") or 0.0))),
            ]
            for r in rows
        ],
        numeric=frozenset({*numbers, "last seen"}),
        ellipsis=frozenset({by}),
        ellipsis_width=USAGE_KEY_WIDTH,
    )


@main.command()
@click.option("--url", default="http://127.0.0.1:8787", show_default=True, help="Proxy URL.")
@click.option(
    "--token",
    envvar="CONTEXT_PROXY_ADMIN_TOKEN",
    help="Admin bearer token [env CONTEXT_PROXY_ADMIN_TOKEN; a flag shows in ps].",
)
@click.option("--once", is_flag=True, help="Print one frame and exit.")
def top(url: str, token: str | None, once: bool) -> None:
    """Show the in-flight exchanges of a running proxy, live (like top).

    One row per exchange: protocol, session, phase, fold level, bytes held by
    kind (raw, parsed, outbound, response) and age, under a line with the
    process's RSS and the bytes held by phase. Reads GET /admin/events; ends
    when the proxy drains, or on Ctrl-C. Piped, it prints each frame after the last.
    """
    from rich.console import Console
    from rich.live import Live

    from ._top import TopError, print_once, render, snapshots

    stream = snapshots(url.rstrip("/"), token)
    try:
        first = next(stream, None)
        if first is None:
            click.echo("the proxy ended the stream (draining)")
            return
        if once:
            click.echo(print_once(first, TABLE_WIDTH))
            return
        console = Console()
        if not console.is_terminal:
            # Piped (e.g. into a log): one plain frame per snapshot, a blank line between.
            click.echo(print_once(first, TABLE_WIDTH))
            for snap in stream:  # bounded: the proxy ends the stream
                click.echo("\n" + print_once(snap, TABLE_WIDTH))
        else:
            with Live(render(first), console=console, auto_refresh=False) as live:
                for snap in stream:  # bounded: the proxy ends the stream
                    live.update(render(snap), refresh=True)
        click.echo("the proxy ended the stream (draining)")
    except TopError as exc:
        raise click.ClickException(f"{exc}{_refusal_hint(exc.status or 0, token)}") from None
    except KeyboardInterrupt:
        pass
    finally:
        stream.close()


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

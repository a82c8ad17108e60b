"""Test helpers for plugin authors and for the project's own tests.

``proxy_with_emulator`` starts the built-in upstream emulator and a proxy in
front of it, both on ephemeral ports of 127.0.0.1, in the running event loop::

    from proxy.testing import proxy_with_emulator

    async def test_counts_requests() -> None:
        counter = RequestCounter()
        async with proxy_with_emulator(plugins=[counter]) as h:
            client = openai.AsyncOpenAI(base_url=h.openai_base_url, api_key="test")
            await client.chat.completions.create(model="m", messages=[...])
        assert counter.by_model == {"m": 1}

Leaving the block drains the proxy (commit hooks finish, plugins shut down)
and stops the emulator, so assertions after it see the final state. Inside
it, :meth:`Harness.settle` waits for the commits of answers already received.
The pytest fixture ``context_proxy`` (:mod:`proxy.pytest_plugin`) wraps this.

Needs the ``testing`` extra (``pip install 'context-proxy[testing]'``: the
emulator runs on aiohttp); without it, importing this module raises
``ImportError`` naming the extra.

``make_record`` builds the :class:`~proxy.ExchangeRecord` a ``commit``
hook receives, for unit tests that call the hooks directly, without a proxy.
``load_plugins`` loads plugins from option tables exactly as ``serve`` does
(into a :class:`PluginHost` whose ``startup``, ``run_commit`` and ``shutdown``
isolate failures as in the proxy); ``start_emulator`` starts the upstream
emulator alone (an :class:`EmulatorServer`), e.g. in front of ``proxy_process``.

``proxy_process`` runs ``context-proxy serve`` as a child process instead, for
what only a process shows: start-up errors, SIGTERM, state kept across a restart.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import os
import re
import signal
import sys
import time
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any, Final

try:
    import aiohttp
except ImportError:  # the emulator below needs it too
    raise ImportError(
        "proxy.testing needs the 'testing' extra: pip install 'context-proxy[testing]'"
    ) from None

from ._app import AppState, ProxyApp, build_app, running
from ._config import Settings, load_settings
from ._emulator import EmulatorServer, start_emulator
from ._emulator_script import window_script
from ._plugins import ExchangeRecord, Outcome, Plugin, PluginHost, Scalar, load_plugins
from ._protocols import Protocol

if TYPE_CHECKING:
    from opentelemetry.trace import TracerProvider

__all__ = [
    "EmulatorServer",
    "Harness",
    "PluginHost",
    "ProxyProcess",
    "ProxyStartError",
    "load_plugins",
    "make_record",
    "proxy_process",
    "proxy_with_emulator",
    "start_emulator",
]


@dataclasses.dataclass(frozen=True, slots=True)
class Harness:
    """A running proxy in front of a running emulator.

    ``url`` is the proxy's base URL (``http://127.0.0.1:<port>``);
    ``openai_base_url`` adds ``/v1`` as the ``openai`` SDK expects, while the
    ``anthropic`` SDK takes ``url`` itself.
    """

    url: str
    emulator: EmulatorServer
    app: ProxyApp
    settings: Settings
    _stack: contextlib.AsyncExitStack = dataclasses.field(
        default_factory=contextlib.AsyncExitStack, repr=False, compare=False, kw_only=True
    )

    @property
    def openai_base_url(self) -> str:
        """Base URL for ``openai.OpenAI(base_url=...)``."""
        return f"{self.url}/v1"

    @property
    def state(self) -> AppState:
        """The proxy's live state (exchanges, sessions, metrics, plugins)."""
        return self.app.state

    async def settle(self, within: float = 5.0) -> None:
        """Wait until every exchange the proxy has started is finished, commit hooks included.

        A client has the last byte of an answer before the proxy runs the
        ``commit`` hooks, so call this between receiving an answer and asserting
        on what a plugin booked. Covers every request whose handler has started
        (in particular every one whose answer was received), and the pending
        commits (which run after the handler has returned).

        Raises:
            TimeoutError: still busy after ``within`` seconds (a hung stream or hook).
        """
        state = self.state
        me = asyncio.current_task()
        async with asyncio.timeout(within):
            while True:  # bounded by the timeout; each pass waits for real work
                busy: set[asyncio.Task[Any]] = {
                    t
                    for t in (*state.handlers, *state.commits.pending)
                    if t is not me and not t.done()
                }
                if not busy:
                    return
                await asyncio.wait(busy)

    async def session_view(self, session_id: str) -> dict[str, Any] | None:
        """``GET /admin/sessions/{session_id}`` decoded, or ``None`` for an unknown session.

        The view has ``id``, ``in_flight``, ``requests``, ``idle_s`` (seconds), ``live``,
        ``tombstoned`` and ``plugins``: ``{plugin name: {key: scalar}}`` from each
        plugin's ``session_state``. Call :meth:`settle` first to see the last commit.

        Raises:
            aiohttp.ClientResponseError: the admin route answered another error.
        """
        headers = {}
        if self.settings.admin_token:
            headers["Authorization"] = f"Bearer {self.settings.admin_token}"
        async with (
            aiohttp.ClientSession() as http,
            http.get(f"{self.url}/admin/sessions/{session_id}", headers=headers) as resp,
        ):
            if resp.status == 404:
                return None
            resp.raise_for_status()
            view: dict[str, Any] = await resp.json()
            return view

    def metric(self, name: str, **labels: str) -> float | None:
        """The current value of one sample of the proxy's metrics, or ``None`` if absent.

        ``name`` is the sample name as ``GET /metrics`` shows it (counters end in
        ``_total``); ``labels`` must match the sample's labels exactly. Reads the
        app's own registry, so it includes every plugin that exports metrics.
        """
        value: float | None = self.state.metrics.registry.get_sample_value(name, labels)
        return value

    async def stop(self) -> None:
        """Drain and stop the proxy, then the emulator, before the block ends.

        Afterwards every ``commit`` and ``shutdown`` hook has run, so a test can
        assert on what a plugin flushed. Leaving the block later does nothing
        more. Idempotent; do not call it from two tasks at once.
        """
        await self._stack.aclose()


@contextlib.asynccontextmanager
async def proxy_with_emulator(
    *,
    plugins: Sequence[Plugin | str] | None = None,
    plugin_timeout: float | None = None,
    clock: Callable[[], float] = time.monotonic,
    config: str | os.PathLike[str] | None = None,
    context_window_tokens: int | None = None,
    tracer_provider: TracerProvider | None = None,
    **settings: Any,
) -> AsyncIterator[Harness]:
    """Run the emulator and a proxy using ``plugins``, in order.

    Each item of ``plugins`` is a :class:`~proxy.Plugin` instance, or a
    name loaded as ``context-proxy serve`` loads it (an entry-point name or
    ``module:Class``, options from the ``plugin`` setting's table of that name).
    ``plugins=None`` uses the settings' list: none by default here, or that of
    ``config``, a TOML settings file read as ``serve --config`` reads it.
    ``settings`` override :class:`~proxy.Settings` fields (for example
    ``max_body_bytes=1024``); the upstream URLs always point at the emulator,
    the proxy always listens on an ephemeral port of 127.0.0.1, and the
    environment is ignored. ``plugin_timeout`` (seconds) defaults to the settings'.
    ``clock`` (monotonic seconds) drives the session registry: pass a fake one
    to expire tombstones without sleeping. ``context_window_tokens`` gives the
    emulator a context window, as ``context-proxy emulate
    --context-window-tokens N`` does: a prompt over N tokens (body bytes // 4)
    gets the protocol's overflow error, stating N as the maximum.
    ``tracer_provider`` receives the spans
    when ``tracing="otel"`` is among ``settings`` (e.g. an SDK provider with an
    ``InMemorySpanExporter``); without one, the SDK reads the process's ``OTEL_*``
    variables, as ``serve`` does.

    Raises:
        proxy.ConfigError: a bad setting.
        proxy._plugins.PluginError: a plugin cannot be loaded, or its ``startup`` raised.
    """
    async with contextlib.AsyncExitStack() as stack:
        window = None if context_window_tokens is None else window_script(context_window_tokens)
        emulator = await start_emulator(default_script=window)
        stack.push_async_callback(emulator.close)
        # Quick drains by default, and no plugins unless named, when there is no
        # config file to say otherwise.
        defaults: dict[str, Any] = {"plugins": [], "shutdown_grace": 5.0} if config is None else {}
        overrides: dict[str, Any] = {
            **defaults,
            **settings,
            "upstream_openai": emulator.url,
            "upstream_anthropic": emulator.url,
            "plugin_timeout": plugin_timeout,  # None leaves the lower layers alone
        }
        resolved = load_settings(config, environ={}, overrides=overrides)
        host = None
        if plugins is not None:
            timeout = resolved.plugin_timeout
            instances = [
                item
                if isinstance(item, Plugin)
                else load_plugins([item], resolved.plugin, timeout=timeout, strict=False).plugins[0]
                for item in plugins
            ]
            host = PluginHost(instances, timeout=timeout)
        app = build_app(
            resolved, host=host, clock=clock, environ={}, tracer_provider=tracer_provider
        )
        port = await stack.enter_async_context(running(app, "127.0.0.1", 0))
        yield Harness(f"http://127.0.0.1:{port}", emulator, app, resolved, _stack=stack)


# -- the proxy as a child process ----------------------------------------------------------

_LISTENING: Final = re.compile(r"context-proxy listening on (http://[^\s:]+:\d+)")
_READ_BYTES: Final = 64 * 1024


class ProxyStartError(RuntimeError):
    """The proxy process exited, or did not listen in time, before serving.

    ``returncode`` is its exit status (``None`` if it was killed for being too
    slow); ``output`` is everything it printed (stdout and stderr merged).
    """

    def __init__(self, message: str, returncode: int | None, output: str) -> None:
        super().__init__(f"{message} (exit status {returncode}):\n{output}")
        self.returncode = returncode
        self.output = output


class ProxyProcess:
    """A proxy running as a child process (``python -m proxy serve`` by default).

    ``url`` is its base URL; ``lines`` is everything it printed so far (log
    lines on stderr, merged with stdout), one ``str`` per line, kept for the
    whole life of the process: meant for tests, not for long runs.
    """

    __slots__ = ("_proc", "_reader", "lines", "url")

    def __init__(
        self, proc: asyncio.subprocess.Process, reader: asyncio.Task[None], lines: list[str]
    ) -> None:
        self._proc = proc
        self._reader = reader
        self.lines = lines
        self.url = ""

    @property
    def pid(self) -> int:
        """The child's process id."""
        return self._proc.pid

    @property
    def output(self) -> str:
        """Everything printed so far, lines joined with ``\\n``."""
        return "\n".join(self.lines)

    @property
    def returncode(self) -> int | None:
        """The exit status once the process has exited (and was waited for), else ``None``."""
        return self._proc.returncode

    async def session_view(self, session_id: str, within: float = 5.0) -> dict[str, Any] | None:
        """``GET /admin/sessions/{session_id}`` once the session has nothing in flight.

        A client has its answer before the proxy runs the ``commit`` hooks, and
        a child process offers nothing to wait on, so this polls (every 10 ms)
        until the view shows no exchange in flight and the plugins' state. The
        view is as :meth:`Harness.session_view` describes; ``None`` for an
        unknown session.

        Raises:
            TimeoutError: the session was still busy after ``within`` seconds.
            aiohttp.ClientResponseError: the admin route answered another error.
        """
        async with aiohttp.ClientSession() as http, asyncio.timeout(within):
            while True:  # bounded by the timeout
                async with http.get(f"{self.url}/admin/sessions/{session_id}") as resp:
                    if resp.status == 404:
                        return None
                    resp.raise_for_status()
                    view: dict[str, Any] = await resp.json()
                if view["in_flight"] == 0 and view["plugins"] is not None:
                    return view
                await asyncio.sleep(0.01)

    async def stop(self, within: float = 30.0) -> int:
        """Send SIGTERM as a service manager would, wait for the exit, return the exit status.

        The proxy drains (in-flight streams get the ``shutdown_grace``), closes
        its sessions and shuts its plugins down before it exits, so after this
        returns whatever a plugin flushes at shutdown is on disk and ``lines``
        holds the complete output. Idempotent.

        Raises:
            TimeoutError: the process did not exit within ``within`` seconds; it
                has been killed.
        """
        if self._proc.returncode is None:
            self._proc.send_signal(signal.SIGTERM)
            try:
                async with asyncio.timeout(within):
                    await self._proc.wait()
            except TimeoutError:
                self._proc.kill()
                await self._proc.wait()
                raise
        await self._reader  # EOF follows the exit: the output is complete
        return await self._proc.wait()  # the exit status, already known


async def _read_lines(
    stream: asyncio.StreamReader, lines: list[str], listening: asyncio.Future[str]
) -> None:
    """Collect ``stream`` into ``lines`` until EOF; resolve ``listening`` with the bound URL."""
    pending = b""
    while True:  # ends at EOF, which the child's exit guarantees
        # Chunks, not readline(): a log line longer than the reader's limit must not
        # stop the draining (a full pipe would block the child).
        chunk = await stream.read(_READ_BYTES)
        if chunk:
            *complete, pending = (pending + chunk).split(b"\n")
        else:  # EOF: a last line without its newline still counts
            complete, pending = ([pending] if pending else []), b""
        for raw in complete:
            line = raw.decode("utf-8", "replace").rstrip("\r")
            lines.append(line)
            match = _LISTENING.search(line)
            if match and not listening.done():
                listening.set_result(match.group(1))
        if not chunk:
            if not listening.done():
                listening.set_exception(EOFError("the proxy exited before listening"))
            return


@contextlib.asynccontextmanager
async def proxy_process(
    *args: str,
    config: str | os.PathLike[str] | None = None,
    cwd: str | os.PathLike[str] | None = None,
    env: Mapping[str, str] | None = None,
    command: Sequence[str] | None = None,
    start_timeout: float = 30.0,
) -> AsyncIterator[ProxyProcess]:
    """Run ``context-proxy serve`` as a child process on an ephemeral port of 127.0.0.1.

    The command is ``command`` (default: this interpreter's ``python -m proxy``)
    followed by ``serve --host 127.0.0.1 --port 0 --log-level INFO``, then
    ``--config config`` if given, then ``args`` (later flags win, e.g.
    ``"--upstream-openai", emulator.url``). The environment is this process's
    without its ``CONTEXT_PROXY_*`` variables, updated with ``env``. Yields once
    the proxy logs that it listens. Leaving the block stops it with SIGTERM if
    it still runs (see :meth:`ProxyProcess.stop`).

    Use it to test what only a real process shows: start-up errors, signal
    handling, the flush at shutdown, state that must survive a restart.

    Raises:
        ProxyStartError: the process exited, or did not listen within
            ``start_timeout`` seconds (it is killed), before serving.
    """
    base = list(command) if command is not None else [sys.executable, "-m", "proxy"]
    argv = [*base, "serve", "--host", "127.0.0.1", "--port", "0", "--log-level", "INFO"]
    if config is not None:
        argv += ["--config", os.fspath(config)]
    argv += args
    environ = {k: v for k, v in os.environ.items() if not k.startswith("CONTEXT_PROXY_")}
    environ.update(env or {})
    proc = await asyncio.create_subprocess_exec(
        *argv,
        cwd=cwd,
        env=environ,
        stdin=asyncio.subprocess.DEVNULL,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.STDOUT,
    )
    assert proc.stdout is not None
    lines: list[str] = []
    listening: asyncio.Future[str] = asyncio.get_running_loop().create_future()
    reader = asyncio.create_task(_read_lines(proc.stdout, lines, listening))
    child = ProxyProcess(proc, reader, lines)
    try:
        try:
            async with asyncio.timeout(start_timeout):
                child.url = await listening
        except EOFError:
            await proc.wait()
            await reader
            raise ProxyStartError(
                "the proxy exited before listening", proc.returncode, child.output
            ) from None
        except TimeoutError:
            proc.kill()
            await proc.wait()
            await reader
            raise ProxyStartError(
                f"the proxy did not listen within {start_timeout:.0f}s", None, child.output
            ) from None
        yield child
    finally:
        if proc.returncode is None:
            await child.stop()
        await reader


# -- records for unit tests of commit hooks ------------------------------------------------


def make_record(**overrides: Scalar) -> ExchangeRecord:
    """A valid :class:`~proxy.ExchangeRecord`: plausible defaults, any field overridable.

    For plugin authors' unit tests that feed ``commit`` hooks directly: each test
    names only the fields that matter to it, e.g. ``make_record(model="m2",
    session_id="s2")``. The defaults describe a finished, streamed OpenAI chat
    exchange ``x1`` of session ``s1``: protocol ``openai-chat`` on
    ``/v1/chat/completions``, model ``gpt-test``, status 200, outcome ``ok``, a
    comparable history of 3 messages with wire digest ``"a" * 32``, 1000 bytes
    sent upstream unchanged, 500 bytes answered, 250 input and 40 output tokens,
    no cache reads, fold level 0 with no refolds or retries, started at Unix time
    1_700_000_000.0, first byte after 0.2 s, done after 1.5 s, no error.

    Raises:
        TypeError: an override names a field the record does not have, or its
            value is not a scalar (see :class:`~proxy.ExchangeRecord`).
    """
    fields: dict[str, Any] = {
        "exchange_id": "x1",
        "session_id": "s1",
        "protocol": Protocol.CHAT,
        "path": "/v1/chat/completions",
        "model": "gpt-test",
        "stream": True,
        "wire_digest": "a" * 32,
        "comparable": True,
        "message_count": 3,
        "request_bytes": 1000,
        "outbound_bytes": 1000,
        "outbound_digest": None,
        "status": 200,
        "outcome": Outcome.OK,
        "fold_level": 0,
        "refolds": 0,
        "retries": 0,
        "input_tokens": 250,
        "output_tokens": 40,
        "cache_read_tokens": None,
        "cache_write_tokens": None,
        "cache_write_5m_tokens": None,
        "cache_write_1h_tokens": None,
        "response_bytes": 500,
        "started_at": 1_700_000_000.0,
        "ttfb_s": 0.2,
        "duration_s": 1.5,
        "error": None,
    }
    fields.update(overrides)
    return ExchangeRecord(**fields)

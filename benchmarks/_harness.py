"""Process management and memory sampling for the benchmarks.

Every server under test runs as its own process, started here with a clean
environment: the upstream emulator (``python -m proxy emulate``), this proxy
(``python -m proxy serve``) and the naive baseline (``python -m benchmarks.naive``).
The benchmark process itself only sends requests and samples memory, so its own
allocations never show up in a figure.

Memory is read from Linux's ``/proc`` through psutil: RSS every few
milliseconds by a :class:`RssSampler` thread, and ``VmHWM`` (the kernel's peak
RSS of the process, which cannot be reset) once at the end of a case; a fresh
process per case makes ``VmHWM`` the peak of that case.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import math
import os
import re
import resource
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import AsyncIterator, Callable, Coroutine, Mapping, Sequence
from pathlib import Path
from typing import Any, Final, TypeVar

import aiohttp
import click
import psutil  # type: ignore[import-untyped,unused-ignore]  # no stubs; types-psutil is not a dependency

from ._report import Reporter
from ._workload import BenchProtocol

__all__ = [
    "CONTEXT_SETTINGS",
    "HOST",
    "EmulatorControl",
    "RssSampler",
    "Service",
    "ServiceError",
    "StreamCall",
    "StreamOutcome",
    "admin_exchanges",
    "cpu_seconds",
    "free_port",
    "held_metrics",
    "median_rss",
    "open_client_and_emulator",
    "raise_nofile_limit",
    "read_rss_kinds",
    "read_vm_hwm",
    "reset_vm_hwm",
    "run_collect",
    "run_command",
    "start_emulator",
    "start_naive",
    "start_proxy",
    "wait_proxy_idle",
]

HOST: Final = "127.0.0.1"
#: Seconds a started server gets to answer its readiness probe.
_START_TIMEOUT: Final = 30.0
#: Seconds a server gets to exit after SIGTERM before it is killed.
_STOP_TIMEOUT: Final = 10.0
_ENV_PREFIX: Final = "CONTEXT_PROXY_"

_T = TypeVar("_T")
_A = TypeVar("_A")  # a benchmark's options object


class ServiceError(RuntimeError):
    """A benchmark server did not start, or died; the message names its log file."""


def raise_nofile_limit() -> tuple[int, int]:
    """Raise this process's open-file soft limit to the hard limit; children inherit it.

    500 held streams need about 1,500 descriptors across the client, the proxy and
    the emulator. Returns ``(soft, hard)`` after the change.
    """
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard == resource.RLIM_INFINITY or soft < hard:
        target = hard if hard != resource.RLIM_INFINITY else max(soft, 65536)
        with contextlib.suppress(ValueError, OSError):
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
    return resource.getrlimit(resource.RLIMIT_NOFILE)


def free_port() -> int:
    """An unused loopback TCP port (bound and released; the OS will not reuse it at once)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((HOST, 0))
        port: int = sock.getsockname()[1]
        return port


def read_vm_hwm(pid: int) -> int:
    """Peak resident set size of ``pid`` in bytes (``VmHWM`` of /proc/PID/status); 0 if unknown."""
    try:
        with open(f"/proc/{pid}/status", encoding="ascii") as fh:
            for line in fh:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def reset_vm_hwm(pid: int) -> bool:
    """Reset ``VmHWM`` of ``pid`` to its current RSS (``echo 5 > /proc/PID/clear_refs``,
    Linux 4.0+, needs the right to ptrace it); ``False`` when not possible."""
    try:
        with open(f"/proc/{pid}/clear_refs", "w", encoding="ascii") as fh:
            fh.write("5")
    except OSError:
        return False
    return True


def read_rss_kinds(pid: int) -> tuple[int, int]:
    """``(RssAnon, RssFile)`` of ``pid`` in bytes, from /proc/PID/status; ``(0, 0)`` if unknown.

    Anonymous pages are the process's own memory (heap, buffers); file-backed
    pages (a spooled body's mapping, the interpreter's code) are page cache the
    kernel can drop and read again (proc(5), "RssAnon", "RssFile").
    """
    anon = file = 0
    try:
        with open(f"/proc/{pid}/status", encoding="ascii") as fh:
            for line in fh:
                if line.startswith("RssAnon:"):
                    anon = int(line.split()[1]) * 1024
                elif line.startswith("RssFile:"):
                    file = int(line.split()[1]) * 1024
    except OSError:
        pass
    return anon, file


# Linux's CPU-time clock of another process: MAKE_PROCESS_CPUCLOCK(pid, CPUCLOCK_SCHED) in
# include/linux/posix-timers.h. It counts nanoseconds of every thread (dead ones too), where
# /proc/PID/stat counts 10 ms ticks: a 20-request round of the naive proxy can read 0 ticks.
_CPUCLOCK_SCHED: Final = 2


def _process_cpu_clock(pid: int) -> int:
    return ((~pid) << 3) | _CPUCLOCK_SCHED


def cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of process ``pid`` so far, in nanosecond resolution.

    Reads the process's CPU-time clock (``clock_gettime``, Linux: the scheduler's
    count that ``/proc/PID/stat`` rounds to ticks); where that clock is not
    available, ``/proc/PID/stat`` via psutil (10 ms ticks, so a short burst may read
    0 s: the tables then say ``n/a`` rather than a ratio). Raises ``psutil.NoSuchProcess``
    when ``pid`` is gone.
    """
    try:
        return time.clock_gettime(_process_cpu_clock(pid))
    except (OSError, AttributeError):
        times = psutil.Process(pid).cpu_times()
        return float(times.user + times.system)


class RssSampler:
    """Samples the RSS of one process every ``interval`` seconds in a daemon thread.

    ``times`` (seconds since :attr:`t0`, monotonic), ``rss``, ``anon`` and ``file``
    (bytes: RSS, its anonymous and its file-backed part, :func:`read_rss_kinds`)
    are parallel lists; :meth:`mark` records a named instant (a phase boundary)
    on the same clock. A thread rather than a task, so sampling goes on while
    the event loop of the benchmark is busy sending a large body.

    ``also``: more processes (an nginx master's workers) whose figures are added
    to ``pid``'s in every sample; :attr:`pids` lists them all, ``pid`` first.
    """

    __slots__ = (
        "_procs",
        "_stop",
        "_thread",
        "anon",
        "file",
        "interval",
        "marks",
        "pid",
        "pids",
        "rss",
        "t0",
        "times",
    )

    def __init__(self, pid: int, interval: float = 0.005, *, also: Sequence[int] = ()) -> None:
        self.pid = pid
        self.pids = (pid, *also)
        self.interval = interval
        self._procs = [psutil.Process(p) for p in self.pids]
        self.t0 = time.monotonic()
        self.times: list[float] = []
        self.rss: list[int] = []
        self.anon: list[int] = []
        self.file: list[int] = []
        self.marks: list[tuple[float, str]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"rss-{pid}", daemon=True)

    def start(self) -> RssSampler:
        """Start sampling; returns ``self``."""
        self._thread.start()
        return self

    def _run(self) -> None:
        procs, times, rss, anon, file = self._procs, self.times, self.rss, self.anon, self.file
        while not self._stop.is_set():
            try:
                value = sum(proc.memory_info().rss for proc in procs)
            except psutil.Error:
                return
            kinds = [read_rss_kinds(pid) for pid in self.pids]
            # Appended last-list-first: a reader zipping the lists never sees rss ahead.
            file.append(sum(kind[1] for kind in kinds))
            anon.append(sum(kind[0] for kind in kinds))
            times.append(time.monotonic() - self.t0)
            rss.append(value)
            self._stop.wait(self.interval)

    def stop(self) -> None:
        """Stop sampling and wait for the thread (at most one interval plus one read)."""
        self._stop.set()
        self._thread.join(timeout=5.0)

    def now(self) -> float:
        """Seconds since :attr:`t0`."""
        return time.monotonic() - self.t0

    def mark(self, label: str) -> float:
        """Record that phase ``label`` starts now; returns the time (seconds since t0)."""
        at = self.now()
        self.marks.append((at, label))
        return at

    def current(self) -> int:
        """RSS in bytes right now, of every process sampled (a direct read, not a sample)."""
        value: int = sum(proc.memory_info().rss for proc in self._procs)
        return value

    def peak(self, since: float = 0.0, until: float = float("inf")) -> int:
        """Largest sampled RSS (bytes) between ``since`` and ``until`` (seconds since t0)."""
        values = [r for t, r in zip(self.times, self.rss, strict=False) if since <= t <= until]
        return max(values) if values else 0

    def peak_of(self, values: list[int], since: float, until: float) -> int:
        """Largest of ``values`` (``anon`` or ``file``) sampled between ``since`` and ``until``."""
        picked = [v for t, v in zip(self.times, values, strict=False) if since <= t <= until]
        return max(picked) if picked else 0

    def median_of(self, values: list[int], since: float, until: float) -> int:
        """Median of ``values`` (``anon`` or ``file``) sampled between ``since`` and ``until``."""
        picked = sorted(v for t, v in zip(self.times, values, strict=False) if since <= t <= until)
        return picked[len(picked) // 2] if picked else 0

    def window(self, since: float, until: float) -> list[int]:
        """Sampled RSS values (bytes) between ``since`` and ``until``."""
        return [r for t, r in zip(self.times, self.rss, strict=False) if since <= t <= until]


async def median_rss(sampler: RssSampler, seconds: float = 0.1) -> int:
    """Median RSS in bytes over the next ``seconds`` (sampled; a direct read if too few)."""
    since = sampler.now()
    await asyncio.sleep(seconds)
    values = sampler.window(since, sampler.now())
    return int(statistics.median(values)) if values else sampler.current()


class Service:
    """One server process under test: its URL, pid and log file.

    Use as an async context manager, or call :meth:`stop` (SIGTERM, then SIGKILL
    after 10 s). Output goes to ``log_path``, never to the benchmark's terminal.
    """

    __slots__ = ("_log", "log_path", "name", "proc", "ready_path", "url")

    def __init__(
        self, name: str, proc: subprocess.Popen[bytes], url: str, log_path: Path, ready_path: str
    ) -> None:
        self.name = name
        self.proc = proc
        self.url = url
        self.log_path = log_path
        self.ready_path = ready_path
        self._log: Any = None

    @property
    def pid(self) -> int:
        """The process id."""
        return self.proc.pid

    async def wait_ready(
        self, session: aiohttp.ClientSession, within_s: float = _START_TIMEOUT
    ) -> None:
        """Poll ``ready_path`` until it answers 200, for up to ``within_s`` seconds (30).

        Raises:
            ServiceError: the process exited, or was not ready within ``within_s``.
        """
        deadline = time.monotonic() + within_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise ServiceError(
                    f"{self.name} exited with {self.proc.returncode} at start; see {self.log_path}"
                )
            with contextlib.suppress(aiohttp.ClientError, OSError):
                async with session.get(self.url + self.ready_path) as resp:
                    if resp.status == 200:
                        return
            await asyncio.sleep(0.02)
        raise ServiceError(f"{self.name} not ready within {within_s:g} s; see {self.log_path}")

    def check_alive(self) -> None:
        """Raise :class:`ServiceError` if the process has exited."""
        if self.proc.poll() is not None:
            raise ServiceError(
                f"{self.name} died (exit {self.proc.returncode}); see {self.log_path}"
            )

    async def stop(self) -> None:
        """SIGTERM, wait up to 10 s, then SIGKILL; idempotent."""
        proc = self.proc
        if proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                proc.send_signal(signal.SIGTERM)
            try:
                await asyncio.to_thread(proc.wait, _STOP_TIMEOUT)
            except subprocess.TimeoutExpired:
                proc.kill()
                await asyncio.to_thread(proc.wait, 5.0)

    async def __aenter__(self) -> Service:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.stop()


def _clean_env(extra: Mapping[str, str]) -> dict[str, str]:
    # The user's own CONTEXT_PROXY_* settings must not change what is measured.
    env = {k: v for k, v in os.environ.items() if not k.startswith(_ENV_PREFIX)}
    env.update(extra)
    env["PYTHONUNBUFFERED"] = "1"
    return env


def _spawn(
    name: str,
    argv: Sequence[str],
    port: int,
    log_dir: Path,
    ready_path: str,
    env: Mapping[str, str],
    wrapper: Sequence[str] = (),
) -> Service:
    log_dir.mkdir(parents=True, exist_ok=True)
    log_path = log_dir / f"{name}.log"
    log = log_path.open("ab")
    try:
        proc = subprocess.Popen(
            [*wrapper, sys.executable, *argv],
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
            env=_clean_env(env),
            # Its own process group: a Ctrl-C in the terminal reaches the benchmark,
            # which then stops the servers in order.
            start_new_session=True,
        )
    finally:
        log.close()
    return Service(name, proc, f"http://{HOST}:{port}", log_path, ready_path)


def start_emulator(log_dir: Path, args: Sequence[str] = ()) -> Service:
    """Start the upstream emulator on a free port (``context-proxy emulate [args]``)."""
    port = free_port()
    argv = ["-m", "proxy", "emulate", "--host", HOST, "--port", str(port), *args]
    return _spawn("emulator", argv, port, log_dir, "/", {})


def start_proxy(
    upstream: str,
    log_dir: Path,
    *,
    plugins: Sequence[str] = ("fold",),
    fake_completion_retries: int = 0,
    max_body_bytes: int = 100 * 1024 * 1024,
    env: Mapping[str, str] | None = None,
    module: str = "proxy",
    name: str = "proxy",
    event_loop: str = "asyncio",
    wrapper: Sequence[str] = (),
) -> Service:
    """Start this proxy (``python -m proxy serve``) in front of ``upstream``.

    ``plugins`` are entry-point names or ``module:Class`` paths (empty: none);
    settings not given here are the defaults, and the environment's
    ``CONTEXT_PROXY_*`` variables are ignored. ``env`` adds variables (e.g.
    ``MALLOC_*`` tunables). ``module`` replaces ``proxy`` in ``python -m proxy``
    (a wrapper that patches the proxy before running its CLI). ``event_loop``
    is the ``event_loop`` setting (``uvloop`` or ``asyncio``); give the naive
    baseline the same one for a fair comparison. ``wrapper`` is a command the
    interpreter runs under (e.g. ``valgrind --tool=callgrind``; the pid is then its).
    """
    port = free_port()
    argv = [
        "-m",
        module,
        "serve",
        "--host",
        HOST,
        "--port",
        str(port),
        "--upstream-openai",
        upstream,
        "--upstream-anthropic",
        upstream,
        "--max-body-bytes",
        str(max_body_bytes),
        "--shutdown-grace",
        "2",
        "--log-level",
        "WARNING",
    ]
    extra = {
        f"{_ENV_PREFIX}PLUGINS": ",".join(plugins),
        f"{_ENV_PREFIX}FAKE_COMPLETION_RETRIES": str(fake_completion_retries),
        f"{_ENV_PREFIX}EVENT_LOOP": event_loop,
        **(env or {}),
    }
    return _spawn(name, argv, port, log_dir, "/healthz", extra, wrapper)


def start_naive(
    upstream: str,
    log_dir: Path,
    *,
    env: Mapping[str, str] | None = None,
    name: str = "naive",
    event_loop: str = "asyncio",
    wrapper: Sequence[str] = (),
) -> Service:
    """Start the naive baseline proxy (``python -m benchmarks.naive``) in front of ``upstream``,
    on ``event_loop`` (``uvloop`` or ``asyncio``, as this proxy's run), under ``wrapper``
    as :func:`start_proxy`."""
    port = free_port()
    argv = ["-m", "benchmarks.naive", "--host", HOST, "--port", str(port), "--upstream", upstream]
    argv += ["--event-loop", event_loop]
    return _spawn(name, argv, port, log_dir, "/", dict(env or {}), wrapper)


# --------------------------------------------------------------------------- client side

_SEND_SLICE: Final = 256 * 1024
_TAIL_KEEP: Final = 4096


@dataclasses.dataclass(slots=True)
class StreamOutcome:
    """What the client saw of one streamed request. Times are on the caller's clock
    (seconds); NaN when the moment never came."""

    status: int = 0
    received: int = 0
    complete: bool = False
    upload_done: float = math.nan
    headers_at: float = math.nan
    first_byte_at: float = math.nan
    done_at: float = math.nan
    error: str | None = None


class StreamCall:
    """One streamed request running in its own task, observable while it runs.

    The body is sent as ``memoryview`` slices with a ``Content-Length`` (as SDKs
    send it); :attr:`first_byte` is set when the first response body byte
    arrives; the task reads the answer to the end and keeps only its last 4 KiB to
    check that the protocol's terminal event came (``outcome.complete``).
    """

    __slots__ = (
        "_body",
        "_clock",
        "_headers",
        "_protocol",
        "_session",
        "_url",
        "first_byte",
        "outcome",
        "task",
    )

    def __init__(
        self,
        session: aiohttp.ClientSession,
        base_url: str,
        protocol: BenchProtocol,
        body: bytes,
        *,
        script: str | None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._session = session
        self._url = base_url + protocol.path
        self._protocol = protocol
        self._body = body
        self._clock = clock
        headers = protocol.headers()
        headers["content-length"] = str(len(body))
        if script:
            headers["x-emulator"] = script
        self._headers = headers
        self.first_byte = asyncio.Event()
        self.outcome = StreamOutcome()
        self.task: asyncio.Task[StreamOutcome] = asyncio.ensure_future(self._run())

    async def _chunks(self) -> AsyncIterator[memoryview]:
        view = memoryview(self._body)
        try:
            for start in range(0, len(view), _SEND_SLICE):
                yield view[start : start + _SEND_SLICE]
        finally:
            view.release()
        self.outcome.upload_done = self._clock()

    async def _run(self) -> StreamOutcome:
        out = self.outcome
        tail = b""
        try:
            async with self._session.post(
                self._url, data=self._chunks(), headers=self._headers
            ) as resp:
                out.status = resp.status
                out.headers_at = self._clock()
                async for chunk in resp.content.iter_any():
                    if not out.received:
                        out.first_byte_at = self._clock()
                        self.first_byte.set()
                    out.received += len(chunk)
                    tail = (tail + chunk)[-_TAIL_KEEP:]
            out.done_at = self._clock()
            out.complete = resp.status == 200 and self._protocol.terminal in tail
            if not out.complete:
                out.error = f"status {resp.status}: {tail[-300:]!r}"
        except (aiohttp.ClientError, OSError) as exc:
            out.error = f"{type(exc).__name__}: {exc}"
        finally:
            self.first_byte.set()
        return out

    async def result(self, within: float) -> StreamOutcome:
        """Wait (at most ``within`` seconds) for the answer's end; raises ``TimeoutError``."""
        async with asyncio.timeout(within):
            return await asyncio.shield(self.task)

    async def cancel(self) -> None:
        """Abandon the request (closes its connection)."""
        self.task.cancel()
        with contextlib.suppress(asyncio.CancelledError, Exception):
            await self.task


class EmulatorControl:
    """The emulator's control routes, over HTTP (it runs in another process)."""

    __slots__ = ("_session", "url")

    def __init__(self, session: aiohttp.ClientSession, url: str) -> None:
        self._session = session
        self.url = url

    async def reset(self) -> None:
        """Forget records, counters and hold latches."""
        async with self._session.post(self.url + "/_emulator/reset") as resp:
            resp.raise_for_status()

    async def release(self, key: str) -> None:
        """Let every answer held on ``key`` finish."""
        async with self._session.post(f"{self.url}/_emulator/release/{key}") as resp:
            resp.raise_for_status()

    async def records(self) -> list[dict[str, Any]]:
        """The request records (see ``proxy._emulator.RequestRecord``)."""
        async with self._session.get(self.url + "/_emulator/stats") as resp:
            resp.raise_for_status()
            data = await resp.json()
        records: list[dict[str, Any]] = data["requests"]
        return records

    async def wait_holding(self, key: str, count: int = 1, *, within: float = 300.0) -> None:
        """Poll (every 10 ms) until ``count`` answers sit in their hold on ``key``.

        Raises:
            TimeoutError: not reached within ``within`` seconds.
        """
        async with asyncio.timeout(within):
            while True:
                records = await self.records()
                if sum(1 for r in records if r.get("holding") == key) >= count:
                    return
                await asyncio.sleep(0.01)

    async def body_bytes(self, key: str) -> int:
        """Body size (bytes) the emulator received for the request held on ``key`` (0 if none).

        The last such request: after a refold, the one that was answered and held.
        """
        for record in reversed(await self.records()):
            if f"hold={key}" in (record.get("script") or ""):
                size: int = record["body_bytes"]
                return size
        return 0


async def admin_exchanges(session: aiohttp.ClientSession, url: str) -> list[dict[str, Any]]:
    """``GET /admin/exchanges`` of this proxy: each in-flight exchange with its held bytes."""
    async with session.get(url + "/admin/exchanges") as resp:
        resp.raise_for_status()
        data = await resp.json()
    exchanges: list[dict[str, Any]] = data["exchanges"]
    return exchanges


_HELD_LINE: Final = re.compile(
    r"^context_proxy_held_bytes\{(?P<labels>[^}]*)\}\s+(?P<value>[0-9.eE+-]+)$", re.M
)
_LABEL: Final = re.compile(r'(\w+)="([^"]*)"')


async def held_metrics(session: aiohttp.ClientSession, url: str) -> dict[str, int]:
    """``context_proxy_held_bytes`` from ``GET /metrics``, as ``{"phase/kind": bytes}``.

    Only what is held: the proxy exports every (phase, kind) from the start, at 0.
    """
    async with session.get(url + "/metrics") as resp:
        resp.raise_for_status()
        text = await resp.text()
    held: dict[str, int] = {}
    for match in _HELD_LINE.finditer(text):
        labels = dict(_LABEL.findall(match["labels"]))
        key = f"{labels.get('phase', '?')}/{labels.get('kind', '?')}"
        value = int(float(match["value"]))
        if value:
            held[key] = value
    return held


async def wait_proxy_idle(
    session: aiohttp.ClientSession, url: str, *, within: float = 30.0
) -> None:
    """Poll ``/admin/exchanges`` (every 10 ms) until no exchange is in flight.

    Raises:
        TimeoutError: still busy after ``within`` seconds.
    """
    async with asyncio.timeout(within):
        while True:
            if not await admin_exchanges(session, url):
                return
            await asyncio.sleep(0.01)


# --------------------------------------------------------------------------- a whole run


@contextlib.asynccontextmanager
async def open_client_and_emulator(
    log_dir: Path, emulator_args: Sequence[str] = ()
) -> AsyncIterator[tuple[aiohttp.ClientSession, Service]]:
    """A client session and a ready emulator process (its log in ``log_dir``) for one run.

    ``emulator_args`` are options of ``context-proxy emulate`` (e.g. a context window).

    The session's connection pool is unbounded (500 held streams need 500
    connections) and only connecting is timed (10 s): a large request may take
    minutes, and each benchmark bounds its own requests. Leaving the block stops
    the emulator, then closes the session.

    Raises:
        ServiceError: the emulator did not start.
    """
    timeout = aiohttp.ClientTimeout(total=None, sock_connect=10)
    connector = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(timeout=timeout, connector=connector) as session:
        emulator = start_emulator(log_dir, emulator_args)
        async with emulator:
            await emulator.wait_ready(session)
            yield session, emulator


def run_collect(
    collect: Callable[[_A, Reporter, Path], Coroutine[Any, Any, _T]],
    args: _A,
    reporter: Reporter,
    log_dir: Path,
) -> _T | None:
    """Run ``collect(args, reporter, log_dir)`` in a new event loop; its result, or ``None``.

    ``log_dir`` (the servers' log files) is emptied first, so the logs left
    behind are this run's. ``None`` means a server failed or a wait timed out
    (``RuntimeError``, which includes :class:`ServiceError`, ``OSError`` or
    ``TimeoutError``); the reason has been printed through ``reporter`` and the
    benchmark's exit status is 1.
    """
    if log_dir.exists():
        shutil.rmtree(log_dir)
    try:
        return asyncio.run(collect(args, reporter, log_dir))
    except (RuntimeError, OSError, TimeoutError) as exc:
        reporter.note(f"[bold red]benchmark failed:[/bold red] {exc}")
        return None


#: click settings every ``bench`` command shares.
CONTEXT_SETTINGS: Final = {"help_option_names": ["-h", "--help"], "max_content_width": 100}


def run_command(command: click.Command, prog: str, argv: Sequence[str]) -> int:
    """Run a benchmark's click ``command`` on ``argv``; its exit status (2: bad options).

    ``argv`` reaches the command as ``ctx.obj`` (the results record the command line).
    """
    try:
        status = command.main(
            args=list(argv), prog_name=prog, standalone_mode=False, obj=list(argv)
        )
    except click.ClickException as exc:
        exc.show()
        return exc.exit_code
    except click.Abort:
        return 1
    return int(status or 0)

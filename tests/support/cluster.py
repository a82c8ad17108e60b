"""Real redis-server, real nginx and proxy node processes for the cluster tests.

Each is started on an ephemeral loopback port with its configuration in a
temporary directory, waited for with a bounded readiness loop, and stopped by
its PID. redis-server has no ``--port 0``: a free port is found by binding and
closing a socket, and the start is retried on another port if the server
loses the race for it. This module holds no tests.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any, Final

import pytest

from benchmarks._cluster import nginx_config
from benchmarks._nginx import nginx_argv
from tests.support.ports import free_port

__all__ = [
    "Cluster",
    "EmulatorProcess",
    "NginxServer",
    "ProxyNode",
    "RedisServer",
    "need_binary",
]

_REPO: Final = Path(__file__).resolve().parents[2]
_START_ATTEMPTS: Final = 5
_READY_WITHIN: Final = 20.0  # seconds; a node is a fresh Python process on a loaded machine
_STOP_WITHIN: Final = 15.0


def need_binary(name: str) -> str:
    """The path of ``name`` on PATH (or in /usr/sbin); skips the test when missing."""
    found = shutil.which(name) or shutil.which(name, path="/usr/sbin:/usr/local/sbin")
    if found is None:
        pytest.skip(f"{name} is not installed (.ci/run installs it)")
    return found


def _wait_port(port: int, proc: subprocess.Popen[bytes], within: float) -> bool:
    """Whether ``port`` accepts connections before ``within`` seconds or ``proc`` exits."""
    deadline = time.monotonic() + within
    while time.monotonic() < deadline:  # bounded
        if proc.poll() is not None:
            return False
        with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port), 0.2):
            return True
        time.sleep(0.02)
    return False


def _stop(proc: subprocess.Popen[bytes] | None, sig: int = signal.SIGTERM) -> None:
    if proc is None or proc.poll() is not None:
        return
    os.kill(proc.pid, sig)
    try:
        proc.wait(_STOP_WITHIN)
    except subprocess.TimeoutExpired:
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(_STOP_WITHIN)


def _start_retrying(
    launch: Callable[[int], subprocess.Popen[bytes]],
    ready: Callable[[subprocess.Popen[bytes]], bool],
    failure: str,
    *,
    pause: float = 0.0,
) -> None:
    """Start a server, retrying when it loses the race for its port.

    ``launch(attempt)`` picks the port (a fresh free one, or the one a restart
    keeps), spawns the process and returns it; ``ready(proc)`` waits (bounded) for
    it to serve. A process that is not ready is killed and, ``pause`` seconds
    later, the next of :data:`_START_ATTEMPTS` attempts starts. Raises
    ``RuntimeError(failure)`` when none got ready.
    """
    for attempt in range(_START_ATTEMPTS):
        proc = launch(attempt)
        if ready(proc):
            return
        _stop(proc, signal.SIGKILL)
        time.sleep(pause)
    raise RuntimeError(failure)


class RedisServer:
    """A redis-server process on 127.0.0.1 with nothing persisted."""

    def __init__(self, workdir: Path) -> None:
        self.binary = need_binary("redis-server")
        self.workdir = workdir
        self.port = 0
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self, *, same_port: bool = False) -> None:
        """Start (or restart, on the same port with ``same_port``)."""

        def launch(attempt: int) -> subprocess.Popen[bytes]:
            if not same_port:
                self.port = free_port()
            conf = self.workdir / f"redis-{self.port}.conf"
            conf.write_text(
                f'port {self.port}\nbind 127.0.0.1\nsave ""\nappendonly no\n'
                f"dir {self.workdir}\nlogfile {self.workdir / 'redis.log'}\n"
                "protected-mode yes\ndaemonize no\n"
            )
            self.proc = subprocess.Popen([self.binary, str(conf)])
            return self.proc

        _start_retrying(
            launch,
            lambda proc: self._ready(_READY_WITHIN),
            f"redis-server did not start; see {self.workdir / 'redis.log'}",
            pause=0.2 if same_port else 0.0,  # the old socket may linger for a moment
        )

    def _ready(self, within: float) -> bool:
        assert self.proc is not None
        deadline = time.monotonic() + within
        while time.monotonic() < deadline:  # bounded
            if self.proc.poll() is not None:
                return False
            with (
                contextlib.suppress(OSError),
                socket.create_connection(("127.0.0.1", self.port), 0.2) as sock,
            ):
                sock.sendall(b"PING\r\n")
                if sock.recv(16).startswith(b"+PONG"):
                    return True
            time.sleep(0.02)
        return False

    def stop(self) -> None:
        _stop(self.proc)

    def kill(self) -> None:
        """``kill -9``: no goodbye to the clients."""
        _stop(self.proc, signal.SIGKILL)

    def pause(self) -> None:
        """``SIGSTOP``: connections stay open, nothing answers (a partition, no RST)."""
        assert self.proc is not None
        os.kill(self.proc.pid, signal.SIGSTOP)

    def resume(self) -> None:
        """``SIGCONT`` (harmless when not paused or no longer running)."""
        if self.proc is not None and self.proc.poll() is None:
            os.kill(self.proc.pid, signal.SIGCONT)

    @contextlib.contextmanager
    def hung(self) -> Iterator[None]:
        """Paused for the block, resumed on the way out whatever happened."""
        self.pause()
        try:
            yield
        finally:
            self.resume()


class NginxServer:
    """An nginx process in front of ``nodes`` (ports), hashing the session id."""

    def __init__(self, workdir: Path, nodes: Sequence[int]) -> None:
        self.binary = need_binary("nginx")
        self.workdir = workdir
        self.nodes = list(nodes)
        self.port = 0
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> None:
        def launch(attempt: int) -> subprocess.Popen[bytes]:
            self.port = free_port()
            conf = self.workdir / "nginx.conf"
            conf.write_text(nginx_config(self.port, self.nodes))
            self.proc = subprocess.Popen(
                nginx_argv(self.binary, self.workdir, conf), stderr=subprocess.DEVNULL
            )
            return self.proc

        _start_retrying(
            launch,
            lambda proc: _wait_port(self.port, proc, _READY_WITHIN),
            f"nginx did not start; see {self.workdir / 'nginx-error.log'}",
        )

    def stop(self) -> None:
        _stop(self.proc, signal.SIGQUIT)


class ProxyNode:
    """One ``python -m proxy serve`` process in cluster mode."""

    def __init__(
        self,
        name: str,
        upstream: str,
        redis_url: str,
        workdir: Path,
        settings: Mapping[str, Any] | None = None,
    ) -> None:
        self.name = name
        self.upstream = upstream
        self.redis_url = redis_url
        self.workdir = workdir
        self.settings = dict(settings or {})
        self.port = 0
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def _env(self) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items() if not k.startswith("CONTEXT_PROXY_")}
        # The repository on the path, so a test plugin (tests.support.closed_log) imports.
        path = [str(_REPO), *filter(None, [env.get("PYTHONPATH")])]
        env.update(
            {
                "PYTHONPATH": os.pathsep.join(path),
                "CONTEXT_PROXY_UPSTREAM_OPENAI": self.upstream,
                "CONTEXT_PROXY_UPSTREAM_ANTHROPIC": self.upstream,
                "CONTEXT_PROXY_REDIS_URL": self.redis_url,
                "CONTEXT_PROXY_NODE_ID": self.name,
                "CONTEXT_PROXY_PLUGINS": "",
                "CONTEXT_PROXY_LOG_LEVEL": "WARNING",
            }
        )
        for key, value in self.settings.items():
            env["CONTEXT_PROXY_" + key.upper()] = str(value)
        return env

    def spawn(self, *, same_port: bool = False) -> None:
        """Start the process without waiting (see :meth:`wait_ready`)."""
        if not same_port or not self.port:
            self.port = free_port()
        log = (self.workdir / f"node-{self.name}.log").open("ab")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "proxy", "serve", "--port", str(self.port)],
            env=self._env(),
            stdout=log,
            stderr=log,
        )
        log.close()

    def wait_ready(self) -> bool:
        """Whether ``/readyz`` answered 200 within the readiness bound."""
        return self._ready(_READY_WITHIN)

    def start(self, *, same_port: bool = False) -> None:
        """Start the process and wait for ``/readyz`` (restart on the same port with
        ``same_port``); retried on another port if it lost the race for one."""

        def launch(attempt: int) -> subprocess.Popen[bytes]:
            self.spawn(same_port=same_port and attempt == 0)
            assert self.proc is not None
            return self.proc

        _start_retrying(
            launch,
            lambda proc: self.wait_ready(),
            f"node {self.name} did not start; see its log in {self.workdir}",
        )

    def _ready(self, within: float) -> bool:
        assert self.proc is not None
        deadline = time.monotonic() + within
        while time.monotonic() < deadline:  # bounded
            if self.proc.poll() is not None:
                return False
            try:
                with urllib.request.urlopen(f"{self.url}/readyz", timeout=1) as resp:
                    if resp.status == 200:
                        return True
            except (OSError, urllib.error.URLError):
                pass
            time.sleep(0.05)
        return False

    def log_text(self) -> str:
        path = self.workdir / f"node-{self.name}.log"
        return path.read_text(errors="replace") if path.exists() else ""

    def stop(self) -> int | None:
        """SIGTERM (a rolling restart) and wait; the exit status."""
        _stop(self.proc)
        return None if self.proc is None else self.proc.returncode

    def kill(self) -> None:
        """``kill -9``."""
        _stop(self.proc, signal.SIGKILL)


class EmulatorProcess:
    """``python -m proxy emulate`` in a process of its own (the nodes' upstream)."""

    def __init__(self, workdir: Path) -> None:
        self.workdir = workdir
        self.port = 0
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> None:
        def launch(attempt: int) -> subprocess.Popen[bytes]:
            self.port = free_port()
            log = (self.workdir / "emulator.log").open("ab")
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "proxy", "emulate", "--port", str(self.port)],
                stdout=log,
                stderr=log,
            )
            log.close()
            return self.proc

        _start_retrying(
            launch,
            lambda proc: _wait_port(self.port, proc, _READY_WITHIN),
            "the emulator did not start",
        )

    def stats(self) -> list[dict[str, Any]]:
        """``GET /_emulator/stats``: one record per request, oldest first."""
        with urllib.request.urlopen(f"{self.url}/_emulator/stats", timeout=5) as resp:
            data = json.load(resp)
        records: list[dict[str, Any]] = data["requests"] if isinstance(data, dict) else data
        return records

    def release(self, key: str) -> None:
        request = urllib.request.Request(f"{self.url}/_emulator/release/{key}", method="POST")
        with urllib.request.urlopen(request, timeout=5):
            pass

    def stop(self) -> None:
        _stop(self.proc)


class Cluster:
    """Redis, the emulator, ``n`` proxy nodes and nginx in front of them.

    ``settings`` are node settings (``CONTEXT_PROXY_*``) shared by every node.
    Stop with :meth:`stop` (every process by its PID, whatever state it is in).
    """

    def __init__(
        self, workdir: Path, n: int = 3, settings: Mapping[str, Any] | None = None
    ) -> None:
        self.workdir = workdir
        self.redis = RedisServer(workdir)
        self.emulator = EmulatorProcess(workdir)
        self.settings = dict(settings or {})
        self.nodes: list[ProxyNode] = []
        self.n = n
        self.nginx: NginxServer | None = None

    def start(self) -> None:
        try:
            self.redis.start()
            self.emulator.start()
            self.nodes = [
                ProxyNode(name, self.emulator.url, self.redis.url, self.workdir, self.settings)
                for name in "abcdefgh"[: self.n]
            ]
            for node in self.nodes:  # in parallel: each is a Python start-up
                node.spawn()
            for node in self.nodes:
                if not node.wait_ready():
                    _stop(node.proc, signal.SIGKILL)
                    node.start()
            self.nginx = NginxServer(self.workdir, [node.port for node in self.nodes])
            self.nginx.start()
        except BaseException:
            self.stop()
            raise

    def stop(self) -> None:
        servers: list[Any] = [self.nginx, *self.nodes, self.emulator, self.redis]
        for server in servers:
            if server is not None:
                with contextlib.suppress(Exception):
                    server.stop()

    def node_at(self, port: int) -> ProxyNode:
        return next(node for node in self.nodes if node.port == port)

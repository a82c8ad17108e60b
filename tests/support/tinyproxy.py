"""A real Debian ``tinyproxy`` on a loopback port, and a private CA, for the egress tests.

:class:`Tinyproxy` writes its configuration to a temporary folder (``Allow
127.0.0.1``, a ``ConnectPort`` per allowed tunnel port, optional ``BasicAuth``),
starts it in the foreground, waits until it accepts connections and stops it by
its PID. :meth:`Tinyproxy.requests` reads its log: one request line per request
it received (``CONNECT localhost:4443 HTTP/1.1``, ``POST http://...``), which is
how a test knows a request really went through it.

:func:`private_ca` is a ``trustme`` CA with a certificate for ``localhost`` and
``127.0.0.1``: the server context for the emulator and the CA's PEM file for
``upstream_ca_file``; the server records the SNI names it was sent.
"""

from __future__ import annotations

import contextlib
import dataclasses
import re
import signal
import socket
import ssl
import subprocess
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Final

import trustme

from tests.support.cluster import need_binary
from tests.support.ports import free_port

__all__ = ["PrivateCA", "Tinyproxy", "private_ca", "tinyproxy"]

_READY_WITHIN_S: Final = 10.0
_STOP_WITHIN_S: Final = 5.0
_REQUEST_LINE: Final = re.compile(r"Request \(file descriptor \d+\): (.+)$")


class Tinyproxy:
    """One tinyproxy process on ``127.0.0.1:port``; ``url`` is ``http://127.0.0.1:port``."""

    __slots__ = ("_proc", "basic_auth", "binary", "connect_ports", "log", "port", "url", "workdir")

    def __init__(
        self,
        workdir: Path,
        *,
        connect_ports: Sequence[int] = (),
        basic_auth: tuple[str, str] | None = None,
    ) -> None:
        self.binary = need_binary("tinyproxy")
        self.workdir = workdir
        self.connect_ports = tuple(connect_ports)
        self.basic_auth = basic_auth
        self.log = workdir / "tinyproxy.log"
        self.port = 0
        self.url = ""
        self._proc: subprocess.Popen[bytes] | None = None

    def _config(self) -> str:
        lines = [
            f"Port {self.port}",
            "Listen 127.0.0.1",
            "Timeout 30",
            f'LogFile "{self.log}"',
            "LogLevel Connect",
            "MaxClients 32",
            "Allow 127.0.0.1",
        ]
        # Without any ConnectPort line tinyproxy tunnels to every port: at least one.
        lines += [f"ConnectPort {port}" for port in self.connect_ports or (443,)]
        if self.basic_auth is not None:
            lines.append(f"BasicAuth {self.basic_auth[0]} {self.basic_auth[1]}")
        return "\n".join(lines) + "\n"

    def start(self) -> None:
        """Start it on a free port (a few tries: a free port may be taken meanwhile).

        Raises:
            AssertionError: it did not accept connections within 10 s on any try.
        """
        for _ in range(3):
            self.port = free_port()
            conf = self.workdir / "tinyproxy.conf"
            conf.write_text(self._config())
            self._proc = subprocess.Popen(
                [self.binary, "-d", "-c", str(conf)],
                stdin=subprocess.DEVNULL,
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
            )
            if self._wait_ready():
                self.url = f"http://127.0.0.1:{self.port}"
                return
            self.stop()
        raise AssertionError(f"tinyproxy did not start; see {self.log}")

    def _wait_ready(self) -> bool:
        deadline = time.monotonic() + _READY_WITHIN_S
        for _ in range(200):  # bounded by count and time
            assert self._proc is not None
            if self._proc.poll() is not None or time.monotonic() > deadline:
                return False
            with (
                contextlib.suppress(OSError),
                socket.create_connection(("127.0.0.1", self.port), timeout=0.5),
            ):
                return True
            time.sleep(0.05)
        return False

    def stop(self) -> None:
        """Stop it by its PID (SIGTERM, then SIGKILL after 5 s); idempotent."""
        proc, self._proc = self._proc, None
        if proc is None or proc.poll() is not None:
            return
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(_STOP_WITHIN_S)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(_STOP_WITHIN_S)

    def requests(self) -> list[str]:
        """The request lines tinyproxy logged so far, oldest first."""
        if not self.log.exists():
            return []
        found = []
        for line in self.log.read_text(errors="replace").splitlines():
            match = _REQUEST_LINE.search(line)
            if match:
                found.append(match[1])
        return found


@contextlib.contextmanager
def tinyproxy(
    workdir: Path,
    *,
    connect_ports: Sequence[int] = (),
    basic_auth: tuple[str, str] | None = None,
) -> Iterator[Tinyproxy]:
    """A started :class:`Tinyproxy` in ``workdir``, stopped on exit."""
    proxy = Tinyproxy(workdir, connect_ports=connect_ports, basic_auth=basic_auth)
    proxy.start()
    try:
        yield proxy
    finally:
        proxy.stop()


@dataclasses.dataclass(slots=True)
class PrivateCA:
    """A private CA: ``server`` (a server context whose certificate it signed, for
    ``localhost`` and ``127.0.0.1``), ``ca_file`` (its PEM) and ``sni``, the server
    names clients sent in their TLS hellos, in order (``None``: no SNI)."""

    server: ssl.SSLContext
    ca_file: Path
    sni: list[str | None]


def private_ca(workdir: Path) -> PrivateCA:
    """A fresh :class:`PrivateCA` whose PEM file is in ``workdir``."""
    ca = trustme.CA()
    server = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    ca.issue_cert("localhost", "127.0.0.1").configure_cert(server)
    ca_file = workdir / "private-ca.pem"
    ca.cert_pem.write_to_path(str(ca_file))
    found = PrivateCA(server, ca_file, [])

    def record(_sock: ssl.SSLObject, name: str | None, _context: ssl.SSLContext) -> None:
        found.sni.append(name)

    server.sni_callback = record
    return found

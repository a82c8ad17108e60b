"""Helpers for cluster-mode runs (``bench cluster`` and the cluster tests): processes
that are not the proxy, and the nginx configuration of docs/cluster.md.

The nginx block is read from the document itself, so the benchmark and the
integration tests run exactly the configuration users copy.
"""

from __future__ import annotations

import contextlib
import re
import socket
import subprocess
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Final

__all__ = ["DOCS", "nginx_config", "start_redis"]

DOCS: Final = Path(__file__).resolve().parent.parent / "docs" / "cluster.md"
_DOC_NODE_RE: Final = re.compile(r"^( *)server 127\.0\.0\.1:878\d (.*)\n", re.MULTILINE)
#: Directives for the files nginx writes; the document's must all be relative paths.
_PREFIX_FILES: Final = (
    "pid",
    "error_log",
    *(f"{kind}_temp_path" for kind in ("client_body", "proxy", "fastcgi", "uwsgi", "scgi")),
)


def nginx_config(listen: int, nodes: Sequence[int]) -> str:
    """The nginx configuration of docs/cluster.md with this run's ports, for ``nginx -p``.

    The ``nginx`` block is read from the document, so the tests run exactly the
    configuration users copy. Substituted: the node ``server`` lines (one per
    port in ``nodes``), the ``listen`` port, one worker, ``daemon off`` (the
    caller owns the process and stops it by its PID), and an ``X-Upstream-Node``
    header naming the node that answered. The document's pid, error log and
    temporary paths are relative, so they land in the ``-p`` prefix directory.

    Raises:
        AssertionError: the document no longer has the block or its landmarks
            (among them: every file nginx writes relative to the prefix).
    """
    text = DOCS.read_text()
    block = text.split("```nginx\n", 1)[1].split("```", 1)[0]
    for kind in _PREFIX_FILES:
        line = re.search(rf"^ *{kind} +(\S+?)[ ;]", block, re.MULTILINE)
        assert line is not None, f"docs/cluster.md: the nginx block sets no {kind}"
        assert not line.group(1).startswith("/"), f"docs/cluster.md: {kind} outside the prefix"
    match = _DOC_NODE_RE.search(block)
    assert match is not None, "docs/cluster.md: no 'server 127.0.0.1:878N' line"
    indent, options = match.group(1), match.group(2)
    servers = "".join(f"{indent}server 127.0.0.1:{port} {options}\n" for port in nodes)
    first = match.start()
    block = block[:first] + servers + _DOC_NODE_RE.sub("", block[first:])
    assert "listen 127.0.0.1:8080;" in block
    block = block.replace("listen 127.0.0.1:8080;", f"listen 127.0.0.1:{listen};")
    block = block.replace("worker_processes auto;", "worker_processes 1;")
    landmark = "proxy_pass http://context_proxy;"
    assert landmark in block
    block = block.replace(
        landmark, landmark + "\n            add_header X-Upstream-Node $upstream_addr always;"
    )
    return "daemon off;\n" + block


def start_redis(
    binary: str, port: int, workdir: Path, within: float = 20.0
) -> subprocess.Popen[bytes]:
    """Start ``redis-server`` on 127.0.0.1:``port`` with nothing persisted; wait for PING.

    Raises:
        RuntimeError: it exited or did not answer PING within ``within`` seconds.
    """
    workdir.mkdir(parents=True, exist_ok=True)
    proc = subprocess.Popen(
        [
            binary,
            "--port",
            str(port),
            "--bind",
            "127.0.0.1",
            "--save",
            "",
            "--appendonly",
            "no",
            "--dir",
            str(workdir),
            "--logfile",
            str(workdir / "redis.log"),
        ],
        stdin=subprocess.DEVNULL,
    )
    deadline = time.monotonic() + within
    while time.monotonic() < deadline:  # bounded
        if proc.poll() is not None:
            break
        with (
            contextlib.suppress(OSError),
            socket.create_connection(("127.0.0.1", port), 0.2) as sock,
        ):
            sock.sendall(b"PING\r\n")
            if sock.recv(16).startswith(b"+PONG"):
                return proc
        time.sleep(0.02)
    proc.kill()
    proc.wait(5)
    raise RuntimeError(f"redis-server did not start on port {port}; see {workdir / 'redis.log'}")

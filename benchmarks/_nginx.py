"""nginx as a process under test: found on PATH, started on a free loopback port, stopped
by its PID.

Two users: ``bench cluster`` (nginx in front of three nodes, configured as in
docs/cluster.md, :func:`benchmarks._cluster.nginx_config`) and ``bench memory``
(nginx as a plain reverse proxy in front of the emulator, spooling request bodies
to a temporary file, :func:`spooling_config`: the memory profile of a server
that keeps bodies out of its heap, beside this proxy and the naive one).

nginx runs in the foreground (``daemon off``) in its own process group, with a
prefix directory (``-p``) that holds its configuration, pid file, error log and
temporary files, so nothing is written outside the run's directory.
"""

from __future__ import annotations

import grp
import os
import pwd
import shutil
import subprocess
from pathlib import Path
from typing import Final

import psutil  # type: ignore[import-untyped,unused-ignore]  # no stubs; types-psutil is not a dependency

from ._harness import HOST, Service, free_port

__all__ = [
    "BODY_BUFFER_BYTES",
    "find_nginx",
    "nginx_argv",
    "nginx_pids",
    "spooling_config",
    "start_nginx",
]

#: ``client_body_buffer_size`` of the memory benchmark's nginx: nginx's own default on
#: 64-bit platforms (two memory pages); a body larger than this goes to
#: ``client_body_temp_path`` (nginx docs, ngx_http_core_module).
BODY_BUFFER_BYTES: Final = 16 * 1024
#: Where nginx is looked for besides PATH (Debian installs it in /usr/sbin).
_SBIN: Final = "/usr/sbin:/usr/local/sbin"


def find_nginx() -> str | None:
    """The path of the ``nginx`` binary on PATH or in /usr/sbin; ``None`` when missing."""
    return shutil.which("nginx") or shutil.which("nginx", path=_SBIN)


def nginx_argv(binary: str, prefix: Path, conf: Path) -> list[str]:
    """The command line of an nginx whose files live under ``prefix`` (``-p``), with its
    start-up errors in ``prefix/nginx-error.log`` (``-e``) and its configuration ``conf``.

    The paths are made absolute: nginx reads a relative ``-c`` or ``-e`` path from the
    prefix, not from the working directory.
    """
    prefix, conf = prefix.resolve(), conf.resolve()
    return [binary, "-p", str(prefix), "-e", str(prefix / "nginx-error.log"), "-c", str(conf)]


def _user_directive() -> str:
    # A master process run as root starts its workers as "nobody", which could not
    # write the temporary files into a run directory that only root may enter: run
    # them as this process's user instead. nginx ignores the directive otherwise.
    if os.geteuid() != 0:
        return ""
    user = pwd.getpwuid(os.geteuid()).pw_name
    group = grp.getgrgid(os.getegid()).gr_name
    return f"user {user} {group};\n"


def spooling_config(listen: int, upstream: str) -> str:
    """An nginx configuration: a reverse proxy on ``127.0.0.1:listen`` to ``upstream``
    (``http://host:port``) that spools request bodies, for ``nginx -p PREFIX``.

    One worker. Request bodies are read whole before the request goes upstream
    (``proxy_request_buffering on``), kept in a buffer of :data:`BODY_BUFFER_BYTES`
    and, above it, written to a file in ``PREFIX/client_body_temp``; no body
    size limit (``client_max_body_size 0``). Answers are streamed as they
    arrive (``proxy_buffering off``: SSE events are passed on at once). Every
    file nginx writes is relative to the prefix.
    """
    return f"""daemon off;
{_user_directive()}pid nginx.pid;
error_log nginx-error.log warn;
worker_processes 1;
events {{ worker_connections 1024; }}
http {{
    access_log off;
    client_body_temp_path client_body_temp;
    proxy_temp_path proxy_temp;
    fastcgi_temp_path fastcgi_temp;
    uwsgi_temp_path uwsgi_temp;
    scgi_temp_path scgi_temp;
    upstream emulator {{
        server {upstream.removeprefix("http://")};
        keepalive 16;
    }}
    server {{
        listen {HOST}:{listen};
        client_max_body_size 0;
        client_body_buffer_size {BODY_BUFFER_BYTES};
        location / {{
            proxy_pass http://emulator;
            proxy_http_version 1.1;
            proxy_set_header Connection "";
            proxy_request_buffering on;
            proxy_buffering off;
            proxy_read_timeout 1h;
            proxy_send_timeout 1h;
        }}
    }}
}}
"""


def start_nginx(binary: str, upstream: str, log_dir: Path, *, name: str = "nginx") -> Service:
    """Start nginx (:func:`spooling_config`) in front of ``upstream``; its prefix is
    ``log_dir/name``. Returns a :class:`~benchmarks._harness.Service` whose ``pid`` is the
    master's: :meth:`Service.stop` sends it SIGTERM (nginx's fast shutdown, workers
    included); readiness is ``GET /`` answered 200 through nginx by the emulator.

    Raises:
        OSError: the binary could not be run.
    """
    prefix = log_dir / name
    prefix.mkdir(parents=True, exist_ok=True)
    port = free_port()
    conf = prefix / "nginx.conf"
    conf.write_text(spooling_config(port, upstream), encoding="utf-8")
    log_path = prefix / "nginx-error.log"
    # What nginx says before its error log is open (a bad option) goes there too.
    with log_path.open("ab") as log:
        proc = subprocess.Popen(
            nginx_argv(binary, prefix, conf),
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=log,
            # Its own process group, as every server of a benchmark (see _harness._spawn).
            start_new_session=True,
        )
    return Service(name, proc, f"http://{HOST}:{port}", log_path, "/")


def nginx_pids(master: int) -> list[int]:
    """``master`` and its worker processes (its children), master first.

    Raises:
        psutil.NoSuchProcess: ``master`` is gone.
    """
    return [master, *(child.pid for child in psutil.Process(master).children())]

"""Small raw-socket upstreams of our own, for faults the emulator cannot produce; no tests here.

:class:`Scripted` runs a test's own coroutine for each connection (what to read,
what to write, when to close); :class:`RawUpstream` answers each request with
canned bytes and closes; :class:`HoldingUpstream` sends one chunk of an event
stream and keeps the connection open. All listen on an ephemeral port of
127.0.0.1 and read a request the same way (:func:`read_request`).
:func:`black_hole` is a loopback address that drops connects, as an address
routed nowhere does.

Canned answers: :func:`json_answer` (by default :data:`CHAT_JSON`, a chat
completion), :func:`chat_sse_events` (its streamed form), :data:`SSE_HEAD` and
the chunked coding (:func:`chunk`, :func:`chunked`).

:func:`proxy_app` is a plugin-less proxy in front of an upstream, yielding its
URL and app (:func:`pool_of` is the app's upstream pool); :func:`proxy_for`
yields the URL alone.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import socket
import ssl
import subprocess
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator, Sequence
from pathlib import Path
from typing import Any, Final

import pytest

from proxy._app import ProxyApp, build_app, running
from proxy._config import load_settings
from proxy._plugins import Plugin, PluginHost
from proxy._upstream import UpstreamPool

__all__ = [
    "CHAT_JSON",
    "SSE_HEAD",
    "HoldingUpstream",
    "RawUpstream",
    "Script",
    "Scripted",
    "black_hole",
    "chat_sse_events",
    "chunk",
    "chunked",
    "content_length",
    "dead_first",
    "json_answer",
    "pool_of",
    "proxy_app",
    "proxy_for",
    "read_request",
    "self_signed",
]

SSE_HEAD: Final = (
    b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\n"
)

CHAT_JSON: Final = json.dumps(
    {
        "id": "chatcmpl-1",
        "object": "chat.completion",
        "created": 0,
        "model": "m",
        "choices": [
            {
                "index": 0,
                "message": {"role": "assistant", "content": "hi"},
                "finish_reason": "stop",
            }
        ],
        "usage": {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2},
    }
).encode()
"""A complete non-streamed chat completion whose text is ``"hi"`` (UTF-8 JSON)."""

Script = Callable[[asyncio.StreamReader, asyncio.StreamWriter, int], Awaitable[None]]
"""What a :class:`Scripted` upstream does on connection ``n`` (counted from 0)."""


def chunk(piece: bytes) -> bytes:
    """``piece`` as one chunk of the chunked transfer coding (RFC 9112 section 7.1)."""
    return b"%x\r\n%s\r\n" % (len(piece), piece)


def chunked(*pieces: bytes) -> bytes:
    """``pieces`` in chunked transfer coding, ended by the last-chunk."""
    return b"".join(chunk(p) for p in pieces) + b"0\r\n\r\n"


def json_answer(body: bytes = CHAT_JSON, status: str = "200 OK", extra: bytes = b"") -> bytes:
    """A whole HTTP/1.1 answer: ``status`` (``"200 OK"``), a JSON ``body`` with its
    ``Content-Length``, and ``extra`` header lines (each ending in CRLF) before the
    blank line."""
    return b"HTTP/1.1 %s\r\nContent-Type: application/json\r\nContent-Length: %d\r\n%s\r\n%s" % (
        status.encode(),
        len(body),
        extra,
        body,
    )


def chat_sse_events(text: str = "hi") -> list[bytes]:
    """A streamed chat completion of ``text`` as three SSE events (bytes each): the
    delta, the ``finish_reason: "stop"`` chunk and ``data: [DONE]``."""
    first = {
        "id": "c1",
        "object": "chat.completion.chunk",
        "created": 0,
        "model": "m",
        "choices": [{"index": 0, "delta": {"role": "assistant", "content": text}}],
    }
    last = {
        "id": "c1",
        "object": "chat.completion.chunk",
        "created": 0,
        "model": "m",
        "choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}],
    }
    return [
        b"data: " + json.dumps(first).encode() + b"\n\n",
        b"data: " + json.dumps(last).encode() + b"\n\n",
        b"data: [DONE]\n\n",
    ]


@contextlib.asynccontextmanager
async def proxy_app(
    upstream_url: str,
    *,
    plugins: Sequence[Plugin] = (),
    environ: dict[str, str] | None = None,
    **overrides: Any,
) -> AsyncIterator[tuple[str, ProxyApp]]:
    """A proxy in front of ``upstream_url`` on an ephemeral port of 127.0.0.1, both
    protocols' upstreams; ``plugins`` are its plugins (none by default),
    ``overrides`` are settings, ``environ`` the environment its upstream client
    reads (``HTTPS_PROXY`` and the rest; empty by default, whatever this process
    has). Yields ``(base URL, app)``, the app for a look at its state
    (:func:`pool_of`); leaving the block drains it (commit hooks have run)."""
    settings = load_settings(
        None,
        environ={},
        overrides={
            "plugins": [],
            "shutdown_grace": 1.0,
            "upstream_openai": upstream_url,
            "upstream_anthropic": upstream_url,
            **overrides,
        },
    )
    host = PluginHost(list(plugins), timeout=settings.plugin_timeout) if plugins else None
    app = build_app(settings, host=host, environ=environ or {})
    async with running(app, "127.0.0.1", 0) as port:
        yield f"http://127.0.0.1:{port}", app


@contextlib.asynccontextmanager
async def proxy_for(upstream_url: str, **overrides: Any) -> AsyncIterator[str]:
    """:func:`proxy_app`, yielding its base URL alone."""
    async with proxy_app(upstream_url, **overrides) as (url, _app):
        yield url


def pool_of(app: ProxyApp) -> UpstreamPool:
    """The connection pool of a running proxy ``app``."""
    upstream = app.state.upstream
    assert upstream is not None
    return upstream.pool


@contextlib.contextmanager
def black_hole(port: int = 0) -> Iterator[int]:
    """A listener on 127.0.0.2 whose accept queue is full, so the kernel drops further
    SYNs: a connect to it neither succeeds nor fails, like one to an address routed
    nowhere. Yields its port (``port``, or an ephemeral one for 0); skips the test
    if 127.0.0.2 cannot be bound."""
    hole = socket.socket()
    filler = socket.socket()
    try:
        try:
            hole.bind(("127.0.0.2", port))
        except OSError:
            pytest.skip("127.0.0.2 is not usable here")
        hole.listen(0)
        bound: int = hole.getsockname()[1]
        filler.setblocking(False)
        filler.connect_ex(("127.0.0.2", bound))  # takes the one place in the accept queue
        yield bound
    finally:
        filler.close()
        hole.close()


def dead_first(
    loop: asyncio.AbstractEventLoop, host: str, port: int
) -> Callable[..., Awaitable[Any]]:
    """A stand-in for ``loop.getaddrinfo`` under which ``host`` resolves to 127.0.0.2
    first (make it a :func:`black_hole`), then to 127.0.0.1, both on ``port``; any
    other name resolves as before. An address routed nowhere ahead of a live one is
    what a host's AAAA record is on a network without IPv6 routes."""
    real = loop.getaddrinfo

    async def resolve(name: Any, *args: Any, **kwargs: Any) -> Any:
        if name == host:
            stream = socket.SOCK_STREAM
            return [
                (socket.AF_INET, stream, 6, "", ("127.0.0.2", port)),
                (socket.AF_INET, stream, 6, "", ("127.0.0.1", port)),
            ]
        return await real(name, *args, **kwargs)

    return resolve


def content_length(head: bytes) -> int:
    """The ``Content-Length`` of a request ``head`` (bytes; 0 without one)."""
    length = 0
    for line in head.split(b"\r\n")[1:]:
        name, _, value = line.partition(b":")
        if name.strip().lower() == b"content-length":
            length = int(value)
    return length


async def read_request(reader: asyncio.StreamReader) -> tuple[bytes, bytes]:
    """One HTTP/1.1 request with a ``Content-Length`` body: ``(head, body)``, the head
    with its blank line. Raises ``IncompleteReadError`` if the peer closes first."""
    head = await reader.readuntil(b"\r\n\r\n")
    return head, await reader.readexactly(content_length(head))


class Scripted:
    """A loopback upstream running ``script(reader, writer, n)`` for its connection n
    (from 0), then closing the connection; the peer hanging up, a cancel or a
    timeout ends a script quietly.

    ``tls`` (a server context) makes it an https upstream. Used as ``async with
    Scripted(script) as upstream``; ``url`` is its base URL, ``port`` its port,
    ``connections`` the number of connections accepted so far and ``closed`` the
    number of those whose script ended (the upstream closed them).
    """

    def __init__(self, script: Script, *, tls: ssl.SSLContext | None = None) -> None:
        self._script = script
        self._tls = tls
        self._server: asyncio.Server | None = None
        self.connections = 0
        self.closed = 0
        self.url = ""
        self.port = 0

    async def _run(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        n = self.connections
        self.connections += 1
        try:
            await self._script(reader, writer, n)
        except (asyncio.IncompleteReadError, ConnectionError, asyncio.CancelledError, TimeoutError):
            pass  # the client left, a bound ran out, or the test ended (the server closes)
        finally:
            self.closed += 1
            writer.close()

    async def __aenter__(self) -> Scripted:
        self._server = await asyncio.start_server(self._run, "127.0.0.1", 0, ssl=self._tls)
        self.port = self._server.sockets[0].getsockname()[1]
        scheme = "http" if self._tls is None else "https"
        self.url = f"{scheme}://127.0.0.1:{self.port}"
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        assert self._server is not None
        self._server.close()
        with contextlib.suppress(Exception):
            async with asyncio.timeout(3):  # bounded: a script may still hold a connection
                await self._server.wait_closed()


class RawUpstream:
    """A loopback HTTP/1.1 upstream answering each request with canned bytes, then closing.

    ``reply(target)`` returns the raw response bytes for a request target; the
    request head and body (bytes) are recorded in ``heads`` / ``bodies`` first.
    Used as ``async with RawUpstream(reply) as upstream``; ``url`` is its base URL.
    """

    def __init__(self, reply: Callable[[str], bytes]) -> None:
        self._reply = reply
        self._server: asyncio.Server | None = None
        self.heads: list[bytes] = []
        self.bodies: list[bytes] = []
        self.url = ""

    async def __aenter__(self) -> RawUpstream:
        self._server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        port = self._server.sockets[0].getsockname()[1]
        self.url = f"http://127.0.0.1:{port}"
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        assert self._server is not None
        self._server.close()
        await self._server.wait_closed()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            head, body = await read_request(reader)
            self.heads.append(head)
            self.bodies.append(body)
            writer.write(self._reply(head.split(b" ", 2)[1].decode("latin-1")))
            await writer.drain()
            await self._after_reply()
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            writer.close()

    async def _after_reply(self) -> None:
        """What the connection does once the reply is written: close at once."""


class HoldingUpstream(RawUpstream):
    """A loopback upstream that sends ``body`` as one chunk of an event stream, then
    keeps the connection open (no last-chunk, no close) until the test leaves, or at
    most ``hold_s`` seconds."""

    def __init__(self, body: bytes, *, hold_s: float) -> None:
        super().__init__(lambda target: SSE_HEAD + chunk(body))
        self._release = asyncio.Event()
        self._hold_s = hold_s

    async def __aenter__(self) -> HoldingUpstream:
        await super().__aenter__()
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        self._release.set()
        await super().__aexit__(*exc_info)

    async def _after_reply(self) -> None:
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(self._hold_s):  # bounded even if never released
                await self._release.wait()


def self_signed(tmp_path: Path) -> tuple[Path, Path]:
    """A one-day self-signed certificate for ``localhost`` and its key: ``(cert, key)``
    (made by ``openssl``, in ``tmp_path``)."""
    cert, key = tmp_path / "cert.pem", tmp_path / "key.pem"
    subprocess.run(
        [
            "openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1",
            "-subj", "/CN=localhost", "-addext", "subjectAltName=DNS:localhost",
            "-keyout", str(key), "-out", str(cert),
        ],
        check=True,
        capture_output=True,
        timeout=60,
    )  # fmt: skip
    return cert, key

"""Small raw-socket upstreams of our own, for faults the emulator cannot produce; no tests here.

:class:`RawUpstream` answers each request with canned bytes and closes;
:class:`HoldingUpstream` sends one chunk of an event stream and keeps the
connection open. Both read the request the same way (:func:`read_request`) and
listen on an ephemeral port of 127.0.0.1. :func:`proxy_for` is a plugin-less
proxy in front of one of them. Used by ``test_adversarial.py`` and
``test_stream_end.py``.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Callable
from typing import Any, Final

from proxy._app import build_app, running
from proxy._config import load_settings

__all__ = ["SSE_HEAD", "HoldingUpstream", "RawUpstream", "chunked", "proxy_for", "read_request"]

SSE_HEAD: Final = (
    b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\n"
)


def chunked(*pieces: bytes) -> bytes:
    """``pieces`` in chunked transfer coding, ended by the last-chunk."""
    return b"".join(b"%x\r\n%s\r\n" % (len(p), p) for p in pieces) + b"0\r\n\r\n"


@contextlib.asynccontextmanager
async def proxy_for(upstream_url: str, **overrides: Any) -> AsyncIterator[str]:
    """A proxy (no plugins) in front of ``upstream_url`` on 127.0.0.1; yields its base URL."""
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
    app = build_app(settings)
    async with running(app, "127.0.0.1", 0) as port:
        yield f"http://127.0.0.1:{port}"


async def read_request(reader: asyncio.StreamReader) -> tuple[bytes, bytes]:
    """One HTTP/1.1 request with a ``Content-Length`` body: ``(head, body)``, the head
    with its blank line. Raises ``IncompleteReadError`` if the peer closes first."""
    head = await reader.readuntil(b"\r\n\r\n")
    length = 0
    for line in head.split(b"\r\n")[1:]:
        name, _, value = line.partition(b":")
        if name.strip().lower() == b"content-length":
            length = int(value)
    return head, await reader.readexactly(length)


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
        super().__init__(lambda target: SSE_HEAD + b"%x\r\n%s\r\n" % (len(body), body))
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

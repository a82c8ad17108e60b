"""Loopback listeners on ports the kernel picks; no tests here.

:func:`free_port` is a port of 127.0.0.1 that nobody listens on (for a child
process that must be told its port, or an upstream that refuses connections);
:func:`serve_app` runs an aiohttp application of the test's own (an upstream,
a trace collector, an event stream) on an ephemeral port for one block.
"""

from __future__ import annotations

import contextlib
import socket
from collections.abc import AsyncIterator

from aiohttp import web

__all__ = ["free_port", "serve_app"]


def free_port() -> int:
    """A TCP port of 127.0.0.1 that was free a moment ago (bound, read, closed):
    a connect to it is refused until something binds it."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@contextlib.asynccontextmanager
async def serve_app(app: web.Application, *, access_log: bool = False) -> AsyncIterator[str]:
    """``app`` served on an ephemeral port of 127.0.0.1 while the block runs; yields
    its base URL, ``http://127.0.0.1:PORT``. Leaving the block closes the listener
    and the open connections (aiohttp's ``AppRunner.cleanup``). ``access_log``
    false: no aiohttp access line per request in the test's log."""
    runner = web.AppRunner(app) if access_log else web.AppRunner(app, access_log=None)
    await runner.setup()
    try:
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        yield f"http://127.0.0.1:{runner.addresses[0][1]}"
    finally:
        await runner.cleanup()

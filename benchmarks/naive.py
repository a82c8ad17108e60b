"""The naive baseline proxy: what a user would write in an afternoon.

It reads the whole request with ``await request.read()``, parses it with
``json.loads``, serializes it again with ``json.dumps`` (where a body-changing
feature would go), sends that upstream and streams the answer back chunk by
chunk as it arrives. Every one of those objects stays referenced by the
handler until it returns, i.e. until the last byte of a possibly minutes-long
answer has gone out. That is the memory profile the benchmarks compare against;
it is a fair baseline, not a strawman: it streams, it pools upstream
connections (without a cap, like this proxy), and it passes headers and status
through.

Run: ``python -m benchmarks.naive --port 8789 --upstream http://127.0.0.1:8788``.
"""

from __future__ import annotations

import json
import sys
from typing import Final

import aiohttp
import click
from aiohttp import web

from proxy._loops import EVENT_LOOPS, EventLoopName, loop_factory

__all__ = ["build_naive_app", "main"]

_HOP_BY_HOP: Final = frozenset(
    {
        "connection",
        "keep-alive",
        "proxy-authenticate",
        "proxy-authorization",
        "te",
        "trailer",
        "transfer-encoding",
        "upgrade",
        "host",
        "content-length",
        "content-encoding",
    }
)
_CLIENT: Final = web.AppKey("naive_client", aiohttp.ClientSession)


def build_naive_app(upstream: str, *, max_body_bytes: int = 1 << 30) -> web.Application:
    """The baseline as an aiohttp app forwarding ``/v1/*`` to ``upstream`` (a base URL).

    ``GET /`` answers ``ok`` (readiness). Request bodies up to ``max_body_bytes``
    bytes are accepted (aiohttp answers 413 above).
    """
    base = upstream.rstrip("/")

    async def forward(request: web.Request) -> web.StreamResponse:
        raw = await request.read()
        body = json.loads(raw) if raw else None
        data = json.dumps(body).encode() if body is not None else None
        headers = {k: v for k, v in request.headers.items() if k.lower() not in _HOP_BY_HOP}
        url = base + request.path_qs
        async with request.app[_CLIENT].request(
            request.method, url, data=data, headers=headers
        ) as upstream_resp:
            response = web.StreamResponse(
                status=upstream_resp.status,
                headers={
                    k: v for k, v in upstream_resp.headers.items() if k.lower() not in _HOP_BY_HOP
                },
            )
            await response.prepare(request)
            async for chunk in upstream_resp.content.iter_any():
                await response.write(chunk)
            await response.write_eof()
            return response

    async def root(request: web.Request) -> web.Response:
        return web.Response(text="ok\n")

    async def on_startup(app: web.Application) -> None:
        # No cap on upstream connections (aiohttp's default is 100), as in this proxy:
        # with 500 held streams a cap would queue requests, not measure them.
        app[_CLIENT] = aiohttp.ClientSession(
            timeout=aiohttp.ClientTimeout(total=None), connector=aiohttp.TCPConnector(limit=0)
        )

    async def on_cleanup(app: web.Application) -> None:
        await app[_CLIENT].close()

    app = web.Application(client_max_size=max_body_bytes)
    app.router.add_get("/", root)
    app.router.add_route("*", "/v1/{tail:.*}", forward)
    app.on_startup.append(on_startup)
    app.on_cleanup.append(on_cleanup)
    return app


@click.command(help=__doc__, context_settings={"help_option_names": ["-h", "--help"]})
@click.option("--host", default="127.0.0.1", show_default=True)
@click.option("--port", type=int, default=8789, show_default=True)
@click.option("--upstream", required=True, help="upstream base URL")
@click.option(
    "--event-loop",
    type=click.Choice(EVENT_LOOPS),
    default="asyncio",
    show_default=True,
    help="the same loop as the proxy it is compared with",
)
def command(host: str, port: int, upstream: str, event_loop: EventLoopName) -> None:
    """``python -m benchmarks.naive``: run the baseline until SIGINT/SIGTERM."""
    factory, _ = loop_factory(event_loop)
    web.run_app(
        build_naive_app(upstream),
        loop=factory(),
        host=host,
        port=port,
        access_log=None,
        print=None,
    )


def main(argv: list[str]) -> int:
    """Run the baseline until SIGINT/SIGTERM; returns the exit status (2: bad options)."""
    try:
        command.main(args=argv, prog_name="python -m benchmarks.naive", standalone_mode=False)
    except click.ClickException as exc:
        exc.show()
        return exc.exit_code
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

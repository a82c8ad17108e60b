"""``context-proxy top`` against an event stream cut before its first snapshot.

Something between top and the proxy (a reverse proxy's error page served as 200, a
buffering intermediary) may end the stream at once. top opened it again at once, for
ever: a busy loop against the proxy, and a terminal that never came back.
"""

from __future__ import annotations

import pytest
from aiohttp import web

from tests.support.ports import serve_app
from tests.support.process import Proc


async def test_top_gives_up_on_a_stream_that_ends_before_any_snapshot() -> None:
    opened: list[int] = []

    async def events(request: web.Request) -> web.Response:
        opened.append(1)
        return web.Response(body=b"", content_type="text/event-stream")

    app = web.Application()
    app.router.add_get("/admin/events", events)
    async with serve_app(app) as url:
        proc = await Proc.start("top", "top", "--url", url)
        try:
            code = await proc.wait_exit(10)
        finally:
            await proc.stop()
    assert code == 1, proc.output
    assert "ended before its first snapshot" in proc.output
    assert len(opened) == 1


@pytest.mark.parametrize("data", [b"not json", b"[1, 2]", b"\xff\xfe"])
async def test_top_names_a_stream_that_is_not_a_proxys_instead_of_a_traceback(
    data: bytes,
) -> None:
    async def events(request: web.Request) -> web.Response:
        return web.Response(
            body=b"event: snapshot\ndata: " + data + b"\n\n", content_type="text/event-stream"
        )

    app = web.Application()
    app.router.add_get("/admin/events", events)
    async with serve_app(app) as url:
        proc = await Proc.start("top", "top", "--once", "--url", url)
        try:
            code = await proc.wait_exit(10)
        finally:
            await proc.stop()
    assert code == 1, proc.output
    assert "not a JSON object" in proc.output and "Traceback" not in proc.output

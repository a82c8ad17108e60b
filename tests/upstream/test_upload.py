"""An upload the upstream stops reading (proxy/_upload.py), cut from outside, on real sockets.

The upstream takes the request head and never reads the body, so the proxy's
socket fills and the upload waits for it to drain. Something else then ends the
exchange: the wait for the answer's head runs out (``upstream_header_timeout``),
or the client hangs up. The body is released at that moment, spooled bodies
included: the upload that was cut keeps no view of it (such a view made the
spool's ``mmap.close`` fail, logged as a plugin keeping a view, counted in
``leaks``, the mapping living on until the exception was dropped).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from pathlib import Path

import pytest

from tests.support.e2e import wait_until
from tests.support.upstream import Scripted, proxy_app

BODY_BYTES = 16 * 1024 * 1024  # far more than the loopback socket buffers take


def _body() -> bytes:
    pad = b"x" * BODY_BYTES
    return b'{"model":"m","stream":true,"messages":[{"role":"user","content":"%s"}]}' % pad


def _post(body: bytes) -> bytes:
    return (
        b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        b"Content-Length: %d\r\n\r\n" % len(body)
    ) + body


@pytest.mark.parametrize("cut", ["head-timeout", "client-gone"])
async def test_an_upload_cut_mid_way_keeps_no_view_of_the_spooled_body(
    cut: str, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, logger="context_proxy")
    asked = asyncio.Event()

    async def never_reads(
        reader: asyncio.StreamReader, writer: asyncio.StreamWriter, n: int
    ) -> None:
        await reader.readuntil(b"\r\n\r\n")
        asked.set()
        await asyncio.sleep(10)  # the body is never read: the proxy's upload waits

    async with (
        Scripted(never_reads) as upstream,
        proxy_app(
            upstream.url,
            spool_above_bytes=64 * 1024,
            spool_dir=str(tmp_path),
            upstream_header_timeout=1.0 if cut == "head-timeout" else 60.0,
        ) as (url, app),
    ):
        port = int(url.rsplit(":", 1)[1])
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        try:
            writer.write(_post(_body()))
            await writer.drain()
            async with asyncio.timeout(10):
                await asked.wait()
            if cut == "client-gone":
                # The upload is under way (the upstream has the head): the client leaves.
                await asyncio.sleep(0.3)
                writer.transport.abort()
            else:
                async with asyncio.timeout(10):
                    line = await reader.readline()
                assert line.startswith(b"HTTP/1.1 504 "), line
            await wait_until(lambda: not app.state.exchanges, "the exchange ended")
            spool = app.state.spool
            assert spool.spooled == 1, "the body went to the spool"
            assert (spool.files, spool.in_flight, spool.leaks) == (0, 0, 0)
        finally:
            with contextlib.suppress(ConnectionError):
                writer.close()
    warned = [r.getMessage() for r in caplog.records if "outlived" in r.getMessage()]
    assert warned == [], json.dumps(warned)


async def test_an_upstream_that_answered_but_stopped_reading_is_not_said_to_have_sent_no_head() -> (
    None
):
    """The upstream sends its 200 head at once, then never reads the body: the upload is
    still bounded by ``upstream_header_timeout`` (a 504), but its words name what the
    upstream did not do (read the body), not headers it did send."""

    async def answers_then_stalls(
        reader: asyncio.StreamReader, writer: asyncio.StreamWriter, n: int
    ) -> None:
        await reader.readuntil(b"\r\n\r\n")
        writer.write(
            b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: 2\r\n\r\n{}"
        )
        await writer.drain()
        await asyncio.sleep(10)  # never reads the body

    async with (
        Scripted(answers_then_stalls) as upstream,
        proxy_app(upstream.url, upstream_header_timeout=1.0) as (url, _app),
    ):
        port = int(url.rsplit(":", 1)[1])
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        try:
            writer.write(_post(_body()))
            async with asyncio.timeout(10):
                head = await reader.readuntil(b"\r\n\r\n")
                length = int(head.lower().split(b"content-length: ")[1].split(b"\r\n")[0])
                error = json.loads(await reader.readexactly(length))["error"]
        finally:
            with contextlib.suppress(ConnectionError):
                writer.close()
    assert head.startswith(b"HTTP/1.1 504 ")
    assert "headers" not in error["message"], error["message"]
    assert "body" in error["message"], error["message"]

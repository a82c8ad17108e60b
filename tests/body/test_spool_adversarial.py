"""Adversarial checks of spooled request bodies (docs/design.md §2, "the spool").

Each test drives a proxy on 127.0.0.1 into an edge of a spooled body's life and
asserts what a user or operator would notice: a warning, a counter, a mapping
of a deleted file left in the process.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import resource
import tracemalloc
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from proxy.testing import proxy_with_emulator
from tests.support.e2e import wait_until
from tests.support.lifetime import RawConn, conversation, encode
from tests.support.upstream import Scripted, proxy_app

CHAT = "/v1/chat/completions"
ANSWER = (
    b'{"id":"x","object":"chat.completion","created":0,"model":"m","choices":[{"index":0,'
    b'"message":{"role":"assistant","content":"hi"},"finish_reason":"stop"}]}'
)


def deleted_mappings() -> list[str]:
    """Lines of ``/proc/self/maps`` that map a deleted (anonymous) file: the spool's."""
    with open("/proc/self/maps") as fh:
        return [line for line in fh if line.rstrip().endswith("(deleted)")]


async def _answers_first(
    reader: asyncio.StreamReader, writer: asyncio.StreamWriter, n: int
) -> None:
    """An upstream that answers 200 on the head, then reads the body slowly."""
    head = await reader.readuntil(b"\r\n\r\n")
    fields = dict(line.split(b":", 1) for line in head.split(b"\r\n")[1:] if b":" in line)
    length = int({k.lower(): v for k, v in fields.items()}[b"content-length"])
    writer.write(
        b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n"
        % len(ANSWER)
        + ANSWER
    )
    await writer.drain()
    await asyncio.sleep(0.5)  # the proxy's write queue is full meanwhile
    got = 0
    for _ in range(100_000):  # bounded
        if got >= length:
            break
        data = await reader.read(64 * 1024)
        if not data:
            break
        got += len(data)
    await asyncio.sleep(0.5)


def test_an_upstream_that_answers_before_reading_leaves_no_spool_mapping_on_uvloop(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """uvloop keeps what it cannot write now as the object it was given: a view of the
    spool's mapping handed to it outlived the release boundary (a warning blaming a
    plugin, ``leaks`` counted, the file's disk space outside ``max_spool_bytes``)."""
    uvloop = pytest.importorskip("uvloop")
    caplog.set_level(logging.WARNING, logger="context_proxy")
    body = encode(conversation(CHAT, turns=40, turn_bytes=100_000))  # ~4 MB

    async def scenario() -> tuple[int, int, int, list[str]]:
        async with (
            Scripted(_answers_first) as upstream,
            proxy_app(upstream.url, spool_above_bytes=16 * 1024, spool_dir=str(tmp_path)) as (
                url,
                app,
            ),
            aiohttp.ClientSession() as http,
        ):
            async with http.post(
                url + CHAT, data=body, headers={"Content-Type": "application/json"}
            ) as resp:
                status = resp.status
                await resp.read()
            for _ in range(100):  # bounded: 5 s
                if not app.state.exchanges:
                    break
                await asyncio.sleep(0.05)
            spool = app.state.spool
            # The exchange is over; the upstream is still reading the upload.
            return status, spool.leaks, spool.in_flight, deleted_mappings()

    with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
        status, leaks, in_flight, mappings = runner.run(scenario())
    assert status == 200
    assert (leaks, in_flight) == (0, 0)
    assert mappings == []
    assert not [r for r in caplog.records if "outlived the release boundary" in r.getMessage()]


def free_descriptor_numbers(count: int) -> list[int]:
    """The ``count`` lowest descriptor numbers this process has free, in order (the
    kernel hands out the lowest free one: open that many, note them, close them)."""
    taken = [os.open(os.devnull, os.O_RDONLY) for _ in range(count)]
    for fd in taken:
        os.close(fd)
    return taken


@pytest.mark.parametrize("where", ["open", "map"])
async def test_out_of_descriptors_a_large_body_gets_the_fd_answer_not_a_memory_or_dir_one(
    where: str, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """``EMFILE`` when the spool opens its file (``open``) or maps it (``map``: mmap
    holds a duplicate descriptor) is the process's descriptor limit, not a broken
    ``spool_dir`` nor memory: the client reads the proxy's "out of file descriptors"
    503 (``fd_reserve``), counted as such, and no warning sends the operator to the
    directory or to an address-space limit."""
    caplog.set_level(logging.WARNING, logger="context_proxy")
    body = encode(conversation(CHAT))
    async with proxy_with_emulator(spool_above_bytes=16 * 1024, spool_dir=str(tmp_path)) as h:
        conn = await RawConn.open(h.url)
        await conn.send_head(CHAT, len(body), {})
        await wait_until(lambda: bool(h.state.exchanges), "the exchange is reading")
        soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        first, second = free_descriptor_numbers(2)
        # Descriptor numbers must be under the soft limit: from here the spool's file
        # gets none ("open"), or it gets one and its mapping's duplicate none ("map").
        resource.setrlimit(resource.RLIMIT_NOFILE, (first if where == "open" else second, hard))
        try:
            with contextlib.suppress(ConnectionError):
                await conn.send(body)  # the proxy may answer and close first
            status = await conn.status()
            await wait_until(lambda: not h.state.exchanges, "the exchange ended")
        finally:
            resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
        answer = await conn.reader.read(64 * 1024)
        conn.abort()
        spool = h.state.spool
        assert (spool.spooled, spool.files, spool.in_flight) == (int(where == "map"), 0, 0)
        fd_exhausted = h.state.metrics.fd_exhausted.value()
    assert status == 503
    assert b'"fd_reserve"' in answer
    assert fd_exhausted == 1
    warnings = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert not [m for m in warnings if "cannot be used" in m or "memory could not" in m]


async def _expect_continue(port: int, length: int) -> tuple[asyncio.StreamReader, Any, bytes]:
    """A connection that sent a head with ``Expect: 100-continue``: its first answer line."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(
        b"POST %s HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
        b"Expect: 100-continue\r\nContent-Length: %d\r\n\r\n" % (CHAT.encode(), length)
    )
    await writer.drain()
    async with asyncio.timeout(5):
        line = await reader.readline()
    return reader, writer, line


@pytest.mark.xfail(
    strict=True,
    reason="max_spool_bytes charges bytes received, not declared (as max_reading_bytes, so"
    " that clients declaring large bodies and sending nothing cannot spend it): bodies"
    " admitted at once all get 100 Continue and the late ones are cut mid-upload with 503."
    " Reserving declarations would trade this for a slowloris; a policy decision.",
)
async def test_uploads_admitted_together_never_promise_more_than_max_spool_bytes(
    tmp_path: Path,
) -> None:
    """Ten 2 MB bodies at once against a 6 MB budget: those that do not fit next to the
    ones admitted before them get their 503 instead of 100 Continue, before the upload,
    and every body told to go on is read whole and answered (none cut mid-upload)."""
    body = encode(conversation(CHAT, turns=40, turn_bytes=50_000))  # ~2 MB
    budget = 3 * len(body) + 1000
    async with proxy_with_emulator(
        spool_above_bytes=16 * 1024, spool_dir=str(tmp_path), max_spool_bytes=budget
    ) as h:
        port = int(h.url.rsplit(":", 1)[1])
        conns = [await _expect_continue(port, len(body)) for _ in range(10)]
        firsts = [line.split(b" ", 2)[1] for _, _, line in conns]
        assert firsts.count(b"100") == 3 and firsts.count(b"503") == 7, firsts
        spool = h.state.spool

        async def upload(reader: asyncio.StreamReader, writer: Any) -> bytes:
            for start in range(0, len(body), 64 * 1024):
                writer.write(body[start : start + 64 * 1024])
                await writer.drain()
            async with asyncio.timeout(10):
                for _ in range(10):  # bounded: a few answer lines
                    line = await reader.readline()
                    if line.startswith(b"HTTP/1.1 ") and not line.startswith(b"HTTP/1.1 1"):
                        return line.split(b" ", 2)[1]
            return b"none"

        go = [(r, w) for (r, w, _), first in zip(conns, firsts, strict=True) if first == b"100"]
        finals = await asyncio.gather(*[upload(r, w) for r, w in go])
        for _, writer, _ in conns:
            writer.transport.abort()
        await wait_until(lambda: not h.state.exchanges, "every exchange ended")
        left = (spool.files, spool.in_flight)
    assert finals == [b"200"] * 3
    assert left == (0, 0)


def test_a_heap_body_is_not_kept_by_uvloops_write_queue_past_the_exchange() -> None:
    """The heap path of the same upstream (spool off): a slice of the body that uvloop
    queued is a view that keeps the whole body buffer alive, so the body stayed in
    memory after its exchange ended, until the upstream had read it all."""
    uvloop = pytest.importorskip("uvloop")
    body = encode(conversation(CHAT, turns=40, turn_bytes=100_000))  # ~4 MB

    async def scenario() -> tuple[int, int, int]:
        async with (
            Scripted(_answers_first) as upstream,
            proxy_app(upstream.url, spool_above_bytes=0) as (url, app),
            aiohttp.ClientSession() as http,
        ):
            tracemalloc.start()
            try:
                baseline = tracemalloc.get_traced_memory()[0]
                async with http.post(
                    url + CHAT, data=body, headers={"Content-Type": "application/json"}
                ) as resp:
                    status = resp.status
                    await resp.read()
                for _ in range(100):  # bounded: 5 s
                    if not app.state.exchanges:
                        break
                    await asyncio.sleep(0.05)
                # The exchange is over; the upstream is still reading the upload.
                held = tracemalloc.get_traced_memory()[0] - baseline
            finally:
                tracemalloc.stop()
            return status, held, len(app.state.exchanges)

    with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
        status, held, exchanges = runner.run(scenario())
    assert (status, exchanges) == (200, 0)
    # A few slices in the write queue, as asyncio's own copies: not the body.
    assert held < len(body) // 4, f"{held / len(body):.2f} x the body still allocated"

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
from pathlib import Path

import aiohttp
import pytest

from proxy.testing import proxy_with_emulator
from tests.test_e2e_support import wait_until
from tests.test_lifetime_support import RawConn, conversation, encode
from tests.upstream_support import Scripted, proxy_app

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

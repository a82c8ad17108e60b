"""A body whose memory cannot be had is a 503 to retry, never a 500 (issue 20, item 5).

A real proxy process under an address-space limit (``RLIMIT_AS``, what
``ulimit -v`` sets): an upload declaring more than the limit fails its
reservation at the first body byte; a gzip body inflating past it fails a
growth of the buffer. Both are answered 503 with ``Retry-After`` in the
client's protocol shape, counted in ``context_proxy_memory_refused_total``,
logged once per 10 s without the body, and leave nothing behind: the proxy's
resident memory is back and the next request is served.
"""

from __future__ import annotations

import asyncio
import json
import re
import resource
import signal
import zlib
from typing import Any

import pytest

from proxy import ExchangeRecord, Plugin
from proxy import _app as app_module
from proxy._emulator import EmulatorServer
from proxy.testing import proxy_with_emulator
from tests.support.e2e import ANTHROPIC_PATH, CHAT_PATH, RawClient, stream_body
from tests.support.process import Proc

BOUND_S = 20.0
MiB = 1024 * 1024
#: The proxy's address space: well above its own (~60 MB), below what the bodies need.
ADDRESS_SPACE = 384 * MiB
#: Declared by the identity uploads: more than the whole address space.
DECLARED = 600 * MiB
#: Decoded size of the gzip body (its buffer grows until a growth fails).
INFLATED = 512 * MiB
#: A marker in every refused body: it must never reach the log.
MARKER = b"body-marker-7f3a"


def _limit_address_space() -> None:
    resource.setrlimit(resource.RLIMIT_AS, (ADDRESS_SPACE, ADDRESS_SPACE))


def _gzip_zeros(nbytes: int) -> bytes:
    """``nbytes`` of JSON-ish text then zeros, gzip-compressed (a few MB for hundreds)."""
    packer = zlib.compressobj(1, zlib.DEFLATED, 31)
    parts = [packer.compress(b'{"model":"m","messages":[],"x":"' + MARKER)]
    zeros = bytes(MiB)
    parts.extend(packer.compress(zeros) for _ in range(nbytes // MiB))
    parts.append(packer.flush())
    return b"".join(parts)


async def _exchange(port: int, head: bytes, body: bytes) -> tuple[int, dict[str, str], bytes]:
    """Send ``head`` + ``body`` on a fresh connection; the answer's status, fields, body."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        writer.write(head + body)
        await writer.drain()
        async with asyncio.timeout(BOUND_S):
            raw_head = await reader.readuntil(b"\r\n\r\n")
            lines = raw_head.decode("latin-1").split("\r\n")
            status = int(lines[0].split()[1])
            fields = {}
            for line in lines[1:]:
                if line:
                    name, _, value = line.partition(":")
                    fields[name.strip().lower()] = value.strip()
            content = await reader.readexactly(int(fields.get("content-length", "0")))
        return status, fields, content
    finally:
        writer.close()


def _head(path: str, length: int, *extra: bytes) -> bytes:
    fields = b"".join(line + b"\r\n" for line in extra)
    return (
        b"POST %s HTTP/1.1\r\nHost: proxy\r\nContent-Type: application/json\r\n"
        b"anthropic-version: 2023-06-01\r\n%sContent-Length: %d\r\n\r\n"
        % (path.encode(), fields, length)
    )


def _rss_bytes(pid: int) -> int:
    with open(f"/proc/{pid}/status") as fh:
        for line in fh:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS")


@pytest.mark.timeout(120)
async def test_a_body_whose_memory_cannot_be_reserved_is_a_503_with_retry_after(
    emulator: EmulatorServer,
) -> None:
    proc, port = await Proc.serve(
        emulator.url,
        # The heap path: a spooled body would never ask for the memory (issue 21).
        env={
            "CONTEXT_PROXY_MAX_BODY_BYTES": str(1024 * MiB),
            "CONTEXT_PROXY_SPOOL_ABOVE_BYTES": "0",
        },
        preexec_fn=_limit_address_space,
    )
    try:
        pid = proc.proc.pid
        # The first bytes of the body: the reservation happens when they arrive.
        start = b'{"model":"m","messages":[],"x":"' + MARKER + b" " * 4096
        refused = 0
        for path in ("/v1/chat/completions", "/v1/messages", "/v1/chat/completions"):
            status, fields, content = await _exchange(port, _head(path, DECLARED), start)
            assert status == 503, (status, content)
            assert fields["retry-after"] == "5"
            assert fields["connection"] == "close"
            error = json.loads(content)
            if path == "/v1/messages":
                assert error["type"] == "error"
                assert "memory" in error["error"]["message"]
            else:
                assert error["error"]["type"] == "server_error"
                assert error["error"]["code"] == "memory"
            refused += 1
        # A coded body: the buffer grows with the decoded bytes until a growth fails.
        packed = _gzip_zeros(INFLATED)
        status, fields, content = await _exchange(
            port,
            _head("/v1/chat/completions", len(packed), b"Content-Encoding: gzip"),
            packed,
        )
        assert status == 503, (status, content)
        assert fields["retry-after"] == "5"
        assert json.loads(content)["error"]["code"] == "memory"
        refused += 1
        # Nothing is left: the partial buffer (hundreds of MB resident) is gone and an
        # ordinary request is served.
        assert _rss_bytes(pid) < 150 * MiB
        body = json.dumps(
            {"model": "m", "stream": False, "messages": [{"role": "user", "content": "hi"}]}
        ).encode()
        status, _, content = await _exchange(port, _head("/v1/chat/completions", len(body)), body)
        assert status == 200, content
        status, _, metrics = await _exchange(
            port, b"GET /metrics HTTP/1.1\r\nHost: proxy\r\nConnection: close\r\n\r\n", b""
        )
        counted = re.search(rb"^context_proxy_memory_refused_total (\S+)$", metrics, re.M)
        assert counted and float(counted[1]) == refused
        assert b"context_proxy_internal_errors_total{" not in metrics or not re.search(
            rb"^context_proxy_internal_errors_total\{[^}]*\} [1-9]", metrics, re.M
        )
        proc.proc.send_signal(signal.SIGTERM)
        assert await proc.wait_exit(BOUND_S) == 0
    finally:
        await proc.stop()
    # One line for the four refusals (the rest would be counted in the next one).
    said = [line for line in proc.lines if "memory could not be reserved" in line]
    assert len(said) == 1, said
    assert "internal error" not in proc.output
    assert "Traceback" not in proc.output
    assert MARKER.decode() not in proc.output


class _Recorder(Plugin):
    """Keeps every committed record."""

    name = "recorder"

    def __init__(self) -> None:
        self.records: list[ExchangeRecord] = []

    async def commit(self, record: ExchangeRecord) -> None:
        self.records.append(record)


def _no_memory(*args: Any, **kwargs: Any) -> Any:
    raise MemoryError


@pytest.mark.parametrize("path", [CHAT_PATH, ANTHROPIC_PATH])
async def test_a_memory_error_after_the_body_read_is_a_503_not_a_500(
    path: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """In-process: a ``MemoryError`` past the body read (here resolving the session) is
    the same 503 with ``Retry-After``, counted, and booked once, not an internal error."""
    recorder = _Recorder()
    async with proxy_with_emulator(plugins=[recorder]) as h:
        monkeypatch.setattr(app_module, "resolve_session_id", _no_memory)
        client = await RawClient.connect(h.url)
        try:
            await client.request("POST", path, stream_body(path, stream=True))
            head = await client.read_head()
            body = await client.read_body(head)
        finally:
            await client.close()
        await h.settle()
        metrics = h.state.metrics.render().decode()
    assert head.status == 503
    assert head.headers["Retry-After"] == "5"
    answer = json.loads(body)
    if path == ANTHROPIC_PATH:
        assert answer["type"] == "error" and "memory" in answer["error"]["message"]
    else:
        assert answer["error"]["code"] == "memory"
    (record,) = recorder.records
    assert (record.status, record.error) == (503, "memory")
    assert re.search(r"^context_proxy_memory_refused_total 1\.0$", metrics, re.M)
    assert not re.search(r"^context_proxy_internal_errors_total\{.*\} [1-9]", metrics, re.M)

"""``bench overhead --slow-streams``: the slow-stream client and its gap figures.

A small SSE server in this process stands in for the emulator, so these tests
check the client's parsing and counting (chunked framing, events split across
chunks and reads, failures by reason), not anyone's speed.
"""

from __future__ import annotations

import asyncio
import gc
import time
from collections.abc import AsyncIterator, Awaitable, Callable

import pytest

from benchmarks._slow import gap_histogram, percentile, run_slow_streams
from benchmarks._workload import BenchProtocol

_Handler = Callable[[asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]]
_CHAT = BenchProtocol.CHAT


async def _read_request(reader: asyncio.StreamReader) -> str:
    head = (await reader.readuntil(b"\r\n\r\n")).decode("latin-1")
    length = next(
        int(line.split(":", 1)[1])
        for line in head.split("\r\n")
        if line.lower().startswith("content-length:")
    )
    await reader.readexactly(length)
    return head


def _chunk(data: bytes) -> bytes:
    return b"%x\r\n%s\r\n" % (len(data), data)


def _events(deltas: int) -> list[bytes]:
    """A chat answer as the emulator sends it: role chunk, deltas, finish chunk, [DONE]."""
    role = b'data: {"choices":[{"delta":{"role":"assistant"}}]}\n\n'
    pieces = [b'data: {"choices":[{"delta":{"content":"w%d"}}]}\n\n' % i for i in range(deltas)]
    finish = b'data: {"choices":[{"delta":{},"finish_reason":"stop"}]}\n\n'
    return [role, *pieces, finish, b"data: [DONE]\n\n"]


@pytest.fixture
async def serve() -> AsyncIterator[Callable[[_Handler], Awaitable[str]]]:
    servers: list[asyncio.Server] = []

    async def start(handler: _Handler) -> str:
        server = await asyncio.start_server(handler, "127.0.0.1", 0)
        servers.append(server)
        port = server.sockets[0].getsockname()[1]
        return f"http://127.0.0.1:{port}"

    yield start
    for server in servers:
        server.close()
        await server.wait_closed()


def _sse_handler(deltas: int, gap: float, *, split: bool) -> _Handler:
    """Answers each request with ``deltas`` deltas ``gap`` s apart; ``split``: every event
    straddles two chunks, its blank line cut in half, each half written on its own."""

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        head = await _read_request(reader)
        assert f"x-emulator: chunks={deltas}; delay={gap:g}" in head
        writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\n")
        writer.write(b"Transfer-Encoding: chunked\r\n\r\n")
        events = _events(deltas)
        for index, event in enumerate(events):
            if 1 < index <= deltas:
                await asyncio.sleep(gap)
            if split:
                writer.write(_chunk(event[:-1]))
                await writer.drain()
                await asyncio.sleep(0.001)  # a separate read for the event's last "\n"
                writer.write(_chunk(event[-1:]))
            else:
                writer.write(_chunk(event))
            await writer.drain()
        writer.write(b"0\r\n\r\n")
        await writer.drain()
        writer.close()

    return handle


@pytest.mark.parametrize("split", [False, True], ids=["event-per-chunk", "split-events"])
async def test_every_stream_completes_and_each_gap_between_deltas_counts_once(
    serve: Callable[[_Handler], Awaitable[str]], split: bool
) -> None:
    url = await serve(_sse_handler(deltas=4, gap=0.05, split=split))
    figures = await run_slow_streams(
        "direct", url, _CHAT, b'{"stream":true}', streams=6, deltas=4, gap=0.05, ramp=0.0
    )
    assert figures.errors == {}
    assert figures.complete == 6
    # 3 gaps a stream (4 deltas): the events before the first and after the last
    # delta (role, finish, [DONE]) are not gaps. With no ramp every gap is in the window.
    assert len(figures.gaps) == 6 * 3
    assert figures.gaps == sorted(figures.gaps)
    summary = figures.summary()
    assert summary["gaps"] == 18 and summary["complete"] == 6
    assert sum(summary["added_histogram_ms"].values()) == 18  # type: ignore[attr-defined]


async def test_failed_streams_are_counted_by_reason(
    serve: Callable[[_Handler], Awaitable[str]],
) -> None:
    async def refuse(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await _read_request(reader)
        writer.write(b"HTTP/1.1 503 Service Unavailable\r\nContent-Length: 0\r\n\r\n")
        await writer.drain()
        writer.close()

    async def cut(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await _read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n")
        writer.write(b"".join(_chunk(event) for event in _events(3)[:3]))
        await writer.drain()
        writer.close()  # two deltas of three, no terminal chunk

    refused = await run_slow_streams(
        "ours", await serve(refuse), _CHAT, b"{}", streams=3, deltas=3, gap=0.05, ramp=0.0
    )
    assert refused.complete == 0 and refused.errors == {"bad answer: status 503": 3}
    assert refused.gaps == []
    cut_short = await run_slow_streams(
        "ours", await serve(cut), _CHAT, b"{}", streams=2, deltas=3, gap=0.05, ramp=0.0
    )
    assert cut_short.complete == 0 and cut_short.errors == {"closed before the end": 2}


def test_percentile_is_nearest_rank_and_histogram_buckets_by_upper_edge() -> None:
    values = [float(v) for v in range(1, 101)]
    assert percentile(values, 0.5) == 50.0
    assert percentile(values, 0.99) == 99.0
    assert percentile(values, 1.0) == 100.0
    assert percentile([], 0.5) != percentile([], 0.5)  # NaN
    counts = gap_histogram([-0.5, 0.9, 1.0, 3.0, 24.9, 25.1, 2000.0])
    assert counts["<=1"] == 3 and counts["<=5"] == 1 and counts["<=25"] == 1
    assert counts["<=50"] == 1 and counts[">1000"] == 1
    assert sum(counts.values()) == 7


async def test_rounds_through_one_target_pool_their_streams_gaps_and_errors(
    serve: Callable[[_Handler], Awaitable[str]],
) -> None:
    url = await serve(_sse_handler(deltas=3, gap=0.05, split=False))
    first = await run_slow_streams(
        "ours", url, _CHAT, b"{}", streams=2, deltas=3, gap=0.05, ramp=0.0
    )
    second = await run_slow_streams(
        "ours", url, _CHAT, b"{}", streams=3, deltas=3, gap=0.05, ramp=0.0
    )
    second.errors["timed out"] = 1  # as a round with one stream that never ended says
    pooled = sorted(first.gaps + second.gaps)
    first.add(second)
    assert (first.streams, first.complete) == (5, 5)
    assert first.gaps == pooled and len(pooled) == 10
    assert first.errors == {"timed out": 1}


async def test_the_client_runs_no_garbage_collection_while_streams_stream(
    serve: Callable[[_Handler], Awaitable[str]],
) -> None:
    """A collection in the client stops every stream's reads alike (the instrument's
    pause, not a server's): none runs from the first event sent to the last, even with
    thresholds that would run one every few allocations."""
    sent: list[float] = []
    handler = _sse_handler(deltas=4, gap=0.02, split=False)

    async def stamped(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        sent.append(time.perf_counter())
        await handler(reader, writer)
        sent.append(time.perf_counter())

    url = await serve(stamped)
    collections: list[float] = []

    def record(phase: str, info: dict[str, int]) -> None:
        if phase == "start":
            collections.append(time.perf_counter())

    thresholds = gc.get_threshold()
    gc.set_threshold(2, 1, 1)
    gc.callbacks.append(record)
    try:
        figures = await run_slow_streams(
            "ours", url, _CHAT, b"{}", streams=8, deltas=4, gap=0.02, ramp=0.0
        )
    finally:
        gc.callbacks.remove(record)
        gc.set_threshold(*thresholds)
    assert figures.complete == 8
    assert gc.isenabled()
    assert collections, "the thresholds make collections run around the measurement"
    assert not [t for t in collections if min(sent) <= t <= max(sent)]

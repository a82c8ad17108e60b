"""Slow streams for ``bench overhead --slow-streams``: many answers, one SSE event a second.

Each stream is one streamed POST on its own connection; the emulator answers it
with ``deltas`` text deltas ``gap`` seconds apart (``x-emulator: chunks=N;
delay=S``). The streams start evenly over ``ramp`` seconds, so their events are
spread over the second as a real crowd's are, not sent in one burst.

The client is a bare :class:`asyncio.Protocol`, not aiohttp's client: with
thousands of streams on a small shared machine, a heavier client's CPU per event
would delay every target's events alike and leave less CPU for the servers
measured. It parses the status line, removes the chunked framing (RFC 9112 §7.1)
and stamps, with ``time.perf_counter``, the read in which each SSE event ends (a
blank line: the WHATWG HTML event-stream format, §9.2.6).

The client runs no garbage collection while it measures (:func:`_collector_off`):
4,000 open streams make this process hold ~300,000 tracked objects too, and a full
collection in it (130-450 ms measured in one run) stopped every stream's reads alike,
whichever target was being measured: a pause of the instrument, not of a server.

A *gap* is the time between two consecutive text deltas of one stream, as this
client saw them: the scripted ``gap`` plus whatever the servers on the way
added. Only gaps whose midpoint falls while every stream is streaming count
(from the last stream's first delta to the first stream's last delta): the
figures are those of ``streams`` concurrent streams, not of the ramp up or down.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import gc
import math
import time
from collections.abc import Iterator, Sequence
from typing import Final
from urllib.parse import urlsplit

from ._workload import BenchProtocol

__all__ = [
    "GAP_BUCKETS_MS",
    "SlowStreamFigures",
    "gap_histogram",
    "percentile",
    "run_slow_streams",
]

#: Upper edges (ms) of the histogram of gap minus the scripted gap; the last bucket is open.
GAP_BUCKETS_MS: Final = (1.0, 2.0, 5.0, 10.0, 25.0, 50.0, 100.0, 250.0, 500.0, 1000.0)
#: Seconds every stream gets past its scripted duration before it counts as failed.
_SLACK_S: Final = 60.0
#: Decoded body bytes each stream keeps to find its terminal event.
_TAIL_KEEP: Final = 256
_READ_SIZE_LINE: Final = -1
_READ_DATA_CRLF: Final = -2
#: A chunk-size line longer than this is not HTTP/1.1 from our servers.
_MAX_SIZE_LINE: Final = 1024


def percentile(sorted_values: Sequence[float], fraction: float) -> float:
    """Nearest-rank percentile (``fraction`` in [0, 1]) of ascending values; NaN if empty."""
    if not sorted_values:
        return math.nan
    rank = max(1, math.ceil(fraction * len(sorted_values)))
    return sorted_values[min(rank, len(sorted_values)) - 1]


def gap_histogram(added_ms: Sequence[float]) -> dict[str, int]:
    """Counts of ``added_ms`` (gap minus the scripted gap, ms) per :data:`GAP_BUCKETS_MS` bucket.

    Keys name each bucket's upper edge (``"<=5"``), the last one ``">1000"``; a value
    below zero (a delta that came early after a late one) falls in the first bucket.
    """
    counts = {f"<={edge:g}": 0 for edge in GAP_BUCKETS_MS}
    counts[f">{GAP_BUCKETS_MS[-1]:g}"] = 0
    keys = list(counts)
    for value in added_ms:
        index = next((i for i, edge in enumerate(GAP_BUCKETS_MS) if value <= edge), -1)
        counts[keys[index]] += 1
    return counts


@dataclasses.dataclass(slots=True)
class SlowStreamFigures:
    """What ``streams`` slow streams through one target showed.

    ``gaps`` are the in-window gaps in seconds, ascending; ``scripted_gap_s`` the
    emulator's sleep between deltas; ``window_s`` how long all streams streamed at
    once (seconds); ``errors`` counts failed streams by reason.
    """

    target: str
    streams: int
    scripted_gap_s: float
    complete: int = 0
    window_s: float = 0.0
    gaps: list[float] = dataclasses.field(default_factory=list)
    errors: dict[str, int] = dataclasses.field(default_factory=dict)

    def add(self, other: SlowStreamFigures) -> None:
        """Pool ``other`` (another round through the same target) into these figures:
        streams, completions, errors and gaps add up; ``window_s`` is the shortest."""
        self.streams += other.streams
        self.complete += other.complete
        self.window_s = min(self.window_s, other.window_s) if self.gaps else other.window_s
        self.gaps = sorted(self.gaps + other.gaps)
        for reason, count in other.errors.items():
            self.errors[reason] = self.errors.get(reason, 0) + count

    def added(self, fraction: float) -> float:
        """The ``fraction`` percentile of gap minus the scripted gap, seconds (NaN: no gaps)."""
        return percentile(self.gaps, fraction) - self.scripted_gap_s

    def summary(self) -> dict[str, object]:
        """The figures as JSON-ready values: counts, added-gap percentiles (s), histogram."""
        added_ms = [(gap - self.scripted_gap_s) * 1000 for gap in self.gaps]
        return {
            "streams": self.streams,
            "complete": self.complete,
            "errors": dict(self.errors),
            "window_s": self.window_s,
            "gaps": len(self.gaps),
            "scripted_gap_s": self.scripted_gap_s,
            **{f"added_p{p}_s": self.added(p / 100) for p in (50, 90, 99)},
            "added_max_s": self.added(1.0),
            "added_histogram_ms": gap_histogram(added_ms),
        }


class _SlowStream(asyncio.Protocol):
    """One request on its own connection; stamps the end of each SSE event of the answer."""

    __slots__ = (
        "_body",
        "_buffer",
        "_chunk_left",
        "_head_done",
        "_newline",
        "_request",
        "_tail",
        "_terminal",
        "_transport",
        "complete",
        "done",
        "error",
        "events",
    )

    def __init__(self, request: bytes, terminal: bytes, done: asyncio.Future[None]) -> None:
        self._request = request
        self._terminal = terminal
        self._transport: asyncio.Transport | None = None
        self._buffer = bytearray()
        self._head_done = False
        self._chunk_left = _READ_SIZE_LINE
        self._newline = False  # the last decoded byte was a "\n" that ended no event
        self._tail = b""
        self.done = done
        self.events: list[float] = []
        self.complete = False
        self.error: str | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        self._transport = transport
        transport.write(self._request)

    def data_received(self, data: bytes) -> None:
        now = time.perf_counter()
        self._buffer += data
        try:
            if not self._head_done and not self._read_head():
                return
            self._read_chunks(now)
        except ValueError as exc:
            self._fail(f"bad answer: {exc}")

    def connection_lost(self, exc: Exception | None) -> None:
        if not self.done.done():
            reason = type(exc).__name__ if exc is not None else "closed before the end"
            self.error = self.error or reason
            self.done.set_result(None)

    def abort(self, reason: str) -> None:
        """Give up on this stream (``reason`` counts as its error)."""
        self._fail(reason)

    def _read_head(self) -> bool:
        end = self._buffer.find(b"\r\n\r\n")
        if end < 0:
            if len(self._buffer) > 64 * 1024:
                raise ValueError("response head over 64 KiB")
            return False
        head = bytes(self._buffer[:end]).decode("latin-1").lower().split("\r\n")
        del self._buffer[: end + 4]
        status = head[0].split(" ", 2)[1] if head[0].count(" ") else "?"
        if status != "200":
            raise ValueError(f"status {status}")
        fields = dict(line.split(":", 1) for line in head[1:] if ":" in line)
        if fields.get("transfer-encoding", "").strip() != "chunked":
            raise ValueError("answer not chunked")
        self._head_done = True
        return True

    def _read_chunks(self, now: float) -> None:
        buffer = self._buffer
        while buffer:
            if self._chunk_left > 0:
                piece = bytes(buffer[: self._chunk_left])
                del buffer[: len(piece)]
                self._chunk_left -= len(piece)
                self._on_data(piece, now)
                if self._chunk_left == 0:
                    self._chunk_left = _READ_DATA_CRLF
            elif self._chunk_left == _READ_DATA_CRLF:
                if len(buffer) < 2:
                    return
                if buffer[:2] != b"\r\n":
                    raise ValueError("chunk data not followed by CRLF")
                del buffer[:2]
                self._chunk_left = _READ_SIZE_LINE
            else:
                end = buffer.find(b"\r\n")
                if end < 0:
                    if len(buffer) > _MAX_SIZE_LINE:
                        raise ValueError("chunk-size line too long")
                    return
                size = int(bytes(buffer[:end]).split(b";", 1)[0], 16)
                del buffer[: end + 2]
                if size == 0:
                    self._finish()
                    return
                self._chunk_left = size

    def _on_data(self, piece: bytes, now: float) -> None:
        # Our servers end events with "\n\n"; one may straddle two chunks or reads.
        text = b"\n" + piece if self._newline else piece
        self.events.extend([now] * text.count(b"\n\n"))
        self._newline = text.endswith(b"\n") and not text.endswith(b"\n\n")
        self._tail = (self._tail + piece)[-_TAIL_KEEP:]

    def _finish(self) -> None:
        self.complete = self._terminal in self._tail
        if not self.complete:
            self.error = "no terminal event"
        if not self.done.done():
            self.done.set_result(None)
        if self._transport is not None:
            self._transport.close()

    def _fail(self, reason: str) -> None:
        self.error = self.error or reason
        if not self.done.done():
            self.done.set_result(None)
        if self._transport is not None:
            self._transport.abort()


def _request(url: str, protocol: BenchProtocol, body: bytes, script: str) -> bytes:
    parts = urlsplit(url)
    lines = [f"POST {protocol.path} HTTP/1.1", f"Host: {parts.netloc}"]
    lines += [f"{name}: {value}" for name, value in protocol.headers().items()]
    lines += [f"Content-Length: {len(body)}", f"x-emulator: {script}", "Connection: close"]
    return ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1") + body


async def _open(loop: asyncio.AbstractEventLoop, host: str, port: int, stream: _SlowStream) -> None:
    try:
        await loop.create_connection(lambda: stream, host, port)
    except OSError as exc:
        stream.abort(f"connect: {type(exc).__name__}")


@contextlib.contextmanager
def _collector_off() -> Iterator[None]:
    """No cyclic garbage collection in this process inside the block; one full one on
    each side of it, outside the measurement (what the block made is freed then)."""
    enabled = gc.isenabled()
    gc.collect()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()
        gc.collect()


async def run_slow_streams(
    target: str,
    url: str,
    protocol: BenchProtocol,
    body: bytes,
    *,
    streams: int,
    deltas: int,
    gap: float,
    ramp: float,
) -> SlowStreamFigures:
    """Run ``streams`` slow streams against ``url`` (``http://host:port``) and measure gaps.

    ``deltas`` text deltas per answer (at least 2), ``gap`` seconds apart; the
    streams start evenly over ``ramp`` seconds. Every stream is bounded: one not
    finished ``_SLACK_S`` (60 s) after its scripted duration is aborted and counted
    failed. Returns the figures for ``target``; never raises for a failed stream.
    """
    if deltas < 2:
        raise ValueError("deltas must be at least 2 (one gap)")
    loop = asyncio.get_running_loop()
    parts = urlsplit(url)
    assert parts.hostname is not None and parts.port is not None
    request = _request(url, protocol, body, f"chunks={deltas}; delay={gap:g}")
    terminal = protocol.terminal
    calls = [_SlowStream(request, terminal, loop.create_future()) for _ in range(streams)]
    openers: list[asyncio.Task[None]] = []
    with _collector_off():
        await _stream_all(loop, parts.hostname, parts.port, calls, openers, deltas, gap, ramp)
    return _figures(target, calls, protocol, deltas, gap)


async def _stream_all(
    loop: asyncio.AbstractEventLoop,
    host: str,
    port: int,
    calls: Sequence[_SlowStream],
    openers: list[asyncio.Task[None]],
    deltas: int,
    gap: float,
    ramp: float,
) -> None:
    """Open ``calls`` evenly over ``ramp`` seconds and wait for them (bounded)."""
    streams = len(calls)
    started = time.perf_counter()
    try:
        for index, stream in enumerate(calls):
            # Start stream i at started + i * ramp / streams: a bounded loop of sleeps.
            delay = started + index * ramp / streams - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            openers.append(loop.create_task(_open(loop, host, port, stream)))
        remaining = ramp + deltas * gap + _SLACK_S - (time.perf_counter() - started)
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(max(remaining, 0.0)):
                await asyncio.gather(*(stream.done for stream in calls))
    finally:
        for stream in calls:
            if not stream.done.done():
                stream.abort("timed out")
        for opener in openers:
            opener.cancel()
        await asyncio.gather(*openers, return_exceptions=True)


def _figures(
    target: str, calls: Sequence[_SlowStream], protocol: BenchProtocol, deltas: int, gap: float
) -> SlowStreamFigures:
    figures = SlowStreamFigures(target, len(calls), gap)
    first = protocol.first_delta_event - 1  # index of the first delta among the events
    stamps: list[list[float]] = []
    for stream in calls:
        delta_stamps = stream.events[first : first + deltas]
        if stream.complete and len(delta_stamps) == deltas:
            figures.complete += 1
            stamps.append(delta_stamps)
            continue
        reason = stream.error or f"{len(delta_stamps)} of {deltas} deltas"
        figures.errors[reason] = figures.errors.get(reason, 0) + 1
    if not stamps:
        return figures
    # The window in which every complete stream was streaming.
    opened = max(s[0] for s in stamps)
    closing = min(s[-1] for s in stamps)
    figures.window_s = max(0.0, closing - opened)
    # By midpoint: streams opened microseconds apart still count all their gaps alike.
    figures.gaps = sorted(
        s[k] - s[k - 1]
        for s in stamps
        for k in range(1, deltas)
        if opened <= (s[k] + s[k - 1]) / 2 <= closing
    )
    return figures

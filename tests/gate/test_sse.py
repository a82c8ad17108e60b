"""Tests for the incremental SSE framer (proxy/_sse.py).

Property checks use seeded ``random`` generators (bounded iteration counts)
and an independent whole-stream reference parser written from the WHATWG
rules, so a failure prints a reproducible seed.
"""

from __future__ import annotations

import random
import re
import tracemalloc
from collections.abc import Sequence

import pytest

from proxy._sse import SSEEvent, SSEFramer

BOM = b"\xef\xbb\xbf"

Simple = tuple[str | None, bytes]


def reference_events(stream: bytes) -> list[Simple]:
    """Whole-stream SSE interpretation, straight from the spec's prose."""
    if stream.startswith(BOM):
        stream = stream[len(BOM) :]
    lines = re.split(rb"\r\n|\r|\n", stream)[:-1]  # the last piece is unterminated
    events: list[Simple] = []
    data: list[bytes] | None = None
    event_type = b""
    for line in lines:
        if not line:
            if data is not None:
                name = event_type.decode("utf-8", "replace") or None
                events.append((name, b"\n".join(data)))
            data = None
            event_type = b""
            continue
        if line.startswith(b":"):
            continue
        name_b, colon, value = line.partition(b":")
        if colon and value.startswith(b" "):
            value = value[1:]
        if name_b == b"data":
            data = [*(data or []), value]
        elif name_b == b"event":
            event_type = value
    return events


def simple(events: Sequence[SSEEvent]) -> list[Simple]:
    return [(e.event, e.data) for e in events]


def feed_chunks(
    stream: bytes, cuts: Sequence[int], *, max_data: int = 1 << 20
) -> tuple[list[SSEEvent], list[tuple[int, int]]]:
    """Feed ``stream`` cut at ``cuts``; return events and (fed, pending) after each chunk."""
    framer = SSEFramer(max_data=max_data)
    events: list[SSEEvent] = []
    pendings: list[tuple[int, int]] = []
    previous = 0
    for cut in [*cuts, len(stream)]:
        events += framer.feed(stream[previous:cut])
        previous = cut
        pendings.append((framer.fed_bytes, framer.pending_bytes))
    events += framer.close()
    return events, pendings


def bytewise_pending(stream: bytes) -> list[int]:
    """pending_bytes after each prefix length 0..len(stream), feeding one byte at a time."""
    framer = SSEFramer()
    out = [framer.pending_bytes]
    for i in range(len(stream)):
        framer.feed(stream[i : i + 1])
        out.append(framer.pending_bytes)
    return out


# -- table tests ------------------------------------------------------------

TABLE: list[tuple[str, bytes, list[Simple]]] = [
    ("lf", b"data: a\n\n", [(None, b"a")]),
    ("crlf", b"data: a\r\n\r\n", [(None, b"a")]),
    ("lone cr", b"data: a\r\r", [(None, b"a")]),
    ("mixed endings", b"data: a\r\ndata: b\rdata: c\n\r\n", [(None, b"a\nb\nc")]),
    ("no space after colon", b"data:x\n\n", [(None, b"x")]),
    ("only one space stripped", b"data:  x\n\n", [(None, b" x")]),
    ("field without colon is empty", b"data\n\n", [(None, b"")]),
    ("two empty data lines", b"data\ndata\n\n", [(None, b"\n")]),
    ("multi-line data", b"data: a\ndata: b\n\n", [(None, b"a\nb")]),
    ("event name", b"event: ping\ndata: {}\n\n", [("ping", b"{}")]),
    ("last event name wins", b"event: a\nevent: b\ndata: x\n\n", [("b", b"x")]),
    ("empty event name is default", b"event\ndata: x\n\n", [(None, b"x")]),
    (
        "unknown event type kept",
        b"event: response.future_thing\ndata: 1\n\n",
        [("response.future_thing", b"1")],
    ),
    ("id retry unknown ignored", b"id: 7\nretry: 10\nfoo: bar\ndata: x\n\n", [(None, b"x")]),
    ("field names are case sensitive", b"DATA: x\n\n", []),
    ("space before colon is part of name", b"data : x\n\n", []),
    ("comment lines", b": hello\ndata: x\n: bye\n\n", [(None, b"x")]),
    ("comment-only block", b": keepalive\n\n", []),
    ("event without data not dispatched", b"event: ping\n\ndata: x\n\n", [(None, b"x")]),
    ("bom stripped", BOM + b"data: x\n\n", [(None, b"x")]),
    ("only one bom stripped", BOM + BOM + b"data: x\n\n", []),
    ("bom only at stream start", b"data: x\n\n" + BOM + b"data: y\n\n", [(None, b"x")]),
    ("unterminated event discarded", b"data: x\n\ndata: y\n", [(None, b"x")]),
    ("done sentinel", b"data: [DONE]\n\n", [(None, b"[DONE]")]),
    ("utf-8 data kept as bytes", b"data: caf\xc3\xa9\n\n", [(None, b"caf\xc3\xa9")]),
    ("invalid utf-8 event name", b"event: a\xff\ndata: x\n\n", [("a\ufffd", b"x")]),
    ("stray blank lines", b"\n\n\r\n\rdata: x\n\n\n", [(None, b"x")]),
    ("colon inside value", b"data: a: b\n\n", [(None, b"a: b")]),
]


@pytest.mark.parametrize(
    ("stream", "expected"), [(s, e) for _, s, e in TABLE], ids=[n for n, _, _ in TABLE]
)
def test_table_whole_and_bytewise(stream: bytes, expected: list[Simple]) -> None:
    whole, _ = feed_chunks(stream, [])
    bytewise, _ = feed_chunks(stream, list(range(1, len(stream))))
    assert simple(whole) == expected
    assert simple(bytewise) == expected
    assert reference_events(stream) == expected  # the oracle agrees with the table
    for event in whole:
        assert event.data_size == len(event.data)
        assert not event.truncated


def test_event_spans_cover_exact_bytes() -> None:
    stream = BOM + b": c\n\nevent: a\r\ndata: 1\r\n\r\ndata: 2\r\rdata: 3\n\n"
    events, _ = feed_chunks(stream, [])
    assert [(e.start, e.end) for e in events] == [(8, 29), (29, 38), (38, 47)]
    for event in events:
        # Replaying just an event's bytes yields just that event.
        framer = SSEFramer()
        replay = framer.feed(stream[event.start : event.end]) + framer.close()
        assert simple(replay) == [(event.event, event.data)]


def test_crlf_split_across_chunks() -> None:
    framer = SSEFramer()
    assert framer.feed(b"data: a\r") == []
    assert framer.pending_bytes == 8
    # The blank line's CR arrives at a chunk end: its LF may still follow.
    assert framer.feed(b"\n\r") == []
    assert framer.mid_event
    (event,) = framer.feed(b"\n")
    assert (event.data, event.start, event.end) == (b"a", 0, 11)
    assert framer.pending_bytes == 0
    assert not framer.mid_event


def test_lone_cr_terminator_resolved_by_next_byte_or_close() -> None:
    framer = SSEFramer()
    (first,) = framer.feed(b"data: a\r\rdata: b\r\r")
    assert (first.data, first.end) == (b"a", 9)
    assert framer.pending_bytes == 9  # "data: b\r\r" awaits its possible LF
    (second,) = framer.feed(b"d")
    assert (second.data, second.start, second.end) == (b"b", 9, 18)
    assert framer.pending_bytes == 1
    framer2 = SSEFramer()
    framer2.feed(b"data: z\r\r")
    (last,) = framer2.close()
    assert last.data == b"z"
    assert framer2.pending_bytes == 0


def test_comment_only_block_resets_boundary() -> None:
    framer = SSEFramer()
    assert framer.feed(b": keepalive\n") == []
    assert framer.pending_bytes == 12
    assert framer.feed(b"\n") == []
    assert framer.pending_bytes == 0
    assert not framer.mid_event
    (event,) = framer.feed(b"data: x\n\n")
    assert event.start == 13


def test_unterminated_tail_reported_after_close() -> None:
    framer = SSEFramer()
    framer.feed(b"data: x\n\ndata: partial")
    assert framer.close() == []
    assert framer.pending_bytes == len(b"data: partial")
    assert framer.close() == []  # idempotent
    with pytest.raises(RuntimeError):
        framer.feed(b"data: y\n\n")


def test_accepts_bytearray_and_memoryview() -> None:
    framer = SSEFramer()
    buffer = bytearray(b"data: a\n\n")
    events = framer.feed(buffer)
    buffer[:] = b"XXXXXXXXX"  # the caller may reuse its buffer
    events += framer.feed(memoryview(b"data: b\n\n"))
    assert simple(events) == [(None, b"a"), (None, b"b")]


def test_bom_split_across_chunks() -> None:
    framer = SSEFramer()
    assert framer.feed(BOM[:1]) == []
    assert framer.feed(BOM[1:2]) == []
    assert framer.pending_bytes == 2
    (event,) = framer.feed(BOM[2:] + b"data: x\n\n")
    assert (event.data, event.start, event.end) == (b"x", 0, 12)


def test_bom_prefix_that_is_not_a_bom_is_data() -> None:
    framer = SSEFramer()
    assert framer.feed(b"\xef") == []
    assert framer.feed(b"\xbbdata: x\n\n") == []  # "\xef\xbbdata" is an unknown field name
    (event,) = framer.feed(b"data: y\n\n")
    assert event.data == b"y"


def test_negative_max_data_rejected() -> None:
    with pytest.raises(ValueError):
        SSEFramer(max_data=-1)


@pytest.mark.parametrize(
    ("stream", "data", "size", "truncated"),
    [
        (b"data: 12345\n\n", b"12345", 5, False),
        (b"data: 123456\n\n", b"", 6, True),
        (b"data: 12\ndata: 34\n\n", b"12\n34", 5, False),
        (b"data: 12\ndata: 345\n\n", b"", 6, True),
        (b"data: 12345\ndata\n\n", b"", 6, True),
    ],
)
def test_max_data_boundary(stream: bytes, data: bytes, size: int, truncated: bool) -> None:
    framer = SSEFramer(max_data=5)
    (event,) = framer.feed(stream)
    assert (event.data, event.data_size, event.truncated) == (data, size, truncated)
    # State resets after a truncated event.
    (after,) = framer.feed(b"data: ok\n\n")
    assert (after.data, after.data_size, after.truncated) == (b"ok", 2, False)


# -- chunking invariance ----------------------------------------------------

CORPUS = (
    BOM
    + b": comment\r\n\r\n"
    + b'event: message_start\r\ndata: {"a": 1}\r\n\r\n'
    + b"data: x\rdata: y\r\r"
    + b"event: ping\n\n"
    + b"data\ndata:\ndata:  z\n\n"
    + b"id: 1\nretry: 5\nunknown\ndata: [DONE]\n\r\n"
    + b"data: tail-unterminated"
)


def test_every_two_way_split_gives_same_events_and_boundaries() -> None:
    whole, _ = feed_chunks(CORPUS, [])
    assert simple(whole) == reference_events(CORPUS)
    assert len(whole) == 4
    pending = bytewise_pending(CORPUS)
    for cut in range(len(CORPUS) + 1):
        events, pendings = feed_chunks(CORPUS, [cut])
        assert events == whole, cut
        for fed, pend in pendings:
            assert pend == pending[fed], (cut, fed)


TOKENS = [
    b"data",
    b"data",
    b"event",
    b"id",
    b"retry",
    b":",
    b":",
    b" ",
    b"  ",
    b"x",
    b"yz",
    b"\r",
    b"\n",
    b"\n",
    b"\r\n",
    b"ping",
    BOM,
    b"\xc3\xa9",
    b"[DONE]",
]


def random_stream(rng: random.Random) -> bytes:
    prefix = BOM if rng.random() < 0.2 else b""
    return prefix + b"".join(rng.choice(TOKENS) for _ in range(rng.randrange(0, 80)))


def random_cuts(rng: random.Random, length: int) -> list[int]:
    if length == 0:
        return []
    return sorted(rng.sample(range(length + 1), k=rng.randrange(0, min(length, 12) + 1)))


@pytest.mark.parametrize("seed", range(40))
def test_random_streams_match_reference_under_random_splits(seed: int) -> None:
    rng = random.Random(seed)
    for _ in range(25):
        stream = random_stream(rng)
        expected = reference_events(stream)
        whole, _ = feed_chunks(stream, [])
        assert simple(whole) == expected, stream
        pending = bytewise_pending(stream)
        for _ in range(4):
            events, pendings = feed_chunks(stream, random_cuts(rng, len(stream)))
            assert events == whole, stream
            for fed, pend in pendings:
                assert pend == pending[fed], (stream, fed)
        for event in whole:
            framer = SSEFramer()
            replay = framer.feed(stream[event.start : event.end]) + framer.close()
            assert simple(replay) == [(event.event, event.data)], stream


# -- cost -------------------------------------------------------------------

LINE_3MB = 3_000_000


def test_three_megabyte_line_in_1k_chunks_is_linear_and_bounded() -> None:
    max_data = 1 << 20
    stream = b"event: big\ndata: " + b"a" * LINE_3MB + b"\n\ndata: after\n\n"
    framer = SSEFramer(max_data=max_data)
    events: list[SSEEvent] = []
    for i in range(0, len(stream), 1024):
        events += framer.feed(stream[i : i + 1024])
        assert framer.retained_bytes <= max_data
    events += framer.close()
    big, after = events
    assert (big.event, big.data, big.data_size, big.truncated) == ("big", b"", LINE_3MB, True)
    assert (after.data, after.truncated) == (b"after", False)
    # Each byte is searched at most twice (line end + field colon), never rescanned.
    assert framer.scanned_bytes <= 2 * len(stream)
    assert framer.fed_bytes == len(stream)


def test_long_line_memory_stays_within_max_data() -> None:
    max_data = 64 * 1024
    chunk = b"a" * 1024
    framer = SSEFramer(max_data=max_data)
    framer.feed(b"data: ")
    tracemalloc.start()
    try:
        baseline = tracemalloc.get_traced_memory()[0]
        for _ in range(LINE_3MB // 1024):
            framer.feed(chunk)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak - baseline < 4 * max_data
    (event,) = framer.feed(b"\n\n")
    assert event.truncated
    assert event.data_size == LINE_3MB // 1024 * 1024


def test_long_line_retained_when_under_max_data() -> None:
    payload = bytes(range(32, 127)) * 33_000  # ~3.1 MB
    stream = b"data: " + payload + b"\r\n\r\n"
    framer = SSEFramer(max_data=4 << 20)
    events: list[SSEEvent] = []
    for i in range(0, len(stream), 1000):
        events += framer.feed(stream[i : i + 1000])
    (event,) = events
    assert event.data == payload
    assert framer.scanned_bytes <= 2 * len(stream)


def test_many_small_events_in_one_chunk_scan_linearly() -> None:
    stream = b"".join(b'data: {"i": %d}\n\n' % i for i in range(20_000))
    framer = SSEFramer()
    events = framer.feed(stream)
    assert len(events) == 20_000
    assert events[-1].data == b'{"i": 19999}'
    assert framer.scanned_bytes <= 2 * len(stream)
    assert framer.pending_bytes == 0


def _every_field(events: Sequence[SSEEvent]) -> list[tuple[object, ...]]:
    return [(e.event, e.data, e.data_size, e.truncated, e.start, e.end) for e in events]


@pytest.mark.parametrize(
    ("stream", "max_data"),
    [
        # One data line per block, whole in the chunk: the framer's short path.
        (b'data: {"a":1}\n\ndata: [DONE]\n\n', 1 << 20),
        (b"event: message_start\ndata: {}\n\nevent: ping\ndata:\n\n", 1 << 20),
        (b"event:\ndata: x\n\n", 1 << 20),  # an empty name: the default type
        (b"event: caf\xc3\xa9\ndata:  two spaces\n\n", 1 << 20),
        (b"event: " + b"n" * 2000 + b"\ndata: x\n\n", 1 << 20),  # name kept to 1024 bytes
        (b"data: " + b"v" * 4000 + b"\n\n", 4000),  # exactly max_data: kept
        (b"data: " + b"v" * 4001 + b"\n\n", 4000),  # one over: truncated, size counted
        (b": comment\nid: 1\ndata: after a comment\n\n\n\ndata: y\n\n", 1 << 20),
        (b"data: a\ndata: b\n\nevent: e\ndata: c\n\n", 1 << 20),  # two lines: buffered
    ],
)
def test_whole_events_in_one_chunk_match_a_byte_at_a_time_feed(
    stream: bytes, max_data: int
) -> None:
    whole = SSEFramer(max_data=max_data)
    fast = whole.feed(stream)
    bytewise = SSEFramer(max_data=max_data)
    slow = [event for i in range(len(stream)) for event in bytewise.feed(stream[i : i + 1])]
    assert _every_field(fast) == _every_field(slow)
    assert whole.pending_bytes == bytewise.pending_bytes == 0
    assert whole.scanned_bytes <= 2 * len(stream)

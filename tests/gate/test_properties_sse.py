"""Property-based tests of the SSE framer (hypothesis): random streams, random splits.

The oracle is the whole-stream reference parser of ``tests/gate/test_sse.py``,
written from the WHATWG prose and sharing no code with :mod:`proxy._sse`.
Streams are built from the things real upstreams send and the spec allows:
``data``/``event``/``id``/``retry``/unknown fields, comments, fields without a
colon, CRLF / LF / lone CR line ends mixed, a BOM, long values, and a trailing
unterminated fragment. Each stream is fed cut at random places.
"""

from __future__ import annotations

import itertools

from hypothesis import given
from hypothesis import strategies as st

from proxy._sse import SSEEvent, SSEFramer
from tests.gate.test_sse import BOM, reference_events, simple

_EOL = st.sampled_from([b"\n", b"\r\n", b"\r"])
# Values never contain CR or LF (a line end would end them); anything else goes.
_VALUE = st.binary(max_size=40).map(lambda b: b.replace(b"\r", b"").replace(b"\n", b""))
_LONG_VALUE = st.integers(min_value=0, max_value=5000).map(lambda n: b"v" * n)


@st.composite
def _line(draw: st.DrawFn) -> bytes:
    kind = draw(st.sampled_from(["data", "data", "event", "id", "retry", "other", "bare", "note"]))
    value = draw(st.one_of(_VALUE, _LONG_VALUE)) if kind == "data" else draw(_VALUE)
    space = draw(st.sampled_from([b"", b" ", b"  "]))
    if kind == "note":
        return b":" + value
    if kind == "bare":  # a field name with no colon: an empty value
        return draw(st.sampled_from([b"data", b"event", b"x"]))
    if kind == "other":
        return b"x-field:" + space + value
    return kind.encode() + b":" + space + value


@st.composite
def streams(draw: st.DrawFn) -> bytes:
    """A random event stream, possibly with a BOM and an unterminated tail."""
    out = bytearray(BOM if draw(st.booleans()) else b"")
    for _ in range(draw(st.integers(min_value=0, max_value=8))):
        for line in draw(st.lists(_line(), max_size=5)):
            out += line + draw(_EOL)
        out += draw(_EOL)  # the blank line that dispatches the block
    if draw(st.booleans()):
        out += draw(_line())  # a fragment the stream ends inside
        if draw(st.booleans()):
            out += draw(_EOL)
    return bytes(out)


@st.composite
def split(draw: st.DrawFn, data: bytes) -> list[bytes]:
    cuts = sorted(
        draw(st.lists(st.integers(min_value=0, max_value=len(data)), max_size=12, unique=True))
    )
    bounds = [0, *cuts, len(data)]
    return [data[a:b] for a, b in itertools.pairwise(bounds)]


@given(st.data())
def test_framer_agrees_with_the_reference_parser_for_any_split(data: st.DataObject) -> None:
    stream = data.draw(streams())
    chunks = data.draw(split(stream))
    framer = SSEFramer()
    events = []
    for chunk in chunks:
        events.extend(framer.feed(chunk))
    events.extend(framer.close())
    assert simple(events) == reference_events(stream)


@given(st.data())
def test_event_offsets_and_pending_bytes_do_not_depend_on_the_split(data: st.DataObject) -> None:
    stream = data.draw(streams())
    whole = SSEFramer()
    expected = whole.feed(stream)
    chunks = data.draw(split(stream))
    framer = SSEFramer()
    events = []
    for chunk in chunks:
        events.extend(framer.feed(chunk))
    # The one lookahead case: a final CR may still complete an event at close.
    assert [(e.start, e.end) for e in events] == [(e.start, e.end) for e in expected]
    assert framer.pending_bytes == whole.pending_bytes
    assert framer.fed_bytes == len(stream)
    # Events tile the stream: each starts where the last one (or a dispatch-less
    # block) ended, and ends just past a blank line.
    previous_end = 0
    for event in events:
        assert previous_end <= event.start < event.end <= len(stream)
        assert stream[event.end - 1 : event.end] in (b"\n", b"\r")
        previous_end = event.end
    assert framer.scanned_bytes <= 2 * len(stream) + 8


@given(streams(), st.integers(min_value=0, max_value=64))
def test_a_small_max_data_truncates_but_keeps_sizes_and_boundaries(
    stream: bytes, max_data: int
) -> None:
    full = SSEFramer().feed(stream)
    small = SSEFramer(max_data=max_data).feed(stream)
    assert [(e.start, e.end, e.event, e.data_size) for e in small] == [
        (e.start, e.end, e.event, e.data_size) for e in full
    ]
    for got, want in zip(small, full, strict=True):
        assert got.truncated == (want.data_size > max_data)
        assert got.data == (b"" if got.truncated else want.data)


@st.composite
def _lf_blocks(draw: st.DrawFn) -> bytes:
    """Streams shaped like real upstreams': LF line ends, mostly one ``event:`` and one
    ``data:`` line per block, with the odd comment, id, empty or over-long event name,
    second data line or stray blank line mixed in."""
    out = bytearray()
    for _ in range(draw(st.integers(min_value=0, max_value=10))):
        if draw(st.booleans()):
            out += b": keep-alive\n" if draw(st.booleans()) else b"id: 7\n"
        if draw(st.booleans()):
            name = draw(st.sampled_from([b"message_start", b"", b"x" * 1100, b"caf\xc3\xa9"]))
            out += b"event:" + draw(st.sampled_from([b"", b" "])) + name + b"\n"
        value = draw(st.one_of(_VALUE, _LONG_VALUE))
        out += b"data:" + draw(st.sampled_from([b"", b" ", b"  "])) + value + b"\n"
        if draw(st.integers(min_value=0, max_value=4)) == 0:
            out += b"data: more\n"
        out += b"\n"
        if draw(st.integers(min_value=0, max_value=6)) == 0:
            out += b"\n"
    return bytes(out)


def _fields(events: list[SSEEvent]) -> list[tuple[object, ...]]:
    return [(e.event, e.data, e.data_size, e.truncated, e.start, e.end) for e in events]


def _fed_byte_by_byte(stream: bytes, max_data: int) -> tuple[list[SSEEvent], SSEFramer]:
    """The events of ``stream`` fed a byte at a time (never on the short path), and the
    framer after its close."""
    framer = SSEFramer(max_data=max_data)
    events: list[SSEEvent] = []
    for i in range(len(stream)):
        events += framer.feed(stream[i : i + 1])
    events += framer.close()
    return events, framer


@given(_lf_blocks(), st.integers(min_value=0, max_value=6000))
def test_whole_events_in_one_chunk_frame_as_fed_byte_by_byte(stream: bytes, max_data: int) -> None:
    """Whole events in one chunk take the framer's short path (no data buffer): every
    field of every event is what the byte-at-a-time feed (never on that path) gives,
    and what the reference parser reads, at any ``max_data``."""
    whole = SSEFramer(max_data=max_data)
    fast = whole.feed(stream) + whole.close()
    slow, slow_framer = _fed_byte_by_byte(stream, max_data)
    assert _fields(fast) == _fields(slow)
    assert whole.pending_bytes == slow_framer.pending_bytes
    if b"x" * (1024 + 1) not in stream:  # the framer keeps 1024 bytes of a name, the spec all
        assert simple(SSEFramer().feed(stream)) == reference_events(stream)


@given(st.data(), st.integers(min_value=0, max_value=6000))
def test_whole_events_fed_cut_anywhere_frame_as_fed_byte_by_byte(
    data: st.DataObject, max_data: int
) -> None:
    """The short path is taken again after each event the line loop finishes (a chunk
    that begins mid-event): every field agrees with the byte-at-a-time feed."""
    stream = data.draw(_lf_blocks())
    framer = SSEFramer(max_data=max_data)
    fast: list[SSEEvent] = []
    for chunk in data.draw(split(stream)):
        fast += framer.feed(chunk)
    fast += framer.close()
    slow, slow_framer = _fed_byte_by_byte(stream, max_data)
    assert _fields(fast) == _fields(slow)
    assert framer.pending_bytes == slow_framer.pending_bytes
    assert framer.scanned_bytes <= 2 * len(stream) + 8

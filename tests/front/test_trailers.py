"""Trailer fields of a chunked request body (proxy/_front.py, ``RequestFraming``).

httptools buffers a field until its line ends, trailer fields after a chunked
body's last chunk too; the head's limits did not apply there (the head was
over). A client sending a never-ending trailer line made the proxy hold every
byte of it, for as long as the body reader waited for the body's end (its idle
timeout, 30 s by default: at loopback speed, gigabytes). Trailers are
bounded like a head now; ordinary ones still pass.
"""

from __future__ import annotations

import tracemalloc

import pytest

from proxy._http1 import END, MAX_HEAD_BYTES, MalformedRequest, RequestFraming

CHUNKED = b"POST /v1/x HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n"


def test_a_never_ending_trailer_line_is_refused_before_it_grows_past_the_head_limit() -> None:
    framing = RequestFraming()
    framing.feed(CHUNKED + b"5\r\nhello\r\n0\r\nX-Endless: ")
    tracemalloc.start()
    try:
        with pytest.raises(MalformedRequest, match="trailer fields are over the size limit"):
            for _ in range(MAX_HEAD_BYTES // 1024 + 2):  # bounded: one more than the limit
                framing.feed(b"a" * 1024)
        held = tracemalloc.get_traced_memory()[0]
    finally:
        tracemalloc.stop()
    assert held < 2 * MAX_HEAD_BYTES


@pytest.mark.parametrize("step", [None, 1, 7])
def test_ordinary_trailers_and_chunk_lines_pass_however_they_are_cut(step: int | None) -> None:
    body = (
        b"".join(b"%x\r\n%s\r\n" % (n, b"b" * n) for n in (1, 300, 70_000))
        + b"0\r\nX-Sum: 42\r\n\r\n"
    )
    data = CHUNKED + body + b"GET / HTTP/1.1\r\nHost: x\r\n\r\n"
    framing = RequestFraming()
    events: list[object] = []
    size = step or len(data)
    for i in range(0, len(data), size):
        events += framing.feed(data[i : i + size])
    pieces = b"".join(e for e in events if isinstance(e, bytes))
    assert pieces == b"b" * (1 + 300 + 70_000)
    assert sum(e is END for e in events) == 2

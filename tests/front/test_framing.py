"""The server edge's request framing, without sockets (proxy/_front.py, ``RequestFraming``).

Bytes in, events out: a head, body pieces, ``END``; limits of our own on top of
llhttp's strict parsing; every fault a :class:`MalformedRequest` in our words,
never the bytes that caused it.
"""

from __future__ import annotations

import tracemalloc

import pytest

from proxy._http1 import (
    END,
    MAX_FIELDS,
    MAX_HEAD_BYTES,
    MAX_LINE_BYTES,
    MalformedRequest,
    RequestFraming,
    RequestHead,
    Trailers,
)

SECRET = "sk-framing-secret-1234"


def feed_all(data: bytes, *, step: int | None = None) -> list[object]:
    """Every event of ``data`` fed whole, or ``step`` bytes at a time."""
    framing = RequestFraming()
    if step is None:
        return list(framing.feed(data))
    events: list[object] = []
    for i in range(0, len(data), step):
        events += framing.feed(data[i : i + step])
    return events


def body_of(events: list[object]) -> bytes:
    return b"".join(e for e in events if isinstance(e, bytes))


POST = (
    b"POST /v1/chat/completions?beta=true HTTP/1.1\r\nHost: x\r\n"
    b'Content-Type: application/json\r\nContent-Length: 7\r\n\r\n{"a":1}'
)


@pytest.mark.parametrize("step", [None, 1, 5, 64])
def test_a_request_is_a_head_its_body_and_its_end_however_it_is_cut(step: int | None) -> None:
    events = feed_all(POST, step=step)
    head = events[0]
    assert isinstance(head, RequestHead)
    assert (head.method, head.path, head.raw_path, head.query_string) == (
        "POST",
        "/v1/chat/completions",
        "/v1/chat/completions",
        "beta=true",
    )
    assert head.headers["content-type"] == "application/json"
    assert (head.content_length, head.chunked, head.expects_body) == (7, False, True)
    assert head.keep_alive and head.version == (1, 1)
    assert body_of(events) == b'{"a":1}'
    assert events[-1] is END


def test_a_chunked_body_comes_without_its_framing() -> None:
    data = (
        b"POST /v1/responses HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n"
        b"3\r\nabc\r\n2;ext=1\r\nde\r\n0\r\n\r\n"
    )
    events = feed_all(data, step=3)
    head = events[0]
    assert isinstance(head, RequestHead) and head.chunked and head.content_length is None
    assert body_of(events) == b"abcde" and events[-1] is END


def test_pipelined_requests_follow_each_other_in_order() -> None:
    get = b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n"
    events = feed_all(POST + get + POST)
    heads = [e for e in events if isinstance(e, RequestHead)]
    assert [h.path for h in heads] == ["/v1/chat/completions", "/healthz", "/v1/chat/completions"]
    assert [e for e in events if e is END] == [END, END, END]
    assert not heads[1].expects_body


def test_targets_are_decoded_for_routing_and_kept_raw_for_the_upstream() -> None:
    (head, *_) = feed_all(b"GET /v1/files/a%2Fb%3Fc?x=%20 HTTP/1.1\r\nHost: x\r\n\r\n")
    assert isinstance(head, RequestHead)
    assert head.path == "/v1/files/a/b?c" and head.raw_path == "/v1/files/a%2Fb%3Fc"
    assert head.query_string == "x=%20"
    (absolute, *_) = feed_all(b"GET http://other.example/v1/models?q=1 HTTP/1.1\r\nHost: x\r\n\r\n")
    assert isinstance(absolute, RequestHead)
    assert (absolute.path, absolute.query_string) == ("/v1/models", "q=1")


def test_http10_and_connection_close_do_not_keep_the_connection() -> None:
    (old, *_) = feed_all(b"GET / HTTP/1.0\r\n\r\n")
    (closing, *_) = feed_all(b"GET / HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
    assert isinstance(old, RequestHead) and isinstance(closing, RequestHead)
    assert old.version == (1, 0) and not old.keep_alive
    assert not closing.keep_alive


def test_header_values_keep_every_byte() -> None:
    (head, *_) = feed_all(b"GET / HTTP/1.1\r\nHost: x\r\nX-Name: caf\xc3\xa9 \xff\r\n\r\n")
    assert isinstance(head, RequestHead)
    value = head.headers["X-Name"]
    assert value.encode("utf-8", "surrogateescape") == b"caf\xc3\xa9 \xff"


@pytest.mark.parametrize(
    ("data", "words"),
    [
        (
            f"GET / HTTP/1.1\r\nAuthorization: Bearer {SECRET}\x01\r\n\r\n".encode(),
            "malformed HTTP request",
        ),
        (b"G@T / HTTP/1.1\r\n\r\n", "malformed"),
        (
            b"POST / HTTP/1.1\r\nContent-Length: 3\r\nTransfer-Encoding: chunked\r\n\r\n",
            "malformed HTTP request",
        ),
        (b"POST / HTTP/1.1\r\nContent-Length: 3\r\nContent-Length: 4\r\n\r\n", "malformed"),
        (b"POST / HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\n", "malformed"),
        (
            b"GET / HTTP/1.1\r\nX-Key: " + SECRET.encode() + b"A" * MAX_LINE_BYTES + b"\r\n\r\n",
            "over the size limit",
        ),
        (b"GET /" + b"a" * MAX_LINE_BYTES + b" HTTP/1.1\r\n\r\n", "over the size limit"),
        (
            b"GET / HTTP/1.1\r\n"
            + b"".join(b"X-%d: 1\r\n" % i for i in range(MAX_FIELDS + 1))
            + b"\r\n",
            "too many header fields",
        ),
    ],
    ids=[
        "control-char",
        "bad-method",
        "length-and-chunked",
        "two-lengths",
        "bad-chunk-size",
        "long-field",
        "long-target",
        "too-many-fields",
    ],
)
def test_a_malformed_request_is_refused_in_our_words(data: bytes, words: str) -> None:
    with pytest.raises(MalformedRequest) as caught:
        feed_all(data, step=7)
    assert words in str(caught.value)
    assert SECRET not in str(caught.value) and "AAAA" not in str(caught.value)


def test_a_never_ending_header_line_is_refused_before_it_grows_past_the_head_limit() -> None:
    framing = RequestFraming()
    framing.feed(b"GET / HTTP/1.1\r\nX-Endless: ")
    fed = 0
    with pytest.raises(MalformedRequest, match="over the size limit"):
        for _ in range(MAX_HEAD_BYTES // 1024 + 2):  # bounded: one more than the limit
            framing.feed(b"a" * 1024)
            fed += 1024
    assert fed <= MAX_HEAD_BYTES


def test_an_upgrade_request_is_framed_and_nothing_after_it() -> None:
    framing = RequestFraming()
    events = framing.feed(
        b"GET / HTTP/1.1\r\nHost: x\r\nConnection: Upgrade\r\nUpgrade: h2c\r\n\r\nPRI * HTTP/2.0"
    )
    assert isinstance(events[0], RequestHead) and framing.upgraded
    assert framing.feed(b"GET / HTTP/1.1\r\n\r\n") == []


def test_a_head_over_the_limit_is_refused_even_when_it_arrives_in_one_read() -> None:
    fields = b"".join(b"X-Pad-%d: %s\r\n" % (i, b"p" * 1000) for i in range(100))
    with pytest.raises(MalformedRequest, match="over the size limit"):
        feed_all(b"GET / HTTP/1.1\r\nHost: x\r\n" + fields + b"\r\n")
    # Just under the limit passes, in one read or in pieces.
    fine = b"".join(b"X-Pad-%d: %s\r\n" % (i, b"p" * 1000) for i in range(60))
    for step in (None, 1000):
        (head, *_) = feed_all(b"GET / HTTP/1.1\r\nHost: x\r\n" + fine + b"\r\n", step=step)
        assert isinstance(head, RequestHead) and len(head.headers) == 61


def test_too_many_fields_are_refused_before_the_head_ends() -> None:
    """The field count is bounded as fields arrive: an endless head of tiny fields is
    refused at field MAX_FIELDS + 1, not held until its end."""
    framing = RequestFraming()
    framing.feed(b"GET / HTTP/1.1\r\nHost: x\r\n")
    with pytest.raises(MalformedRequest, match="too many header fields"):
        framing.feed(b"a:\r\n" * (MAX_FIELDS + 1))  # no blank line
    # The first field over a limit names the fault: a long line before the count is over.
    long_first = b"X-Long: " + b"A" * MAX_LINE_BYTES + b"\r\n"
    with pytest.raises(MalformedRequest, match="over the size limit"):
        feed_all(b"GET / HTTP/1.1\r\nHost: x\r\n" + long_first + b"a:\r\n" * MAX_FIELDS)


def test_an_http11_request_without_host_is_refused() -> None:
    """RFC 9112 section 3.2: a server MUST answer 400 to an HTTP/1.1 request without Host."""
    with pytest.raises(MalformedRequest, match="without a Host"):
        feed_all(b"GET /v1/models HTTP/1.1\r\nAccept: */*\r\n\r\n")
    (old, *_) = feed_all(b"GET / HTTP/1.0\r\n\r\n")
    assert isinstance(old, RequestHead)


# -----------------------------------------------------------------------------
# Trailer fields of a chunked request body (proxy/_front.py, ``RequestFraming``).
#
# httptools buffers a field until its line ends, trailer fields after a chunked
# body's last chunk too; the head's limits did not apply there (the head was
# over). A client sending a never-ending trailer line made the proxy hold every
# byte of it, for as long as the body reader waited for the body's end (its idle
# timeout, 30 s by default: at loopback speed, gigabytes). Trailers are
# bounded like a head now; ordinary ones still pass.


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


def test_trailers_count_on_top_of_the_head_against_the_head_limit() -> None:
    """Trailer fields are one section with the head: a head and trailers that are each
    under MAX_HEAD_BYTES but over it together are refused, in one read too."""
    pad = b"".join(b"X-Pad-%d: %s\r\n" % (i, b"p" * 1000) for i in range(40))
    head = b"POST /v1/x HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n" + pad + b"\r\n"
    body = b"5\r\nhello\r\n0\r\n" + pad + b"\r\n"
    with pytest.raises(MalformedRequest, match="the request head is over the size limit"):
        RequestFraming().feed(head + body)
    # Either alone passes.
    (first, *_) = feed_all(head + b"0\r\n\r\n")
    assert isinstance(first, RequestHead)
    events = feed_all(CHUNKED + body)
    assert [len(e.fields) for e in events if isinstance(e, Trailers)] == [40]


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

"""The client side of proxy/_http1.py: its transition table, response framing, keep-alive
and deadlines, driven with bytes alone (no sockets, no event loop)."""

from __future__ import annotations

import pytest

from proxy._http1 import (
    CLIENT_KEEPALIVE_TIMEOUT,
    MAX_FIELDS,
    MAX_LINE_BYTES,
    MAX_RESPONSE_HEAD_BYTES,
    NEED_DATA,
    ClientConnection,
    ClientEvent,
    ClientState,
    EndOfMessage,
    Expiry,
    Fault,
    Request,
    ResponseHead,
    StateError,
    field_lines,
    keep_alive_timeout,
)


def asked(method: str = "GET", body_bytes: int = 0, **kwargs: float) -> ClientConnection:
    """A connection whose request head (and, without a body, end) is sent."""
    conn = ClientConnection(**kwargs)
    conn.send_head(Request(method, "/v1/x", [("Host", "up")]), body_bytes)
    return conn


def events(conn: ClientConnection, *pieces: bytes) -> list[ClientEvent]:
    """Feed ``pieces`` one by one and take every event (bounded: one per parsed item)."""
    found: list[ClientEvent] = []
    for piece in pieces:
        conn.receive_data(piece)
        for _ in range(len(piece) + 8):
            event = conn.next_event()
            if isinstance(event, (ResponseHead, bytes, EndOfMessage, Fault)):
                found.append(event)
            else:
                break
    return found


def body_of(found: list[ClientEvent]) -> bytes:
    return b"".join(e for e in found if isinstance(e, bytes))


def kinds(found: list[ClientEvent]) -> list[str]:
    return [type(e).__name__ for e in found]


# ------------------------------------------------------------------ the table


def test_a_second_request_head_before_the_first_ended_is_an_illegal_move() -> None:
    conn = asked("POST", 3)
    with pytest.raises(StateError):
        conn.send_head(Request("POST", "/", []))


def test_body_without_a_head_or_past_its_length_and_a_short_end_are_illegal() -> None:
    with pytest.raises(StateError):
        ClientConnection().send_body(1)
    conn = asked("POST", 3)
    conn.send_body(2)
    with pytest.raises(StateError):
        conn.send_end()  # 2 of 3 bytes
    with pytest.raises(StateError):
        conn.send_body(2)  # 4 of 3
    done = asked("GET")
    assert done.our_state is ClientState.DONE
    with pytest.raises(StateError):
        done.send_body(1)


def test_start_next_is_illegal_until_the_answer_ended_and_allows_reuse() -> None:
    conn = asked()
    with pytest.raises(StateError):
        conn.start_next(0.0)
    events(conn, b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\n{}")
    conn.start_next(0.0)
    assert (conn.our_state, conn.their_state) == (ClientState.IDLE, ClientState.IDLE)
    closing = asked()
    events(closing, b"HTTP/1.1 200 OK\r\nConnection: close\r\nContent-Length: 0\r\n\r\n")
    with pytest.raises(StateError):
        closing.start_next(0.0)


def test_an_abandoned_upload_is_never_reused() -> None:
    conn = asked("POST", 10)
    conn.send_body(4)
    found = events(conn, b"HTTP/1.1 413 Too Large\r\nContent-Length: 0\r\n\r\n")
    assert kinds(found) == ["ResponseHead", "EndOfMessage"]
    conn.abandon()
    assert conn.our_state is ClientState.MUST_CLOSE and not conn.reusable
    with pytest.raises(StateError):
        conn.start_next(0.0)


def test_the_head_bytes_and_the_field_check() -> None:
    conn = ClientConnection()
    head = Request("GET", "/a?b", [("Host", "h"), ("X", "é")])
    assert conn.send_head(head) == "GET /a?b HTTP/1.1\r\nHost: h\r\nX: é\r\n\r\n".encode()
    for bad in [("X", "a\r\nInjected: 1"), ("X\n", "a"), ("X", "a\rb")]:
        with pytest.raises(ValueError, match="CR or LF"):
            field_lines([bad], 1)
        with pytest.raises(ValueError, match="CR or LF"):
            Request("GET", "/", [bad])
    with pytest.raises(ValueError, match="CR or LF"):
        Request("GET", "/\r\nX: 1", [])


# ------------------------------------------------------------------ framing


def test_a_length_framed_answer_fed_byte_by_byte() -> None:
    wire = b"HTTP/1.1 200 OK\r\nContent-Length: 5\r\nX-Trace: a b\r\n\r\nhello"
    conn = asked()
    found = events(conn, *(wire[i : i + 1] for i in range(len(wire))))
    head = found[0]
    assert isinstance(head, ResponseHead) and head.status == 200 and not head.interim
    assert head.fields == [("Content-Length", "5"), ("X-Trace", "a b")]
    assert body_of(found) == b"hello" and kinds(found)[-1] == "EndOfMessage"
    assert conn.reusable


def test_body_pieces_parsed_between_two_takes_come_as_one_data_and_are_counted() -> None:
    conn = asked()
    conn.receive_data(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n")
    assert isinstance(conn.next_event(), ResponseHead)
    conn.receive_data(b"3\r\nabc\r\n")
    conn.receive_data(b"2\r\nde\r\n")
    assert conn.buffered_bytes == 5
    event = conn.next_event()
    assert event == b"abcde"
    assert conn.buffered_bytes == 0 and conn.next_event() is NEED_DATA


def test_a_chunked_answer_with_trailers_ends_with_them() -> None:
    conn = asked()
    found = events(
        conn,
        b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n4\r\ndata\r\n0\r\n",
        b"X-Usage: 7\r\n\r\n",
    )
    end = found[-1]
    assert isinstance(end, EndOfMessage) and end.trailers == [("X-Usage", "7")]
    assert body_of(found) == b"data" and conn.reusable


def test_interim_answers_come_before_the_final_one() -> None:
    conn = asked()
    found = events(
        conn,
        b"HTTP/1.1 100 Continue\r\n\r\nHTTP/1.1 103 Early Hints\r\nLink: </a>\r\n\r\n"
        b"HTTP/1.1 429 Too Many Requests\r\nRetry-After: 3\r\nContent-Length: 2\r\n\r\n{}",
    )
    heads = [(e.status, e.interim) for e in found if isinstance(e, ResponseHead)]
    assert heads == [(100, True), (103, True), (429, False)]
    assert conn.status == 429 and body_of(found) == b"{}"


def test_an_answer_without_framing_ends_when_the_upstream_closes() -> None:
    conn = asked()
    found = events(conn, b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\n\r\ndata: 1\n\n")
    assert kinds(found) == ["ResponseHead", "bytes"] and conn.until_close
    found = events(conn, b"")
    assert kinds(found) == ["EndOfMessage"] and conn.their_state is ClientState.CLOSED
    assert not conn.reusable


@pytest.mark.parametrize("status", [204, 304])
def test_bodiless_statuses_end_at_their_head_whatever_the_length_says(status: int) -> None:
    conn = asked()
    found = events(conn, b"HTTP/1.1 %d X\r\nContent-Length: 5\r\n\r\n" % status)
    assert kinds(found) == ["ResponseHead", "EndOfMessage"] and conn.reusable


def test_a_head_answer_ends_at_its_head_and_is_not_reused() -> None:
    conn = asked("HEAD")
    found = events(conn, b"HTTP/1.1 200 OK\r\nContent-Length: 5\r\n\r\n")
    assert kinds(found) == ["ResponseHead", "EndOfMessage"]
    assert not conn.reusable


def test_stray_bytes_after_a_204_leave_the_answer_whole_but_the_connection_unusable() -> None:
    conn = asked()
    found = events(conn, b"HTTP/1.1 204 No Content\r\n\r\nstray")
    assert kinds(found) == ["ResponseHead", "EndOfMessage", "Fault"]
    assert not conn.reusable and conn.their_state is ClientState.ERROR


@pytest.mark.parametrize(
    "after",
    [b"x", b"HTTP/1.1 200 OK\r\nContent-Length: 0\r\n\r\n"],
    ids=["garbage", "an-answer-nobody-asked-for"],
)
def test_bytes_after_a_complete_answer_are_a_fault(after: bytes) -> None:
    conn = asked()
    found = events(conn, b"HTTP/1.1 200 OK\r\nContent-Length: 1\r\n\r\na", after)
    assert kinds(found) == ["ResponseHead", "bytes", "EndOfMessage", "Fault"]
    fault = found[-1]
    assert isinstance(fault, Fault) and fault.words == "upstream sent bytes after its answer"


@pytest.mark.parametrize(
    ("wire", "words"),
    [
        (b"HTTP/1.1 200 OK\r\nContent-Le", "closed the connection before answering"),
        (b"HTTP/1.1 200 OK\r\nContent-Length: 9\r\n\r\nabc", "closed the connection mid-answer"),
        (b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n3\r\nabc\r\n", "mid-answer"),
    ],
    ids=["before-head", "short-length", "no-last-chunk"],
)
def test_a_close_before_the_framing_ends_is_a_fault(wire: bytes, words: str) -> None:
    conn = asked()
    found = events(conn, wire, b"")
    fault = found[-1]
    assert isinstance(fault, Fault) and fault.closed and words in fault.words
    assert "EndOfMessage" not in kinds(found)


@pytest.mark.parametrize(
    ("wire", "words"),
    [
        (
            b"HTTP/1.1 200 OK\r\nX-Big: " + b"t" * 20_000 + b"\r\n\r\n",
            f"limit ({MAX_LINE_BYTES} bytes a line)",
        ),
        (
            # Under the feed's bound for a growing line, over the limit once it is whole.
            b"HTTP/1.1 200 OK\r\nX-1: 1\r\nX-Big: " + b"t" * MAX_LINE_BYTES + b"\r\n\r\n",
            f"limit ({MAX_LINE_BYTES} bytes a line)",
        ),
        (
            b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n0\r\nX-Big: "
            + b"t" * MAX_LINE_BYTES
            + b"\r\n\r\n",
            f"limit ({MAX_LINE_BYTES} bytes a line)",
        ),
        (
            b"HTTP/1.1 200 OK\r\n"
            + b"".join(b"X-%d: 1\r\n" % i for i in range(MAX_FIELDS + 1))
            + b"\r\n",
            "limit (too many fields)",
        ),
        (
            # The first field over a limit names the fault: a long line before the count.
            b"HTTP/1.1 200 OK\r\nX-Big: "
            + b"t" * MAX_LINE_BYTES
            + b"\r\n"
            + b"".join(b"X-%d: 1\r\n" % i for i in range(MAX_FIELDS + 1))
            + b"\r\n",
            f"limit ({MAX_LINE_BYTES} bytes a line)",
        ),
        (b"NOT HTTP\r\n\r\n", "could not be parsed"),
        (b"HTTP/1.1 101 Switching Protocols\r\nUpgrade: x\r\n\r\n", "switched protocols"),
        (
            b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\nabc\r\n",
            "body framing is broken",
        ),
    ],
    ids=[
        "long-line",
        "line-just-over",
        "long-trailer-line",
        "many-fields",
        "long-line-first",
        "garbage",
        "upgrade",
        "bad-chunk",
    ],
)
def test_bad_heads_and_framing_are_faults_in_our_own_words(wire: bytes, words: str) -> None:
    conn = asked()
    found = events(conn, wire)
    fault = found[-1]
    assert isinstance(fault, Fault) and not fault.closed and words in fault.words
    assert "ttt" not in fault.words  # never the upstream's bytes
    # Nothing is parsed after a fault.
    assert events(conn, b"HTTP/1.1 200 OK\r\nContent-Length: 0\r\n\r\n") == []


def test_a_header_line_that_never_ends_is_refused_within_a_few_lines_worth() -> None:
    conn = asked()
    conn.receive_data(b"HTTP/1.1 200 OK\r\nX-Slow: ")
    fed = 0
    while not conn.has_events and fed <= 2 * MAX_RESPONSE_HEAD_BYTES:  # bounded
        conn.receive_data(b"t" * 1024)
        fed += 1024
    fault = conn.next_event()
    assert isinstance(fault, Fault) and "bytes a line" in fault.words
    assert fed <= 2 * MAX_LINE_BYTES + 1024


def test_a_head_of_many_short_lines_is_refused_at_the_head_limit() -> None:
    conn = asked()
    conn.receive_data(b"HTTP/1.1 200 OK\r\n")
    fed = 0
    line = b"X-A: " + b"v" * 1000 + b"\r\n"
    while not conn.has_events and fed <= 2 * MAX_RESPONSE_HEAD_BYTES:  # bounded
        conn.receive_data(line)
        fed += len(line)
    fault = conn.next_event()
    assert isinstance(fault, Fault) and "limit" in fault.words


# ------------------------------------------------------------------ keep-alive


@pytest.mark.parametrize(
    ("wire", "reusable"),
    [
        (b"HTTP/1.1 200 OK\r\nContent-Length: 0\r\n\r\n", True),
        (b"HTTP/1.1 200 OK\r\nConnection: close\r\nContent-Length: 0\r\n\r\n", False),
        (b"HTTP/1.0 200 OK\r\nContent-Length: 0\r\n\r\n", False),
        (b"HTTP/1.0 200 OK\r\nConnection: keep-alive\r\nContent-Length: 0\r\n\r\n", True),
        (b"HTTP/1.1 200 OK\r\nKeep-Alive: timeout=1\r\nContent-Length: 0\r\n\r\n", False),
    ],
    ids=["1.1", "close", "1.0", "1.0-keep-alive", "keep-alive-1s"],
)
def test_reuse_follows_the_answer_s_version_and_fields(wire: bytes, reusable: bool) -> None:
    conn = asked()
    events(conn, wire)
    assert conn.their_state is ClientState.DONE and conn.reusable is reusable


def test_our_own_connection_close_rules_out_reuse() -> None:
    conn = ClientConnection()
    conn.send_head(Request("GET", "/", [("Connection", "close")], close=True))
    events(conn, b"HTTP/1.1 200 OK\r\nContent-Length: 0\r\n\r\n")
    assert not conn.reusable


def test_body_bytes_not_taken_rule_out_reuse_an_end_not_taken_does_not() -> None:
    conn = asked()
    conn.receive_data(b"HTTP/1.1 200 OK\r\nContent-Length: 1\r\n\r\na")
    assert conn.ended and not conn.reusable  # the byte is still queued
    assert isinstance(conn.next_event(), ResponseHead)
    assert conn.next_event() == b"a"
    assert conn.reusable  # the end is queued, not taken: nothing unread is lost
    conn.start_next(0.0)
    assert conn.next_event() is NEED_DATA and not conn.ended


@pytest.mark.parametrize(
    ("value", "seconds"),
    [
        ("timeout=5", 4.0),
        ('timeout="5"', 4.0),
        ('timeout="5", max=100', 4.0),
        ("max=3, timeout=60", CLIENT_KEEPALIVE_TIMEOUT),
        ("timeout=0", 0.0),
        ("timeout=abc", CLIENT_KEEPALIVE_TIMEOUT),
        ("max=3", CLIENT_KEEPALIVE_TIMEOUT),
    ],
)
def test_the_keep_alive_timeout_is_a_second_less_than_the_upstream_s(
    value: str, seconds: float
) -> None:
    assert keep_alive_timeout(value) == seconds
    conn = asked()
    events(conn, b"HTTP/1.1 200 OK\r\nKeep-Alive: %s\r\nContent-Length: 0\r\n\r\n" % value.encode())
    assert conn.keep_alive_s == seconds


def test_of_a_framing_field_named_twice_the_last_counts_whatever_its_case() -> None:
    conn = asked()
    events(
        conn,
        b"HTTP/1.1 200 OK\r\nKeep-Alive: timeout=10\r\nX-A: 1\r\nkeep-ALIVE: timeout=4\r\n"
        b"Content-Length: 0\r\n\r\n",
    )
    assert conn.keep_alive_s == 3.0
    conn = asked()
    found = events(
        conn, b"HTTP/1.1 200 OK\r\ntransfer-encoding: CHUNKED\r\n\r\n4\r\ndata\r\n0\r\n\r\n"
    )
    assert body_of(found) == b"data" and isinstance(found[-1], EndOfMessage) and conn.reusable


# ------------------------------------------------------------------ deadlines


def test_an_idle_kept_connection_expires_after_its_keep_alive_time() -> None:
    conn = asked()
    events(conn, b"HTTP/1.1 200 OK\r\nKeep-Alive: timeout=5\r\nContent-Length: 0\r\n\r\n")
    assert conn.next_deadline() is None
    conn.start_next(100.0)
    assert conn.next_deadline() == 104.0
    assert conn.expired(103.9) is None
    assert conn.expired(104.0) is Expiry.IDLE
    # A request clears the clock, and its answer says its own keep-alive time.
    conn.send_head(Request("GET", "/", []))
    assert conn.next_deadline() is None and conn.keep_alive_s == CLIENT_KEEPALIVE_TIMEOUT


def test_a_waiting_reader_expires_after_idle_read_unless_bytes_came() -> None:
    conn = asked(idle_read_s=30.0)
    events(conn, b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n")
    conn.reader_waits(10.0)
    conn.reader_waits(20.0)  # the first wait's start stands
    assert conn.next_deadline() == 40.0
    conn.receive_data(b"1\r\na\r\n")
    assert conn.next_deadline() is None  # the reader has its bytes
    assert conn.expired(1000.0) is None
    conn.next_event()
    conn.reader_waits(50.0)
    assert conn.expired(79.0) is None
    assert conn.expired(80.0) is Expiry.READ
    assert conn.next_deadline() is None  # reported once


def test_the_head_deadline_holds_until_the_head_came_and_the_body_went_out() -> None:
    # In time: the final head lifts it (an interim one does not).
    conn = ClientConnection()
    conn.send_head(Request("GET", "/", []), head_due=10.0)
    assert conn.next_deadline() == 10.0
    events(conn, b"HTTP/1.1 100 Continue\r\n\r\n")
    assert conn.next_deadline() == 10.0
    events(conn, b"HTTP/1.1 200 OK\r\nContent-Length: 0\r\n\r\n")
    assert conn.next_deadline() is None and conn.expired(99.0) is None and not conn.late
    # A head during the upload leaves it until the body's end (a server that answers,
    # then stops reading, would hold the upload forever).
    conn = ClientConnection()
    conn.send_head(Request("POST", "/", []), 4, head_due=10.0)
    events(conn, b"HTTP/1.1 200 OK\r\nContent-Length: 0\r\n\r\n")
    assert conn.next_deadline() == 10.0
    conn.send_body(4)
    conn.send_end()
    assert conn.next_deadline() is None
    # Late: reported once, the connection is unusable and says why in our words.
    conn = ClientConnection()
    conn.send_head(Request("GET", "/", []), head_due=10.0)
    events(conn, b"HTTP/1.1 200 OK\r\n")  # half a head
    assert conn.expired(9.9) is None
    assert conn.expired(10.0) is Expiry.HEAD
    assert conn.late and conn.their_state is ClientState.ERROR
    fault = conn.next_event()
    assert isinstance(fault, Fault) and fault.words == "upstream sent no response headers in time"
    assert conn.next_deadline() is None and conn.expired(99.0) is None
    events(conn, b"Content-Length: 0\r\n\r\n")  # too late: nothing more is parsed
    assert conn.next_event() is NEED_DATA and not conn.reusable

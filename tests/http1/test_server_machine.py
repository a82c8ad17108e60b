"""The server side's connection state machine, without sockets (proxy/_http1.py).

Every decision the driver used to take from flags is the machine's now: the
transition table (an illegal move raises), keep-alive and ``Connection: close``,
the answer's framing, ``100 Continue``, pipelining and its pause, the linger
after an early answer, upgrades, the 400 after pipelined requests, the one deadline.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable

import pytest
from multidict import CIMultiDict

from proxy._http1 import (
    END,
    LINGER_TIMEOUT,
    NEED_DATA,
    PAUSED,
    QUEUED_MAX,
    SERVER_TRANSITIONS,
    After,
    BadRequest,
    InformationalResponse,
    RequestHead,
    Response,
    ServerConnection,
    ServerEvent,
    ServerState,
    StateError,
    Trailers,
    field_lines,
)

S = ServerState
HEADER_TIMEOUT = 30.0
KEEPALIVE = 75.0


class Clock:
    """A clock the test moves by hand (seconds)."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def machine(clock: Callable[[], float] | None = None, **kwargs: object) -> ServerConnection:
    return ServerConnection(
        clock or Clock(),
        header_timeout=HEADER_TIMEOUT,
        keepalive_timeout=KEEPALIVE,
        **kwargs,  # type: ignore[arg-type]
    )


def drain(conn: ServerConnection, limit: int = 1000) -> list[ServerEvent]:
    """Every event up to NEED_DATA or PAUSED (which ends the list)."""
    events: list[ServerEvent] = []
    for _ in range(limit):
        event = conn.next_event()
        events.append(event)
        if event is NEED_DATA or event is PAUSED:
            return events
    raise AssertionError("no NEED_DATA or PAUSED within the limit")


def get(path: str = "/", *, version: str = "1.1", extra: str = "") -> bytes:
    return f"GET {path} HTTP/{version}\r\nHost: x\r\n{extra}\r\n".encode()


def post(body: bytes, *, extra: str = "") -> bytes:
    return (
        f"POST /v1 HTTP/1.1\r\nHost: x\r\nContent-Length: {len(body)}\r\n{extra}\r\n".encode()
        + body
    )


def answer(conn: ServerConnection, body: bytes = b"ok", *, length: bool = True) -> bytes:
    """A whole answer's bytes, sent through the machine."""
    headers = CIMultiDict({"Content-Type": "text/plain"})
    out = conn.send(Response(200, headers, length=len(body) if length else None))
    out += conn.send(body) + conn.send(END)
    return out


def heads(events: list[ServerEvent]) -> list[RequestHead]:
    return [e for e in events if isinstance(e, RequestHead)]


# ---------------------------------------------------------------------- the table


def reach(state: ServerState) -> ServerConnection:
    """A machine brought to ``state`` through its public moves only."""
    clock = Clock()
    conn = machine(clock)
    if state is S.IDLE:
        return conn
    if state is S.IN_HEAD:
        conn.receive_data(b"GET / HT")
        drain(conn)
        return conn
    if state is S.CLOSED:
        conn.connection_lost()
        return conn
    if state is S.CLOSING:
        conn.receive_data(b"NOT HTTP\r\n\r\n")
        drain(conn)
        return conn
    if state is S.LINGERING:
        conn.receive_data(post(b"x" * 100)[:-50])
        drain(conn)
        answer(conn)
        conn.finish_answer()
        return conn
    conn.receive_data(get())
    drain(conn)
    if state is S.RESPONSE:
        return conn
    conn.send(Response(200, CIMultiDict(), length=2))
    if state is S.SEND_BODY:
        return conn
    conn.send(END)
    assert state is S.DONE
    return conn


@pytest.mark.parametrize("state", list(ServerState))
def test_every_state_is_reachable_by_public_moves(state: ServerState) -> None:
    assert reach(state).state is state


def moves() -> dict[str, Callable[[ServerConnection], object]]:
    headers: CIMultiDict[str] = CIMultiDict()
    return {
        "send Response": lambda c: c.send(Response(200, headers, length=0)),
        "send 100 Continue": lambda c: c.send(InformationalResponse()),
        "send body bytes": lambda c: c.send(b"x"),
        "send END": lambda c: c.send(END),
        "finish_answer": lambda c: c.finish_answer(),
        "connection_lost": lambda c: c.connection_lost(),
        "receive_data": lambda c: c.receive_data(b"\r\n"),
    }


# Where each public move is legal; everywhere else it raises StateError.
LEGAL: dict[str, set[ServerState]] = {
    "send Response": {S.RESPONSE},
    "send 100 Continue": {S.RESPONSE},
    "send body bytes": {S.SEND_BODY},
    "send END": {S.SEND_BODY},
    "finish_answer": {S.RESPONSE, S.SEND_BODY, S.DONE},
    "connection_lost": set(ServerState) - {S.CLOSED},
    "receive_data": set(ServerState) - {S.CLOSED},
}


@pytest.mark.parametrize(
    ("state", "move"), list(itertools.product(list(ServerState), sorted(LEGAL)))
)
def test_a_move_is_legal_only_where_the_table_allows_it(state: ServerState, move: str) -> None:
    conn = reach(state)
    if state in LEGAL[move]:
        moves()[move](conn)
        # Whatever it moved to is one of the table's next states.
        assert conn.state is state or conn.state in SERVER_TRANSITIONS[state]
    else:
        with pytest.raises(StateError):
            moves()[move](conn)
        assert conn.state is state  # an illegal move changes nothing


def test_the_table_covers_every_state_and_closed_is_final() -> None:
    assert set(SERVER_TRANSITIONS) == set(ServerState)
    assert SERVER_TRANSITIONS[S.CLOSED] == frozenset()
    for state, nexts in SERVER_TRANSITIONS.items():
        assert state is S.CLOSED or S.CLOSED in nexts  # the client may leave at any time
        # Lingering and closing never go back to reading requests.
        if state in (S.LINGERING, S.CLOSING):
            assert nexts <= {S.CLOSING, S.CLOSED}


# ---------------------------------------------------------------------- keep-alive


def test_a_kept_request_is_answered_without_close_and_the_connection_waits() -> None:
    conn = machine()
    conn.receive_data(get())
    assert [type(e) for e in drain(conn)] == [RequestHead, type(END), type(NEED_DATA)]
    assert conn.state is S.RESPONSE
    out = answer(conn)
    assert out.startswith(b"HTTP/1.1 200 OK\r\n") and b"Connection: close" not in out
    assert b"Content-Length: 2\r\n" in out and out.endswith(b"\r\n\r\nok")
    assert conn.finish_answer() is After.WAIT and conn.state is S.IDLE


@pytest.mark.parametrize(
    ("request_bytes", "why"),
    [
        (get(extra="Connection: close\r\n"), "Connection: close"),
        (get(version="1.0"), "HTTP/1.0"),
        (get(version="1.0", extra="Connection: keep-alive\r\n"), "HTTP/1.0 keep-alive ignored"),
        (get(extra="Connection: upgrade\r\nUpgrade: websocket\r\n"), "an upgrade"),
    ],
)
def test_the_answer_says_close_and_the_connection_closes(request_bytes: bytes, why: str) -> None:
    conn = machine()
    conn.receive_data(request_bytes)
    drain(conn)
    assert conn.will_close(), why
    assert b"Connection: close\r\n" in answer(conn), why
    assert conn.finish_answer() is After.CLOSE and conn.state is S.CLOSING


def test_close_after_answer_and_one_answer_connections_close() -> None:
    conn = machine()
    conn.receive_data(get())
    drain(conn)
    conn.close_after_answer()
    assert b"Connection: close\r\n" in answer(conn)
    assert conn.finish_answer() is After.CLOSE
    shed = machine(one_answer=True)
    shed.receive_data(get())
    drain(shed)
    assert b"Connection: close\r\n" in answer(shed)
    assert shed.finish_answer() is After.CLOSE


# ---------------------------------------------------------------------- framing of answers


def test_an_unknown_length_is_chunked_to_http11_and_close_delimited_to_http10() -> None:
    conn = machine()
    conn.receive_data(get())
    drain(conn)
    out = answer(conn, b"hello", length=False)
    assert b"Transfer-Encoding: chunked\r\n" in out
    assert out.endswith(b"\r\n\r\n5\r\nhello\r\n0\r\n\r\n")
    old = machine()
    old.receive_data(get(version="1.0"))
    drain(old)
    out = answer(old, b"hello", length=False)
    assert b"Transfer-Encoding" not in out and b"Content-Length" not in out
    assert out.endswith(b"\r\n\r\nhello") and b"Connection: close\r\n" in out
    assert old.finish_answer() is After.CLOSE


def test_an_empty_piece_is_never_the_chunked_end() -> None:
    conn = machine()
    conn.receive_data(get())
    drain(conn)
    conn.send(Response(200, CIMultiDict()))
    assert conn.send(b"") == b""
    assert conn.send(b"ab") == b"2\r\nab\r\n"


@pytest.mark.parametrize("status", [100, 204, 304])
def test_bodiless_statuses_get_no_framing_and_no_body(status: int) -> None:
    conn = machine()
    conn.receive_data(get())
    drain(conn)
    out = conn.send(Response(status, CIMultiDict(), length=5))
    assert b"Content-Length" not in out and b"Transfer-Encoding" not in out
    assert conn.send(b"stray") == b"" and conn.send(END) == b""


def test_a_head_request_states_a_known_length_and_gets_no_body() -> None:
    conn = machine()
    conn.receive_data(b"HEAD / HTTP/1.1\r\nHost: x\r\n\r\n")
    drain(conn)
    out = conn.send(Response(200, CIMultiDict(), length=7))
    assert b"Content-Length: 7\r\n" in out
    assert conn.send(b"1234567") == b"" and conn.send(END) == b""
    conn.finish_answer()
    conn.receive_data(b"HEAD / HTTP/1.1\r\nHost: x\r\n\r\n")
    drain(conn)
    out = conn.send(Response(200, CIMultiDict()))  # length unknown: no framing field
    assert b"Content-Length" not in out and b"Transfer-Encoding" not in out
    assert conn.send(b"x") == b"" and conn.send(END) == b""


def test_a_field_with_a_line_break_is_refused_and_the_answer_may_still_be_sent() -> None:
    conn = machine()
    conn.receive_data(get())
    drain(conn)
    with pytest.raises(ValueError, match="CR or LF"):
        conn.send(Response(200, CIMultiDict({"X-Evil": "a\r\nSet-Cookie: b"})))
    assert conn.state is S.RESPONSE
    assert conn.send(Response(500, CIMultiDict(), length=0)).startswith(b"HTTP/1.1 500 ")


def test_field_lines_is_the_one_check_for_both_sides() -> None:
    assert field_lines([("A", "b"), ("C", "d\udcff")], 2) == b"A: b\r\nC: d\xff\r\n"
    for name, value in [("A\r", "b"), ("A", "b\n"), ("A", "\rb")]:
        with pytest.raises(ValueError):
            field_lines([(name, value)], 1)


# ---------------------------------------------------------------------- Expect: 100-continue


def test_100_continue_goes_to_http11_clients_only() -> None:
    conn = machine()
    conn.receive_data(post(b"", extra="Expect: 100-continue\r\n")[: -0 or None])
    events = drain(conn)
    assert heads(events)[0].headers["Expect"] == "100-continue"
    assert conn.send(InformationalResponse()) == b"HTTP/1.1 100 Continue\r\n\r\n"
    old = machine()
    old.receive_data(b"POST / HTTP/1.0\r\nContent-Length: 3\r\nExpect: 100-continue\r\n\r\n")
    drain(old)
    # RFC 9110 §10.1.1: a server MUST NOT send a 100 to an HTTP/1.0 client.
    assert old.send(InformationalResponse()) == b""


def test_an_answer_before_the_body_says_close_and_lingers_on_the_rest() -> None:
    clock = Clock()
    conn = machine(clock)
    conn.receive_data(post(b"x" * 1000, extra="Expect: 100-continue\r\n")[:-1000])
    drain(conn)
    assert b"Connection: close\r\n" in answer(conn, b"no")  # the body's rest is not a request
    clock.now += 1
    assert conn.finish_answer() is After.LINGER and conn.state is S.LINGERING
    assert conn.next_deadline() == clock.now + LINGER_TIMEOUT
    conn.receive_data(b"x" * 1000 + get())  # dropped: neither body nor a next request
    assert drain(conn) == [NEED_DATA]


# ---------------------------------------------------------------------- pipelining


def test_pipelined_requests_wait_in_order_and_parsing_pauses_behind_the_queue() -> None:
    conn = machine()
    many = b"".join(get(f"/{i}") for i in range(QUEUED_MAX + 4))
    conn.receive_data(many)
    events = drain(conn)
    # One slice of 16 KiB holds them all: parsed, then the machine pauses.
    assert [h.path for h in heads(events)] == [f"/{i}" for i in range(QUEUED_MAX + 4)]
    assert events[-1] is PAUSED
    for i in range(QUEUED_MAX + 4):
        assert conn.current is not None and conn.current.path == f"/{i}"
        answer(conn)
        expected = After.NEXT if i < QUEUED_MAX + 3 else After.WAIT
        assert conn.finish_answer() is expected
    assert conn.state is S.IDLE


def test_bytes_received_while_paused_wait_unparsed_and_are_parsed_after_an_answer() -> None:
    conn = machine(slice_bytes=64)
    requests = [get(f"/{i}") for i in range(QUEUED_MAX + 6)]
    conn.receive_data(b"".join(requests))
    taken = heads(drain(conn))
    # Parsed a slice (a request or two) at a time: stopped behind the full queue.
    assert QUEUED_MAX + 1 <= len(taken) < len(requests)
    assert conn.next_event() is PAUSED
    conn.receive_data(get("/late"))  # a read already under way
    paths = [h.path for h in taken]
    for _ in range(20):  # bounded: one answer per request
        if conn.current is None:
            break
        answer(conn)
        conn.finish_answer()
        paths += [h.path for h in heads(drain(conn))]
    assert paths == [f"/{i}" for i in range(QUEUED_MAX + 6)] + ["/late"]


def test_a_bad_request_after_pipelined_ones_is_refused_after_their_answers() -> None:
    conn = machine()
    conn.receive_data(get("/a") + get("/b") + b"BAD\x00 / HTTP/1.1\r\n\r\n")
    events = drain(conn)
    assert [h.path for h in heads(events)] == ["/a", "/b"]
    assert isinstance(events[-2], BadRequest) and events[-1] is NEED_DATA
    assert conn.state is S.RESPONSE
    answer(conn)
    assert conn.finish_answer() is After.NEXT
    answer(conn)
    assert conn.finish_answer() is After.REFUSE and conn.state is S.CLOSING
    conn.receive_data(get())  # nothing after the fault is parsed
    assert drain(conn) == [NEED_DATA]


def test_a_bad_request_alone_closes_at_once() -> None:
    conn = machine()
    conn.receive_data(b"GET / HTTP/1.1\r\n\r\n")  # no Host (RFC 9112 §3.2)
    events = drain(conn)
    assert isinstance(events[0], BadRequest) and "Host" in events[0].words
    assert conn.state is S.CLOSING


def test_a_fault_inside_the_body_being_answered_closes_without_a_400() -> None:
    conn = machine()
    conn.receive_data(
        b"POST / HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n3\r\nabc\r\nzz\r\n"
    )
    events = drain(conn)
    assert b"abc" in events and isinstance(events[-2], BadRequest)
    assert b"Connection: close" in answer(conn)
    assert conn.finish_answer() is After.CLOSE


def test_trailers_are_an_event_before_the_end() -> None:
    conn = machine()
    conn.receive_data(
        b"POST / HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n"
        b"2\r\nhi\r\n0\r\nX-Sum: 1\r\n\r\n"
    )
    events = drain(conn)
    trailers = [e for e in events if isinstance(e, Trailers)]
    assert [t.fields for t in trailers] == [[("X-Sum", "1")]]
    assert events.index(trailers[0]) == events.index(END) - 1


def test_an_upgrade_is_answered_as_a_plain_request_then_closes() -> None:
    conn = machine()
    conn.receive_data(get(extra="Connection: upgrade\r\nUpgrade: websocket\r\n") + b"\x81\x05hello")
    events = drain(conn)
    assert len(heads(events)) == 1 and not [e for e in events if isinstance(e, BadRequest)]
    assert conn.will_close()


# ---------------------------------------------------------------------- the deadline


def test_the_one_deadline_follows_the_state() -> None:
    clock = Clock()
    conn = machine(clock)
    assert conn.next_deadline() == clock.now + KEEPALIVE  # idle from the start
    clock.now += 5
    conn.receive_data(b"GET / HTTP/1.1\r\n")
    drain(conn)
    assert conn.state is S.IN_HEAD
    assert conn.next_deadline() == clock.now + HEADER_TIMEOUT
    started = clock.now
    clock.now += 5
    conn.receive_data(b"X-A: b\r\n")  # later pieces do not push the header clock back
    drain(conn)
    assert conn.next_deadline() == started + HEADER_TIMEOUT
    conn.receive_data(b"Host: x\r\n\r\n")
    drain(conn)
    assert conn.next_deadline() is None  # answering: the handler has its own deadlines
    answer(conn)
    clock.now += 7
    conn.finish_answer()
    assert conn.next_deadline() == clock.now + KEEPALIVE


def test_a_head_begun_behind_an_answer_starts_its_clock_when_the_answer_ends() -> None:
    clock = Clock()
    conn = machine(clock)
    conn.receive_data(get() + b"GET /next HT")
    drain(conn)
    assert conn.next_deadline() is None
    clock.now += 3
    answer(conn)
    assert conn.finish_answer() is After.WAIT and conn.state is S.IN_HEAD
    assert conn.next_deadline() == clock.now + HEADER_TIMEOUT


def test_a_head_that_arrives_whole_reads_no_clock() -> None:
    reads: list[float] = []

    def clock() -> float:
        reads.append(0.0)
        return 0.0

    conn = machine(clock)
    reads.clear()
    conn.receive_data(post(b"abc"))
    drain(conn)
    answer(conn)
    assert reads == []  # the request cycle itself is free of clock reads
    conn.finish_answer()
    assert len(reads) == 1  # the keep-alive clock starts once

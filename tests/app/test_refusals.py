"""The table from errors to answers (proxy/_refusals.py), and the app answering from it.

No sockets: the table is data, and the app's answer to an error is built from a
request head and an app state alone.
"""

from __future__ import annotations

import asyncio
import json

import pytest
from multidict import CIMultiDict, CIMultiDictProxy

from proxy._app import _refuse
from proxy._body import BodyBusy, BodyError, BodyIncomplete, BodyMemory, BodyTimeout, BodyTooLarge
from proxy._coding import BodyEncodingError
from proxy._config import Settings
from proxy._exchange import Exchange
from proxy._front import Request
from proxy._http1 import RequestHead
from proxy._phases import Phase
from proxy._plugins import Outcome, PluginHost
from proxy._protocols import Protocol
from proxy._refusals import (
    ANSWERS,
    CommitBacklog,
    Draining,
    Effect,
    SessionRequired,
    Shed,
    resolve,
    rule_for,
)
from proxy._sessions import SessionClosed
from proxy._spool import SpoolBusy, SpoolFull, SpoolNoDescriptor
from proxy._state import AppState
from proxy._wire import WireError

# error -> (status, code, outcome, close, cut, effect): what a client and the books see.
CASES: list[tuple[BaseException, tuple[int, str, Outcome, bool, bool, Effect]]] = [
    (Draining(), (503, "proxy_shutdown", Outcome.REJECTED, False, False, Effect.NONE)),
    (Shed(), (503, "fd_reserve", Outcome.REJECTED, True, False, Effect.FD_EXHAUSTED)),
    (SessionRequired(), (400, "session_required", Outcome.REJECTED, False, False, Effect.NONE)),
    (CommitBacklog(2), (503, "commit_backlog", Outcome.REJECTED, False, False, Effect.NONE)),
    (
        SessionClosed("s-1", 2.5),
        (503, "session_closed", Outcome.REJECTED, False, False, Effect.NONE),
    ),
    (
        WireError("body is not JSON"),
        (400, "invalid_json", Outcome.REJECTED, False, False, Effect.NONE),
    ),
    (
        BodyIncomplete(),
        (400, "incomplete", Outcome.REJECTED, True, False, Effect.GONE_MID_BODY),
    ),
    (BodyTooLarge(1024), (413, "too_large", Outcome.REJECTED, True, False, Effect.NONE)),
    (
        BodyEncodingError.unsupported("snappy"),
        (415, "unsupported_encoding", Outcome.REJECTED, True, False, Effect.NONE),
    ),
    (BodyTimeout(5.0), (408, "timeout", Outcome.REJECTED, True, False, Effect.NONE)),
    (BodyBusy(), (503, "busy", Outcome.REJECTED, True, False, Effect.NONE)),
    (SpoolBusy(), (503, "spool_busy", Outcome.REJECTED, True, False, Effect.NONE)),
    (SpoolFull(), (503, "spool_full", Outcome.REJECTED, True, False, Effect.SPOOL_FULL)),
    (
        SpoolNoDescriptor(),
        (503, "fd_reserve", Outcome.REJECTED, True, False, Effect.FD_EXHAUSTED),
    ),
    (BodyMemory(), (503, "memory", Outcome.REJECTED, True, False, Effect.MEMORY)),
    (MemoryError(), (503, "memory", Outcome.ERROR, True, True, Effect.MEMORY)),
    (KeyError("x"), (500, "internal_error", Outcome.ERROR, True, True, Effect.INTERNAL)),
]


@pytest.mark.parametrize(("error", "expected"), CASES, ids=lambda c: type(c).__name__)
def test_each_error_has_its_answer(
    error: BaseException, expected: tuple[int, str, Outcome, bool, bool, Effect]
) -> None:
    refusal = resolve(error, "ex-1")
    rule = refusal.rule
    got = (refusal.status, refusal.code, rule.outcome, rule.close, rule.cut, rule.effect)
    assert got == expected


def test_messages_are_the_errors_own_or_the_rows_never_an_internal_errors_text() -> None:
    too_large = resolve(BodyTooLarge(1024), "ex-1")
    assert too_large.message == "request body exceeds the limit of 1024 bytes"
    assert resolve(WireError("body is not JSON"), "ex-1").message == "body is not JSON"
    assert resolve(Draining(), "ex-1").message == "proxy shutting down"
    # The session id is not echoed: the row's fixed message is.
    assert resolve(SessionClosed("secret-sid", 1.0), "ex-1").message == "session closed"
    internal = resolve(RuntimeError("Authorization: Bearer sk-secret"), "ex-9")
    assert internal.message == "internal proxy error (exchange ex-9)"
    assert resolve(CommitBacklog(1), "ex-1").message.endswith("(1 pending commit)")
    assert resolve(CommitBacklog(3), "ex-1").message.endswith("(3 pending commits)")


def test_a_closed_sessions_retry_after_is_its_tombstones_remaining_ttl_rounded_up() -> None:
    assert resolve(SessionClosed("s", 2.1), "ex-1").retry_after == "3"
    # Every other 503 leaves Retry-After to the setting.
    assert resolve(BodyBusy(), "ex-1").retry_after is None


def test_an_error_without_a_row_answers_as_its_closest_listed_base() -> None:
    class Cut(BodyIncomplete):
        pass

    class Odd(BodyError):
        status = 422
        kind = "odd"

    assert rule_for(Cut()) is ANSWERS[BodyIncomplete]
    assert rule_for(BodyTooLarge(10)) is ANSWERS[BodyError]
    assert (resolve(Odd("odd body"), "ex-1").status, resolve(Odd("x"), "ex-1").code) == (422, "odd")
    assert rule_for(ZeroDivisionError()) is ANSWERS[Exception]


def test_a_cancel_is_control_flow_not_an_error_to_answer() -> None:
    with pytest.raises(KeyError):
        rule_for(asyncio.CancelledError())


def test_only_body_errors_may_leave_status_and_code_to_the_error() -> None:
    for cls, rule in ANSWERS.items():
        if rule.status is None or rule.code is None:
            assert issubclass(cls, BodyError), cls


# ------------------------------------------------------------ the app answers from it


def _request(path: str = "/v1/messages") -> Request:
    headers = CIMultiDictProxy(CIMultiDict({"Content-Type": "application/json"}))
    return Request(RequestHead("POST", path, headers, (1, 1), True, 10, False), None)


def _state() -> AppState:
    return AppState(Settings(retry_after=7), PluginHost([], timeout=1.0))


def _exchange(protocol: Protocol = Protocol.MESSAGES) -> Exchange:
    return Exchange(protocol=protocol, method="POST", path="/v1/messages")


def _raised(error: Exception) -> Exception:
    """``error`` with the traceback it has in the app (it was raised there)."""
    try:
        raise error
    except Exception as caught:
        return caught


def test_the_app_answers_a_refusal_in_the_clients_shape_and_books_it() -> None:
    state, ex = _state(), _exchange()
    answer = _refuse(_request(), state, ex, SpoolFull())
    assert (answer.status, answer.close, answer.headers["Retry-After"]) == (503, True, "7")
    body = json.loads(answer.body)
    assert body["type"] == "error" and body["error"]["message"] == SpoolFull().message
    assert (ex.status, ex.outcome, ex.error) == (503, Outcome.REJECTED, "spool_full")
    assert state.metrics.spool_full.value() == 1


def test_the_app_runs_each_rows_effect() -> None:
    state = _state()
    ex = _exchange(Protocol.CHAT)
    _refuse(_request("/v1/chat/completions"), state, ex, BodyIncomplete())
    # A hang-up mid-body is booked as the client's doing, not a refusal.
    assert (ex.status, ex.outcome, ex.error) == (400, Outcome.CLIENT_GONE, "incomplete")
    assert state.metrics.disconnects.value("reading") == 1
    ex = _exchange(Protocol.CHAT)
    answer = _refuse(_request("/v1/chat/completions"), state, ex, _raised(ValueError("boom")))
    assert answer.status == 500 and "Retry-After" not in answer.headers
    assert json.loads(answer.body)["error"]["code"] == "internal_error"
    assert state.metrics.internal_errors.value(str(Protocol.CHAT)) == 1
    _refuse(_request(), state, _exchange(), MemoryError())
    assert state.metrics.memory_refused.value() == 1


def test_an_answer_already_begun_is_cut_not_spliced() -> None:
    state, ex = _state(), _exchange()
    ex.mark_sent()
    ex.accept()
    ex.mark_streaming()
    assert ex.phase is Phase.STREAMING
    answer = _refuse(_request(), state, ex, _raised(RuntimeError("late bug")))
    assert (answer.status, answer.body, answer.close) == (500, b"", True)
    assert (ex.status, ex.outcome) == (500, Outcome.ERROR)

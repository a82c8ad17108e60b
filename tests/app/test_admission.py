"""Admission before a body is read (proxy/_admission.py), without sockets.

One function decides what goes out instead of ``100 Continue`` and what a client
that did not ask for one is refused before its upload: a drain, the descriptor
reserve, the declared size and coding, and the budgets for bodies in flight.
"""

from __future__ import annotations

import asyncio
import pathlib

import pytest
from multidict import CIMultiDict, CIMultiDictProxy

from proxy._admission import BodyAdmission, ReadingAccount, admit, admit_session
from proxy._body import BodyBusy, BodyError
from proxy._config import Settings
from proxy._exchange import Exchange
from proxy._http1 import RequestHead
from proxy._plugins import PluginHost
from proxy._protocols import Protocol
from proxy._refusals import CommitBacklog, Draining, SessionRequired, Shed
from proxy._spool import SpoolBusy
from proxy._state import AppState

KIB = 1024
MIB = 1024 * KIB


def _state(tmp_path: pathlib.Path, **settings: object) -> AppState:
    base: dict[str, object] = {"spool_dir": str(tmp_path)}
    return AppState(Settings(**{**base, **settings}), PluginHost([], timeout=1.0))  # type: ignore[arg-type]


def _head(
    method: str = "POST",
    content_length: int | None = 100,
    *,
    chunked: bool = False,
    coding: str | None = None,
) -> RequestHead:
    fields = CIMultiDict({"Content-Type": "application/json"})
    if coding is not None:
        fields["Content-Encoding"] = coding
    return RequestHead(
        method, "/v1/messages", CIMultiDictProxy(fields), (1, 1), True, content_length, chunked
    )


def test_a_plain_body_is_admitted_with_its_declared_size(tmp_path: pathlib.Path) -> None:
    assert admit(_state(tmp_path), _head()) == BodyAdmission(100, None)
    chunked = admit(_state(tmp_path), _head(content_length=None, chunked=True, coding="gzip"))
    assert chunked == BodyAdmission(0, "gzip")


def test_a_request_without_a_body_has_nothing_to_admit(tmp_path: pathlib.Path) -> None:
    assert admit(_state(tmp_path), _head("GET", None)) is None
    # POST, PUT and PATCH are read as bodies even when the head frames none.
    assert admit(_state(tmp_path), _head("POST", None)) == BodyAdmission(0, None)


def test_a_drain_and_the_descriptor_reserve_refuse_before_anything_else(
    tmp_path: pathlib.Path,
) -> None:
    state = _state(tmp_path, max_body_bytes=10)
    with pytest.raises(Shed):
        admit(state, _head(content_length=10**9), shed=True)
    state.draining = True
    with pytest.raises(Draining):
        admit(state, _head("GET", None), shed=True)


def test_a_declared_length_over_the_limit_is_413_before_the_upload(
    tmp_path: pathlib.Path,
) -> None:
    with pytest.raises(BodyError) as info:
        admit(_state(tmp_path, max_body_bytes=1000), _head(content_length=1001))
    assert (info.value.status, info.value.kind) == (413, "too_large")


def test_a_coding_the_proxy_cannot_decode_is_415(tmp_path: pathlib.Path) -> None:
    with pytest.raises(BodyError) as info:
        admit(_state(tmp_path), _head(coding="snappy"))
    assert info.value.status == 415


def test_the_reading_budget_counts_bytes_received_and_always_admits_one_body(
    tmp_path: pathlib.Path,
) -> None:
    state = _state(tmp_path, max_reading_bytes=64 * KIB, spool_above_bytes=0)
    # Alone, a body may declare more than the budget (the per-body limit is max_body_bytes).
    assert admit(state, _head(content_length=200 * KIB)) == BodyAdmission(200 * KIB, None)
    state.reading_bytes = 60 * KIB  # received by reads in progress
    assert admit(state, _head(content_length=4 * KIB)) == BodyAdmission(4 * KIB, None)
    with pytest.raises(BodyBusy):
        admit(state, _head(content_length=4 * KIB + 1))


def test_a_body_the_spool_takes_at_once_is_admitted_by_the_spools_budget(
    tmp_path: pathlib.Path,
) -> None:
    state = _state(
        tmp_path, max_reading_bytes=64 * KIB, spool_above_bytes=100 * KIB, max_spool_bytes=MIB
    )
    state.reading_bytes = 60 * KIB
    # Plain and over the threshold: spooled from its first byte, no heap budget asked.
    assert admit(state, _head(content_length=500 * KIB)) == BodyAdmission(500 * KIB, None)
    # A coded body decodes on the heap first: the heap budget applies.
    with pytest.raises(BodyBusy):
        admit(state, _head(content_length=500 * KIB, coding="gzip"))
    state.spool.in_flight = 600 * KIB
    with pytest.raises(SpoolBusy):
        admit(state, _head(content_length=500 * KIB))
    assert state.spool.busy == 1


def test_a_session_is_required_only_where_it_is_asked_for_and_on_exchange_routes(
    tmp_path: pathlib.Path,
) -> None:
    admit_session(_state(tmp_path), Protocol.MESSAGES, None)
    required = _state(tmp_path, require_session=True)
    with pytest.raises(SessionRequired):
        admit_session(required, Protocol.MESSAGES, None)
    admit_session(required, Protocol.ANTHROPIC, None)
    admit_session(required, Protocol.MESSAGES, "s-1")


def test_a_sessions_exchanges_in_flight_count_toward_its_commit_backlog(
    tmp_path: pathlib.Path,
) -> None:
    state = _state(tmp_path, max_pending_commits=2)

    async def two_in_flight() -> None:
        first = state.registry.track("s-1")
        with first:
            admit_session(state, Protocol.MESSAGES, "s-1")
            with state.registry.track("s-1"):
                with pytest.raises(CommitBacklog, match=r"\(2 pending commits\)"):
                    admit_session(state, Protocol.MESSAGES, "s-1")
                admit_session(state, Protocol.MESSAGES, "s-2")

    asyncio.run(asyncio.wait_for(two_in_flight(), 10))


def test_the_reading_account_refuses_growth_past_a_shared_budget_and_settles(
    tmp_path: pathlib.Path,
) -> None:
    state = _state(tmp_path, max_reading_bytes=100)
    ex = Exchange(protocol=Protocol.MESSAGES, method="POST", path="/v1/messages")
    alone = ReadingAccount(state, ex)
    alone.grow(150)  # alone, a read may pass the budget
    other = ReadingAccount(state, ex)
    with pytest.raises(BodyBusy):
        other.grow(1)
    assert state.reading_bytes == 151
    other.settle()
    alone.settle()
    alone.settle()  # idempotent
    assert state.reading_bytes == 0
    assert ex.reading_bytes == 151  # the exchange counts what it received

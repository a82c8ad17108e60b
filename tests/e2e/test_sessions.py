"""Sessions through the real proxy (issue 5, items 1-4): identity, locks, shutdown_session.

Every test runs the proxy and the upstream emulator on loopback ports of this
process (``proxy.testing.proxy_with_emulator``) and talks plain HTTP to the
proxy with aiohttp. Ordering uses asyncio events set by test plugins and the
emulator's own wait helpers (``hold=KEY`` keeps an upstream stream open until
the test releases it). Tombstone expiry uses an injected clock, never a sleep.
SSE is parsed by the minimal reader of ``tests.support.e2e``, not by the proxy's framer.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import math
import time
from collections import defaultdict
from collections.abc import AsyncIterator, Awaitable
from typing import Any, TypeVar

import aiohttp
import pytest
from multidict import CIMultiDictProxy

from proxy import Plugin
from proxy._emulator import DEFAULT_TEXT
from proxy._plugins import ExchangeRecord, PrepareContext
from proxy._session_ids import bearer_session_id
from proxy._wire import WireMetadata
from proxy.testing import proxy_with_emulator
from tests.support.e2e import Event, request_body, sse_events, streamed_text, wait_until

CHAT = "/v1/chat/completions"
RESPONSES = "/v1/responses"
MESSAGES = "/v1/messages"
#: Upper bound (seconds) for any wait that should end at once.
BOUND_S = 5.0
#: The session shutdown timeout under test: the stream never released is cut after it.
SHUTDOWN_TIMEOUT_S = 0.5
TOMBSTONE_TTL_S = 60.0

T = TypeVar("T")


# --------------------------------------------------------------------------- helpers


class FakeClock:
    """A monotonic clock (seconds) moved by hand; drives the session registry."""

    def __init__(self) -> None:
        self.now = 5000.0

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


def ends_cleanly(path: str, events: list[Event]) -> bool:
    """Whether the stream ends with the protocol's terminal event (docs/design.md §7)."""
    if not events:
        return False
    name, data = events[-1]
    if path == CHAT:
        return data == "[DONE]"
    if path == RESPONSES:
        return name == "response.completed"
    return name == "message_stop"


@dataclasses.dataclass(frozen=True, slots=True)
class Streamed:
    """One finished HTTP exchange as the client saw it."""

    status: int
    headers: CIMultiDictProxy[str]
    raw: bytes

    @property
    def events(self) -> list[Event]:
        """The SSE events of the body (empty for a JSON answer)."""
        return sse_events(self.raw)

    def json(self) -> Any:
        """The body decoded as JSON."""
        return json.loads(self.raw)


async def call(
    http: aiohttp.ClientSession,
    url: str,
    body: dict[str, Any],
    headers: dict[str, str] | None = None,
    *,
    first_event: asyncio.Event | None = None,
) -> Streamed:
    """POST ``body`` and read the whole answer; ``first_event`` is set once one SSE event
    (a blank-line-terminated block) has arrived, so a caller knows the stream started."""
    async with http.post(url, json=body, headers=headers or {}) as resp:
        raw = bytearray()
        async for line in resp.content:
            raw += line
            if first_event is not None and line in (b"\n", b"\r\n"):
                first_event.set()
        return Streamed(resp.status, resp.headers, bytes(raw))


async def bounded(aw: Awaitable[T]) -> T:
    """``await aw``, failing after BOUND_S seconds instead of hanging the test."""
    async with asyncio.timeout(BOUND_S):
        return await aw


@pytest.fixture
async def http() -> AsyncIterator[aiohttp.ClientSession]:
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=20)) as session:
        yield session


class Recorder(Plugin):
    """Records what the proxy tells plugins: commit records and session_closed calls."""

    name = "recorder"

    def __init__(self) -> None:
        self.records: list[ExchangeRecord] = []
        self.closed: list[str] = []

    async def commit(self, record: ExchangeRecord) -> None:
        self.records.append(record)

    async def session_closed(self, session_id: str) -> None:
        self.closed.append(session_id)


class PrepareGate(Plugin):
    """A prepare hook that logs enter/exit per model and waits for the test's go-ahead.

    ``asked[model]`` is set from ``wants_body``, which the exchange calls just
    before taking the session lock, with no ``await`` in between: once it is set,
    that request is either inside ``prepare`` or queued on the session lock.
    """

    name = "gate"

    def __init__(self) -> None:
        self.log: list[str] = []
        self.asked: defaultdict[str, asyncio.Event] = defaultdict(asyncio.Event)
        self.entered: defaultdict[str, asyncio.Event] = defaultdict(asyncio.Event)
        self.proceed: defaultdict[str, asyncio.Event] = defaultdict(asyncio.Event)

    def wants_body(self, meta: WireMetadata, fold_level: int) -> bool:
        assert meta.model is not None
        self.asked[meta.model].set()
        return False

    async def prepare(self, ctx: PrepareContext) -> bool:
        model = ctx.meta.model
        assert model is not None
        self.log.append(f"enter {model}")
        self.entered[model].set()
        await self.proceed[model].wait()
        self.log.append(f"exit {model}")
        return False


# --------------------------------------------------------------------------- locks


async def test_prepares_of_one_session_are_serialized_but_not_behind_a_stream(
    http: aiohttp.ClientSession,
) -> None:
    """Two requests of one session: the second prepare waits for the first one's to end,
    but not for the first one's stream, which the emulator holds open throughout."""
    gate = PrepareGate()
    async with proxy_with_emulator(plugins=[gate]) as h:
        session = {"x-session-id": "sess-lock"}
        a = asyncio.create_task(
            call(
                http,
                h.url + CHAT,
                request_body(CHAT, "a"),
                {**session, "x-emulator": "hold=hold-a"},
            )
        )
        b: asyncio.Task[Streamed] | None = None
        try:
            await bounded(gate.entered["a"].wait())
            b = asyncio.create_task(call(http, h.url + CHAT, request_body(CHAT, "b"), session))
            await bounded(gate.asked["b"].wait())
            # b is at its prepare while a is inside its own: b must queue on the lock.
            assert not gate.entered["b"].is_set()
            info = h.state.registry.info("sess-lock")
            assert info is not None and info.locked and info.in_flight == 2

            gate.proceed["a"].set()
            await bounded(gate.entered["b"].wait())
            # a's upstream stream is held open by the emulator, and b got in anyway.
            held = await h.emulator.wait_holding(1)
            assert held.model == "a" and not held.closed
            gate.proceed["b"].set()
            done_b = await bounded(b)
            assert done_b.status == 200
            assert streamed_text(CHAT, done_b.events) == DEFAULT_TEXT
            assert not a.done(), "b finished while a's stream is still held"
            assert gate.log == ["enter a", "exit a", "enter b", "exit b"]

            h.emulator.release("hold-a")
            done_a = await bounded(a)
        finally:
            for task in (a, b):
                if task is not None and not task.done():
                    task.cancel()
    assert done_a.status == 200
    assert streamed_text(CHAT, done_a.events) == DEFAULT_TEXT
    assert ends_cleanly(CHAT, done_a.events)


# --------------------------------------------------------------------------- identity


async def test_session_id_sources_in_order(http: aiohttp.ClientSession) -> None:
    """Headers in the default order, then the body (prompt_cache_key, metadata.user_id),
    then the opt-in bearer digest, as the commit hooks see them."""
    recorder = Recorder()
    async with proxy_with_emulator(plugins=[recorder], session_from_bearer=True) as h:
        cases: list[tuple[str, str, dict[str, str], dict[str, Any]]] = [
            # header order: x-session-id beats x-claude-code-session-id beats session-id
            (
                "m1",
                CHAT,
                {"session-id": "s-c", "x-claude-code-session-id": "s-b", "x-session-id": "s-a"},
                {},
            ),
            ("m2", MESSAGES, {"session-id": "s-c", "x-claude-code-session-id": "s-b"}, {}),
            ("m3", RESPONSES, {"session-id": "s-c"}, {"prompt_cache_key": "from-body"}),
            # body sources when no header names a session
            ("m4", RESPONSES, {}, {"prompt_cache_key": "pck-1"}),
            (
                "m5",
                MESSAGES,
                {},
                {"metadata": {"user_id": "user_ab12_account_77_session_0f0e-uuid"}},
            ),
            # opt-in bearer: a digest, never the token itself
            ("m6", CHAT, {"Authorization": "Bearer sk-secret-token"}, {}),
        ]
        for model, path, headers, extra in cases:
            got = await call(http, h.url + path, request_body(path, model, **extra), headers)
            assert got.status == 200, (model, got.raw[:200])
    by_model = {r.model: r.session_id for r in recorder.records}
    assert by_model == {
        "m1": "s-a",
        "m2": "s-b",
        "m3": "s-c",
        "m4": "pck-1",
        "m5": "0f0e-uuid",
        "m6": bearer_session_id("Bearer sk-secret-token"),
    }
    assert "sk-secret-token" not in str(by_model)


async def test_configured_header_order_and_bearer_off_by_default(
    http: aiohttp.ClientSession,
) -> None:
    """``session_headers`` reorders the headers; without the opt-in a bearer names no session."""
    recorder = Recorder()
    async with proxy_with_emulator(
        plugins=[recorder], session_headers=["session-id", "x-session-id"]
    ) as h:
        both = {"x-session-id": "later", "session-id": "first"}
        assert (await call(http, h.url + CHAT, request_body(CHAT, "m1"), both)).status == 200
        bearer = {"Authorization": "Bearer sk-not-a-session"}
        assert (await call(http, h.url + CHAT, request_body(CHAT, "m2"), bearer)).status == 200
    by_model = {r.model: r.session_id for r in recorder.records}
    assert by_model == {"m1": "first", "m2": None}


@pytest.mark.parametrize("path", [CHAT, RESPONSES, MESSAGES])
async def test_require_session_rejects_in_protocol_shape(
    http: aiohttp.ClientSession, path: str
) -> None:
    """``require_session``: no identity is a 400 in the client's protocol shape, never forwarded."""
    async with proxy_with_emulator(plugins=[], require_session=True) as h:
        got = await call(http, h.url + path, request_body(path, "m"))
        ok = await call(http, h.url + path, request_body(path, "m"), {"x-session-id": "s"})
        forwarded = len(h.emulator.stats)
    assert got.status == 400
    payload = got.json()
    if path == MESSAGES:
        assert payload["type"] == "error"
        assert payload["error"]["type"] == "invalid_request_error"
        assert "session" in payload["error"]["message"]
    else:
        assert payload["error"]["type"] == "invalid_request_error"
        assert payload["error"]["code"] == "session_required"
    assert ok.status == 200
    assert forwarded == 1, "the request without a session must not reach the upstream"


async def test_requests_without_identity_are_served_without_a_session(
    http: aiohttp.ClientSession,
) -> None:
    """No identity and no requirement: served normally, no session entry is created."""
    recorder = Recorder()
    async with proxy_with_emulator(plugins=[recorder]) as h:
        got = await call(http, h.url + CHAT, request_body(CHAT, "m"))
        sessions = h.state.registry.session_count
    assert got.status == 200 and streamed_text(CHAT, got.events) == DEFAULT_TEXT
    assert [r.session_id for r in recorder.records] == [None]
    assert sessions == 0


# --------------------------------------------------------------------------- shutdown_session


async def test_shutdown_session_waits_cancels_tombstones_and_expires(
    http: aiohttp.ClientSession,
) -> None:
    """DELETE /admin/sessions/{id} with two streams in flight: the one released within the
    timeout finishes intact, the other is cut with an in-band error and its upstream
    request aborted; late requests get 503 + Retry-After; plugins are told once; the
    tombstone expires after its TTL on the injected clock."""
    clock = FakeClock()
    recorder = Recorder()
    sid = "sess-shut"
    async with proxy_with_emulator(
        plugins=[recorder],
        clock=clock,
        session_shutdown_timeout=SHUTDOWN_TIMEOUT_S,
        tombstone_ttl=TOMBSTONE_TTL_S,
    ) as h:
        session = {"x-session-id": sid}
        started_a, started_b = asyncio.Event(), asyncio.Event()
        # a (chat) will be released during the wait and finish; b (Anthropic) never is.
        a = asyncio.create_task(
            call(
                http,
                h.url + CHAT,
                request_body(CHAT, "a"),
                {**session, "x-emulator": "hold=shut-a"},
                first_event=started_a,
            )
        )
        b = asyncio.create_task(
            call(
                http,
                h.url + MESSAGES,
                request_body(MESSAGES, "b"),
                {**session, "x-emulator": "hold=shut-b"},
                first_event=started_b,
            )
        )
        try:
            await bounded(asyncio.gather(started_a.wait(), started_b.wait()))
            ids = {r.model: r.id for r in h.emulator.stats}
            await h.emulator.wait_holding(ids["a"])
            await h.emulator.wait_holding(ids["b"])

            t0 = time.monotonic()
            delete = asyncio.create_task(http.delete(f"{h.url}/admin/sessions/{sid}"))
            await wait_until(lambda: h.state.registry.is_tombstoned(sid), "tombstoned", BOUND_S)

            # Late requests are refused in their own protocol's shape, with Retry-After:
            # while the shutdown runs, the whole TTL (it starts when the shutdown ends),
            # not the proxy's generic retry_after.
            late_chat = await call(http, h.url + CHAT, request_body(CHAT, "late"), session)
            late_msg = await call(http, h.url + MESSAGES, request_body(MESSAGES, "late"), session)
            assert late_chat.status == 503 and late_msg.status == 503
            for late in (late_chat, late_msg):
                assert late.headers["Retry-After"] == str(math.ceil(TOMBSTONE_TTL_S))
            assert late_chat.json()["error"]["code"] == "session_closed"
            assert "session closed" in late_chat.json()["error"]["message"]
            assert late_msg.json()["type"] == "error"
            assert "session closed" in late_msg.json()["error"]["message"]
            assert len(h.emulator.stats) == 2, "a late request reached the upstream"

            h.emulator.release("shut-a")
            done_a = await bounded(a)
            async with asyncio.timeout(SHUTDOWN_TIMEOUT_S + BOUND_S):
                resp = await delete
                result = await resp.json()
            elapsed = time.monotonic() - t0
            done_b = await bounded(b)
        finally:
            for task in (a, b):
                if not task.done():
                    task.cancel()
        assert resp.status == 200
        assert result == {"id": sid, "finished": 1, "cancelled": 1, "already_closed": False}
        assert SHUTDOWN_TIMEOUT_S <= elapsed < SHUTDOWN_TIMEOUT_S + BOUND_S

        # a finished intact; b was cut with an in-band Anthropic error event.
        assert done_a.status == 200 and ends_cleanly(CHAT, done_a.events)
        assert streamed_text(CHAT, done_a.events) == DEFAULT_TEXT
        assert done_b.status == 200
        name, data = done_b.events[-1]
        assert name == "error"
        error = json.loads(data)
        assert error["type"] == "error" and error["error"]["type"] == "api_error"
        assert "session closed" in error["error"]["message"]
        assert done_b.events[0][0] == "message_start"

        # Upstream side: a's answer ended normally, b's connection was dropped by the proxy.
        assert h.emulator.record(ids["a"]).finished
        assert (await h.emulator.wait_aborted(ids["b"])).aborted_by_peer

        # State dropped, plugins told once; a second DELETE is a no-op.
        assert recorder.closed == [sid]
        assert h.state.registry.info(sid) is None
        again = await http.delete(f"{h.url}/admin/sessions/{sid}")
        assert (await again.json())["already_closed"] is True
        assert recorder.closed == [sid]

        # The tombstone outlives the shutdown by its TTL, then expires; Retry-After is
        # what is left of it, in whole seconds rounded up.
        clock.advance(20.25)
        partway = await call(http, h.url + MESSAGES, request_body(MESSAGES, "late"), session)
        assert partway.status == 503
        assert partway.headers["Retry-After"] == str(math.ceil(TOMBSTONE_TTL_S - 20.25))
        clock.advance(TOMBSTONE_TTL_S - 1 - 20.25)
        still = await call(http, h.url + CHAT, request_body(CHAT, "late"), session)
        assert still.status == 503
        assert still.headers["Retry-After"] == "1"
        clock.advance(2)
        fresh = await call(http, h.url + CHAT, request_body(CHAT, "fresh"), session)
        assert fresh.status == 200 and streamed_text(CHAT, fresh.events) == DEFAULT_TEXT
        assert not h.state.registry.is_tombstoned(sid)
    outcomes = {r.model: r.outcome for r in recorder.records if r.model != "late"}
    assert outcomes == {"a": "ok", "b": "cancelled", "fresh": "ok"}
    # Refused requests never went upstream; any commit they got says so.
    assert all(
        (r.status, r.outcome) == (503, "rejected") for r in recorder.records if r.model == "late"
    )


async def test_a_request_refused_for_a_closed_session_is_booked_with_its_session_id(
    http: aiohttp.ClientSession, caplog: pytest.LogCaptureFixture
) -> None:
    """Finding: the 503 ``session_closed`` refusal was committed with ``session_id=None``
    and its access line said ``session_id=-``, though the client named the session. Now
    the commit record and the access line carry the id the request was refused for, and
    the commit still reaches the plugins (the closed session's lock would refuse it)."""
    caplog.set_level(logging.INFO, logger="context_proxy.access")
    recorder = Recorder()
    sid = "sess-refused-1"
    async with proxy_with_emulator(plugins=[recorder], tombstone_ttl=TOMBSTONE_TTL_S) as h:
        closed = await http.delete(f"{h.url}/admin/sessions/{sid}")
        assert closed.status == 200
        late = await call(http, h.url + CHAT, request_body(CHAT, "late"), {"x-session-id": sid})
        await wait_until(lambda: bool(recorder.records), "the refusal committed", BOUND_S)
        assert h.emulator.stats == []
    assert late.status == 503 and late.json()["error"]["code"] == "session_closed"
    [record] = recorder.records
    assert (record.session_id, record.status, record.outcome) == (sid, 503, "rejected")
    [access] = [r for r in caplog.records if r.name == "context_proxy.access"]
    assert f"session_id={sid}" in access.getMessage()
    assert access.__dict__["access"]["session_id"] == sid
    # Booked, not failed: the closed session's lock is not taken for it.
    assert [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR] == []


async def test_a_closed_session_stays_visible_and_its_cut_streams_say_session_closed(
    http: aiohttp.ClientSession,
) -> None:
    """A chat and a Responses stream cut by DELETE /admin/sessions/{id} end with the
    in-band code ``session_closed`` (not an upstream failure); afterwards the admin
    views show the session as tombstoned with its remaining TTL until it expires."""
    clock = FakeClock()
    sid = "sess-visible"
    async with proxy_with_emulator(
        clock=clock, session_shutdown_timeout=SHUTDOWN_TIMEOUT_S, tombstone_ttl=TOMBSTONE_TTL_S
    ) as h:
        session = {"x-session-id": sid}
        started_c, started_r = asyncio.Event(), asyncio.Event()
        chat = asyncio.create_task(
            call(
                http,
                h.url + CHAT,
                request_body(CHAT, "c"),
                {**session, "x-emulator": "hold=vis-c"},
                first_event=started_c,
            )
        )
        resp = asyncio.create_task(
            call(
                http,
                h.url + RESPONSES,
                request_body(RESPONSES, "r"),
                {**session, "x-emulator": "chunks=4; hold=vis-r; stall_after=6"},
                first_event=started_r,
            )
        )
        try:
            await bounded(asyncio.gather(started_c.wait(), started_r.wait()))
            for record in list(h.emulator.stats):
                await h.emulator.wait_holding(record.id)
            async with http.delete(f"{h.url}/admin/sessions/{sid}") as answer:
                assert (await answer.json())["cancelled"] == 2
            done_c, done_r = await bounded(asyncio.gather(chat, resp))
        finally:
            for task in (chat, resp):
                task.cancel()
        chat_error = json.loads(done_c.events[-1][1])["error"]
        assert chat_error["message"] == "session closed"
        assert chat_error["code"] == "session_closed"
        name, data = done_r.events[-1]
        assert name == "error"
        assert json.loads(data)["code"] == "session_closed"

        assert h.state.registry.info(sid) is None  # the state is gone, the tombstone is not
        clock.advance(10.0)
        async with http.get(f"{h.url}/admin/sessions/{sid}") as answer:
            assert answer.status == 200
            detail = await answer.json()
        assert detail["id"] == sid and detail["tombstoned"] is True
        assert detail["tombstone_ttl_s"] == TOMBSTONE_TTL_S - 10.0
        assert detail["in_flight"] == 0
        # The plain listing shows live sessions; ?tombstoned=true the closed ones.
        async with http.get(f"{h.url}/admin/sessions") as answer:
            assert sid not in {s["id"] for s in (await answer.json())["sessions"]}
        async with http.get(f"{h.url}/admin/sessions?tombstoned=true") as answer:
            closed = {s["id"]: s for s in (await answer.json())["sessions"]}
        assert closed[sid]["tombstoned"] is True
        assert closed[sid]["tombstone_ttl_s"] == TOMBSTONE_TTL_S - 10.0

        clock.advance(TOMBSTONE_TTL_S)
        async with http.get(f"{h.url}/admin/sessions/{sid}") as answer:
            assert answer.status == 404
            assert await answer.json() == {"error": "no such session"}
        async with http.get(f"{h.url}/admin/sessions?tombstoned=true") as answer:
            assert await answer.json() == {"sessions": [], "next_cursor": None}


class StuckPrepare(Plugin):
    """A prepare hook that never returns for model ``stuck`` (until cancelled)."""

    name = "stuck"

    def __init__(self) -> None:
        self.entered = asyncio.Event()
        self.closed: list[str] = []

    async def prepare(self, ctx: PrepareContext) -> bool:
        if ctx.meta.model == "stuck":
            self.entered.set()
            await asyncio.Event().wait()
        return False

    async def session_closed(self, session_id: str) -> None:
        self.closed.append(session_id)


async def test_shutdown_session_answers_stragglers_not_yet_streaming_with_503(
    http: aiohttp.ClientSession,
) -> None:
    """Stragglers cancelled before any answer byte (one in prepare, one held back before
    its first output event) get a 503 "session closed" in their protocol, not a reset."""
    stuck = StuckPrepare()
    sid = "sess-strag"
    # plugin_timeout outlasts the shutdown timeout: the shutdown, not the hook
    # budget, ends the prepare.
    async with proxy_with_emulator(
        plugins=[stuck], session_shutdown_timeout=SHUTDOWN_TIMEOUT_S, plugin_timeout=30
    ) as h:
        session = {"x-session-id": sid}
        # One straggler sits in prepare under the session lock; the other is a
        # Responses stream the proxy holds back until its first output event,
        # which the emulator never sends.
        # (The gated one first: the other then keeps the session lock to itself.)
        gated = asyncio.create_task(
            call(
                http,
                h.url + RESPONSES,
                request_body(RESPONSES, "gated"),
                {**session, "x-emulator": "hold=strag; stall_after=1"},
            )
        )
        in_prepare: asyncio.Task[Streamed] | None = None
        try:
            await h.emulator.wait_holding(1)
            in_prepare = asyncio.create_task(
                call(http, h.url + MESSAGES, request_body(MESSAGES, "stuck"), session)
            )
            await bounded(stuck.entered.wait())
            async with asyncio.timeout(SHUTDOWN_TIMEOUT_S + BOUND_S):
                async with http.delete(f"{h.url}/admin/sessions/{sid}") as resp:
                    result = await resp.json()
                answers = [await in_prepare, await gated]
        finally:
            gated.cancel()
            if in_prepare is not None:
                in_prepare.cancel()
        aborted = await h.emulator.wait_aborted(1)
    assert result == {"id": sid, "finished": 0, "cancelled": 2, "already_closed": False}
    for answer in answers:
        assert answer.status == 503, answer.raw
        assert int(answer.headers["Retry-After"]) >= 0
    anthropic_error, openai_error = (answer.json() for answer in answers)
    assert anthropic_error["type"] == "error"
    assert anthropic_error["error"]["message"] == "session closed"
    assert openai_error["error"]["message"] == "session closed"
    assert openai_error["error"]["code"] == "session_closed"
    assert aborted.model == "gated"
    assert stuck.closed == [sid]

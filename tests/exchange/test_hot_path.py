"""The per-request work a small exchange skips, and what must still happen when it does.

Issue 11 item 3 (CPU per request): a body already received whole is read
without a timer; a proxy whose plugins have no ``commit`` hook, or whose hooks
all decline the exchange's session (``wants_commit``: fold without a session),
spends no task or record on commits (but still counts them); the client's answer leaves in as
few writes as the upstream's pieces allow (its head with the first bytes, a
whole JSON answer with its end). Each skip is checked together with the
behaviour it must not change: the idle-body deadline, the commit counters and
hooks, response headers that are not held back while the upstream stalls. A commit
whose hooks return without awaiting arms no timer; one that awaits keeps both
budgets (its own and its hook's).
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import socket
from collections.abc import AsyncIterator, Callable
from typing import Any

import aiohttp
import pytest
from aiohttp import web
from prometheus_client import CollectorRegistry

import proxy._app as app_module
from plugins.fold import FoldPlugin
from proxy import ExchangeRecord, Plugin, PrepareContext
from proxy._body import BodyTimeout, read_body
from proxy._commits import CommitTracker
from proxy._exchange import Exchange
from proxy._front import BodyStream
from proxy._plugins import PluginHost
from proxy._protocols import Protocol
from proxy.testing import proxy_with_emulator
from tests.body.test_body import fed_reader
from tests.support.e2e import CHAT_PATH, stream_body
from tests.support.lifetime import proxy_at
from tests.support.ports import serve_app
from tests.support.upstream import SSE_HEAD, RawUpstream, chat_sse_events, chunked, proxy_for

IO_TIMEOUT = 20.0  # seconds; bounds every wait


# --------------------------------------------------------------------------- body read


@pytest.fixture
def timers(monkeypatch: pytest.MonkeyPatch) -> list[float | None]:
    """Delays or deadlines of the ``asyncio.timeout`` and ``asyncio.timeout_at`` contexts
    made while the test runs."""
    made: list[float | None] = []
    real, real_at = asyncio.timeout, asyncio.timeout_at

    def counted(delay: float | None) -> asyncio.Timeout:
        made.append(delay)
        return real(delay)

    def counted_at(when: float | None) -> asyncio.Timeout:
        made.append(when)
        return real_at(when)

    monkeypatch.setattr(asyncio, "timeout", counted)
    monkeypatch.setattr(asyncio, "timeout_at", counted_at)
    return made


async def test_a_body_received_whole_is_read_without_a_timer(timers: list[float | None]) -> None:
    body = stream_body(CHAT_PATH)
    result = await read_body(
        fed_reader(body),
        content_length=len(body),
        content_encoding=None,
        limit=1 << 20,
        idle_timeout=0.05,
        body_timeout=0.05,
    )
    assert bytes(result.buffer) == body
    assert timers == []


async def test_a_body_still_arriving_keeps_its_idle_deadline(timers: list[float | None]) -> None:
    content = BodyStream(None)
    content.feed(b'{"model": "m", ')  # and then nothing more
    with pytest.raises(BodyTimeout):
        await asyncio.wait_for(
            read_body(
                content,
                content_length=1000,
                content_encoding=None,
                limit=1 << 20,
                idle_timeout=0.05,
            ),
            IO_TIMEOUT,
        )
    assert len(timers) == 1


# --------------------------------------------------------------------------- commits


class PrepareOnly(Plugin):
    """A plugin with a prepare hook and no commit hook (like the built-in fold)."""

    name = "prepare-only"

    def __init__(self) -> None:
        self.prepared = 0

    async def prepare(self, ctx: PrepareContext) -> bool:
        self.prepared += 1
        return False


class Booker(Plugin):
    """Counts the records its commit hook receives."""

    name = "booker"

    def __init__(self) -> None:
        self.records: list[ExchangeRecord] = []

    async def commit(self, record: ExchangeRecord) -> None:
        self.records.append(record)


@pytest.fixture
def started(monkeypatch: pytest.MonkeyPatch) -> list[ExchangeRecord]:
    """Records handed to :meth:`CommitTracker.start` (each one a commit task)."""
    seen: list[ExchangeRecord] = []
    real = CommitTracker.start

    def counted(self: CommitTracker, record: ExchangeRecord, **run: Any) -> asyncio.Task[None]:
        seen.append(record)
        return real(self, record, **run)

    monkeypatch.setattr(CommitTracker, "start", counted)
    return seen


async def _post_chat(url: str, count: int) -> None:
    async with aiohttp.ClientSession() as http:
        for _ in range(count):
            async with http.post(url + CHAT_PATH, data=stream_body(CHAT_PATH)) as resp:
                assert resp.status == 200
                assert b"[DONE]" in await resp.read()


async def test_without_a_commit_hook_commits_are_counted_and_no_task_is_made(
    started: list[ExchangeRecord],
) -> None:
    plugin = PrepareOnly()
    async with proxy_with_emulator(plugins=[plugin]) as h:
        await _post_chat(h.url, 3)
        await h.settle()
        commits = h.state.commits
        assert (commits.count("started"), commits.count("finished")) == (3, 3)
        assert h.metric("context_proxy_commits_total", event="finished") == 3
        assert commits.pending == frozenset()
    assert plugin.prepared == 3
    assert started == []


async def test_a_commit_hook_still_gets_every_record(started: list[ExchangeRecord]) -> None:
    booker = Booker()
    async with proxy_with_emulator(plugins=[PrepareOnly(), booker]) as h:
        await _post_chat(h.url, 3)
        await h.settle()
        assert h.state.commits.count("finished") == 3
    assert len(started) == 3
    assert [r.exchange_id for r in booker.records] == [r.exchange_id for r in started]
    assert {(r.status, r.outcome) for r in booker.records} == {(200, "ok")}


class Declines(Booker):
    """A commit hook that declines exchanges without a session (``wants_commit``)."""

    name = "declines"

    def wants_commit(self, session_id: str | None) -> bool:
        return session_id is not None


class AsksAndFails(Booker):
    name = "asks-and-fails"

    def wants_commit(self, session_id: str | None) -> bool:
        raise RuntimeError("no answer")


async def _post_chat_as(url: str, session: str | None) -> None:
    headers = {} if session is None else {"x-session-id": session}
    async with (
        aiohttp.ClientSession() as http,
        http.post(url + CHAT_PATH, data=stream_body(CHAT_PATH), headers=headers) as resp,
    ):
        assert resp.status == 200
        assert b"[DONE]" in await resp.read()


async def test_fold_spends_no_record_or_task_on_a_request_without_a_session(
    started: list[ExchangeRecord],
) -> None:
    async with proxy_with_emulator(plugins=[FoldPlugin()]) as h:
        await _post_chat(h.url, 3)
        await _post_chat_as(h.url, "s-1")
        await h.settle()
        commits = h.state.commits
        assert (commits.count("started"), commits.count("finished")) == (4, 4)
        assert h.metric("context_proxy_commits_total", event="finished") == 4
    # Only the request with a session is booked: its fold may be carried.
    assert [r.session_id for r in started] == ["s-1"]


async def test_a_commit_hook_that_declines_gets_no_record_and_the_others_do(
    started: list[ExchangeRecord],
) -> None:
    declines, booker = Declines(), Booker()
    async with proxy_with_emulator(plugins=[declines, booker]) as h:
        await _post_chat(h.url, 2)
        await _post_chat_as(h.url, "s-2")
        await h.settle()
        assert h.state.commits.count("finished") == 3
    assert len(started) == 3
    assert [r.session_id for r in booker.records] == [None, None, "s-2"]
    assert [r.session_id for r in declines.records] == ["s-2"]


async def test_a_wants_commit_that_raises_takes_part_and_is_counted() -> None:
    plugin = AsksAndFails()
    async with proxy_with_emulator(plugins=[plugin]) as h:
        await _post_chat(h.url, 2)
        await h.settle()
        assert h.state.host.failures == {"asks-and-fails": 2}
    assert len(plugin.records) == 2


@pytest.fixture
def deadlines(monkeypatch: pytest.MonkeyPatch) -> list[float]:
    """The deadlines (loop time) asyncio timeout contexts are armed for while the test
    runs: each one a timer handle on the loop (a context made unarmed records none)."""
    armed: list[float] = []
    real = asyncio.Timeout.reschedule

    def reschedule(self: asyncio.Timeout, when: float | None) -> None:
        if when is not None:
            armed.append(when)
        real(self, when)

    monkeypatch.setattr(asyncio.Timeout, "reschedule", reschedule)
    return armed


class Awaiting(Plugin):
    """A commit hook that awaits ``delay`` seconds first; raises ``fail`` after it if set."""

    name = "awaiting"

    def __init__(self, delay: float, fail: Exception | None = None) -> None:
        self.delay = delay
        self.fail = fail
        self.records: list[str] = []
        self.cancelled = 0

    async def commit(self, record: ExchangeRecord) -> None:
        try:
            await asyncio.sleep(self.delay)
        except asyncio.CancelledError:
            self.cancelled += 1
            raise
        if self.fail is not None:
            raise self.fail
        self.records.append(record.exchange_id)


def _tracker(host: PluginHost, timeout: float) -> CommitTracker:
    return CommitTracker(host.run_commit, timeout=timeout, registry=CollectorRegistry())


async def _book(tracker: CommitTracker, exchange_id: str) -> None:
    ex = Exchange(protocol=Protocol.OPENAI, method="POST", path=CHAT_PATH)
    record = dataclasses.replace(ex.begin_commit(), exchange_id=exchange_id)
    await asyncio.wait_for(tracker.start(record), IO_TIMEOUT)


async def test_a_commit_whose_hooks_return_without_awaiting_arms_no_timer(
    deadlines: list[float],
) -> None:
    booker = Booker()
    tracker = _tracker(PluginHost([booker], timeout=5.0), timeout=10.0)
    await _book(tracker, "ex-a")
    assert [r.exchange_id for r in booker.records] == ["ex-a"]
    assert tracker.count("finished") == 1
    assert tracker.pending == frozenset()
    assert deadlines == []


async def test_a_commit_hook_that_awaits_keeps_both_budgets(deadlines: list[float]) -> None:
    plugin = Awaiting(0.001)
    tracker = _tracker(PluginHost([plugin], timeout=5.0), timeout=10.0)
    loop = asyncio.get_running_loop()
    before = loop.time()
    await _book(tracker, "ex-b")
    assert plugin.records == ["ex-b"]
    assert tracker.count("finished") == 1
    # The hook's deadline (5 s) and the commit's (10 s), counted from before the hooks ran.
    hook, commit = sorted(d - before for d in deadlines)
    assert 5.0 <= hook < 5.0 + IO_TIMEOUT and 10.0 <= commit < 10.0 + IO_TIMEOUT


async def test_a_commit_hook_past_its_budget_is_cut_and_the_next_hook_still_runs() -> None:
    slow, booker = Awaiting(IO_TIMEOUT * 2), Booker()
    host = PluginHost([slow, booker], timeout=0.05)
    tracker = _tracker(host, timeout=10.0)
    await _book(tracker, "ex-c")
    assert slow.cancelled == 1 and slow.records == []
    assert [r.exchange_id for r in booker.records] == ["ex-c"]
    assert host.failures == {"awaiting": 1}
    assert (tracker.count("finished"), tracker.count("timed_out")) == (1, 0)


async def test_a_commit_hook_that_raises_after_awaiting_is_isolated() -> None:
    plugin = Awaiting(0.001, fail=RuntimeError("boom"))
    host = PluginHost([plugin], timeout=5.0)
    tracker = _tracker(host, timeout=10.0)
    await _book(tracker, "ex-d")
    assert host.failures == {"awaiting": 1}
    assert tracker.count("finished") == 1


async def test_a_commit_past_the_commits_budget_is_cancelled_and_counted_timed_out() -> None:
    slow = Awaiting(IO_TIMEOUT * 2)
    # Hooks unbounded (0: no plugin budget): only the commit's own budget can stop it.
    tracker = _tracker(PluginHost([slow], timeout=0), timeout=0.05)
    await _book(tracker, "ex-e")
    assert slow.cancelled == 1
    assert (tracker.count("timed_out"), tracker.count("finished")) == (1, 0)


# --------------------------------------------------------------------------- access log


async def test_an_access_line_the_log_level_drops_costs_no_peer_look_up(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    looked_up: list[str | None] = []
    real = app_module._peer

    def peer(request: Any) -> str | None:
        looked_up.append(real(request))
        return looked_up[-1]

    monkeypatch.setattr(app_module, "_peer", peer)
    caplog.set_level(logging.WARNING, logger="context_proxy.access")
    async with proxy_with_emulator(plugins=[]) as h:
        await _post_chat(h.url, 2)  # access_log is on, its logger drops INFO lines
        assert looked_up == []
        caplog.set_level(logging.INFO, logger="context_proxy.access")
        await _post_chat(h.url, 1)
        await h.settle()
    lines = [r.getMessage() for r in caplog.records if r.name == "context_proxy.access"]
    assert len(lines) == 1 and len(looked_up) == 1
    assert looked_up[0] is not None and f"peer={looked_up[0]}" in lines[0]


# --------------------------------------------------------------------------- client writes


@pytest.fixture
def writes(monkeypatch: pytest.MonkeyPatch) -> Callable[[int], list[bytes]]:
    """``writes(port)``: the bytes of each socket write made on a connection
    accepted on ``port`` (the proxy's side of its clients' connections)."""
    log: list[tuple[int, bytes]] = []
    transport_type: Any = type(_any_transport())
    real_write = transport_type.write

    def local_port(transport: asyncio.BaseTransport) -> int:
        sockname = transport.get_extra_info("sockname")
        return int(sockname[1]) if isinstance(sockname, tuple) else -1

    def write(self: Any, data: Any) -> None:
        log.append((local_port(self), bytes(data)))
        real_write(self, data)

    def writelines(self: Any, lines: Any) -> None:
        data = b"".join(bytes(line) for line in lines)
        log.append((local_port(self), data))
        real_write(self, data)  # one call, one record (the base class would call write)

    monkeypatch.setattr(transport_type, "write", write)
    monkeypatch.setattr(transport_type, "writelines", writelines)
    return lambda port: [data for p, data in log if p == port]


def _any_transport() -> asyncio.BaseTransport:
    """A socket transport of the running loop's kind (for its class), already closed."""
    loop = asyncio.new_event_loop()
    try:
        one, two = socket.socketpair()
        with one, two:
            transport, _ = loop.run_until_complete(
                loop.connect_accepted_socket(asyncio.Protocol, one)
            )
            transport.close()
            loop.run_until_complete(asyncio.sleep(0))
        return transport
    finally:
        loop.close()


def _port(url: str) -> int:
    return int(url.rsplit(":", 1)[1])


async def test_a_whole_json_answer_leaves_in_one_write(
    writes: Callable[[int], list[bytes]],
) -> None:
    async with proxy_with_emulator() as h:
        async with aiohttp.ClientSession() as http:
            body = stream_body(CHAT_PATH, stream=False)
            async with http.post(h.url + CHAT_PATH, data=body) as resp:
                assert resp.status == 200
                answer = await resp.json()
        sent = writes(_port(h.url))
    assert answer["choices"][0]["message"]["content"]
    # Head, body and end together: one write, where a plain relay makes three.
    assert len(sent) == 1
    assert sent[0].startswith(b"HTTP/1.1 200") and b'"choices"' in sent[0]


async def test_a_stream_head_leaves_with_its_first_event(
    writes: Callable[[int], list[bytes]],
) -> None:
    async with proxy_with_emulator() as h:
        body = stream_body(CHAT_PATH)
        async with aiohttp.ClientSession() as http, http.post(h.url + CHAT_PATH, data=body) as resp:
            assert resp.status == 200
            raw = await resp.read()
        sent = writes(_port(h.url))
    assert raw.endswith(b"data: [DONE]\n\n")
    assert sent[0].startswith(b"HTTP/1.1 200") and b"data: {" in sent[0]


async def test_a_stream_that_arrives_whole_leaves_with_its_end_in_one_write(
    writes: Callable[[int], list[bytes]],
) -> None:
    events = b"".join(chat_sse_events())
    # The whole answer in one upstream write: head, events ending in data: [DONE], last-chunk.
    async with (
        RawUpstream(lambda target: SSE_HEAD + chunked(events)) as upstream,
        proxy_for(upstream.url) as url,
        aiohttp.ClientSession() as http,
        http.post(url + CHAT_PATH, data=stream_body(CHAT_PATH)) as resp,
    ):
        assert resp.status == 200
        raw = await resp.read()
        sent = writes(_port(url))
    assert raw == events
    # Head, events and end together, where a write per piece makes two (or three).
    assert len(sent) == 1
    assert sent[0].startswith(b"HTTP/1.1 200") and sent[0].endswith(events)


@pytest.fixture
async def stalling_upstream() -> AsyncIterator[tuple[str, asyncio.Event]]:
    """An upstream whose answers send their head, then wait for the event to send a body."""
    go = asyncio.Event()

    async def answer(request: web.Request) -> web.StreamResponse:
        await request.read()
        response = web.StreamResponse(headers={"Content-Type": "application/octet-stream"})
        await response.prepare(request)
        await go.wait()
        await response.write(b"late bytes")
        await response.write_eof()
        return response

    app = web.Application()
    app.router.add_route("*", "/{tail:.*}", answer)
    async with serve_app(app) as url:
        try:
            yield url, go
        finally:
            go.set()


@pytest.mark.parametrize("path", ["/v1/files", "/v1/models"])
async def test_response_headers_are_not_held_back_while_the_upstream_stalls(
    stalling_upstream: tuple[str, asyncio.Event], path: str
) -> None:
    url, go = stalling_upstream
    method = "POST" if path == "/v1/files" else "GET"
    data = b"file bytes" if method == "POST" else None
    # Bounded: a head held back until the body would never come (the body waits for us).
    async with (
        proxy_at(url) as proxy,
        aiohttp.ClientSession() as http,
        asyncio.timeout(5.0),
        http.request(method, proxy.url + path, data=data) as resp,
    ):
        # The head came while the upstream still holds the body back.
        assert resp.status == 200 and not go.is_set()
        go.set()
        assert await resp.read() == b"late bytes"

"""Every admitted exchange is committed exactly once, whatever the client does (issue 9, item 1).

Clients that hang up right after the last byte (the ``openai`` / ``anthropic``
SDKs used in a ``with`` block, a raw socket closed at the terminal byte) used to
cancel the commit that the handler awaited inline: records went missing from
the jsonlog file, the ledger and the usage totals without a word. Here every
variant sends a bounded number of exchanges with a session id, through the
ledger, usage and jsonlog plugins, and the books must show exactly that many,
each ``ok``. A slow commit hook must not hold up the next request on the same
keep-alive connection, and session close and process shutdown wait for commits.
"""

from __future__ import annotations

import asyncio
import json
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any, Final

import anthropic
import openai
import pytest

from plugins.jsonlog import JsonLogPlugin
from plugins.ledger import LedgerPlugin
from plugins.usage import UsagePlugin
from proxy import ExchangeRecord, Plugin
from proxy.testing import Harness, proxy_with_emulator
from tests.support.e2e import (
    ANTHROPIC_PATH,
    CHAT_PATH,
    RESPONSES_PATH,
    SECRET,
    RawClient,
    stream_body,
)
from tests.support.lifetime import Tally

#: Exchanges per variant: enough that a lost commit shows (the issue saw 6 of 20 lost).
PER_VARIANT: Final = 20
NEVER: Final = 3600.0  # ledger debounce: no test outlives it
SESSION_HEADER: Final = {
    CHAT_PATH: "x-session-id",
    RESPONSES_PATH: "session-id",
    ANTHROPIC_PATH: "x-claude-code-session-id",
}
#: The bytes that end each protocol's stream (the terminal event's data).
TERMINAL: Final = {
    CHAT_PATH: b"data: [DONE]",
    RESPONSES_PATH: b"response.completed",
    ANTHROPIC_PATH: b"message_stop",
}


def _books(
    tmp_path: Path,
) -> tuple[list[Plugin], JsonLogPlugin, LedgerPlugin, UsagePlugin, Path]:
    log = tmp_path / "exchanges.jsonl"
    jsonlog = JsonLogPlugin(path=str(log), max_bytes=0)
    ledger = LedgerPlugin(path=str(tmp_path / "ledger.db"), debounce=NEVER)
    usage = UsagePlugin()
    return [ledger, usage, jsonlog], jsonlog, ledger, usage, log


def _records(log: Path) -> list[dict[str, Any]]:
    if not log.exists():
        return []
    return [json.loads(line) for line in log.read_text().splitlines() if line]


def _sdk_call(h: Harness, path: str, stream: bool, sid: str) -> None:
    """One exchange through a fresh SDK client in a ``with`` block (closed at once)."""
    headers = {SESSION_HEADER[path]: sid}
    if path == ANTHROPIC_PATH:
        with anthropic.Anthropic(
            base_url=h.url, api_key=SECRET, max_retries=0, default_headers=headers
        ) as client:
            if stream:
                with client.messages.stream(
                    model="m", max_tokens=16, messages=[{"role": "user", "content": "hi"}]
                ) as events:
                    assert events.get_final_message().content
            else:
                answer = client.messages.create(
                    model="m", max_tokens=16, messages=[{"role": "user", "content": "hi"}]
                )
                assert answer.content
        return
    with openai.OpenAI(
        base_url=h.openai_base_url, api_key=SECRET, max_retries=0, default_headers=headers
    ) as oai:
        if path == CHAT_PATH:
            if stream:
                chunks = list(
                    oai.chat.completions.create(
                        model="m", messages=[{"role": "user", "content": "hi"}], stream=True
                    )
                )
                assert chunks
            else:
                reply = oai.chat.completions.create(
                    model="m", messages=[{"role": "user", "content": "hi"}]
                )
                assert reply.choices
        elif stream:
            events = oai.responses.create(model="m", input="hi", stream=True)
            kinds = [event.type for event in events]
            assert kinds[-1] == "response.completed"
        else:
            assert oai.responses.create(model="m", input="hi").output


async def _raw_call(h: Harness, path: str, stream: bool, sid: str) -> None:
    """One exchange over a raw socket closed right after the answer's terminal byte."""
    client = await RawClient.connect(h.url)
    try:
        await client.request(
            "POST",
            path,
            stream_body(path, stream=stream),
            headers=[(SESSION_HEADER[path], sid), ("Authorization", f"Bearer {SECRET}")],
        )
        head = await client.read_head()
        assert head.status == 200
        seen = b""
        async for data in client.iter_body(head):
            seen += data
            if stream:
                at = seen.find(TERMINAL[path])
                if at >= 0 and b"\n\n" in seen[at:]:
                    break  # the terminal event is complete: hang up now
            else:
                try:
                    json.loads(seen)
                except ValueError:
                    continue
                break  # the whole JSON answer: hang up now
        else:
            pytest.fail(f"{path}: the answer ended before its terminal byte")
    finally:
        await client.close()


VARIANTS: Final = [
    (kind, path, stream)
    for kind in ("sdk", "raw")
    for path in (CHAT_PATH, RESPONSES_PATH, ANTHROPIC_PATH)
    for stream in (True, False)
]


@pytest.mark.parametrize(
    ("kind", "path", "stream"),
    VARIANTS,
    ids=[f"{k}-{p.rsplit('/', 1)[-1]}-{'stream' if s else 'json'}" for k, p, s in VARIANTS],
)
async def test_every_exchange_is_booked_once_when_the_client_hangs_up_at_the_end(
    kind: str, path: str, stream: bool, tmp_path: Path
) -> None:
    plugins, _, ledger, usage, log = _books(tmp_path)
    sid = f"once-{kind}-{path.rsplit('/', 1)[-1]}-{stream}"
    async with proxy_with_emulator(plugins=plugins) as h:
        for _ in range(PER_VARIANT):
            if kind == "sdk":
                await asyncio.to_thread(_sdk_call, h, path, stream, sid)
            else:
                await _raw_call(h, path, stream, sid)
        await h.settle()
        commits = h.state.commits
        ledger_requests = ledger.session_state(sid).get("requests")
        usage_requests = usage.session_state(sid).get("requests")
        started, finished = commits.count("started"), commits.count("finished")
    records = _records(log)
    assert len(records) == PER_VARIANT, "a record is missing from (or doubled in) the jsonlog"
    assert Counter(r["exchange_id"] for r in records).most_common(1)[0][1] == 1
    # A complete answer followed by a hang-up is a success, booked as such.
    assert {(r["session_id"], r["status"], r["outcome"]) for r in records} == {(sid, 200, "ok")}
    assert ledger_requests == PER_VARIANT
    assert usage_requests == PER_VARIANT
    assert started == finished == PER_VARIANT


class Gate(Plugin):
    """A commit hook that waits until the test opens it (a slow bookkeeping backend)."""

    name = "gate"

    def __init__(self) -> None:
        self.opened = asyncio.Event()
        self.entered = asyncio.Event()
        self.booked: list[ExchangeRecord] = []

    async def commit(self, record: ExchangeRecord) -> None:
        self.entered.set()
        await self.opened.wait()
        self.booked.append(record)


async def test_a_slow_commit_does_not_hold_up_the_next_request_on_the_connection() -> None:
    gate = Gate()
    async with proxy_with_emulator(plugins=[gate], plugin_timeout=30.0) as h:
        client = await RawClient.connect(h.url)
        try:
            for _ in range(2):  # two requests on one keep-alive connection
                await client.request("POST", CHAT_PATH, stream_body(CHAT_PATH, stream=False))
                head = await client.read_head()
                assert head.status == 200
                assert json.loads(await client.read_body(head))["choices"]
                await asyncio.wait_for(gate.entered.wait(), 10.0)
            # Both answers arrived while the first commit was still blocked in its hook.
            assert gate.booked == []
            assert len(h.state.commits.pending) == 2
        finally:
            await client.close()
        gate.opened.set()
        await h.settle()
        assert len(gate.booked) == 2


async def test_session_close_waits_for_the_sessions_pending_commit() -> None:
    gate = Gate()
    order: list[str] = []

    class Closing(Plugin):
        name = "closing"

        async def session_closed(self, session_id: str) -> None:
            order.append(f"closed:{len(gate.booked)}")

    async with proxy_with_emulator(plugins=[gate, Closing()], plugin_timeout=30.0) as h:
        client = await RawClient.connect(h.url)
        try:
            await client.request(
                "POST",
                CHAT_PATH,
                stream_body(CHAT_PATH, stream=False),
                headers=[("x-session-id", "closing")],
            )
            head = await client.read_head()
            assert head.status == 200
            await client.read_body(head)
        finally:
            await client.close()
        await asyncio.wait_for(gate.entered.wait(), 10.0)
        closing = asyncio.create_task(
            h.state.registry.shutdown_session("closing", h.settings.session_shutdown_timeout)
        )
        await asyncio.sleep(0.2)  # would be long enough for the close to finish, had it not waited
        assert not closing.done() and order == []
        gate.opened.set()
        await asyncio.wait_for(closing, 10.0)
    # The plugins heard of the close only after the commit was booked.
    assert order == ["closed:1"]


async def test_shutdown_waits_for_pending_commits_before_the_plugins_stop(tmp_path: Path) -> None:
    gate = Gate()
    stopped: list[int] = []

    class Stop(Plugin):
        name = "stop"

        async def shutdown(self) -> None:
            stopped.append(len(gate.booked))

    async with proxy_with_emulator(plugins=[gate, Stop()], plugin_timeout=30.0) as h:
        client = await RawClient.connect(h.url)
        try:
            await client.request("POST", CHAT_PATH, stream_body(CHAT_PATH, stream=False))
            head = await client.read_head()
            await client.read_body(head)
        finally:
            await client.close()
        await asyncio.wait_for(gate.entered.wait(), 10.0)
        release: Callable[[], None] = gate.opened.set
        asyncio.get_running_loop().call_later(0.3, release)
    # Leaving the harness drained the proxy: the commit ran before the plugins stopped.
    assert stopped == [1]
    assert len(gate.booked) == 1


class Hung(Plugin):
    """A commit hook on a dependency that never answers: the host cuts it at ``plugin_timeout``."""

    name = "hung"

    async def commit(self, record: ExchangeRecord) -> None:
        await asyncio.Event().wait()


async def test_commits_queued_behind_a_hung_hook_are_not_timed_out_while_they_wait() -> None:
    # Budget: plugin_timeout x (plugins + 1) = 1.5 s of hook time per commit. Each commit
    # of the session runs after the one before, and each spends 0.5 s in the hung hook:
    # the fourth would have waited 1.5 s for the session lock. Counting that wait timed
    # out every commit from the fourth on, and the tally never saw them.
    hung, tally = Hung(), Tally()
    commits = 6
    async with proxy_with_emulator(plugins=[hung, tally], plugin_timeout=0.5) as h:
        client = await RawClient.connect(h.url)
        try:
            for _ in range(commits):
                await client.request(
                    "POST",
                    CHAT_PATH,
                    stream_body(CHAT_PATH, stream=False),
                    headers=[("x-session-id", "queued")],
                )
                head = await client.read_head()
                assert head.status == 200
                await client.read_body(head)
        finally:
            await client.close()
        await h.settle(within=60.0)
        assert tally.booked == commits
        assert h.state.commits.count("timed_out") == 0
        assert h.state.commits.count("finished") == commits


async def test_a_sessions_commit_backlog_is_bounded_and_refused_in_protocol_shape() -> None:
    # A hook that never returns in time: without a bound, every request of the session
    # queues one more record (and task) behind it, for as long as the client goes on.
    gate = Gate()
    async with proxy_with_emulator(plugins=[gate], plugin_timeout=60.0, max_pending_commits=3) as h:
        client = await RawClient.connect(h.url)
        try:
            statuses: list[int] = []
            for _ in range(5):
                await client.request(
                    "POST",
                    CHAT_PATH,
                    stream_body(CHAT_PATH, stream=False),
                    headers=[("x-session-id", "backlogged")],
                )
                head = await client.read_head()
                body = json.loads(await client.read_body(head))
                statuses.append(head.status)
            # Three admitted (their commits wait in the hook), then refused while they do.
            assert statuses == [200, 200, 200, 503, 503]
            assert head.headers.get("Retry-After") == "5"
            assert body["error"]["code"] == "commit_backlog"
            # The refusals queued nothing: the backlog is exactly what was admitted.
            assert h.state.commits.pending_for("backlogged") == 3
            # Another session is not held back by this one's backlog.
            await client.request(
                "POST",
                CHAT_PATH,
                stream_body(CHAT_PATH, stream=False),
                headers=[("x-session-id", "other")],
            )
            head = await client.read_head()
            await client.read_body(head)
            assert head.status == 200
            # Once the hook catches up, the session is served again; nothing was lost.
            gate.opened.set()
            await h.settle(within=30.0)
            await client.request(
                "POST",
                CHAT_PATH,
                stream_body(CHAT_PATH, stream=False),
                headers=[("x-session-id", "backlogged")],
            )
            head = await client.read_head()
            await client.read_body(head)
            assert head.status == 200
        finally:
            gate.opened.set()  # a failed assertion must not leave shutdown waiting
            await client.close()
        await h.settle(within=30.0)
        # 3 + "other" + the last, each once; the two refusals were not booked.
        assert [r.outcome for r in gate.booked] == ["ok"] * 5
        assert h.state.commits.count("timed_out") == 0


async def test_a_sessions_backlog_bound_counts_its_exchanges_in_flight() -> None:
    # Ten requests of one session at once, the commit hook stuck: the bound holds for
    # concurrent requests too (each exchange in flight has a commit on its way), so
    # exactly max_pending_commits are admitted and the rest refused.
    gate = Gate()
    async with proxy_with_emulator(plugins=[gate], plugin_timeout=60.0, max_pending_commits=3) as h:
        clients = [await RawClient.connect(h.url) for _ in range(10)]
        try:
            for client in clients:
                await client.request(
                    "POST",
                    CHAT_PATH,
                    stream_body(CHAT_PATH, stream=False),
                    headers=[("x-session-id", "crowd")],
                )
            statuses = []
            for client in clients:
                head = await client.read_head()
                await client.read_body(head)
                statuses.append(head.status)
            assert sorted(statuses) == [200] * 3 + [503] * 7
            assert h.state.commits.pending_for("crowd") == 3
        finally:
            gate.opened.set()
            for client in clients:
                await client.close()
        await h.settle(within=30.0)
        assert len(gate.booked) == 3

"""Usage you can read (issue 24, item 1): ``GET /admin/usage`` and the usage store.

Through a real proxy in front of the emulator, with the real SDKs: the totals per
model and per session match what the SDKs were billed, page by ``limit`` and
``cursor``, filter by ``since``; with a ``path`` they survive a restart of a real
``python -m proxy serve`` process (and, with ``sync = "commit"``, a ``kill -9``).
"""

from __future__ import annotations

import asyncio
import datetime
import os
import signal
import sqlite3
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any, Final
from urllib.parse import quote

import aiohttp
import anthropic
import openai
import pytest

from plugins.ledger import LedgerPlugin
from plugins.usage import UsagePlugin, UsageStoreError
from proxy import Plugin, UsagePage, UsageQuery
from proxy.testing import Harness, make_record, proxy_process, proxy_with_emulator, start_emulator
from tests.support.e2e import finished_commits

BOUND_S: Final = 20.0


@pytest.fixture
async def http() -> AsyncIterator[aiohttp.ClientSession]:
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=BOUND_S)) as session:
        yield session


async def get_json(http: aiohttp.ClientSession, url: str, status: int = 200) -> Any:
    async with http.get(url) as resp:
        assert resp.status == status, await resp.text()
        assert resp.content_type == "application/json"
        return await resp.json()


async def walk(http: aiohttp.ClientSession, base: str, query: str, limit: int) -> list[Any]:
    """Every page of ``GET /admin/usage?{query}`` with ``limit``, following ``next_cursor``."""
    pages = []
    cursor: str | None = None
    for _ in range(100):  # bounded: far more pages than any test makes
        url = f"{base}/admin/usage?{query}&limit={limit}"
        if cursor is not None:
            url += f"&cursor={cursor}"
        page = await get_json(http, url)
        pages.append(page)
        cursor = page["next_cursor"]
        if cursor is None:
            return pages
    raise AssertionError("the cursor never ended")


def row(key: str, requests: int, inputs: int, cached: int, outputs: int) -> dict[str, Any]:
    """An expected row without ``last_seen`` (compared apart)."""
    return {
        "key": key,
        "requests": requests,
        "input_tokens": inputs,
        "cached_input_tokens": cached,
        "cache_write_tokens": 0,
        "output_tokens": outputs,
    }


def without_time(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [{k: v for k, v in r.items() if k != "last_seen"} for r in rows]


async def two_clients_talk(h: Harness) -> tuple[list[Any], Any]:
    """Session ``alpha`` asks ``gpt-a`` twice (OpenAI chat), ``beta`` asks ``claude-b``
    once with 5 cached tokens (Anthropic, streamed). Returns what the SDKs were billed."""
    billed = []
    async with openai.AsyncOpenAI(
        base_url=h.openai_base_url,
        api_key="sk-test",
        default_headers={"x-session-id": "alpha"},
        max_retries=0,
    ) as chat:
        for text in ("hello", "hello again, a longer question"):
            answer = await chat.chat.completions.create(
                model="gpt-a", messages=[{"role": "user", "content": text}]
            )
            billed.append(answer.usage)
    async with (
        anthropic.AsyncAnthropic(
            base_url=h.url,
            api_key="sk-test",
            default_headers={"x-claude-code-session-id": "beta", "x-emulator": "cache_read=5"},
            max_retries=0,
        ) as claude,
        claude.messages.stream(
            model="claude-b", max_tokens=8, messages=[{"role": "user", "content": "hi"}]
        ) as events,
    ):
        message = await events.get_final_message()
    await h.settle()
    return billed, message.usage


@pytest.mark.parametrize("store", [False, True], ids=["memory", "sqlite"])
async def test_usage_by_model_and_by_session_is_what_the_sdks_were_billed(
    tmp_path: Path, http: aiohttp.ClientSession, store: bool
) -> None:
    plugin = UsagePlugin(path=str(tmp_path / "usage.db") if store else None, debounce=3600)
    before = time.time()
    async with proxy_with_emulator(plugins=[plugin]) as h:
        chat_usage, claude_usage = await two_clients_talk(h)
        after = time.time()
        by_model = await get_json(http, f"{h.url}/admin/usage?by=model")
        by_session = await get_json(http, f"{h.url}/admin/usage?by=session")
        default = await get_json(http, f"{h.url}/admin/usage")

    assert [u.prompt_tokens_details.cached_tokens for u in chat_usage] == [0, 0]
    chat_in = sum(u.prompt_tokens for u in chat_usage)
    chat_out = sum(u.completion_tokens for u in chat_usage)
    # The proxy's input_tokens is the whole prompt: Anthropic's cached part included.
    claude_in = claude_usage.input_tokens + (claude_usage.cache_read_input_tokens or 0)
    assert claude_usage.cache_read_input_tokens == 5
    assert by_model["by"] == "model" and by_model["next_cursor"] is None
    assert without_time(by_model["rows"]) == [
        row("claude-b", 1, claude_in, 5, claude_usage.output_tokens),
        row("gpt-a", 2, chat_in, 0, chat_out),
    ]
    assert by_session["by"] == "session" and by_session["next_cursor"] is None
    assert without_time(by_session["rows"]) == [
        row("alpha", 2, chat_in, 0, chat_out),
        row("beta", 1, claude_in, 5, claude_usage.output_tokens),
    ]
    assert default == by_model
    for r in by_model["rows"] + by_session["rows"]:
        assert before <= r["last_seen"] <= after


@pytest.mark.parametrize("store", [False, True], ids=["memory", "sqlite"])
async def test_pages_follow_the_cursor_and_since_selects_recent_rows(
    tmp_path: Path, http: aiohttp.ClientSession, store: bool
) -> None:
    plugin = UsagePlugin(path=str(tmp_path / "usage.db") if store else None)
    async with proxy_with_emulator(plugins=[plugin]) as h:
        async with openai.AsyncOpenAI(
            base_url=h.openai_base_url, api_key="sk-test", max_retries=0
        ) as chat:
            for sid in ("s3", "s1", "s5"):
                await chat.chat.completions.create(
                    model="m",
                    messages=[{"role": "user", "content": "hi"}],
                    extra_headers={"x-session-id": sid},
                )
            await h.settle()
            between = time.time()
            for sid in ("s2", "s4"):
                await chat.chat.completions.create(
                    model="m",
                    messages=[{"role": "user", "content": "hi"}],
                    extra_headers={"x-session-id": sid},
                )
            await h.settle()

        pages = await walk(http, h.url, "by=session", limit=2)
        assert [[r["key"] for r in page["rows"]] for page in pages] == [
            ["s1", "s2"],
            ["s3", "s4"],
            ["s5"],
        ]
        # Unix seconds or ISO-8601 (UTC unless it says otherwise): the rows seen since.
        iso = datetime.datetime.fromtimestamp(between, datetime.UTC).isoformat()
        naive = datetime.datetime.fromtimestamp(between, datetime.UTC).replace(tzinfo=None)
        for since in (str(between), iso, naive.isoformat()):
            recent = await walk(http, h.url, f"by=session&since={quote(since)}", limit=1)
            assert [r["key"] for page in recent for r in page["rows"]] == ["s2", "s4"], since
        future = await get_json(http, f"{h.url}/admin/usage?by=session&since={time.time() + 60}")
        assert future == {"by": "session", "rows": [], "next_cursor": None}


@pytest.mark.parametrize(
    ("query", "names"),
    [
        ("by=user", "by"),
        ("limit=0", "limit"),
        ("limit=251", "limit"),
        ("limit=ten", "limit"),
        ("since=yesterday", "since"),
        ("since=inf", "since"),
        ("cursor=%21%21", "cursor"),
        ("cursor=bm90LWlzc3VlZA", "cursor"),  # base64 without padding: not one we issue
    ],
)
async def test_bad_parameters_are_a_400_in_json(
    http: aiohttp.ClientSession, query: str, names: str
) -> None:
    async with proxy_with_emulator(plugins=[UsagePlugin()]) as h:
        answer = await get_json(http, f"{h.url}/admin/usage?{query}", status=400)
    assert answer["error"].startswith(f"{names}:")


async def test_without_the_usage_plugin_the_route_says_how_to_get_it(
    http: aiohttp.ClientSession,
) -> None:
    async with proxy_with_emulator(plugins=[]) as h:
        answer = await get_json(http, f"{h.url}/admin/usage", status=404)
    assert "usage plugin" in answer["error"]


async def test_a_closed_session_keeps_its_usage_row() -> None:
    plugin = UsagePlugin()
    await plugin.commit(make_record(session_id="gone", input_tokens=10, output_tokens=2))
    await plugin.session_closed("gone")
    assert plugin.session_state("gone") == {}  # the live view forgets it
    async with proxy_with_emulator(plugins=[plugin]) as h, aiohttp.ClientSession() as http:
        page = await get_json(http, f"{h.url}/admin/usage?by=session")
    assert without_time(page["rows"]) == [row("gone", 1, 10, 0, 2)]


async def test_the_store_adds_across_starts_and_refuses_a_foreign_file(tmp_path: Path) -> None:
    db = tmp_path / "usage.db"
    for _ in range(2):
        plugin = UsagePlugin(path=str(db))
        await plugin.startup()
        await plugin.commit(make_record(session_id="s", input_tokens=10, cache_read_tokens=4))
        await plugin.shutdown()
        assert plugin.writes == 1
    conn = sqlite3.connect(db)
    try:
        stored = conn.execute(
            "SELECT requests, input_tokens, cache_read_tokens FROM usage WHERE kind = 'session'"
        ).fetchall()
    finally:
        conn.close()
    assert stored == [(2, 20, 8)]
    UsagePlugin(path=str(db)).check()

    foreign = tmp_path / "foreign.db"
    conn = sqlite3.connect(foreign)
    conn.execute("CREATE TABLE t (x)")
    conn.close()
    with pytest.raises(UsageStoreError, match="not a usage store"):
        UsagePlugin(path=str(foreign)).check()
    with pytest.raises(UsageStoreError, match="not a usage store"):
        await UsagePlugin(path=str(foreign)).startup()
    with pytest.raises(UsageStoreError, match="directory"):
        UsagePlugin(path=str(tmp_path / "missing" / "usage.db")).check()


@pytest.mark.parametrize(
    ("option", "value"),
    [("path", ""), ("debounce", -1), ("sync", "always"), ("lock_timeout", 0)],
)
def test_bad_store_options_are_rejected(option: str, value: object) -> None:
    with pytest.raises(ValueError, match=option):
        UsagePlugin(**{option: value})  # type: ignore[arg-type]


# -- a real process: stop, start again, the totals are still there ---------------------------


async def _ask(http: aiohttp.ClientSession, url: str, n: int) -> None:
    for i in range(n):
        body = {"model": "m", "messages": [{"role": "user", "content": f"turn {i}"}]}
        async with http.post(
            f"{url}/v1/chat/completions", json=body, headers={"x-session-id": "keep"}
        ) as resp:
            assert resp.status == 200
            await resp.read()
    async with asyncio.timeout(BOUND_S):
        # A child process offers nothing to wait on: poll its metrics.
        while await finished_commits(http, url) < n:  # noqa: ASYNC110
            await asyncio.sleep(0.01)


@pytest.mark.parametrize(
    ("sync", "stop", "kept"),
    [
        ("debounced", "sigterm", 3),  # the graceful stop writes what the debounce held
        ("commit", "kill-9", 3),  # each commit was on disk before its hook returned
        ("debounced", "kill-9", 0),  # the documented cost of a kill -9 within the debounce
    ],
)
async def test_totals_survive_a_restart(
    tmp_path: Path, http: aiohttp.ClientSession, sync: str, stop: str, kept: int
) -> None:
    db = tmp_path / "usage.db"
    config = tmp_path / "proxy.toml"
    config.write_text(
        f'plugins = ["usage"]\n[plugin.usage]\npath = "{db}"\nsync = "{sync}"\ndebounce = 3600\n'
    )
    emulator = await start_emulator()
    try:
        async with proxy_process("--upstream-openai", emulator.url, config=config) as child:
            await _ask(http, child.url, 3)
            if stop == "sigterm":
                # Read first (a read writes what is held, then reads the store).
                first = await get_json(http, f"{child.url}/admin/usage?by=session")
                assert await child.stop() == 0
            else:
                os.kill(child.pid, signal.SIGKILL)
                # 255: asyncio's child watcher found the pid already reaped.
                assert await child.stop() in (-signal.SIGKILL, 255)
        async with proxy_process("--upstream-openai", emulator.url, config=config) as child:
            again = await get_json(http, f"{child.url}/admin/usage?by=session")
            by_model = await get_json(http, f"{child.url}/admin/usage?by=model")
            await _ask(http, child.url, 1)
            more = await get_json(http, f"{child.url}/admin/usage?by=session")
            assert await child.stop() == 0
    finally:
        await emulator.close()
    if stop == "sigterm":
        assert again["rows"] == first["rows"]
    if kept:
        [before] = again["rows"]
        assert before["key"] == "keep"
        assert before["requests"] == kept and before["input_tokens"] > 0
        assert without_time(by_model["rows"]) == [{**without_time(again["rows"])[0], "key": "m"}]
    else:
        assert again["rows"] == []
    [after] = more["rows"]
    assert after["requests"] == kept + 1


# -- the two hooks behind these views fail like any other hook -------------------------------


class BrokenStorage(Plugin):
    """A plugin whose storage views raise: its failures are logged and counted."""

    name = "broken"

    def stored_sessions(self) -> list[tuple[str, float]]:
        raise OSError("disk gone")

    async def usage_page(self, query: UsageQuery) -> UsagePage:
        raise OSError("disk gone")


class Remembers(Plugin):
    """Reports two sessions from storage, one of them also reported by another plugin."""

    name = "remembers"

    def stored_sessions(self) -> list[tuple[str, float]]:
        return [("from-disk", time.time() - 600), ("", 0.0), ("twice", time.time() - 60)]


class AlsoRemembers(Plugin):
    name = "also"

    def stored_sessions(self) -> list[tuple[str, float]]:
        return [("twice", time.time() - 6000)]


async def test_a_failing_storage_hook_is_isolated(http: aiohttp.ClientSession) -> None:
    plugins = [BrokenStorage(), Remembers(), AlsoRemembers()]
    async with proxy_with_emulator(plugins=plugins) as h:
        failed = await get_json(http, f"{h.url}/admin/usage", status=503)
        listing = await get_json(http, f"{h.url}/admin/sessions")
        assert h.state.host.failures == {"broken": 2}
    assert "failed" in failed["error"]
    # An empty id is no session; one reported twice counts at its latest activity.
    idle = {s["id"]: s["idle_s"] for s in listing["sessions"]}
    assert sorted(idle) == ["from-disk", "twice"]
    assert 600 <= idle["from-disk"] < 700 and 60 <= idle["twice"] < 160
    assert all(s["live"] is False for s in listing["sessions"])


async def test_in_memory_the_session_rows_are_capped_least_recent_first() -> None:
    plugin = UsagePlugin(max_sessions=2)
    # "b" pushes "a" out; "c" is then used again, so "d" pushes out "b", not "c".
    for sid in ("a", "c", "b", "c", "d"):
        await plugin.commit(make_record(session_id=sid, input_tokens=1))
    page = await plugin.usage_page(UsageQuery(by="session", since=None, after=None, limit=5))
    assert [(r.key, r.requests) for r in page.rows] == [("c", 2), ("d", 1)]
    assert not page.more
    later = await plugin.usage_page(UsageQuery(by="session", since=None, after="c", limit=5))
    assert [r.key for r in later.rows] == ["d"]


async def test_a_failed_write_keeps_the_totals_for_the_next_one(tmp_path: Path) -> None:
    """``sync = "commit"``: a write that cannot take the lock raises from the hook; the
    totals stay counted in memory and held, and the next write stores them all."""
    db = tmp_path / "usage.db"
    plugin = UsagePlugin(path=str(db), sync="commit", lock_timeout=0.05)
    await plugin.startup()
    try:
        await plugin.commit(make_record(session_id="s", input_tokens=1))
        other = sqlite3.connect(db, isolation_level=None)
        other.execute("BEGIN IMMEDIATE")  # another process holds the write lock
        try:
            with pytest.raises(UsageStoreError, match="write failed"):
                await plugin.commit(make_record(session_id="s", input_tokens=10))
        finally:
            other.execute("ROLLBACK")
            other.close()
        assert plugin.write_errors == 1
        assert plugin.session_state("s")["input_tokens"] == 11  # counted in memory anyway
        await plugin.commit(make_record(session_id="s", input_tokens=100))
        page = await plugin.usage_page(UsageQuery(by="session", since=None, after=None, limit=5))
    finally:
        await plugin.shutdown()
    assert [(r.requests, r.input_tokens) for r in page.rows] == [(3, 111)]


# -----------------------------------------------------------------------------
# A store (usage, ledger) locked by another process does not hold the shutdown past
# its budget (the ledger's case is still open: xfail).
#
# With ``sync = "commit"`` every commit queues a write on the store's one thread; with
# the file locked each waits ``lock_timeout`` in turn. The shutdown hook's budget
# (10 s) ran out, and closing the store then waited for every queued write: 60
# commits at 0.5 s each kept the proxy from exiting for 30 s (an orchestrator's
# grace period is often 30 s: the kill lands before the other plugins are stopped).


COMMITS = 60
LOCK_S = 0.5
#: The shutdown hook's budget (proxy/_plugins.py: at least 10 s), the write running
#: when it ends, and slack: far below COMMITS * LOCK_S.
LOCKED_BOUND_S = 10.0 + LOCK_S + 4.0


async def test_a_locked_store_does_not_hold_the_shutdown_past_its_budget(tmp_path: Path) -> None:
    db = tmp_path / "usage.db"
    plugin = UsagePlugin(path=str(db), sync="commit", lock_timeout=LOCK_S)
    harness = proxy_with_emulator(plugins=[plugin], plugin_timeout=0.2)
    h = await harness.__aenter__()
    locker = sqlite3.connect(db, isolation_level=None)
    try:
        locker.execute("BEGIN EXCLUSIVE")
        async with aiohttp.ClientSession() as http:
            for i in range(COMMITS):
                async with http.post(
                    f"{h.url}/v1/chat/completions",
                    json={"model": "m", "messages": [{"role": "user", "content": "hi"}]},
                    headers={"x-session-id": f"s{i}", "authorization": "Bearer k"},
                ) as answer:
                    assert answer.status == 200
                    await answer.read()
        started = time.monotonic()
        async with asyncio.timeout(COMMITS * LOCK_S + 30):  # bounded even when it fails
            await harness.__aexit__(None, None, None)
        took = time.monotonic() - started
    finally:
        locker.close()
    assert took < LOCKED_BOUND_S, f"shutdown took {took:.1f} s"


LEDGER_SESSIONS = 24
LEDGER_LOCK_S = 1.0


@pytest.mark.xfail(
    strict=True,
    reason="the drain closes sessions one at a time and each ledger session_closed "
    "waits its plugin_timeout on the locked file, then LedgerPlugin._close waits "
    "lock_timeout for every queued write (the usage plugin's _close fix applies to "
    "the second; the first needs a total budget for SessionRegistry.close_all)",
)
async def test_a_locked_ledger_does_not_hold_the_shutdown_past_its_budget(
    tmp_path: Path,
) -> None:
    db = tmp_path / "ledger.db"
    plugin = LedgerPlugin(path=str(db), sync="commit", lock_timeout=LEDGER_LOCK_S)
    harness = proxy_with_emulator(plugins=[plugin], plugin_timeout=0.5)
    h = await harness.__aenter__()
    locker = sqlite3.connect(db, isolation_level=None)
    try:
        locker.execute("BEGIN EXCLUSIVE")
        async with aiohttp.ClientSession() as http:

            async def one(i: int) -> int:
                async with http.post(
                    f"{h.url}/v1/chat/completions",
                    json={"model": "m", "messages": [{"role": "user", "content": "hi"}]},
                    headers={"x-session-id": f"s{i}", "authorization": "Bearer k"},
                ) as answer:
                    await answer.read()
                    return answer.status

            statuses = await asyncio.gather(*(one(i) for i in range(LEDGER_SESSIONS)))
            assert statuses == [200] * LEDGER_SESSIONS
            await asyncio.sleep(1)
        started = time.monotonic()
        async with asyncio.timeout(LEDGER_SESSIONS * LEDGER_LOCK_S + 30):
            await harness.__aexit__(None, None, None)
        took = time.monotonic() - started
    finally:
        locker.close()
    assert took < 10.0 + LEDGER_LOCK_S + 4.0, f"shutdown took {took:.1f} s"

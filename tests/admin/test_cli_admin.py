"""CLI and admin niceties (issue 12, item 6): ``DELETE ...?wait=false``, ``sessions --json``,
the admin token from the environment; the ``usage`` table (issue 24, item 1)."""

from __future__ import annotations

import asyncio
import json
import re
import time
from collections.abc import AsyncIterator
from pathlib import Path

import aiohttp
import click
import pytest
from click.testing import CliRunner, Result

from plugins.ledger import LedgerPlugin
from plugins.usage import UsagePlugin
from proxy._cli import USAGE_PAGE, _age
from proxy._cli import main as cli_main
from proxy.testing import Harness, make_record, proxy_with_emulator

CHAT = "/v1/chat/completions"
BOUND_S = 10.0
#: Long enough that a close waiting for it is unmistakable.
SHUTDOWN_TIMEOUT_S = 30.0
TOKEN = "admin-tok-env-5e5e"


def _body(model: str) -> dict[str, object]:
    return {"model": model, "stream": True, "messages": [{"role": "user", "content": "hi"}]}


@pytest.fixture
async def http() -> AsyncIterator[aiohttp.ClientSession]:
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=60)) as session:
        yield session


async def _held_stream(
    http: aiohttp.ClientSession, h: Harness, sid: str, key: str
) -> asyncio.Task[int]:
    """A chat stream of session ``sid`` the emulator holds open until ``key`` is released."""

    async def run() -> int:
        headers = {"x-session-id": sid, "x-emulator": f"hold={key}"}
        async with http.post(h.url + CHAT, json=_body(sid), headers=headers) as resp:
            await resp.read()
            return resp.status

    task = asyncio.create_task(run())
    async with asyncio.timeout(BOUND_S):
        while not any(r.holding == key for r in h.emulator.stats):  # noqa: ASYNC110
            await asyncio.sleep(0.02)
    return task


async def test_wait_false_answers_202_at_once_and_the_close_finishes_in_the_background(
    http: aiohttp.ClientSession,
) -> None:
    async with proxy_with_emulator(plugins=[], session_shutdown_timeout=SHUTDOWN_TIMEOUT_S) as h:
        sid = "sess-nowait"
        stream = await _held_stream(http, h, sid, "nowait")
        async with asyncio.timeout(BOUND_S):  # far below the 30 s the close may take
            async with http.delete(f"{h.url}/admin/sessions/{sid}?wait=false") as resp:
                assert resp.status == 202
                assert await resp.json() == {"id": sid, "status": "closing"}
        # Tombstoned before the answer: a new request of the session is refused.
        async with http.post(h.url + CHAT, json=_body("late"), headers={"x-session-id": sid}) as r:
            assert r.status == 503
        assert not stream.done()
        # The in-flight stream ends, and the close completes shortly after.
        h.emulator.release("nowait")
        async with asyncio.timeout(BOUND_S):
            assert await stream == 200
            while h.state.registry.info(sid) is not None:  # noqa: ASYNC110
                await asyncio.sleep(0.02)
        async with http.get(f"{h.url}/admin/sessions/{sid}") as resp:
            assert resp.status == 200
            assert (await resp.json())["tombstoned"] is True


async def test_the_default_delete_waits_and_answers_with_the_counts(
    http: aiohttp.ClientSession,
) -> None:
    async with proxy_with_emulator(plugins=[], session_shutdown_timeout=SHUTDOWN_TIMEOUT_S) as h:
        sid = "sess-wait"
        stream = await _held_stream(http, h, sid, "wait")
        delete = asyncio.create_task(http.delete(f"{h.url}/admin/sessions/{sid}"))
        await asyncio.sleep(0.3)
        assert not delete.done(), "the default close waits for in-flight exchanges"
        h.emulator.release("wait")
        async with asyncio.timeout(BOUND_S):
            resp = await delete
            assert resp.status == 200
            assert await resp.json() == {
                "id": sid,
                "finished": 1,
                "cancelled": 0,
                "already_closed": False,
            }
            assert await stream == 200
        async with http.delete(f"{h.url}/admin/sessions/{sid}?wait=maybe") as resp:
            assert resp.status == 400


async def test_sessions_json_parses_and_the_token_comes_from_the_environment(
    http: aiohttp.ClientSession,
) -> None:
    # No address is allowed without the token: the CLI must send it.
    async with proxy_with_emulator(plugins=[], admin_allow=[], admin_token=TOKEN) as h:
        for sid in ("s-one", "s-two"):
            async with http.post(h.url + CHAT, json=_body(sid), headers={"x-session-id": sid}) as r:
                assert r.status == 200
                await r.read()
        await h.settle()
        runner = CliRunner()
        args = ["sessions", "--url", h.url, "--json"]
        refused = await asyncio.to_thread(
            runner.invoke, cli_main, args, env={"CONTEXT_PROXY_ADMIN_TOKEN": None}
        )
        assert refused.exit_code == 1 and "HTTP 403" in refused.output
        result = await asyncio.to_thread(
            runner.invoke, cli_main, args, env={"CONTEXT_PROXY_ADMIN_TOKEN": TOKEN}
        )
    assert result.exit_code == 0, result.output
    listed = json.loads(result.output)["sessions"]
    assert sorted(entry["id"] for entry in listed) == ["s-one", "s-two"]
    assert all(entry["requests"] == 1 and entry["tombstoned"] is False for entry in listed)
    assert TOKEN not in result.output


async def test_a_refused_sessions_command_says_how_to_pass_the_token() -> None:
    """Under ``admin_allow = []`` the 403 names the variable and the option to set;
    a wrong token is said to be refused, and never printed."""
    async with proxy_with_emulator(plugins=[], admin_allow=[], admin_token=TOKEN) as h:
        runner = CliRunner()
        args = ["sessions", "--url", h.url]
        missing = await asyncio.to_thread(
            runner.invoke, cli_main, args, env={"CONTEXT_PROXY_ADMIN_TOKEN": None}
        )
        wrong = await asyncio.to_thread(
            runner.invoke, cli_main, args, env={"CONTEXT_PROXY_ADMIN_TOKEN": "not-the-token"}
        )
    assert missing.exit_code == 1
    assert "HTTP 403: set CONTEXT_PROXY_ADMIN_TOKEN or --token" in missing.output
    assert wrong.exit_code == 1
    assert "HTTP 403: the proxy refused this admin token" in wrong.output
    assert "not-the-token" not in wrong.output


@pytest.mark.parametrize("kind", ["memory", "overhead", "concurrency"])
def test_every_benchmark_is_a_click_command_under_the_cli(kind: str) -> None:
    import importlib

    import click

    module = importlib.import_module(f"benchmarks.{kind}")
    assert isinstance(module.command, click.Command)
    runner = CliRunner()
    shown = runner.invoke(cli_main, ["bench", kind, "--help"])
    assert shown.exit_code == 0
    assert shown.output.startswith(f"Usage: context-proxy bench {kind} [OPTIONS]")
    bad = runner.invoke(cli_main, ["bench", kind, "--out"])
    assert bad.exit_code == 2
    assert "Error: Option '--out' requires an argument." in bad.output


async def test_the_sessions_table_prints_ages_and_keeps_numbers_whole_at_80_columns(
    http: aiohttp.ClientSession, tmp_path: Path
) -> None:
    """The ledger's ``last_activity`` (Unix seconds) and ``idle_s`` show as ages; a
    long id is cut with an ellipsis; no number is split across lines."""
    ledger = LedgerPlugin(path=str(tmp_path / "ledger.db"), debounce=0.01)
    sids = ["s-" + "x" * 70, "short-one"]
    async with proxy_with_emulator(plugins=[ledger]) as h:
        for sid in sids:
            async with http.post(h.url + CHAT, json=_body(sid), headers={"x-session-id": sid}) as r:
                assert r.status == 200
                await r.read()
        await h.settle()
        result = await asyncio.to_thread(
            CliRunner().invoke, cli_main, ["sessions", "--url", h.url], env={"COLUMNS": "80"}
        )
    assert result.exit_code == 0, result.output
    lines = result.output.splitlines()
    assert all(len(line) <= 80 for line in lines), result.output
    assert not re.search(r"\d{9,}\.\d", result.output), result.output  # no epoch float
    assert " last_activity=just now" in result.output, result.output
    assert "…" in result.output and "short-one" in result.output
    # Every ledger number sits whole on its line, right after its key.
    for key in ("requests", "bytes_in", "bytes_out", "revision_epoch"):
        assert len(re.findall(rf"^ +{key}=\d+$", result.output, re.M)) == 2, result.output


def test_ages_read_as_a_person_says_them() -> None:
    assert [_age(s) for s in (0.2, 42.9, 180.0, 7300.0, 200000.0)] == [
        "just now",
        "42 s ago",
        "3 m ago",
        "2 h ago",
        "2 d ago",
    ]


async def test_the_usage_table_fits_80_columns_with_big_numbers_abbreviated(
    http: aiohttp.ClientSession,
) -> None:
    """``context-proxy usage``: a row per model or session, most recent first, every
    number whole on its row (a billion tokens as 1.2G), follows the cursor; --json has
    the exact counts."""
    plugin = UsagePlugin()
    # A long-lived session's totals (older, and too big to print whole).
    await plugin.commit(
        make_record(
            session_id="s-" + "y" * 70,
            model="claude-big",
            input_tokens=1_234_567_890,
            cache_read_tokens=987_654_321,
            cache_write_tokens=12_345_678,
            output_tokens=4_567_890,
        )
    )
    async with proxy_with_emulator(plugins=[plugin]) as h:
        for n in range(USAGE_PAGE + 2):  # more models than a page: the CLI follows the cursor
            headers = {"x-session-id": "fresh"}
            async with http.post(h.url + CHAT, json=_body(f"m{n:03}"), headers=headers) as r:
                assert r.status == 200
                await r.read()
        await h.settle()

        def run(*args: str) -> Result:
            return CliRunner().invoke(cli_main, ["usage", "--url", h.url, *args])

        by_session = await asyncio.to_thread(run, "--by", "session")
        by_model = await asyncio.to_thread(run, "--json")
        recent = await asyncio.to_thread(run, "--by", "session", "--since", "1h")
        nothing = await asyncio.to_thread(run, "--since", str(time.time() + 60))
        bad = await asyncio.to_thread(run, "--since", "last week")
    assert by_session.exit_code == 0, by_session.output
    lines = by_session.output.splitlines()
    assert all(len(line) <= 80 for line in lines), by_session.output
    assert lines[0].split() == ["cache", "cache"]
    assert lines[1].split() == [
        "session",
        "requests",
        "input",
        "read",
        "write",
        "output",
        "last",
        "seen",
    ]
    # Most recent first: the emulator's session, then the big one (its record is from 2023).
    assert lines[2].split()[:2] == ["fresh", str(USAGE_PAGE + 2)]
    assert lines[2].endswith("just now")
    assert lines[3].split()[1:6] == ["1", "1.2G", "988M", "12M", "4.6M"], by_session.output
    assert "…" in lines[3] and len(lines) == 4
    listed = json.loads(by_model.output)
    assert listed["by"] == "model"
    assert len(listed["rows"]) == USAGE_PAGE + 3
    [big] = [r for r in listed["rows"] if r["key"] == "claude-big"]
    assert (big["input_tokens"], big["cached_input_tokens"]) == (1_234_567_890, 987_654_321)
    assert [r.split()[0] for r in recent.output.splitlines()[2:]] == ["fresh"]
    assert nothing.exit_code == 0 and nothing.output == "no usage\n"
    assert bad.exit_code == 1 and "HTTP 400 (since: expected" in bad.output


async def test_the_usage_command_says_when_the_plugin_is_not_enabled() -> None:
    async with proxy_with_emulator(plugins=[]) as h:
        result = await asyncio.to_thread(CliRunner().invoke, cli_main, ["usage", "--url", h.url])
    assert result.exit_code == 1
    assert "HTTP 404 (no usage kept: enable the usage plugin" in result.output


async def test_ledger_sessions_loaded_at_start_up_are_listed_as_not_live(
    http: aiohttp.ClientSession, tmp_path: Path
) -> None:
    """Run, stop, start again: the ledger's saved sessions are in ``/admin/sessions``
    (``live: false``), ``GET /admin/sessions/{id}`` (not 404) and ``context-proxy
    sessions``; a request makes one live; one never used stays stored."""
    db = tmp_path / "ledger.db"
    async with proxy_with_emulator(plugins=[LedgerPlugin(path=str(db))]) as h:
        for sid in ("used-again", "stays-stored", "used-again"):
            async with http.post(h.url + CHAT, json=_body(sid), headers={"x-session-id": sid}) as r:
                assert r.status == 200
                await r.read()
        await h.settle()
    for start in range(2):  # the second start proves the first one's stop kept them stored
        async with proxy_with_emulator(plugins=[LedgerPlugin(path=str(db))]) as h:
            async with http.get(h.url + "/admin/sessions") as resp:
                listed = {s["id"]: s for s in (await resp.json())["sessions"]}
            assert sorted(listed) == ["stays-stored", "used-again"]
            assert all(s["live"] is False and s["requests"] == 0 for s in listed.values())
            assert all(s["idle_s"] >= 0 and s["in_flight"] == 0 for s in listed.values())
            view = await h.session_view("used-again")
            assert view is not None and view["live"] is False
            assert view["plugins"]["ledger"]["requests"] == 2 + start
            table = await asyncio.to_thread(
                CliRunner().invoke, cli_main, ["sessions", "--url", h.url], env={"COLUMNS": "80"}
            )
            assert table.exit_code == 0, table.output
            rows = {line.split()[0]: line.split()[1:] for line in table.output.splitlines()[1:]}
            # in_flight, requests, active ("N s ago" or "just now": 2 words), state
            assert rows["stays-stored"][0:2] == ["0", "0"], table.output
            assert rows["stays-stored"][4] == "stored", table.output
            async with http.post(
                h.url + CHAT, json=_body("m"), headers={"x-session-id": "used-again"}
            ) as r:
                assert r.status == 200
                await r.read()
            await h.settle()
            view = await h.session_view("used-again")
            assert view is not None and view["live"] is True and view["requests"] == 1
            assert view["plugins"]["ledger"]["requests"] == 3 + start
            stored = await h.session_view("stays-stored")
            assert stored is not None and stored["live"] is False


def test_a_proxy_that_repeats_a_page_cursor_cannot_keep_the_cli_looping(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from proxy import _cli

    asked: list[str] = []

    def same_page(url: str, token: str | None) -> dict[str, object]:
        asked.append(url)
        return {"sessions": [{"id": f"s{len(asked)}"}], "next_cursor": "again"}

    monkeypatch.setattr(_cli, "_admin_get", same_page)
    with pytest.raises(click.ClickException, match="repeated a page cursor"):
        list(_cli._listing("http://127.0.0.1:9", None))
    assert len(asked) == 2

"""CLI and admin niceties (issue 12, item 6): ``DELETE ...?wait=false``, ``sessions --json``,
the admin token from the environment."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator

import aiohttp
import pytest
from click.testing import CliRunner

from proxy._cli import main as cli_main
from proxy.testing import Harness, proxy_with_emulator

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

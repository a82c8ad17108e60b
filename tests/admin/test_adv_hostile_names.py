"""Names a client chooses (model, session id) reach the operator's terminal as text.

A model or session id is whatever a client sent: ``[/x]`` is rich markup (a closing
tag with no opening one made ``context-proxy usage`` and ``top`` die with a
``MarkupError`` traceback for every operator), an ESC sequence would drive the
terminal, and a ``/`` in a session id made ``GET``/``DELETE /admin/sessions/{id}``
a 404, so the session could be neither shown nor closed, and ``context-proxy
sessions`` failed as a whole.
"""

from __future__ import annotations

import asyncio
import urllib.parse

import aiohttp
from click.testing import CliRunner, Result

from plugins.usage import UsagePlugin
from proxy import _top as top
from proxy._cli import main as cli_main
from proxy.testing import Harness, proxy_with_emulator

MARKUP = "[/x]"
ESCAPE = "evil\x1b]0;title\x07\x1b[2J"
SLASHED = "team/42"


async def _send(h: Harness, http: aiohttp.ClientSession, model: str, session: str) -> None:
    async with http.post(
        f"{h.url}/v1/chat/completions",
        json={"model": model, "messages": [{"role": "user", "content": "hi"}]},
        headers={"x-session-id": session, "authorization": "Bearer k"},
    ) as answer:
        assert answer.status == 200
        await answer.read()


async def _cli(*args: str) -> Result:
    return await asyncio.to_thread(CliRunner().invoke, cli_main, list(args), env={"COLUMNS": "120"})


async def test_usage_prints_markup_and_escapes_in_names_as_text() -> None:
    async with proxy_with_emulator(plugins=[UsagePlugin()]) as h, aiohttp.ClientSession() as http:
        await _send(h, http, MARKUP, "[/y]")
        await _send(h, http, ESCAPE, "plain")
        await h.settle()
        by_model = await _cli("usage", "--url", h.url)
        by_session = await _cli("usage", "--by", "session", "--url", h.url)
    assert by_model.exit_code == 0, by_model.output
    assert by_session.exit_code == 0, by_session.output
    assert MARKUP in by_model.output and "[/y]" in by_session.output
    assert "\x1b" not in by_model.output and "\x07" not in by_model.output
    assert "evil\\x1b]0;title" in by_model.output


def test_top_draws_a_session_id_that_looks_like_markup() -> None:
    snap = {
        "rss_bytes": 1,
        "held_by_phase": {},
        "exchanges": [
            {
                "id": "ex-1",
                "protocol": "openai-chat",
                "session": "[/x]",
                "phase": "sent",
                "fold_level": 0,
                "age_s": 1.0,
                "held_bytes": {},
            },
        ],
    }
    assert "[/x]" in top.print_once(snap, 120)


async def test_a_session_id_with_a_slash_can_be_shown_listed_and_closed() -> None:
    async with proxy_with_emulator(plugins=[UsagePlugin()]) as h, aiohttp.ClientSession() as http:
        await _send(h, http, "m", SLASHED)
        await h.settle()
        url = f"{h.url}/admin/sessions/{urllib.parse.quote(SLASHED, safe='')}"
        async with http.get(url) as answer:
            assert answer.status == 200, await answer.text()
            assert (await answer.json())["id"] == SLASHED
        listed = await _cli("sessions", "--url", h.url)
        assert listed.exit_code == 0, listed.output
        assert SLASHED in listed.output
        async with http.delete(url) as answer:
            assert answer.status in (200, 202), await answer.text()
        async with http.get(url) as answer:
            assert answer.status == 200
            assert (await answer.json())["tombstoned"] is True

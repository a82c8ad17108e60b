"""Adversarial checks of carried folds (docs/plugins.md, "Carried folds").

The real ``fold`` plugin in a proxy in front of a tap that routes each body by
its ``model`` to one of two emulators with different context windows, so a
session that switches models meets an upstream that has room for its history.
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import AsyncIterator
from typing import Any, cast

import aiohttp
import openai
import pytest
from aiohttp import web

from plugins.fold import FoldPlugin
from proxy._emulator import EmulatorServer, start_emulator
from proxy._emulator_script import window_script
from proxy.testing import Harness
from tests.plugins.test_carried_fold import (
    PLACEHOLDER_MARK,
    WINDOW_TOKENS,
    _text,
    opening,
    proxy_on,
    tapped,
)
from tests.support.ports import serve_app

#: The model whose upstream has ten times the window of the others.
BIG = "gpt-big"


@contextlib.asynccontextmanager
async def routed() -> AsyncIterator[tuple[Harness, EmulatorServer, list[tuple[str, bytes]]]]:
    """A proxy with ``fold`` whose upstream sends :data:`BIG`'s bodies to an emulator with
    ten times the window; yields the harness (on the small one), the big emulator and
    the ``(model, body)`` of every body the upstream received."""
    small = await start_emulator(default_script=window_script(WINDOW_TOKENS))
    big = await start_emulator(default_script=window_script(10 * WINDOW_TOKENS))
    seen: list[tuple[str, bytes]] = []
    http = aiohttp.ClientSession()

    async def relay(request: web.Request) -> web.Response:
        body = await request.read()
        model = json.loads(body)["model"]
        seen.append((model, body))
        target = big if model == BIG else small
        headers = {"Content-Type": "application/json"}
        async with http.post(target.url + request.path_qs, data=body, headers=headers) as up:
            answer = await up.read()
            return web.Response(status=up.status, body=answer, content_type=up.content_type)

    app = web.Application()
    app.router.add_post("/{tail:.*}", relay)
    try:
        async with serve_app(app) as url, proxy_on(url, small, FoldPlugin()) as h:
            yield h, big, seen
    finally:
        await http.close()
        await small.close()
        await big.close()


async def ask(h: Harness, session: str, model: str, history: list[tuple[str, str]]) -> str:
    """One chat request of ``session`` to ``model`` through the proxy; the answer's text."""
    async with openai.AsyncOpenAI(
        base_url=h.openai_base_url,
        api_key="test",
        max_retries=0,
        default_headers={"x-session-id": session},
    ) as client:
        messages: list[dict[str, Any]] = [{"role": "system", "content": "Be careful."}]
        messages += [{"role": r, "content": t} for r, t in history]
        chat = await client.chat.completions.create(model=model, messages=cast(Any, messages))
        return chat.choices[0].message.content or ""


async def test_a_session_that_switches_to_a_larger_model_gets_its_history_unfolded() -> None:
    """The carried fold was learned against one model's window: a model with room for
    the whole history must receive it as the client sent it, not with old turns elided."""
    async with routed() as (h, big, seen):
        history = opening(18)
        answer = await ask(h, "switch-1", "gpt-test", history)
        await h.settle()
        assert [r.status for r in h.emulator.stats] == [400, 200]
        assert PLACEHOLDER_MARK in seen[1][1]  # folded for the small model

        history = [*history, ("assistant", answer), ("user", "And with the big model?")]
        await ask(h, "switch-1", BIG, history)
        await h.settle()
        assert [r.status for r in big.stats] == [200]
        model, body = seen[2]
        assert model == BIG
        assert PLACEHOLDER_MARK not in body, "the big model got a folded history"


def _marked(history: list[dict[str, Any]], marks: int) -> list[dict[str, Any]]:
    """``history`` with a ``cache_control`` breakpoint on the last ``marks`` user
    messages (Anthropic's multi-turn caching pattern: it moves forward every turn)."""
    out = json.loads(json.dumps(history))
    users = [m for m in out if m["role"] == "user"]
    for message in users[len(users) - marks :] if marks else []:
        message["content"][-1]["cache_control"] = {"type": "ephemeral"}
    return out


@pytest.mark.parametrize("marks", [0, 1, 2])
async def test_moving_cache_breakpoints_do_not_cost_the_carried_fold(marks: int) -> None:
    """A Messages client that moves its ``cache_control`` breakpoints to the newest user
    messages every turn: the carried fold keeps being applied, so 28 turns of a growing
    history past the window cost about as few rejected round trips as without markers."""
    async with tapped(FoldPlugin()) as (h, _tap):
        history: list[dict[str, Any]] = [
            {"role": "user", "content": [{"type": "text", "text": "Fix the parser."}]}
        ]
        async with aiohttp.ClientSession() as http:
            for turn in range(28):
                # A bulky block and a short one each (the short ones never fold, so
                # the cut has to move up to the newest turns).
                for role in ("assistant", "user"):
                    blocks = [_text(f"{role}{turn}", 3000), _text(f"{role}{turn}", 1000)]
                    content = [{"type": "text", "text": text} for text in blocks]
                    history.append({"role": role, "content": content})
                body = {
                    "model": "claude-test",
                    "max_tokens": 64,
                    "system": "Be careful.",
                    "messages": _marked(history, marks),
                }
                headers = {"x-claude-code-session-id": "marks", "anthropic-version": "2023-06-01"}
                async with http.post(h.url + "/v1/messages", json=body, headers=headers) as resp:
                    assert resp.status == 200, await resp.text()
                    await resp.read()
        await h.settle()
        rejected = sum(r.status != 200 for r in h.emulator.stats)
    assert rejected <= 2, f"{rejected} rejected round trips"

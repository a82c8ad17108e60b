"""`emulate --context-window-tokens N`: prompts above N tokens get the overflow error."""

from __future__ import annotations

import json

import aiohttp

from proxy._protocols._overflow import is_overflow_payload
from tests.support.process import Proc


async def test_cli_window_rejects_longer_prompts_in_each_protocol() -> None:
    proc = await Proc.start("emulator", "emulate", "--port", "0", "--context-window-tokens", "100")
    try:
        url = (await proc.wait_line(r"listening on (http://\S+)", within=30))[1]
        async with aiohttp.ClientSession() as http:
            for path in ("/v1/chat/completions", "/v1/messages", "/v1/responses"):
                small = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
                async with http.post(url + path, json=small) as resp:
                    assert resp.status == 200, path
                big = {"model": "m", "messages": [{"role": "user", "content": "x" * 800}]}
                async with http.post(url + path, json=big) as resp:
                    body = await resp.read()
                    assert resp.status == 400, path
                    assert is_overflow_payload(400, resp.content_type, body), path
                    message = json.loads(body)["error"]["message"]
                    assert "100" in message, message
    finally:
        await proc.stop()

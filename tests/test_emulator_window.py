"""`emulate --context-window-tokens N`: prompts above N tokens get the overflow error."""

from __future__ import annotations

import asyncio
import json
import sys

import aiohttp

from proxy._protocols._overflow import is_overflow_payload


async def test_cli_window_rejects_longer_prompts_in_each_protocol() -> None:
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "proxy",
        "emulate",
        "--port",
        "0",
        "--context-window-tokens",
        "100",
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.STDOUT,
    )
    try:
        assert proc.stdout is not None
        url = ""
        for _ in range(50):
            line = (await asyncio.wait_for(proc.stdout.readline(), 30)).decode()
            if "listening on" in line:
                url = line.split("listening on ")[1].strip()
                break
        assert url
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
        proc.terminate()
        await proc.wait()

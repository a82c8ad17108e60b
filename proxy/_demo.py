"""``context-proxy demo``: the emulator, the proxy in front of it, one streamed answer."""

from __future__ import annotations

import asyncio
import json
import signal
import sys

import aiohttp

from ._app import build_app, running
from ._config import load_settings
from ._emulator import start_emulator
from ._sse import SSEFramer

__all__ = ["run_demo"]


async def _stream_once(base: str) -> None:
    body = {
        "model": "emulator-1",
        "stream": True,
        "stream_options": {"include_usage": True},
        "messages": [{"role": "user", "content": "Say hello through the proxy."}],
    }
    headers = {"Authorization": "Bearer demo-key", "x-emulator": "chunks=8; delay=0.15"}
    framer = SSEFramer()
    out = sys.stdout
    async with (
        aiohttp.ClientSession() as session,
        session.post(f"{base}/v1/chat/completions", json=body, headers=headers) as resp,
    ):
        out.write(f"POST {base}/v1/chat/completions -> {resp.status}, streaming:\n  ")
        async for chunk in resp.content.iter_any():
            for event in framer.feed(chunk):
                if event.data == b"[DONE]" or not event.data:
                    continue
                payload = json.loads(event.data)
                for choice in payload.get("choices") or []:
                    out.write((choice.get("delta") or {}).get("content") or "")
                usage = payload.get("usage")
                if usage:
                    out.write(
                        f"\n  usage: {usage['prompt_tokens']} in, "
                        f"{usage['completion_tokens']} out\n"
                    )
                out.flush()


async def run_demo(port: int, *, once: bool = False) -> None:
    """Serve the proxy on ``127.0.0.1:port`` in front of a fresh emulator.

    Streams one chat completion through it and prints the text as it arrives;
    then serves until Ctrl-C (or returns at once with ``once``).
    """
    async with await start_emulator() as emulator:
        settings = load_settings(
            overrides={
                "upstream_openai": emulator.url,
                "upstream_anthropic": emulator.url,
                "port": port,
                "shutdown_grace": 2.0,
            }
        )
        app = build_app(settings)
        async with running(app, "127.0.0.1", port) as bound:
            base = f"http://127.0.0.1:{bound}"
            # Ctrl-C works from the first line on: a signal during the first stream ends
            # the demo as soon as that stream has been shown.
            stop = app.state.stop
            loop = asyncio.get_running_loop()
            for sig in (signal.SIGINT, signal.SIGTERM):
                loop.add_signal_handler(sig, stop.set)
            print(f"context-proxy on {base}, upstreams -> emulator at {emulator.url}")
            await _stream_once(base)
            if stop.is_set():
                return
            if once:
                return
            print(
                f"\nServing. Try: ANTHROPIC_BASE_URL={base} or OPENAI_BASE_URL={base}/v1 "
                "with any api key. Ctrl-C stops."
            )
            await stop.wait()

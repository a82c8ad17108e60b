"""A usage store locked by another process does not hold the shutdown past its budget.

With ``sync = "commit"`` every commit queues a write on the store's one thread; with
the file locked each waits ``lock_timeout`` in turn. The shutdown hook's budget
(10 s) ran out, and closing the store then waited for every queued write: 60
commits at 0.5 s each kept the proxy from exiting for 30 s (an orchestrator's
grace period is often 30 s: the kill lands before the other plugins are stopped).
"""

from __future__ import annotations

import asyncio
import sqlite3
import time
from pathlib import Path

import aiohttp

from plugins.usage import UsagePlugin
from proxy.testing import proxy_with_emulator

COMMITS = 60
LOCK_S = 0.5
#: The shutdown hook's budget (proxy/_plugins.py: at least 10 s), the write running
#: when it ends, and slack: far below COMMITS * LOCK_S.
BOUND_S = 10.0 + LOCK_S + 4.0


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
    assert took < BOUND_S, f"shutdown took {took:.1f} s"

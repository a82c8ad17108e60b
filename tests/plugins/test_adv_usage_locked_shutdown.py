"""A store (usage, ledger) locked by another process does not hold the shutdown past
its budget (the ledger's case is still open: xfail).

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
import pytest

from plugins.ledger import LedgerPlugin
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

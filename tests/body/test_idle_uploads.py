"""Memory grows with bytes received, not bytes declared (a proxy process, its RSS from /proc).

An attacker opens 20 connections, each declaring a 100 MB body, and trickles
one byte now and then (well within the idle timeout). Declared bytes cost
address space only: the proxy's RSS may grow by at most 32 MiB, and the
admission budget (``max_reading_bytes``) is charged with what was received,
so a normal 100 KB request from another client is still served.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from pathlib import Path

import aiohttp
import psutil  # type: ignore[import-untyped]  # no stubs; types-psutil is not a dependency

from benchmarks._harness import Service, start_emulator, start_proxy
from tests.support.e2e import CHAT_PATH, RawClient, exact_body

MiB = 1024 * 1024
ATTACKERS = 20
DECLARED = 100 * 1000 * 1000
TRICKLE_EVERY = 0.3  # seconds between two bytes of one attacker (idle timeout: 30 s)
ROUNDS = 8


@contextlib.asynccontextmanager
async def proxy_process(tmp_path: Path, **settings: str) -> AsyncIterator[Service]:
    """A ``python -m proxy serve`` process in front of an emulator process, both ready."""
    env = {f"CONTEXT_PROXY_{name.upper()}": value for name, value in settings.items()}
    async with aiohttp.ClientSession() as session, start_emulator(tmp_path) as emulator:
        await emulator.wait_ready(session)
        async with start_proxy(emulator.url, tmp_path, plugins=(), env=env) as proxy:
            await proxy.wait_ready(session)
            yield proxy


def _rss(pid: int) -> int:
    rss: int = psutil.Process(pid).memory_info().rss
    return rss


async def test_declared_but_unsent_bodies_cost_no_memory_and_no_admission(
    tmp_path: Path,
) -> None:
    async with proxy_process(tmp_path) as proxy:
        body = exact_body(CHAT_PATH, 100_000)
        async with aiohttp.ClientSession() as session:
            # Warm up the code paths a request takes before measuring.
            async with session.post(f"{proxy.url}{CHAT_PATH}", data=body) as resp:
                assert resp.status == 200
                await resp.read()
            before = _rss(proxy.pid)
            attackers = [await RawClient.connect(proxy.url) for _ in range(ATTACKERS)]
            try:
                for client in attackers:
                    client.send_head(
                        "POST",
                        CHAT_PATH,
                        [("Content-Type", "application/json"), ("Content-Length", str(DECLARED))],
                    )
                for _ in range(ROUNDS):
                    for client in attackers:
                        await client.send(b"{" if _ == 0 else b" ")
                    await asyncio.sleep(TRICKLE_EVERY)
                grown = _rss(proxy.pid) - before
                # Every attacker is still being read: none was refused or timed out.
                async with session.get(f"{proxy.url}/admin/exchanges") as resp:
                    exchanges = (await resp.json())["exchanges"]
                assert sorted(e["phase"] for e in exchanges) == ["reading"] * ATTACKERS
                # A normal request from another client is admitted and served.
                async with session.post(f"{proxy.url}{CHAT_PATH}", data=body) as resp:
                    assert resp.status == 200, await resp.text()
                    await resp.read()
            finally:
                for client in attackers:
                    client.abort()
        assert grown <= 32 * MiB, f"RSS grew by {grown / MiB:.0f} MiB for {ATTACKERS} idle uploads"

"""Many viewers of ``GET /admin/events`` cost one snapshot per half interval, not one each.

A snapshot walks every in-flight exchange (about 5 ms per 1,000 of them); built per
viewer, 100 viewers of a busy proxy kept its event loop busy half of every second.
"""

from __future__ import annotations

import asyncio
from typing import Any

import aiohttp
import pytest

from proxy import _live as live
from proxy.testing import proxy_with_emulator

VIEWERS = 30
WATCH_S = 2.2  # seconds all viewers stay connected after their first snapshot


async def _first_event(stream: aiohttp.ClientResponse) -> None:
    async with asyncio.timeout(5):
        while not (await stream.content.readline()).startswith(b"data: "):
            pass


async def test_viewers_share_their_periodic_snapshots(monkeypatch: pytest.MonkeyPatch) -> None:
    made: list[int] = []
    real = live.snapshot

    def counted(state: Any) -> dict[str, Any]:
        made.append(1)
        return real(state)

    monkeypatch.setattr(live, "snapshot", counted)
    async with (
        proxy_with_emulator() as h,
        aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as http,
    ):
        streams = [await http.get(f"{h.url}/admin/events") for _ in range(VIEWERS)]
        try:
            await asyncio.gather(*(_first_event(s) for s in streams))
            assert len(made) == VIEWERS  # each viewer's first snapshot is its own
            made.clear()
            await asyncio.sleep(WATCH_S)
            # Built per viewer: about VIEWERS * WATCH_S of them; shared: a few a second.
            assert len(made) <= 3 * (WATCH_S + 1), len(made)
        finally:
            for stream in streams:
                stream.close()

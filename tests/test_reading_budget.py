"""Admission by declared body size: a stalled upload cannot make the proxy pin unbounded memory.

A body's buffer is sized from its ``Content-Length`` on its first byte, so a
client that declares a large body and then trickles it would hold that much
memory for as long as it keeps the idle timeout at bay. ``max_reading_bytes``
bounds the declared bytes being read at once; past it, new uploads get 503
with ``Retry-After`` in their protocol's shape, before their body is read.
"""

from __future__ import annotations

import json

import aiohttp

from proxy.testing import proxy_with_emulator

from .test_e2e_support import CHAT_PATH, RawClient, exact_body, wait_until

BUDGET = 200_000
DECLARED = 150_000


async def test_stalled_upload_is_accounted_and_later_uploads_wait_their_turn() -> None:
    async with proxy_with_emulator(max_reading_bytes=BUDGET) as h:
        body = exact_body(CHAT_PATH, DECLARED)
        stalled = await RawClient.connect(h.url)
        try:
            stalled.send_head(
                "POST",
                CHAT_PATH,
                [("Content-Type", "application/json"), ("Content-Length", str(DECLARED))],
            )
            await stalled.send(body[:1])
            await wait_until(lambda: h.state.reading_bytes == DECLARED, "the upload is admitted")

            async with aiohttp.ClientSession() as session:
                # The stalled upload is visible: its admitted bytes count as held.
                async with session.get(f"{h.url}/admin/exchanges") as resp:
                    exchanges = (await resp.json())["exchanges"]
                assert [(e["phase"], e["held_bytes"]["raw"]) for e in exchanges] == [
                    ("reading", DECLARED)
                ]

                # A second large upload would pass the budget: refused before its body.
                async with session.post(
                    f"{h.url}{CHAT_PATH}",
                    data=body,
                    headers={"Content-Type": "application/json"},
                ) as resp:
                    assert resp.status == 503
                    assert resp.headers["Retry-After"] == str(h.settings.retry_after)
                    error = json.loads(await resp.read())["error"]
                    assert error["code"] == "busy"

                # Expect: 100-continue gets the same answer before any upload.
                async with session.post(
                    f"{h.url}{CHAT_PATH}",
                    data=body,
                    headers={"Content-Type": "application/json"},
                    expect100=True,
                ) as resp:
                    assert resp.status == 503

                # A small body still fits next to the stalled one.
                small = exact_body(CHAT_PATH, 1_000)
                async with session.post(
                    f"{h.url}{CHAT_PATH}", data=small, headers={"Content-Type": "application/json"}
                ) as resp:
                    assert resp.status == 200
                    await resp.read()

                # The stalled upload completes: its admission is returned.
                await stalled.send(body[1:])
                head = await stalled.read_head()
                assert head.status == 200
                await stalled.read_body(head)
                assert h.state.reading_bytes == 0

                async with session.post(
                    f"{h.url}{CHAT_PATH}", data=body, headers={"Content-Type": "application/json"}
                ) as resp:
                    assert resp.status == 200
                    await resp.read()
        finally:
            await stalled.close()
        # Only the three admitted requests reached the upstream.
        assert [r.body_bytes for r in h.emulator.stats] == [1_000, DECLARED, DECLARED]


async def test_a_hang_up_mid_upload_returns_its_admission() -> None:
    async with proxy_with_emulator(max_reading_bytes=BUDGET) as h:
        body = exact_body(CHAT_PATH, DECLARED)
        client = await RawClient.connect(h.url)
        client.send_head(
            "POST",
            CHAT_PATH,
            [("Content-Type", "application/json"), ("Content-Length", str(DECLARED))],
        )
        await client.send(body[:10])
        await wait_until(lambda: h.state.reading_bytes == DECLARED, "the upload is admitted")
        client.abort()
        await wait_until(lambda: h.state.reading_bytes == 0, "the admission is returned")
        await wait_until(lambda: not h.state.exchanges, "the exchange is gone")
        assert h.emulator.stats == []

"""The budget for bodies being read at once (``max_reading_bytes``) is charged with bytes received.

A declared ``Content-Length`` reserves address space only, so it is not
charged: clients that declare large bodies and send nothing cannot spend the
budget. Bytes received are charged as they arrive. A new upload whose declared
size would not fit next to what is being read gets 503 with ``Retry-After`` in
its protocol's shape before its body is read; a read that grows past the
budget while others share it ends with the same 503.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import zlib
from collections.abc import AsyncIterator
from pathlib import Path

import aiohttp
import psutil  # type: ignore[import-untyped]  # no stubs; types-psutil is not a dependency
import pytest

from benchmarks._harness import Service, start_emulator, start_proxy
from proxy.testing import proxy_with_emulator
from tests.support.e2e import CHAT_PATH, RawClient, exact_body, wait_until

BUDGET = 200_000
DECLARED = 150_000
SENT = 120_000


async def test_stalled_upload_is_accounted_and_later_uploads_wait_their_turn() -> None:
    async with proxy_with_emulator(max_reading_bytes=BUDGET) as h:
        body = exact_body(CHAT_PATH, DECLARED)
        stalled = await RawClient.connect(h.url)
        try:
            await stalled.start_upload(CHAT_PATH, body, SENT)
            await wait_until(lambda: h.state.reading_bytes == SENT, "the bytes sent are charged")

            async with aiohttp.ClientSession() as session:
                # The stalled upload is visible: the bytes it sent count as held.
                async with session.get(f"{h.url}/admin/exchanges") as resp:
                    exchanges = (await resp.json())["exchanges"]
                assert [
                    (e["phase"], e["declared_bytes"], e["held_bytes"]["raw"]) for e in exchanges
                ] == [("reading", DECLARED, SENT)]

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
                await stalled.send(body[SENT:])
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
        await client.start_upload(CHAT_PATH, body, 10)
        await wait_until(lambda: h.state.reading_bytes == 10, "the upload is charged")
        client.abort()
        await wait_until(lambda: h.state.reading_bytes == 0, "the admission is returned")
        await wait_until(lambda: not h.state.exchanges, "the exchange is gone")
        assert h.emulator.stats == []


async def test_declared_but_unsent_bytes_are_not_charged() -> None:
    async with proxy_with_emulator(max_reading_bytes=BUDGET) as h:
        body = exact_body(CHAT_PATH, DECLARED)
        idle = await RawClient.connect(h.url)
        try:
            await idle.start_upload(CHAT_PATH, body, 1)
            await wait_until(lambda: h.state.reading_bytes == 1, "the one byte is charged")
            # A second upload of the same declared size fits: the first one holds a byte.
            async with (
                aiohttp.ClientSession() as session,
                session.post(
                    f"{h.url}{CHAT_PATH}", data=body, headers={"Content-Type": "application/json"}
                ) as resp,
            ):
                assert resp.status == 200
                await resp.read()
            assert h.state.reading_bytes == 1
        finally:
            idle.abort()
        await wait_until(lambda: h.state.reading_bytes == 0, "the admission is returned")


async def test_a_read_growing_past_the_shared_budget_gets_503_and_the_other_goes_on() -> None:
    async with proxy_with_emulator(max_reading_bytes=BUDGET) as h:
        body = exact_body(CHAT_PATH, DECLARED)
        first = await RawClient.connect(h.url)
        second = await RawClient.connect(h.url)
        try:
            await first.start_upload(CHAT_PATH, body, SENT)
            await wait_until(lambda: h.state.reading_bytes == SENT, "the first upload is charged")
            # Chunked: nothing declared, so admitted; it grows past the budget mid-body.
            second.send_head(
                "POST",
                CHAT_PATH,
                [("Content-Type", "application/json"), ("Transfer-Encoding", "chunked")],
            )
            await second.send(b"%x\r\n%s\r\n0\r\n\r\n" % (len(body), body))
            head = await second.read_head()
            assert head.status == 503
            assert head.headers["Retry-After"] == str(h.settings.retry_after)
            assert json.loads(await second.read_body(head))["error"]["code"] == "busy"
            await wait_until(lambda: h.state.reading_bytes == SENT, "the refused read is refunded")
            # The first upload is unaffected and completes.
            await first.send(body[SENT:])
            head = await first.read_head()
            assert head.status == 200
            await first.read_body(head)
        finally:
            await first.close()
            await second.close()
        assert h.state.reading_bytes == 0
        assert [r.body_bytes for r in h.emulator.stats] == [DECLARED]


@pytest.mark.parametrize("framing", ["chunked", "gzip"])
async def test_stalled_chunked_or_compressed_upload_is_charged_its_decoded_bytes(
    framing: str,
) -> None:
    """Neither a chunked upload (nothing declared) nor a gzip one (a small declared
    size that expands) slips past the budget: the bytes decoded so far are charged,
    and the next large upload waits its turn."""
    async with proxy_with_emulator(max_reading_bytes=BUDGET) as h:
        body = exact_body(CHAT_PATH, DECLARED)
        stalled = await RawClient.connect(h.url)
        try:
            headers = [("Content-Type", "application/json")]
            if framing == "chunked":
                stalled.send_head("POST", CHAT_PATH, [*headers, ("Transfer-Encoding", "chunked")])
                await stalled.send(b"%x\r\n%s\r\n" % (SENT, body[:SENT]))
            else:
                packer = zlib.compressobj(6, zlib.DEFLATED, 31)
                packed = packer.compress(body[:SENT]) + packer.flush(zlib.Z_SYNC_FLUSH)
                assert len(packed) < SENT // 10
                # The declared size is the compressed size (plus a rest never sent).
                stalled.send_head(
                    "POST",
                    CHAT_PATH,
                    [
                        *headers,
                        ("Content-Encoding", "gzip"),
                        ("Content-Length", str(len(packed) + 100)),
                    ],
                )
                await stalled.send(packed)
            await wait_until(
                lambda: h.state.reading_bytes == SENT, "the decoded bytes received are charged"
            )
            async with (
                aiohttp.ClientSession() as session,
                session.post(
                    f"{h.url}{CHAT_PATH}", data=body, headers={"Content-Type": "application/json"}
                ) as resp,
            ):
                assert resp.status == 503
                assert json.loads(await resp.read())["error"]["code"] == "busy"
        finally:
            stalled.abort()
        await wait_until(lambda: h.state.reading_bytes == 0, "the admission is returned")
        assert h.emulator.stats == []


SPOOL_ABOVE = 100_000


async def test_a_body_the_spool_takes_is_not_charged_to_the_heap_budget() -> None:
    # max_spool_bytes caps spooled bodies; max_reading_bytes is for bodies held in memory.
    async with proxy_with_emulator(max_reading_bytes=BUDGET, spool_above_bytes=SPOOL_ABOVE) as h:
        body = exact_body(CHAT_PATH, DECLARED)
        stalled = await RawClient.connect(h.url)
        try:
            await stalled.start_upload(CHAT_PATH, body, SENT)
            await wait_until(
                lambda: any(e.reading_bytes == SENT for e in h.state.exchanges.values()),
                "the stalled upload's bytes are read",
            )
            # In the spool from its first byte: nothing charged to the heap budget.
            assert h.state.reading_bytes == 0
            # So a second large upload is admitted next to it (it was a 503 above).
            async with (
                aiohttp.ClientSession() as session,
                session.post(
                    f"{h.url}{CHAT_PATH}", data=body, headers={"Content-Type": "application/json"}
                ) as resp,
            ):
                assert resp.status == 200
                await resp.read()
            await stalled.send(body[SENT:])
            head = await stalled.read_head()
            assert head.status == 200
            await stalled.read_body(head)
        finally:
            await stalled.close()
        assert h.state.reading_bytes == 0
        assert [r.body_bytes for r in h.emulator.stats] == [DECLARED, DECLARED]


async def test_a_chunked_body_leaves_the_heap_budget_when_it_moves_to_the_spool() -> None:
    async with proxy_with_emulator(max_reading_bytes=BUDGET, spool_above_bytes=SPOOL_ABOVE) as h:
        body = exact_body(CHAT_PATH, DECLARED)
        client = await RawClient.connect(h.url)

        def chunk(data: bytes) -> bytes:
            return b"%x\r\n%s\r\n" % (len(data), data)

        try:
            client.send_head(
                "POST",
                CHAT_PATH,
                [("Content-Type", "application/json"), ("Transfer-Encoding", "chunked")],
            )
            # Below the threshold the body is in memory and charged as it arrives.
            await client.send(chunk(body[:50_000]))
            await wait_until(lambda: h.state.reading_bytes == 50_000, "heap bytes are charged")
            # Past it the body moves to the spool and its charge is returned.
            await client.send(chunk(body[50_000:SENT]))
            await wait_until(lambda: h.state.reading_bytes == 0, "the spooled body is not charged")
            await client.send(chunk(body[SENT:]) + b"0\r\n\r\n")
            head = await client.read_head()
            assert head.status == 200
            await client.read_body(head)
        finally:
            await client.close()
        assert [r.body_bytes for r in h.emulator.stats] == [DECLARED]


# -----------------------------------------------------------------------------
# Memory grows with bytes received, not bytes declared (a proxy process, its RSS from /proc).
#
# An attacker opens 20 connections, each declaring a 100 MB body, and trickles
# one byte now and then (well within the idle timeout). Declared bytes cost
# address space only: the proxy's RSS may grow by at most 32 MiB, and the
# admission budget (``max_reading_bytes``) is charged with what was received,
# so a normal 100 KB request from another client is still served.


MiB = 1024 * 1024
ATTACKERS = 20
CLAIMED = 100 * 1000 * 1000
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
                        [("Content-Type", "application/json"), ("Content-Length", str(CLAIMED))],
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

"""Running out of file descriptors is survivable and quiet (issue 12, item 5)."""

from __future__ import annotations

import asyncio
import errno
import json
import re
import resource
import signal

import aiohttp
import pytest

from proxy._emulator import EmulatorServer
from proxy._fdlimit import is_fd_exhaustion
from tests.support.process import Proc

BOUND_S = 20.0


def _limit(soft: int, hard: int) -> None:
    resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


@pytest.mark.timeout(60)
async def test_serve_raises_the_soft_limit_to_the_hard_one_and_logs_it() -> None:
    proc = await Proc.start(
        "proxy", "serve", "--port", "0", "--plugin", "fold", preexec_fn=lambda: _limit(64, 512)
    )
    try:
        match = await proc.wait_line(r"file descriptor limit: (\d+) \(raised from (\d+)\)", BOUND_S)
        assert (match[1], match[2]) == ("512", "64")
        proc.proc.send_signal(signal.SIGTERM)
        assert await proc.wait_exit(BOUND_S) == 0
    finally:
        await proc.stop()


def test_exhaustion_is_recognised_through_aiohttps_wrapping() -> None:
    emfile = OSError(errno.EMFILE, "Too many open files")
    key = aiohttp.client_reqrep.ConnectionKey("h", 1, False, True, None, None, None)
    wrapped = aiohttp.ClientConnectorError(key, emfile)
    assert is_fd_exhaustion(emfile)
    assert is_fd_exhaustion(wrapped)
    refused = aiohttp.ClientConnectorError(key, ConnectionRefusedError(errno.ECONNREFUSED, "no"))
    assert not is_fd_exhaustion(refused)
    assert not is_fd_exhaustion(None)


#: The proxy's descriptor limit (soft and hard, so start-up cannot raise it), the
#: streams opened first (two descriptors each: they fit) and the burst sent while
#: they are held (far more than the descriptors left).
FD_LIMIT = 96
FIRST = 20
BURST = 100


async def _stream(http: aiohttp.ClientSession, url: str, script: str) -> tuple[int, bytes]:
    body = {"model": "m", "stream": True, "messages": [{"role": "user", "content": "hi"}]}
    async with http.post(url, json=body, headers={"x-emulator": script}) as resp:
        return resp.status, await resp.read()


@pytest.mark.timeout(120)
async def test_out_of_descriptors_the_excess_get_503_the_log_stays_short_then_all_is_well(
    emulator: EmulatorServer,
) -> None:
    proc, port = await Proc.serve(emulator.url, preexec_fn=lambda: _limit(FD_LIMIT, FD_LIMIT))
    try:
        base = f"http://127.0.0.1:{port}"
        connector = aiohttp.TCPConnector(limit=0)
        timeout = aiohttp.ClientTimeout(total=90)
        async with aiohttp.ClientSession(connector=connector, timeout=timeout) as http:
            url = base + "/v1/chat/completions"

            def holding() -> int:
                return sum(1 for r in emulator.stats if r.holding is not None)

            first = [asyncio.create_task(_stream(http, url, "hold=fds")) for _ in range(FIRST)]
            async with asyncio.timeout(30):
                # The emulator's records have no event to wait on: poll them.
                while holding() < FIRST:  # noqa: ASYNC110
                    await asyncio.sleep(0.05)
            burst = [asyncio.create_task(_stream(http, url, "hold=fds")) for _ in range(BURST)]
            # Every burst request is answered (503) or got its descriptors and is held too.
            async with asyncio.timeout(60):
                while sum(t.done() for t in burst) + holding() - FIRST < BURST:  # noqa: ASYNC110
                    await asyncio.sleep(0.05)
            emulator.release("fds")
            async with asyncio.timeout(90):
                first_results = await asyncio.gather(*first)
                burst_results = await asyncio.gather(*burst)
            # The streams that had their descriptors are untouched.
            assert all(s == 200 and b"[DONE]" in b for s, b in first_results)
            statuses = [status for status, _ in burst_results]
            refused = [body for status, body in burst_results if status == 503]
            assert set(statuses) <= {200, 503}, sorted(set(statuses))
            assert len(refused) >= BURST // 2, statuses
            for body in refused:
                error = json.loads(body)["error"]
                assert "out of file descriptors" in error["message"]
                assert error["type"] == "server_error"
            # Once descriptors are free again, the proxy serves as before.
            status, body = await _stream(http, url, "chunks=3")
            assert status == 200 and b"[DONE]" in body
            async with http.get(base + "/metrics") as resp:
                metrics = await resp.text()
        counted = re.search(r"^context_proxy_fd_exhausted_total (\S+)$", metrics, re.M)
        assert counted and float(counted[1]) == len(refused)
        proc.proc.send_signal(signal.SIGTERM)
        assert await proc.wait_exit(BOUND_S) == 0
    finally:
        await proc.stop()
    # A few lines, not one (or a traceback) per failure: without the log filter and the
    # descriptor reserve this run wrote over 200,000 lines. The listener stops accepting
    # before accept() fails (fd_reserve), so asyncio's accept storm is gone too.
    assert "Traceback" not in proc.output
    assert len(proc.lines) <= 100, f"{len(proc.lines)} lines:\n{proc.output[:5000]}"
    assert "socket.accept() out of system resource" not in proc.output

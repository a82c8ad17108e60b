"""Running out of file descriptors is survivable and quiet (issue 12, item 5)."""

from __future__ import annotations

import errno
import resource
import signal

import aiohttp
import pytest

from proxy.fdlimit import is_fd_exhaustion
from tests.process_support import Proc

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

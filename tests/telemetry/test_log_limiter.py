"""Rate-limited failure logging (issue 20, item 8): :class:`proxy._logs.LogLimiter`, and
an upstream that is down costing one warning and then a summary line per interval,
not a warning (and an info line) per failed request.

The proxy runs in this process in front of a closed loopback port (connection
refused at once); the access log keeps its line per request.
"""

from __future__ import annotations

import asyncio
import logging
import re

import aiohttp
import pytest

import proxy._relay as relay
from proxy._logs import LogLimiter
from tests.support.ports import free_port
from tests.support.upstream import proxy_app

N_FAILED = 200
BOUND_S = 10.0


class FakeClock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def _messages(caplog: pytest.LogCaptureFixture, name: str) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == name]


def test_the_first_event_is_logged_then_one_summary_per_interval_without_a_loop(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.INFO, logger="t.limiter")
    clock = FakeClock()
    limiter = LogLimiter(logging.getLogger("t.limiter"), interval=10.0, clock=clock)
    assert limiter.event("redis down", "first failure: %s", "refused") is True
    for _ in range(99):
        clock.now += 0.05
        assert limiter.event("redis down", "first failure: %s", "refused") is False
    assert limiter.suppressed("redis down") == 99
    # Another key has its own run.
    assert limiter.event("upstream b", "b failed") is True
    clock.now = 111.0  # the window is over: the next event reports the 99, and is counted
    assert limiter.event("redis down", "first failure: %s", "refused") is False
    assert _messages(caplog, "t.limiter") == [
        "first failure: refused",
        "b failed",
        "redis down: 99 more in the last 11 s",
    ]
    limiter.flush()
    assert _messages(caplog, "t.limiter")[-1] == "redis down: 1 more in the last 0 s"
    # After a quiet interval the next event is logged in full again.
    clock.now = 200.0
    assert limiter.event("redis down", "first failure: %s", "back") is True
    limiter.flush()  # nothing unreported: no line
    assert _messages(caplog, "t.limiter")[-1] == "first failure: back"
    with pytest.raises(ValueError):
        LogLimiter(logging.getLogger("t"), interval=0)


async def test_on_a_loop_the_summary_comes_when_the_window_ends(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.INFO, logger="t.limiter")
    limiter = LogLimiter(logging.getLogger("t.limiter"), interval=0.2)
    for _ in range(5):
        limiter.event("upstream x", "x failed")
    async with asyncio.timeout(BOUND_S):
        while len(_messages(caplog, "t.limiter")) < 2:  # noqa: ASYNC110
            await asyncio.sleep(0.02)
    first, summary = _messages(caplog, "t.limiter")
    assert first == "x failed"
    assert re.fullmatch(r"upstream x: 4 more in the last \d s", summary)
    assert limiter.suppressed("upstream x") == 0


def _summarised(caplog: pytest.LogCaptureFixture) -> bool:
    return any("more in the last" in m for m in _messages(caplog, "context_proxy.relay"))


async def test_an_upstream_down_logs_one_warning_and_a_summary_with_the_count(
    caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    caplog.set_level(logging.INFO)
    monkeypatch.setattr(relay, "FAILURE_LOG_INTERVAL", 1.0)
    port = free_port()
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
    async with (
        proxy_app(f"http://127.0.0.1:{port}") as (url, _app),
        aiohttp.ClientSession() as http,
    ):
        for _ in range(N_FAILED):
            async with http.post(f"{url}/v1/chat/completions", json=body) as resp:
                assert resp.status == 502
        async with asyncio.timeout(BOUND_S):
            while not _summarised(caplog):  # noqa: ASYNC110
                await asyncio.sleep(0.05)
    access = _messages(caplog, "context_proxy.access")
    assert len(access) == N_FAILED  # one per request, by design
    relay_lines = _messages(caplog, "context_proxy.relay")
    # The first failure in full (with the error's class), then the summaries: one per
    # second of the run at most, whose counts add up to every other failure.
    first, *summaries = relay_lines
    assert f"upstream refused the connection at 127.0.0.1:{port}" in first
    assert "(ConnectFailed)" in first
    counted = 0
    for line in summaries:
        match = re.fullmatch(
            rf"upstream 127\.0\.0\.1:{port} failed \(upstream_unreachable\): "
            r"(\d+) more in the last \d+ s",
            line,
        )
        assert match is not None, line
        counted += int(match.group(1))
    assert counted == N_FAILED - 1
    assert len(summaries) <= 30, relay_lines[:5]
    other = [
        r.getMessage()
        for r in caplog.records
        if r.name.startswith("context_proxy")
        and r.name not in ("context_proxy.access", "context_proxy.relay")
        and r.levelno >= logging.WARNING
    ]
    assert other == []

"""Logs of a real ``serve`` process (issue 12, item 2).

``log_format = "json"``: every line is one JSON object (timestamp, level, logger,
message; exchange and session id where known); one access line per exchange with
its method, route, status, outcome, sizes, timings and fold level; never a key, a
header value or a body. ``access_log = false`` turns the access lines off.
"""

from __future__ import annotations

import json
import logging
import signal
import sys
from typing import Any

import anthropic
import openai
import pytest

from proxy import Plugin
from proxy._emulator import EmulatorServer
from proxy._logs import BurstFilter
from proxy._plugins import ExchangeRecord
from tests.support.process import Proc

API_KEY = "sk-logs-test-SECRET-9f8e7d"
PROMPT = "PROMPT-MARKER-logs-5a5a"
SESSION = "sess-logs-1"
SECRET_HEADER = "hdr-value-SECRET-4242"
BOUND_S = 20.0


class FailingCommit(Plugin):
    """A plugin whose commit hook raises: the host logs it inside the exchange's context."""

    name = "failing_commit"

    async def commit(self, record: ExchangeRecord) -> None:
        raise RuntimeError("bookkeeping failed on purpose")


async def _serve(upstream: str, **env: str) -> tuple[Proc, str]:
    """``serve`` with the settings' defaults but ``env`` (``log_format="json"`` is
    ``CONTEXT_PROXY_LOG_FORMAT=json``); the child and its base URL."""
    variables = {f"CONTEXT_PROXY_{k.upper()}": v for k, v in env.items()}
    proc, port = await Proc.serve(upstream, quiet=False, env=variables, within=BOUND_S)
    return proc, f"http://127.0.0.1:{port}"


async def _traffic(base: str) -> None:
    """Three exchanges: an OpenAI chat stream, an Anthropic stream, a 404 from upstream."""
    headers = {"x-session-id": SESSION, "x-custom-header": SECRET_HEADER}
    oai = openai.AsyncOpenAI(base_url=f"{base}/v1", api_key=API_KEY, default_headers=headers)
    async with oai:
        stream = await oai.chat.completions.create(
            model="m", messages=[{"role": "user", "content": PROMPT}], stream=True
        )
        async for _ in stream:
            pass
    ant = anthropic.AsyncAnthropic(base_url=base, api_key=API_KEY, default_headers=headers)
    async with ant:
        async with ant.messages.stream(
            model="m", max_tokens=16, messages=[{"role": "user", "content": PROMPT}]
        ) as s:
            async for _ in s.text_stream:
                pass
        with pytest.raises(anthropic.NotFoundError):
            await ant.messages.create(
                model="m",
                max_tokens=16,
                messages=[{"role": "user", "content": PROMPT}],
                extra_headers={"x-emulator": "status=404"},
            )


@pytest.mark.timeout(60)
async def test_json_lines_parse_and_carry_one_access_line_per_exchange(
    emulator: EmulatorServer,
) -> None:
    proc, base = await _serve(
        emulator.url, log_format="json", plugins="tests.telemetry.test_logs:FailingCommit"
    )
    try:
        await _traffic(base)
        proc.proc.send_signal(signal.SIGTERM)
        assert await proc.wait_exit(BOUND_S) == 0
    finally:
        await proc.stop()
    records: list[dict[str, Any]] = []
    for line in proc.lines:
        if not line:
            continue
        record = json.loads(line)  # every line is one JSON object
        assert isinstance(record, dict)
        assert {"timestamp", "level", "logger", "message"} <= record.keys(), record
        records.append(record)
    assert records[0]["timestamp"].endswith("+00:00")

    access = [r for r in records if r["logger"] == "context_proxy.access"]
    assert [(r["method"], r["route"], r["status"], r["outcome"]) for r in access] == [
        ("POST", "/v1/chat/completions", 200, "ok"),
        ("POST", "/v1/messages", 200, "ok"),
        ("POST", "/v1/messages", 404, "upstream_error"),
    ]
    for r in access:
        assert r["session_id"] == SESSION
        assert r["exchange_id"].startswith("ex-")
        assert r["request_bytes"] > len(PROMPT)
        assert r["fold_level"] == 0
        assert r["duration_s"] > 0
    assert access[0]["response_bytes"] > 0 and access[0]["ttfb_s"] > 0
    assert access[0]["ttfb_s"] <= access[0]["duration_s"]
    assert len({r["exchange_id"] for r in access}) == 3

    # A record written inside an exchange (the failing commit hook) names it.
    failures = [
        r for r in records if "plugin failing_commit: commit raised RuntimeError" in r["message"]
    ]
    assert len(failures) == 3
    assert {r["exchange_id"] for r in failures} == {r["exchange_id"] for r in access}
    assert all(r["session_id"] == SESSION for r in failures)

    text = proc.output
    for secret in (API_KEY, PROMPT, SECRET_HEADER):
        assert secret not in text


@pytest.mark.timeout(60)
async def test_access_log_false_turns_the_access_lines_off(emulator: EmulatorServer) -> None:
    proc, base = await _serve(emulator.url, access_log="false")
    try:
        await _traffic(base)
        proc.proc.send_signal(signal.SIGTERM)
        assert await proc.wait_exit(BOUND_S) == 0
    finally:
        await proc.stop()
    assert "listening on" in proc.output  # text lines still come
    assert "context_proxy.access" not in proc.output
    assert "outcome=" not in proc.output


@pytest.mark.timeout(60)
async def test_text_access_line_is_key_value(emulator: EmulatorServer) -> None:
    proc, base = await _serve(emulator.url)
    try:
        await _traffic(base)
        proc.proc.send_signal(signal.SIGTERM)
        assert await proc.wait_exit(BOUND_S) == 0
    finally:
        await proc.stop()
    lines = [line for line in proc.lines if " context_proxy.access: " in line]
    assert len(lines) == 3
    assert "method=POST route=/v1/chat/completions status=200 outcome=ok" in lines[0]
    assert f"session_id={SESSION}" in lines[0]
    for secret in (API_KEY, PROMPT, SECRET_HEADER):
        assert secret not in proc.output


def _emfile_record(n: int) -> logging.LogRecord:
    try:
        raise OSError(24, "Too many open files")
    except OSError:
        exc_info = sys.exc_info()
    return logging.LogRecord(
        "asyncio",
        logging.ERROR,
        __file__,
        n,
        "socket.accept() out of system resource",
        (),
        exc_info,
    )


def test_burst_filter_keeps_a_descriptor_storm_to_a_few_lines_and_counts_the_rest() -> None:
    now = [0.0]
    f = BurstFilter(burst=3, window=10.0, clock=lambda: now[0])
    passed = [r for r in (_emfile_record(i) for i in range(1000)) if f.filter(r)]
    assert len(passed) == 3
    assert all(r.exc_info is None for r in passed), "one line each, no traceback"
    other = logging.LogRecord("context_proxy", logging.INFO, __file__, 1, "unrelated", (), None)
    assert f.filter(other)
    now[0] = 10.0
    summary = _emfile_record(0)
    assert f.filter(summary)
    assert "997 similar record(s) dropped" in summary.getMessage()

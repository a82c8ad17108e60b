"""No 5xx from the proxy's own code on bad input; a bug is a clean 500 (issue 9, item 6).

A non-ASCII ``Authorization: Bearer`` value on ``/admin/`` is a wrong token (403),
not a crash. Any unexpected exception in the exchange handler is a 500 in the
client's protocol shape, logged once with the exception's class and the exchange
id (never the exception's text, a header value or the body), counted in a
metric, and the exchange is committed with outcome ``error``.
"""

from __future__ import annotations

import asyncio
import json
import logging
from typing import Any, Final

import pytest
from prometheus_client.parser import text_string_to_metric_families

from proxy import ExchangeRecord, Plugin
from proxy import _app as app_module
from proxy._exchange import Exchange
from proxy.testing import Harness, proxy_with_emulator
from tests.support.e2e import (
    ANTHROPIC_PATH,
    CHAT_PATH,
    RESPONSES_PATH,
    RawClient,
    stream_body,
)

TOKEN: Final = "admin-token-7f3a9c1e"
#: Put into the exception's text: it must never reach the log or the client.
LEAK: Final = "sk-never-log-this-3b8d0e"


class Recorder(Plugin):
    """Keeps every committed record."""

    name = "recorder"

    def __init__(self) -> None:
        self.records: list[ExchangeRecord] = []

    async def commit(self, record: ExchangeRecord) -> None:
        self.records.append(record)


@pytest.mark.parametrize(
    "value",
    [
        "Bearer admin-token-é".encode("latin-1"),  # not UTF-8 at all
        "Bearer jeton-de-l'administrateur-é".encode(),  # UTF-8, not ASCII
        b"Bearer " + TOKEN.encode()[:-1] + "é".encode(),
    ],
    ids=["latin-1", "utf-8", "token-plus-accent"],
)
async def test_a_non_ascii_bearer_token_is_refused_not_a_crash(value: bytes) -> None:
    async with proxy_with_emulator(plugins=[], admin_allow=[], admin_token=TOKEN) as h:
        client = await RawClient.connect(h.url)
        try:
            head = b"GET /admin/sessions HTTP/1.1\r\nHost: x\r\nAuthorization: " + value
            await client.send(head + b"\r\n\r\n")
            resp = await client.read_head()
            body = await client.read_body(resp)
        finally:
            await client.close()
        assert resp.status == 403
        assert json.loads(body) == {"error": "forbidden"}
        # The right token still opens the door (the comparison is not just "always no").
        client = await RawClient.connect(h.url)
        try:
            client.send_head("GET", "/admin/sessions", [("Authorization", f"Bearer {TOKEN}")])
            await client.send(b"")
            ok = await client.read_head()
            await client.read_body(ok)
        finally:
            await client.close()
        assert ok.status == 200


def _metric(h: Harness, name: str, **labels: str) -> float:
    """The sum of the samples of ``name`` whose labels include ``labels``."""
    text = h.state.metrics.render().decode()
    return sum(
        sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
        if sample.name == name and all(sample.labels.get(k) == v for k, v in labels.items())
    )


def _boom(*args: Any, **kwargs: Any) -> Any:
    raise RuntimeError(f"unexpected failure quoting {LEAK}")


async def _exchange(h: Harness, path: str, *, stream: bool) -> tuple[int, bytes]:
    client = await RawClient.connect(h.url)
    try:
        await client.request("POST", path, stream_body(path, stream=stream))
        head = await client.read_head()
        body = await client.read_body(head)
        return head.status, body
    finally:
        await client.close()


@pytest.mark.parametrize("path", [CHAT_PATH, RESPONSES_PATH, ANTHROPIC_PATH])
async def test_an_unexpected_exception_is_a_500_in_protocol_shape_logged_counted_committed(
    path: str, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    recorder = Recorder()
    async with proxy_with_emulator(plugins=[recorder]) as h:
        # A failure after the body was read, before the upstream is asked.
        monkeypatch.setattr(app_module, "resolve_session_id", _boom)
        with caplog.at_level(logging.ERROR, logger="context_proxy"):
            status, body = await _exchange(h, path, stream=True)
        await h.settle()
        errors = _metric(h, "context_proxy_internal_errors_total")
        left = dict(h.state.exchanges)
    assert status == 500
    answer = json.loads(body)
    if path == ANTHROPIC_PATH:
        assert answer["type"] == "error" and answer["error"]["type"] == "api_error"
        message = answer["error"]["message"]
    else:
        assert answer["error"]["code"] == "internal_error"
        message = answer["error"]["message"]
    assert LEAK not in body.decode()
    (record,) = recorder.records
    assert (record.status, record.outcome, record.error) == (500, "error", "internal_error")
    assert record.exchange_id in message
    lines = [r for r in caplog.records if record.exchange_id in r.getMessage()]
    assert len(lines) == 1, "logged exactly once"
    (line,) = lines
    assert "RuntimeError" in line.getMessage() and line.levelno == logging.ERROR
    assert all(LEAK not in r.getMessage() and not r.exc_info for r in caplog.records)
    assert errors == 1
    assert left == {}


async def test_an_exception_mid_stream_cuts_the_answer_and_is_committed_as_error(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    recorder = Recorder()
    async with proxy_with_emulator(plugins=[recorder]) as h:
        # A failure while relaying: the 200 and its headers are already out.
        monkeypatch.setattr(Exchange, "count_response_bytes", _boom)
        with caplog.at_level(logging.ERROR, logger="context_proxy"):
            client = await RawClient.connect(h.url)
            try:
                # Paced: the events come in several reads, so the failure strikes mid-way
                # (an answer that came whole would leave whole, in one write).
                paced = [("x-emulator", "delay=0.05")]
                await client.request("POST", CHAT_PATH, stream_body(CHAT_PATH), paced)
                head = await client.read_head()
                with pytest.raises((asyncio.IncompleteReadError, ConnectionError)):
                    await client.read_body(head)
            finally:
                await client.close()
        await h.settle()
        errors = _metric(h, "context_proxy_internal_errors_total", protocol="openai-chat")
    assert head.status == 200
    (record,) = recorder.records
    assert (record.status, record.outcome) == (500, "error")
    assert errors == 1
    assert all(LEAK not in r.getMessage() for r in caplog.records)

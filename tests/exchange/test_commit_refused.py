"""Every finished exchange reaches the plugins, refused or passed through (issue 24, item 4).

docs/plugins.md promises "one record per finished exchange, admitted or refused",
yet a request refused after its head (413 declared or mid-read, 400 bad JSON, 408,
415, a 503 budget or descriptor refusal, a client gone mid-body) and every
passthrough route (``GET /v1/models``) ended without a commit: jsonlog, usage and
any plugin of the user's own never saw them. Each case here drives the real proxy
on loopback with a recording plugin and checks the one record it books: outcome,
status, the request bytes received, the response bytes relayed, and no digest.
The ledger's gate must ignore such digest-less records: a passthrough body used
to be gated with an opaque digest, so the session's next real request flipped
its verdict and marked it dirty.
"""

from __future__ import annotations

import contextlib
import json
import resource
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from pathlib import Path
from typing import Any, ClassVar, Final

import aiohttp
import openai
import pytest

from plugins.jsonlog import JsonLogPlugin
from plugins.ledger import LedgerPlugin
from plugins.usage import UsagePlugin
from proxy import ExchangeRecord, Plugin
from proxy.testing import Harness, make_record, proxy_with_emulator
from tests.support.e2e import CHAT_PATH, RawClient, exact_body, wait_until

LIMIT: Final = 1000  # max_body_bytes of the size cases, bytes
PART: Final = 300  # bytes of a body sent before the client stalls or leaves
BUDGET: Final = 200_000  # max_reading_bytes of the busy case, bytes
NEVER: Final = 3600.0  # ledger debounce (seconds): no test outlives it

#: The record fields every case checks; a case's expectation names them all.
FIELDS: Final = (
    "outcome",
    "status",
    "error",
    "path",
    "request_bytes",
    "response_bytes",
    "wire_digest",
    "outbound_digest",
)


class Recorder(Plugin):
    """Keeps every record its commit hook receives (scalars only), in order."""

    name: ClassVar[str] = "recorder"

    def __init__(self) -> None:
        self.records: list[ExchangeRecord] = []

    async def commit(self, record: ExchangeRecord) -> None:
        self.records.append(record)


def _expect(
    outcome: str,
    status: int | None,
    error: str | None,
    request_bytes: int,
    response_bytes: int = 0,
    path: str = CHAT_PATH,
) -> dict[str, Any]:
    """A record as a case expects it: no digest, ever (``status`` None: not checked)."""
    return {
        "outcome": outcome,
        "status": status,
        "error": error,
        "path": path,
        "request_bytes": request_bytes,
        "response_bytes": response_bytes,
        "wire_digest": "",
        "outbound_digest": None,
    }


def _seen(record: ExchangeRecord, expected: dict[str, Any]) -> dict[str, Any]:
    seen = {name: getattr(record, name) for name in FIELDS}
    if expected["status"] is None:
        seen["status"] = None  # the race of a hang-up decides it (400 or 0)
    return seen


@contextlib.asynccontextmanager
async def _raw(h: Harness) -> AsyncIterator[RawClient]:
    client = await RawClient.connect(h.url)
    try:
        yield client
    finally:
        await client.close()


def _head(length: int, *extra: tuple[str, str]) -> list[tuple[str, str]]:
    return [("Content-Type", "application/json"), ("Content-Length", str(length)), *extra]


# Each driver sends its request(s) through the proxy, checks what the client got,
# and returns the records the plugins must receive (in the order they finish).
Driver = Callable[[Harness], Awaitable[list[dict[str, Any]]]]


async def _declared_413(h: Harness) -> list[dict[str, Any]]:
    async with _raw(h) as client:
        client.send_head("POST", CHAT_PATH, _head(5 * LIMIT))
        assert (await client.read_head()).status == 413
    return [_expect("rejected", 413, "too_large", 0)]


async def _declared_413_expect_continue(h: Harness) -> list[dict[str, Any]]:
    async with _raw(h) as client:
        client.send_head("POST", CHAT_PATH, _head(5 * LIMIT, ("Expect", "100-continue")))
        assert (await client.read_head()).status == 413  # instead of 100 (Continue)
    return [_expect("rejected", 413, "too_large", 0)]


async def _mid_read_413(h: Harness) -> list[dict[str, Any]]:
    async with _raw(h) as client:
        client.send_head(
            "POST",
            CHAT_PATH,
            [("Content-Type", "application/json"), ("Transfer-Encoding", "chunked")],
        )
        # Exactly the limit first (allowed), then any byte more passes it.
        await client.send(b"%x\r\n%s\r\n" % (LIMIT, b"x" * LIMIT))
        await wait_until(lambda: h.state.reading_bytes == LIMIT, "the first chunk is read")
        await client.send(b"%x\r\n%s\r\n" % (PART, b"x" * PART))
        assert (await client.read_head()).status == 413
    # The piece that passed the limit was refused whole: only the first chunk was received.
    return [_expect("rejected", 413, "too_large", LIMIT)]


async def _bad_json_400(h: Harness) -> list[dict[str, Any]]:
    body = b'{"model": "m", "messages": [{"role": "user", "content": "unfinished'
    async with _raw(h) as client:
        await client.request("POST", CHAT_PATH, body)
        assert (await client.read_head()).status == 400
    return [_expect("rejected", 400, "invalid_json", len(body))]


async def _body_deadline_408(h: Harness) -> list[dict[str, Any]]:
    async with _raw(h) as client:
        client.send_head("POST", CHAT_PATH, _head(LIMIT))
        await client.send(b"x" * PART)
        assert (await client.read_head()).status == 408  # the idle timeout, after PART bytes
    return [_expect("rejected", 408, "timeout", PART)]


async def _unsupported_encoding_415(h: Harness) -> list[dict[str, Any]]:
    async with _raw(h) as client:
        await client.request("POST", CHAT_PATH, b"{}", [("Content-Encoding", "bogus")])
        assert (await client.read_head()).status == 415
    return [_expect("rejected", 415, "unsupported_encoding", 0)]


async def _busy_503(h: Harness) -> list[dict[str, Any]]:
    body = exact_body(CHAT_PATH, 150_000)
    sent = 120_000
    stalled = await RawClient.connect(h.url)
    try:
        stalled.send_head("POST", CHAT_PATH, _head(len(body)))
        await stalled.send(body[:sent])
        await wait_until(lambda: h.state.reading_bytes == sent, "the bytes sent are charged")
        # A second upload that would pass the budget is refused before its body.
        async with _raw(h) as second:
            await second.request("POST", CHAT_PATH, body)
            assert (await second.read_head()).status == 503
    finally:
        stalled.abort()  # and the stalled one leaves mid-body
    return [
        _expect("rejected", 503, "busy", 0),
        _expect("client_gone", None, "incomplete", sent),
    ]


async def _client_gone_mid_body(h: Harness) -> list[dict[str, Any]]:
    client = await RawClient.connect(h.url)
    client.send_head("POST", CHAT_PATH, _head(LIMIT))
    await client.send(b"x" * PART)
    await wait_until(lambda: h.state.reading_bytes == PART, "the part sent is read")
    client.abort()
    return [_expect("client_gone", None, "incomplete", PART)]


async def _passthrough_get(h: Harness) -> list[dict[str, Any]]:
    async with aiohttp.ClientSession() as http, http.get(f"{h.url}/v1/models") as resp:
        assert resp.status == 200
        answer = await resp.read()
    assert json.loads(answer)["object"] == "list"
    return [_expect("ok", 200, None, 0, len(answer), path="/v1/models")]


async def _passthrough_post(h: Harness) -> list[dict[str, Any]]:
    # Not JSON (a file upload): it goes upstream verbatim; the emulator has no such route.
    upload = b"--b\r\nContent-Disposition: form-data; name=file\r\n\r\n" + b"z" * 500 + b"\r\n--b--"
    async with (
        aiohttp.ClientSession() as http,
        http.post(
            f"{h.url}/v1/files",
            data=upload,
            headers={"Content-Type": "multipart/form-data; boundary=b"},
        ) as resp,
    ):
        assert resp.status == 404
        answer = await resp.read()
    return [_expect("upstream_error", 404, None, len(upload), len(answer), path="/v1/files")]


async def _descriptor_reserve_503(h: Harness) -> list[dict[str, Any]]:
    async with aiohttp.ClientSession() as http, http.get(f"{h.url}/v1/models") as resp:
        assert resp.status == 503
        assert (await resp.json())["error"]["code"] == "fd_reserve"
    return [_expect("rejected", 503, "fd_reserve", 0, path="/v1/models")]


@contextlib.contextmanager
def _soft_nofile(at_most: int) -> Iterator[int]:
    """The soft descriptor limit, lowered to ``at_most`` for the block if it is above."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft <= at_most:
        yield soft
        return
    resource.setrlimit(resource.RLIMIT_NOFILE, (at_most, hard))
    try:
        yield at_most
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


CASES: Final[dict[str, tuple[Driver, dict[str, Any]]]] = {
    "413 declared": (_declared_413, {"max_body_bytes": LIMIT}),
    "413 declared, Expect: 100-continue": (
        _declared_413_expect_continue,
        {"max_body_bytes": LIMIT},
    ),
    "413 mid-read": (_mid_read_413, {"max_body_bytes": LIMIT}),
    "400 bad JSON": (_bad_json_400, {}),
    "408 body deadline": (_body_deadline_408, {"body_idle_timeout": 1.0}),
    "415 unsupported encoding": (_unsupported_encoding_415, {}),
    "503 reading budget": (_busy_503, {"max_reading_bytes": BUDGET}),
    "client gone mid-body": (_client_gone_mid_body, {}),
    "passthrough GET /v1/models": (_passthrough_get, {}),
    "passthrough POST /v1/files": (_passthrough_post, {}),
}


@pytest.mark.parametrize("case", list(CASES))
async def test_a_refused_or_passthrough_exchange_is_committed_once(case: str) -> None:
    drive, settings = CASES[case]
    recorder = Recorder()
    async with proxy_with_emulator(plugins=[recorder], **settings) as h:
        expected = await drive(h)
        await h.settle()
        assert len(recorder.records) == len(expected), recorder.records
        assert [_seen(r, e) for r, e in zip(recorder.records, expected, strict=True)] == expected
        # Nothing was held back: every commit that started has finished.
        assert h.metric("context_proxy_commits_total", event="finished") == len(expected)


async def test_a_request_shed_from_the_descriptor_reserve_is_committed() -> None:
    recorder = Recorder()
    # A reserve as large as the limit: every new connection is accepted from it and shed.
    with _soft_nofile(4096) as limit:
        async with proxy_with_emulator(plugins=[recorder], fd_reserve=limit) as h:
            expected = await _descriptor_reserve_503(h)
            await h.settle()
            assert [_seen(r, e) for r, e in zip(recorder.records, expected, strict=True)] == (
                expected
            )


def _books(tmp_path: Path) -> tuple[LedgerPlugin, UsagePlugin, JsonLogPlugin, Path]:
    log = tmp_path / "exchanges.jsonl"
    ledger = LedgerPlugin(path=str(tmp_path / "ledger.db"), debounce=NEVER)
    return ledger, UsagePlugin(), JsonLogPlugin(path=str(log), max_bytes=0), log


async def test_digest_less_records_do_not_move_the_ledger_gate_nor_the_usage(
    tmp_path: Path,
) -> None:
    ledger, usage, jsonlog, log = _books(tmp_path)
    session = {"x-session-id": "s-pass"}
    async with proxy_with_emulator(plugins=[ledger, usage, jsonlog]) as h:
        async with aiohttp.ClientSession(headers=session) as http:
            async with http.get(f"{h.url}/v1/models") as resp:
                assert resp.status == 200
            async with http.post(
                f"{h.url}/v1/files",
                data=b"not json, not a history",
                headers={"Content-Type": "application/octet-stream"},
            ) as resp:
                assert resp.status == 404
        await h.settle()
        # Booked by jsonlog, but neither the gate nor the session's usage saw them.
        assert ledger.session_state("s-pass") == {}
        assert usage.session_state("s-pass") == {}
        client = openai.AsyncOpenAI(
            base_url=h.openai_base_url, api_key="k", default_headers=session, max_retries=0
        )
        await client.chat.completions.create(
            model="m", messages=[{"role": "user", "content": "hi"}]
        )
        await h.settle()
        state = ledger.session_state("s-pass")
        # The first gated request of the session: not a flipped verdict after an opaque body.
        assert (state["requests"], state["revision_epoch"], state["dirty"]) == (1, 0, False)
        assert usage.session_state("s-pass")["requests"] == 1
    lines = [json.loads(line) for line in log.read_text().splitlines()]
    assert [(line["path"], line["wire_digest"] != "") for line in lines] == [
        ("/v1/models", False),
        ("/v1/files", False),
        (CHAT_PATH, True),
    ]


async def test_the_ledger_ignores_an_ok_record_without_a_digest(tmp_path: Path) -> None:
    ledger, _, _, _ = _books(tmp_path)
    await ledger.startup()
    try:
        await ledger.commit(make_record(session_id="s1", wire_digest="", comparable=False))
        assert ledger.session_state("s1") == {}
        await ledger.commit(make_record(session_id="s1"))
        assert ledger.session_state("s1")["revision_epoch"] == 0
        assert ledger.session_state("s1")["requests"] == 1
    finally:
        await ledger.shutdown()

"""Hostile and unlucky clients and upstreams: each test pins one finding of the review.

The proxy runs in this process (``proxy_with_emulator``, or ``build_app`` in front
of :class:`RawUpstream`, a loopback server that answers with canned bytes for the
upstream misbehaviours the emulator cannot script), once as a real ``serve``
process for SIGTERM. Ordering uses the emulator's ``hold``/``wait_*`` helpers and
the proxy's own state; the only wall-clock waits are timeouts under test
(``body_idle_timeout``, :data:`proxy._stream.TERMINAL_EOF_GRACE`, a grace period),
each bounded by ``asyncio.timeout``.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import gzip
import hashlib
import json
import logging
import time
import tracemalloc
import zlib
from collections.abc import AsyncIterator
from typing import Any, Final

import aiohttp
import anthropic
import brotli
import openai
import psutil  # type: ignore[import-untyped]  # no stubs; types-psutil is not a dependency
import pytest
import zstandard
from aiohttp import web

from proxy import Plugin
from proxy._emulator import DEFAULT_TEXT, start_emulator
from proxy._phases import Phase
from proxy._plugins import PrepareContext
from proxy._relay import ClientGone
from proxy._wire import WireMetadata
from proxy.testing import Harness, ProxyStartError, proxy_process, proxy_with_emulator
from tests.support.e2e import (
    ANTHROPIC_PATH,
    CHAT_PATH,
    RESPONSES_PATH,
    RawClient,
    RawResponse,
    sse_events,
    wait_until,
)
from tests.support.upstream import SSE_HEAD, RawUpstream, chunked, proxy_for

PATHS: Final = (CHAT_PATH, RESPONSES_PATH, ANTHROPIC_PATH)
PATH_IDS: Final = ("chat", "responses", "messages")
#: Events up to and including the first text delta (emulator defaults, see test_e2e_edges).
FIRST_DELTA_AT: Final = {CHAT_PATH: 2, RESPONSES_PATH: 5, ANTHROPIC_PATH: 4}
SECRET: Final = "sk-adversarial-SECRET-7d3f09b2c4e18a56f0d2"
PROMPT: Final = "PROMPT-TEXT-ae41c7"
BOUND_S: Final = 5.0


def body_for(path: str, *, stream: bool = True, text: str = PROMPT, model: str = "adv") -> bytes:
    """A valid request body (bytes) for ``path`` whose only message is ``text``."""
    payload: dict[str, Any] = {"model": model}
    if path == RESPONSES_PATH:
        payload["input"] = text
    else:
        payload["messages"] = [{"role": "user", "content": text}]
    if path == ANTHROPIC_PATH:
        payload["max_tokens"] = 16
    if stream:
        payload["stream"] = True
    return json.dumps(payload).encode()


def auth_headers(path: str) -> list[tuple[str, str]]:
    """The credential header each protocol's SDK sends, carrying :data:`SECRET`."""
    if path == ANTHROPIC_PATH:
        return [("x-api-key", SECRET), ("anthropic-version", "2023-06-01")]
    return [("Authorization", f"Bearer {SECRET}")]


def assert_no_secret(text: str, where: str) -> None:
    """Neither the API key (nor any 16-character piece of its ends) nor the prompt in ``text``."""
    for needle in (SECRET, SECRET[:16], SECRET[-16:], PROMPT):
        assert needle not in text, f"{needle!r} leaked into {where}"


def log_text(caplog: pytest.LogCaptureFixture) -> str:
    """Every captured record, formatted with its exception text (what a log file would hold)."""
    formatter = logging.Formatter("%(levelname)s %(name)s: %(message)s")
    return "\n".join(formatter.format(record) for record in caplog.records)


def errors_logged(caplog: pytest.LogCaptureFixture) -> list[str]:
    """Records at ERROR or above, formatted (empty when the proxy logged no failure)."""
    return [f"{r.name}: {r.getMessage()}" for r in caplog.records if r.levelno >= logging.ERROR]


async def read_all(client: RawClient) -> tuple[int, bytes]:
    """Status and whole body of the next response on ``client``."""
    head = await client.read_head()
    return head.status, await client.read_body(head)


# ----------------------------------------------------------------- hang-ups (F1, F2)


async def test_hangup_seen_by_the_relay_is_not_logged_as_a_server_error(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """Finding: when the relay (not a cancellation) noticed the hang-up, ``ClientGone``
    escaped the handler and aiohttp logged "Error handling request" with a traceback for an
    ordinary disconnect. Now it is booked as ``client_gone`` without an error record."""

    async def gone(*args: object, **kwargs: object) -> web.StreamResponse:
        raise ClientGone

    monkeypatch.setattr("proxy._app.relay", gone)
    caplog.set_level(logging.INFO)
    async with proxy_with_emulator() as h:
        client = await RawClient.connect(h.url)
        await client.request("POST", CHAT_PATH, body_for(CHAT_PATH), auth_headers(CHAT_PATH))
        head = await client.read_head()
        await client.close()
        await h.settle()
        assert head.headers["Connection"].lower() == "close"
        assert h.metric("context_proxy_client_disconnects_total", phase="prepared") == 1
        booked = h.metric(
            "context_proxy_requests_total",
            protocol="openai-chat",
            code="0",
            outcome="client_gone",
        )
        assert booked == 1
    assert errors_logged(caplog) == []
    assert_no_secret(log_text(caplog), "the log")


class _BlockingFold(Plugin):
    """Wants the body from fold level 1 and then blocks in ``prepare`` until cancelled."""

    name = "blocking-fold"

    def __init__(self) -> None:
        self.entered = asyncio.Event()
        self._never = asyncio.Event()

    def wants_body(self, meta: WireMetadata, fold_level: int) -> bool:
        return fold_level > 0

    async def prepare(self, ctx: PrepareContext) -> bool:
        if ctx.fold_level > 0:
            self.entered.set()
            await self._never.wait()
        return False


SCENARIOS: Final = (
    "mid_headers",
    "mid_body",
    "awaiting_upstream_headers",
    "in_refold",
    "in_retry_gate",
    "in_resend",
    "mid_stream",
    "slow_client",
)


async def _hang_up_once(
    h: Harness, plugin: _BlockingFold, path: str, scenario: str, abort: bool
) -> None:
    """One client that hangs up at ``scenario``; returns once the proxy let go of it."""
    emulator, state = h.emulator, h.state
    emulator.reset()
    body = body_for(path)
    client = await RawClient.connect(h.url, rcvbuf=4096 if scenario == "slow_client" else None)
    headers = [*auth_headers(path), ("x-session-id", "storm")]

    async def send(script: str) -> None:
        await client.request("POST", path, body, [*headers, ("x-emulator", script)])

    if scenario == "mid_headers":
        await client.send(f"POST {path} HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer sk-a".encode())
    elif scenario == "mid_body":
        client.send_head("POST", path, [*headers, ("Content-Length", str(len(body) + 100))])
        await client.send(body)
        await wait_until(
            lambda: any(ex.phase is Phase.READING for ex in state.exchanges.values()), "reading"
        )
    elif scenario == "awaiting_upstream_headers":
        await send("stall_headers=30")
        await emulator.wait_received(1)
    elif scenario == "in_refold":
        plugin.entered.clear()
        await send("overflow_above=10")
        async with asyncio.timeout(BOUND_S):
            await plugin.entered.wait()
    elif scenario == "in_retry_gate":
        await send("empty=1; hold=gate; stall_after=0")
        await emulator.wait_holding(1)
    elif scenario == "in_resend":
        # The first, empty answer is resent; the resend waits 0.5 s for its headers,
        # far longer than the hang-up takes to reach the upstream.
        await send("empty=1; stall_headers=0.5")
        await emulator.wait_received(2)
    elif scenario == "mid_stream":
        await send(f"hold=mid; stall_after={FIRST_DELTA_AT[path]}")
        await client.read_head()
        await emulator.wait_holding(1)
    else:  # slow_client: reads the head, then stops reading a long answer
        await send("chunks=200; long_line=1000000")
        await client.read_head()
        await emulator.wait_events(1, 2)
    if abort:
        client.abort()
    else:
        await client.close()
    await wait_until(lambda: not state.exchanges, f"done with the {scenario} exchange")
    records = emulator.stats
    async with asyncio.timeout(BOUND_S):
        for record in records:
            await emulator.wait_closed(record.id)
    if scenario in ("awaiting_upstream_headers", "in_retry_gate", "mid_stream", "in_resend"):
        assert records[-1].aborted_by_peer, scenario
    if scenario in ("in_refold", "in_retry_gate"):
        assert len(records) == 1, f"{scenario}: resent after the client left"


def _server_connections(port: int) -> int:
    """Open sockets of this process on the proxy's side of ``port`` (the listener excluded)."""
    return sum(
        1
        for conn in psutil.Process().net_connections(kind="tcp")
        if conn.laddr and conn.laddr[1] == port and conn.status != psutil.CONN_LISTEN
    )


# Eight hang-up moments x three protocols, one at a time, plus two 0.5 s resends: ~4 s.
@pytest.mark.timeout(60)
async def test_hangups_at_every_moment_leave_nothing_behind(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A client that hangs up (RST or FIN, alternately) mid-headers, mid-body, while the
    upstream thinks, during a refold, in the fake-completion gate, during the resend,
    mid-stream and while reading slowly: the upstream request is aborted and never resent,
    and afterwards no exchange, held byte, socket, task or session lock is left; nothing
    is logged as an error; no key or prompt reaches the log, the metrics or the admin view."""
    caplog.set_level(logging.INFO)
    plugin = _BlockingFold()
    tasks_before = len(asyncio.all_tasks())
    async with proxy_with_emulator(plugins=[plugin], fake_completion_retries=1) as h:
        port = int(h.url.rsplit(":", 1)[1])
        fds_before = psutil.Process().num_fds()
        turn = 0
        for path in PATHS:
            for scenario in SCENARIOS:
                await _hang_up_once(h, plugin, path, scenario, abort=turn % 2 == 0)
                turn += 1
        h.emulator.reset()
        # The session lock is free again, and the proxy still serves.
        client = await RawClient.connect(h.url)
        await client.request(
            "POST",
            CHAT_PATH,
            body_for(CHAT_PATH),
            [*auth_headers(CHAT_PATH), ("x-session-id", "storm")],
        )
        status, raw = await read_all(client)
        await client.close()
        assert status == 200 and sse_events(raw)[-1] == (None, "[DONE]")
        await h.settle()

        async with aiohttp.ClientSession() as http:
            async with http.get(f"{h.url}/metrics") as resp:
                metrics = await resp.text()
            async with http.get(f"{h.url}/admin/exchanges") as resp:
                exchanges = await resp.json()
            async with http.get(f"{h.url}/admin/sessions") as resp:
                sessions = await resp.text()
        assert exchanges == {"exchanges": []}
        held = [
            line
            for line in metrics.splitlines()
            if line.startswith("context_proxy_held_bytes{") and float(line.rsplit(" ", 1)[1])
        ]
        assert held == []
        assert "context_proxy_in_flight 0.0" in metrics
        assert h.metric("context_proxy_client_disconnects_total", phase="streaming")
        for text, where in ((metrics, "/metrics"), (sessions, "/admin/sessions")):
            assert_no_secret(text, where)
        await wait_until(lambda: _server_connections(port) == 0, "without client connections")
        # Idle pooled upstream connections are expected; dropping them must leave nothing.
        assert h.state.upstream is not None
        await h.state.upstream.pool.close()
        await wait_until(
            lambda: len(asyncio.all_tasks()) <= tasks_before, "back to the tasks before"
        )
        await wait_until(lambda: psutil.Process().num_fds() <= fds_before, "back to the fds before")
    assert errors_logged(caplog) == []
    assert "Traceback" not in log_text(caplog)
    assert_no_secret(log_text(caplog), "the log")


# -------------------------------------------------------------- final events (F3, F4)


async def count_events(h: Harness, path: str) -> int:
    """Number of SSE events of the default answer for ``path``, read through the proxy."""
    client = await RawClient.connect(h.url)
    await client.request("POST", path, body_for(path), auth_headers(path))
    status, raw = await read_all(client)
    await client.close()
    assert status == 200
    return len(sse_events(raw))


def is_final(path: str, event: tuple[str | None, str]) -> bool:
    """Whether ``event`` is the protocol's last event of a complete answer."""
    name, data = event
    if path == CHAT_PATH:
        return data == "[DONE]"
    return name == ("response.completed" if path == RESPONSES_PATH else "message_stop")


@pytest.mark.parametrize("path", PATHS, ids=PATH_IDS)
async def test_upstream_cut_right_after_the_final_event_is_a_complete_answer(path: str) -> None:
    """Finding: an upstream that dropped the connection right after its final event (before
    the end of the chunked body) got an in-band error appended after ``message_stop`` /
    ``[DONE]``; the ``anthropic`` SDK raised on a complete answer and the exchange was
    booked as a stream error. Now the answer ends at its final event and is booked ``ok``."""
    async with proxy_with_emulator() as h:
        total = await count_events(h, path)
        client = await RawClient.connect(h.url)
        await client.request(
            "POST",
            path,
            body_for(path),
            [*auth_headers(path), ("x-emulator", f"cut_after={total}")],
        )
        status, raw = await read_all(client)
        await client.close()
        if path == ANTHROPIC_PATH:
            sdk = anthropic.AsyncAnthropic(base_url=h.url, api_key=SECRET, max_retries=0)
            async with sdk.messages.stream(
                model="adv",
                max_tokens=16,
                messages=[{"role": "user", "content": "hi"}],
                extra_headers={"x-emulator": f"cut_after={total}"},
            ) as stream:
                assert await stream.get_final_text() == DEFAULT_TEXT
        await h.settle()
        assert all(record.cut_by_emulator for record in h.emulator.stats[1:])
        protocol = {CHAT_PATH: "openai-chat", RESPONSES_PATH: "openai-responses"}.get(
            path, "anthropic-messages"
        )
        assert h.metric(
            "context_proxy_requests_total", protocol=protocol, code="200", outcome="ok"
        ) == len(h.emulator.stats)
    assert status == 200
    events = sse_events(raw)
    assert len(events) == total and is_final(path, events[-1])


@pytest.mark.parametrize("path", PATHS, ids=PATH_IDS)
async def test_upstream_holding_the_body_open_after_the_final_event_does_not_hold_the_client(
    path: str,
) -> None:
    """Finding: an upstream that kept the body open after its final event kept the client's
    stream open too, until the upstream idle timeout (300 s); the ``anthropic`` SDK reads to
    the end and hung. Now the stream ends within ``TERMINAL_EOF_GRACE`` of the final event
    and the upstream connection is closed."""
    async with proxy_with_emulator() as h:
        total = await count_events(h, path)
        script = f"hold=open; stall_after={total}"
        client = await RawClient.connect(h.url)
        await client.request(
            "POST", path, body_for(path), [*auth_headers(path), ("x-emulator", script)]
        )
        started = time.monotonic()
        async with asyncio.timeout(BOUND_S):
            status, raw = await read_all(client)
        took = time.monotonic() - started
        await client.close()
        await h.emulator.wait_aborted(2)
    assert status == 200
    events = sse_events(raw)
    assert len(events) == total and is_final(path, events[-1])
    # Within the grace (0.5 s), not the upstream idle timeout (300 s); generous for load.
    assert took < 4.0


REPLAYED_EVENTS: Final = (
    b'event: response.created\ndata: {"type":"response.created","sequence_number":0}\n\n',
    b'event: response.completed\ndata: {"type":"response.completed","sequence_number":1}\n\n',
)


def _responses_replay(target: str) -> bytes:
    return SSE_HEAD + chunked(*REPLAYED_EVENTS)


async def test_passthrough_stream_is_relayed_as_it_comes_and_never_resent() -> None:
    """Finding: a passthrough SSE stream (``GET /v1/responses/{id}?stream=true``, which ends
    with ``response.completed`` and no ``[DONE]``) was judged by chat rules: an in-band error
    was appended to a complete stream (the ``openai`` SDK raised), and with fake-completion
    retry on, the stream looked empty and was requested again. Now it is relayed byte for
    byte, once."""
    replay = RawUpstream(_responses_replay)
    async with replay as upstream, proxy_for(upstream.url, fake_completion_retries=2) as url:
        client = await RawClient.connect(url)
        await client.request(
            "GET", "/v1/responses/resp_1?stream=true", b"", auth_headers(CHAT_PATH)
        )
        status, raw = await read_all(client)
        await client.close()
    assert status == 200
    assert raw == b"".join(REPLAYED_EVENTS)
    assert len(upstream.heads) == 1


# ------------------------------------------------------------- broken bodies (F7)


def _broken_json(target: str) -> bytes:
    if "gzip" in target:
        # A gzip header, then a deflate block of the reserved type 3: undecodable.
        body = gzip.compress(b'{"id":"x","choices":[]}')[:10] + b"\xff" * 16
        return (
            b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Encoding: gzip\r\n"
            + b"Content-Length: %d\r\n\r\n" % len(body)
            + body
        )
    # Promises 100 bytes, sends 7, closes.
    return (
        b'HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: 100\r\n\r\n{"a":1}'
    )


@pytest.mark.parametrize("kind", ["short", "gzip"])
async def test_broken_json_answer_is_cut_not_spliced_with_an_event(kind: str) -> None:
    """Finding: a non-streaming answer that broke mid-body (a short body, corrupt gzip) got
    an SSE ``data: {"error": ...}`` line appended to the JSON; the client parsed garbage.
    Now the connection is cut: the client sees a truncated body, which the ``openai`` SDK
    treats as a connection error and retries."""
    async with RawUpstream(_broken_json) as upstream, proxy_for(upstream.url) as url:
        target = f"{url}/v1/chat/completions?{kind}"
        async with (
            aiohttp.ClientSession() as http,
            http.post(target, data=body_for(CHAT_PATH, stream=False)) as resp,
        ):
            assert resp.status == 200
            received = bytearray()
            with pytest.raises(aiohttp.ClientPayloadError):
                async for chunk in resp.content.iter_any():
                    received += chunk
        assert b"data:" not in received
        # A connection error is what the SDK retries; no retry here, to stay fast.
        sdk = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key=SECRET, max_retries=0)
        with pytest.raises(openai.APIConnectionError):
            await sdk.chat.completions.create(
                model="adv",
                messages=[{"role": "user", "content": "hi"}],
                extra_query={kind: "1"},
            )
        await sdk.close()
    assert len(upstream.heads) == 2


BOMB_BYTES: Final = 64 << 20  # decoded size of the compressed answer below
BOMB_HELD_BOUND: Final = 4 << 20  # bytes: the most the whole run may hold at once


def _bomb(coding: str) -> tuple[bytes, str]:
    """A ``coding``-compressed body of :data:`BOMB_BYTES` repetitive bytes (under 1 MB on the
    wire), and the SHA-256 of the decoded body; built 1 MiB at a time, never whole."""
    block = b"".join(b"line %06d of a file that compresses far too well\n" % i for i in range(20))
    block = (block * (1 + (1 << 20) // len(block)))[: 1 << 20]
    digest = hashlib.sha256()
    compressor: Any
    if coding == "gzip":
        compressor = zlib.compressobj(9, zlib.DEFLATED, 16 + zlib.MAX_WBITS)
        compress, flush = compressor.compress, compressor.flush
    elif coding == "br":
        compressor = brotli.Compressor(quality=5)
        compress, flush = compressor.process, compressor.finish
    else:
        compressor = zstandard.ZstdCompressor(level=3).compressobj()
        compress, flush = compressor.compress, compressor.flush
    wire = bytearray()
    for _ in range(BOMB_BYTES // len(block)):
        digest.update(block)
        wire += compress(block)
    wire += flush()
    assert len(wire) < 1 << 20
    return bytes(wire), digest.hexdigest()


@pytest.mark.parametrize("coding", ["gzip", "br", "zstd"])
async def test_a_compressed_answer_is_decoded_only_as_fast_as_the_client_reads(
    coding: str,
) -> None:
    """Finding: each wire chunk of a compressed answer was decoded whole before the first
    piece went to the client, so a gzip bomb (here 64 MiB from under 1 MB on the wire)
    sat in memory while a slow client read. Now the relay decodes the next piece only
    once the previous one was forwarded: with the client not reading, and while it then
    reads the whole answer, the process holds a few MiB at most; the answer arrives intact."""
    wire, expected = _bomb(coding)

    def reply(target: str) -> bytes:
        return (
            b"HTTP/1.1 200 OK\r\nContent-Type: application/octet-stream\r\n"
            b"Content-Encoding: %s\r\nContent-Length: %d\r\n\r\n%s"
            % (coding.encode(), len(wire), wire)
        )

    async with RawUpstream(reply) as upstream, proxy_for(upstream.url) as url:
        client = await RawClient.connect(url, rcvbuf=64 * 1024)
        gc.collect()
        tracemalloc.start()
        try:
            client.send_head("GET", "/v1/files/file-bomb/content", auth_headers(CHAT_PATH))
            await client.send(b"")
            head = await client.read_head()
            # Not reading: the proxy has the whole answer from the upstream (it closed)
            # and must wait for the client. A bounded look at what it holds meanwhile.
            await wait_until(lambda: bool(upstream.bodies), "the upstream answered", BOUND_S)
            for _ in range(20):
                await asyncio.sleep(0.05)
                stalled_peak = tracemalloc.get_traced_memory()[1]
                assert stalled_peak < BOMB_HELD_BOUND, f"{stalled_peak} bytes held while stalled"
            digest, size = hashlib.sha256(), 0
            async for piece in client.iter_body(head):
                digest.update(piece)
                size += len(piece)
            peak = tracemalloc.get_traced_memory()[1]
        finally:
            tracemalloc.stop()
        await client.close()
    assert head.status == 200 and "Content-Encoding" not in head.headers
    assert (size, digest.hexdigest()) == (BOMB_BYTES, expected)
    assert peak < BOMB_HELD_BOUND, f"{peak} bytes held at the peak"


# ------------------------------------------------------ what reaches the upstream (F5, F6)


def _ok(target: str) -> bytes:
    return b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: 2\r\n\r\n{}"


@pytest.mark.parametrize(
    "target",
    [
        "/v1/files/file%3Fx%23y%20z",
        "/v1/files/a%2Fb/content",
        "/v1/models?after=%0D%0Ainjected&q=a+b%26c",
    ],
    ids=["encoded-query-and-fragment-marks", "encoded-slash", "encoded-crlf-in-query"],
)
async def test_request_target_reaches_the_upstream_as_sent(target: str) -> None:
    """Finding: the upstream URL was rebuilt from the *decoded* path and query: ``%3F``
    became a query, ``%23`` cut the rest off as a fragment, ``%2F`` a path separator, and
    ``%0D%0A`` vanished from the query. Now the target goes upstream byte for byte."""
    async with RawUpstream(_ok) as upstream, proxy_for(upstream.url) as url:
        client = await RawClient.connect(url)
        await client.request("GET", target, b"", auth_headers(CHAT_PATH))
        status, _ = await read_all(client)
        await client.close()
    assert status == 200
    assert upstream.heads[0].split(b"\r\n", 1)[0] == f"GET {target} HTTP/1.1".encode()


async def test_non_json_passthrough_body_is_forwarded_verbatim() -> None:
    """Finding: every body was parsed as JSON, so a multipart upload to a passthrough route
    (``POST /v1/files``, audio transcriptions) got 400 "not valid JSON". Now a passthrough
    body goes upstream byte for byte; the exchange routes still insist on a JSON object."""
    boundary = "adv-boundary"
    upload = (
        (
            f'--{boundary}\r\nContent-Disposition: form-data; name="purpose"\r\n\r\nbatch\r\n'
            f'--{boundary}\r\nContent-Disposition: form-data; name="file"; filename="a.bin"\r\n'
            f"Content-Type: application/octet-stream\r\n\r\n"
        ).encode()
        + bytes(range(256))
        + f"\r\n--{boundary}--\r\n".encode()
    )
    async with RawUpstream(_ok) as upstream, proxy_for(upstream.url) as url:
        client = await RawClient.connect(url)
        head = [
            ("Content-Type", f"multipart/form-data; boundary={boundary}"),
            ("Content-Length", str(len(upload))),
        ]
        client.send_head("POST", "/v1/files", [*auth_headers(CHAT_PATH), *head])
        await client.send(upload)
        status, _ = await read_all(client)
        client.send_head("POST", CHAT_PATH, head)
        await client.send(upload)
        chat_status, chat_body = await read_all(client)
        await client.close()
    assert status == 200
    assert upstream.bodies == [upload]
    assert chat_status == 400
    assert json.loads(chat_body)["error"]["code"] == "invalid_json"


def _content_types(head: bytes) -> list[str]:
    """The ``Content-Type`` values of a request head (bytes), in order."""
    fields = (line.partition(b":") for line in head.split(b"\r\n")[1:])
    return [value.strip().decode() for name, _, value in fields if name.lower() == b"content-type"]


@pytest.mark.parametrize(
    ("path", "content_type"),
    [
        (CHAT_PATH, None),
        (ANTHROPIC_PATH, None),
        ("/v1/files", None),
        (CHAT_PATH, "application/json; charset=utf-8"),
        ("/v1/files", "text/plain"),
    ],
    ids=["chat-none", "messages-none", "passthrough-none", "chat-json-charset", "passthrough-text"],
)
async def test_the_upstream_gets_exactly_the_clients_content_type(
    path: str, content_type: str | None
) -> None:
    """Finding (regression): a request sent without ``Content-Type`` reached the upstream
    as ``application/octet-stream`` (aiohttp's default for a POST). Now the upstream gets
    the client's ``Content-Type`` as sent, and none when the client sent none."""
    body = body_for(path, stream=False)
    headers = [("Content-Length", str(len(body))), *auth_headers(path)]
    if content_type is not None:
        headers.append(("Content-Type", content_type))
    async with RawUpstream(_ok) as upstream, proxy_for(upstream.url) as url:
        client = await RawClient.connect(url)
        client.send_head("POST", path, headers)
        await client.send(body)
        status, _ = await read_all(client)
        await client.close()
    assert status == 200
    assert upstream.bodies == [body]
    assert _content_types(upstream.heads[0]) == ([] if content_type is None else [content_type])


# ------------------------------------------------------------ upstream misbehaviour


def _misbehaving(target: str) -> bytes:
    if target.endswith("redirect"):
        location = target.replace("redirect", "elsewhere")
        return (
            b"HTTP/1.1 307 Temporary Redirect\r\nLocation: %s\r\nContent-Length: 0\r\n\r\n"
            % location.encode()
        )
    if target.endswith("nocontent"):
        return b"HTTP/1.1 204 No Content\r\n\r\n"
    if target.endswith("html"):
        return b"HTTP/1.1 200 OK\r\nContent-Type: text/html\r\nContent-Length: 7\r\n\r\n<html/>"
    # Anything else: a small JSON answer.
    return b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: 2\r\n\r\n{}"


async def test_upstream_redirects_204_and_wrong_content_types_pass_through() -> None:
    """A 307 from the upstream is relayed, never followed; a 204 ends without a body; a 200
    with a wrong content type is relayed as it came to a request that did not ask for a
    stream. (A streaming request answered so is a 502: test_stream_end.)"""
    async with (
        RawUpstream(_misbehaving) as upstream,
        proxy_for(upstream.url) as url,
        aiohttp.ClientSession() as http,
    ):
        async with http.post(
            f"{url}/v1/chat/completions/redirect", data=b"{}", allow_redirects=False
        ) as resp:
            assert resp.status == 307
            assert resp.headers["Location"] == "/v1/chat/completions/elsewhere"
        async with http.get(f"{url}/v1/models/nocontent") as resp:
            assert resp.status == 204
            assert await resp.read() == b""
        plain = body_for(CHAT_PATH, stream=False)
        async with http.post(f"{url}/v1/chat/completions?html", data=plain) as resp:
            assert resp.status == 200 and resp.content_type == "text/html"
            assert await resp.read() == b"<html/>"
    assert [h.split(b" ", 2)[1] for h in upstream.heads] == [
        b"/v1/chat/completions/redirect",
        b"/v1/models/nocontent",
        b"/v1/chat/completions?html",
    ]


# --------------------------------------------------------------------- weird HTTP (F8, F9)


async def test_expect_100_continue_is_refused_before_the_upload() -> None:
    """Finding: curl sends ``Expect: 100-continue`` for bodies over 1 MB, and the proxy
    answered 100 (Continue) before finding the declared size over the limit, so the client
    started a doomed upload (RFC 9110 section 10.1.1: answer the final status instead). Now
    413/415/503 come first; an acceptable body still gets 100 and goes through."""
    async with proxy_with_emulator(max_body_bytes=4096) as h:
        body = body_for(CHAT_PATH, stream=False)
        expect = [("Expect", "100-continue"), ("Content-Type", "application/json")]
        cases = [
            ([("Content-Length", "5000")], [413]),
            ([("Content-Length", str(len(body))), ("Content-Encoding", "compress")], [415]),
            ([("Content-Length", str(len(body)))], [100, 200]),
        ]
        for extra, expected in cases:
            client = await RawClient.connect(h.url)
            client.send_head("POST", CHAT_PATH, [*expect, *extra])
            await client.send(b"")
            first = await client.read_head()
            if first.status == 100:
                await client.send(body)
                final = await client.read_head()
                await client.read_body(final)
                statuses = [first.status, final.status]
            else:
                statuses = [first.status]
                assert first.headers["Connection"].lower() == "close"
            await client.close()
            assert statuses == expected, extra
        assert len(h.emulator.stats) == 1
        h.state.draining = True
        client = await RawClient.connect(h.url)
        client.send_head("POST", CHAT_PATH, [*expect, ("Content-Length", str(len(body)))])
        await client.send(b"")
        refused = await client.read_head()
        await client.close()
        assert refused.status == 503 and "Retry-After" in refused.headers


async def test_malformed_requests_never_put_request_bytes_in_the_log(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Finding: aiohttp logs a request it cannot parse at ERROR with the parser's message,
    which quotes the offending bytes: the rest of a body sent past a too-small
    ``Content-Length`` (prompt text) or a malformed header line (an API key). Now the
    record names the peer and the error class only, as a warning."""
    caplog.set_level(logging.INFO)
    async with proxy_with_emulator() as h:
        for garbage in (
            body_for(CHAT_PATH) + b"\r\n\r\n",
            f"GET /v1/models HTTP/1.1\r\nHost: x\r\napi-key: {SECRET}\rX: y\r\n\r\n".encode(),
        ):
            client = await RawClient.connect(h.url)
            await client.send(b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n")
            await read_all(client)
            await client.send(garbage)
            assert (await client.read_head()).status == 400
            await client.close()
        body = body_for(CHAT_PATH, stream=False)
        client = await RawClient.connect(h.url)
        client.send_head("POST", CHAT_PATH, [("Content-Length", "10")])
        await client.send(body)
        with contextlib.suppress(asyncio.IncompleteReadError, ConnectionError):
            while True:  # bounded: each read times out after 10 s and the server closes
                await read_all(client)
        await client.close()
        assert h.emulator.stats == []
    assert errors_logged(caplog) == []
    assert any("malformed request" in r.getMessage() for r in caplog.records)
    assert_no_secret(log_text(caplog), "the log")


@pytest.mark.parametrize(
    "raw",
    [
        (
            f"POST {CHAT_PATH} HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {SECRET}\x01\r\n"
            f"Content-Length: 2\r\n\r\n{{}}"
        ).encode(),
        b"POST %s HTTP/1.1\r\nHost: x\r\nContent-Length: 10\r\n\r\n%s"
        % (CHAT_PATH.encode(), body_for(CHAT_PATH, stream=False)),
        (
            f"POST {ANTHROPIC_PATH} HTTP/1.1\r\nHost: x\r\nx-api-key: {SECRET}{'A' * 9000}\r\n"
            f"Content-Length: 2\r\n\r\n{{}}"
        ).encode(),
    ],
    ids=["control-char-in-authorization", "short-content-length", "over-long-header-line"],
)
async def test_a_malformed_request_gets_a_json_400_without_its_bytes(raw: bytes) -> None:
    """Finding: aiohttp answered a request it could not parse with a text/plain 400 quoting
    the parser's message: the Authorization header with its key, the tail of a body sent
    past a short ``Content-Length`` (prompt text), the start of an over-long x-api-key
    line. Now the answer is an OpenAI-shaped JSON error (no route is known yet) in the
    proxy's words, with ``Connection: close``; no byte of the request comes back."""
    async with proxy_with_emulator() as h:
        client = await RawClient.connect(h.url)
        await client.send(raw)
        answers: list[tuple[RawResponse, bytes]] = []
        with contextlib.suppress(asyncio.IncompleteReadError, ConnectionError):
            while len(answers) < 3:  # bounded: the proxy closes after the 400
                head = await client.read_head()
                answers.append((head, await client.read_body(head)))
        await client.close()
        assert h.emulator.stats == []
    assert answers, "no answer at all"
    for head, body in answers:
        assert head.headers["Content-Type"].startswith("application/json")
        assert_no_secret(body.decode("latin-1"), "the answer")
        assert_no_secret(str(head.headers), "the answer's head")
    head, body = answers[-1]
    error = json.loads(body)["error"]
    assert (head.status, error["type"], error["code"]) == (
        400,
        "invalid_request_error",
        "malformed_request",
    )
    assert head.headers["Connection"].lower() == "close"


async def test_traversal_absolute_form_pipelining_and_http10() -> None:
    """Paths that climb out of ``/v1/`` (plain or percent-encoded) are 404 and never reach
    the upstream or the admin routes; an absolute-form target naming another host still
    goes to the configured upstream; pipelined requests are answered in order; an HTTP/1.0
    client gets its stream delimited by the connection's end."""
    async with proxy_with_emulator() as h:
        for target in (
            "/v1/../admin/shutdown",
            "/v1/%2e%2e/admin/shutdown",
            "/v1/%2E%2E/%2E%2E/etc/passwd",
            "/v1/files/..%2f..%2fadmin%2fshutdown",
        ):
            client = await RawClient.connect(h.url)
            await client.request("POST", target, b"{}")
            status, _ = await read_all(client)
            await client.close()
            assert status == 404, target
        assert not h.state.draining and h.emulator.stats == []

        client = await RawClient.connect(h.url)
        await client.request("GET", "http://169.254.169.254/v1/models", b"")
        status, models = await read_all(client)
        assert status == 200 and json.loads(models)["data"][0]["id"] == "emulator-1"

        first, second = body_for(CHAT_PATH, model="first"), body_for(CHAT_PATH, model="second")
        pipelined = b"".join(
            b"POST %s HTTP/1.1\r\nHost: x\r\nContent-Length: %d\r\n\r\n%s"
            % (CHAT_PATH.encode(), len(b), b)
            for b in (first, second)
        )
        await client.send(pipelined)
        answers = [await read_all(client), await read_all(client)]
        await client.close()
        models_seen = [json.loads(sse_events(raw)[0][1])["model"] for _, raw in answers]
        assert models_seen == ["first", "second"]

        client = await RawClient.connect(h.url)
        await client.send(
            b"POST %s HTTP/1.0\r\nContent-Length: %d\r\n\r\n%s"
            % (CHAT_PATH.encode(), len(first), first)
        )
        head = await client.read_head()
        raw = await client.read_body(head)  # no length, no chunks: ends at the close
        await client.close()
        assert head.status == 200 and not head.chunked
        assert sse_events(raw)[-1] == (None, "[DONE]")


# -------------------------------------------------------------- bodies that lie or are bad


@pytest.mark.parametrize(
    ("body", "headers", "status", "code"),
    [
        (b"[1, 2]", [], 400, "invalid_json"),
        (b"42", [], 400, "invalid_json"),
        (
            b'{"model": "m", "messages": [{"role": "user", "content": "\xff\xfe"}]}',
            [],
            400,
            "invalid_json",
        ),
        (
            b'{"model": "m", "messages": ' + b"[" * 100_000 + b"]" * 100_000 + b"}",
            [],
            400,
            "invalid_json",
        ),
        (gzip.compress(b"not json at all"), [("Content-Encoding", "gzip")], 400, "invalid_json"),
        (b"not gzip", [("Content-Encoding", "gzip")], 400, "bad_encoding"),
        (b"{}", [("Content-Encoding", "compress")], 415, "unsupported_encoding"),
    ],
    ids=[
        "array",
        "number",
        "invalid-utf8",
        "deep-nesting",
        "gzip-not-json",
        "bad-gzip",
        "unknown-coding",
    ],
)
async def test_bad_bodies_get_a_protocol_error_and_nothing_goes_upstream(
    body: bytes, headers: list[tuple[str, str]], status: int, code: str
) -> None:
    """Each bad body gets its status with a JSON error in the client's protocol shape; the
    upstream never sees a request; the proxy still serves afterwards."""
    async with proxy_with_emulator() as h:
        client = await RawClient.connect(h.url)
        await client.request("POST", CHAT_PATH, body, headers)
        got, raw = await read_all(client)
        await client.close()
        assert h.emulator.stats == []
        assert (got, json.loads(raw)["error"]["code"]) == (status, code)
        duplicates = b'{"model": "a", "model": "b", "messages": [{"role": "user", "content": "x"}]}'
        client = await RawClient.connect(h.url)
        await client.request("POST", CHAT_PATH, duplicates)
        got, raw = await read_all(client)
        await client.close()
        # Duplicate keys: last one wins, for the proxy and the upstream alike.
        assert got == 200 and json.loads(raw)["model"] == "b"
        assert h.emulator.stats[0].model == "b"


async def test_a_refused_body_is_booked_with_the_bytes_received(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Finding: a body that was read but refused (not JSON) got ``request_bytes=0`` in its
    access line. Now the line books the decoded bytes received, as for a body that went
    upstream."""
    caplog.set_level(logging.INFO, logger="context_proxy.access")
    bodies = (b"not json {{{", gzip.compress(b"[1, 2, 3]"), body_for(CHAT_PATH, stream=False))
    async with proxy_with_emulator() as h:
        for body, coding in zip(bodies, ([], [("Content-Encoding", "gzip")], []), strict=True):
            client = await RawClient.connect(h.url)
            await client.request("POST", CHAT_PATH, body, coding)
            await read_all(client)
            await client.close()
        await wait_until(lambda: len(access_lines(caplog)) == 3, "three access lines", BOUND_S)
    booked = [(r["status"], r["request_bytes"]) for r in access_lines(caplog)]
    assert booked == [(400, 12), (400, len(b"[1, 2, 3]")), (200, len(bodies[2]))]


def access_lines(caplog: pytest.LogCaptureFixture) -> list[dict[str, Any]]:
    """The fields of each access line captured so far, in order."""
    return [r.__dict__["access"] for r in caplog.records if r.name == "context_proxy.access"]


async def test_content_length_too_large_and_endless_chunked_bodies_time_out() -> None:
    """A body shorter than its ``Content-Length`` and a chunked body that never ends get
    408 after ``body_idle_timeout`` (not a hang), with ``Connection: close``; nothing is
    forwarded and no exchange is left."""
    async with proxy_with_emulator(body_idle_timeout=0.2) as h:
        body = body_for(CHAT_PATH)
        for head, part in (
            ([("Content-Length", str(len(body) + 50))], body),
            ([("Transfer-Encoding", "chunked")], b"%x\r\n%s\r\n" % (len(body), body)),
        ):
            client = await RawClient.connect(h.url)
            client.send_head("POST", CHAT_PATH, head)
            await client.send(part)
            async with asyncio.timeout(BOUND_S):
                response = await client.read_head()
            await client.close()
            assert response.status == 408 and response.headers["Connection"].lower() == "close"
        await wait_until(lambda: not h.state.exchanges, "done with every exchange")
        assert h.emulator.stats == []


# ----------------------------------------------------------------- sessions, tombstones


async def test_distinct_sessions_and_tombstone_floods_stay_bounded() -> None:
    """A client inventing a new session id per request, or an operator tombstoning
    thousands, cannot grow the registry past ``idle_session_cap`` / ``tombstone_cap``."""
    async with (
        proxy_with_emulator(idle_session_cap=20, tombstone_cap=10) as h,
        aiohttp.ClientSession() as http,
    ):
        body = body_for(CHAT_PATH, stream=False)
        for i in range(60):
            async with http.post(
                f"{h.url}{CHAT_PATH}", data=body, headers={"x-session-id": f"s-{i}"}
            ) as resp:
                assert resp.status == 200
                await resp.read()
        await h.settle()
        assert h.state.registry.session_count <= 20
        assert h.metric("context_proxy_sessions") == h.state.registry.session_count
        for i in range(40):
            async with http.delete(f"{h.url}/admin/sessions/t-{i}") as resp:
                assert resp.status == 200
        assert h.state.registry.tombstone_count == 10
        async with http.post(
            f"{h.url}{CHAT_PATH}", data=body, headers={"x-session-id": "t-39"}
        ) as resp:
            assert resp.status == 503  # the newest tombstones are kept


# ------------------------------------------------------------------------ shutdown


async def _stream(
    http: aiohttp.ClientSession, url: str, path: str, script: str, started: asyncio.Event
) -> tuple[int, bytes]:
    async with http.post(
        url + path, data=body_for(path), headers={**dict(auth_headers(path)), "x-emulator": script}
    ) as resp:
        started.set()
        return resp.status, await resp.read()


async def _upload(http: aiohttp.ClientSession, url: str, sent: asyncio.Event) -> tuple[int, bytes]:
    async def body() -> AsyncIterator[bytes]:
        yield b'{"model": "adv", "messages": [{"role": "user", "content": "'
        sent.set()
        await asyncio.Event().wait()  # never completes: the proxy must stop waiting
        yield b""

    async with http.post(url + CHAT_PATH, data=body()) as resp:
        return resp.status, await resp.read()


async def _json_answer(http: aiohttp.ClientSession, url: str, started: asyncio.Event) -> bytes:
    async with http.post(
        url + CHAT_PATH,
        data=body_for(CHAT_PATH, stream=False),
        headers={"x-emulator": "hold=json; stall_after=1"},
    ) as resp:
        started.set()
        received = bytearray()
        with pytest.raises(aiohttp.ClientPayloadError):
            async for chunk in resp.content.iter_any():
                received += chunk
        return bytes(received)


# A real serve process (~1 s to start) and a 0.5 s grace: about 3 s.
@pytest.mark.timeout(60)
async def test_sigterm_with_twenty_streams_and_uploads_in_flight_exits_cleanly() -> None:
    """SIGTERM while 20 streams run, two uploads are half sent and a JSON answer is half
    written: exit status 0 soon after the grace; every stream ends with its protocol's
    in-band error event, the uploads get 503, the JSON answer is cut (never spliced with an
    event); nothing is logged as an error and no key or prompt is printed."""
    emulator = await start_emulator()
    async with (
        emulator,
        proxy_process(
            "--upstream-openai",
            emulator.url,
            "--upstream-anthropic",
            emulator.url,
            "--shutdown-grace",
            "0.5",
        ) as proxy,
        aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=30)) as http,
    ):
        started = [asyncio.Event() for _ in range(23)]
        streams = [
            asyncio.create_task(
                _stream(
                    http,
                    proxy.url,
                    PATHS[i % 3],
                    f"hold=sig; stall_after={FIRST_DELTA_AT[PATHS[i % 3]]}",
                    started[i],
                )
            )
            for i in range(20)
        ]
        uploads = [asyncio.create_task(_upload(http, proxy.url, started[20 + i])) for i in range(2)]
        answer = asyncio.create_task(_json_answer(http, proxy.url, started[22]))
        async with asyncio.timeout(BOUND_S):
            await asyncio.gather(*(event.wait() for event in started))
            for request_id in range(1, 22):
                await emulator.wait_holding(request_id)
            while True:  # bounded by the timeout; the uploads' phase has no event
                async with http.get(f"{proxy.url}/admin/exchanges") as resp:
                    phases = [ex["phase"] for ex in (await resp.json())["exchanges"]]
                if phases.count("reading") == 2:
                    break
                await asyncio.sleep(0.01)
        stopped = time.monotonic()
        code = await proxy.stop(within=10)
        took = time.monotonic() - stopped
        async with asyncio.timeout(BOUND_S):
            results = await asyncio.gather(*streams)
            upload_results = await asyncio.gather(*uploads)
            partial = await answer
    assert code == 0, proxy.output
    assert took < 5.0
    for (status, raw), i in zip(results, range(20), strict=True):
        assert status == 200
        name, data = sse_events(raw)[-1]
        assert name == "error" or json.loads(data).get("error"), PATHS[i % 3]
        assert "proxy shutting down" in data
    assert [status for status, _ in upload_results] == [503, 503]
    assert partial and b"data:" not in partial
    assert "Traceback" not in proxy.output and " ERROR " not in proxy.output
    assert_no_secret(proxy.output, "the process output")


# A real serve process that fails to start: about 1 s.
@pytest.mark.timeout(60)
async def test_port_in_use_fails_cleanly_without_leaking_the_upstream_pool() -> None:
    """Finding: when the port was taken, start-up had already opened the upstream client
    pool and started the plugins, and nothing closed them: the failed start ended with
    "Unclosed client session" at ERROR. Now start-up is undone before the error is shown."""
    blocker = await asyncio.start_server(lambda r, w: None, "127.0.0.1", 0)
    try:
        port = blocker.sockets[0].getsockname()[1]
        with pytest.raises(ProxyStartError) as failed:
            async with proxy_process("--port", str(port)):
                pass
    finally:
        blocker.close()
        await blocker.wait_closed()
    assert failed.value.returncode not in (0, None)
    assert "cannot listen" in failed.value.output
    assert "Unclosed" not in failed.value.output and "ERROR" not in failed.value.output

"""Health, readiness, metrics and the admin API of a running proxy (issue 5, item 7).

The proxy and the upstream emulator run on loopback ports of this process. The
admin guard is checked from a second loopback address: Linux routes all of
127.0.0.0/8 to ``lo``, so a client socket bound to 127.0.0.2 reaches a proxy
on 127.0.0.1 and the proxy sees 127.0.0.2 as the peer (checked by the
``second_loopback`` fixture, which skips where that is not so). Ordering uses
plugin events and the emulator's ``hold=KEY``; no sleeps.
"""

from __future__ import annotations

import asyncio
import json
import socket
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from prometheus_client.parser import text_string_to_metric_families

from plugins.usage import UsagePlugin
from proxy import Plugin
from proxy._plugins import PrepareContext, Scalar
from proxy._protocols import Protocol
from proxy._wire import WireMetadata
from proxy.testing import Harness, proxy_with_emulator

CHAT = "/v1/chat/completions"
RESPONSES = "/v1/responses"
MESSAGES = "/v1/messages"
BOUND_S = 5.0
OTHER_LOOPBACK = "127.0.0.2"
TOKEN = "admin-tok-7Hq2"
#: Text that only exists in request bodies and headers: no admin answer may echo it.
PROMPT_MARKER = "PROMPT-MARKER-c0ffee"
API_KEY = "sk-admin-test-KEY-0123456789"

ADMIN_ROUTES = [
    ("GET", "/admin/sessions"),
    ("GET", "/admin/sessions/some-session"),
    ("DELETE", "/admin/sessions/some-session"),
    ("GET", "/admin/exchanges"),
    ("GET", "/admin/usage"),
    ("POST", "/admin/shutdown"),
]


def chat_body(model: str, content: str = "hi", *, stream: bool = True) -> dict[str, Any]:
    return {"model": model, "messages": [{"role": "user", "content": content}], "stream": stream}


def messages_body(model: str, content: str = "hi") -> dict[str, Any]:
    return {
        "model": model,
        "max_tokens": 16,
        "messages": [{"role": "user", "content": content}],
        "stream": True,
    }


def encoded_size(body: dict[str, Any]) -> int:
    """Bytes aiohttp sends for ``json=body`` (its default ``json.dumps``)."""
    return len(json.dumps(body).encode())


Samples = dict[tuple[str, frozenset[tuple[str, str]]], float]


def parse_metrics(text: str) -> Samples:
    """``{(sample name, labels): value}`` from Prometheus text exposition."""
    out: Samples = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            out[(sample.name, frozenset(sample.labels.items()))] = sample.value
    return out


def sample(samples: Samples, name: str, **labels: str) -> float | None:
    return samples.get((name, frozenset(labels.items())))


def series(samples: Samples, name: str, *keys: str) -> dict[tuple[str, ...], float]:
    """Every sample of ``name``, keyed by the values of the labels ``keys`` in that order."""
    return {
        tuple(dict(labels)[key] for key in keys): value
        for (sample_name, labels), value in samples.items()
        if sample_name == name
    }


async def metrics(http: aiohttp.ClientSession, h: Harness) -> tuple[str, Samples]:
    async with http.get(h.url + "/metrics") as resp:
        assert resp.status == 200
        assert resp.content_type == "text/plain"
        text = await resp.text()
    return text, parse_metrics(text)


async def get_json(http: aiohttp.ClientSession, url: str) -> tuple[int, str, Any]:
    async with http.get(url) as resp:
        text = await resp.text()
        return resp.status, text, json.loads(text)


async def read_first_event(resp: aiohttp.ClientResponse) -> bytes:
    """Read up to the end of the first SSE event (a blank line)."""
    raw = bytearray()
    async with asyncio.timeout(BOUND_S):
        async for line in resp.content:
            raw += line
            if line in (b"\n", b"\r\n"):
                return bytes(raw)
    raise AssertionError(f"stream ended before its first event: {bytes(raw)!r}")


@pytest.fixture
async def http() -> AsyncIterator[aiohttp.ClientSession]:
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=20)) as session:
        yield session


@pytest.fixture
def second_loopback() -> str:
    """127.0.0.2, once a socket bound to it could reach 127.0.0.1 and be seen as itself."""
    with socket.socket() as server, socket.socket() as client:
        server.bind(("127.0.0.1", 0))
        server.listen(1)
        try:
            client.bind((OTHER_LOOPBACK, 0))
            client.connect(server.getsockname())
        except OSError as exc:
            pytest.skip(f"{OTHER_LOOPBACK} is not usable as a loopback source here: {exc}")
        conn, peer = server.accept()
        conn.close()
    if peer[0] != OTHER_LOOPBACK:
        pytest.skip(f"the kernel rewrote {OTHER_LOOPBACK} to {peer[0]}")
    return OTHER_LOOPBACK


@pytest.fixture
async def http_other(second_loopback: str) -> AsyncIterator[aiohttp.ClientSession]:
    """A client whose connections come from 127.0.0.2, not 127.0.0.1."""
    connector = aiohttp.TCPConnector(local_addr=(second_loopback, 0))
    async with aiohttp.ClientSession(
        connector=connector, timeout=aiohttp.ClientTimeout(total=20)
    ) as session:
        yield session


class Gate(Plugin):
    """Holds the prepare of requests for model ``gated`` (it wants their body) until told."""

    name = "gate"

    def __init__(self) -> None:
        self.entered = asyncio.Event()
        self.proceed = asyncio.Event()

    def wants_body(self, meta: WireMetadata, fold_level: int) -> bool:
        return meta.model == "gated"

    async def prepare(self, ctx: PrepareContext) -> bool:
        if ctx.meta.model == "gated":
            assert ctx.body["messages"]  # the body is parsed on first access
            self.entered.set()
            await self.proceed.wait()
        return False

    def session_state(self, session_id: str) -> dict[str, Scalar]:
        return {"seen": True, "last_prompt": None}


class Shrink(Plugin):
    """On a refold (fold level >= 1), replaces the conversation with a short one."""

    name = "shrink"

    def wants_body(self, meta: WireMetadata, fold_level: int) -> bool:
        return fold_level > 0

    async def prepare(self, ctx: PrepareContext) -> bool:
        if ctx.fold_level == 0:
            return False
        ctx.body["messages"] = [{"role": "user", "content": "short"}]
        return True


# --------------------------------------------------------------------------- guard


async def test_admin_from_non_loopback_needs_the_token(
    http: aiohttp.ClientSession, http_other: aiohttp.ClientSession
) -> None:
    """From 127.0.0.2 every admin route is 403 without the token (spoofed forwarding
    headers do not help) and 200 with it; open endpoints answer anyone."""
    async with proxy_with_emulator(plugins=[], admin_allow=["127.0.0.1"], admin_token=TOKEN) as h:
        spoofed = {
            "X-Forwarded-For": "127.0.0.1",
            "X-Real-IP": "127.0.0.1",
            "Forwarded": "for=127.0.0.1",
        }
        for method, path in ADMIN_ROUTES:
            for headers in (
                {},
                spoofed,
                {"Authorization": "Bearer wrong-token"},
                {"Authorization": TOKEN},
                {"Authorization": f"Basic {TOKEN}"},
            ):
                async with http_other.request(method, h.url + path, headers=headers) as resp:
                    assert resp.status == 403, (method, path, headers)
                    assert TOKEN not in await resp.text()
        # The refused POST /admin/shutdown and DELETE changed nothing.
        assert not h.state.draining
        assert not h.state.registry.is_tombstoned("some-session")

        # Open endpoints answer anyone.
        for path in ("/healthz", "/readyz", "/metrics"):
            async with http_other.get(h.url + path) as resp:
                assert resp.status == 200, path

        bearer = {"Authorization": f"Bearer {TOKEN}"}
        async with http_other.get(h.url + "/admin/sessions", headers=bearer) as resp:
            assert resp.status == 200
            assert await resp.json() == {"sessions": [], "next_cursor": None}
        async with http_other.get(h.url + "/admin/exchanges", headers=bearer) as resp:
            assert resp.status == 200
        # The scheme is case-insensitive (RFC 9110 section 11.1).
        lower = {"Authorization": f"bearer {TOKEN}"}
        async with http_other.get(h.url + "/admin/sessions", headers=lower) as resp:
            assert resp.status == 200

        # From an allowed address no token is needed.
        async with http.get(h.url + "/admin/sessions") as resp:
            assert resp.status == 200


async def test_without_a_configured_token_non_loopback_is_always_refused(
    http_other: aiohttp.ClientSession,
) -> None:
    """With no admin_token configured, no Authorization value opens the admin routes."""
    async with proxy_with_emulator(plugins=[], admin_allow=["127.0.0.1"]) as h:
        for auth in ("Bearer ", "Bearer None", "Bearer null"):
            headers = {"Authorization": auth, "X-Forwarded-For": "127.0.0.1"}
            async with http_other.get(h.url + "/admin/sessions", headers=headers) as resp:
                assert resp.status == 403, auth


# --------------------------------------------------------------------------- views


async def test_exchanges_and_sessions_views_show_state_never_a_body(
    http: aiohttp.ClientSession,
) -> None:
    """/admin/exchanges, /admin/sessions[/{id}] and /metrics show phase, held bytes and
    counts of in-flight exchanges, and never a body, a prompt or a key."""
    gate = Gate()
    async with proxy_with_emulator(plugins=[gate]) as h:
        secret = {"Authorization": f"Bearer {API_KEY}"}
        held_body = chat_body("held", f"stream {PROMPT_MARKER}")
        gated_body = messages_body("gated", f"gated {PROMPT_MARKER} " + "z" * 5000)
        held_resp = await http.post(
            h.url + CHAT,
            json=held_body,
            headers={**secret, "x-session-id": "sess-view-1", "x-emulator": "hold=view"},
        )
        gated = asyncio.create_task(
            http.post(
                h.url + MESSAGES,
                json=gated_body,
                headers={**secret, "x-claude-code-session-id": "sess-view-2"},
            )
        )
        try:
            assert held_resp.status == 200
            await read_first_event(held_resp)
            async with asyncio.timeout(BOUND_S):
                await gate.entered.wait()

            status, text, view = await get_json(http, h.url + "/admin/exchanges")
            assert status == 200
            by_session = {e["session"]: e for e in view["exchanges"]}
            assert set(by_session) == {"sess-view-1", "sess-view-2"}
            streaming = by_session["sess-view-1"]
            assert streaming["protocol"] == Protocol.CHAT
            assert streaming["phase"] == "streaming"
            # Mid-stream the exchange holds no request bytes (docs/design.md §2).
            assert streaming["held_bytes"] == {
                "raw": 0,
                "parsed": 0,
                "outbound": 0,
                "response": 0,
                "total": 0,
                "spooled": 0,
            }
            preparing = by_session["sess-view-2"]
            assert preparing["protocol"] == Protocol.MESSAGES
            assert preparing["phase"] == "parsed"
            size = encoded_size(gated_body)
            assert preparing["held_bytes"]["raw"] == size
            assert preparing["held_bytes"]["parsed"] == size  # the parse estimate
            assert preparing["held_bytes"]["total"] == 2 * size
            for entry in view["exchanges"]:
                assert entry["age_s"] >= 0 and entry["id"].startswith("ex-")

            # Bytes held by phase, and in-flight exchanges, as metrics.
            mtext, samples = await metrics(http, h)
            assert sample(samples, "context_proxy_in_flight") == 2
            assert sample(samples, "context_proxy_held_bytes", phase="parsed", kind="raw") == size
            assert sample(samples, "context_proxy_held_bytes", phase="streaming", kind="raw") == 0

            status, stext, sessions = await get_json(http, h.url + "/admin/sessions")
            assert status == 200
            listed = {s["id"]: s for s in sessions["sessions"]}
            assert listed["sess-view-1"]["in_flight"] == 1
            assert listed["sess-view-1"]["pinned"] is True
            assert listed["sess-view-2"]["in_flight"] == 1
            status, dtext, detail = await get_json(http, h.url + "/admin/sessions/sess-view-1")
            assert status == 200
            assert detail["id"] == "sess-view-1" and detail["requests"] == 1
            assert detail["plugins"] == {"gate": {"seen": True, "last_prompt": None}}
            status, _, _ = await get_json(http, h.url + "/admin/sessions/no-such")
            assert status == 404

            for answer in (text, mtext, stext, dtext):
                assert PROMPT_MARKER not in answer
                assert API_KEY not in answer
                assert "z" * 100 not in answer
        finally:
            gate.proceed.set()
            h.emulator.release("view")
            async with asyncio.timeout(BOUND_S):
                held_rest = await held_resp.read()
                gated_resp = await gated
                await gated_resp.read()
        assert b"[DONE]" in held_rest
        assert gated_resp.status == 200
        # Once the handlers (commit hooks included) are done, nothing is listed.
        await h.settle()
        _, _, after = await get_json(http, h.url + "/admin/exchanges")
        assert after == {"exchanges": []}


async def test_metrics_series_after_traffic(http: aiohttp.ClientSession) -> None:
    """After a success, an upstream error, a refold, a client gone and a session shutdown,
    /metrics counts exactly that traffic in the named series."""
    async with proxy_with_emulator(plugins=[Shrink()]) as h:
        session = {"x-session-id": "sess-metrics"}
        # A plain success.
        async with http.post(h.url + CHAT, json=chat_body("ok"), headers=session) as resp:
            assert resp.status == 200
            await resp.read()
        # An upstream error passed through.
        headers = {**session, "x-emulator": "status=429"}
        async with http.post(h.url + MESSAGES, json=messages_body("e"), headers=headers) as resp:
            assert resp.status == 429
            await resp.read()
        # A context overflow answered by one refold.
        headers = {**session, "x-emulator": "overflow_above=1000"}
        big = chat_body("big", "x" * 4000, stream=False)
        async with http.post(h.url + CHAT, json=big, headers=headers) as resp:
            assert resp.status == 200
            await resp.read()
        # A client that hangs up mid-stream. A Responses stream is relayed from its
        # first output event on (until then a refold may still replace it), so the
        # emulator holds it after the third event, output_item.added.
        headers = {**session, "x-emulator": "hold=gone; stall_after=3"}
        responses_body = {"model": "r", "input": "hi", "stream": True}
        resp = await http.post(h.url + RESPONSES, json=responses_body, headers=headers)
        assert resp.status == 200
        await read_first_event(resp)
        gone_id = max(r.id for r in h.emulator.stats)
        resp.close()
        await h.emulator.wait_aborted(gone_id)
        # A tombstone.
        async with http.delete(h.url + "/admin/sessions/sess-metrics") as resp:
            assert resp.status == 200

        text, samples = await metrics(http, h)
    # Requests by protocol and status (and outcome), exactly the traffic sent.
    requests = series(samples, "context_proxy_requests_total", "protocol", "code", "outcome")
    assert requests == {
        (Protocol.CHAT, "200", "ok"): 2,
        (Protocol.MESSAGES, "429", "upstream_error"): 1,
        (Protocol.RESPONSES, "200", "client_gone"): 1,
    }
    assert sample(samples, "context_proxy_in_flight") == 0
    assert sample(samples, "context_proxy_releases_total") == 4
    assert sample(samples, "context_proxy_refolds_total") == 1
    assert sample(samples, "context_proxy_client_disconnects_total", phase="streaming") == 1
    assert sample(samples, "context_proxy_tombstones") == 1
    assert sample(samples, "context_proxy_draining") == 0
    assert "# TYPE context_proxy_held_bytes gauge" in text


async def test_readyz_flips_on_admin_shutdown(http: aiohttp.ClientSession) -> None:
    """POST /admin/shutdown: /readyz 503 at once, /healthz still 200, new requests 503 with
    Retry-After and Connection: close in their protocol's shape, nothing forwarded."""
    async with proxy_with_emulator(plugins=[]) as h:
        async with http.get(h.url + "/readyz") as resp:
            assert resp.status == 200
        async with http.post(h.url + "/admin/shutdown") as resp:
            assert resp.status == 202
        async with http.get(h.url + "/readyz") as resp:
            assert resp.status == 503
        async with http.get(h.url + "/healthz") as resp:
            assert resp.status == 200
        async with http.post(h.url + CHAT, json=chat_body("m")) as resp:
            assert resp.status == 503
            assert resp.headers["Retry-After"] == str(h.settings.retry_after)
            assert resp.headers["Connection"].lower() == "close"
            assert (await resp.json())["error"]["type"] == "server_error"
        async with http.post(h.url + MESSAGES, json=messages_body("m")) as resp:
            assert resp.status == 503
            assert resp.headers["Retry-After"] == str(h.settings.retry_after)
            payload = await resp.json()
            assert payload["type"] == "error" and "shutting down" in payload["error"]["message"]
        _, samples = await metrics(http, h)
        assert sample(samples, "context_proxy_draining") == 1
        assert h.emulator.stats == [], "a request reached the upstream while draining"


# -----------------------------------------------------------------------------
# Hostile query parameters of the admin routes are a 400 in JSON, never a 500 or a 503.


@pytest.mark.parametrize("route", ["/admin/usage", "/admin/sessions"])
@pytest.mark.parametrize("limit", ["%C2%B2", "%E2%91%A0"], ids=["superscript-2", "circled-1"])
async def test_a_limit_of_unicode_digits_is_a_400_not_an_internal_error(
    route: str, limit: str
) -> None:
    async with (
        proxy_with_emulator(plugins=[UsagePlugin()]) as h,
        aiohttp.ClientSession() as http,
        http.get(f"{h.url}{route}?limit={limit}") as answer,
    ):
        assert answer.status == 400, await answer.text()
        assert (await answer.json())["error"].startswith("limit:")


@pytest.mark.parametrize("store", [False, True], ids=["memory", "sqlite"])
async def test_a_cursor_that_is_not_utf8_is_a_400_and_the_store_is_not_blamed(
    tmp_path: Path, store: bool
) -> None:
    """``_w==`` is the URL-safe base64 of the byte 0xff: no key this endpoint issues."""
    plugin = UsagePlugin(path=str(tmp_path / "usage.db") if store else None)
    async with (
        proxy_with_emulator(plugins=[plugin]) as h,
        aiohttp.ClientSession() as http,
        http.get(f"{h.url}/admin/usage?by=session&cursor=_w==") as answer,
    ):
        assert answer.status == 400, await answer.text()
        assert (await answer.json())["error"].startswith("cursor:")

"""End to end: request bodies through the proxy (sizes, the limit, content codings, hang-ups).

The emulator records the length and xxh3_128 digest of every body it receives
(after any content decoding), which is what "the upstream got the same bytes"
means here.
"""

from __future__ import annotations

import gzip
import json
import logging
from collections.abc import AsyncIterator, Callable
from typing import Any

import aiohttp
import pytest
import xxhash
import zstandard

from proxy.testing import Harness, proxy_with_emulator
from tests.support.e2e import (
    ANTHROPIC_PATH,
    CHAT_PATH,
    RESPONSES_PATH,
    LogWaiter,
    RawClient,
    exact_body,
    stream_body,
    wait_until,
)

LIMIT = 64 * 1024  # a small max_body_bytes keeps the limit tests fast


@pytest.fixture
async def http() -> AsyncIterator[aiohttp.ClientSession]:
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=30)) as session:
        yield session


@pytest.fixture
async def limited() -> AsyncIterator[Harness]:
    async with proxy_with_emulator(max_body_bytes=LIMIT) as h:
        yield h


def digest(data: bytes) -> str:
    return xxhash.xxh3_128_hexdigest(data)


async def chunked(data: bytes, piece: int = 16 * 1024) -> AsyncIterator[bytes]:
    """``data`` as an async generator: aiohttp then sends it with chunked framing, no length."""
    for start in range(0, len(data), piece):
        yield data[start : start + piece]


# ----------------------------------------------------------------- sizes


# 40 MB: about 0.5 s of loopback copying and hashing on each hop.
@pytest.mark.parametrize("size", [1_500_000, 40_000_000], ids=["1.5MB", "40MB"])
async def test_large_bodies_arrive_intact(http: aiohttp.ClientSession, size: int) -> None:
    body = exact_body(CHAT_PATH, size)
    async with (
        proxy_with_emulator() as h,
        http.post(
            h.url + CHAT_PATH, data=body, headers={"Content-Type": "application/json"}
        ) as resp,
    ):
        assert resp.status == 200
        reply = await resp.json()
        record = h.emulator.stats[-1]
    assert record.body_bytes == size
    assert record.body_digest == digest(body)
    assert record.content_length == size
    assert reply["usage"]["prompt_tokens"] == size // 4


# ----------------------------------------------------------------- the limit


def openai_too_large(payload: Any) -> str:
    error = payload["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["type"] == "invalid_request_error"
    return str(error["message"])


def anthropic_too_large(payload: Any) -> str:
    assert payload["type"] == "error"
    assert payload["error"]["type"] == "request_too_large"
    return str(payload["error"]["message"])


SHAPES: list[tuple[str, Callable[[Any], str]]] = [
    (CHAT_PATH, openai_too_large),
    (ANTHROPIC_PATH, anthropic_too_large),
]


@pytest.mark.parametrize("framing", ["content-length", "chunked"])
@pytest.mark.parametrize(("path", "shape"), SHAPES, ids=["openai", "anthropic"])
async def test_limit_plus_one_is_413_in_protocol_shape_and_never_forwarded(
    limited: Harness,
    http: aiohttp.ClientSession,
    path: str,
    shape: Callable[[Any], str],
    framing: str,
) -> None:
    body = exact_body(path, LIMIT + 1)
    data = body if framing == "content-length" else chunked(body)
    headers = {"Content-Type": "application/json"}
    async with http.post(limited.url + path, data=data, headers=headers) as resp:
        assert resp.status == 413
        assert resp.content_type == "application/json"
        message = shape(await resp.json())
    assert str(LIMIT) in message
    assert limited.emulator.stats == []
    # The proxy is still fine: the next request goes through.
    async with http.post(limited.url + path, data=stream_body(path, stream=False)) as resp:
        assert resp.status == 200
    assert len(limited.emulator.stats) == 1


@pytest.mark.parametrize("framing", ["content-length", "chunked"])
@pytest.mark.parametrize("size", [LIMIT - 1, LIMIT], ids=["limit-1", "limit"])
@pytest.mark.parametrize("path", [CHAT_PATH, ANTHROPIC_PATH])
async def test_bodies_up_to_the_limit_pass(
    limited: Harness, http: aiohttp.ClientSession, path: str, size: int, framing: str
) -> None:
    body = exact_body(path, size)
    data = body if framing == "content-length" else chunked(body)
    async with http.post(
        limited.url + path, data=data, headers={"Content-Type": "application/json"}
    ) as resp:
        assert resp.status == 200, await resp.text()
    (record,) = limited.emulator.stats
    assert record.body_bytes == size and record.body_digest == digest(body)


# ----------------------------------------------------------------- content codings


def codex_body(size: int) -> bytes:
    """A streaming Responses body like Codex sends, about ``size`` bytes, text that compresses."""
    words = " ".join(f"line {i}: the proxy must forward every byte" for i in range(size // 40))
    body = {"model": "gpt-e2e", "stream": True, "input": [{"role": "user", "content": words}]}
    return json.dumps(body).encode()


ENCODERS: dict[str, Callable[[bytes], bytes]] = {
    "gzip": gzip.compress,
    "zstd": lambda data: zstandard.ZstdCompressor().compress(data),
}


@pytest.mark.parametrize(
    ("path", "coding"),
    [(RESPONSES_PATH, "zstd"), (CHAT_PATH, "gzip"), (RESPONSES_PATH, "gzip"), (CHAT_PATH, "zstd")],
)
async def test_encoded_bodies_reach_the_upstream_decoded(
    http: aiohttp.ClientSession, path: str, coding: str
) -> None:
    plain = codex_body(300_000)
    encoded = ENCODERS[coding](plain)
    assert len(encoded) < len(plain) // 4
    headers = {"Content-Type": "application/json", "Content-Encoding": coding}
    async with (
        proxy_with_emulator() as h,
        http.post(h.url + path, data=encoded, headers=headers) as resp,
    ):
        assert resp.status == 200
        raw = await resp.read()
        record = h.emulator.stats[-1]
    assert record.body_digest == digest(plain) and record.body_bytes == len(plain)
    assert record.content_encoding is None
    assert record.stream is True
    assert b'"type":"response.completed"' in raw or b"[DONE]" in raw


@pytest.mark.parametrize("coding", ["gzip", "zstd"])
@pytest.mark.parametrize(("path", "shape"), SHAPES, ids=["openai", "anthropic"])
async def test_decompression_bomb_is_413(
    limited: Harness,
    http: aiohttp.ClientSession,
    path: str,
    shape: Callable[[Any], str],
    coding: str,
) -> None:
    # 16 MB of zeros inside a valid JSON string: a few KB on the wire.
    bomb = ENCODERS[coding](
        b'{"model":"m","messages":[{"role":"user","content":"' + bytes(16 << 20)
    )
    assert len(bomb) < 64 * 1024
    headers = {"Content-Type": "application/json", "Content-Encoding": coding}
    async with http.post(limited.url + path, data=bomb, headers=headers) as resp:
        assert resp.status == 413
        message = shape(await resp.json())
    assert str(LIMIT) in message
    assert limited.emulator.stats == []


# ----------------------------------------------------------------- hang-ups


@pytest.mark.parametrize("hangup", ["reset", "close"])
async def test_client_gone_mid_body_logs_and_sends_nothing_upstream(
    limited: Harness, http: aiohttp.ClientSession, hangup: str
) -> None:
    with LogWaiter("context_proxy", "before the body completed") as gone:
        client = await RawClient.connect(limited.url)
        client.send_head(
            "POST", CHAT_PATH, [("Content-Type", "application/json"), ("Content-Length", "40000")]
        )
        await client.send(exact_body(CHAT_PATH, 40_000)[:10_000])
        await wait_until(lambda: bool(limited.state.exchanges), "reading the body")
        if hangup == "reset":
            client.abort()
        else:
            await client.close()
        record = await gone.wait(2.0)
    assert record.levelno == logging.WARNING
    await wait_until(lambda: not limited.state.exchanges, "done with the exchange")
    assert limited.emulator.stats == []
    async with http.post(
        limited.url + CHAT_PATH, data=stream_body(CHAT_PATH, stream=False)
    ) as resp:
        assert resp.status == 200
    assert [r.path for r in limited.emulator.stats] == [CHAT_PATH]

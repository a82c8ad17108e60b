"""An upstream failure's words name its cause, in the client's error and the proxy's log.

The status alone (502, 504) does not tell an operator where to look: a connect
that times out points at the network (a firewall, IPv6 routed nowhere), broken
chunk framing at the upstream or a middlebox rewriting the stream, an
unverifiable certificate at the TLS setup (a self-signed or corporate CA). The
words say which, and never hold a key or a prompt.
"""

from __future__ import annotations

import asyncio
import json
import logging
import ssl
from pathlib import Path

import anthropic
import openai
import pytest

from tests.support.e2e import RawClient, sse_events
from tests.support.upstream import (
    SSE_HEAD,
    Scripted,
    black_hole,
    chat_sse_events,
    chunk,
    proxy_app,
    read_request,
    self_signed,
)

SECRET = "sk-ant-words-SECRET-5c1e"
PROMPT = "PROMPT-words-77aa"


async def test_a_connect_timeout_is_a_504_that_says_connect() -> None:
    """An upstream that never answers the SYN (the black hole: a full accept queue)
    is a 504 whose message says "connect", not that the upstream was slow to answer."""
    with black_hole() as port:
        async with (
            proxy_app(f"http://127.0.0.2:{port}", upstream_connect_timeout=0.5) as (url, _app),
            openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="sk-x", max_retries=0) as sdk,
        ):
            with pytest.raises(openai.APIStatusError) as caught:
                await sdk.chat.completions.create(
                    model="m", messages=[{"role": "user", "content": "hello"}]
                )
    assert caught.value.status_code == 504
    assert "connect" in caught.value.message, caught.value.message


async def test_broken_chunk_framing_mid_stream_is_called_framing_not_a_close() -> None:
    """A bad chunk size mid-stream, the connection still open: the client's error event
    says the framing broke, not that the upstream closed the connection."""

    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, n: int) -> None:
        await read_request(reader)
        writer.write(SSE_HEAD + chunk(chat_sse_events()[0]) + b"zz\r\nnot a chunk\r\n")
        await writer.drain()
        await asyncio.sleep(3)  # the connection stays open

    body = json.dumps(
        {"model": "m", "stream": True, "messages": [{"role": "user", "content": "x"}]}
    ).encode()
    async with Scripted(serve) as upstream, proxy_app(upstream.url) as (url, _app):
        client = await RawClient.connect(url)
        await client.request("POST", "/v1/chat/completions", body, [("Authorization", "Bearer k")])
        head = await client.read_head()
        raw = await client.read_body(head)
        await client.close()
    _name, data = sse_events(raw)[-1]
    message = json.loads(data)["error"]["message"]
    assert "closed the connection" not in message, message
    assert "framing" in message, message


async def test_a_self_signed_upstream_is_a_clean_502_that_names_the_certificate(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """An https upstream whose certificate does not verify: a 502 in the client's
    protocol shape (anthropic SDK) whose message or log line says "certificate"
    (the cause is no secret), while the log holds neither the key nor the prompt."""
    cert, key = self_signed(tmp_path)
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    context.load_cert_chain(cert, key)

    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, n: int) -> None:
        return  # the handshake fails first; a connection that gets here is closed

    caplog.set_level(logging.INFO, logger="context_proxy")
    async with (
        Scripted(serve, tls=context) as upstream,
        proxy_app(f"https://localhost:{upstream.port}") as (url, _app),
        anthropic.AsyncAnthropic(base_url=url, api_key=SECRET, max_retries=0) as sdk,
    ):
        with pytest.raises(anthropic.APIStatusError) as caught:
            await sdk.messages.create(
                model="m",
                max_tokens=5,
                messages=[{"role": "user", "content": PROMPT}],
            )
    assert caught.value.status_code == 502
    error = caught.value.body
    assert isinstance(error, dict) and error["type"] == "error", error
    proxy_log = "\n".join(
        r.getMessage() for r in caplog.records if r.name.startswith("context_proxy")
    )
    assert SECRET not in proxy_log and PROMPT not in proxy_log
    said = f"{caught.value.message}\n{proxy_log}"
    assert "certificate" in said.lower(), said

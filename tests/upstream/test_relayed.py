"""What crosses the upstream edge, through a real proxy in front of raw upstreams of our own.

Header value bytes unchanged both ways, a 204 followed by stray bytes, an upload
the upstream reads after its head or cuts mid-way, and the words a failure is
named in (the client's error and the proxy's log).
"""

from __future__ import annotations

import asyncio
import json
import logging
import socket
import ssl
import struct
from pathlib import Path

import anthropic
import openai
import pytest

from tests.support.e2e import RawClient, sse_events, wait_until
from tests.support.upstream import (
    SSE_HEAD,
    Scripted,
    black_hole,
    chat_sse_events,
    chunk,
    chunked,
    content_length,
    json_answer,
    pool_of,
    proxy_app,
    read_request,
    self_signed,
)

# -----------------------------------------------------------------------------
# A 204 answer followed by stray bytes reaches the client as the complete answer it is.
#
# A 204 has no body (RFC 9110 section 15.3.5), yet a misbehaving upstream or a
# middlebox may append one anyway. The bytes after the head belong to no answer,
# so the connection cannot be framed any further and is not kept; but the 204
# itself was whole: the client gets it, and the exchange is not concluded (nor
# logged) as a failed stream.


async def test_a_204_with_stray_bytes_reaches_the_client_and_is_not_logged_as_failed(
    caplog: pytest.LogCaptureFixture,
) -> None:
    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, n: int) -> None:
        await read_request(reader)
        writer.write(b"HTTP/1.1 204 No Content\r\n\r\nstray")
        await writer.drain()
        await asyncio.sleep(1)

    caplog.set_level(logging.INFO, logger="context_proxy")
    body = json.dumps({"model": "m", "messages": [{"role": "user", "content": "x"}]}).encode()
    async with Scripted(serve) as upstream, proxy_app(upstream.url) as (url, _app):
        client = await RawClient.connect(url)
        await client.request("POST", "/v1/chat/completions", body, [("Authorization", "Bearer k")])
        head = await client.read_head()
        await client.close()
    assert head.status == 204
    failed = [r.getMessage() for r in caplog.records if "failed" in r.getMessage()]
    assert failed == [], failed


# -----------------------------------------------------------------------------
# Header value bytes cross the proxy unchanged in both directions, UTF-8 or not.
#
# Header values are bytes (RFC 9110 section 5.5: obs-text is any byte >= 0x80),
# and real ones carry UTF-8 (a file name, a user's display name). A request's
# ``X-Odd: café ✓`` reaches the upstream as the client's bytes, and an upstream's
# ``X-Up: café ✓`` reaches the client as the upstream's bytes, not re-encoded
# into mojibake (``cafÃ©``).


async def test_non_ascii_header_value_bytes_cross_the_proxy_unchanged_both_ways() -> None:
    heads: list[bytes] = []

    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, n: int) -> None:
        head, _ = await read_request(reader)
        heads.append(head)
        writer.write(json_answer(extra="X-Up: café ✓\r\n".encode()))
        await writer.drain()

    body = json.dumps({"model": "m", "messages": [{"role": "user", "content": "x"}]}).encode()
    async with Scripted(serve) as upstream, proxy_app(upstream.url) as (url, _app):
        reader, writer = await asyncio.open_connection("127.0.0.1", int(url.rsplit(":", 1)[1]))
        writer.write(
            b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nX-Odd: caf\xc3\xa9 \xe2\x9c\x93\r\n"
            b"Content-Type: application/json\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body)
        )
        head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 5)
        writer.close()
    assert b"\r\nX-Odd: caf\xc3\xa9 \xe2\x9c\x93\r\n" in heads[0]  # request side: kept
    up_line = [line for line in head.split(b"\r\n") if line.lower().startswith(b"x-up:")]
    assert up_line == ["X-Up: café ✓".encode()], f"the client got {up_line!r}"


# -----------------------------------------------------------------------------
# An upstream that sends its 200 head before it reads the request body still gets all of it.
#
# A streaming server may open its event stream first (an aiohttp handler that
# ``prepare()``s its response before ``await request.json()``) and read the body
# afterwards. A client may stop sending the body only on an error answer (RFC
# 9112 section 9.3, RFC 9110 section 15); a 2xx head means "go on", so the
# upload continues and the stream completes instead of hanging, both sides
# waiting, until the idle-read timeout.


async def test_a_200_head_before_the_body_is_read_does_not_stop_the_upload() -> None:
    got = asyncio.get_running_loop().create_future()

    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, n: int) -> None:
        head = await reader.readuntil(b"\r\n\r\n")
        length = content_length(head)
        first, last, done = chat_sse_events()
        writer.write(SSE_HEAD + chunk(first))  # the head (and an event) first ...
        await writer.drain()
        body = await reader.readexactly(length)  # ... then the body
        if not got.done():
            got.set_result(len(body))
        writer.write(chunked(last, done))
        await writer.drain()

    big = "x" * 30_000_000
    async with (
        Scripted(serve) as upstream,
        proxy_app(upstream.url, upstream_idle_read_timeout=5.0) as (url, _app),
        openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="sk-x", max_retries=0, timeout=30) as sdk,
    ):
        stream = await sdk.chat.completions.create(
            model="m",
            messages=[{"role": "user", "content": big}],
            stream=True,
        )
        finishes = []
        try:
            async for event in stream:
                if event.choices and event.choices[0].finish_reason:
                    finishes.append(event.choices[0].finish_reason)
        except openai.APIError as exc:
            raise AssertionError(
                f"upstream got {got.result() if got.done() else 'no complete'} body; "
                f"stream failed: {exc}"
            ) from None
    assert got.done() and got.result() > 30_000_000
    assert finishes == ["stop"]


# -----------------------------------------------------------------------------
# An upstream that resets its connection mid-upload ends the upload at once.
#
# An upstream may reset a connection while a large body is still going up (a
# load balancer's body-size limit, a crashed worker). The client gets a 502 in
# its protocol shape, the pool's connection is freed, and the proxy stops
# writing the rest of the body into the dead transport: asyncio logs
# "socket.send() raised exception." for every write after the fifth on a lost
# connection, which for a 20 MB body would be dozens of warnings per failure.


async def test_a_reset_mid_upload_is_a_502_and_no_write_goes_to_the_dead_socket() -> None:
    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, n: int) -> None:
        await reader.readuntil(b"\r\n\r\n")
        await reader.readexactly(1_000_000)
        sock = writer.get_extra_info("socket")
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        writer.transport.abort()  # RST

    body = json.dumps(
        {"model": "m", "stream": True, "messages": [{"role": "user", "content": "x" * 20_000_000}]}
    ).encode()
    records: list[logging.LogRecord] = []

    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            records.append(record)

    keep = Keep(logging.WARNING)
    logging.getLogger("asyncio").addHandler(keep)
    async with Scripted(serve) as upstream, proxy_app(upstream.url) as (url, app):
        client = await RawClient.connect(url)
        await client.request(
            "POST", "/v1/chat/completions", body, [("Authorization", "Bearer sk-x")]
        )
        head = await client.read_head()
        answer = json.loads(await client.read_body(head))
        await client.close()
        assert head.status == 502 and "error" in answer
        pool = pool_of(app)
        await wait_until(lambda: pool.connections_in_use == 0, "the connection freed", within=5.0)
    logging.getLogger("asyncio").removeHandler(keep)
    spam = [r for r in records if "socket.send() raised exception" in r.getMessage()]
    assert spam == [], f"{len(spam)} asyncio warnings: the upload went on writing to a lost socket"


# -----------------------------------------------------------------------------
# An upstream failure's words name its cause, in the client's error and the proxy's log.
#
# The status alone (502, 504) does not tell an operator where to look: a connect
# that times out points at the network (a firewall, IPv6 routed nowhere), broken
# chunk framing at the upstream or a middlebox rewriting the stream, an
# unverifiable certificate at the TLS setup (a self-signed or corporate CA). The
# words say which, and never hold a key or a prompt.


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

"""Adversarial egress: forward proxies that stall, trickle, lie or hang up."""

from __future__ import annotations

import asyncio
import base64
import time

import aiohttp
import openai
import pytest

from proxy._egress import EgressError, ForwardProxy, choose_proxy
from tests.support.ports import free_port
from tests.support.process import Proc
from tests.support.upstream import Scripted, pool_of, proxy_app

BODY = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}


async def test_a_client_that_hangs_up_during_connect_frees_the_tunnel_at_once() -> None:
    """The forward proxy never answers CONNECT; the client leaves after 0.5 s: the
    connection to the forward proxy is closed then, not at the connect timeout."""
    closed = asyncio.Event()

    async def stall(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, n: int) -> None:
        await reader.readuntil(b"\r\n\r\n")
        try:
            await reader.read()  # EOF once the proxy closes its side
        finally:
            closed.set()

    async with Scripted(stall) as fake:
        env = {"HTTPS_PROXY": f"http://127.0.0.1:{fake.port}"}
        async with (
            proxy_app(
                "https://api.example.invalid", environ=env, upstream_connect_timeout=30.0
            ) as (url, app),
            aiohttp.ClientSession() as http,
        ):
            with pytest.raises(TimeoutError):
                async with asyncio.timeout(0.5):
                    await http.post(
                        f"{url}/v1/chat/completions",
                        json=BODY,
                        headers={"authorization": "Bearer k"},
                    )
            async with asyncio.timeout(5):
                await closed.wait()
            for _ in range(100):
                if not app.state.exchanges and pool_of(app).connections_in_use == 0:
                    break
                await asyncio.sleep(0.05)
            assert not app.state.exchanges
            assert pool_of(app).connections_in_use == 0


async def test_a_stalled_connect_is_a_504_or_502_within_the_connect_timeout() -> None:
    async def stall(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, n: int) -> None:
        await reader.readuntil(b"\r\n\r\n")
        writer.write(b"HTTP/1.1 200 Connection established\r\n")  # never the blank line
        await writer.drain()
        await asyncio.sleep(30)

    async with Scripted(stall) as fake:
        env = {"HTTPS_PROXY": f"http://u:secretpw@127.0.0.1:{fake.port}"}
        async with (
            proxy_app("https://api.example.invalid", environ=env, upstream_connect_timeout=1.0) as (
                url,
                app,
            ),
            openai.AsyncOpenAI(
                base_url=f"{url}/v1", api_key="sk-x", max_retries=0, timeout=10
            ) as sdk,
        ):
            t0 = time.monotonic()
            with pytest.raises(openai.APIStatusError) as caught:
                await sdk.chat.completions.create(**BODY)  # type: ignore[call-overload]
            assert time.monotonic() - t0 < 5
            assert caught.value.status_code in (502, 504)
            assert "secretpw" not in str(caught.value.body)
            assert not app.state.exchanges


@pytest.mark.parametrize(
    ("head", "piece"),
    [
        # A proxy writing its head in small pieces (line by line, Nagle off).
        (
            b"HTTP/1.1 200 Connection established\r\n"
            + b"".join(b"X-Hop-%d: y\r\n" % i for i in range(40))
            + b"\r\n",
            3,
        ),
        (b"HTTP/1.1 200 Connection established\r\nProxy-Agent: p\r\n\r\n", 1),
    ],
)
async def test_a_tunnel_head_that_comes_in_many_small_pieces_still_opens_the_tunnel(
    head: bytes, piece: int
) -> None:
    """The tunnel opens (the TLS hello goes through it) however many reads the
    proxy's 200 takes, within the connect timeout."""
    hello: list[bytes] = []

    async def trickle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, n: int) -> None:
        await reader.readuntil(b"\r\n\r\n")
        for i in range(0, len(head), piece):
            writer.write(head[i : i + piece])
            await writer.drain()
            await asyncio.sleep(0.002)
        hello.append(await reader.read(1))

    async with Scripted(trickle) as fake:
        env = {"HTTPS_PROXY": f"http://127.0.0.1:{fake.port}"}
        async with (
            proxy_app("https://api.example.invalid", environ=env, upstream_connect_timeout=5.0) as (
                url,
                _app,
            ),
            openai.AsyncOpenAI(
                base_url=f"{url}/v1", api_key="sk-x", max_retries=0, timeout=10
            ) as sdk,
        ):
            with pytest.raises(openai.APIStatusError) as caught:
                await sdk.chat.completions.create(**BODY)  # type: ignore[call-overload]
    # The fake is no TLS server: the handshake fails, after the tunnel opened.
    assert hello == [b"\x16"], caught.value.body
    assert caught.value.status_code == 502


async def test_an_endless_tunnel_head_is_refused_as_too_big() -> None:
    async def endless(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, n: int) -> None:
        await reader.readuntil(b"\r\n\r\n")
        writer.write(b"HTTP/1.1 200 Connection established\r\n")
        for _ in range(10_000):  # bounded: the proxy stops reading long before
            writer.write(b"X-Filler: " + b"a" * 100 + b"\r\n")
            await writer.drain()

    async with Scripted(endless) as fake:
        env = {"HTTPS_PROXY": f"http://127.0.0.1:{fake.port}"}
        async with (
            proxy_app("https://api.example.invalid", environ=env, upstream_connect_timeout=5.0) as (
                url,
                app,
            ),
            openai.AsyncOpenAI(
                base_url=f"{url}/v1", api_key="sk-x", max_retries=0, timeout=10
            ) as sdk,
        ):
            with pytest.raises(openai.APIStatusError) as caught:
                await sdk.chat.completions.create(**BODY)  # type: ignore[call-overload]
            assert not app.state.exchanges
    assert caught.value.status_code == 502
    body = caught.value.body
    assert isinstance(body, dict)
    assert "answer head over 16384 bytes" in body["message"]


@pytest.mark.parametrize(
    "url",
    [
        "http://alice:2024/pw@proxy.corp:3128",
        "http://alice:99#pw@proxy.corp",
        "http://alice:12?pw@proxy.corp:3128",
    ],
)
def test_credentials_with_an_unencoded_slash_are_refused_not_shown_as_host_and_port(
    url: str,
) -> None:
    """Unencoded, ``alice:2024`` parses as host and port: the user name and part of the
    password would be shown in every log line and 502 body naming the proxy."""
    with pytest.raises(EgressError) as caught:
        choose_proxy(True, "api.openai.com", 443, setting=None, environ={"HTTPS_PROXY": url})
    words = str(caught.value)
    assert words.startswith("HTTPS_PROXY: ") and "percent-encode" in words
    assert "alice" not in words and "pw" not in words


def test_percent_encoded_credentials_with_a_slash_still_work() -> None:
    proxy = ForwardProxy("http://alice:pa%2Fss@proxy.corp:3128", "HTTPS_PROXY")
    assert proxy.shown == "http://proxy.corp:3128"
    assert proxy.authorization == "Basic " + base64.b64encode(b"alice:pa/ss").decode()


@pytest.mark.parametrize(
    "env",
    [
        {"HTTP_PROXY": "http://127.0.0.1:{port}"},  # the egress proxy is this proxy
        {"CONTEXT_PROXY_UPSTREAM_OPENAI": "http://localhost:{port}"},  # the upstream is
    ],
    ids=["egress-proxy", "upstream"],
)
async def test_a_proxy_that_would_send_requests_to_itself_refuses_to_start(
    env: dict[str, str],
) -> None:
    """Each request came back to the proxy and went out again, a connection pair per
    hop: one request took every file descriptor (20,000) in 11 s, and from then on
    every client got 503 fd_reserve."""
    port = free_port()
    proc = await Proc.start(
        "proxy",
        "serve",
        "--port",
        str(port),
        env={
            "CONTEXT_PROXY_PLUGINS": "",
            "CONTEXT_PROXY_UPSTREAM_OPENAI": "http://api.example.invalid",
            "CONTEXT_PROXY_UPSTREAM_ANTHROPIC": "http://api.example.invalid",
            **{k: v.format(port=port) for k, v in env.items()},
        },
    )
    try:
        code = await proc.wait_exit(20)
    finally:
        await proc.stop()
    assert code == 1, proc.output
    assert "openai upstream:" in proc.output and "this proxy itself" in proc.output
    assert "listening on" not in proc.output

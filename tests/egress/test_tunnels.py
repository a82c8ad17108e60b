"""Egress through forward proxies (proxy/_egress.py, the pool's CONNECT tunnels).

A real Debian tinyproxy (egress as companies have it), then fake forward proxies
of our own that stall, trickle, lie or hang up.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import logging
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import aiohttp
import anthropic
import openai
import pytest
import uvloop
from openai.types.chat import ChatCompletionUserMessageParam

from proxy._egress import EgressError, ForwardProxy, choose_proxy
from proxy._emulator import DEFAULT_TEXT, EmulatorServer, start_emulator
from proxy._relay import upstream_tls
from proxy._upstream import UpstreamPool, UpstreamTarget
from tests.support.ports import free_port
from tests.support.process import Proc
from tests.support.tinyproxy import PrivateCA, Tinyproxy, private_ca, tinyproxy
from tests.support.upstream import Scripted, json_answer, pool_of, proxy_app, read_request

# -----------------------------------------------------------------------------
# Egress as companies have it (issue 24 item 6), through a real Debian tinyproxy.
#
# The upstream is the project's emulator behind TLS, its certificate signed by a
# private CA (``trustme``) for ``localhost``; the proxy reaches it through
# tinyproxy started by the test on a loopback port. That a request really went
# through tinyproxy is read from tinyproxy's own log (its request lines).


SECRET = "sk-egress-test-key-0123456789"
USER: list[ChatCompletionUserMessageParam] = [{"role": "user", "content": "hi"}]


@pytest.fixture
def ca(tmp_path: Path) -> PrivateCA:
    return private_ca(tmp_path)


@pytest.fixture
async def tls_emulator(ca: PrivateCA) -> AsyncIterator[EmulatorServer]:
    emulator = await start_emulator(tls=ca.server)
    try:
        yield emulator
    finally:
        await emulator.close()


@pytest.fixture
async def plain_emulator() -> AsyncIterator[EmulatorServer]:
    emulator = await start_emulator()
    try:
        yield emulator
    finally:
        await emulator.close()


@pytest.fixture
def tunnel(tmp_path: Path, tls_emulator: EmulatorServer) -> Iterator[Tinyproxy]:
    """tinyproxy allowed to tunnel to the TLS emulator's port."""
    with tinyproxy(tmp_path, connect_ports=[tls_emulator.port]) as proxy:
        yield proxy


def _openai(url: str) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=f"{url}/v1", api_key=SECRET, max_retries=0, timeout=20)


@contextlib.asynccontextmanager
async def _proxy(
    upstream: str, environ: dict[str, str], **settings: Any
) -> AsyncIterator[openai.AsyncOpenAI]:
    async with proxy_app(upstream, environ=environ, **settings) as (url, _app), _openai(url) as sdk:
        yield sdk


async def _stream_text(sdk: openai.AsyncOpenAI) -> str:
    stream = await sdk.chat.completions.create(model="m", messages=USER, stream=True)
    return "".join([c.choices[0].delta.content or "" async for c in stream if c.choices])


async def test_an_https_upstream_is_reached_in_a_connect_tunnel_reused_for_its_target(
    ca: PrivateCA, tls_emulator: EmulatorServer, tunnel: Tinyproxy
) -> None:
    upstream = f"https://localhost:{tls_emulator.port}"
    env = {"HTTPS_PROXY": tunnel.url}
    async with _proxy(upstream, env, upstream_ca_file=str(ca.ca_file)) as sdk:
        assert await _stream_text(sdk) == DEFAULT_TEXT
        chat = await sdk.chat.completions.create(model="m", messages=USER)
        assert chat.choices[0].message.content
    # One tunnel for both requests (the pooled connection is kept per route), to the
    # upstream's name and port; TLS inside it named the upstream (SNI), not the proxy.
    assert tunnel.requests() == [f"CONNECT localhost:{tls_emulator.port} HTTP/1.1"]
    assert ca.sni == ["localhost"]
    assert [r.path for r in tls_emulator.stats] == ["/v1/chat/completions"] * 2
    # The proxy's request headers inside the tunnel are the client's (its key arrived).
    assert tls_emulator.stats[0].headers["authorization"].startswith("Bearer ")


async def test_an_http_upstream_gets_the_absolute_form_through_http_proxy(
    tmp_path: Path, plain_emulator: EmulatorServer
) -> None:
    with tinyproxy(tmp_path) as proxy:
        env = {"HTTP_PROXY": proxy.url, "HTTPS_PROXY": "http://127.0.0.1:9"}
        async with (
            proxy_app(plain_emulator.url, environ=env) as (url, _app),
            anthropic.AsyncAnthropic(
                base_url=url, api_key=SECRET, max_retries=0, timeout=20
            ) as sdk,
        ):
            message = await sdk.messages.create(
                model="claude-x", max_tokens=16, messages=[{"role": "user", "content": "hi"}]
            )
        assert message.content[0].type == "text" and message.content[0].text == DEFAULT_TEXT
        assert proxy.requests() == [f"POST {plain_emulator.url}/v1/messages HTTP/1.1"]
    assert [r.path for r in plain_emulator.stats] == ["/v1/messages"]


async def test_an_http_proxys_407_is_a_502_naming_the_proxy_not_the_clients_api_error(
    tmp_path: Path, plain_emulator: EmulatorServer
) -> None:
    # Without credentials, the proxy answers the absolute-form request itself: its 407
    # (an HTML page) must not reach an SDK as if its API key had been refused upstream.
    with tinyproxy(tmp_path, basic_auth=("alice", "s3cret")) as proxy:
        env = {"HTTP_PROXY": proxy.url, "HTTPS_PROXY": "http://127.0.0.1:9"}
        async with (
            proxy_app(plain_emulator.url, environ=env) as (url, _app),
            anthropic.AsyncAnthropic(
                base_url=url, api_key=SECRET, max_retries=0, timeout=20
            ) as sdk,
        ):
            with pytest.raises(anthropic.APIStatusError) as caught:
                await sdk.messages.create(
                    model="claude-x", max_tokens=16, messages=[{"role": "user", "content": "hi"}]
                )
        assert caught.value.status_code == 502
        message = str(caught.value)
        assert "egress proxy" in message and "407 Proxy Authentication Required" in message
        assert "<html" not in message.lower()
    assert plain_emulator.stats == []


async def test_no_proxy_sends_its_hosts_direct_and_the_others_through_the_proxy(
    ca: PrivateCA, tls_emulator: EmulatorServer, tunnel: Tinyproxy
) -> None:
    port = tls_emulator.port
    # Two routes to one emulator: openai by name (tunnelled), anthropic by IP (direct).
    env = {"https_proxy": tunnel.url, "no_proxy": "example.invalid, 127.0.0.0/8"}
    async with (
        proxy_app(
            f"https://localhost:{port}",
            environ=env,
            upstream_anthropic=f"https://127.0.0.1:{port}",
            upstream_ca_file=str(ca.ca_file),
        ) as (url, _app),
        _openai(url) as oai,
        anthropic.AsyncAnthropic(base_url=url, api_key=SECRET, max_retries=0, timeout=20) as ant,
    ):
        await ant.messages.create(
            model="claude-x", max_tokens=16, messages=[{"role": "user", "content": "hi"}]
        )
        assert tunnel.requests() == []
        assert await _stream_text(oai) == DEFAULT_TEXT
    assert tunnel.requests() == [f"CONNECT localhost:{port} HTTP/1.1"]
    assert len(tls_emulator.stats) == 2


async def test_a_private_upstream_is_trusted_only_with_upstream_ca_file(
    tls_emulator: EmulatorServer, tunnel: Tinyproxy
) -> None:
    upstream = f"https://localhost:{tls_emulator.port}"
    async with _proxy(upstream, {"HTTPS_PROXY": tunnel.url}) as sdk:
        with pytest.raises(openai.APIStatusError) as caught:
            await sdk.chat.completions.create(model="m", messages=USER)
    assert caught.value.status_code == 502
    message = caught.value.body["message"]  # type: ignore[index]
    assert message.startswith(
        f"upstream's TLS certificate could not be verified at localhost:{tls_emulator.port}"
    )
    # The tunnel was open; the handshake inside it is what failed.
    assert tunnel.requests() == [f"CONNECT localhost:{tls_emulator.port} HTTP/1.1"]
    assert tls_emulator.stats == []


async def test_a_refused_connect_is_a_502_in_the_clients_shape(
    tmp_path: Path,
    ca: PrivateCA,
    tls_emulator: EmulatorServer,
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.INFO, logger="context_proxy.access")
    # Only port 443 may be tunnelled to: tinyproxy answers 403 to the emulator's port.
    with tinyproxy(tmp_path, connect_ports=[443]) as proxy:
        upstream = f"https://localhost:{tls_emulator.port}"
        env = {"HTTPS_PROXY": proxy.url}
        async with _proxy(upstream, env, upstream_ca_file=str(ca.ca_file)) as sdk:
            with pytest.raises(openai.APIStatusError) as caught:
                await sdk.chat.completions.create(model="m", messages=USER)
        assert proxy.requests() == [f"CONNECT localhost:{tls_emulator.port} HTTP/1.1"]
    assert caught.value.status_code == 502
    body = caught.value.body
    assert isinstance(body, dict)
    assert body["message"] == (
        f"egress proxy {proxy.url} (from HTTPS_PROXY) refused CONNECT to "
        f"localhost:{tls_emulator.port}: 403 Forbidden "
        "(the proxy does not allow this host or port)"
    )
    assert tls_emulator.stats == []
    assert "status=502 outcome=upstream_unreachable" in caplog.text


async def test_proxy_credentials_go_as_basic_auth_and_are_never_logged(
    tmp_path: Path,
    ca: PrivateCA,
    tls_emulator: EmulatorServer,
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.DEBUG)
    port = tls_emulator.port
    upstream = f"https://localhost:{port}"
    with tinyproxy(tmp_path, connect_ports=[port], basic_auth=("alice", "s3cret")) as proxy:
        host_port = proxy.url.removeprefix("http://")
        without = {"HTTPS_PROXY": proxy.url}
        async with _proxy(upstream, without, upstream_ca_file=str(ca.ca_file)) as sdk:
            with pytest.raises(openai.APIStatusError) as caught:
                await sdk.chat.completions.create(model="m", messages=USER)
        assert caught.value.status_code == 502
        assert "407 Proxy Authentication Required (proxy credentials" in str(caught.value)
        wrong = {"HTTPS_PROXY": f"http://alice:n0tright@{host_port}"}
        async with _proxy(upstream, wrong, upstream_ca_file=str(ca.ca_file)) as sdk:
            with pytest.raises(openai.APIStatusError) as caught:
                await sdk.chat.completions.create(model="m", messages=USER)
        # tinyproxy answers 401 to wrong credentials (407 to none).
        assert "401 Unauthorized (proxy credentials missing or wrong" in str(caught.value)
        assert tls_emulator.stats == []
        right = {"HTTPS_PROXY": f"http://alice:s3cret@{host_port}"}
        async with _proxy(upstream, right, upstream_ca_file=str(ca.ca_file)) as sdk:
            assert await _stream_text(sdk) == DEFAULT_TEXT
        assert len(proxy.requests()) == 3
    assert len(tls_emulator.stats) == 1
    # Neither the password nor its Basic encoding in any log line of the proxy.
    assert "s3cret" not in caplog.text and "n0tright" not in caplog.text
    assert "YWxpY2U6czNjcmV0" not in caplog.text


async def test_an_unreachable_proxy_is_upstream_unreachable(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.INFO, logger="context_proxy.access")
    dead = free_port()  # nothing listens there
    upstream = "https://localhost:1"
    async with _proxy(upstream, {"HTTPS_PROXY": f"http://127.0.0.1:{dead}"}) as sdk:
        with pytest.raises(openai.APIStatusError) as caught:
            await sdk.chat.completions.create(model="m", messages=USER)
    assert caught.value.status_code == 502
    assert caught.value.body["message"] == (  # type: ignore[index]
        f"egress proxy http://127.0.0.1:{dead} (from HTTPS_PROXY) refused the connection "
        f"at 127.0.0.1:{dead}"
    )
    # Booked as an upstream that cannot be reached, as without a proxy.
    assert "status=502 outcome=upstream_unreachable" in caplog.text


async def test_the_upstream_proxy_setting_overrides_the_environment(
    ca: PrivateCA, tls_emulator: EmulatorServer, tunnel: Tinyproxy
) -> None:
    upstream = f"https://localhost:{tls_emulator.port}"
    env = {"HTTPS_PROXY": f"http://127.0.0.1:{free_port()}"}  # dead: would fail
    async with _proxy(
        upstream, env, upstream_proxy=tunnel.url, upstream_ca_file=str(ca.ca_file)
    ) as sdk:
        assert await _stream_text(sdk) == DEFAULT_TEXT
    assert tunnel.requests() == [f"CONNECT localhost:{tls_emulator.port} HTTP/1.1"]


async def test_serve_reads_the_proxy_environment_and_logs_the_route_without_credentials(
    tmp_path: Path, ca: PrivateCA, tls_emulator: EmulatorServer
) -> None:
    port = tls_emulator.port
    with tinyproxy(tmp_path, connect_ports=[port], basic_auth=("alice", "s3cret")) as proxy:
        host_port = proxy.url.removeprefix("http://")
        env = {
            # Lowercase: it wins over whatever uppercase ones this process has.
            "https_proxy": f"http://alice:s3cret@{host_port}",
            "no_proxy": "",
            "CONTEXT_PROXY_UPSTREAM_CA_FILE": str(ca.ca_file),
            "CONTEXT_PROXY_ACCESS_LOG": "true",
        }
        child, proxy_port = await Proc.serve(f"https://localhost:{port}", env=env)
        try:
            await child.wait_line(
                rf"egress: openai upstream through {proxy.url} \(from https_proxy\)"
            )
            async with _openai(f"http://127.0.0.1:{proxy_port}") as sdk:
                assert await _stream_text(sdk) == DEFAULT_TEXT
            await child.wait_line(r"status=200")
        finally:
            await child.stop()
        assert proxy.requests() == [f"CONNECT localhost:{port} HTTP/1.1"]
    assert "s3cret" not in child.output and "YWxpY2U6czNjcmV0" not in child.output


def test_the_tunnel_works_on_uvloop_too(tmp_path: Path, ca: PrivateCA) -> None:
    async def answer(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, n: int) -> None:
        for _ in range(4):  # bounded: the requests of one kept connection
            await read_request(reader)
            writer.write(json_answer())
            await writer.drain()

    async def two_requests(proxy_url: str, port: int) -> list[int]:
        pool = UpstreamPool(
            connect_timeout=10.0,
            idle_read=5.0,
            max_connections=0,
            tls_context=upstream_tls(str(ca.ca_file)),
        )
        via = ForwardProxy(proxy_url, "HTTPS_PROXY")
        target = UpstreamTarget(f"https://localhost:{port}", via)
        statuses = []
        try:
            for _ in range(2):
                resp = await pool.request(target, "GET", "/", {})
                for _ in range(100):  # bounded: a small JSON body
                    if not await resp.read():
                        break
                statuses.append(resp.status)
                resp.release()
        finally:
            await pool.close()
        return statuses

    async def run() -> tuple[list[int], list[str]]:
        async with Scripted(answer, tls=ca.server) as upstream:
            with tinyproxy(tmp_path, connect_ports=[upstream.port]) as proxy:
                statuses = await two_requests(proxy.url, upstream.port)
                return statuses, proxy.requests()

    with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
        statuses, lines = runner.run(run())
    assert statuses == [200, 200]
    assert len(lines) == 1 and lines[0].startswith("CONNECT localhost:")


# -----------------------------------------------------------------------------
# Adversarial egress: forward proxies that stall, trickle, lie or hang up.


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

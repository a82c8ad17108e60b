"""Which forward proxy an upstream is reached through (issue 24 item 6): the
environment variables and the ``upstream_proxy`` setting, read as curl and
requests read them (proxy/_egress.py). The tunnels themselves are tested through
a real tinyproxy in ``tests/egress/test_tunnels.py``."""

from __future__ import annotations

import asyncio
import base64
import os
import subprocess
import sys
from pathlib import Path

import openai
import pytest
from click.testing import CliRunner, Result

from proxy._cli import main
from proxy._config import ConfigError, load_settings
from proxy._egress import EgressError, ForwardProxy, NoProxy, choose_proxy
from proxy._relay import upstream_targets
from proxy._upstream import UpstreamTarget
from tests.support.upstream import Scripted, proxy_app


def _via(url: str, env: dict[str, str], setting: str | None = None) -> str | None:
    target = UpstreamTarget(url)
    proxy = choose_proxy(target.tls, target.host, target.port, setting=setting, environ=env)
    return None if proxy is None else proxy.shown


def test_https_upstreams_take_https_proxy_and_http_upstreams_http_proxy() -> None:
    env = {"HTTPS_PROXY": "http://secure.corp:3128", "HTTP_PROXY": "http://plain.corp:8080"}
    assert _via("https://api.openai.com", env) == "http://secure.corp:3128"
    assert _via("http://gateway.corp:9000", env) == "http://plain.corp:8080"
    assert _via("https://api.openai.com", {"HTTP_PROXY": "http://plain.corp:8080"}) is None
    assert _via("https://api.openai.com", {}) is None


def test_the_lowercase_variable_wins_and_an_empty_one_is_unset() -> None:
    env = {"https_proxy": "http://lower:1", "HTTPS_PROXY": "http://upper:2"}
    assert _via("https://api.openai.com", env) == "http://lower:1"
    assert _via("https://api.openai.com", {"https_proxy": "", "HTTPS_PROXY": "upper:2"}) == (
        "http://upper:2"
    )


def test_a_proxy_without_scheme_or_port_is_http_on_1080_like_curl() -> None:
    assert _via("https://a.example", {"HTTPS_PROXY": "proxy.corp"}) == "http://proxy.corp:1080"


def test_the_setting_overrides_the_environment_for_every_upstream() -> None:
    env = {"HTTPS_PROXY": "http://env:1", "HTTP_PROXY": "http://env:2"}
    assert _via("https://api.openai.com", env, "http://set:3") == "http://set:3"
    assert _via("http://gateway.corp", env, "http://set:3") == "http://set:3"
    # NO_PROXY still applies to it, as curl applies it to --proxy.
    assert _via("http://gateway.corp", {"NO_PROXY": "corp"}, "http://set:3") is None


@pytest.mark.parametrize(
    ("no_proxy", "url", "bypassed"),
    [
        ("*", "https://api.openai.com", True),
        ("api.openai.com", "https://api.openai.com", True),
        ("API.OpenAI.com", "https://api.openai.com", True),
        ("openai.com", "https://api.openai.com", True),
        (".openai.com", "https://api.openai.com", True),
        (".openai.com", "https://openai.com", True),
        ("*.openai.com", "https://api.openai.com", True),
        ("openai.com", "https://notopenai.com", False),
        ("api.openai.com", "https://openai.com", False),
        ("localhost:8443", "https://localhost:8443", True),
        ("localhost:8443", "https://localhost:9443", False),
        ("openai.com:443", "https://api.openai.com", True),
        ("10.1.2.3", "http://10.1.2.3:8000", True),
        ("10.1.2.3", "http://10.1.2.4:8000", False),
        ("10.0.0.0/8", "http://10.200.0.1", True),
        ("10.0.0.0/8", "http://11.0.0.1", False),
        ("::1", "http://[::1]:8000", True),
        ("[::1]:8000", "http://[::1]:8000", True),
        ("[::1]:8000", "http://[::1]:9000", False),
        ("fd00::/8", "http://[fd12::5]", True),
        # An IP entry never matches a name (nothing is resolved), nor a name an IP.
        ("127.0.0.1", "http://localhost", False),
        ("localhost", "http://127.0.0.1", False),
        (" , internal.corp ,, ", "https://llm.internal.corp", True),
        ("", "https://api.openai.com", False),
    ],
)
def test_no_proxy_entries_match_as_curl_and_requests_match_them(
    no_proxy: str, url: str, bypassed: bool
) -> None:
    target = UpstreamTarget(url)
    assert NoProxy(no_proxy).bypasses(target.host, target.port) is bypassed
    env = {"HTTPS_PROXY": "http://p:1", "HTTP_PROXY": "http://p:1", "no_proxy": no_proxy}
    assert (_via(url, env) is None) is bypassed


def test_lowercase_no_proxy_wins_over_uppercase() -> None:
    env = {"HTTPS_PROXY": "http://p:1", "no_proxy": "other.com", "NO_PROXY": "openai.com"}
    assert _via("https://api.openai.com", env) == "http://p:1"


def test_credentials_become_basic_proxy_authorization_and_are_never_shown() -> None:
    proxy = ForwardProxy("http://al%40ice:s3cr%3At@proxy.corp:3128", "HTTPS_PROXY")
    expected = base64.b64encode(b"al@ice:s3cr:t").decode()
    assert proxy.authorization == f"Basic {expected}"
    assert proxy.shown == "http://proxy.corp:3128"
    assert "s3cr" not in repr(proxy) and "alice" not in repr(proxy)
    assert ForwardProxy("http://proxy.corp:3128", "x").authorization is None


def test_an_http_upstream_through_a_proxy_gets_the_absolute_form_and_the_credentials() -> None:
    via = ForwardProxy("http://u:p@proxy.corp:3128", "HTTP_PROXY")
    target = UpstreamTarget("http://gateway.corp:9000/base", via)
    path = target.request_target("/v1/messages", "beta=true")
    assert path == "http://gateway.corp:9000/base/v1/messages?beta=true"
    head = target.request_head("POST", path, {"X-Api-Key": "k"}).data.decode()
    assert head.startswith("POST http://gateway.corp:9000/base/v1/messages?beta=true HTTP/1.1\r\n")
    assert "Host: gateway.corp:9000\r\n" in head
    assert f"Proxy-Authorization: {via.authorization}\r\n" in head
    # Through a tunnel the proxy's credentials stay on the CONNECT, never in the tunnel.
    tunnelled = UpstreamTarget("https://api.openai.com", via)
    assert tunnelled.request_target("/v1/responses", "") == "/v1/responses"
    inner = tunnelled.request_head("POST", "/v1/responses", {}).data.decode()
    assert "Proxy-Authorization" not in inner


def test_pooled_connections_are_kept_per_route() -> None:
    via = ForwardProxy("http://proxy.corp:3128", "HTTPS_PROXY")
    assert (
        UpstreamTarget("https://api.openai.com").key
        != UpstreamTarget("https://api.openai.com", via).key
    )


def test_upstream_targets_route_each_upstream_from_settings_and_environment() -> None:
    settings = load_settings(
        None,
        environ={},
        overrides={"upstream_anthropic": "http://gateway.corp:9000"},
    )
    targets = upstream_targets(settings, {"HTTPS_PROXY": "http://p:3128", "NO_PROXY": "corp"})
    assert targets["openai"].via is not None and targets["openai"].via.shown == "http://p:3128"
    assert targets["anthropic"].via is None


@pytest.mark.parametrize("url", ["https://proxy.corp:3128", "socks5://proxy.corp:1080"])
def test_an_unsupported_proxy_scheme_is_an_error_naming_its_variable(url: str) -> None:
    with pytest.raises(EgressError, match=r"^HTTPS_PROXY: only http:// forward proxies"):
        choose_proxy(True, "api.openai.com", 443, setting=None, environ={"HTTPS_PROXY": url})


def test_a_bad_upstream_proxy_setting_is_a_config_error_without_its_credentials() -> None:
    with pytest.raises(ConfigError) as caught:
        load_settings(
            None, environ={"CONTEXT_PROXY_UPSTREAM_PROXY": "socks5://user:hunter2@proxy:1080"}
        )
    assert str(caught.value).startswith("CONTEXT_PROXY_UPSTREAM_PROXY: only http://")
    assert "hunter2" not in str(caught.value)
    empty = load_settings(None, environ={"CONTEXT_PROXY_UPSTREAM_PROXY": ""})
    assert empty.upstream_proxy is None


def _check(tmp_path: Path, **env: str) -> Result:
    config = tmp_path / "proxy.toml"
    config.write_text("plugins = []\n")
    # Whatever proxy variables this process has are unset for the check (None: unset).
    hermetic: dict[str, str | None] = {
        name: None
        for base in ("https_proxy", "http_proxy", "no_proxy")
        for name in (base, base.upper())
    }
    hermetic.update(env)
    return CliRunner().invoke(main, ["check", "--config", str(config)], env=hermetic)


def test_check_reports_a_missing_or_unusable_ca_file(tmp_path: Path) -> None:
    missing = tmp_path / "nowhere" / "ca.pem"
    result = _check(tmp_path, CONTEXT_PROXY_UPSTREAM_CA_FILE=str(missing))
    assert result.exit_code == 1
    assert result.output.strip() == (
        f"problem: upstream_ca_file: cannot read {missing}: No such file or directory"
    )
    junk = tmp_path / "junk.pem"
    junk.write_text("not a certificate\n")
    result = _check(tmp_path, CONTEXT_PROXY_UPSTREAM_CA_FILE=str(junk))
    assert result.exit_code == 1
    assert result.output.strip() == (
        f"problem: upstream_ca_file: {junk} holds no usable PEM certificate"
    )


def test_check_reports_an_unusable_proxy_variable_without_its_credentials(tmp_path: Path) -> None:
    result = _check(tmp_path, HTTPS_PROXY="socks5://me:hunter2@proxy.corp:1080")
    assert result.exit_code == 1
    assert result.output.strip() == (
        "problem: HTTPS_PROXY: only http:// forward proxies are supported, not socks5://"
    )
    assert "hunter2" not in result.output
    ok = _check(tmp_path, HTTPS_PROXY="http://me:hunter2@proxy.corp:3128")
    assert ok.exit_code == 0, ok.output
    # The summary names each upstream's route, without the credentials.
    assert ok.output.strip().endswith(
        "; openai upstream through http://proxy.corp:3128 (from HTTPS_PROXY),"
        " anthropic upstream through http://proxy.corp:3128 (from HTTPS_PROXY)"
    )
    assert "hunter2" not in ok.output


def test_serve_refuses_to_start_with_an_unreadable_ca_file(tmp_path: Path) -> None:
    missing = tmp_path / "ca.pem"
    env = {k: v for k, v in os.environ.items() if not k.startswith("CONTEXT_PROXY_")}
    env["CONTEXT_PROXY_UPSTREAM_CA_FILE"] = str(missing)
    done = subprocess.run(
        [sys.executable, "-m", "proxy", "serve", "--port", "0"],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 1
    assert f"bad setting: upstream_ca_file: cannot read {missing}" in done.stderr


@pytest.mark.parametrize(
    ("answer", "words"),
    [
        (b"", "closed the connection before answering CONNECT"),
        (b"SSH-2.0-OpenSSH_9.2\r\n", "sent no HTTP answer to CONNECT"),
        (b"HTTP/1.1 200 Connection established\r\n\r\nEARLY", "sent bytes after CONNECT"),
        (b"HTTP/1.1 502 Bad Gateway\r\nContent-Length: 0\r\n\r\n", ": 502 Bad Gateway"),
    ],
)
async def test_a_proxy_that_does_not_open_the_tunnel_is_a_502_saying_what_it_did(
    answer: bytes, words: str
) -> None:
    seen: list[bytes] = []

    async def proxy(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, n: int) -> None:
        seen.append(await reader.readuntil(b"\r\n\r\n"))
        writer.write(answer)
        await writer.drain()

    async with Scripted(proxy) as fake:
        env = {"HTTPS_PROXY": f"http://user:pw@127.0.0.1:{fake.port}"}
        async with (
            proxy_app("https://api.example.invalid", environ=env) as (url, _app),
            openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="sk-x", max_retries=0) as sdk,
        ):
            with pytest.raises(openai.APIStatusError) as caught:
                await sdk.chat.completions.create(
                    model="m", messages=[{"role": "user", "content": "hi"}]
                )
    assert caught.value.status_code == 502
    body = caught.value.body
    assert isinstance(body, dict)
    prefix = f"egress proxy http://127.0.0.1:{fake.port} (from HTTPS_PROXY) "
    assert body["message"].startswith(prefix) and words in body["message"]
    assert "api.example.invalid:443" in body["message"]
    token = base64.b64encode(b"user:pw").decode()
    assert seen == [
        b"CONNECT api.example.invalid:443 HTTP/1.1\r\nHost: api.example.invalid:443\r\n"
        b"User-Agent: context-proxy\r\nProxy-Authorization: Basic " + token.encode() + b"\r\n\r\n"
    ]

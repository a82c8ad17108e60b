"""An HTTP fuzzer (hypothesis) over real sockets against a running proxy process.

Requests are built from what clients and attackers send: request lines with
odd methods and targets, header sets with good and bad Content-Length /
Transfer-Encoding / Content-Encoding / session headers, JSON bodies in the
shape of each route and beside it, framed with an exact, short, long or
missing Content-Length, or chunked. Each one goes over a fresh connection
to a ``python -m proxy serve`` process in front of an emulator process.

What must hold for every request: the proxy never answers a 5xx of its own
making (the emulator only answers 5xx when asked to, which these requests
never do); afterwards no exchange is left in ``/admin/exchanges``; and the
proxy's RSS stays bounded over the whole run.
"""

from __future__ import annotations

import json
import socket
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psutil  # type: ignore[import-untyped]  # no stubs; types-psutil is not a dependency
import pytest
from hypothesis import given
from hypothesis import strategies as st

from benchmarks._harness import HOST, _spawn, free_port

MiB = 1024 * 1024
IO_TIMEOUT = 5.0  # seconds for one answer (body_idle_timeout is 1 s here)
RSS_GROWTH_MAX = 48 * MiB

PATHS = [
    "/v1/chat/completions",
    "/v1/responses",
    "/v1/messages",
    "/v1/messages?beta=true",
    "/v1/messages/count_tokens",
    "/v1/models",
    "/v1/embeddings",
    "/v1/chat/completions?x=%00%ff",
    "/v1/%2e%2e/admin/shutdown",
    "/",
    "/healthz",
    "/v1/",
    "/nope",
]
METHODS = ["POST", "POST", "POST", "GET", "HEAD", "PUT", "DELETE", "OPTIONS", "PATCH", "BREW"]


class Proxy:
    """A proxy process and its emulator; stopped by PID at the end."""

    def __init__(self, tmp: Path) -> None:
        self.emulator = _spawn(
            "emulator",
            ["-m", "proxy", "emulate", "--host", HOST, "--port", str(port := free_port())],
            port,
            tmp,
            "/",
            {},
        )
        port = free_port()
        env = {
            "CONTEXT_PROXY_PLUGINS": "fold",
            "CONTEXT_PROXY_MAX_BODY_BYTES": str(256 * 1024),
            "CONTEXT_PROXY_BODY_IDLE_TIMEOUT": "1",
            "CONTEXT_PROXY_BODY_TIMEOUT": "3",
            "CONTEXT_PROXY_HEADER_TIMEOUT": "2",
        }
        argv = ["-m", "proxy", "serve", "--host", HOST, "--port", str(port)]
        argv += ["--upstream-openai", self.emulator.url, "--upstream-anthropic", self.emulator.url]
        argv += ["--shutdown-grace", "1", "--log-level", "WARNING"]
        self.proxy = _spawn("proxy", argv, port, tmp, "/healthz", env)
        self.port = port
        for service in (self.emulator, self.proxy):
            _wait_ready(service.url + service.ready_path, service.proc)
        # Baseline after one request of each route has warmed the code paths up.
        for path in PATHS[:5]:
            exchange(port, _post(path, b'{"model":"m","messages":[],"input":"hi"}'))
        self.baseline_rss = self.rss()

    def stop(self) -> None:
        for service in (self.proxy, self.emulator):
            if service.proc.poll() is None:
                service.proc.terminate()
                try:
                    service.proc.wait(10)
                except Exception:
                    service.proc.kill()
                    service.proc.wait(5)

    def rss(self) -> int:
        rss: int = psutil.Process(self.proxy.pid).memory_info().rss
        return rss

    def get(self, target: str) -> tuple[int, bytes]:
        raw = f"GET {target} HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n".encode()
        return exchange(self.port, raw)

    def exchanges(self) -> list[dict[str, Any]]:
        status, body = self.get("/admin/exchanges")
        assert status == 200
        found: list[dict[str, Any]] = json.loads(body)["exchanges"]
        return found


def _post(target: str, body: bytes) -> bytes:
    head = f"POST {target} HTTP/1.1\r\nHost: x\r\nContent-Length: {len(body)}\r\n\r\n"
    return head.encode() + body


def _wait_ready(url: str, proc: Any) -> None:
    port = int(url.rsplit(":", 1)[1].split("/", 1)[0])
    path = "/" + url.rsplit(":", 1)[1].partition("/")[2]
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        assert proc.poll() is None, "the process exited at start"
        try:
            status, _ = exchange(port, f"GET {path} HTTP/1.1\r\nHost: x\r\n\r\n".encode())
        except OSError:
            time.sleep(0.05)
            continue
        if status == 200:
            return
        time.sleep(0.05)
    raise TimeoutError(f"{url} not ready within 30 s")


def exchange(port: int, raw: bytes, *, half_close: bool = False) -> tuple[int, bytes]:
    """Send ``raw`` on a fresh connection; (status, body) of the final answer, 0 if none.

    Interim 1xx answers (100 Continue) are skipped; an answer to HEAD has no body.
    """
    head_only = raw.startswith(b"HEAD ")
    with socket.create_connection((HOST, port), timeout=IO_TIMEOUT) as sock:
        try:
            sock.sendall(raw)
            if half_close:
                sock.shutdown(socket.SHUT_WR)
        except OSError:
            pass  # the proxy may answer and close before reading everything
        data = bytearray()
        deadline = time.monotonic() + IO_TIMEOUT
        while time.monotonic() < deadline:
            try:
                piece = sock.recv(65536)
            except (TimeoutError, ConnectionError):
                break
            if not piece:
                break
            data += piece
            if _complete(_final(data), head_only):
                break
    final = _final(data)
    if not final.startswith(b"HTTP/"):
        return 0, final
    head, _, body = final.partition(b"\r\n\r\n")
    return int(head.split(b" ", 2)[1]), body


def _final(data: bytearray) -> bytes:
    """``data`` without the interim 1xx answers in front of the final one."""
    out = bytes(data)
    while out.startswith(b"HTTP/1.1 1") and b"\r\n\r\n" in out:
        out = out.partition(b"\r\n\r\n")[2]
    return out


def _complete(data: bytes, head_only: bool) -> bool:
    head, sep, body = data.partition(b"\r\n\r\n")
    if not sep or data.startswith(b"HTTP/1.1 1"):
        return False
    if head_only:
        return True
    for line in head.split(b"\r\n")[1:]:
        name, _, value = line.partition(b":")
        if name.strip().lower() == b"content-length":
            return len(body) >= int(value.strip() or 0)
    # A streamed (chunked) answer: read to its end marker (or to the close).
    return body.endswith(b"0\r\n\r\n")


@pytest.fixture(scope="module")
def proxy(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Proxy]:
    running = Proxy(tmp_path_factory.mktemp("fuzz"))
    try:
        yield running
    finally:
        running.stop()


_json = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=20),
    lambda inner: (
        st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4)
    ),
    max_leaves=12,
)
_content = st.one_of(
    st.text(max_size=40),
    st.lists(
        st.fixed_dictionaries(
            {"type": st.sampled_from(["text", "input_text", "image", "tool_use", "x"])},
            optional={"text": st.text(max_size=20), "id": st.text(max_size=5)},
        ),
        max_size=3,
    ),
    _json,
)
_message = st.fixed_dictionaries(
    {"role": st.sampled_from(["user", "assistant", "system", "tool", "developer", ""])},
    optional={"content": _content, "type": st.sampled_from(["message", "function_call"])},
)
_route_body = st.fixed_dictionaries(
    {},
    optional={
        "model": st.one_of(st.text(max_size=12), st.integers(), st.none()),
        "messages": st.one_of(st.lists(_message, max_size=4), _json),
        "input": st.one_of(st.text(max_size=20), st.lists(_message, max_size=3), _json),
        "stream": st.one_of(st.booleans(), _json),
        "max_tokens": st.one_of(st.integers(min_value=-5, max_value=50), _json),
        "metadata": st.one_of(st.fixed_dictionaries({"user_id": st.text(max_size=10)}), _json),
        "prompt_cache_key": st.one_of(st.text(max_size=10), _json),
    },
)
_bodies = st.one_of(
    _route_body.map(lambda b: json.dumps(b).encode()),
    _json.map(lambda b: json.dumps(b).encode()),
    st.binary(max_size=200),
)
_header_name = st.sampled_from(
    [
        "Content-Type",
        "Content-Encoding",
        "x-session-id",
        "session-id",
        "x-claude-code-session-id",
        "Authorization",
        "anthropic-beta",
        "Accept-Encoding",
        "Expect",
        "Connection",
        "X-Junk",
    ]
)
_header_value = st.one_of(
    st.sampled_from(
        [
            "application/json",
            "gzip",
            "br",
            "zstd",
            "identity",
            "gzip, br",
            "bogus",
            "100-continue",
            "close",
            "keep-alive",
            "Bearer sk-test",
        ]
    ),
    st.text(alphabet=st.characters(min_codepoint=0x20, max_codepoint=0x7E), max_size=30),
    st.text(alphabet=st.characters(min_codepoint=0x80, max_codepoint=0xFF), max_size=8),
)


@st.composite
def requests(draw: st.DrawFn) -> tuple[bytes, bool]:
    """(raw request bytes, whether to half-close after sending)."""
    method = draw(st.sampled_from(METHODS))
    target = draw(st.sampled_from(PATHS))
    version = draw(st.sampled_from(["HTTP/1.1", "HTTP/1.1", "HTTP/1.0"]))
    body = draw(_bodies)
    headers = [(draw(_header_name), draw(_header_value)) for _ in range(draw(st.integers(0, 5)))]
    framing = draw(st.sampled_from(["exact", "exact", "short", "long", "none", "chunked", "junk"]))
    half_close = False
    if framing == "exact":
        headers.append(("Content-Length", str(len(body))))
    elif framing == "short":  # declares more than it sends, then stops sending
        headers.append(("Content-Length", str(len(body) + draw(st.integers(1, 1000)))))
        half_close = True
    elif framing == "long":  # sends more than it declares: the rest is a next "request"
        headers.append(("Content-Length", str(max(0, len(body) - draw(st.integers(1, 20))))))
    elif framing == "chunked":
        headers.append(("Transfer-Encoding", "chunked"))
        cuts = sorted(draw(st.lists(st.integers(0, len(body)), max_size=4)))
        pieces = [body[a:b] for a, b in zip([0, *cuts], [*cuts, len(body)], strict=True)]
        body = b"".join(b"%x\r\n%s\r\n" % (len(p), p) for p in pieces if p) + b"0\r\n\r\n"
    elif framing == "junk":
        headers.append(("Content-Length", draw(st.sampled_from(["-1", "1e3", "0x10", "", "1,2"]))))
    head = f"{method} {target} {version}\r\nHost: 127.0.0.1\r\n"
    lines = "".join(f"{name}: {value}\r\n" for name, value in headers)
    raw = (head + lines + "\r\n").encode("latin-1") + body
    return raw, half_close


@given(requests())
def test_no_proxy_5xx_for_any_request(proxy: Proxy, request_: tuple[bytes, bool]) -> None:
    raw, half_close = request_
    status, body = exchange(proxy.port, raw, half_close=half_close)
    assert status < 500, f"{status} {body[:300]!r} for {raw[:400]!r}"


def test_after_the_fuzzing_nothing_is_left_and_memory_is_bounded(proxy: Proxy) -> None:
    # Runs after the fuzzer in this module (same proxy process).
    deadline = time.monotonic() + 10
    while proxy.exchanges() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert proxy.exchanges() == []
    assert proxy.proxy.proc.poll() is None, "the proxy died"
    grown = proxy.rss() - proxy.baseline_rss
    assert grown <= RSS_GROWTH_MAX, f"RSS grew by {grown / MiB:.0f} MiB over the fuzzing"

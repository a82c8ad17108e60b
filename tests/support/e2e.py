"""Helpers shared by the end-to-end tests (``tests/e2e/``); this module holds no tests.

The request-body builders and the SSE reader here serve ``tests/e2e/test_sessions.py``,
``test_shutdown.py`` and ``test_emulator.py`` too. The reader is independent of
the proxy's own framer (``proxy/_sse.py``) on purpose, so a test of that framer,
or of the emulator that feeds it, never checks the code under test against itself.

Everything talks to real sockets on 127.0.0.1: :class:`RawClient` is a
hand-written HTTP/1.1 client over an asyncio stream, for the cases an HTTP
library hides (hop-by-hop headers, a body cut off mid-way, a connection reset
at a chosen moment, a client that stops reading).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import re
import socket
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable
from typing import Any, Final, TypeVar
from urllib.parse import urlsplit

import aiohttp
from multidict import CIMultiDict

__all__ = [
    "ANTHROPIC_PATH",
    "CHAT_PATH",
    "COUNT_TOKENS_PATH",
    "RESPONSES_PATH",
    "SECRET",
    "WAIT_S",
    "Event",
    "LogWaiter",
    "RawClient",
    "RawResponse",
    "exact_body",
    "request_body",
    "sse_events",
    "stream_body",
    "streamed_text",
    "wait_until",
]

CHAT_PATH: Final = "/v1/chat/completions"
RESPONSES_PATH: Final = "/v1/responses"
ANTHROPIC_PATH: Final = "/v1/messages"
COUNT_TOKENS_PATH: Final = "/v1/messages/count_tokens"

#: An API key distinctive enough that finding any 16-character piece of it in a
#: log line means the key leaked.
SECRET: Final = "sk-e2e-SECRET-4f9c2a7d1b8e6f305a1c9d7e2b4f6a8c"

#: One SSE event as :func:`sse_events` reads it: (``event:`` name or ``None``, joined ``data:``).
Event = tuple[str | None, str]

_T = TypeVar("_T")

# How long a test waits for something that must happen (an event reached, a state left), in
# seconds. It bounds a failing test, it is not a measure: on a loaded 2-core machine with other
# suites running, a loopback round trip can take a second, so it is far above the ~ms it takes.
WAIT_S: Final = 10.0
_IO_TIMEOUT: Final = 10.0  # seconds; any single raw read/write step taking longer is a failure


def request_body(
    path: str,
    model: str = "e2e-model",
    *,
    stream: bool = True,
    content: str = "hi",
    **extra: Any,
) -> dict[str, Any]:
    """A small valid JSON-ready request for ``path`` in that protocol's shape.

    One user turn of ``content`` (``input`` for Responses; ``messages`` with
    ``max_tokens`` 16 for Anthropic); ``"stream": true`` when ``stream``, except
    for count_tokens, which has no stream; then ``extra`` top-level fields, in
    that key order.
    """
    body: dict[str, Any]
    if path == RESPONSES_PATH:
        body = {"model": model, "input": content}
    elif path in (ANTHROPIC_PATH, COUNT_TOKENS_PATH):
        body = {
            "model": model,
            "max_tokens": 16,
            "messages": [{"role": "user", "content": content}],
        }
    else:
        body = {"model": model, "messages": [{"role": "user", "content": content}]}
    if stream and path != COUNT_TOKENS_PATH:
        body["stream"] = True
    body.update(extra)
    return body


def stream_body(path: str, *, stream: bool = True, model: str = "e2e-model") -> bytes:
    """:func:`request_body` as compact JSON bytes (no spaces after separators)."""
    return json.dumps(request_body(path, model, stream=stream), separators=(",", ":")).encode()


def exact_body(path: str, size: int, *, filler: bytes = b"x") -> bytes:
    """A valid JSON request body of exactly ``size`` bytes for ``path`` (non-streaming).

    The single user message is padded with ``filler`` (one ASCII byte, repeated).

    Raises:
        ValueError: ``size`` is smaller than the protocol's envelope (~80 bytes).
    """
    if path == ANTHROPIC_PATH:
        head = b'{"model":"e2e-model","max_tokens":16,"messages":[{"role":"user","content":"'
    else:
        head = b'{"model":"e2e-model","messages":[{"role":"user","content":"'
    tail = b'"}]}'
    pad = size - len(head) - len(tail)
    if pad < 0:
        raise ValueError(f"size {size} is below the {len(head) + len(tail)}-byte envelope")
    return head + filler * pad + tail


def sse_events(raw: bytes) -> list[Event]:
    """(event name, data) of every SSE event in ``raw`` (WHATWG framing; comments skipped)."""
    events: list[Event] = []
    name: str | None = None
    data: list[str] = []
    for line in re.split(r"\r\n|\n|\r", raw.decode()):
        if line == "":
            if data:
                events.append((name, "\n".join(data)))
            name, data = None, []
        elif not line.startswith(":"):
            key, _, value = line.partition(":")
            value = value[1:] if value.startswith(" ") else value
            if key == "event":
                name = value
            elif key == "data":
                data.append(value)
    return events


def streamed_text(path: str, events: list[Event]) -> str:
    """The answer text a client reassembles from the deltas of ``events`` (from ``path``).

    Chat: every choice's ``delta.content``; Responses: ``response.output_text.delta``;
    Anthropic: ``content_block_delta``. Other events and ``[DONE]`` add nothing.

    Raises:
        json.JSONDecodeError: an event's data (other than ``[DONE]``) is not JSON.
    """
    out: list[str] = []
    for _, data in events:
        if data == "[DONE]":
            continue
        obj = json.loads(data)
        if path == CHAT_PATH:
            for choice in obj.get("choices", ()):
                out.append(choice["delta"].get("content") or "")
        elif path == RESPONSES_PATH and obj.get("type") == "response.output_text.delta":
            out.append(obj["delta"])
        elif path == ANTHROPIC_PATH and obj.get("type") == "content_block_delta":
            out.append(obj["delta"]["text"])
    return "".join(out)


async def finished_commits(http: aiohttp.ClientSession, url: str) -> float:
    """How many exchanges the proxy at ``url`` has committed so far, read from its
    ``/metrics`` (``context_proxy_commits_total{event="finished"}``; 0 before the first):
    for a child process, which offers nothing else to wait on."""
    async with http.get(f"{url}/metrics") as resp:
        text = await resp.text()
    for line in text.splitlines():
        if line.startswith('context_proxy_commits_total{event="finished"}'):
            return float(line.rsplit(" ", 1)[1])
    return 0.0


async def wait_until(condition: Callable[[], bool], what: str, within: float = WAIT_S) -> None:
    """Poll ``condition`` every 5 ms until true; ``TimeoutError`` after ``within`` seconds.

    Only for proxy-internal state that has no event to wait on (e.g. the
    exchange table); the emulator's ``wait_*`` helpers are event driven.
    """
    # Either bound ends the wait with the same message naming what never happened.
    with contextlib.suppress(TimeoutError):
        async with asyncio.timeout(within):
            for _ in range(int(within / 0.005) + 1):
                if condition():
                    return
                await asyncio.sleep(0.005)
    raise TimeoutError(f"not {what} within {within} s")


async def _step(awaitable: Awaitable[_T]) -> _T:
    """One read or write step of :class:`RawClient`, bounded by ``_IO_TIMEOUT``."""
    async with asyncio.timeout(_IO_TIMEOUT):
        return await awaitable


class LogWaiter(logging.Handler):
    """A context manager that catches log records of ``logger`` whose message has ``needle``.

    ``await wait(within)`` returns once one was emitted (event driven, no polling);
    ``records`` lists the matching records. Attached to the logger itself, so
    it sees records whatever the root level is.
    """

    def __init__(self, logger: str, needle: str, level: int = logging.WARNING) -> None:
        super().__init__(level)
        self._logger = logging.getLogger(logger)
        self._needle = needle
        self._seen = asyncio.Event()
        self._saved_level = self._logger.level
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        if self._needle in record.getMessage():
            self.records.append(record)
            self._seen.set()

    async def wait(self, within: float) -> logging.LogRecord:
        """The first matching record; ``TimeoutError`` after ``within`` seconds."""
        async with asyncio.timeout(within):
            await self._seen.wait()
        return self.records[0]

    def __enter__(self) -> LogWaiter:
        self._logger.addHandler(self)
        if self._logger.getEffectiveLevel() > self.level:
            self._logger.setLevel(self.level)
        return self

    def __exit__(self, *exc_info: object) -> None:
        self._logger.removeHandler(self)
        self._logger.setLevel(self._saved_level)


class RawResponse:
    """Status line and headers of a response read by :class:`RawClient`."""

    __slots__ = ("headers", "status")

    def __init__(self, status: int, headers: CIMultiDict[str]) -> None:
        self.status = status
        self.headers = headers

    @property
    def chunked(self) -> bool:
        """True when the body uses chunked transfer coding."""
        return "chunked" in self.headers.get("Transfer-Encoding", "").lower()


class RawClient:
    """One HTTP/1.1 connection over a plain asyncio stream.

    ``connect(url, rcvbuf=...)`` can shrink the socket's receive buffer (bytes)
    so that a client that stops reading is felt upstream quickly. ``abort()``
    resets the connection at once (TCP RST), the way a killed process hangs up.
    Each read step raises ``TimeoutError`` after 10 s.
    """

    __slots__ = ("host", "reader", "writer")

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, host: str):
        self.reader = reader
        self.writer = writer
        self.host = host

    @classmethod
    async def connect(cls, url: str, *, rcvbuf: int | None = None) -> RawClient:
        """Open a connection to ``url``'s host and port (``http://127.0.0.1:PORT``)."""
        parts = urlsplit(url)
        assert parts.hostname is not None and parts.port is not None
        if rcvbuf is None:
            reader, writer = await asyncio.open_connection(parts.hostname, parts.port)
        else:
            sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            # Before connect, so the window advertised in the handshake is small too.
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf)
            sock.setblocking(False)
            await asyncio.get_running_loop().sock_connect(sock, (parts.hostname, parts.port))
            reader, writer = await asyncio.open_connection(sock=sock, limit=rcvbuf)
        return cls(reader, writer, parts.netloc)

    def send_head(self, method: str, target: str, headers: Iterable[tuple[str, str]] = ()) -> None:
        """Queue a request line and headers (a ``Host`` header is added)."""
        lines = [f"{method} {target} HTTP/1.1", f"Host: {self.host}"]
        lines.extend(f"{name}: {value}" for name, value in headers)
        self.writer.write(("\r\n".join(lines) + "\r\n\r\n").encode("latin-1"))

    async def send(self, data: bytes) -> None:
        """Write ``data`` and wait until the transport accepted it."""
        self.writer.write(data)
        await _step(self.writer.drain())

    async def start_upload(self, target: str, body: bytes, sent: int) -> None:
        """POST the head of a JSON body of ``len(body)`` declared bytes, then its first
        ``sent`` bytes only: an upload left in progress (the rest with :meth:`send`)."""
        self.send_head(
            "POST",
            target,
            [("Content-Type", "application/json"), ("Content-Length", str(len(body)))],
        )
        await self.send(body[:sent])

    async def request(
        self,
        method: str,
        target: str,
        body: bytes = b"",
        headers: Iterable[tuple[str, str]] = (),
    ) -> None:
        """Send a whole request with a ``Content-Length`` body (JSON unless told otherwise)."""
        all_headers = [("Content-Type", "application/json"), *headers]
        all_headers.append(("Content-Length", str(len(body))))
        self.send_head(method, target, all_headers)
        await self.send(body)

    async def read_head(self) -> RawResponse:
        """Read the status line and headers of the next response."""
        raw = await _step(self.reader.readuntil(b"\r\n\r\n"))
        status_line, *lines = raw.decode("latin-1").split("\r\n")
        headers: CIMultiDict[str] = CIMultiDict()
        for line in lines:
            if line:
                name, _, value = line.partition(":")
                headers.add(name.strip(), value.strip())
        return RawResponse(int(status_line.split(" ", 2)[1]), headers)

    async def iter_body(self, head: RawResponse) -> AsyncIterator[bytes]:
        """The body of ``head``'s response as it arrives, transfer coding removed."""
        reader = self.reader
        if head.chunked:
            while True:
                size_line = await _step(reader.readuntil(b"\r\n"))
                size = int(size_line.split(b";")[0], 16)
                if size == 0:
                    await _step(reader.readuntil(b"\r\n"))  # the proxy sends no trailers
                    return
                data = await _step(reader.readexactly(size))
                await _step(reader.readexactly(2))
                yield data
        length = head.headers.get("Content-Length")
        if length is not None:
            if int(length):
                yield await _step(reader.readexactly(int(length)))
            return
        while chunk := await _step(reader.read(65536)):
            yield chunk

    async def read_body(self, head: RawResponse) -> bytes:
        """The whole body of ``head``'s response."""
        return b"".join([chunk async for chunk in self.iter_body(head)])

    def abort(self) -> None:
        """Reset the connection now (RST, nothing more is sent or read)."""
        self.writer.transport.abort()

    async def close(self) -> None:
        """Close the connection politely (FIN) and wait until it is closed."""
        self.writer.close()
        with contextlib.suppress(ConnectionError):
            await _step(self.writer.wait_closed())

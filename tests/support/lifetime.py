"""Helpers shared by the exchange-lifetime tests (``test_lifetime.py``, ``test_refold.py``).

This module holds no tests. What it gives:

* request bodies shaped like a coding agent's history (:func:`conversation`)
  and large chat bodies built without a JSON encoder (:func:`big_chat_body`);
* :func:`install_codec_counts`: counts full parses and serializations of bodies;
* :func:`install_spy`: replaces the app's :class:`~proxy.exchange.Exchange`
  with :class:`TracedExchange`, which records its phases, its release calls
  and puts a ``weakref.finalize`` on every buffer holder it creates, so a test
  can tell exactly when each buffer was let go;
* :func:`proxy_at`: a proxy in front of any upstream URL (a closed port, a
  socket that never reads, an emulator in a subprocess);
* :class:`Recorder`, a plugin that keeps the commit records, and a few more;
* :class:`RawConn`, a bare HTTP/1.1 client for hanging up at a chosen moment;
* :class:`SubprocessEmulator`, ``python -m proxy emulate`` in a child process,
  so that memory measured in this process is the proxy's, not the upstream's.

Everything talks to 127.0.0.1 on ephemeral ports; every wait is bounded.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import select
import socket
import subprocess
import sys
import time
import weakref
from collections.abc import AsyncIterator, Iterator, Sequence
from typing import Any, Final

import aiohttp
import pytest
from aiohttp import web

from proxy import _app as app_module
from proxy import _wire as wire
from proxy._app import AppState
from proxy._exchange import Exchange
from proxy._holders import HeldBytes
from proxy._phases import Phase
from proxy._plugins import ExchangeRecord, Plugin, PrepareContext
from proxy._wire import WireMetadata
from tests.support.ports import free_port, serve_app
from tests.support.upstream import proxy_app

__all__ = [
    "CHAT",
    "MESSAGES",
    "MIB",
    "RESPONSES",
    "WAIT_S",
    "Mutator",
    "ProxyUnderTest",
    "RawConn",
    "Reader",
    "Recorder",
    "Spy",
    "SubprocessEmulator",
    "Trace",
    "TracedExchange",
    "big_chat_body",
    "closed_port_url",
    "conversation",
    "encode",
    "fixed_upstream",
    "install_codec_counts",
    "install_spy",
    "never_reading_upstream",
    "proxy_at",
    "slices",
]

MIB: Final = 1 << 20
CHAT: Final = "/v1/chat/completions"
RESPONSES: Final = "/v1/responses"
MESSAGES: Final = "/v1/messages"
#: Upper bound, in seconds, of any single wait in these tests.
WAIT_S: Final = 10.0

# ------------------------------------------------------------------------------ bodies

_PROSE: Final = (
    "The build fails in the parser module because the tokenizer returns a stale "
    "offset after a multi-byte character; the fix keeps byte and character "
    "positions apart and adds a regression test for the euro sign. "
)


def _text(tag: str, size: int) -> str:
    """``size`` ASCII characters of prose starting with ``tag`` (JSON-safe, no escapes)."""
    head = f"[{tag}] "
    body = (_PROSE * (size // len(_PROSE) + 1))[: max(0, size - len(head))]
    return head + body


def conversation(
    path: str,
    *,
    turns: int = 12,
    turn_bytes: int = 10_000,
    stream: bool = True,
    model: str = "lifetime-model",
) -> dict[str, Any]:
    """A coding-agent history for ``path``'s protocol, as a JSON-ready dict.

    A system prompt, ``turns`` alternating user/assistant turns of about
    ``turn_bytes`` ASCII bytes each (pasted files, long explanations), then a
    short final question. The fold plugin can shrink it level by level; a
    history with ``turn_bytes`` below its ``min_bytes`` (2048) cannot shrink.
    """
    history: list[dict[str, Any]] = []
    for index in range(turns):
        role = "user" if index % 2 == 0 else "assistant"
        text = _text(f"turn {index}", turn_bytes)
        if path == RESPONSES:
            kind = "input_text" if role == "user" else "output_text"
            history.append({"role": role, "content": [{"type": kind, "text": text}]})
        else:
            history.append({"role": role, "content": text})
    question = "Why does the test still fail?"
    body: dict[str, Any]
    if path == RESPONSES:
        history.append({"role": "user", "content": [{"type": "input_text", "text": question}]})
        body = {"model": model, "instructions": "You are a careful engineer.", "input": history}
    elif path == MESSAGES:
        history.append({"role": "user", "content": question})
        body = {
            "model": model,
            "max_tokens": 256,
            "system": "You are a careful engineer.",
            "messages": history,
        }
    else:
        history.insert(0, {"role": "system", "content": "You are a careful engineer."})
        history.append({"role": "user", "content": question})
        body = {"model": model, "messages": history}
    if stream:
        body["stream"] = True
    return body


def encode(body: dict[str, Any], *, indent: int | None = None) -> bytes:
    """``body`` as UTF-8 JSON bytes: compact, or pretty-printed with ``indent``."""
    separators = (",", ":") if indent is None else (",", ": ")
    return json.dumps(body, separators=separators, indent=indent).encode()


def big_chat_body(total: int, *, message_bytes: int = 256 * 1024) -> bytes:
    """A streaming chat body of about ``total`` bytes in messages of ``message_bytes``.

    Built by joining bytes (no JSON encoder), so a 64 MB body costs one copy.
    """
    head = b'{"model":"lifetime-model","stream":true,"messages":['
    count = max(2, total // (message_bytes + 64))
    messages = []
    for index in range(count):
        role = b"user" if index % 2 == 0 else b"assistant"
        text = _text(f"message {index}", message_bytes).encode()
        messages.append(b'{"role":"' + role + b'","content":"' + text + b'"}')
    messages.append(b'{"role":"user","content":"Why does the test still fail?"}')
    return head + b",".join(messages) + b"]}"


def chat_text(raw: bytes) -> str:
    """The assistant text carried by an OpenAI chat SSE stream (the ``content`` of
    every chunk's deltas, joined)."""
    text = []
    for line in raw.decode().splitlines():
        if line.startswith("data: {"):
            for choice in json.loads(line[6:])["choices"]:
                text.append(choice["delta"].get("content") or "")
    return "".join(text)


async def slices(body: bytes, size: int = 256 * 1024) -> AsyncIterator[memoryview]:
    """``body`` as ``memoryview`` slices, for uploads that must not copy it.

    On Python 3.11 a socket transport copies whatever it cannot send at once;
    handing aiohttp one large ``bytes`` would copy the whole body into this
    process's memory and spoil a memory measurement.
    """
    view = memoryview(body)
    for start in range(0, len(view), size):
        yield view[start : start + size]


# ------------------------------------------------------------------------------ the spy


class Trace:
    """What one traced exchange went through.

    ``phases`` lists every phase it entered, in order; ``watched`` names the
    buffer holders that got a finalizer (``raw``, ``parsed``, ``outbound``) and
    ``fired`` those whose finalizer ran (the holder was freed); ``release_calls``
    counts calls of ``release()`` and ``held_at_release`` is what the exchange
    held right after the call that did the work; ``raw_allocated`` is the
    ``sys.getsizeof`` of the body buffer it was handed (bytes, with slack).
    """

    def __init__(self) -> None:
        self.phases: list[Phase] = []
        self.watched: list[str] = []
        self.fired: list[str] = []
        self.release_calls = 0
        self.held_at_release: HeldBytes | None = None
        self.phase_at_release: Phase | None = None
        self.raw_allocated = 0
        self.task = asyncio.current_task()
        self._waiters: list[tuple[Phase, asyncio.Future[None]]] = []
        self._held: list[weakref.ref[object]] = []

    def enter(self, phase: Phase) -> None:
        """Record ``phase`` and wake whoever waits for it."""
        self.phases.append(phase)
        for wanted, waiter in self._waiters:
            if wanted is phase and not waiter.done():
                waiter.set_result(None)

    def watch(self, name: str, holder: object | None) -> None:
        """Put a finalizer on ``holder`` that appends ``name`` to ``fired``."""
        if holder is None:
            return
        self.watched.append(name)
        weakref.finalize(holder, self.fired.append, name)

    def watch_once(self, name: str, holder: object | None) -> None:
        """:meth:`watch` ``holder`` unless it already has a finalizer from this trace."""
        if holder is None or any(h() is holder for h in self._held):
            return
        self._held.append(weakref.ref(holder))
        self.watch(name, holder)

    async def reached(self, phase: Phase, within: float = WAIT_S) -> None:
        """Return once the exchange has entered ``phase``; ``TimeoutError`` otherwise."""
        if phase in self.phases:
            return
        waiter: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        entry = (phase, waiter)
        self._waiters.append(entry)
        try:
            async with asyncio.timeout(within):
                await waiter
        finally:
            self._waiters.remove(entry)

    async def finished(self, within: float = WAIT_S) -> None:
        """Wait until the handler task that owns the exchange has ended."""
        task = self.task
        assert task is not None
        await asyncio.wait({task}, timeout=within)
        assert task.done(), f"the handler did not end within {within} s"


class TracedExchange(Exchange):
    """An :class:`Exchange` that reports into a :class:`Trace` (``self.trace``).

    It watches through the public ``observer`` hook: each phase move is recorded,
    and the buffer holders that exist on entering ``parsed`` or ``prepared`` get
    a finalizer (the raw body; the parsed body and a re-serialized outbound body).
    """

    def __init__(self, **kwargs: Any) -> None:
        self.trace = Trace()
        super().__init__(observer=self._observe, **kwargs)
        self.trace.enter(self.phase)

    def _observe(self, ex: Exchange, old: Phase, new: Phase) -> None:
        trace = self.trace
        if new is Phase.PARSED and self.raw_holder is not None:
            trace.raw_allocated = sys.getsizeof(self.raw_holder.data)
            trace.watch_once("raw", self.raw_holder)
        elif new is Phase.PREPARED:
            trace.watch_once("parsed", self.parsed_holder)
            if self.outbound_holder is not self.raw_holder:
                trace.watch_once("outbound", self.outbound_holder)
        trace.enter(new)

    def release(self, *, keep_outbound: bool = False) -> None:
        self.trace.release_calls += 1
        before = self.releases
        super().release(keep_outbound=keep_outbound)
        if not before and self.releases:
            self.trace.phase_at_release = self.phase
            self.trace.held_at_release = self.held_bytes()


class Spy(list[TracedExchange]):
    """The traced exchanges the app has made, in the order it made them."""

    def __init__(self) -> None:
        super().__init__()
        self._grew = asyncio.Event()

    def add(self, ex: TracedExchange) -> None:
        """Record a new exchange and wake :meth:`made` waiters."""
        self.append(ex)
        self._grew.set()

    async def made(self, count: int, within: float = WAIT_S) -> None:
        """Return once at least ``count`` exchanges exist; ``TimeoutError`` otherwise."""
        async with asyncio.timeout(within):
            while len(self) < count:
                self._grew.clear()
                await self._grew.wait()


def install_spy(monkeypatch: pytest.MonkeyPatch) -> Spy:
    """Make the app build :class:`TracedExchange` objects; returns the :class:`Spy` list."""
    spy = Spy()

    class Recorded(TracedExchange):
        def __init__(self, **kwargs: Any) -> None:
            super().__init__(**kwargs)
            spy.add(self)

    monkeypatch.setattr(app_module, "Exchange", Recorded)
    return spy


def install_codec_counts(monkeypatch: pytest.MonkeyPatch) -> dict[str, int]:
    """Count full parses and serializations of request bodies from now on.

    Returns ``{"parse": n, "encode": n}``, updated in place: ``parse`` counts
    decodes with :mod:`proxy._wire`'s full decoder (the structural decode that
    computes wire metadata is not one), ``encode`` counts calls of
    ``wire.encode_body``. ``monkeypatch`` undoes it at the end of the test.
    """
    counts = {"parse": 0, "encode": 0}
    decode_json, encode_body = wire._decode_json, wire.encode_body

    def counting_decode(decoder: Any, data: Any, /) -> Any:
        if decoder is wire._FULL_DECODER:
            counts["parse"] += 1
        return decode_json(decoder, data)

    def counting_encode(obj: dict[str, Any]) -> bytes:
        counts["encode"] += 1
        return encode_body(obj)

    monkeypatch.setattr(wire, "_decode_json", counting_decode)
    monkeypatch.setattr(wire, "encode_body", counting_encode)
    return counts


# ------------------------------------------------------------------------------ plugins


class Recorder(Plugin):
    """Keeps every commit record; :meth:`wait` returns once ``count`` have arrived."""

    name = "recorder"

    def __init__(self) -> None:
        self.records: list[ExchangeRecord] = []
        self._arrived = asyncio.Event()

    async def commit(self, record: ExchangeRecord) -> None:
        self.records.append(record)
        self._arrived.set()

    async def wait(self, count: int, within: float = WAIT_S) -> list[ExchangeRecord]:
        """The records once at least ``count`` exist; ``TimeoutError`` after ``within`` s."""
        async with asyncio.timeout(within):
            while len(self.records) < count:
                self._arrived.clear()
                await self._arrived.wait()
        return self.records


class Tally(Plugin):
    """Counts the commits it sees in ``booked``: a bookkeeping plugin that needs
    nothing slow (no Redis, no disk)."""

    name = "tally"

    def __init__(self) -> None:
        self.booked = 0

    async def commit(self, record: ExchangeRecord) -> None:
        self.booked += 1


class Reader(Plugin):
    """Reads the parsed body at every fold level and never changes it."""

    name = "reader"

    def __init__(self) -> None:
        self.levels: list[int] = []

    def wants_body(self, meta: WireMetadata, fold_level: int) -> bool:
        return True

    async def prepare(self, ctx: PrepareContext) -> bool:
        self.levels.append(ctx.fold_level)
        assert isinstance(ctx.body, dict)
        return False


class Mutator(Plugin):
    """Changes the body at fold level 0 (sets ``temperature``): it is re-serialized."""

    name = "mutator"

    def wants_body(self, meta: WireMetadata, fold_level: int) -> bool:
        return fold_level == 0

    async def prepare(self, ctx: PrepareContext) -> bool:
        if ctx.fold_level != 0:
            return False
        ctx.body["temperature"] = 0.25
        return True


# ------------------------------------------------------------------------------ proxies


@dataclasses.dataclass(frozen=True, slots=True)
class ProxyUnderTest:
    """A running proxy: its base URL and its live state."""

    url: str
    state: AppState


@contextlib.asynccontextmanager
async def proxy_at(
    upstream: str, plugins: Sequence[Plugin] = (), **settings: Any
) -> AsyncIterator[ProxyUnderTest]:
    """A proxy on 127.0.0.1 (ephemeral port) whose both upstreams are ``upstream``.

    ``settings`` override :class:`~proxy.config.Settings` fields; leaving the
    block drains the proxy (commit hooks have run).
    """
    settings = {"shutdown_grace": 5.0, **settings}
    for name in ("upstream_openai", "upstream_anthropic"):
        settings.pop(name, None)  # both are ``upstream``
    async with proxy_app(upstream, plugins=plugins, **settings) as (url, app):
        yield ProxyUnderTest(url, app.state)


def closed_port_url() -> str:
    """``http://127.0.0.1:PORT`` of a port nobody listens on (connections are refused)."""
    return f"http://127.0.0.1:{free_port()}"


@contextlib.contextmanager
def never_reading_upstream() -> Iterator[str]:
    """An upstream URL whose socket accepts connections and never reads a byte.

    The listening socket is never ``accept()``-ed: the kernel completes the
    handshake into the backlog and takes as much as the tiny receive buffer
    holds, so an upload stalls mid-body.
    """
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        sock.bind(("127.0.0.1", 0))
        sock.listen(4)
        yield f"http://127.0.0.1:{sock.getsockname()[1]}"


@contextlib.asynccontextmanager
async def fixed_upstream(
    status: int, content_type: str, body: bytes
) -> AsyncIterator[tuple[str, list[int]]]:
    """An upstream that answers every POST with ``status``, ``content_type`` and ``body``.

    Yields its URL and the list of request body sizes it has seen (bytes).
    """
    seen: list[int] = []

    async def answer(request: web.Request) -> web.StreamResponse:
        size = 0
        while chunk := await request.content.readany():
            size += len(chunk)
        seen.append(size)
        response = web.StreamResponse(status=status, headers={"Content-Type": content_type})
        await response.prepare(request)
        await response.write(body)
        await response.write_eof()
        return response

    app = web.Application()
    app.router.add_post("/{tail:.*}", answer)
    async with serve_app(app) as url:
        yield url, seen


# ------------------------------------------------------------------------------ clients


class RawConn:
    """One bare HTTP/1.1 connection, for hanging up at a precise moment.

    ``abort()`` resets the connection (RST) the way a killed client does. Every
    read is bounded by :data:`WAIT_S`.
    """

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.reader = reader
        self.writer = writer
        self.received = bytearray()

    @classmethod
    async def open(cls, url: str) -> RawConn:
        """Connect to ``url`` (``http://127.0.0.1:PORT``)."""
        host, _, port = url.removeprefix("http://").partition(":")
        reader, writer = await asyncio.open_connection(host, int(port))
        return cls(reader, writer)

    async def send_head(self, path: str, length: int, headers: dict[str, str]) -> None:
        """Send a POST request line and headers announcing a ``length``-byte JSON body."""
        lines = [f"POST {path} HTTP/1.1", "Host: 127.0.0.1", "Content-Type: application/json"]
        lines += [f"Content-Length: {length}", *(f"{k}: {v}" for k, v in headers.items())]
        self.writer.write(("\r\n".join(lines) + "\r\n\r\n").encode("latin-1"))
        await self.writer.drain()

    async def send(self, data: bytes) -> None:
        """Send ``data`` in 256 KiB views, waiting for the transport after each."""
        async for piece in slices(data):
            self.writer.write(piece)
            await self.writer.drain()

    async def status(self) -> int:
        """Read the response head; returns the status code."""
        async with asyncio.timeout(WAIT_S):
            head = await self.reader.readuntil(b"\r\n\r\n")
        return int(head.split(b" ", 2)[1])

    async def read_until(self, needle: bytes) -> None:
        """Read the response body until ``needle`` has been received."""
        async with asyncio.timeout(WAIT_S):
            while needle not in self.received:
                chunk = await self.reader.read(65536)
                assert chunk, "the connection closed before the awaited bytes"
                self.received += chunk

    def abort(self) -> None:
        """Hang up now (TCP RST)."""
        self.writer.transport.abort()


class SubprocessEmulator:
    """The upstream emulator in a child process (``python -m proxy emulate``).

    Its allocations are not in this process, so tracemalloc and RSS measure
    the proxy (and this test's client) alone. Use as a context manager.
    """

    def __init__(self) -> None:
        self._proc = subprocess.Popen(
            [sys.executable, "-m", "proxy", "emulate", "--host", "127.0.0.1", "--port", "0"],
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            text=True,
        )
        self.url = self._read_url()

    def _read_url(self) -> str:
        stdout = self._proc.stdout
        assert stdout is not None
        deadline = time.monotonic() + 30.0
        while (left := deadline - time.monotonic()) > 0:
            ready, _, _ = select.select([stdout], [], [], left)
            if ready:
                line = stdout.readline()
                if not line:
                    break
                if "listening on" in line:
                    return line.split()[-1]
        self.close()
        raise RuntimeError("the emulator subprocess did not start")

    async def release(self, http: aiohttp.ClientSession, key: str) -> None:
        """Release the ``hold`` on ``key``."""
        async with http.post(f"{self.url}/_emulator/release/{key}") as resp:
            assert resp.status == 200

    async def reset(self, http: aiohttp.ClientSession) -> None:
        """Forget earlier requests (records, holds, counters)."""
        async with http.post(f"{self.url}/_emulator/reset") as resp:
            assert resp.status == 200

    async def records(self, http: aiohttp.ClientSession) -> list[dict[str, Any]]:
        """The emulator's request records (its ``/_emulator/stats``), oldest first."""
        async with http.get(f"{self.url}/_emulator/stats") as resp:
            stats: dict[str, list[dict[str, Any]]] = await resp.json()
        return stats["requests"]

    def close(self) -> None:
        """Stop the child (SIGTERM, then SIGKILL after 10 s)."""
        if self._proc.poll() is None:
            self._proc.terminate()
            try:
                self._proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self._proc.kill()
                self._proc.wait(timeout=10)
        if self._proc.stdout is not None:
            self._proc.stdout.close()

    def __enter__(self) -> SubprocessEmulator:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

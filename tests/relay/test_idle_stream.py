"""What an open, idle stream keeps (issue 11 item 5; docs/design.md §2, "streaming").

While an answer streams, nothing the request needed to be *sent* may stay: the
header fields built for the upstream request (kept until then for a resend)
and the upstream answer's head, once the client's response head has been
built from it (the upstream answer would keep its parsed fields for as long
as the body streams).

Proved the two ways the guide asks for: a ``weakref.finalize`` on each holder
(with the cyclic GC off, so reference counting alone must free them), and
tracemalloc over many open streams held by an emulator in another process,
against a negative control in which nothing is dropped.
"""

from __future__ import annotations

import asyncio
import gc
import json
import re
import sys
import tracemalloc
import weakref
from collections.abc import AsyncIterator, Iterator, MutableMapping
from typing import Any

import aiohttp
import pytest

from proxy._exchange import Exchange
from proxy._sse import SSEFramer
from proxy._upstream import UpstreamAnswer
from tests.support.lifetime import CHAT, SubprocessEmulator, proxy_at

#: Streams held open at once for the tracemalloc figure.
STREAMS = 8
#: Bytes the step into streaming frees per stream beyond the control: the upstream
#: head's fields and their strings, and the forwarded fields (the emulator's head is
#: small; a real upstream's few dozen fields free more).
MIN_FREED_PER_STREAM = 160


@pytest.fixture(scope="module")
def emulator() -> Iterator[SubprocessEmulator]:
    with SubprocessEmulator() as emu:
        yield emu


@pytest.fixture
async def http() -> AsyncIterator[aiohttp.ClientSession]:
    connector = aiohttp.TCPConnector(limit=0)
    timeout = aiohttp.ClientTimeout(total=60)
    async with aiohttp.ClientSession(timeout=timeout, connector=connector) as session:
        yield session


def _body() -> bytes:
    return json.dumps(
        {"model": "m", "stream": True, "messages": [{"role": "user", "content": "hi"}]}
    ).encode()


class Holders:
    """Finalizers on the header holders of every exchange (forwarded fields, upstream head)."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.fired: list[str] = []
        attach = Exchange.attach_headers
        init = UpstreamAnswer.__init__

        def attach_headers(ex: Exchange, headers: MutableMapping[str, str]) -> None:
            weakref.finalize(headers, self.fired.append, "forwarded fields")
            attach(ex, headers)

        def started(resp: UpstreamAnswer, *args: Any) -> None:
            init(resp, *args)
            weakref.finalize(resp.headers, self.fired.append, "upstream head")

        monkeypatch.setattr(Exchange, "attach_headers", attach_headers)
        monkeypatch.setattr(UpstreamAnswer, "__init__", started)


def _keep_everything(monkeypatch: pytest.MonkeyPatch) -> None:
    """The negative control: the header fields and the upstream head are never dropped."""
    kept: list[object] = []
    attach = Exchange.attach_headers

    def attach_and_keep(ex: Exchange, headers: MutableMapping[str, str]) -> None:
        kept.append(headers)
        attach(ex, headers)

    monkeypatch.setattr(Exchange, "attach_headers", attach_and_keep)
    monkeypatch.setattr(UpstreamAnswer, "drop_head", lambda self: None)


async def _open_held(
    http: aiohttp.ClientSession, url: str, key: str
) -> tuple[aiohttp.ClientResponse, bytes]:
    # Held after the first text delta: a gated stream (resend armed) has opened by then.
    headers = {"Content-Type": "application/json", "x-emulator": f"hold={key}; stall_after=2"}
    resp = await http.post(url + CHAT, data=_body(), headers=headers)
    assert resp.status == 200
    first = await resp.content.readany()
    assert first.startswith(b"data: ")
    return resp, first


@pytest.mark.parametrize("drops", [True, False], ids=["drops", "negative-control"])
async def test_an_open_stream_holds_neither_the_forwarded_fields_nor_the_upstream_head(
    drops: bool,
    emulator: SubprocessEmulator,
    http: aiohttp.ClientSession,
    monkeypatch: pytest.MonkeyPatch,
    no_gc: None,
) -> None:
    holders = Holders(monkeypatch)
    if not drops:
        _keep_everything(monkeypatch)
    key = f"head-{drops}"
    await emulator.reset(http)
    # A resend feature armed: the fields must survive acceptance, and go at the first byte.
    async with proxy_at(emulator.url, [], fake_completion_retries=1) as proxy:
        resp, first = await _open_held(http, proxy.url, key)
        try:
            (ex,) = proxy.state.exchanges.values()
            fired_while_open = sorted(holders.fired)
            outbound_headers = ex.outbound_headers
        finally:
            await emulator.release(http, key)
            rest = await resp.read()
            resp.release()
    assert b"[DONE]" in first + rest
    if drops:
        assert fired_while_open == ["forwarded fields", "upstream head"]
        assert outbound_headers is None
    else:
        assert fired_while_open == [], "the control shows every holder still alive"


async def test_a_resend_still_sends_the_forwarded_fields(
    emulator: SubprocessEmulator, http: aiohttp.ClientSession
) -> None:
    """The fields are kept for a fake-completion resend: the second request carries them."""
    await emulator.reset(http)
    async with proxy_at(emulator.url, [], fake_completion_retries=1) as proxy:
        headers = {
            "Content-Type": "application/json",
            "x-emulator": "empty_times=1",
            "x-emulator-key": "resend-fields",
        }
        async with http.post(proxy.url + CHAT, data=_body(), headers=headers) as resp:
            assert resp.status == 200
            answer = await resp.read()
    # The second answer (not empty: the fake completion was resent) reached the client.
    assert b"[DONE]" in answer and b"chatcmpl-emu000002" in answer
    assert re.search(rb'"content": ?"[^"]', answer) is not None
    records = await emulator.records(http)
    # Both requests carried the client's fields (the script) and the whole body.
    assert [(r["script"], r["body_bytes"]) for r in records] == [
        ("empty_times=1", len(_body()))
    ] * 2


async def test_the_first_byte_frees_the_header_fields_by_tracemalloc(
    emulator: SubprocessEmulator,
    http: aiohttp.ClientSession,
    monkeypatch: pytest.MonkeyPatch,
    no_gc: None,
) -> None:
    """Traced bytes freed by the step into streaming, per stream, against the control
    (the event loop runs one step at a time, so the difference across the call is what
    that call let go; in both runs it also frees the small outbound body)."""
    freed: list[int] = []
    mark = Exchange.mark_streaming

    def measured(ex: Exchange, *, upstream_head: Any = None) -> None:
        before = tracemalloc.get_traced_memory()[0]
        mark(ex, upstream_head=upstream_head)
        freed.append(before - tracemalloc.get_traced_memory()[0])

    monkeypatch.setattr(Exchange, "mark_streaming", measured)

    async def freed_per_stream(key: str) -> float:
        freed.clear()
        await emulator.reset(http)
        async with proxy_at(emulator.url, [], fake_completion_retries=1) as proxy:
            tracemalloc.start(1)
            try:
                opened = [await _open_held(http, proxy.url, key) for _ in range(STREAMS)]
            finally:
                tracemalloc.stop()
                await emulator.release(http, key)
            for resp, _ in opened:
                await resp.read()
                resp.release()
        assert len(freed) == STREAMS
        return sum(freed) / STREAMS

    ours = await freed_per_stream("traced-drops")
    _keep_everything(monkeypatch)
    control = await freed_per_stream("traced-control")
    assert ours - control >= MIN_FREED_PER_STREAM, (ours, control)


def _await_chain(task: asyncio.Task[Any]) -> list[str]:
    """Names of the coroutines (and async generators) ``task`` waits in, outermost first."""
    names: list[str] = []
    awaited: Any = task.get_coro()
    while awaited is not None:
        code = getattr(awaited, "cr_code", None) or getattr(awaited, "ag_code", None)
        if code is None:
            break  # a future or an awaitable object: the bottom of the chain
        names.append(code.co_name)
        awaited = getattr(awaited, "cr_await", None) or getattr(awaited, "ag_await", None)
    return names


async def test_an_open_stream_waits_through_no_pass_through_frames(
    emulator: SubprocessEmulator, http: aiohttp.ClientSession
) -> None:
    """Every coroutine frame an idle stream is suspended in is held per open stream:
    the dispatch, ``relay()`` and the admission hand over their
    callee's coroutine (or are plain objects) instead of awaiting it in a frame of their own."""
    key = "frames"
    await emulator.reset(http)
    async with proxy_at(emulator.url, []) as proxy:
        resp, _ = await _open_held(http, proxy.url, key)
        try:
            (task,) = proxy.state.handlers
            chain = _await_chain(task)
        finally:
            await emulator.release(http, key)
            await resp.read()
            resp.release()
    assert chain[-2:] == ["_answer", "read_body"], chain
    passing = {"dispatch", "relay", "_run", "_next", "admitted"}
    assert not passing & set(chain), chain


#: Bytes beyond its own size an idle stream's framer may hold between events: its
#: counters (small ints are shared, offsets past 256 are not; ~9 B measured), no
#: buffer object. The three empty bytearrays it kept before are 168 B more.
FRAMER_SLACK = 64


def test_a_framer_between_events_holds_no_buffers_by_tracemalloc() -> None:
    """Framers that went through every buffer (a data line split across chunks, two
    data lines, a split ``event:`` line, a field without a colon), now waiting
    between events, as on an idle stream: traced bytes per framer are its own."""
    pieces = [
        b"event: response.output_text.de",
        b'lta\ndata: {"delta": "he',
        b'llo"}\ndata: more\nid\n\n',
        b'data: {"delta": " world"}\n\n',
    ]
    count = 200
    tracemalloc.start(1)
    try:
        before = tracemalloc.get_traced_memory()[0]
        framers = [SSEFramer() for _ in range(count)]
        for framer in framers:
            for piece in pieces:
                events = framer.feed(piece)
            assert [e.data for e in events] == [b'{"delta": " world"}']
            assert not framer.mid_event
        held = (tracemalloc.get_traced_memory()[0] - before) / count
    finally:
        tracemalloc.stop()
    assert held <= sys.getsizeof(framers[0]) + FRAMER_SLACK, held


#: Container objects the collector tracks per open idle stream, at most (89.6 measured:
#: both connections' protocols, machines, parsers and their bound callbacks, asyncio's
#: transports, selector keys, handles and contexts, the handler's task and coroutine
#: chain, one of each per-exchange object). Each is visited by every full collection,
#: which at 4,000 streams stops the loop for ~0.2 s (proxy/_gc.py); 95.7 before the
#: per-exchange bound method, closure cells and sent head fields went.
MAX_TRACKED_PER_STREAM = 92

#: Streams held open at once for the tracked-object count.
COUNTED_STREAMS = 100

# A client in a process of its own (its sockets and buffers are not counted here):
# opens argv[2] streams to argv[1], prints "open" once each has its first event, then
# holds them until a line comes on stdin.
_HOLDING_CLIENT = """
import socket, sys
port, count, script = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
body = b'{"model": "m", "stream": true, "messages": [{"role": "user", "content": "hi"}]}'
head = ("POST /v1/chat/completions HTTP/1.1\\r\\nHost: 127.0.0.1\\r\\n"
        "Content-Type: application/json\\r\\nContent-Length: %d\\r\\nx-emulator: %s\\r\\n\\r\\n"
        % (len(body), script)).encode()
socks = [socket.create_connection(("127.0.0.1", port), timeout=30) for _ in range(count)]
for sock in socks:
    sock.sendall(head + body)
for sock in socks:
    got = b""
    while b"data: " not in got:
        chunk = sock.recv(65536)
        assert chunk, "closed before the first event"
        got += chunk
print("open", flush=True)
sys.stdin.readline()
"""


async def test_an_idle_stream_keeps_few_objects_the_collector_visits(
    emulator: SubprocessEmulator, http: aiohttp.ClientSession
) -> None:
    key = "tracked"
    await emulator.reset(http)
    async with proxy_at(emulator.url, []) as proxy:
        port = proxy.url.rsplit(":", 1)[1]
        gc.collect()
        before = len(gc.get_objects())
        client = await asyncio.create_subprocess_exec(
            sys.executable,
            "-c",
            _HOLDING_CLIENT,
            port,
            str(COUNTED_STREAMS),
            f"hold={key}; stall_after=2",
            stdin=asyncio.subprocess.PIPE,
            stdout=asyncio.subprocess.PIPE,
        )
        assert client.stdin is not None and client.stdout is not None
        try:
            async with asyncio.timeout(60):
                assert await client.stdout.readline() == b"open\n"
            assert len(proxy.state.exchanges) == COUNTED_STREAMS
            gc.collect()
            per_stream = (len(gc.get_objects()) - before) / COUNTED_STREAMS
        finally:
            await emulator.release(http, key)
            client.stdin.write(b"\n")
            async with asyncio.timeout(30):
                await client.wait()
    assert per_stream <= MAX_TRACKED_PER_STREAM, per_stream

"""An exchange leaves no reference cycle: its objects die by reference counting as it ends.

A cycle (objects that refer to each other and nothing else refers to) is freed only
by the cyclic collector. An exchange caught in one keeps its buffers, its
connection's objects and its coroutine frames alive until the next collection that
reaches them, which in a busy proxy is a full one many seconds later (proxy/_gc.py),
and each such collection stops the event loop for every open stream. So the
collector is off while real exchanges of every kind run through a real proxy
(the emulator in a child process: its own garbage is not this process's), then
``gc.collect()`` must find nothing (``gc.DEBUG_SAVEALL`` keeps what it found, to
name it in the failure).

The client is a blocking socket in a worker thread: asyncio streams and aiohttp
would bring garbage of their own.
"""

from __future__ import annotations

import asyncio
import collections
import gc
import socket
import struct
import time
from collections.abc import Iterator
from typing import Final

import aiohttp
import pytest

from plugins.fold import FoldPlugin
from proxy._app import AppState
from tests.support.lifetime import (
    CHAT,
    MESSAGES,
    RESPONSES,
    WAIT_S,
    SubprocessEmulator,
    closed_port_url,
    conversation,
    encode,
    proxy_at,
)

#: Times each kind of exchange runs while the collector is off.
ROUNDS: Final = 3
#: Between a long conversation (~120 KB) and what fold level 1 leaves of it (~70 KB).
OVERFLOW_ABOVE: Final = 100_000


@pytest.fixture(scope="module")
def emulator() -> Iterator[SubprocessEmulator]:
    with SubprocessEmulator() as emu:
        yield emu


def _small(path: str, *, stream: bool) -> bytes:
    return encode(conversation(path, turns=2, turn_bytes=200, stream=stream))


def _head(path: str, body: bytes, script: str, *, close: bool = True) -> bytes:
    lines = [
        f"POST {path} HTTP/1.1",
        "Host: 127.0.0.1",
        "Content-Type: application/json",
        f"Content-Length: {len(body)}",
        "anthropic-version: 2023-06-01",
        f"x-emulator: {script}",
    ]
    if close:
        lines.append("Connection: close")
    return ("\r\n".join(lines) + "\r\n\r\n").encode()


def _read_answer(sock: socket.socket, buffered: bytes = b"") -> tuple[bytes, bytes]:
    """One whole answer (length-framed or chunked) and the bytes read past it."""
    data = buffered
    while b"\r\n\r\n" not in data:
        data += _recv(sock)
    head, _, rest = data.partition(b"\r\n\r\n")
    lowered = head.lower()
    if b"transfer-encoding: chunked" in lowered:
        while b"\r\n0\r\n\r\n" not in b"\r\n" + rest:
            rest += _recv(sock)
        end = (b"\r\n" + rest).index(b"\r\n0\r\n\r\n") + 5
    else:
        length = int(lowered.split(b"content-length:", 1)[1].split(b"\r\n", 1)[0])
        while len(rest) < length:
            rest += _recv(sock)
        end = length
    return head + b"\r\n\r\n" + rest[:end], rest[end:]


def _recv(sock: socket.socket) -> bytes:
    chunk = sock.recv(65536)
    assert chunk, "the proxy closed the connection before the whole answer"
    return chunk


def _client(url: str, path: str, body: bytes, script: str, mode: str) -> bytes:
    """One exchange on a connection of its own (blocking; run it in a worker thread).

    ``mode``: ``close`` reads the answer to the proxy's close; ``keep`` sends the
    request twice on one kept connection; ``hang-up`` resets the connection (RST)
    once the first event of a streamed answer is in. Returns the bytes read.
    """
    host, port = url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=WAIT_S) as sock:
        if mode == "keep":
            sock.sendall(_head(path, body, script, close=False) + body)
            first, rest = _read_answer(sock)
            sock.sendall(_head(path, body, script) + body)
            second, _ = _read_answer(sock, rest)
            return first + second
        sock.sendall(_head(path, body, script) + body)
        got = b""
        while chunk := sock.recv(65536):
            got += chunk
            if mode == "hang-up" and b"data:" in got:
                # SO_LINGER with a zero timeout: close() sends RST, as a killed client does.
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
                break
        return got


#: name -> (path, body, x-emulator script, client mode, what the answer starts with or holds)
CASES: Final = {
    "chat json": (CHAT, _small(CHAT, stream=False), "", "close", b"HTTP/1.1 200"),
    "chat stream": (CHAT, _small(CHAT, stream=True), "", "close", b"[DONE]"),
    "responses json": (RESPONSES, _small(RESPONSES, stream=False), "", "close", b"HTTP/1.1 200"),
    "responses stream": (
        RESPONSES,
        _small(RESPONSES, stream=True),
        "",
        "close",
        b"response.completed",
    ),
    "messages json": (MESSAGES, _small(MESSAGES, stream=False), "", "close", b"HTTP/1.1 200"),
    "messages stream": (MESSAGES, _small(MESSAGES, stream=True), "", "close", b"message_stop"),
    "two on a kept connection": (CHAT, _small(CHAT, stream=False), "", "keep", b"HTTP/1.1 200"),
    "client hangs up mid-stream": (
        CHAT,
        _small(CHAT, stream=True),
        "chunks=50; delay=0.1",
        "hang-up",
        b"data:",
    ),
    "upstream answers 500": (CHAT, _small(CHAT, stream=True), "status=500", "close", b" 500 "),
    "upstream cuts the stream": (
        CHAT,
        _small(CHAT, stream=True),
        "cut_after=1",
        "close",
        b"HTTP/1.1 200",
    ),
    "refold after an overflow": (
        CHAT,
        encode(conversation(CHAT, turns=12, turn_bytes=10_000)),
        f"overflow_above={OVERFLOW_ABOVE}",
        "close",
        b"[DONE]",
    ),
}


def _names(garbage: list[object]) -> list[tuple[str, int]]:
    """What the collector found, by type (and code for frames and coroutines), most first."""
    counts: collections.Counter[str] = collections.Counter()
    for obj in garbage:
        name = f"{type(obj).__module__}.{type(obj).__qualname__}"
        code = getattr(obj, "f_code", None) or getattr(obj, "cr_code", None)
        counts[f"{name} {code.co_qualname}" if code is not None else name] += 1
    return counts.most_common(40)


async def _settled(*states: AppState) -> None:
    """Wait until no proxy has an exchange or a handler left (bounded), then a moment
    for the closed connections' ``connection_lost`` callbacks."""
    deadline = time.monotonic() + WAIT_S
    while any(state.exchanges or state.handlers for state in states):
        assert time.monotonic() < deadline, "the proxies did not settle"
        await asyncio.sleep(0.01)
    await asyncio.sleep(0.2)


async def test_no_exchange_leaves_a_reference_cycle(emulator: SubprocessEmulator) -> None:
    loop = asyncio.get_running_loop()

    async def run(url: str, case: str) -> bytes:
        path, body, script, mode, _ = CASES[case]
        return await loop.run_in_executor(None, _client, url, path, body, script, mode)

    async with (
        proxy_at(emulator.url, [FoldPlugin()]) as proxy,
        proxy_at(closed_port_url()) as unreachable,
    ):
        # Once each first: what the first exchange makes lazily lives on (the upstream
        # pool's kept connection, caches, the executor's thread).
        for case in CASES:
            await run(proxy.url, case)
        await run(unreachable.url, "chat stream")
        await _settled(proxy.state, unreachable.state)
        answers: dict[str, bytes] = {}
        gc.collect()
        gc.disable()
        gc.set_debug(gc.DEBUG_SAVEALL)
        try:
            for _ in range(ROUNDS):
                for case in CASES:
                    answers[case] = await run(proxy.url, case)
                answers["upstream unreachable"] = await run(unreachable.url, "chat stream")
            await _settled(proxy.state, unreachable.state)
            found = gc.collect()
            garbage = list(gc.garbage)
        finally:
            gc.garbage.clear()
            gc.set_debug(0)
            gc.enable()
    for case, (*_, expected) in CASES.items():
        assert expected in answers[case], (case, answers[case][:300])
    assert answers["upstream unreachable"].startswith(b"HTTP/1.1 502")
    assert found == 0, _names(garbage)
    del garbage
    async with aiohttp.ClientSession() as http:
        refolded = [r for r in await emulator.records(http) if r["body_bytes"] > OVERFLOW_ABOVE]
    assert len(refolded) == ROUNDS + 1  # each refold case sent the long body once, then folded

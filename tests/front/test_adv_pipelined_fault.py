"""A whole request pipelined ahead of malformed bytes is answered and committed.

The client's bytes may arrive in one read or several: the outcome must not
depend on where the segments fall. Before, a request and the bad bytes behind
it in one read were dropped together (no answer, no commit); in two reads the
whole body was thrown away and the request booked as a client gone mid-body.
"""

from __future__ import annotations

import asyncio
from typing import Final

import pytest

from proxy.testing import Harness, proxy_with_emulator
from tests.exchange.test_commit_refused import Recorder
from tests.support.e2e import CHAT_PATH, exact_body

GARBAGE: Final = b"\x00GARBAGE\r\n\r\n"


async def _exchange(h: Harness, pieces: list[bytes]) -> bytes:
    """Send ``pieces`` (0.2 s apart) on one connection; all the proxy answered."""
    host, _, port = h.url.removeprefix("http://").partition(":")
    reader, writer = await asyncio.open_connection(host, int(port))
    try:
        for i, piece in enumerate(pieces):
            if i:
                await asyncio.sleep(0.2)
            writer.write(piece)
        async with asyncio.timeout(10):
            return await reader.read(-1)  # the proxy closes after its 400
    finally:
        writer.close()


def _post(body: bytes, length: int | None = None) -> bytes:
    return (
        b"POST %s HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        b"Content-Length: %d\r\n\r\n"
        % (CHAT_PATH.encode(), len(body) if length is None else length)
    )


@pytest.mark.parametrize("split", [False, True], ids=["one-read", "head-then-rest"])
async def test_a_request_pipelined_ahead_of_garbage_is_answered_and_committed(
    split: bool,
) -> None:
    body = exact_body(CHAT_PATH, 300)
    head = _post(body)
    pieces = [head, body + GARBAGE] if split else [head + body + GARBAGE]
    recorder = Recorder()
    async with proxy_with_emulator(plugins=[recorder]) as h:
        answer = await _exchange(h, pieces)
        await h.settle()
        assert answer.startswith(b"HTTP/1.1 200 OK\r\n"), answer[:200]
        assert answer.count(b"HTTP/1.1 400 ") == 1 and b"malformed_request" in answer
        assert [(r.outcome.value, r.status, r.request_bytes) for r in recorder.records] == [
            ("ok", 200, len(body))
        ]
        assert not h.state.exchanges


@pytest.mark.parametrize("split", [False, True], ids=["one-read", "head-then-rest"])
async def test_a_content_length_shorter_than_the_body_is_judged_on_the_declared_bytes(
    split: bool,
) -> None:
    """The declared 250 bytes are the request (cut JSON: 400 invalid_json, committed);
    the 50 after them are a malformed next request (400, close)."""
    body = exact_body(CHAT_PATH, 300)
    head = _post(body, 250)
    pieces = [head, body] if split else [head + body]
    recorder = Recorder()
    async with proxy_with_emulator(plugins=[recorder]) as h:
        answer = await _exchange(h, pieces)
        await h.settle()
        assert b"invalid_json" in answer and b"malformed_request" in answer, answer
        assert [
            (r.outcome.value, r.status, r.error, r.request_bytes) for r in recorder.records
        ] == [("rejected", 400, "invalid_json", 250)]


async def test_a_request_queued_behind_one_in_flight_is_answered_before_the_400() -> None:
    """The first request streams for a while; the second and the bad bytes come
    meanwhile: both requests are answered and committed, then the 400 closes."""
    slow = exact_body(CHAT_PATH, 300)
    quick = exact_body(CHAT_PATH, 200)
    first = (
        b"POST %s HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        b"x-emulator: stall_headers=0.5\r\nContent-Length: %d\r\n\r\n"
        % (CHAT_PATH.encode(), len(slow))
    ) + slow
    recorder = Recorder()
    async with proxy_with_emulator(plugins=[recorder]) as h:
        answer = await _exchange(h, [first, _post(quick) + quick + GARBAGE])
        await h.settle()
        assert answer.count(b"HTTP/1.1 200 OK\r\n") == 2, answer[:300]
        assert answer.rindex(b"HTTP/1.1 400 ") > answer.rindex(b"HTTP/1.1 200 OK")
        assert [(r.outcome.value, r.request_bytes) for r in recorder.records] == [
            ("ok", len(slow)),
            ("ok", len(quick)),
        ]

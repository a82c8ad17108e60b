"""Overflow refold and fake-completion resend (issue 3), end to end through the proxy.

A context overflow, in each shape the upstreams use, is answered by running the
prepare hooks again at the next fold level (the real ``fold`` plugin) and
sending the smaller body; when nothing shrinks or the levels are used up, the
upstream's own error reaches the client unchanged, byte for byte. An empty
answer is resent, with the identical outbound bytes, while no byte has reached
the client. Neither happens once the client has gone.

Byte-identical checks replay the bodies the proxy sent (recomputed with the
same fold plugin and checked against the emulator's digests) to a fresh
emulator, which answers them exactly as it answered the proxy.
"""

from __future__ import annotations

import asyncio
import dataclasses
import re
from collections.abc import AsyncIterator
from typing import Any, cast

import aiohttp
import anthropic
import openai
import pytest
import xxhash

from plugins.fold import FoldPlugin
from proxy import _stream as stream_module
from proxy._emulator import DEFAULT_TEXT, start_emulator
from proxy._exchange import Exchange
from proxy._holders import HeldBytes
from proxy._phases import Phase
from proxy._plugins import Plugin, PrepareContext
from proxy._protocols import Protocol
from proxy._structure import BodyView, Splice
from proxy.testing import Harness, proxy_with_emulator
from tests.support.lifetime import (
    CHAT,
    MESSAGES,
    RESPONSES,
    WAIT_S,
    Mutator,
    RawConn,
    Recorder,
    Spy,
    TracedExchange,
    chat_text,
    conversation,
    encode,
    fixed_upstream,
    proxy_at,
)

#: Between a long conversation (~120 KB) and what fold level 1 leaves of it (~70 KB).
OVERFLOW_ABOVE = 100_000


@dataclasses.dataclass(frozen=True)
class Shape:
    """One way an upstream says "too long": the route and the emulator's script keys."""

    path: str
    script: str
    protocol: Protocol
    overflow_status: int


SHAPES = {
    "openai-400": Shape(CHAT, "", Protocol.CHAT, 400),
    "anthropic-400": Shape(MESSAGES, "", Protocol.MESSAGES, 400),
    "vllm-plain-text-400": Shape(CHAT, "plain=1", Protocol.CHAT, 400),
    "responses-failed-in-200-stream": Shape(RESPONSES, "", Protocol.RESPONSES, 200),
}


@pytest.fixture
async def http() -> AsyncIterator[aiohttp.ClientSession]:
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=30)) as session:
        yield session


def script(shape: Shape, overflow_above: int) -> str:
    keys = [f"overflow_above={overflow_above}"]
    if shape.script:
        keys.append(shape.script)
    return "; ".join(keys)


async def sdk_answer(h: Harness, shape: Shape, body: dict[str, Any], emulator_script: str) -> str:
    """Ask through the proxy with the protocol's real SDK, streaming; returns the answer text."""
    headers = {"x-emulator": emulator_script}
    text = ""
    if shape.path == MESSAGES:
        async with (
            anthropic.AsyncAnthropic(
                base_url=h.url, api_key="test", max_retries=0, default_headers=headers
            ) as claude,
            claude.messages.stream(
                model=body["model"],
                max_tokens=body["max_tokens"],
                system=body["system"],
                messages=cast(Any, body["messages"]),
            ) as stream,
        ):
            return await stream.get_final_text()
    async with openai.AsyncOpenAI(
        base_url=h.openai_base_url, api_key="test", max_retries=0, default_headers=headers
    ) as client:
        if shape.path == RESPONSES:
            events = await client.responses.create(
                model=body["model"],
                instructions=body["instructions"],
                input=cast(Any, body["input"]),
                stream=True,
            )
            async for event in events:
                if event.type == "response.output_text.delta":
                    text += event.delta
            return text
        chunks = await client.chat.completions.create(
            model=body["model"],
            messages=cast(Any, body["messages"]),
            stream=True,
            stream_options={"include_usage": True},
        )
        async for chunk in chunks:
            for choice in chunk.choices:
                text += choice.delta.content or ""
        return text


REFOLD_PHASES = [
    Phase.READING,
    Phase.PARSED,
    Phase.PREPARED,
    Phase.SENT,
    Phase.PREPARED,  # the refold: prepare again at fold level 1 ...
    Phase.SENT,  # ... and send the smaller body
    Phase.ACCEPTED,
    Phase.STREAMING,
    Phase.COMMITTED,
    Phase.CLOSED,
]


@pytest.mark.parametrize("name", list(SHAPES))
async def test_overflow_is_refolded_and_the_smaller_body_resent(name: str, spy: Spy) -> None:
    shape = SHAPES[name]
    body = conversation(shape.path)
    recorder = Recorder()
    async with proxy_with_emulator(plugins=[FoldPlugin(), recorder]) as h:
        answer = await sdk_answer(h, shape, body, script(shape, OVERFLOW_ABOVE))
        (record,) = await recorder.wait(1)
        first, second = h.emulator.stats
        (ex,) = spy
        await ex.trace.finished()
    assert answer == DEFAULT_TEXT
    assert (first.status, second.status) == (shape.overflow_status, 200)
    assert first.body_bytes > OVERFLOW_ABOVE >= second.body_bytes
    # The client's bytes went up untouched first; the refolded ones second.
    assert record.wire_digest == first.body_digest
    assert record.outbound_digest == second.body_digest
    assert record.outbound_bytes == second.body_bytes
    assert (record.status, record.outcome, record.refolds, record.fold_level) == (200, "ok", 1, 1)
    assert record.input_tokens == second.body_bytes // 4  # usage of the answered request
    assert ex.trace.phases == REFOLD_PHASES
    assert ex.releases == 1 and sorted(ex.trace.fired) == sorted(ex.trace.watched)


def refolded_bodies(raw: bytes, protocol: Protocol, levels: int) -> list[bytes]:
    """``raw`` and what the fold plugin makes of it at levels 1..``levels``, as the proxy does.

    The proxy folds the raw bytes through a fresh structural view at each level.
    """
    bodies = [raw]
    fold = FoldPlugin()
    for level in range(1, levels + 1):
        view = BodyView(raw, protocol)
        assert fold.fold(view, level=level)
        bodies.append(view.splice().join())
    return bodies


_CREATED_AT = re.compile(rb'"created_at":\d+')


async def replayed(
    http: aiohttp.ClientSession, path: str, bodies: list[bytes], emulator_script: str
) -> tuple[int, str, bytes]:
    """Status, content type and body a fresh emulator gives the last of ``bodies``.

    All are sent in order, so the last one gets the same request number there
    as it got behind the proxy. A stream's ``created_at`` (wall clock) is zeroed.
    """
    async with await start_emulator() as fresh:
        for body in bodies:
            headers = {"x-emulator": emulator_script, "Content-Type": "application/json"}
            async with http.post(fresh.url + path, data=body, headers=headers) as resp:
                answer = (resp.status, resp.headers["Content-Type"], await resp.read())
    return answer[0], answer[1], _CREATED_AT.sub(b'"created_at":0', answer[2])


@pytest.mark.parametrize("name", list(SHAPES))
async def test_after_the_last_refold_the_client_gets_the_upstream_error_unchanged(
    name: str, http: aiohttp.ClientSession, counted: dict[str, int]
) -> None:
    shape = SHAPES[name]
    raw = encode(conversation(shape.path))
    every_send = script(shape, 100)  # nothing fits
    recorder = Recorder()
    async with proxy_with_emulator(plugins=[FoldPlugin(), recorder], max_refolds=2) as h:
        headers = {"x-emulator": every_send, "Content-Type": "application/json"}
        async with http.post(h.url + shape.path, data=raw, headers=headers) as resp:
            got = (resp.status, resp.headers["Content-Type"], await resp.read())
        (record,) = await recorder.wait(1)
        upstream = h.emulator.stats
    by_the_proxy = dict(counted)
    # Three sends, each smaller: the original and fold levels 1 and 2.
    sent = refolded_bodies(raw, shape.protocol, 2)
    assert [r.body_digest for r in upstream] == [xxhash.xxh3_128_hexdigest(b) for b in sent]
    assert upstream[0].body_bytes > upstream[1].body_bytes > upstream[2].body_bytes
    # Both refolds went through the structural view: no full parse, no serialization.
    assert by_the_proxy == {"parse": 0, "encode": 0}
    # The client gets exactly what the upstream answered the last send.
    expected = await replayed(http, shape.path, sent, every_send)
    assert (got[0], got[1], _CREATED_AT.sub(b'"created_at":0', got[2])) == expected
    assert got[0] == shape.overflow_status
    assert len(got[2]) == upstream[2].bytes_sent
    assert (record.refolds, record.fold_level, record.status) == (2, 2, shape.overflow_status)


@pytest.mark.parametrize("name", list(SHAPES))
async def test_no_refold_when_nothing_shrinks(name: str, http: aiohttp.ClientSession) -> None:
    shape = SHAPES[name]
    # Turns under the fold plugin's min_bytes: there is nothing it may elide.
    raw = encode(conversation(shape.path, turns=6, turn_bytes=300))
    every_send = script(shape, 100)
    recorder = Recorder()
    async with proxy_with_emulator(plugins=[FoldPlugin(), recorder]) as h:
        headers = {"x-emulator": every_send, "Content-Type": "application/json"}
        async with http.post(h.url + shape.path, data=raw, headers=headers) as resp:
            got = (resp.status, resp.headers["Content-Type"], await resp.read())
        (record,) = await recorder.wait(1)
        assert len(h.emulator.stats) == 1
    expected = await replayed(http, shape.path, [raw], every_send)
    assert (got[0], got[1], _CREATED_AT.sub(b'"created_at":0', got[2])) == expected
    # Prepare ran at level 1 and changed nothing: no refold counted, nothing resent.
    assert (record.refolds, record.fold_level, record.outbound_digest) == (
        0,
        1,
        record.wire_digest,
    )


class Stall(Plugin):
    """Blocks in prepare at fold level 1 (a slow refold), after saying so."""

    name = "stall"

    def __init__(self) -> None:
        self.refolding = asyncio.Event()
        self.levels: list[int] = []

    async def prepare(self, ctx: PrepareContext) -> bool:
        self.levels.append(ctx.fold_level)
        if ctx.fold_level >= 1:
            self.refolding.set()
            await asyncio.Event().wait()  # until cancelled
        return False


@pytest.mark.parametrize("moment", ["while-upstream-thinks", "during-the-refold"])
async def test_no_refold_after_the_client_has_gone(moment: str, spy: Spy) -> None:
    stall = Stall()
    recorder = Recorder()
    raw = encode(conversation(CHAT))
    async with proxy_with_emulator(plugins=[FoldPlugin(), stall, recorder]) as h:
        conn = await RawConn.open(h.url)
        thinking = "; stall_headers=30" if moment == "while-upstream-thinks" else ""
        await conn.send_head(CHAT, len(raw), {"x-emulator": f"overflow_above=100{thinking}"})
        await conn.send(raw)
        if moment == "while-upstream-thinks":
            await h.emulator.wait_received(1)
        else:
            async with asyncio.timeout(WAIT_S):
                await stall.refolding.wait()
        conn.abort()
        (ex,) = spy
        await ex.trace.finished()
        (record,) = await recorder.wait(1)
        await h.emulator.wait_closed(1)
        assert len(h.emulator.stats) == 1
    assert record.outcome == "client_gone"
    assert record.refolds == 0
    if moment == "while-upstream-thinks":
        assert stall.levels == [0]
        assert h.emulator.stats[0].aborted_by_peer
    assert ex.releases == 1 and sorted(ex.trace.fired) == sorted(ex.trace.watched)


@pytest.mark.parametrize("max_refolds", [0, 1])
async def test_an_overflow_in_a_stream_is_never_resent_as_an_empty_answer(
    max_refolds: int, http: aiohttp.ClientSession
) -> None:
    recorder = Recorder()
    raw = encode(conversation(RESPONSES))
    async with proxy_with_emulator(
        plugins=[FoldPlugin(), recorder], max_refolds=max_refolds, fake_completion_retries=2
    ) as h:
        headers = {"x-emulator": "overflow_above=100"}
        async with http.post(h.url + RESPONSES, data=raw, headers=headers) as resp:
            assert resp.status == 200
            answer = await resp.read()
        (record,) = await recorder.wait(1)
        upstream = h.emulator.stats
    assert len(upstream) == 1 + max_refolds
    assert b"event: response.failed" in answer and b"context_length_exceeded" in answer
    assert len(answer) == upstream[-1].bytes_sent
    assert (record.retries, record.refolds) == (0, max_refolds)


async def test_an_overflow_inside_a_chat_stream_armed_for_resend_goes_to_the_client(
    http: aiohttp.ClientSession,
) -> None:
    # Some OpenAI-compatible servers report the overflow after their 200 headers.
    # A chat exchange is released at the headers, so no refold can follow: the
    # client gets the upstream's stream as it came (and no empty-answer resend).
    stream = (
        b'data: {"error":{"message":"This model\'s maximum context length is 8192 tokens",'
        b'"type":"invalid_request_error","param":null,"code":"context_length_exceeded"}}\n\n'
    )
    recorder = Recorder()
    raw = encode(conversation(CHAT))
    async with fixed_upstream(200, "text/event-stream", stream) as (url, seen):
        plugins = [FoldPlugin(), recorder]
        async with proxy_at(url, plugins, fake_completion_retries=1) as proxy:
            async with http.post(proxy.url + CHAT, data=raw) as resp:
                got = (resp.status, await resp.read())
            (record,) = await recorder.wait(1)
    assert got == (200, stream)
    assert seen == [len(raw)]
    assert (record.refolds, record.retries, record.outcome) == (0, 0, "ok")


# ------------------------------------------------------------------------------ fake completion


@pytest.mark.parametrize("change", [False, True], ids=["untouched-body", "changed-body"])
async def test_an_empty_answer_is_resent_with_the_identical_bytes(
    change: bool, spy: Spy, http: aiohttp.ClientSession, counted: dict[str, int]
) -> None:
    raw = encode(conversation(CHAT))
    recorder = Recorder()
    plugins: list[Plugin] = [Mutator(), recorder] if change else [recorder]
    async with proxy_with_emulator(plugins=plugins, fake_completion_retries=2) as h:
        headers = {"x-emulator": "empty_times=2", "x-emulator-key": f"resend-{change}"}
        async with http.post(h.url + CHAT, data=raw, headers=headers) as resp:
            assert resp.status == 200
            answer = await resp.read()
        (record,) = await recorder.wait(1)
        upstream = h.emulator.stats
        (ex,) = spy
        await ex.trace.finished()
    assert chat_text(answer) == DEFAULT_TEXT
    assert len(upstream) == 3
    assert {r.body_digest for r in upstream} == {record.outbound_digest}
    if change:
        assert record.outbound_digest != record.wire_digest
        assert counted == {"parse": 1, "encode": 1}  # serialized once, resent as is
    else:
        assert record.outbound_digest == record.wire_digest == xxhash.xxh3_128_hexdigest(raw)
        assert counted == {"parse": 0, "encode": 0}
    assert (record.retries, record.refolds, record.outcome) == (2, 0, "ok")
    assert ex.releases == 1 and sorted(ex.trace.fired) == sorted(ex.trace.watched)


async def test_resends_stop_at_the_maximum_and_the_empty_answer_goes_through(
    http: aiohttp.ClientSession,
) -> None:
    recorder = Recorder()
    async with proxy_with_emulator(plugins=[recorder], fake_completion_retries=1) as h:
        headers = {"x-emulator": "empty_times=5", "x-emulator-key": "always-empty"}
        raw = encode(conversation(CHAT))
        async with http.post(h.url + CHAT, data=raw, headers=headers) as resp:
            assert resp.status == 200
            answer = await resp.read()
        (record,) = await recorder.wait(1)
        assert len(h.emulator.stats) == 2
    assert chat_text(answer) == ""
    assert answer.rstrip().endswith(b"data: [DONE]")  # well formed, only empty
    assert (record.retries, record.outcome) == (1, "ok")


@pytest.mark.parametrize("kind", ["stream-gate-opened", "json"])
async def test_no_resend_once_a_byte_reached_the_client(
    kind: str, http: aiohttp.ClientSession, monkeypatch: pytest.MonkeyPatch
) -> None:
    if kind == "stream-gate-opened":
        # The held head may not grow past 0 bytes: the first chunk goes to the client.
        monkeypatch.setattr(stream_module, "HEAD_HOLD_CAP", 0)
    recorder = Recorder()
    body = conversation(CHAT, stream=kind != "json")
    async with proxy_with_emulator(plugins=[recorder], fake_completion_retries=2) as h:
        headers = {"x-emulator": "empty=1"}
        async with http.post(h.url + CHAT, data=encode(body), headers=headers) as resp:
            assert resp.status == 200
            answer = await resp.read()
        (record,) = await recorder.wait(1)
        assert len(h.emulator.stats) == 1
    assert answer and record.retries == 0
    assert len(answer) == h.emulator.stats[0].bytes_sent


@pytest.mark.parametrize("retries", [0, 1])
async def test_outbound_body_is_kept_only_while_a_resend_is_possible(
    retries: int, spy: Spy, http: aiohttp.ClientSession
) -> None:
    raw = encode(conversation(CHAT))
    async with proxy_with_emulator(plugins=[], fake_completion_retries=retries) as h:
        # The hold comes after the first event (the role chunk): no output yet.
        headers = {"x-emulator": "hold=out"}

        async def ask() -> bytes:
            async with http.post(h.url + CHAT, data=raw, headers=headers) as resp:
                return await resp.read()

        asking = asyncio.create_task(ask())
        await spy.made(1)
        (ex,) = spy
        await ex.trace.reached(Phase.ACCEPTED)
        await h.emulator.wait_holding(1)
        accepted = (ex.releases, ex.held_bytes(), list(ex.trace.fired))
        h.emulator.release("out")
        answer = await asyncio.wait_for(asking, WAIT_S)
        await ex.trace.finished()
    assert chat_text(answer) == DEFAULT_TEXT
    releases, held, fired = accepted
    assert releases == 1
    if retries:
        # Accepted but gated: the untouched raw bytes stay, as the outbound body only,
        # and the held stream head (the role chunk) is counted on the response side.
        assert held.response > 0
        assert dataclasses.replace(held, response=0) == HeldBytes(
            raw=0, parsed=0, outbound=len(raw)
        )
        assert fired == []
    else:
        assert held == HeldBytes(0, 0, 0)
        assert fired == ["raw"]
    assert ex.trace.fired == ["raw"]


class Counting(FoldPlugin):
    """The fold plugin, recording the levels it was asked to prepare at."""

    def __init__(self) -> None:
        super().__init__()
        self.asked: list[int] = []

    async def prepare(self, ctx: PrepareContext) -> bool:
        self.asked.append(ctx.fold_level)
        return await super().prepare(ctx)


async def test_parsed_body_is_let_go_before_the_last_send(
    spy: Spy, http: aiohttp.ClientSession, monkeypatch: pytest.MonkeyPatch
) -> None:
    # max_refolds=1: after one refold no other can follow, so the raw holder and the
    # preparer must be gone before the second upload even starts.
    at_upload: list[tuple[Phase, int, HeldBytes, list[str], int]] = []
    chunks = Exchange.outbound_chunks

    async def watched_chunks(self: Exchange) -> AsyncIterator[memoryview]:
        assert isinstance(self, TracedExchange)
        out = self.outbound_holder
        owned = out.owned_bytes if isinstance(out, Splice) else -1
        fired = sorted(self.trace.fired)
        at_upload.append((self.phase, self.releases, self.held_bytes(), fired, owned))
        del out
        async for piece in chunks(self):
            yield piece

    monkeypatch.setattr(Exchange, "outbound_chunks", watched_chunks)
    fold = Counting()
    raw = encode(conversation(CHAT))
    async with proxy_with_emulator(plugins=[fold], max_refolds=1) as h:
        headers = {"x-emulator": f"overflow_above={OVERFLOW_ABOVE}"}
        async with http.post(h.url + CHAT, data=raw, headers=headers) as resp:
            assert chat_text(await resp.read()) == DEFAULT_TEXT
        (ex,) = spy
        await ex.trace.finished()
        second = h.emulator.stats[1]
    assert fold.asked == [0, 1]
    first_upload, second_upload = at_upload
    # The first send may still be refolded: everything is kept.
    assert first_upload == (
        Phase.SENT,
        0,
        HeldBytes(raw=len(raw), parsed=0, outbound=0),
        [],
        -1,
    )
    phase, releases, held, fired, owned = second_upload
    assert (phase, releases, fired) == (Phase.SENT, 1, ["raw"])
    # The refolded body is a splice over the raw buffer: its slices keep that one
    # buffer alive for this last send (counted as outbound), and no parsed tree
    # was ever built.
    assert 0 < owned < second.body_bytes < len(raw)
    assert held == HeldBytes(raw=0, parsed=0, outbound=len(raw) + owned)

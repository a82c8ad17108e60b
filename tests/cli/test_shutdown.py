"""Process shutdown (issue 5, item 6): drain, grace, in-band errors, exit code.

Two levels:

* in this process, with ``proxy_with_emulator``: ``POST /admin/shutdown``, then
  the drain runs in its own task while the test releases one stream; the
  streams still running after ``shutdown_grace`` are read by the real
  ``openai`` and ``anthropic`` SDKs, which must see a well-formed error;
* a real ``python -m proxy serve`` process in front of a real
  ``python -m proxy emulate`` process, stopped with SIGTERM.

Ordering uses the emulator's ``hold=KEY`` (released by the test), the first
event a client reads, and the processes' own log lines; the only wall-clock
waits are the grace periods under test, bounded by ``asyncio.timeout``.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import re
import signal
import time
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import anthropic
import openai
import pytest
from anthropic.types import MessageParam
from openai.types.chat import ChatCompletionUserMessageParam

from proxy import Plugin
from proxy._emulator import DEFAULT_TEXT
from proxy._plugins import ExchangeRecord, PrepareContext
from proxy.testing import proxy_with_emulator
from tests.support.e2e import request_body, sse_events, streamed_text
from tests.support.process import Proc

CHAT = "/v1/chat/completions"
RESPONSES = "/v1/responses"
MESSAGES = "/v1/messages"
BOUND_S = 5.0
#: The in-process grace period: long enough for a released stream to finish.
GRACE_S = 1.0
#: The subprocess grace period (the issue's command line).
PROCESS_GRACE_S = 2.0
#: How long after SIGTERM the process may take beyond its grace to exit 0.
EXIT_SLACK_S = 5.0
SHUTDOWN_MESSAGE = "proxy shutting down"
API_KEY = "sk-shutdown-test-KEY-0123456789"
PROMPT_MARKER = "PROMPT-MARKER-5eed"
#: The one user turn of every raw request: the marker must never reach a log line.
PROMPT = f"hi {PROMPT_MARKER}"

OAI_USER: list[ChatCompletionUserMessageParam] = [{"role": "user", "content": "hi"}]
ANT_USER: list[MessageParam] = [{"role": "user", "content": "hi"}]


class Recorder(Plugin):
    """Records commits, session closes and when ``shutdown`` (the flush) ran."""

    name = "recorder"

    def __init__(self) -> None:
        self.records: list[ExchangeRecord] = []
        self.closed: list[str] = []
        self.shutdowns = 0
        self.closed_before_shutdown: list[str] | None = None

    async def commit(self, record: ExchangeRecord) -> None:
        self.records.append(record)

    async def session_closed(self, session_id: str) -> None:
        self.closed.append(session_id)

    async def shutdown(self) -> None:
        self.shutdowns += 1
        self.closed_before_shutdown = list(self.closed)


async def stream_raw(
    http: aiohttp.ClientSession,
    url: str,
    body: dict[str, Any],
    headers: dict[str, str],
    started: asyncio.Event,
) -> tuple[int, bytes]:
    """POST and read a whole SSE answer; ``started`` is set after the first event."""
    async with http.post(url, json=body, headers=headers) as resp:
        raw = bytearray()
        async for line in resp.content:
            raw += line
            if line in (b"\n", b"\r\n"):
                started.set()
        return resp.status, bytes(raw)


# --------------------------------------------------------------------------- in process


async def test_drain_lets_streams_finish_then_cuts_them_with_sdk_readable_errors() -> None:
    """A stream released during the grace finishes intact; the three still running after it
    end with an in-band error each real SDK reports; sessions close, then plugins flush."""
    recorder = Recorder()
    tasks: list[asyncio.Task[Any]] = []
    async with proxy_with_emulator(plugins=[recorder], shutdown_grace=GRACE_S) as h:
        oai = openai.AsyncOpenAI(base_url=h.openai_base_url, api_key=API_KEY, max_retries=0)
        ant = anthropic.AsyncAnthropic(base_url=h.url, api_key=API_KEY, max_retries=0)
        started = {k: asyncio.Event() for k in ("chat", "responses", "messages", "finish")}

        async def chat() -> BaseException | None:
            stream = await oai.chat.completions.create(
                model="c",
                messages=OAI_USER,
                stream=True,
                extra_headers={"x-session-id": "s-chat", "x-emulator": "hold=cut-chat"},
            )
            try:
                async for _ in stream:
                    started["chat"].set()
            except openai.APIError as exc:
                return exc
            return None

        async def responses() -> list[Any]:
            # Held after output_item.added: the stream has reached the client by then.
            headers = {"session-id": "s-resp", "x-emulator": "hold=cut-resp; stall_after=3"}
            stream = await oai.responses.create(
                model="r", input="hi", stream=True, extra_headers=headers
            )
            seen = []
            async for event in stream:
                seen.append(event)
                started["responses"].set()
            return seen

        async def messages() -> BaseException | None:
            stream = await ant.messages.create(
                model="m",
                max_tokens=16,
                messages=ANT_USER,
                stream=True,
                extra_headers={
                    "x-claude-code-session-id": "s-msg",
                    "x-emulator": "hold=cut-msg",
                },
            )
            try:
                async for _ in stream:
                    started["messages"].set()
            except anthropic.APIStatusError as exc:
                return exc
            return None

        async with aiohttp.ClientSession() as http:
            finish_headers = {"x-session-id": "s-finish", "x-emulator": "hold=finish"}
            tasks = [
                asyncio.create_task(chat()),
                asyncio.create_task(responses()),
                asyncio.create_task(messages()),
                asyncio.create_task(
                    stream_raw(
                        http,
                        h.url + CHAT,
                        request_body(CHAT, "f", content=PROMPT),
                        finish_headers,
                        started["finish"],
                    )
                ),
            ]
            async with asyncio.timeout(BOUND_S):
                await asyncio.gather(*(event.wait() for event in started.values()))

            async with http.post(h.url + "/admin/shutdown") as resp:
                assert resp.status == 202
            async with http.get(h.url + "/readyz") as resp:
                assert resp.status == 503
            async with http.post(
                h.url + CHAT, json=request_body(CHAT, "late", content=PROMPT)
            ) as resp:
                assert resp.status == 503
                assert "Retry-After" in resp.headers
                assert resp.headers["Connection"].lower() == "close"

            # The drain runs in its own task, so this one can release a stream meanwhile.
            t0 = time.monotonic()
            drain = asyncio.create_task(h.stop())
            h.emulator.release("finish")
            try:
                async with asyncio.timeout(GRACE_S + BOUND_S):
                    chat_error, resp_events, msg_error, finished = await asyncio.gather(*tasks)
                    await drain
            finally:
                for task in tasks:
                    task.cancel()
            elapsed = time.monotonic() - t0

    # The released stream finished intact inside the grace period.
    status, raw = finished
    assert status == 200
    events = sse_events(raw)
    assert events[-1] == (None, "[DONE]") and streamed_text(CHAT, events) == DEFAULT_TEXT
    # The others were cut after the grace, each with an error its SDK understands.
    assert GRACE_S <= elapsed < GRACE_S + BOUND_S
    assert isinstance(chat_error, openai.APIError)
    assert SHUTDOWN_MESSAGE in chat_error.message
    assert chat_error.code == "proxy_shutdown"
    assert resp_events[-1].type == "error"
    assert resp_events[-1].message == SHUTDOWN_MESSAGE
    assert resp_events[-1].code == "proxy_shutdown"
    assert [e.type for e in resp_events[:3]] == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
    ]
    assert isinstance(msg_error, anthropic.APIStatusError)
    assert isinstance(msg_error.body, dict)
    assert msg_error.body["error"] == {"type": "api_error", "message": SHUTDOWN_MESSAGE}
    # Their upstream requests were aborted, not left running.
    for record in h.emulator.stats:
        if record.model in ("c", "r", "m"):
            assert record.aborted_by_peer, record.model
        else:
            assert record.model == "f" and record.finished
    # Bookkeeping: every exchange committed, every session closed, then the flush.
    outcomes = {r.model: r.outcome for r in recorder.records if r.model != "late"}
    assert outcomes == {"c": "cancelled", "r": "cancelled", "m": "cancelled", "f": "ok"}
    assert sorted(recorder.closed) == ["s-chat", "s-finish", "s-msg", "s-resp"]
    assert recorder.shutdowns == 1
    assert recorder.closed_before_shutdown is not None
    assert sorted(recorder.closed_before_shutdown) == sorted(recorder.closed)
    assert h.state.registry.session_count == 0


class StuckPrepare(Plugin):
    """A prepare hook that never returns for model ``stuck`` (until cancelled)."""

    name = "stuck"

    def __init__(self) -> None:
        self.entered = asyncio.Event()

    async def prepare(self, ctx: PrepareContext) -> bool:
        if ctx.meta.model == "stuck":
            self.entered.set()
            await asyncio.Event().wait()
        return False


async def test_drain_answers_exchanges_not_yet_streaming_with_503() -> None:
    """Exchanges cut by the drain before any answer byte (in prepare, or held back before
    the first output event) get a 503 with Retry-After, not a dropped connection."""
    stuck = StuckPrepare()
    # plugin_timeout outlasts the grace: the drain, not the hook budget, ends the prepare.
    async with (
        proxy_with_emulator(plugins=[stuck], shutdown_grace=GRACE_S, plugin_timeout=30) as h,
        aiohttp.ClientSession() as http,
    ):
        in_prepare = asyncio.create_task(
            http.post(
                h.url + CHAT,
                json=request_body(CHAT, "stuck", content=PROMPT),
                headers={"x-session-id": "p"},
            )
        )
        # A Responses stream is held back until its first output event (a refold
        # could still replace it); the emulator holds it before that.
        gated = asyncio.create_task(
            http.post(
                h.url + RESPONSES,
                json=request_body(RESPONSES, "gated", content=PROMPT),
                headers={"x-emulator": "hold=gated; stall_after=1"},
            )
        )
        try:
            async with asyncio.timeout(BOUND_S):
                await stuck.entered.wait()
            await h.emulator.wait_holding(1)
            async with http.post(h.url + "/admin/shutdown") as resp:
                assert resp.status == 202
            drain = asyncio.create_task(h.stop())
            async with asyncio.timeout(GRACE_S + BOUND_S):
                answers = [await in_prepare, await gated]
                bodies = [await answer.json() for answer in answers]
                await drain
        finally:
            in_prepare.cancel()
            gated.cancel()
    for answer, body in zip(answers, bodies, strict=True):
        assert answer.status == 503
        assert int(answer.headers["Retry-After"]) >= 0
        assert body["error"]["message"] == SHUTDOWN_MESSAGE
        assert body["error"]["type"] == "server_error"
    # Both refusals say the proxy stopped on purpose, in the OpenAI code or the message.
    assert bodies[1]["error"]["code"] == "proxy_shutdown"
    assert h.emulator.record(1).model == "gated"
    assert h.emulator.record(1).aborted_by_peer
    assert len(h.emulator.stats) == 1, "the stuck request must never reach the upstream"


# --------------------------------------------------------------------------- real processes


@pytest.fixture
async def emulator_process() -> AsyncIterator[tuple[Proc, str]]:
    proc = await Proc.start("emulator", "emulate", "--port", "0")
    try:
        match = await proc.wait_line(r"listening on (http://\S+)", within=20)
        yield proc, match.group(1)
    finally:
        if proc.proc.returncode is None:
            proc.proc.send_signal(signal.SIGTERM)
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(BOUND_S):
                    await proc.proc.wait()
        await proc.stop()


async def start_proxy(upstream: str, grace: float) -> tuple[Proc, str]:
    """``python -m proxy serve`` on an ephemeral port in front of ``upstream``; its base URL."""
    proxy, port = await Proc.serve(upstream, grace=grace, quiet=False, within=20)
    return proxy, f"http://127.0.0.1:{port}"


# Runs two Python processes and waits out a 2 s grace period: about 4 s in all.
@pytest.mark.timeout(60)
async def test_sigterm_drains_a_real_serve_process(
    emulator_process: tuple[Proc, str],
) -> None:
    """SIGTERM to ``python -m proxy serve`` with three streams in flight: readiness and new
    requests 503 at once, two released streams finish intact, the third ends with a
    Responses error event after the grace, exit status 0 within grace + a few seconds."""
    _, upstream = emulator_process
    proxy, base = await start_proxy(upstream, PROCESS_GRACE_S)
    tasks: list[asyncio.Task[tuple[int, bytes]]] = []
    try:
        auth = {"Authorization": f"Bearer {API_KEY}"}
        plan = [
            (CHAT, "hold=sig-chat"),  # released during the grace: finishes
            (MESSAGES, "hold=sig-msg"),  # released during the grace: finishes
            (RESPONSES, "hold=sig-resp; stall_after=3"),  # never released: cut
        ]
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=30)) as http:
            started = [asyncio.Event() for _ in plan]
            tasks = [
                asyncio.create_task(
                    stream_raw(
                        http,
                        base + path,
                        request_body(path, f"model-{i}", content=PROMPT),
                        {**auth, "x-session-id": f"sig-{i}", "x-emulator": script},
                        started[i],
                    )
                )
                for i, (path, script) in enumerate(plan)
            ]
            async with asyncio.timeout(BOUND_S):
                await asyncio.gather(*(event.wait() for event in started))
            async with http.get(base + "/readyz") as resp:
                assert resp.status == 200

            proxy.proc.send_signal(signal.SIGTERM)
            t0 = time.monotonic()
            await proxy.wait_line(r"shutting down: readiness is now 503")
            async with http.get(base + "/readyz") as resp:
                assert resp.status == 503
            async with http.post(
                base + CHAT, json=request_body(CHAT, "late", content=PROMPT), headers=auth
            ) as resp:
                assert resp.status == 503
                assert int(resp.headers["Retry-After"]) >= 0
                assert resp.headers["Connection"].lower() == "close"
                refusal = (await resp.json())["error"]
                assert "shutting down" in refusal["message"]
                assert refusal["code"] == "proxy_shutdown"
            for key in ("sig-chat", "sig-msg"):
                async with http.post(f"{upstream}/_emulator/release/{key}") as resp:
                    assert resp.status == 200

            async with asyncio.timeout(PROCESS_GRACE_S + EXIT_SLACK_S):
                results = await asyncio.gather(*tasks)
                code = await proxy.proc.wait()
            exited_after = time.monotonic() - t0
            async with http.get(f"{upstream}/_emulator/stats") as resp:
                upstream_records = {r["model"]: r for r in (await resp.json())["requests"]}
    finally:
        for task in tasks:
            task.cancel()
        await proxy.stop()

    assert code == 0, proxy.output
    assert exited_after < PROCESS_GRACE_S + EXIT_SLACK_S
    (chat_status, chat_raw), (msg_status, msg_raw), (resp_status, resp_raw) = results
    # Streams that finished within the grace arrived intact.
    assert chat_status == 200
    chat_events = sse_events(chat_raw)
    assert chat_events[-1] == (None, "[DONE]")
    assert streamed_text(CHAT, chat_events) == DEFAULT_TEXT
    assert msg_status == 200
    msg_events = sse_events(msg_raw)
    assert msg_events[-1][0] == "message_stop"
    assert streamed_text(MESSAGES, msg_events) == DEFAULT_TEXT
    # The one still running at the end of the grace ends with a Responses error event.
    assert resp_status == 200
    resp_events = sse_events(resp_raw)
    assert [name for name, _ in resp_events] == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "error",
    ]
    error = json.loads(resp_events[-1][1])
    assert error["type"] == "error" and error["message"] == SHUTDOWN_MESSAGE
    assert error["code"] == "proxy_shutdown" and "sequence_number" in error
    assert upstream_records["model-0"]["finished"]
    assert upstream_records["model-1"]["finished"]
    assert upstream_records["model-2"]["aborted_by_peer"]
    assert "late" not in upstream_records
    # The late request's refusal is logged and counted like any refusal.
    assert re.search(
        r"method=POST route=/v1/chat/completions status=503 outcome=rejected", proxy.output
    ), proxy.output
    # Neither the key nor the prompt ever reached the log; nothing crashed.
    assert API_KEY not in proxy.output
    assert PROMPT_MARKER not in proxy.output
    assert "Traceback" not in proxy.output


# Two Python processes per case and a 0.5 s grace: about 2 s per case.
@pytest.mark.timeout(60)
@pytest.mark.parametrize("trigger", ["SIGINT", "POST /admin/shutdown"])
async def test_sigint_and_admin_shutdown_stop_a_real_process_too(
    emulator_process: tuple[Proc, str], trigger: str
) -> None:
    """SIGINT and POST /admin/shutdown drain and exit 0 like SIGTERM does."""
    _, upstream = emulator_process
    grace = 0.5
    proxy, base = await start_proxy(upstream, grace)
    started = asyncio.Event()
    task: asyncio.Task[tuple[int, bytes]] | None = None
    try:
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=30)) as http:
            headers = {"x-emulator": "hold=never"}
            task = asyncio.create_task(
                stream_raw(
                    http,
                    base + MESSAGES,
                    request_body(MESSAGES, "m", content=PROMPT),
                    headers,
                    started,
                )
            )
            async with asyncio.timeout(BOUND_S):
                await started.wait()
            if trigger == "SIGINT":
                proxy.proc.send_signal(signal.SIGINT)
            else:
                async with http.post(base + "/admin/shutdown") as resp:
                    assert resp.status == 202
            await proxy.wait_line(r"shutting down: readiness is now 503")
            async with asyncio.timeout(grace + EXIT_SLACK_S):
                status, raw = await task
                code = await proxy.proc.wait()
    finally:
        if task is not None:
            task.cancel()
        await proxy.stop()
    assert code == 0, proxy.output
    assert "Traceback" not in proxy.output
    assert status == 200
    name, data = sse_events(raw)[-1]
    assert name == "error"
    assert json.loads(data) == {
        "type": "error",
        "error": {"type": "api_error", "message": SHUTDOWN_MESSAGE},
    }

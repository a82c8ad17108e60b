"""End to end: the ledger and usage plugins behind a real proxy (issue 6, bookkeeping).

The hash gate and the start-up errors run the proxy as a real child process
(``python -m proxy serve``) in front of an in-process emulator, because what
they promise (flush on SIGTERM, digests surviving a restart, one clear line
for a bad database) only exists in a process. The rest runs the proxy in
process with :func:`proxy.testing.proxy_with_emulator`.
"""

from __future__ import annotations

import asyncio
import json
import logging
import sqlite3
from pathlib import Path
from typing import Any, Final

import aiohttp
import anthropic
import openai
import pytest
import xxhash
from click.testing import CliRunner
from prometheus_client.parser import text_string_to_metric_families

from plugins.ledger import LedgerPlugin
from plugins.usage import UsagePlugin
from proxy import ExchangeRecord, Outcome, Plugin, PrepareContext, WireMetadata
from proxy._cli import main as cli_main
from proxy._emulator import DEFAULT_TEXT, EmulatorServer
from proxy._logs import ACCESS_LOG
from proxy.testing import ProxyProcess, ProxyStartError, proxy_process, proxy_with_emulator

SECRET: Final = "sk-bookkeeping-0c7e1d5a9b3f42e8a6d0c4b2f1e9a7d3"
CHAT: Final = "/v1/chat/completions"
MESSAGES: Final = "/v1/messages"
NEVER: Final = 3600.0  # a debounce (seconds) no test outlives: only explicit flushes write

# A conversation in OpenAI chat shape, and the same with an image added to its history.
HISTORY_A: Final[dict[str, Any]] = {
    "model": "gate-gpt",
    "messages": [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "first question"},
        {"role": "assistant", "content": "first answer"},
        {"role": "user", "content": "second question"},
    ],
}
HISTORY_A_IMAGE: Final[dict[str, Any]] = {
    **HISTORY_A,
    "messages": [
        *HISTORY_A["messages"],
        {"role": "assistant", "content": "second answer"},
        {
            "role": "user",
            "content": [
                {"type": "text", "text": "and this picture?"},
                {"type": "image_url", "image_url": {"url": "data:image/png;base64,iVBORw0KGgo="}},
            ],
        },
    ],
}
# The same for Anthropic messages.
HISTORY_B: Final[dict[str, Any]] = {
    "model": "gate-claude",
    "max_tokens": 64,
    "messages": [{"role": "user", "content": "describe the plan"}],
}
HISTORY_B_IMAGE: Final[dict[str, Any]] = {
    **HISTORY_B,
    "messages": [
        *HISTORY_B["messages"],
        {"role": "assistant", "content": "the plan is simple"},
        {
            "role": "user",
            "content": [
                {"type": "text", "text": "and this diagram?"},
                {
                    "type": "image",
                    "source": {"type": "base64", "media_type": "image/png", "data": "iVBORw0KGgo="},
                },
            ],
        },
    ],
}


def compact(body: dict[str, Any]) -> bytes:
    return json.dumps(body, separators=(",", ":")).encode()


def indented(body: dict[str, Any], indent: int) -> bytes:
    """The same JSON value as :func:`compact`, formatted differently (a reformat)."""
    return json.dumps(body, indent=indent).encode()


def digest12(body: bytes) -> str:
    """What the ledger's admin view shows: the first 12 hex digits of the wire digest."""
    return xxhash.xxh3_128_hexdigest(body)[:12]


def session_headers(path: str, sid: str) -> dict[str, str]:
    """Credentials and session header as each protocol's client sends them."""
    if path == MESSAGES:
        return {
            "x-api-key": SECRET,
            "anthropic-version": "2023-06-01",
            "x-claude-code-session-id": sid,
            "content-type": "application/json",
        }
    return {
        "authorization": f"Bearer {SECRET}",
        "x-session-id": sid,
        "content-type": "application/json",
    }


async def post(http: aiohttp.ClientSession, base: str, path: str, sid: str, body: bytes) -> None:
    async with http.post(base + path, data=body, headers=session_headers(path, sid)) as resp:
        text = await resp.text()
        assert resp.status == 200, text
        assert DEFAULT_TEXT in text


async def ledger_view(proxy: ProxyProcess, sid: str) -> dict[str, Any]:
    view = await proxy.session_view(sid)
    assert view is not None
    ledger: dict[str, Any] = view["plugins"]["ledger"]
    return ledger


def expect(
    body: bytes, comparable: bool, epoch: int, dirty: bool, requests: int
) -> tuple[str, bool, int, bool, int]:
    """The gate state a session should show after its last request carried ``body``."""
    return digest12(body), comparable, epoch, dirty, requests


def gate(ledger: dict[str, Any]) -> tuple[str, bool, int, bool, int]:
    """``(digest, comparable, revision_epoch, dirty, requests)`` from the ledger's view."""
    return (
        ledger["digest"],
        ledger["comparable"],
        ledger["revision_epoch"],
        ledger["dirty"],
        ledger["requests"],
    )


def saved_rows(db: Path) -> dict[str, tuple[str, int, int, int, int]]:
    """``{session: (digest, comparable, revision_epoch, dirty, requests)}`` as on disk."""
    conn = sqlite3.connect(f"file:{db}?mode=ro", uri=True)
    try:
        rows = conn.execute(
            "SELECT session_id, digest, comparable, revision_epoch, dirty, requests FROM sessions"
        ).fetchall()
    finally:
        conn.close()
    return {row[0]: tuple(row[1:]) for row in rows}


def write_config(path: Path, emulator: EmulatorServer, db: Path, **ledger: Any) -> Path:
    """A TOML settings file: ledger + usage in front of ``emulator``."""
    options = {"path": str(db), "debounce": NEVER, **ledger}
    lines = [
        'plugins = ["ledger", "usage"]',
        "shutdown_grace = 5.0",
        f"upstream_openai = {json.dumps(emulator.url)}",
        f"upstream_anthropic = {json.dumps(emulator.url)}",
        "",
        "[plugin.ledger]",
        *(f"{key} = {json.dumps(value)}" for key, value in options.items()),
    ]
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return path


# -- the hash gate across a restart ------------------------------------------------------------


async def test_hash_gate_every_branch_survives_a_restart(
    tmp_path: Path, emulator: EmulatorServer
) -> None:
    db = tmp_path / "ledger.db"
    config = write_config(tmp_path / "proxy.toml", emulator, db)
    a_compact, a_indent2 = compact(HISTORY_A), indented(HISTORY_A, 2)
    a_indent4 = indented(HISTORY_A, 4)
    a_image = compact(HISTORY_A_IMAGE)
    b_compact, b_image = compact(HISTORY_B), compact(HISTORY_B_IMAGE)
    assert len({a_compact, a_indent2, a_indent4}) == 3  # three spellings of one history

    async with aiohttp.ClientSession() as http:
        async with proxy_process(config=config) as proxy:
            base = proxy.url
            # First request of a session: saved, epoch 0, clean.
            await post(http, base, CHAT, "alpha", a_compact)
            assert gate(await ledger_view(proxy, "alpha")) == expect(a_compact, True, 0, False, 1)
            # Identical retry: nothing moves but the request count.
            await post(http, base, CHAT, "alpha", a_compact)
            assert gate(await ledger_view(proxy, "alpha")) == expect(a_compact, True, 0, False, 2)
            # Reformat: new digest saved, same verdict, still clean.
            await post(http, base, CHAT, "alpha", a_indent2)
            assert gate(await ledger_view(proxy, "alpha")) == expect(a_indent2, True, 0, False, 3)
            # Verdict flip (an image joined the history): epoch + 1, dirty.
            await post(http, base, MESSAGES, "beta", b_compact)
            await post(http, base, MESSAGES, "beta", b_image)
            beta = await ledger_view(proxy, "beta")
            assert gate(beta) == expect(b_image, False, 1, True, 2)
            assert beta["saved"] is False
            # The debounce is an hour: nothing is on disk before shutdown.
            assert saved_rows(db) == {}
            assert await proxy.stop() == 0

        # SIGTERM flushed both sessions, full digests included.
        assert saved_rows(db) == {
            "alpha": (xxhash.xxh3_128_hexdigest(a_indent2), 1, 0, 0, 3),
            "beta": (xxhash.xxh3_128_hexdigest(b_image), 0, 1, 1, 2),
        }
        assert "0 session(s) loaded" in proxy.output

        async with proxy_process(config=config) as proxy:
            base = proxy.url
            assert "2 session(s) loaded" in proxy.output
            # The saved digest is met again: an identical retry, not a first request.
            await post(http, base, CHAT, "alpha", a_indent2)
            assert gate(await ledger_view(proxy, "alpha")) == expect(a_indent2, True, 0, False, 4)
            # A dirty session stays dirty at its epoch.
            await post(http, base, MESSAGES, "beta", b_image)
            assert gate(await ledger_view(proxy, "beta")) == expect(b_image, False, 1, True, 3)
            # The saved verdict still gates: a reformat stays clean, a flip bumps the epoch.
            await post(http, base, CHAT, "alpha", a_indent4)
            assert gate(await ledger_view(proxy, "alpha")) == expect(a_indent4, True, 0, False, 5)
            await post(http, base, CHAT, "alpha", a_image)
            assert gate(await ledger_view(proxy, "alpha")) == expect(a_image, False, 1, True, 6)
            assert await proxy.stop() == 0

    assert saved_rows(db)["alpha"] == (xxhash.xxh3_128_hexdigest(a_image), 0, 1, 1, 6)
    assert SECRET not in proxy.output


@pytest.mark.parametrize("problem", ["corrupt", "locked"])
async def test_a_bad_ledger_database_stops_the_start_with_one_clear_line(
    tmp_path: Path, emulator: EmulatorServer, problem: str
) -> None:
    db = tmp_path / "ledger.db"
    config = write_config(tmp_path / "proxy.toml", emulator, db, lock_timeout=0.1)
    blocker: sqlite3.Connection | None = None
    if problem == "corrupt":
        garbage = b"not a database, just bytes\n" * 100
        db.write_bytes(garbage)
    else:
        blocker = sqlite3.connect(db, isolation_level=None)
        blocker.execute("CREATE TABLE other (x)")
        blocker.execute("BEGIN EXCLUSIVE")
    try:
        with pytest.raises(ProxyStartError) as failure:
            async with proxy_process(config=config):
                pytest.fail("the proxy started on a bad ledger database")
    finally:
        if blocker is not None:
            blocker.execute("ROLLBACK")
            blocker.close()
    error = failure.value
    assert error.returncode == 1
    expected = "is corrupt" if problem == "corrupt" else "is locked"
    assert f"Error: plugin ledger: startup failed: ledger database {db} {expected}" in error.output
    assert "Traceback" not in error.output
    assert "Unclosed" not in error.output  # nothing left open behind the refusal
    if problem == "corrupt":
        assert db.read_bytes() == garbage  # reported, never reset


# -- `context-proxy sessions` against a running proxy ---------------------------------------


async def test_sessions_command_prints_each_plugins_state(
    tmp_path: Path, emulator: EmulatorServer
) -> None:
    config = write_config(tmp_path / "proxy.toml", emulator, tmp_path / "ledger.db")
    runner = CliRunner()
    async with aiohttp.ClientSession() as http, proxy_process(config=config) as proxy:
        empty = await asyncio.to_thread(runner.invoke, cli_main, ["sessions", "--url", proxy.url])
        assert empty.exit_code == 0, empty.output
        assert empty.output == "no sessions\n"

        await post(http, proxy.url, CHAT, "alpha", compact(HISTORY_A))
        await post(http, proxy.url, MESSAGES, "beta", compact(HISTORY_B))
        await post(http, proxy.url, MESSAGES, "beta", compact(HISTORY_B_IMAGE))
        views = {sid: await proxy.session_view(sid) for sid in ("alpha", "beta")}

        result = await asyncio.to_thread(runner.invoke, cli_main, ["sessions", "--url", proxy.url])
        assert result.exit_code == 0, result.output
        as_json = await asyncio.to_thread(
            runner.invoke, cli_main, ["sessions", "--url", proxy.url, "--json"]
        )
        assert as_json.exit_code == 0, as_json.output

    # --json: each session exactly as the admin API describes it.
    listed = {entry["id"]: entry for entry in json.loads(as_json.output)["sessions"]}
    assert listed.keys() == {"alpha", "beta"}
    for sid, view in views.items():
        assert view is not None
        entry = listed[sid]
        assert entry["requests"] == view["requests"]
        for plugin in ("ledger", "usage"):
            for key, value in view["plugins"][plugin].items():
                if key != "last_activity":  # moves with every read
                    assert entry["plugins"][plugin][key] == value, (sid, plugin, key)
    assert listed["beta"]["plugins"]["ledger"]["revision_epoch"] == 1
    assert listed["beta"]["plugins"]["ledger"]["dirty"] is True
    assert listed["alpha"]["plugins"]["ledger"]["digest"] == digest12(compact(HISTORY_A))
    assert listed["alpha"]["plugins"]["usage"]["input_tokens"] == len(compact(HISTORY_A)) // 4

    # The table fits 80 columns; a row per session, its plugins' state in the last column.
    lines = result.output.rstrip("\n").split("\n")
    assert all(len(line) <= 80 for line in lines), result.output
    assert lines[0].split() == ["id", "in_flight", "requests", "active", "state", "plugins"]
    starts = {line.split()[0]: n for n, line in enumerate(lines[1:], 1) if not line.startswith(" ")}
    assert starts.keys() == {"alpha", "beta"}
    beta = " ".join(
        lines[starts["beta"] :]
        if starts["beta"] > starts["alpha"]
        else lines[starts["beta"] : starts["alpha"]]
    )
    assert "ledger:" in beta and "revision_epoch=1" in beta and "dirty=yes" in beta


# -- debounce ----------------------------------------------------------------------------------


async def test_a_burst_of_one_session_costs_one_database_write(tmp_path: Path) -> None:
    db = tmp_path / "ledger.db"
    ledger = LedgerPlugin(path=str(db), debounce=NEVER)
    bodies = [
        compact({**HISTORY_A, "messages": [{"role": "user", "content": f"question {n}"}]})
        for n in range(100)
    ]
    async with proxy_with_emulator(plugins=[ledger]) as h, aiohttp.ClientSession() as http:
        for body in bodies:  # 100 gate changes (each a new digest) inside one debounce window
            await post(http, h.url, CHAT, "burst", body)
        await h.settle()
        assert ledger.writes == 0
        assert ledger.flush_scheduled
        state = ledger.session_state("burst")
        assert (state["requests"], state["saved"]) == (100, False)
    # Leaving the block drains the proxy: session close and shutdown flush once.
    assert ledger.writes == 1
    assert ledger.write_errors == 0
    assert saved_rows(db) == {"burst": (xxhash.xxh3_128_hexdigest(bodies[-1]), 1, 0, 0, 100)}


async def test_closing_a_session_writes_it_at_once(tmp_path: Path) -> None:
    db = tmp_path / "ledger.db"
    ledger = LedgerPlugin(path=str(db), debounce=NEVER)
    body = compact(HISTORY_A)
    async with proxy_with_emulator(plugins=[ledger]) as h, aiohttp.ClientSession() as http:
        await post(http, h.url, CHAT, "closing", body)
        await post(http, h.url, CHAT, "staying", body)
        await h.settle()
        assert saved_rows(db) == {}
        async with http.delete(f"{h.url}/admin/sessions/closing") as resp:
            assert resp.status == 200, await resp.text()
        # Written before the DELETE answered, while the proxy runs on.
        assert saved_rows(db) == {"closing": (xxhash.xxh3_128_hexdigest(body), 1, 0, 0, 1)}
        assert ledger.writes == 1
        assert ledger.session_state("staying")["saved"] is False
    assert set(saved_rows(db)) == {"closing", "staying"}


# -- usage: totals equal what the SDK saw ------------------------------------------------------

Usage = tuple[int, int, int]  # (input tokens incl. cached, output tokens, cache-read tokens)
HEADERS: Final = {"x-session-id": "u1", "x-emulator": "chunks=4; cache_read=3"}
PROMPT: Final = "count my tokens, please"


async def anthropic_usage(base_url: str, stream: bool, model: str) -> Usage:
    """One Messages request with the ``anthropic`` SDK; its usage as the proxy counts it.

    Anthropic's ``input_tokens`` leaves out cached tokens, OpenAI's include
    them; the proxy counts the whole prompt (``proxy._protocols.UsageMeter``),
    so the SDK's figures are summed the same way here.
    """
    claude = anthropic.AsyncAnthropic(base_url=base_url, api_key=SECRET, default_headers=HEADERS)
    messages: list[anthropic.types.MessageParam] = [{"role": "user", "content": PROMPT}]
    if stream:
        async with claude.messages.stream(model=model, max_tokens=64, messages=messages) as events:
            usage = (await events.get_final_message()).usage
    else:
        usage = (await claude.messages.create(model=model, max_tokens=64, messages=messages)).usage
    cached = usage.cache_read_input_tokens or 0
    prompt_total = usage.input_tokens + cached + (usage.cache_creation_input_tokens or 0)
    return prompt_total, usage.output_tokens, cached


async def chat_usage(base_url: str, stream: bool, model: str) -> Usage:
    """One chat completion with the ``openai`` SDK (usage chunk requested when streaming)."""
    client = openai.AsyncOpenAI(base_url=f"{base_url}/v1", api_key=SECRET, default_headers=HEADERS)
    messages: list[openai.types.chat.ChatCompletionMessageParam] = [
        {"role": "user", "content": PROMPT}
    ]
    usage: openai.types.CompletionUsage | None = None
    if stream:
        chunks = await client.chat.completions.create(
            model=model, messages=messages, stream=True, stream_options={"include_usage": True}
        )
        async for chunk in chunks:
            usage = chunk.usage or usage
    else:
        usage = (await client.chat.completions.create(model=model, messages=messages)).usage
    assert usage is not None and usage.prompt_tokens_details is not None
    cached = usage.prompt_tokens_details.cached_tokens or 0
    return usage.prompt_tokens, usage.completion_tokens, cached


async def responses_usage(base_url: str, stream: bool, model: str) -> Usage:
    """One Responses request with the ``openai`` SDK; the usage of its final response."""
    client = openai.AsyncOpenAI(base_url=f"{base_url}/v1", api_key=SECRET, default_headers=HEADERS)
    response: openai.types.responses.Response | None = None
    if stream:
        events = await client.responses.create(model=model, input=PROMPT, stream=True)
        async for event in events:
            if event.type == "response.completed":
                response = event.response
    else:
        response = await client.responses.create(model=model, input=PROMPT)
    assert response is not None and response.usage is not None
    usage = response.usage
    return usage.input_tokens, usage.output_tokens, usage.input_tokens_details.cached_tokens


SDK_CALLS: Final = {
    "openai-chat": chat_usage,
    "openai-responses": responses_usage,
    "anthropic-messages": anthropic_usage,
}


@pytest.mark.parametrize("stream", [False, True], ids=["json", "sse"])
@pytest.mark.parametrize("protocol", ["openai-chat", "openai-responses", "anthropic-messages"])
async def test_usage_totals_equal_what_the_sdk_reports(protocol: str, stream: bool) -> None:
    usage = UsagePlugin()
    model = f"usage-{protocol}-{'sse' if stream else 'json'}"
    async with proxy_with_emulator(plugins=[usage]) as h:
        first = await SDK_CALLS[protocol](h.url, stream, model)
        second = await SDK_CALLS[protocol](h.url, stream, model)
        await h.settle()
        async with aiohttp.ClientSession() as http, http.get(f"{h.url}/metrics") as resp:
            exposition = await resp.text()
        view = await h.session_view("u1")

    # The emulator's figures are deterministic: prompt = body bytes // 4 (+ the cache
    # read for Anthropic's total), output = one token per text delta.
    bodies = [record.body_bytes for record in h.emulator.stats]
    extra = 3 if protocol == "anthropic-messages" else 0
    assert [first, second] == [(size // 4 + extra, 4, 3) for size in bodies]

    totals = tuple(a + b for a, b in zip(first, second, strict=True))
    labels = {"protocol": protocol, "model": model}
    scraped = {
        sample.name: sample.value
        for family in text_string_to_metric_families(exposition)
        for sample in family.samples
        if sample.labels == labels
    }
    assert scraped == {
        "context_proxy_input_tokens_total": totals[0],
        "context_proxy_output_tokens_total": totals[1],
        "context_proxy_cache_read_tokens_total": totals[2],
        "context_proxy_cache_write_tokens_total": 0,
        # Each exchange's cached share of its input tokens, observed once per exchange.
        "context_proxy_cached_input_share_count": 2,
        "context_proxy_cached_input_share_sum": pytest.approx(
            first[2] / first[0] + second[2] / second[0]
        ),
    }
    assert view is not None
    assert view["plugins"]["usage"] == {
        "input_tokens": totals[0],
        "output_tokens": totals[1],
        "cache_read_tokens": totals[2],
        "cache_write_tokens": 0,
        "cache_write_5m_tokens": 0,
        "cache_write_1h_tokens": 0,
        "cached_input_share": totals[2] / totals[0],
        "requests": 2,
    }


# -- a failing plugin costs nothing to the client or to the other plugins -----------------------


class Raises(Plugin):
    """Its commit always raises."""

    name = "raises"

    async def commit(self, record: ExchangeRecord) -> None:
        raise RuntimeError("bookkeeping bug")


class Hangs(Plugin):
    """Its commit never returns on its own (the host's time budget ends it)."""

    name = "hangs"

    async def commit(self, record: ExchangeRecord) -> None:
        await asyncio.Event().wait()


class Records(Plugin):
    """Keeps ``(session, status, outcome, output tokens)`` of each commit."""

    name = "records"

    def __init__(self) -> None:
        self.seen: list[tuple[str | None, int, Outcome, int | None]] = []

    async def commit(self, record: ExchangeRecord) -> None:
        self.seen.append((record.session_id, record.status, record.outcome, record.output_tokens))


@pytest.mark.parametrize("stream", [False, True], ids=["json", "sse"])
async def test_a_plugin_failing_in_commit_affects_neither_client_nor_later_plugins(
    stream: bool, caplog: pytest.LogCaptureFixture
) -> None:
    records, usage = Records(), UsagePlugin()
    caplog.set_level(logging.WARNING, logger="context_proxy.plugins")
    async with proxy_with_emulator(
        plugins=[Raises(), Hangs(), records, usage], plugin_timeout=0.2
    ) as h:
        client = openai.AsyncOpenAI(
            base_url=h.openai_base_url, api_key=SECRET, default_headers={"x-session-id": "f1"}
        )
        messages: list[openai.types.chat.ChatCompletionMessageParam] = [
            {"role": "user", "content": "hi"}
        ]
        for _ in range(2):
            if stream:
                chunks = await client.chat.completions.create(
                    model="m", messages=messages, stream=True
                )
                text = "".join(
                    [c.choices[0].delta.content or "" async for c in chunks if c.choices]
                )
            else:
                completion = await client.chat.completions.create(model="m", messages=messages)
                text = completion.choices[0].message.content or ""
            assert text == DEFAULT_TEXT
        await h.settle()
        view = await h.session_view("f1")
        failures = dict(h.state.host.failures)

    expected_output = 3 if not stream else None  # no usage chunk unless the client asks
    assert records.seen == [("f1", 200, "ok", expected_output)] * 2
    # The outcome is the public enum (a str enum, so the tuple above compares equal).
    assert [seen[2] for seen in records.seen] == [Outcome.OK, Outcome.OK]
    assert all(isinstance(seen[2], Outcome) for seen in records.seen)
    assert view is not None
    assert view["plugins"]["usage"]["requests"] == 2
    assert failures == {"raises": 2, "hangs": 2}
    messages_logged = [r.getMessage() for r in caplog.records]
    assert messages_logged.count("plugin raises: commit raised RuntimeError; skipped") == 2
    assert messages_logged.count("plugin hangs: commit exceeded its 0.2s budget; skipped") == 2


MODEL_SECRET: Final = "model-SECRET-b41f7e"
PROMPT_SECRET: Final = "prompt-SECRET-93c0d2"


class Quotes(Plugin):
    """Hooks that raise with request content in the message, as plugin bugs often do."""

    name = "quotes"

    def wants_body(self, meta: WireMetadata, fold_level: int) -> bool:
        return True

    async def prepare(self, ctx: PrepareContext) -> bool:
        assert ctx.body is not None
        raise KeyError(f"cannot fold {ctx.body['messages'][0]['content']!r}")

    async def commit(self, record: ExchangeRecord) -> None:
        raise ValueError(f"unknown model {record.model!r}")


async def test_a_failing_hook_is_logged_by_its_class_never_its_text(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Finding: a hook's exception text was logged (``commit raised ValueError: unknown
    model 'SECRET...'``), and at DEBUG its traceback, both quoting request content. Now
    the line names the plugin, the hook and the exception class only, at every level."""
    caplog.set_level(logging.DEBUG)
    async with proxy_with_emulator(plugins=[Quotes()]) as h:
        client = openai.AsyncOpenAI(base_url=h.openai_base_url, api_key=SECRET)
        completion = await client.chat.completions.create(
            model=MODEL_SECRET, messages=[{"role": "user", "content": PROMPT_SECRET}]
        )
        assert completion.choices[0].message.content == DEFAULT_TEXT
        await h.settle()
        failures = dict(h.state.host.failures)
    assert failures == {"quotes": 2}
    plugin_lines = [r.getMessage() for r in caplog.records if r.name == "context_proxy.plugins"]
    assert "plugin quotes: prepare raised KeyError; skipped" in plugin_lines
    assert "plugin quotes: commit raised ValueError; skipped" in plugin_lines
    formatter = logging.Formatter("%(levelname)s %(name)s: %(message)s")
    logged = "\n".join(formatter.format(r) for r in caplog.records)
    for secret in (PROMPT_SECRET, SECRET):
        assert secret not in logged
    # The model is an access-log field by design; no other line may quote it.
    elsewhere = "\n".join(formatter.format(r) for r in caplog.records if r.name != ACCESS_LOG.name)
    assert MODEL_SECRET not in elsewhere

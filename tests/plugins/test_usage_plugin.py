"""The usage plugin: token totals per session (admin view) and per model (Prometheus)."""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator
from typing import Any, Final

import aiohttp
import anthropic
import openai
import pytest
from aiohttp import web
from prometheus_client import CollectorRegistry, Counter, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from plugins.usage import UsagePlugin
from proxy import ExchangeRecord, Outcome, Scalar
from proxy._app import ProxyApp
from proxy.testing import make_record
from tests.support.ports import serve_app
from tests.support.upstream import proxy_app

#: Where these tests' records differ from ``make_record``'s: an Anthropic exchange
#: with cache reads, so every per-model token counter moves.
ANTHROPIC: Final[dict[str, Scalar]] = {
    "protocol": "anthropic",
    "path": "/v1/messages",
    "model": "claude-test",
    "input_tokens": 100,
    "output_tokens": 20,
    "cache_read_tokens": 7,
}


def anthropic_record(**overrides: Scalar) -> ExchangeRecord:
    """``make_record`` with the ``ANTHROPIC`` fields; keyword arguments replace fields."""
    return make_record(**{**ANTHROPIC, **overrides})


def sample(registry: CollectorRegistry, kind: str, protocol: str, model: str) -> float | None:
    return registry.get_sample_value(
        f"context_proxy_{kind}_tokens_total", {"protocol": protocol, "model": model}
    )


@pytest.fixture
async def registry_and_plugin() -> AsyncIterator[tuple[CollectorRegistry, UsagePlugin]]:
    registry = CollectorRegistry()
    plugin = UsagePlugin(registry=registry)
    await plugin.startup()
    yield registry, plugin
    await plugin.shutdown()


async def test_totals_per_session_and_per_model(
    registry_and_plugin: tuple[CollectorRegistry, UsagePlugin],
) -> None:
    registry, plugin = registry_and_plugin

    await plugin.commit(anthropic_record())
    await plugin.commit(anthropic_record(input_tokens=50, output_tokens=5, cache_read_tokens=None))
    await plugin.commit(
        anthropic_record(session_id="s2", model="other-model", protocol="openai_chat")
    )

    assert plugin.session_state("s1") == {
        "input_tokens": 150,
        "output_tokens": 25,
        "cache_read_tokens": 7,
        "cache_write_tokens": 0,
        "cache_write_5m_tokens": 0,
        "cache_write_1h_tokens": 0,
        "cached_input_share": 7 / 150,
        "requests": 2,
    }
    assert plugin.session_state("s2")["input_tokens"] == 100
    assert sample(registry, "input", "anthropic", "claude-test") == 150
    assert sample(registry, "output", "anthropic", "claude-test") == 25
    assert sample(registry, "cache_read", "anthropic", "claude-test") == 7
    assert sample(registry, "input", "openai_chat", "other-model") == 100
    assert sample(registry, "input", "openai_chat", "claude-test") is None


async def test_records_without_usage_or_session_count_where_they_can(
    registry_and_plugin: tuple[CollectorRegistry, UsagePlugin],
) -> None:
    registry, plugin = registry_and_plugin

    # The upstream reported no usage (e.g. the client hung up first): a request, no tokens.
    await plugin.commit(
        anthropic_record(
            outcome="client_gone", input_tokens=None, output_tokens=None, cache_read_tokens=None
        )
    )
    # No session: the metrics count it, no per-session state is created.
    await plugin.commit(anthropic_record(session_id=None, model=None))

    assert plugin.session_state("s1") == {
        "input_tokens": 0,
        "output_tokens": 0,
        "cache_read_tokens": 0,
        "cache_write_tokens": 0,
        "cache_write_5m_tokens": 0,
        "cache_write_1h_tokens": 0,
        "cached_input_share": None,
        "requests": 1,
    }
    assert sample(registry, "input", "anthropic", "claude-test") == 0
    assert sample(registry, "input", "anthropic", "unknown") == 100


async def test_a_refusal_for_a_closed_session_does_not_bring_its_totals_back(
    registry_and_plugin: tuple[CollectorRegistry, UsagePlugin],
) -> None:
    registry, plugin = registry_and_plugin
    await plugin.commit(anthropic_record())
    await plugin.session_closed("s1")
    # A late request for s1 is refused with 503 (the session is closed); the proxy
    # books it with the session id it carried, after the plugin forgot the session.
    await plugin.commit(
        anthropic_record(
            outcome=Outcome.REJECTED,
            status=503,
            error="session_closed",
            input_tokens=None,
            output_tokens=None,
            cache_read_tokens=None,
        )
    )
    assert plugin.session_state("s1") == {}
    # Other refusals of an open session still count as its requests.
    await plugin.commit(anthropic_record(session_id="s2", outcome=Outcome.REJECTED, error="busy"))
    assert plugin.session_state("s2")["requests"] == 1
    assert sample(registry, "input", "anthropic", "claude-test") == 200


async def test_the_app_registry_renders_the_plugin_as_a_collector() -> None:
    # What an app with its own registry does with a plugin built from the config
    # file (no registry option): register the plugin itself.
    app_registry = CollectorRegistry(auto_describe=True)
    plugin = UsagePlugin()
    app_registry.register(plugin)
    await plugin.commit(anthropic_record())
    text = generate_latest(app_registry).decode()
    assert (
        'context_proxy_input_tokens_total{model="claude-test",protocol="anthropic"} 100.0' in text
    )
    assert "# TYPE context_proxy_output_tokens_total counter" in text


async def test_apps_built_one_after_another_share_a_registry_without_clashing() -> None:
    registry = CollectorRegistry()
    for n in range(3):
        plugin = UsagePlugin(registry=registry)
        await plugin.startup()
        await plugin.commit(anthropic_record(input_tokens=10 * (n + 1)))
        assert sample(registry, "input", "anthropic", "claude-test") == 10 * (n + 1)
        await plugin.shutdown()
    assert sample(registry, "input", "anthropic", "claude-test") is None


async def test_two_live_plugins_on_one_registry_fail_clearly_at_startup() -> None:
    registry = CollectorRegistry()
    first = UsagePlugin(registry=registry)
    await first.startup()
    second = UsagePlugin(registry=registry)
    with pytest.raises(ValueError, match="context_proxy_input_tokens"):
        await second.startup()
    await first.shutdown()


async def test_a_foreign_collector_with_our_name_is_a_clear_error() -> None:
    registry = CollectorRegistry()
    Counter("context_proxy_input_tokens", "someone else's", registry=registry)
    with pytest.raises(ValueError, match="context_proxy_input_tokens"):
        await UsagePlugin(registry=registry).startup()


async def test_closed_sessions_are_forgotten_and_the_session_table_is_capped() -> None:
    plugin = UsagePlugin(max_sessions=2)

    await plugin.commit(anthropic_record(session_id="s1"))
    await plugin.commit(anthropic_record(session_id="s2"))
    await plugin.commit(anthropic_record(session_id="s1"))  # s1 is now the most recent
    await plugin.commit(anthropic_record(session_id="s3"))  # over the cap: s2 goes

    assert plugin.session_state("s2") == {}
    assert plugin.session_state("s1")["requests"] == 2
    await plugin.session_closed("s1")
    assert plugin.session_state("s1") == {}
    assert plugin.session_state("s3")["requests"] == 1
    # The per-model counters are not affected by forgetting sessions.
    families = {family.name: family for family in plugin.collect()}
    assert [s.value for s in families["context_proxy_input_tokens"].samples] == [400]


async def test_model_labels_are_capped_against_invented_model_names() -> None:
    plugin = UsagePlugin(max_models=3)
    for n in range(5):
        await plugin.commit(anthropic_record(model=f"model-{n}"))
    await plugin.commit(anthropic_record(model="model-0"))
    await plugin.commit(anthropic_record(model="m" * 10_000))

    families = {family.name: family for family in plugin.collect()}
    per_model = {s.labels["model"]: s.value for s in families["context_proxy_input_tokens"].samples}
    assert per_model == {"model-0": 200, "model-1": 100, "model-2": 100, "other": 300}
    assert plugin.model_label(None) == "unknown"


@pytest.mark.parametrize("option", ["max_sessions", "max_models"])
def test_bad_options_are_rejected(option: str) -> None:
    options: dict[str, Any] = {option: 0}
    with pytest.raises(ValueError, match=option):
        UsagePlugin(**options)


async def test_cache_reads_and_writes_are_counted_apart_with_the_ttl_split(
    registry_and_plugin: tuple[CollectorRegistry, UsagePlugin],
) -> None:
    registry, plugin = registry_and_plugin
    # Turn 1 writes the prefix to the cache (5m and 1h breakpoints); turn 2 reads it.
    await plugin.commit(
        anthropic_record(
            input_tokens=1000,
            cache_read_tokens=0,
            cache_write_tokens=900,
            cache_write_5m_tokens=600,
            cache_write_1h_tokens=300,
        )
    )
    await plugin.commit(anthropic_record(input_tokens=1000, cache_read_tokens=900))
    # An OpenAI exchange reports cached reads only; writes stay None and add nothing.
    await plugin.commit(
        anthropic_record(
            session_id="s2", protocol="openai_chat", input_tokens=400, cache_read_tokens=100
        )
    )

    state = plugin.session_state("s1")
    assert (state["cache_read_tokens"], state["cache_write_tokens"]) == (900, 900)
    assert (state["cache_write_5m_tokens"], state["cache_write_1h_tokens"]) == (600, 300)
    assert state["cached_input_share"] == 0.45
    assert plugin.session_state("s2")["cached_input_share"] == 0.25
    assert sample(registry, "cache_read", "anthropic", "claude-test") == 900
    assert sample(registry, "cache_write", "anthropic", "claude-test") == 900
    assert sample(registry, "cache_write", "openai_chat", "claude-test") == 0


async def test_the_cached_share_histogram_observes_each_exchange_by_model(
    registry_and_plugin: tuple[CollectorRegistry, UsagePlugin],
) -> None:
    registry, plugin = registry_and_plugin
    for cached in (0, 900, 950, 1000):
        await plugin.commit(anthropic_record(input_tokens=1000, cache_read_tokens=cached))
    # No input tokens reported: nothing to take a share of, not observed.
    await plugin.commit(anthropic_record(input_tokens=None, cache_read_tokens=None))

    labels = {"protocol": "anthropic", "model": "claude-test"}

    def bucket(le: str) -> float | None:
        return registry.get_sample_value(
            "context_proxy_cached_input_share_bucket", {**labels, "le": le}
        )

    assert registry.get_sample_value("context_proxy_cached_input_share_count", labels) == 4
    assert registry.get_sample_value("context_proxy_cached_input_share_sum", labels) == 2.85
    assert [bucket(le) for le in ("0.1", "0.85", "0.9", "0.95", "1.0", "+Inf")] == [
        1,
        1,
        2,
        3,
        4,
        4,
    ]


# -- through a real proxy, with the real SDKs, against an upstream reporting cache writes ------
#
# The emulator scripts cache reads only, so this upstream (a real aiohttp server on
# 127.0.0.1) answers with the usage a prompt-caching API bills: the first turn writes
# the prefix (split 5m / 1h), the second reads it.

TURNS: Final = (  # (uncached input, cache read, cache write 5m, cache write 1h)
    (10, 0, 600, 300),
    (10, 900, 0, 0),
)


def _anthropic_usage(turn: int) -> dict[str, Any]:
    fresh, read, w5m, w1h = TURNS[turn]
    return {
        "input_tokens": fresh,
        "output_tokens": 1,
        "cache_read_input_tokens": read,
        "cache_creation_input_tokens": w5m + w1h,
        "cache_creation": {"ephemeral_5m_input_tokens": w5m, "ephemeral_1h_input_tokens": w1h},
    }


async def _caching_upstream(request: web.Request) -> web.StreamResponse:
    app_turns: list[int] = request.app[TURN_KEY]
    turn = len(app_turns) % len(TURNS)
    app_turns.append(turn)
    body = await request.json()
    if request.path == "/v1/chat/completions":
        fresh, read, _, _ = TURNS[turn]
        return web.json_response(
            {
                "id": "chatcmpl-1",
                "object": "chat.completion",
                "created": 0,
                "model": body["model"],
                "choices": [
                    {
                        "index": 0,
                        "message": {"role": "assistant", "content": "ok"},
                        "finish_reason": "stop",
                    }
                ],
                "usage": {
                    "prompt_tokens": fresh + read,
                    "completion_tokens": 1,
                    "total_tokens": fresh + read + 1,
                    "prompt_tokens_details": {"cached_tokens": read},
                },
            }
        )
    usage = _anthropic_usage(turn)
    message = {
        "id": "msg_1",
        "type": "message",
        "role": "assistant",
        "model": body["model"],
        "content": [],
        "stop_reason": None,
        "stop_sequence": None,
        "usage": usage,
    }
    response = web.StreamResponse(headers={"content-type": "text/event-stream"})
    await response.prepare(request)
    events: list[tuple[str, dict[str, Any]]] = [
        ("message_start", {"type": "message_start", "message": message}),
        (
            "content_block_start",
            {
                "type": "content_block_start",
                "index": 0,
                "content_block": {"type": "text", "text": ""},
            },
        ),
        (
            "content_block_delta",
            {
                "type": "content_block_delta",
                "index": 0,
                "delta": {"type": "text_delta", "text": "ok"},
            },
        ),
        ("content_block_stop", {"type": "content_block_stop", "index": 0}),
        (
            "message_delta",
            {
                "type": "message_delta",
                "delta": {"stop_reason": "end_turn", "stop_sequence": None},
                "usage": {"output_tokens": 1},
            },
        ),
        ("message_stop", {"type": "message_stop"}),
    ]
    for name, data in events:
        await response.write(f"event: {name}\ndata: {json.dumps(data)}\n\n".encode())
    await response.write_eof()
    return response


TURN_KEY: Final = web.AppKey("turns", list[int])


@contextlib.asynccontextmanager
async def proxy_before_caching_upstream(
    plugin: UsagePlugin,
) -> AsyncIterator[tuple[str, ProxyApp]]:
    """A proxy (base URL and app yielded) with ``plugin``, before :func:`_caching_upstream`."""
    upstream = web.Application()
    upstream[TURN_KEY] = []
    upstream.router.add_post("/v1/messages", _caching_upstream)
    upstream.router.add_post("/v1/chat/completions", _caching_upstream)
    async with (
        serve_app(upstream, access_log=True) as upstream_url,
        proxy_app(upstream_url, plugins=[plugin], shutdown_grace=5.0) as (url, app),
    ):
        yield url, app


async def _settle(app: ProxyApp) -> None:
    # The client has the answer before the commit hooks run: wait (bounded) for
    # every handler and pending commit, as ``proxy.testing.Harness.settle`` does.
    me = asyncio.current_task()
    async with asyncio.timeout(5):
        while True:
            busy = {
                t
                for t in (*app.state.handlers, *app.state.commits.pending)
                if t is not me and not t.done()
            }
            if not busy:
                return
            await asyncio.wait(busy)


async def test_cache_reads_and_writes_reach_metrics_and_the_admin_view() -> None:
    registry = CollectorRegistry()
    plugin = UsagePlugin(registry=registry)
    async with proxy_before_caching_upstream(plugin) as (base, app):
        claude = anthropic.AsyncAnthropic(
            base_url=base,
            api_key="sk-test",
            default_headers={"x-claude-code-session-id": "cc1"},
            max_retries=0,
        )
        billed = []
        for _ in TURNS:
            async with claude.messages.stream(
                model="claude-cache",
                max_tokens=8,
                messages=[{"role": "user", "content": "hello"}],
            ) as events:
                billed.append((await events.get_final_message()).usage)
        chat = openai.AsyncOpenAI(
            base_url=f"{base}/v1",
            api_key="sk-test",
            default_headers={"x-session-id": "oa1"},
            max_retries=0,
        )
        for _ in TURNS:
            await chat.chat.completions.create(
                model="gpt-cache", messages=[{"role": "user", "content": "hello"}]
            )
        await _settle(app)
        async with aiohttp.ClientSession() as http:
            async with http.get(f"{base}/admin/sessions/cc1") as resp:
                assert resp.status == 200
                claude_view = (await resp.json())["plugins"]["usage"]
            async with http.get(f"{base}/admin/sessions/oa1") as resp:
                chat_view = (await resp.json())["plugins"]["usage"]
            async with http.get(f"{base}/metrics") as resp:
                exposition = await resp.text()
    await plugin.shutdown()

    # What the SDK saw is what the proxy booked: 900 written (600 for 5 minutes, 300
    # for an hour), then 900 read; the whole prompt is 910 tokens each turn.
    assert [u.cache_creation_input_tokens for u in billed] == [900, 0]
    assert [u.cache_read_input_tokens for u in billed] == [0, 900]
    assert claude_view == {
        "input_tokens": 1820,
        "output_tokens": 2,
        "cache_read_tokens": 900,
        "cache_write_tokens": 900,
        "cache_write_5m_tokens": 600,
        "cache_write_1h_tokens": 300,
        "cached_input_share": 900 / 1820,
        "requests": 2,
    }
    assert chat_view["cache_read_tokens"] == 900
    assert chat_view["cache_write_tokens"] == 0
    assert chat_view["cached_input_share"] == 900 / 920

    scraped = {
        (sample.name, sample.labels.get("model"), sample.labels.get("le")): sample.value
        for family in text_string_to_metric_families(exposition)
        for sample in family.samples
    }
    assert scraped[("context_proxy_cache_write_tokens_total", "claude-cache", None)] == 900
    assert scraped[("context_proxy_cache_read_tokens_total", "claude-cache", None)] == 900
    assert scraped[("context_proxy_cache_write_tokens_total", "gpt-cache", None)] == 0
    # The writes by cache lifetime, as Anthropic split them; OpenAI splits none.
    lifetimes = {
        (sample.labels["model"], sample.labels["ttl"]): sample.value
        for family in text_string_to_metric_families(exposition)
        for sample in family.samples
        if sample.name == "context_proxy_cache_write_lifetime_tokens_total"
    }
    assert lifetimes == {("claude-cache", "5m"): 600, ("claude-cache", "1h"): 300}
    # Per exchange: the writing turn had a share of 0, the reading turn 900/910.
    assert scraped[("context_proxy_cached_input_share_bucket", "claude-cache", "0.1")] == 1
    assert scraped[("context_proxy_cached_input_share_bucket", "claude-cache", "0.95")] == 1
    assert scraped[("context_proxy_cached_input_share_bucket", "claude-cache", "0.99")] == 2
    assert scraped[("context_proxy_cached_input_share_count", "claude-cache", None)] == 2

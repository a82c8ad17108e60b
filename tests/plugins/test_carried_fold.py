"""Carried folds (issue 22 items 1-3): a session that overflowed stays folded.

Each test runs the real ``fold`` plugin in a proxy in front of a *tap*, an
upstream on 127.0.0.1 that keeps the bytes of every body it receives and relays
the request to the emulator, which has a context window
(``context-proxy emulate --context-window-tokens N``: a prompt of more than N
tokens, body bytes // 4, gets the protocol's real overflow error). Clients are
the real ``openai`` and ``anthropic`` SDKs; the session id travels in each
protocol's header. The tap shows what the upstream's prompt cache sees (the
bytes), the emulator how many requests it had to read and reject.
"""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
import json
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any, cast

import aiohttp
import anthropic
import openai
import pytest
from aiohttp import web

from plugins.fold import DEFAULT_PLACEHOLDER, FoldPlugin
from proxy import BodyView, Protocol
from proxy._app import build_app, running
from proxy._config import load_settings
from proxy._emulator import EmulatorServer, start_emulator
from proxy._emulator_script import window_script
from proxy._plugins import PluginHost, load_plugins
from proxy._protocols import stated_tokens
from proxy.testing import Harness, proxy_with_emulator
from tests.support.cluster import RedisServer, need_binary
from tests.support.ports import serve_app

#: The emulator's context window: 24,000 tokens, i.e. bodies of up to 96,003 bytes.
WINDOW_TOKENS = 24_000
#: Bytes of one bulky turn (a pasted file, a tool result).
TURN_BYTES = 6_000
PLACEHOLDER_MARK = DEFAULT_PLACEHOLDER.split("{n}")[0].encode()

PROTOCOLS = {
    "chat": Protocol.CHAT,
    "messages": Protocol.MESSAGES,
    "responses": Protocol.RESPONSES,
}


def _text(tag: str, size: int) -> str:
    line = f"{tag}: the quick brown fox jumps over the lazy dog 0123456789\n"
    return (line * (size // len(line) + 1))[:size]


@dataclasses.dataclass
class Tap:
    """The bodies the upstream received, in order, as bytes."""

    bodies: list[bytes] = dataclasses.field(default_factory=list)


@contextlib.asynccontextmanager
async def tap_upstream(
    window: int, *, prompt_cache: bool = False
) -> AsyncIterator[tuple[EmulatorServer, Tap, str]]:
    """The emulator with a ``window``-token context (and a prompt cache, if asked), and a
    tap in front of it (its URL)."""
    script = window_script(window, prompt_cache=prompt_cache)
    emulator: EmulatorServer = await start_emulator(default_script=script)
    tap = Tap()
    http = aiohttp.ClientSession()

    async def relay(request: web.Request) -> web.Response:
        body = await request.read()
        tap.bodies.append(body)
        headers = {"Content-Type": request.headers.get("Content-Type", "application/json")}
        async with http.post(emulator.url + request.path_qs, data=body, headers=headers) as up:
            answer = await up.read()
            return web.Response(status=up.status, body=answer, content_type=up.content_type)

    app = web.Application()
    app.router.add_post("/{tail:.*}", relay)
    try:
        async with serve_app(app) as url:
            yield emulator, tap, url
    finally:
        await http.close()
        await emulator.close()


@contextlib.asynccontextmanager
async def proxy_on(
    upstream: str, emulator: EmulatorServer, plugin: FoldPlugin, **settings: Any
) -> AsyncIterator[Harness]:
    """A proxy running ``plugin`` whose upstream is ``upstream``; leaving it drains it."""
    resolved = load_settings(
        environ={},
        overrides={
            "plugins": [],
            "shutdown_grace": 5.0,
            "max_refolds": 4,
            **settings,
            "upstream_openai": upstream,
            "upstream_anthropic": upstream,
        },
    )
    proxy_app = build_app(resolved, host=PluginHost([plugin], timeout=5.0))
    async with running(proxy_app, "127.0.0.1", 0) as port:
        yield Harness(f"http://127.0.0.1:{port}", emulator, proxy_app, resolved)


@contextlib.asynccontextmanager
async def tapped(
    plugin: FoldPlugin, *, window: int = WINDOW_TOKENS, prompt_cache: bool = False
) -> AsyncIterator[tuple[Harness, Tap]]:
    """A proxy with ``plugin`` whose upstream is a tap in front of a windowed emulator."""
    async with (
        tap_upstream(window, prompt_cache=prompt_cache) as (emulator, tap, url),
        proxy_on(url, emulator, plugin) as harness,
    ):
        yield harness, tap


class Client:
    """One protocol's real SDK talking to the proxy for one session id."""

    def __init__(
        self, protocol: Protocol, h: Harness, session: str | None, *, stream: bool = False
    ) -> None:
        self.protocol = protocol
        self.h = h
        self.session = session
        # Responses only: a streamed overflow is an event that states no token figures.
        self.stream = stream

    def _headers(self) -> dict[str, str]:
        if self.session is None:
            return {}
        name = {
            Protocol.CHAT: "x-session-id",
            Protocol.MESSAGES: "x-claude-code-session-id",
            Protocol.RESPONSES: "session-id",
        }[self.protocol]
        return {name: self.session}

    async def ask(self, history: list[tuple[str, str]]) -> str:
        """Send ``history`` (``(role, text)`` pairs, the last one the user's); the answer."""
        headers = self._headers()
        if self.protocol == Protocol.MESSAGES:
            async with anthropic.AsyncAnthropic(
                base_url=self.h.url, api_key="test", max_retries=0, default_headers=headers
            ) as claude:
                message = await claude.messages.create(
                    model="claude-test",
                    max_tokens=64,
                    system="You are a careful engineer.",
                    messages=cast(Any, [{"role": r, "content": t} for r, t in history]),
                )
                block = message.content[0]
                assert block.type == "text"
                return block.text
        async with openai.AsyncOpenAI(
            base_url=self.h.openai_base_url, api_key="test", max_retries=0, default_headers=headers
        ) as client:
            if self.protocol == Protocol.CHAT:
                messages = [{"role": "system", "content": "You are a careful engineer."}]
                messages += [{"role": r, "content": t} for r, t in history]
                chat = await client.chat.completions.create(
                    model="gpt-test", messages=cast(Any, messages)
                )
                return chat.choices[0].message.content or ""
            items = [
                {
                    "role": r,
                    "content": [
                        {"type": "input_text" if r == "user" else "output_text", "text": t}
                    ],
                }
                for r, t in history
            ]
            if not self.stream:
                response = await client.responses.create(
                    model="gpt-test",
                    instructions="You are a careful engineer.",
                    input=cast(Any, items),
                )
                return response.output_text
            async with client.responses.stream(
                model="gpt-test", instructions="You are a careful engineer.", input=cast(Any, items)
            ) as events:
                final = await events.get_final_response()
                return final.output_text


def opening(count: int, tag: str = "turn") -> list[tuple[str, str]]:
    """A history of ``count`` bulky alternating turns, then a short question."""
    history = [
        ("user" if i % 2 == 0 else "assistant", _text(f"{tag} {i}", TURN_BYTES))
        for i in range(count)
    ]
    return [*history, ("user", "Why does the test still fail?")]


def prefix_end(body: bytes, protocol: Protocol, entries: int) -> int:
    """Offset just past history entry ``entries - 1`` of ``body`` (system entries counted)."""
    items = BodyView(body, protocol).items()
    return items[entries - 1].end


def system_entries(protocol: Protocol) -> int:
    return 1 if protocol == Protocol.CHAT else 0


async def folded_session(
    client: Client, h: Harness, history: list[tuple[str, str]]
) -> tuple[str, dict[str, Any]]:
    """Ask once with an over-long ``history``: the overflow is refolded and accepted."""
    answer = await client.ask(history)
    await h.settle()
    assert [r.status for r in h.emulator.stats] == [400, 200]
    assert client.session is not None
    view = await h.session_view(client.session)
    assert view is not None
    return answer, view["plugins"]["fold"]


# -- item 1: the carried fold ---------------------------------------------------------------


@pytest.mark.parametrize("name", PROTOCOLS)
async def test_next_turn_is_folded_before_its_first_send_with_a_byte_identical_prefix(
    name: str,
) -> None:
    protocol = PROTOCOLS[name]
    async with tapped(FoldPlugin()) as (h, tap):
        client = Client(protocol, h, "carry-1")
        history = opening(18)
        answer, state = await folded_session(client, h, history)
        assert state["carried_folds"] == 1 and state["carried_level"] == 1
        assert state["window_tokens"] == WINDOW_TOKENS
        cut = state["carried_cut"]
        sent = tap.bodies[1]

        history = [*history, ("assistant", answer), ("user", "And now?")]
        await client.ask(history)
        await h.settle()
        # One request for turn 2, and it was accepted: no rejected round trip.
        assert [r.status for r in h.emulator.stats] == [400, 200, 200]
        again = tap.bodies[2]
        assert PLACEHOLDER_MARK in again
        # Every entry turn 1 sent (folded part and all) leaves again byte for byte.
        end = prefix_end(sent, protocol, 19 + system_entries(protocol))
        assert again[:end] == sent[:end]
        assert cut <= 18 + system_entries(protocol)
        view = await h.session_view("carry-1")
        assert view is not None
        assert view["plugins"]["fold"]["carried_applied"] == 1


@pytest.mark.parametrize("name", PROTOCOLS)
async def test_without_a_carried_fold_every_turn_pays_a_rejected_round_trip(name: str) -> None:
    protocol = PROTOCOLS[name]
    async with tapped(FoldPlugin(carry=False)) as (h, _):
        client = Client(protocol, h, "carry-off")
        history = opening(18)
        answer = await client.ask(history)
        await client.ask([*history, ("assistant", answer), ("user", "And now?")])
        await h.settle()
        assert [r.status for r in h.emulator.stats] == [400, 200, 400, 200]


@pytest.mark.parametrize("name", PROTOCOLS)
@pytest.mark.parametrize("change", ["edit", "restart", "compaction"])
async def test_a_history_that_no_longer_matches_is_sent_as_received(name: str, change: str) -> None:
    protocol = PROTOCOLS[name]
    async with tapped(FoldPlugin()) as (h, tap):
        client = Client(protocol, h, "carry-2")
        history = opening(18)
        _, state = await folded_session(client, h, history)
        cut = state["carried_cut"] - system_entries(protocol)
        if change == "edit":
            # An entry inside the folded prefix rewritten short (the client trimmed it).
            changed = list(history)
            changed[1] = ("assistant", "shorter now")
            changed = [*changed[: cut + 2], ("user", "Again?")]
        elif change == "restart":
            # Started over: same opening message, a new short history.
            changed = [history[0], ("assistant", "fresh start"), ("user", "Again?")]
        else:
            # Compacted: a summary replaces the history.
            changed = [("user", "Summary of the work so far."), ("assistant", "ok")]
            changed += [("user", "Go on.")]
        await client.ask(changed)
        await h.settle()
        assert [r.status for r in h.emulator.stats] == [400, 200, 200]
        assert PLACEHOLDER_MARK not in tap.bodies[2]
        view = await h.session_view("carry-2")
        assert view is not None
        fold = view["plugins"]["fold"]
        assert fold["carried_applied"] == 0
        if change != "compaction":
            # Same history key, other prefix: the carried fold is dropped.
            assert fold["carried_folds"] == 0


async def test_a_request_without_a_session_is_never_carried() -> None:
    async with tapped(FoldPlugin()) as (h, _):
        client = Client(Protocol.CHAT, h, None)
        history = opening(18)
        answer = await client.ask(history)
        await client.ask([*history, ("assistant", answer), ("user", "And now?")])
        await h.settle()
        assert [r.status for r in h.emulator.stats] == [400, 200, 400, 200]


def test_overflow_errors_state_their_token_figures() -> None:
    anthropic_error = b'{"type":"error","error":{"type":"invalid_request_error",'
    anthropic_error += b'"message":"prompt is too long: 210000 tokens > 200000 maximum"}}'
    assert stated_tokens(anthropic_error) == (210000, 200000)
    chat = (
        b"This model's maximum context length is 128000 tokens. However, your messages "
        b"resulted in 130001 tokens. Please reduce the length of the messages."
    )
    assert stated_tokens(chat) == (130001, 128000)
    vllm = (
        b"This model's maximum context length is 4096 tokens. However, you requested "
        b"5000 tokens (5000 in the messages, 0 in the completion)."
    )
    assert stated_tokens(vllm) == (5000, 4096)
    sglang = b"The input (9000 tokens) is longer than the model's context length (8192 tokens)."
    assert stated_tokens(sglang) == (9000, 8192)
    assert stated_tokens(b"Your input exceeds the context window of this model.") == (None, None)


async def test_the_harness_emulator_takes_a_context_window() -> None:
    async with proxy_with_emulator(context_window_tokens=100) as h:
        small = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
        big = {"model": "m", "messages": [{"role": "user", "content": "x" * 800}]}
        async with aiohttp.ClientSession() as http:
            async with http.post(h.url + "/v1/chat/completions", json=small) as resp:
                assert resp.status == 200
            async with http.post(h.url + "/v1/chat/completions", json=big) as resp:
                assert resp.status == 400
                assert "maximum context length is 100 tokens" in (await resp.text())


# -- item 2: hysteresis -----------------------------------------------------------------------


def history_of(body: bytes, protocol: Protocol) -> list[Any]:
    return [node.value() for node in BodyView(body, protocol).items()]


async def grow(
    client: Client, h: Harness, tap: Tap, turns: int, *, start: int = 18
) -> tuple[list[int], list[int], list[list[tuple[str, str]]]]:
    """Run a session that overflows, then grows by a bulky tool result per turn.

    Returns per turn: the upstream requests it took, the carried cut after it,
    and the history the client sent.
    """
    assert client.session is not None
    history = opening(start)
    requests: list[int] = []
    cuts: list[int] = []
    sent: list[list[tuple[str, str]]] = []
    for turn in range(turns):
        before = len(h.emulator.stats)
        answer = await client.ask(history)
        await h.settle()
        requests.append(len(h.emulator.stats) - before)
        assert h.emulator.stats[-1].status == 200
        view = await h.session_view(client.session)
        assert view is not None
        cuts.append(view["plugins"]["fold"]["carried_cut"])
        sent.append(history)
        history = [*history, ("assistant", answer), ("user", _text(f"result {turn}", TURN_BYTES))]
    assert len(tap.bodies) == sum(requests)
    return requests, cuts, sent


def check_rules(body: bytes, protocol: Protocol, history: list[tuple[str, str]]) -> None:
    """The system prompt and the last user turn left alone; no entry added or dropped."""
    entries = history_of(body, protocol)
    system = system_entries(protocol)
    assert len(entries) == len(history) + system
    if protocol == Protocol.CHAT:
        assert entries[0] == {"role": "system", "content": "You are a careful engineer."}
    last = entries[-1]
    text = last["content"] if isinstance(last["content"], str) else last["content"][0]["text"]
    assert text == history[-1][1]


@pytest.mark.parametrize("name", PROTOCOLS)
async def test_the_cut_moves_rarely_and_earlier_placeholders_stay_byte_for_byte(
    name: str,
) -> None:
    protocol = PROTOCOLS[name]
    async with tapped(FoldPlugin()) as (h, tap):
        client = Client(protocol, h, "grow")
        requests, cuts, sent = await grow(client, h, tap, 24)
        # The first turn overflowed once. The error stated the window, so afterwards
        # the cut moved before the send each time the body passed fold_target of it:
        # no rejected round trip at all.
        assert requests[0] == 2
        assert requests[1:] == [1] * 23
        # The history grew to more than twice the window; the cut moved, but rarely:
        # each move lands near fold_headroom, leaving room for several turns.
        moves = sum(1 for a, b in itertools.pairwise(cuts) if b != a)
        assert 2 <= moves <= 6
        assert cuts == sorted(cuts)
        # Each turn's accepted body, then the next: the bytes through the older
        # cut are identical (its placeholders kept byte for byte).
        accepted = [tap.bodies[sum(requests[: i + 1]) - 1] for i in range(len(requests))]
        for i in range(len(accepted) - 1):
            end = prefix_end(accepted[i], protocol, cuts[i])
            assert accepted[i + 1][:end] == accepted[i][:end], i
        for body, history in zip(accepted, sent, strict=True):
            check_rules(body, protocol, history)
            assert len(body) <= 4 * WINDOW_TOKENS + 3
        view = await h.session_view("grow")
        assert view is not None
        assert view["plugins"]["fold"]["cut_moves"] >= 1


async def cached_share(protocol: Protocol, *, carry: bool, turns: int) -> tuple[float, int]:
    """Run a growing session against a prompt-caching emulator.

    Returns the cached share of input tokens over the accepted requests after the
    first fold, and the number of upstream requests.
    """
    async with tapped(FoldPlugin(carry=carry), prompt_cache=True) as (h, _):
        client = Client(protocol, h, "cache")
        history = opening(18)
        for turn in range(turns):
            answer = await client.ask(history)
            await h.settle()
            # A smaller tool result per turn (3% of the window), as in a long session.
            history = [*history, ("assistant", answer), ("user", _text(f"result {turn}", 3000))]
        stats = h.emulator.stats
        first = next(i for i, r in enumerate(stats) if r.status == 200)
        later = [r for r in stats[first + 1 :] if r.status == 200]
        assert len(later) == turns - 1
        cached = sum(r.cached_tokens for r in later)
        return cached / sum(r.body_bytes // 4 for r in later), len(stats)


@pytest.mark.parametrize("name", PROTOCOLS)
async def test_the_upstream_prompt_cache_keeps_hitting(name: str) -> None:
    protocol = PROTOCOLS[name]
    carried, requests = await cached_share(protocol, carry=True, turns=30)
    fresh, requests_without = await cached_share(protocol, carry=False, turns=30)
    # One rejected round trip in 30 turns, against one or two per turn without.
    assert requests == 31 and requests_without >= 59
    # Most of each prompt is a prefix the upstream already holds; without carried
    # folds, the refold's shifting elisions leave well under half cached.
    assert carried >= 0.8
    assert fresh <= 0.5


async def test_a_carried_fold_that_overflows_again_moves_its_cut_in_one_refold() -> None:
    # A streamed Responses overflow states no figures: the window is known only as
    # "smaller than what was refused", so a carried fold overflows again now and then.
    async with tapped(FoldPlugin()) as (h, tap):
        client = Client(Protocol.RESPONSES, h, "again", stream=True)
        # Folding so long a history takes two refolds; the smaller refused body is
        # then ~1.5x the real window, so fold_target of it is past the window.
        requests, cuts, sent = await grow(client, h, tap, 16, start=44)
        assert requests[0] == 3
        again = [turn for turn, count in enumerate(requests) if turn and count > 1]
        # The carried fold overflowed again once, and one refold moved its cut.
        assert len(again) == 1 and requests[again[0]] == 2
        turn = again[0]
        assert cuts[turn] > cuts[turn - 1]
        refused = len(tap.bodies[sum(requests[:turn])])
        moved = tap.bodies[sum(requests[: turn + 1]) - 1]
        # It aimed at fold_headroom of the refused body, so the next turns fit again.
        assert len(moved) <= 0.6 * refused + TURN_BYTES
        assert requests[turn + 1 :] == [1] * (len(requests) - turn - 1)
        assert cuts == sorted(cuts)
        accepted = [tap.bodies[sum(requests[: i + 1]) - 1] for i in range(len(requests))]
        for i in range(len(accepted) - 1):
            end = prefix_end(accepted[i], Protocol.RESPONSES, cuts[i])
            assert accepted[i + 1][:end] == accepted[i][:end], i
        for body, history in zip(accepted, sent, strict=True):
            check_rules(body, Protocol.RESPONSES, history)


# -- item 3: sub-agents ------------------------------------------------------------------------


async def test_sub_agents_under_one_session_keep_separate_carried_folds() -> None:
    async with tapped(FoldPlugin(max_histories=2)) as (h, _):
        client = Client(Protocol.MESSAGES, h, "agents")
        agents = {tag: opening(18, tag) for tag in ("main", "explore", "review")}
        answers: dict[str, str] = {}

        async def turn(tag: str) -> int:
            before = len(h.emulator.stats)
            history = agents[tag]
            if tag in answers:
                history = agents[tag] = [*history, ("assistant", answers[tag]), ("user", "More?")]
            answers[tag] = await client.ask(history)
            await h.settle()
            assert h.emulator.stats[-1].status == 200
            return len(h.emulator.stats) - before

        # Each history overflows once; interleaved, neither resets the other.
        assert [await turn("main"), await turn("explore")] == [2, 2]
        assert [await turn("main"), await turn("explore"), await turn("main")] == [1, 1, 1]
        view = await h.session_view("agents")
        assert view is not None
        assert view["plugins"]["fold"]["carried_folds"] == 2
        # A third history makes room by dropping the least recently used one.
        assert await turn("review") == 2
        assert await turn("main") == 1
        assert await turn("explore") == 2


# -- item 3: cluster mode ----------------------------------------------------------------------


@pytest.mark.timeout(120)
@pytest.mark.parametrize("name", PROTOCOLS)
async def test_another_node_continues_the_same_cut(name: str, tmp_path: Path) -> None:
    need_binary("redis-server")
    protocol = PROTOCOLS[name]
    redis = RedisServer(tmp_path)
    redis.start()
    try:
        async with tap_upstream(WINDOW_TOKENS) as (emulator, tap, url):
            history = opening(18)
            plugin_a = FoldPlugin(redis_url=redis.url)
            async with proxy_on(url, emulator, plugin_a, redis_url=redis.url) as a:
                answer, state = await folded_session(Client(protocol, a, "moving"), a, history)
            # Node a is gone (drained and stopped); the session comes to node b.
            plugin_b = FoldPlugin(redis_url=redis.url)
            async with proxy_on(url, emulator, plugin_b, redis_url=redis.url) as b:
                turn = [*history, ("assistant", answer), ("user", "And now?")]
                await Client(protocol, b, "moving").ask(turn)
                await b.settle()
                view = await b.session_view("moving")
            # One request for the turn on the new node, accepted, with the same prefix.
            assert [r.status for r in emulator.stats] == [400, 200, 200]
            end = prefix_end(tap.bodies[1], protocol, len(history) + system_entries(protocol))
            assert tap.bodies[2][:end] == tap.bodies[1][:end]
            assert view is not None
            fold = view["plugins"]["fold"]
            assert fold["carried_applied"] == 1
            assert fold["carried_cut"] == state["carried_cut"]
    finally:
        redis.stop()


@pytest.mark.timeout(120)
async def test_without_redis_a_node_starts_over_and_requests_still_succeed(
    tmp_path: Path,
) -> None:
    need_binary("redis-server")
    redis = RedisServer(tmp_path)
    redis.start()
    try:
        async with tap_upstream(WINDOW_TOKENS) as (emulator, _tap, url):
            history = opening(18)
            plugin_a = FoldPlugin(redis_url=redis.url)
            async with proxy_on(url, emulator, plugin_a, redis_url=redis.url) as a:
                answer, _ = await folded_session(Client(Protocol.CHAT, a, "lost"), a, history)
            redis.stop()
            plugin_b = FoldPlugin(redis_url=redis.url, redis_timeout=0.2)
            async with proxy_on(url, emulator, plugin_b) as b:
                turn = [*history, ("assistant", answer), ("user", "And now?")]
                await Client(Protocol.CHAT, b, "lost").ask(turn)
                await b.settle()
            # Redis gone: node b knows nothing, so the turn pays one refold, and works.
            assert [r.status for r in emulator.stats] == [400, 200, 400, 200]
    finally:
        redis.stop()


def test_fold_joins_cluster_mode_with_the_proxy() -> None:
    shared = {"redis_url": "redis://127.0.0.1:1/0", "redis_timeout": 0.5}
    (plugin,) = load_plugins(["fold"], {}, timeout=1.0, shared=shared).plugins
    assert isinstance(plugin, FoldPlugin)
    assert (plugin.redis_url, plugin.redis_timeout) == ("redis://127.0.0.1:1/0", 0.5)
    (alone,) = load_plugins(["fold"], {}, timeout=1.0).plugins
    assert isinstance(alone, FoldPlugin) and alone.redis_url is None


# -----------------------------------------------------------------------------
# Adversarial checks of carried folds (docs/plugins.md, "Carried folds").
#
# The real ``fold`` plugin in a proxy in front of a tap that routes each body by
# its ``model`` to one of two emulators with different context windows, so a
# session that switches models meets an upstream that has room for its history.


#: The model whose upstream has ten times the window of the others.
BIG = "gpt-big"


@contextlib.asynccontextmanager
async def routed() -> AsyncIterator[tuple[Harness, EmulatorServer, list[tuple[str, bytes]]]]:
    """A proxy with ``fold`` whose upstream sends :data:`BIG`'s bodies to an emulator with
    ten times the window; yields the harness (on the small one), the big emulator and
    the ``(model, body)`` of every body the upstream received."""
    small = await start_emulator(default_script=window_script(WINDOW_TOKENS))
    big = await start_emulator(default_script=window_script(10 * WINDOW_TOKENS))
    seen: list[tuple[str, bytes]] = []
    http = aiohttp.ClientSession()

    async def relay(request: web.Request) -> web.Response:
        body = await request.read()
        model = json.loads(body)["model"]
        seen.append((model, body))
        target = big if model == BIG else small
        headers = {"Content-Type": "application/json"}
        async with http.post(target.url + request.path_qs, data=body, headers=headers) as up:
            answer = await up.read()
            return web.Response(status=up.status, body=answer, content_type=up.content_type)

    app = web.Application()
    app.router.add_post("/{tail:.*}", relay)
    try:
        async with serve_app(app) as url, proxy_on(url, small, FoldPlugin()) as h:
            yield h, big, seen
    finally:
        await http.close()
        await small.close()
        await big.close()


async def ask(h: Harness, session: str, model: str, history: list[tuple[str, str]]) -> str:
    """One chat request of ``session`` to ``model`` through the proxy; the answer's text."""
    async with openai.AsyncOpenAI(
        base_url=h.openai_base_url,
        api_key="test",
        max_retries=0,
        default_headers={"x-session-id": session},
    ) as client:
        messages: list[dict[str, Any]] = [{"role": "system", "content": "Be careful."}]
        messages += [{"role": r, "content": t} for r, t in history]
        chat = await client.chat.completions.create(model=model, messages=cast(Any, messages))
        return chat.choices[0].message.content or ""


async def test_a_session_that_switches_to_a_larger_model_gets_its_history_unfolded() -> None:
    """The carried fold was learned against one model's window: a model with room for
    the whole history must receive it as the client sent it, not with old turns elided."""
    async with routed() as (h, big, seen):
        history = opening(18)
        answer = await ask(h, "switch-1", "gpt-test", history)
        await h.settle()
        assert [r.status for r in h.emulator.stats] == [400, 200]
        assert PLACEHOLDER_MARK in seen[1][1]  # folded for the small model

        history = [*history, ("assistant", answer), ("user", "And with the big model?")]
        await ask(h, "switch-1", BIG, history)
        await h.settle()
        assert [r.status for r in big.stats] == [200]
        model, body = seen[2]
        assert model == BIG
        assert PLACEHOLDER_MARK not in body, "the big model got a folded history"


def _marked(history: list[dict[str, Any]], marks: int) -> list[dict[str, Any]]:
    """``history`` with a ``cache_control`` breakpoint on the last ``marks`` user
    messages (Anthropic's multi-turn caching pattern: it moves forward every turn)."""
    out = json.loads(json.dumps(history))
    users = [m for m in out if m["role"] == "user"]
    for message in users[len(users) - marks :] if marks else []:
        message["content"][-1]["cache_control"] = {"type": "ephemeral"}
    return out


@pytest.mark.parametrize("marks", [0, 1, 2])
async def test_moving_cache_breakpoints_do_not_cost_the_carried_fold(marks: int) -> None:
    """A Messages client that moves its ``cache_control`` breakpoints to the newest user
    messages every turn: the carried fold keeps being applied, so 28 turns of a growing
    history past the window cost about as few rejected round trips as without markers."""
    async with tapped(FoldPlugin()) as (h, _tap):
        history: list[dict[str, Any]] = [
            {"role": "user", "content": [{"type": "text", "text": "Fix the parser."}]}
        ]
        async with aiohttp.ClientSession() as http:
            for turn in range(28):
                # A bulky block and a short one each (the short ones never fold, so
                # the cut has to move up to the newest turns).
                for role in ("assistant", "user"):
                    blocks = [_text(f"{role}{turn}", 3000), _text(f"{role}{turn}", 1000)]
                    content = [{"type": "text", "text": text} for text in blocks]
                    history.append({"role": role, "content": content})
                body = {
                    "model": "claude-test",
                    "max_tokens": 64,
                    "system": "Be careful.",
                    "messages": _marked(history, marks),
                }
                headers = {"x-claude-code-session-id": "marks", "anthropic-version": "2023-06-01"}
                async with http.post(h.url + "/v1/messages", json=body, headers=headers) as resp:
                    assert resp.status == 200, await resp.text()
                    await resp.read()
        await h.settle()
        rejected = sum(r.status != 200 for r in h.emulator.stats)
    assert rejected <= 2, f"{rejected} rejected round trips"

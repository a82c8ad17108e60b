"""The emulator's prompt cache (`prompt_cache=1`, `emulate --prompt-cache`).

Cached input tokens are the longest prefix, in whole 1,024-token (4,096-byte) blocks, that
an accepted request of the same route and model sent in the last 5 minutes; the real SDKs
must parse the figures from each protocol's usage fields.
"""

from __future__ import annotations

import hashlib
from collections.abc import AsyncIterator

import aiohttp
import anthropic
import openai
import pytest
from openai.types.chat import ChatCompletionMessageParam
from openai.types.responses import ResponseInputParam

from proxy._emulator import EmulatorServer, Script, start_emulator
from proxy._emulator_cache import BLOCK_BYTES, BLOCK_TOKENS, PrefixChain, PromptCache
from tests.support.process import Proc

KEY = "sk-emulator-cache-test"
# A history that grows: turn 1 is one long user entry (5 whole blocks and 1,920 bytes),
# turn 2 repeats it and adds two entries, so the bodies share 5 whole blocks.
LONG = "You are a careful coding agent. " * 700
SHARED_BLOCKS = len(LONG) // BLOCK_BYTES
CACHED_ON = {"x-emulator": "prompt_cache=1"}


@pytest.fixture
async def server() -> AsyncIterator[EmulatorServer]:
    async with await start_emulator() as srv:
        yield srv


def chain_of(data: bytes, piece: int) -> list[bytes]:
    chain = PrefixChain()
    for start in range(0, len(data), piece):
        chain.feed(data[start : start + piece])
    return list(chain.digests)


# ----------------------------------------------------------------- sans-I/O parts


def test_the_chain_is_the_same_however_the_body_is_cut_and_counts_whole_blocks_only() -> None:
    data = b"".join(hashlib.sha256(b"%d" % i).digest() for i in range(560))  # 4 blocks + part
    whole = chain_of(data, len(data))
    assert len(whole) == len(data) // BLOCK_BYTES == 4
    for piece in (1, 7, 4095, 4096, 4097, 10_000):
        assert chain_of(data, piece) == whole, piece
    # A digest names the whole prefix: a change in block 0 changes every later digest.
    changed = chain_of(b"\xff" + data[1:], 4096)
    assert all(a != b for a, b in zip(changed, whole, strict=True))
    # The same block after a different prefix does not match.
    assert chain_of(data[4096:8192] * 2, 4096)[1] != whole[1]


def test_the_cache_keeps_a_prefix_five_minutes_after_its_last_use_per_scope() -> None:
    now = [1000.0]
    cache = PromptCache(timer=lambda: now[0])
    scope = ("messages", "claude-x")
    first = PrefixChain()
    first.feed(b"a" * (3 * BLOCK_BYTES))
    grown = PrefixChain()
    grown.feed(b"a" * (3 * BLOCK_BYTES) + b"b" * (2 * BLOCK_BYTES))
    assert cache.cached_blocks(scope, first) == 0
    cache.store(scope, first)
    assert cache.cached_blocks(scope, grown) == 3
    assert cache.cached_blocks(("messages", "other-model"), grown) == 0
    assert cache.cached_blocks(("chat", "claude-x"), grown) == 0
    now[0] += 299.0
    cache.store(scope, grown)  # a use restarts the lifetime of the shared blocks
    now[0] += 299.0
    assert cache.cached_blocks(scope, grown) == 5
    now[0] += 2.0
    assert cache.cached_blocks(scope, grown) == 0
    cache.store(scope, grown)
    cache.clear()
    assert cache.cached_blocks(scope, grown) == 0


def test_the_prompt_cache_and_a_fixed_cache_read_exclude_each_other() -> None:
    with pytest.raises(ValueError, match="exclude each other"):
        Script(prompt_cache=True, cache_read=5)


# ----------------------------------------------------------------- real SDKs


async def test_anthropic_reports_reads_writes_and_uncached_input_as_the_api_does(
    server: EmulatorServer,
) -> None:
    client = anthropic.AsyncAnthropic(base_url=server.url, api_key=KEY, max_retries=0)
    turns: list[anthropic.types.Usage] = []
    first_turn: list[anthropic.types.MessageParam] = [{"role": "user", "content": LONG}]
    second_turn: list[anthropic.types.MessageParam] = [
        *first_turn,
        {"role": "assistant", "content": "noted"},
        {"role": "user", "content": "now the next step"},
    ]
    for history in (first_turn, second_turn):
        reply = await client.messages.create(
            model="claude-cache", max_tokens=64, messages=history, extra_headers=CACHED_ON
        )
        turns.append(reply.usage)
    first, second = turns
    sizes = [record.body_bytes for record in server.stats]
    # Turn 1: nothing cached; every whole block is written; input_tokens is the rest.
    assert first.cache_read_input_tokens == 0
    assert first.cache_creation_input_tokens == (sizes[0] // BLOCK_BYTES) * BLOCK_TOKENS
    assert first.cache_creation is not None
    assert first.cache_creation.ephemeral_5m_input_tokens == first.cache_creation_input_tokens
    assert first.input_tokens == sizes[0] // 4 - first.cache_creation_input_tokens
    # Turn 2 shares the first entry's whole blocks.
    assert second.cache_read_input_tokens == SHARED_BLOCKS * BLOCK_TOKENS
    written = (sizes[1] // BLOCK_BYTES - SHARED_BLOCKS) * BLOCK_TOKENS
    assert second.cache_creation_input_tokens == written
    assert second.input_tokens == sizes[1] // 4 - second.cache_read_input_tokens - written
    assert server.stats[1].cached_tokens == second.cache_read_input_tokens
    assert server.stats[1].cache_write_tokens == written


async def test_openai_chat_and_responses_report_the_shared_prefix_as_cached_tokens(
    server: EmulatorServer,
) -> None:
    client = openai.AsyncOpenAI(base_url=server.url + "/v1", api_key=KEY, max_retries=0)
    chat: list[int] = []
    first_chat: list[ChatCompletionMessageParam] = [{"role": "user", "content": LONG}]
    second_chat: list[ChatCompletionMessageParam] = [
        *first_chat,
        {"role": "assistant", "content": "noted"},
        {"role": "user", "content": "next"},
    ]
    for messages in (first_chat, second_chat):
        reply = await client.chat.completions.create(
            model="gpt-cache", messages=messages, extra_headers=CACHED_ON
        )
        assert reply.usage is not None and reply.usage.prompt_tokens_details is not None
        # OpenAI's prompt_tokens is the whole prompt, the cached part inside it.
        assert reply.usage.prompt_tokens == server.stats[-1].body_bytes // 4
        chat.append(reply.usage.prompt_tokens_details.cached_tokens or 0)
    responses: list[int] = []
    first_input: ResponseInputParam = [{"role": "user", "content": LONG}]
    second_input: ResponseInputParam = [
        *first_input,
        {"role": "assistant", "content": "noted"},
        {"role": "user", "content": "next"},
    ]
    for items in (first_input, second_input):
        answer = await client.responses.create(
            model="gpt-cache", input=items, extra_headers=CACHED_ON
        )
        assert answer.usage is not None
        responses.append(answer.usage.input_tokens_details.cached_tokens)
    assert chat == [0, SHARED_BLOCKS * BLOCK_TOKENS]
    assert responses == [0, SHARED_BLOCKS * BLOCK_TOKENS]


async def test_a_rejected_prompt_caches_nothing_and_a_reset_forgets_everything(
    server: EmulatorServer,
) -> None:
    body = {
        "model": "claude-cache",
        "max_tokens": 8,
        "messages": [{"role": "user", "content": LONG}],
    }
    overflow = {"x-emulator": "prompt_cache=1; overflow_above=1000"}
    async with aiohttp.ClientSession() as http:

        async def cached_read(headers: dict[str, str]) -> tuple[int, int]:
            async with http.post(server.url + "/v1/messages", json=body, headers=headers) as r:
                payload = await r.json()
                return r.status, payload.get("usage", {}).get("cache_read_input_tokens", -1)

        assert (await cached_read(overflow))[0] == 400
        assert await cached_read(CACHED_ON) == (200, 0)  # the 400 stored nothing
        assert (await cached_read(CACHED_ON))[1] > 0
        server.reset()
        assert await cached_read(CACHED_ON) == (200, 0)
        # Without the key nothing is looked up: the fixed figure (0) is reported.
        assert await cached_read({}) == (200, 0)


async def test_cli_prompt_cache_flag_turns_it_on_for_every_request() -> None:
    proc = await Proc.start(
        "emulator", "emulate", "--port", "0", "--prompt-cache", "--context-window-tokens", "100000"
    )
    try:
        url = (await proc.wait_line(r"listening on (http://\S+)", within=30))[1]
        client = openai.AsyncOpenAI(base_url=url + "/v1", api_key=KEY, max_retries=0)
        cached: list[int] = []
        for question in ("one", "two"):
            reply = await client.chat.completions.create(
                model="gpt-cli",
                messages=[
                    {"role": "user", "content": LONG},
                    {"role": "user", "content": question},
                ],
            )
            assert reply.usage is not None and reply.usage.prompt_tokens_details is not None
            cached.append(reply.usage.prompt_tokens_details.cached_tokens or 0)
        assert cached == [0, SHARED_BLOCKS * BLOCK_TOKENS]
    finally:
        await proc.stop()

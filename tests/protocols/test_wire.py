"""Wire metadata: structural decode, comparable verdict, digest, full parse (proxy/_wire.py)."""

from __future__ import annotations

import dataclasses
import json
import random
import time
import tracemalloc
import weakref
from typing import Any

import msgspec
import pytest
from hypothesis import given
from hypothesis import strategies as st

from proxy import _wire as wire
from proxy._protocols import Protocol
from proxy._wire import (
    WireError,
    WireMetadata,
    compute_wire_metadata,
    decode_body,
    digest_bytes,
    encode_body,
)

CHAT = Protocol.CHAT
RESPONSES = Protocol.RESPONSES
MESSAGES = Protocol.MESSAGES
COUNT_TOKENS = Protocol.COUNT_TOKENS

PNG_B64 = (
    "iVBORw0KGgoAAAANSUhEUgAAAAEAAAABCAYAAAAfFcSJAAAADUlEQVR4"
    "2mNkYPhfDwAChwGA60e6kgAAAABJRU5ErkJggg=="
)
SESSION_UUID = "5b0e4c1a-8d7e-4f0b-9a51-2f3c6d7e8a90"


def enc(obj: dict[str, Any]) -> bytes:
    return json.dumps(obj, ensure_ascii=False).encode()


def meta_of(protocol: Protocol | str, obj: dict[str, Any]) -> WireMetadata:
    body = enc(obj)
    return compute_wire_metadata(protocol, body, digest_bytes(body))


# --- the verdict table -------------------------------------------------------------------

SYSTEM = {"role": "system", "content": "You are a careful coding assistant."}
USER = {"role": "user", "content": "Why does my test hang on CI but not locally?"}
TOOL_CALL = {
    "id": "call_7Qm",
    "type": "function",
    "function": {"name": "read_file", "arguments": '{"path": "tests/test_io.py"}'},
}


def chat(*messages: Any, **extra: Any) -> dict[str, Any]:
    return {"model": "gpt-4.1", "stream": True, "messages": list(messages), **extra}


def responses(history: Any, **extra: Any) -> dict[str, Any]:
    return {"model": "gpt-5-codex", "instructions": "Be terse.", "input": history, **extra}


def anthropic(*messages: Any, **extra: Any) -> dict[str, Any]:
    return {
        "model": "claude-sonnet-4-5",
        "max_tokens": 4096,
        "system": [{"type": "text", "text": "You are Claude Code."}],
        "messages": list(messages),
        **extra,
    }


def text_block(text: str) -> dict[str, Any]:
    return {"type": "text", "text": text}


def image_block() -> dict[str, Any]:
    return {
        "type": "image",
        "source": {"type": "base64", "media_type": "image/png", "data": PNG_B64},
    }


TOOL_USE = {"type": "tool_use", "id": "toolu_01", "name": "Bash", "input": {"command": "ls"}}
FUNCTION_CALL = {
    "type": "function_call",
    "call_id": "call_9",
    "name": "shell",
    "arguments": '{"cmd": ["ls"]}',
}

# (id, protocol, body, comparable, message_count)
VERDICT_CASES: list[tuple[str, Protocol, dict[str, Any], bool, int]] = [
    # OpenAI chat completions
    (
        "chat-strings",
        CHAT,
        chat(SYSTEM, USER, {"role": "assistant", "content": "A race."}),
        True,
        3,
    ),
    (
        "chat-text-parts",
        CHAT,
        chat({"role": "user", "content": [text_block("part one"), text_block("part two")]}),
        True,
        1,
    ),
    (
        "chat-image-url",
        CHAT,
        chat(
            USER,
            {
                "role": "user",
                "content": [
                    text_block("what is this?"),
                    {"type": "image_url", "image_url": {"url": f"data:image/png;base64,{PNG_B64}"}},
                ],
            },
        ),
        False,
        2,
    ),
    (
        "chat-input-audio",
        CHAT,
        chat(
            {
                "role": "user",
                "content": [
                    {"type": "input_audio", "input_audio": {"data": "UklG", "format": "wav"}}
                ],
            }
        ),
        False,
        1,
    ),
    (
        "chat-file-part",
        CHAT,
        chat({"role": "user", "content": [{"type": "file", "file": {"file_id": "file-abc"}}]}),
        False,
        1,
    ),
    (
        "chat-tool-calls-null-content",
        CHAT,
        chat(
            USER,
            {"role": "assistant", "content": None, "tool_calls": [TOOL_CALL]},
            {"role": "tool", "tool_call_id": "call_7Qm", "content": "def test_io(): ..."},
        ),
        True,
        3,
    ),
    (
        "chat-tool-message-text-parts",
        CHAT,
        chat({"role": "tool", "tool_call_id": "call_7Qm", "content": [text_block("exit 0")]}),
        True,
        1,
    ),
    (
        "chat-assistant-audio",
        CHAT,
        chat(USER, {"role": "assistant", "content": None, "audio": {"id": "audio_abc123"}}),
        False,
        2,
    ),
    (
        "chat-audio-null",
        CHAT,
        chat({"role": "assistant", "content": "plain", "audio": None}),
        True,
        1,
    ),
    (
        "chat-null-content-no-tool-calls",
        CHAT,
        chat({"role": "assistant", "content": None}),
        False,
        1,
    ),
    (
        "chat-refusal-part",
        CHAT,
        chat({"role": "assistant", "content": [{"type": "refusal", "refusal": "I can't."}]}),
        False,
        1,
    ),
    (
        "chat-text-not-string",
        CHAT,
        chat({"role": "user", "content": [{"type": "text", "text": 5}]}),
        False,
        1,
    ),
    ("chat-content-int", CHAT, chat({"role": "user", "content": 7}), False, 1),
    ("chat-messages-number", CHAT, {"model": "gpt-4.1", "messages": 3}, False, 0),
    ("chat-messages-string", CHAT, {"model": "gpt-4.1", "messages": "hi"}, True, 1),
    ("chat-no-messages", CHAT, {"model": "gpt-4.1"}, False, 0),
    ("chat-message-null", CHAT, chat(USER, None), False, 2),
    ("chat-type-null", CHAT, chat({"type": None, "role": "user", "content": "x"}), False, 1),
    # OpenAI Responses
    ("responses-string", RESPONSES, responses("Fix the flaky test."), True, 1),
    (
        "responses-easy-messages",
        RESPONSES,
        responses([{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]),
        True,
        2,
    ),
    (
        "responses-message-items",
        RESPONSES,
        responses(
            [
                {
                    "type": "message",
                    "role": "user",
                    "content": [{"type": "input_text", "text": "run it"}],
                },
                {
                    "type": "message",
                    "role": "assistant",
                    "id": "msg_1",
                    "status": "completed",
                    "content": [{"type": "output_text", "text": "done", "annotations": []}],
                },
            ]
        ),
        True,
        2,
    ),
    (
        "responses-function-call-roundtrip",
        RESPONSES,
        responses(
            [
                {"role": "user", "content": "list files"},
                FUNCTION_CALL,
                {"type": "function_call_output", "call_id": "call_9", "output": "a.py\nb.py\n"},
            ]
        ),
        True,
        3,
    ),
    (
        "responses-function-call-output-parts",
        RESPONSES,
        responses(
            [
                FUNCTION_CALL,
                {
                    "type": "function_call_output",
                    "call_id": "call_9",
                    "output": [{"type": "input_text", "text": "a.py"}],
                },
            ]
        ),
        True,
        2,
    ),
    (
        "responses-function-call-output-image",
        RESPONSES,
        responses(
            [
                FUNCTION_CALL,
                {
                    "type": "function_call_output",
                    "call_id": "call_9",
                    "output": [
                        {"type": "input_text", "text": "screenshot:"},
                        {"type": "input_image", "image_url": f"data:image/png;base64,{PNG_B64}"},
                    ],
                },
            ]
        ),
        False,
        2,
    ),
    (
        "responses-function-call-output-without-output",
        RESPONSES,
        responses([{"type": "function_call_output", "call_id": "call_9"}]),
        False,
        1,
    ),
    (
        "responses-input-image",
        RESPONSES,
        responses(
            [
                {
                    "role": "user",
                    "content": [
                        {"type": "input_text", "text": "what is this?"},
                        {"type": "input_image", "image_url": "https://example.com/cat.png"},
                    ],
                }
            ]
        ),
        False,
        1,
    ),
    (
        "responses-input-file",
        RESPONSES,
        responses([{"role": "user", "content": [{"type": "input_file", "file_id": "file-1"}]}]),
        False,
        1,
    ),
    (
        "responses-input-audio",
        RESPONSES,
        responses(
            [
                {
                    "role": "user",
                    "content": [
                        {"type": "input_audio", "input_audio": {"data": "UklG", "format": "wav"}}
                    ],
                }
            ]
        ),
        False,
        1,
    ),
    (
        "responses-reasoning-item",
        RESPONSES,
        responses(
            [
                {"role": "user", "content": "think"},
                {"type": "reasoning", "id": "rs_1", "summary": [], "encrypted_content": "gAAAA"},
                {
                    "type": "message",
                    "role": "assistant",
                    "content": [{"type": "output_text", "text": "ok"}],
                },
            ]
        ),
        False,
        3,
    ),
    (
        "responses-item-reference",
        RESPONSES,
        responses([{"type": "item_reference", "id": "msg_1"}]),
        False,
        1,
    ),
    (
        "responses-no-input",
        RESPONSES,
        {"model": "gpt-5-codex", "previous_response_id": "resp_1"},
        False,
        0,
    ),
    ("responses-input-object", RESPONSES, responses({"role": "user", "content": "x"}), False, 0),
    # Anthropic messages
    (
        "anthropic-strings",
        MESSAGES,
        anthropic({"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}),
        True,
        2,
    ),
    (
        "anthropic-text-blocks",
        MESSAGES,
        anthropic(
            {
                "role": "user",
                "content": [
                    {"type": "text", "text": "<system-reminder>ctx</system-reminder>"},
                    {"type": "text", "text": "fix it", "cache_control": {"type": "ephemeral"}},
                ],
            }
        ),
        True,
        1,
    ),
    (
        "anthropic-tool-use-and-string-result",
        MESSAGES,
        anthropic(
            {"role": "user", "content": "list files"},
            {"role": "assistant", "content": [text_block("Listing."), TOOL_USE]},
            {
                "role": "user",
                "content": [{"type": "tool_result", "tool_use_id": "toolu_01", "content": "a.py"}],
            },
        ),
        True,
        3,
    ),
    (
        "anthropic-tool-result-nested-text-list",
        MESSAGES,
        anthropic(
            {"role": "assistant", "content": [TOOL_USE]},
            {
                "role": "user",
                "content": [
                    {
                        "type": "tool_result",
                        "tool_use_id": "toolu_01",
                        "content": [text_block("a.py"), text_block("b.py")],
                    }
                ],
            },
        ),
        True,
        2,
    ),
    (
        "anthropic-tool-result-nested-image",
        MESSAGES,
        anthropic(
            {"role": "assistant", "content": [TOOL_USE]},
            {
                "role": "user",
                "content": [
                    {
                        "type": "tool_result",
                        "tool_use_id": "toolu_01",
                        "content": [text_block("screenshot:"), image_block()],
                    }
                ],
            },
        ),
        False,
        2,
    ),
    (
        "anthropic-tool-result-without-content",
        MESSAGES,
        anthropic(
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_01"}]}
        ),
        False,
        1,
    ),
    (
        "anthropic-image",
        MESSAGES,
        anthropic({"role": "user", "content": [image_block(), text_block("what is this?")]}),
        False,
        1,
    ),
    (
        "anthropic-document",
        MESSAGES,
        anthropic(
            {
                "role": "user",
                "content": [
                    {
                        "type": "document",
                        "source": {
                            "type": "base64",
                            "media_type": "application/pdf",
                            "data": "JVBE",
                        },
                    }
                ],
            }
        ),
        False,
        1,
    ),
    (
        "anthropic-thinking",
        MESSAGES,
        anthropic(
            {"role": "user", "content": "plan"},
            {
                "role": "assistant",
                "content": [{"type": "thinking", "thinking": "hmm", "signature": "EqQB"}, TOOL_USE],
            },
        ),
        False,
        2,
    ),
    (
        "anthropic-redacted-thinking",
        MESSAGES,
        anthropic(
            {"role": "assistant", "content": [{"type": "redacted_thinking", "data": "EmwK"}]}
        ),
        False,
        1,
    ),
    ("anthropic-content-int", MESSAGES, anthropic({"role": "user", "content": 5}), False, 1),
    (
        "anthropic-messages-object",
        MESSAGES,
        {"model": "claude", "messages": {"role": "user"}},
        False,
        0,
    ),
    # Anthropic count_tokens: same rules on `messages`
    (
        "count-tokens-plain",
        COUNT_TOKENS,
        {
            "model": "claude-sonnet-4-5",
            "messages": [{"role": "user", "content": [text_block("hi")]}],
        },
        True,
        1,
    ),
    (
        "count-tokens-image",
        COUNT_TOKENS,
        {"model": "claude-sonnet-4-5", "messages": [{"role": "user", "content": [image_block()]}]},
        False,
        1,
    ),
    # pass-through protocols
    (
        "openai-embeddings-input",
        Protocol.OPENAI,
        {"model": "text-embedding-3-small", "input": "hello"},
        True,
        1,
    ),
    (
        "openai-completions-prompt",
        Protocol.OPENAI,
        {"model": "gpt-3.5-turbo-instruct", "prompt": "x"},
        True,
        0,
    ),
    (
        "anthropic-batches",
        Protocol.ANTHROPIC,
        {"requests": [{"custom_id": "a", "params": {"messages": [image_block()]}}]},
        True,
        0,
    ),
    (
        "openai-passthrough-messages-image",
        Protocol.OPENAI,
        chat({"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}),
        False,
        1,
    ),
]


@pytest.fixture(params=["small-body path", "general path"])
def decode_path(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """Run a test on both structural decoders.

    Bodies and histories up to ``_FAST_ITEMS_BYTES`` take a one-pass decode;
    larger ones the general lazy path. Test bodies are small, so the general
    path is forced by setting the threshold below every size.
    """
    if request.param == "general path":
        monkeypatch.setattr(wire, "_FAST_ITEMS_BYTES", -1)
    return str(request.param)


@pytest.mark.usefixtures("decode_path")
@pytest.mark.parametrize(
    ("protocol", "body", "comparable", "count"),
    [pytest.param(*case[1:], id=case[0]) for case in VERDICT_CASES],
)
def test_verdict_table(
    protocol: Protocol, body: dict[str, Any], comparable: bool, count: int
) -> None:
    meta = meta_of(protocol, body)
    assert meta.comparable is comparable
    assert meta.message_count == count
    assert meta.protocol is protocol  # the enum member, not only its string


@pytest.mark.parametrize(
    ("protocol", "body", "comparable", "count"),
    [pytest.param(*case[1:], id=case[0]) for case in VERDICT_CASES],
)
def test_verdict_table_matches_reference_rules(
    protocol: Protocol, body: dict[str, Any], comparable: bool, count: int
) -> None:
    """The hand-written expectations agree with a direct reading of docs/design.md §4."""
    if protocol is RESPONSES:
        history = body.get("input")
    elif protocol in (CHAT, MESSAGES, COUNT_TOKENS) or "messages" in body:
        history = body.get("messages")
    else:
        history = body.get("input")
    if history is None and protocol in (Protocol.OPENAI, Protocol.ANTHROPIC):
        assert comparable
    else:
        assert reference_history(history) is comparable


PLAIN_TYPES = {
    "message",
    "text",
    "input_text",
    "output_text",
    "tool_use",
    "tool_result",
    "function_call",
    "function_call_output",
}


def reference_verdict(value: Any) -> bool:
    """docs/design.md §4 over fully parsed Python objects (the oracle)."""
    if isinstance(value, str):
        return True
    if isinstance(value, list):
        return all(reference_verdict(item) for item in value)
    if not isinstance(value, dict):
        return False
    payload = value.get("content")
    if "type" in value:
        kind = value["type"]
        if not isinstance(kind, str) or kind not in PLAIN_TYPES:
            return False
        if kind in ("tool_use", "function_call"):
            return True
        if kind == "function_call_output":
            payload = value.get("output")
    if value.get("audio") is not None:
        return False
    if payload is not None:
        return reference_verdict(payload)
    return isinstance(value.get("text"), str) or isinstance(value.get("tool_calls"), list)


def reference_history(value: Any) -> bool:
    """The verdict of a whole `messages` / `input` value: only a string or a list is a
    history; any other top-level shape is unexpected and so not comparable."""
    return isinstance(value, str | list) and reference_verdict(value)


def random_value(rng: random.Random, depth: int) -> Any:
    roll = rng.random()
    if depth >= 4 or roll < 0.3:
        return rng.choice(["txt", "", 0, 1.5, True, False, None, "ünï😀"])
    if roll < 0.55:
        return [random_value(rng, depth + 1) for _ in range(rng.randint(0, 3))]
    keys = rng.sample(["type", "content", "audio", "output", "text", "tool_calls", "role", "x"], 3)
    obj: dict[str, Any] = {}
    for key in keys:
        if key == "type":
            obj[key] = rng.choice([*sorted(PLAIN_TYPES), "image", "reasoning", "thinking", None, 3])
        elif key == "audio":
            obj[key] = rng.choice([None, {"id": "a"}, "x"])
        else:
            obj[key] = random_value(rng, depth + 1)
    return obj


@pytest.mark.usefixtures("decode_path")
def test_random_shapes_never_raise_and_follow_the_rules() -> None:
    rng = random.Random(20240611)
    for _ in range(600):
        protocol = rng.choice([CHAT, RESPONSES, MESSAGES, COUNT_TOKENS])
        history = random_value(rng, 0)
        field = "input" if protocol is RESPONSES else "messages"
        body = {
            "model": rng.choice(["m", 1, None, ["m"]]),
            "stream": rng.choice([True, False, "true", 1, None]),
            "metadata": rng.choice([None, 1, {"user_id": 2}, {"user_id": "u"}, "s"]),
            "prompt_cache_key": rng.choice([None, 1, "k"]),
            field: history,
        }
        meta = meta_of(protocol, body)
        assert meta.comparable is reference_history(history), body
        expected_count = (
            len(history) if isinstance(history, list) else int(isinstance(history, str))
        )
        assert meta.message_count == expected_count
        assert meta.model == (body["model"] if isinstance(body["model"], str) else None)
        assert meta.stream is (body["stream"] is True)


# --- scalars, model, stream, session hint ------------------------------------------------


@pytest.mark.usefixtures("decode_path")
def test_scalars_are_read_from_the_body() -> None:
    body = enc(chat(SYSTEM, USER))
    meta = compute_wire_metadata("openai-chat", body, "0123")
    assert meta == WireMetadata(
        protocol=Protocol.CHAT,
        model="gpt-4.1",
        stream=True,
        message_count=2,
        byte_length=len(body),
        digest="0123",
        comparable=True,
        session_hint=None,
    )


@pytest.mark.parametrize(
    ("fields", "model", "stream"),
    [
        ({}, None, False),
        ({"model": "gpt-4o", "stream": False}, "gpt-4o", False),
        ({"model": 4, "stream": "true"}, None, False),
        ({"model": None, "stream": 1}, None, False),
        ({"model": {"name": "x"}, "stream": None}, None, False),
        ({"model": "m" * 5000}, None, False),
        ({"model": ""}, None, False),
        ({"model": "gpt-\u00e9", "stream": True}, "gpt-\u00e9", True),
    ],
)
def test_model_and_stream_of_odd_types(
    fields: dict[str, Any], model: str | None, stream: bool
) -> None:
    meta = meta_of(CHAT, {"messages": [USER], **fields})
    assert meta.model == model
    assert meta.stream is stream


CLAUDE_CODE_USER_ID = (
    "user_3f9a1c0e5b7d2a4c6e8f0a1b3c5d7e9f1a3b5c7d9e1f3a5b7c9d1e3f5a7b9c1d"
    f"_account_0c1d2e3f-4a5b-6c7d-8e9f-0a1b2c3d4e5f_session_{SESSION_UUID}"
)


@pytest.mark.usefixtures("decode_path")
@pytest.mark.parametrize(
    ("protocol", "extra", "hint"),
    [
        (RESPONSES, {"prompt_cache_key": "codex-thread-42"}, "codex-thread-42"),
        (RESPONSES, {"prompt_cache_key": ""}, None),
        (RESPONSES, {"prompt_cache_key": 42}, None),
        (RESPONSES, {"prompt_cache_key": "k" * 5000}, None),
        (RESPONSES, {}, None),
        (MESSAGES, {"metadata": {"user_id": CLAUDE_CODE_USER_ID}}, SESSION_UUID),
        (
            MESSAGES,
            {
                "metadata": {
                    "user_id": json.dumps(
                        {"device_id": "d1", "account_uuid": "a1", "session_id": SESSION_UUID}
                    )
                }
            },
            SESSION_UUID,
        ),
        (
            MESSAGES,
            {"metadata": {"user_id": '{"device_id": "d1"}'}},
            '{"device_id": "d1"}',
        ),
        (MESSAGES, {"metadata": {"user_id": '{"session_id": 7}'}}, '{"session_id": 7}'),
        (MESSAGES, {"metadata": {"user_id": "{not json"}}, "{not json"),
        (MESSAGES, {"metadata": {"user_id": "alice@example.com"}}, "alice@example.com"),
        (MESSAGES, {"metadata": {"user_id": "user_x_session_"}}, "user_x_session_"),
        (MESSAGES, {"metadata": {"user_id": 12}}, None),
        (MESSAGES, {"metadata": {"user_id": ""}}, None),
        (MESSAGES, {"metadata": "user_x"}, None),
        (MESSAGES, {}, None),
        (COUNT_TOKENS, {"metadata": {"user_id": CLAUDE_CODE_USER_ID}}, SESSION_UUID),
    ],
)
def test_session_hint(protocol: Protocol, extra: dict[str, Any], hint: str | None) -> None:
    body = responses("hi", **extra) if protocol is RESPONSES else anthropic(USER, **extra)
    assert meta_of(protocol, body).session_hint == hint


def test_session_hint_survives_a_lone_surrogate_in_user_id_json() -> None:
    user_id = '{"session_id": "\\ud800"}'  # valid outer string, invalid inner JSON
    meta = meta_of(MESSAGES, anthropic(USER, metadata={"user_id": user_id}))
    assert meta.session_hint == user_id


# --- digest ------------------------------------------------------------------------------


def test_digest_is_of_the_wire_bytes_and_a_reformat_keeps_the_verdict() -> None:
    obj = anthropic(
        {"role": "user", "content": "list files"},
        {"role": "assistant", "content": [TOOL_USE]},
        {
            "role": "user",
            "content": [{"type": "tool_result", "tool_use_id": "toolu_01", "content": "a.py"}],
        },
    )
    compact = msgspec.json.encode(obj)
    pretty = msgspec.json.format(compact, indent=2)
    assert compact != pretty and json.loads(compact) == json.loads(pretty)

    first = compute_wire_metadata(MESSAGES, compact, digest_bytes(compact))
    second = compute_wire_metadata(MESSAGES, pretty, digest_bytes(pretty))
    assert first.digest != second.digest
    assert first.byte_length == len(compact) and second.byte_length == len(pretty)
    assert (first.comparable, first.message_count, first.model) == (
        second.comparable,
        second.message_count,
        second.model,
    )
    assert first.comparable is True


def test_digest_bytes_is_xxh3_128_of_any_buffer() -> None:
    # The ledger persists digests, so the algorithm and format must not silently change.
    # XXH3_128 of empty input, as published by the xxHash reference implementation:
    assert digest_bytes(b"") == "99aa06d3014798d86001c324468d497f"
    body = b'{"model":"m"}'
    expected = "47e034b92c24fe23f0c65046d631177d"
    assert digest_bytes(body) == expected
    assert digest_bytes(bytearray(body)) == expected
    assert digest_bytes(memoryview(body)) == expected
    assert digest_bytes(body + b" ") != expected


# --- errors ------------------------------------------------------------------------------


BAD_BODIES = [
    pytest.param(b"", id="empty"),
    pytest.param(b'{"model": "m", "api_key": "sk-secret-123"', id="truncated"),
    pytest.param(b'{"model": "m"} trailing', id="trailing"),
    pytest.param(b"[1, 2]", id="array"),
    pytest.param(b'"sk-secret-123"', id="string"),
    pytest.param(b"null", id="null"),
    pytest.param(b'{"messages": [], "x": "\xff sk-secret-123"}', id="bad-utf8-in-skipped-field"),
    pytest.param(b'{"\xc0\xaf": 1}', id="overlong-utf8-key"),
    pytest.param(b'{"x": "\xed\xa0\x80"}', id="utf8-encoded-surrogate"),
    pytest.param(b'{"x": "\xe2\x82"}', id="truncated-utf8-sequence"),
    pytest.param(b'{"x": "\\ud800"}', id="lone-surrogate-escape"),
    pytest.param(b'{"messages":' + b"[" * 50_000 + b"]" * 50_000 + b"}", id="nested-too-deep"),
]


@pytest.mark.parametrize("body", BAD_BODIES)
def test_bad_bodies_raise_wire_error_without_quoting_the_body(body: bytes) -> None:
    with pytest.raises(WireError) as meta_error:
        compute_wire_metadata(CHAT, body, "d")
    with pytest.raises(WireError) as full_error:
        decode_body(body)
    for error in (meta_error.value, full_error.value):
        assert isinstance(error, ValueError)
        assert "sk-secret" not in str(error)
        assert len(str(error)) < 80
        assert error.__cause__ is None and error.__context__ is None


def test_non_object_and_non_utf8_errors_say_what_is_wrong() -> None:
    with pytest.raises(WireError, match="not a JSON object"):
        compute_wire_metadata(CHAT, b"[]", "d")
    with pytest.raises(WireError, match="UTF-8"):
        compute_wire_metadata(CHAT, b'{"x":"\xff"}', "d")
    with pytest.raises(WireError, match="not valid JSON"):
        compute_wire_metadata(CHAT, b"{", "d")
    with pytest.raises(WireError, match="not a JSON object"):
        decode_body(b"[]")


@pytest.mark.parametrize("padding", range(4))
def test_multibyte_characters_across_validation_slices_are_accepted(padding: int) -> None:
    # 4-byte characters across ~400 KB: whatever the slice size, some slice boundary
    # falls inside a character for one of the paddings.
    text = "x" * padding + "\U0001f600" * 100_000 + "é"
    body = enc(chat({"role": "user", "content": text}))
    assert compute_wire_metadata(CHAT, body, "d").comparable is True
    assert decode_body(body)["messages"][0]["content"] == text


def test_unknown_protocol_name_is_a_caller_error_not_a_body_error() -> None:
    with pytest.raises(ValueError) as info:
        compute_wire_metadata("openai-chats", b"{}", "d")
    assert not isinstance(info.value, WireError)


def test_deep_but_parseable_nesting_is_not_comparable_and_does_not_raise() -> None:
    nested: Any = "leaf"
    for _ in range(40):
        nested = {"role": "user", "content": nested}
    arrays = b'{"messages":[' + b"[" * 600 + b"]" * 600 + b"]}"
    assert meta_of(CHAT, {"messages": [nested]}).comparable is False
    assert meta_of(CHAT, {"messages": [{"content": {"content": {"content": "x"}}}]}).comparable
    meta = compute_wire_metadata(CHAT, arrays, "d")
    assert (meta.comparable, meta.message_count) == (False, 1)


# --- the result holds scalars only and pins nothing --------------------------------------


def test_result_is_frozen_slotted_and_scalar_only() -> None:
    meta = meta_of(MESSAGES, anthropic(USER, metadata={"user_id": CLAUDE_CODE_USER_ID}))
    with pytest.raises(dataclasses.FrozenInstanceError):
        meta.comparable = False  # type: ignore[misc]
    assert not hasattr(meta, "__dict__")
    for field in dataclasses.fields(meta):
        value = getattr(meta, field.name)
        assert type(value) in (Protocol, str, int, bool, type(None)), (field.name, type(value))
    # The enum member (a singleton, so it pins nothing), typed as the public API says;
    # as a StrEnum it still formats and serializes as the plain string.
    assert meta.protocol is Protocol.MESSAGES
    assert (f"{meta.protocol}", json.dumps(meta.protocol)) == (
        "anthropic-messages",
        '"anthropic-messages"',
    )


def big_enough_history() -> bytes:
    return enc(
        anthropic(
            {"role": "user", "content": [text_block("a" * 1000)]},
            {"role": "assistant", "content": [TOOL_USE]},
            {
                "role": "user",
                "content": [{"type": "tool_result", "tool_use_id": "t", "content": "ok"}],
            },
            metadata={"user_id": CLAUDE_CODE_USER_ID},
        )
    )


def test_no_view_into_a_bytearray_survives_the_call() -> None:
    buffer = bytearray(big_enough_history())
    # Control: a live Raw view into the buffer does block resizing.
    raw = msgspec.json.decode(buffer, type=dict[str, msgspec.Raw])
    with pytest.raises(BufferError):
        buffer.extend(b" ")
    del raw

    meta = compute_wire_metadata(MESSAGES, buffer, digest_bytes(buffer))
    assert meta.comparable is True and meta.session_hint == SESSION_UUID
    buffer.extend(b"  ")  # would raise BufferError if a view were still alive
    del buffer[:]


def test_no_view_survives_a_failed_call() -> None:
    buffer = bytearray(b'{"messages": [1, 2], "x": ')
    with pytest.raises(WireError):
        compute_wire_metadata(CHAT, buffer, "d")
    buffer.extend(b"0}")
    assert compute_wire_metadata(CHAT, buffer, "d").message_count == 2


def test_a_memoryview_input_can_be_released_after_the_call() -> None:
    body = big_enough_history()
    view = memoryview(body)
    meta = compute_wire_metadata(MESSAGES, view, digest_bytes(view))
    view.release()  # raises BufferError while anything still exports from it
    assert meta == compute_wire_metadata(MESSAGES, body, digest_bytes(body))


class Body(bytearray):
    """A weakref'able buffer."""


def test_the_input_buffer_is_collectable_after_the_call() -> None:
    holder = Body(big_enough_history())
    ref = weakref.ref(holder)
    meta = compute_wire_metadata(MESSAGES, holder, digest_bytes(holder))
    del holder
    assert ref() is None  # plain refcounting freed it: nothing else points at it
    assert meta.message_count == 3


# --- every parse goes through one function ------------------------------------------------


def test_every_parse_goes_through_the_decoder_hook(monkeypatch: pytest.MonkeyPatch) -> None:
    body = enc(chat(SYSTEM, USER))

    def refuse(decoder: Any, data: Any) -> Any:
        raise AssertionError("parsed")

    monkeypatch.setattr(wire, "_decode_json", refuse)
    with pytest.raises(AssertionError, match="parsed"):
        compute_wire_metadata(CHAT, body, "d")
    with pytest.raises(AssertionError, match="parsed"):
        decode_body(body)


def test_structural_decode_never_materializes_message_text(monkeypatch: pytest.MonkeyPatch) -> None:
    long_text = "This line is long enough to notice. " * 200
    body = enc(
        chat(
            {"role": "system", "content": long_text},
            {"role": "user", "content": [text_block(long_text)]},
            {"role": "assistant", "content": None, "tool_calls": [TOOL_CALL]},
            {"role": "tool", "tool_call_id": "call_7Qm", "content": long_text},
        )
    )
    original = wire._decode_json
    results: list[Any] = []

    def record(decoder: Any, data: Any) -> Any:
        result = original(decoder, data)
        results.append(result)
        return result

    monkeypatch.setattr(wire, "_decode_json", record)
    meta = compute_wire_metadata(CHAT, body, "d")
    assert meta.comparable is True
    strings = [r for r in results if isinstance(r, str)]
    # The model, nothing else: a plainly spelled part type is known by its bytes.
    assert strings == ["gpt-4.1"]
    assert not any(isinstance(r, dict) for r in results)  # no full parse


_TYPE_SPELLINGS = st.one_of(
    st.sampled_from(sorted(wire._PLAIN_TYPES)).map(json.dumps),
    # The same names with one character escaped (a decode must see through it).
    st.sampled_from(sorted(wire._PLAIN_TYPES)).map(lambda t: f'"\\u{ord(t[0]):04x}{t[1:]}"'),
    st.text(max_size=12).map(json.dumps),
    st.text(max_size=300).map(json.dumps),
    st.sampled_from(["null", "1", "true", "[]", '{"a":1}', '["text"]']),
)


@given(_TYPE_SPELLINGS)
def test_the_known_type_lookup_agrees_with_decoding_the_type(spelled: str) -> None:
    raw = msgspec.json.decode(b"[%s]" % spelled.encode(), type=list[msgspec.Raw])[0]
    assert wire._type_name(raw) == wire._short_str(raw, wire._MAX_TYPE_BYTES)


def test_every_known_type_spelled_plainly_is_known_by_its_bytes() -> None:
    for kind in wire._PLAIN_TYPES:
        raw = msgspec.json.decode(b'["%s"]' % kind.encode(), type=list[msgspec.Raw])[0]
        assert wire._type_name(raw) == kind


def test_verdict_stops_at_the_first_non_comparable_item(monkeypatch: pytest.MonkeyPatch) -> None:
    image = {"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}
    body = enc(chat(image, *[USER] * 2000))
    original = wire._decode_json
    calls = 0

    def count(decoder: Any, data: Any) -> Any:
        nonlocal calls
        calls += 1
        return original(decoder, data)

    monkeypatch.setattr(wire, "_decode_json", count)
    meta = compute_wire_metadata(CHAT, body, "d")
    assert (meta.comparable, meta.message_count) == (False, 2001)
    assert calls <= 8  # envelope, model, list, first message and its parts: not 2000 items


# --- full parse and serialization ---------------------------------------------------------


def test_decode_and_encode_round_trip_keeps_content_and_key_order() -> None:
    obj = anthropic(
        {"role": "user", "content": 'zürich 😀 \u2028 "quoted"'},
        metadata={"user_id": CLAUDE_CODE_USER_ID},
        temperature=0.2,
        stop_sequences=None,
    )
    body = enc(obj)
    parsed = decode_body(bytearray(body))
    assert parsed == json.loads(body)
    assert list(parsed) == list(obj)
    encoded = encode_body(parsed)
    assert isinstance(encoded, bytes)
    assert json.loads(encoded) == obj
    assert list(json.loads(encoded)) == list(obj)


def test_encode_body_refuses_values_json_cannot_hold() -> None:
    with pytest.raises(TypeError):
        encode_body({"when": object()})


# --- memory: a 64 MB chat body -----------------------------------------------------------

SENTENCES = [
    "The scheduler retries the job after the lock times out.",
    "Ich habe die Konfiguration geprüft, aber der Fehler bleibt bestehen.",
    "def handler(request):\n    return await relay(request, timeout=30.0)\n",
    "Le processus s'arrête quand la mémoire dépasse la limite fixée.",
    "日志显示上游在第二次重试时返回了 400 错误。",
    'Traceback (most recent call last):\n  File "app.py", line 42, in <module>\n',
    'She said "ship it" and the pipeline went green 🚀 on the first try.',
    "SELECT id, created_at FROM exchanges WHERE status = 'streaming' ORDER BY id;",
    "Проверьте, что клиент закрывает соединение после ответа.",
    "Tabs\tand backslashes \\ and control-ish text \u2028 all need escaping.",
    "The flaky test only fails on CI because two cores change the interleaving.",
    "A tombstone keeps late requests for a closed session from reviving it.",
]


def generate_chat_body(target_bytes: int, seed: int = 11) -> tuple[bytes, int]:
    """A chat body of about ``target_bytes``: varied text, parts, tool calls and results."""
    rng = random.Random(seed)
    texts = [" ".join(rng.choices(SENTENCES, k=rng.randint(30, 140))) for _ in range(97)]
    messages: list[dict[str, Any]] = [{"role": "system", "content": texts[0]}]
    encode = msgspec.json.Encoder().encode
    size = 0
    i = 0
    while size < target_bytes:
        text = texts[i % len(texts)]
        shape = i % 5
        message: dict[str, Any]
        if shape == 0:
            message = {"role": "user", "content": text}
        elif shape == 1:
            message = {
                "role": "user",
                "content": [text_block(text[:2000]), text_block(text[2000:])],
            }
        elif shape == 2:
            call = {
                "id": f"call_{i}",
                "type": "function",
                "function": {"name": "grep", "arguments": json.dumps({"pattern": text[:300]})},
            }
            message = {"role": "assistant", "content": text[:500], "tool_calls": [call]}
        elif shape == 3:
            message = {"role": "tool", "tool_call_id": f"call_{i - 1}", "content": text}
        else:
            message = {"role": "assistant", "content": text, "audio": None}
        messages.append(message)
        size += len(encode(message)) + 1
        i += 1
    body = encode({"model": "gpt-4.1", "stream": True, "temperature": 0, "messages": messages})
    return body, len(messages)


@pytest.mark.timeout(30)
def test_64mb_chat_body_structure_costs_under_3mb() -> None:
    started = time.monotonic()
    body, count = generate_chat_body(64 * 1024 * 1024)
    assert len(body) >= 60 * 1024 * 1024
    digest = digest_bytes(body)

    tracemalloc.start()
    try:
        meta = compute_wire_metadata(CHAT, body, digest)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()

    assert peak < 3 * 1024 * 1024, f"peak {peak / 2**20:.2f} MiB"
    assert meta.comparable is True
    assert meta.message_count == count
    assert (meta.model, meta.stream, meta.byte_length) == ("gpt-4.1", True, len(body))
    assert time.monotonic() - started < 10


def test_utf8_check_of_a_1mib_body_costs_a_small_share_of_it() -> None:
    # Mostly ASCII with an emoji now and then: each decoded slice becomes a str of 4
    # bytes per character (issue 11 item 4: with 128 KiB slices that peaked at ~1 B).
    text = ("plain words and code() " * 170 + "\U0001f600 ") * 300
    body = msgspec.json.encode(
        {
            "model": "gpt-4.1",
            "messages": [
                {"role": "user", "content": text[i : i + 4096]} for i in range(0, len(text), 4096)
            ],
        }
    )
    assert 1 << 20 <= len(body) < 5 * 2**20 // 4
    tracemalloc.start()
    try:
        meta = compute_wire_metadata(CHAT, body, digest_bytes(body))
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert meta.byte_length == len(body) and meta.comparable is True
    assert peak < len(body) // 20, f"peak {peak} bytes for a {len(body)}-byte body"


_PLAIN_JSON = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(),
    lambda children: st.lists(children) | st.dictionaries(st.text(), children),
    max_leaves=40,
)


@given(st.dictionaries(st.text(), _PLAIN_JSON))
def test_encodes_plainly_is_never_wrong_about_the_encoder(obj: dict[str, Any]) -> None:
    """When it vouches for an object, encode_body succeeds on it (raw is dropped first)."""
    try:
        wire.encode_body(obj)
        encodes = True
    except (TypeError, ValueError, RecursionError, OverflowError):
        encodes = False
    if wire.encodes_plainly(obj):
        assert encodes


def test_encodes_plainly_declines_what_the_encoder_refuses() -> None:
    cycle: list[Any] = []
    cycle.append(cycle)
    deep: list[Any] = []
    for _ in range(300):
        deep = [deep]
    for bad in ("x\ud800", {"k\udc00": 1}, {"k": object()}, {"k": {1, 2}}, cycle, deep):
        assert wire.encodes_plainly({"messages": [{"content": bad}]}) is False
    assert wire.encodes_plainly({"messages": [{"role": "user", "content": "h\u00e9 \U0001f600"}]})

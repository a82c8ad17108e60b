"""The built-in fold plugin: what each fold level elides, and what it never breaks (pure)."""

from __future__ import annotations

import copy
import dataclasses
import itertools
import json
import tracemalloc
from collections.abc import Callable, Iterator
from typing import Any

import msgspec
import pytest

from plugins.fold import DEFAULT_PLACEHOLDER, FoldPlugin
from proxy._plugins import PluginError, PluginHost, PrepareContext, load_plugins
from proxy._protocols import Protocol
from proxy._structure import Draft, Splice
from proxy._wire import WireMetadata

MARK = DEFAULT_PLACEHOLDER.split("{n}")[0]  # "[elided by context-proxy: "

_WORDS = (
    "the parser reads one token at a time from the stream buffer and keeps the context "
    "window small while the answer streams back to the client "
)


def text(tag: str, size: int) -> str:
    """Deterministic ASCII prose of exactly ``size`` characters, tagged for debugging."""
    unit = f"[{tag}] {_WORDS}"
    return (unit * (size // len(unit) + 1))[:size]


def b64(size: int) -> str:
    """A fake base64 payload of ``size`` characters (a PNG's magic, then filler)."""
    return ("iVBORw0KGgo" + "QUJD" * size)[:size]


def encode(body: dict[str, Any]) -> bytes:
    return msgspec.json.encode(body)


def walk(value: Any) -> Iterator[Any]:
    """Every dict and list inside ``value``, depth first (bounded by the body's size)."""
    stack = [value]
    while stack:
        node = stack.pop()
        if isinstance(node, dict):
            yield node
            stack.extend(node.values())
        elif isinstance(node, list):
            yield node
            stack.extend(node)


@dataclasses.dataclass
class Folding:
    """A prepare context over ``body``'s JSON bytes, and where to put the result."""

    ctx: PrepareContext
    draft: Draft
    body: dict[str, Any]


def make_ctx(
    protocol: Protocol,
    body: dict[str, Any],
    level: int,
    path: str,
    message_count: int | None = None,
) -> Folding:
    if message_count is None:
        entries = body.get("input", body.get("messages"))
        message_count = len(entries) if isinstance(entries, list) else 0
    data = encode(body)
    meta = WireMetadata(
        protocol=protocol,
        model="test-model",
        stream=True,
        message_count=message_count,
        byte_length=len(data),
        digest="0" * 32,
        comparable=False,
        session_hint=None,
    )
    draft = Draft(protocol, base=data)
    ctx = PrepareContext(meta=meta, fold_level=level, session_id=None, path=path, draft=draft)
    return Folding(ctx, draft, body)


async def run(plugin: FoldPlugin, folding: Folding) -> bool:
    """``plugin.prepare`` on the view; the spliced result replaces ``folding.body`` in place.

    Checks on the way that fold never asks for the whole object and that the
    outbound body is the input bytes outside the replaced values.
    """
    assert plugin.wants_body(folding.ctx.meta, folding.ctx.fold_level) is False
    changed = await plugin.prepare(folding.ctx)
    result = folding.draft.result(changed)
    folding.ctx._close()
    if result is None:
        assert changed is False
        return False
    assert isinstance(result, Splice) and changed is True
    edited = json.loads(result.join())
    folding.body.clear()
    folding.body.update(edited)
    return changed


# -- realistic conversations ------------------------------------------------------------


def chat_body() -> dict[str, Any]:
    """A coding-agent chat: system prompt, an image, tool calls and results, a developer note."""
    return {
        "model": "gpt-4.1",
        "stream": True,
        "messages": [
            {"role": "system", "content": text("system", 6000)},  # bulky, but a system prompt
            {
                "role": "user",
                "content": [
                    {"type": "text", "text": "The parser crashes, see the screenshot."},
                    {
                        "type": "image_url",
                        "image_url": {
                            "url": "data:image/png;base64," + b64(9000),
                            "detail": "auto",
                        },
                    },
                ],
            },
            {
                "role": "assistant",
                "content": None,
                "tool_calls": [
                    {
                        "id": "call_1",
                        "type": "function",
                        "function": {"name": "read_file", "arguments": '{"path": "parser.py"}'},
                    }
                ],
            },
            {"role": "tool", "tool_call_id": "call_1", "content": text("parser.py", 20000)},
            {
                "role": "assistant",
                "content": "Found it; rewriting the tokenizer.",
                "tool_calls": [
                    {
                        "id": "call_2",
                        "type": "function",
                        "function": {
                            "name": "write_file",
                            "arguments": json.dumps(
                                {"path": "parser.py", "content": text("new parser", 10000)}
                            ),
                        },
                    }
                ],
            },
            {"role": "tool", "tool_call_id": "call_2", "content": "ok"},
            {"role": "user", "content": text("pasted log", 15000)},
            {"role": "assistant", "content": text("explanation", 5000)},
            {"role": "developer", "content": "Remember to run the tests."},
            {"role": "user", "content": [{"type": "text", "text": text("failing test", 8000)}]},
            {
                "role": "assistant",
                "content": None,
                "tool_calls": [
                    {
                        "id": "call_3",
                        "type": "function",
                        "function": {"name": "run_tests", "arguments": '{"args": ["-x"]}'},
                    }
                ],
            },
            {
                "role": "tool",
                "tool_call_id": "call_3",
                "content": [{"type": "text", "text": text("pytest output", 12000)}],
            },
            {
                "role": "assistant",
                "content": "Tests pass; one more check.",
                "tool_calls": [
                    {
                        "id": "call_4",
                        "type": "function",
                        "function": {"name": "read_file", "arguments": '{"path": "README.md"}'},
                    }
                ],
            },
            {"role": "tool", "tool_call_id": "call_4", "content": text("README.md", 9000)},
        ],
    }


def anthropic_body() -> dict[str, Any]:
    """A Claude Code style conversation: cached system prompt, image, PDF, thinking, tools."""
    image = {"type": "base64", "media_type": "image/png", "data": b64(9000)}
    return {
        "model": "claude-sonnet-4-5",
        "max_tokens": 4096,
        "system": [
            {"type": "text", "text": text("system", 8000), "cache_control": {"type": "ephemeral"}}
        ],
        "messages": [
            {
                "role": "user",
                "content": [
                    {"type": "text", "text": "Fix the failing test; the spec is attached."},
                    {"type": "image", "source": image},
                    {
                        "type": "document",
                        "source": {
                            "type": "base64",
                            "media_type": "application/pdf",
                            "data": b64(12000),
                        },
                        "title": "spec.pdf",
                    },
                ],
            },
            {
                "role": "assistant",
                "content": [
                    {"type": "thinking", "thinking": text("thinking", 5000), "signature": "c2ln"},
                    {"type": "text", "text": "Let me read the file."},
                    {
                        "type": "tool_use",
                        "id": "toolu_1",
                        "name": "Read",
                        "input": {"file_path": "/src/a.py"},
                    },
                ],
            },
            {
                "role": "user",
                "content": [
                    {
                        "type": "tool_result",
                        "tool_use_id": "toolu_1",
                        "content": text("a.py", 20000),
                    }
                ],
            },
            {
                "role": "assistant",
                "content": [
                    {
                        "type": "tool_use",
                        "id": "toolu_2",
                        "name": "Write",
                        "input": {"file_path": "/src/a.py", "content": text("new a.py", 10000)},
                    }
                ],
            },
            {
                "role": "user",
                "content": [
                    {
                        "type": "tool_result",
                        "tool_use_id": "toolu_2",
                        "content": [{"type": "text", "text": "written"}],
                    }
                ],
            },
            {"role": "assistant", "content": "Updated the file; now running the tests."},
            {"role": "user", "content": "Journal: " + "ünïcödé ✓ " * 700},
            {
                "role": "assistant",
                "content": [
                    {"type": "text", "text": text("analysis", 4000)},
                    {
                        "type": "tool_use",
                        "id": "toolu_3",
                        "name": "Bash",
                        "input": {"command": "pytest -x"},
                    },
                ],
            },
            {
                "role": "user",
                "content": [
                    {
                        "type": "tool_result",
                        "tool_use_id": "toolu_3",
                        "content": [
                            {"type": "text", "text": text("pytest", 7000)},
                            {"type": "image", "source": dict(image)},
                        ],
                    },
                    {
                        "type": "text",
                        "text": "also check lint",
                        "cache_control": {"type": "ephemeral"},
                    },
                ],
            },
            {
                "role": "assistant",
                "content": [
                    {
                        "type": "tool_use",
                        "id": "toolu_4",
                        "name": "Bash",
                        "input": {"command": "ruff check"},
                    }
                ],
            },
            {
                "role": "user",
                "content": [
                    {
                        "type": "tool_result",
                        "tool_use_id": "toolu_4",
                        "content": text("ruff", 5000),
                        "is_error": True,
                    }
                ],
            },
        ],
    }


def responses_body() -> dict[str, Any]:
    """A Codex style Responses request: instructions, developer item, reasoning, calls."""
    return {
        "model": "gpt-5-codex",
        "stream": True,
        "instructions": text("instructions", 5000),
        "input": [
            {"role": "developer", "content": text("developer", 4000)},
            {
                "type": "message",
                "role": "user",
                "content": [
                    {"type": "input_text", "text": "Why does the build fail? Screenshot:"},
                    {"type": "input_image", "image_url": "data:image/png;base64," + b64(9000)},
                ],
            },
            {
                "type": "reasoning",
                "id": "rs_1",
                "summary": [],
                "encrypted_content": b64(6000),
            },
            {
                "type": "function_call",
                "id": "fc_1",
                "call_id": "call_a",
                "name": "shell",
                "arguments": '{"cmd": ["cat", "build.log"]}',
            },
            {"type": "function_call_output", "call_id": "call_a", "output": text("log", 20000)},
            {
                "type": "message",
                "role": "assistant",
                "content": [
                    {
                        "type": "output_text",
                        "text": text("diagnosis", 6000),
                        "annotations": [
                            {
                                "type": "url_citation",
                                "start_index": 10,
                                "end_index": 40,
                                "url": "https://example.com/docs",
                                "title": "docs",
                            }
                        ],
                    }
                ],
            },
            {"role": "user", "content": text("user paste", 10000)},
            {
                "type": "function_call",
                "id": "fc_2",
                "call_id": "call_b",
                "name": "apply_patch",
                "arguments": json.dumps({"patch": text("patch", 9000), "strip": 1}),
            },
            {
                "type": "function_call_output",
                "call_id": "call_b",
                "output": [
                    {"type": "input_text", "text": text("patch result", 7000)},
                    {"type": "input_image", "image_url": "data:image/png;base64," + b64(5000)},
                ],
            },
            {
                "type": "message",
                "role": "assistant",
                "content": [{"type": "output_text", "text": "Patched.", "annotations": []}],
            },
            {"role": "user", "content": [{"type": "input_text", "text": text("question", 3000)}]},
            {
                "type": "function_call",
                "id": "fc_3",
                "call_id": "call_c",
                "name": "shell",
                "arguments": '{"cmd": ["pytest"]}',
            },
            {"type": "function_call_output", "call_id": "call_c", "output": text("pytest", 9000)},
        ],
    }


# -- per-protocol facts and validity checks ----------------------------------------------


def _chat_pairs(body: dict[str, Any]) -> tuple[list[str], list[str]]:
    calls = [c["id"] for m in body["messages"] for c in m.get("tool_calls") or []]
    results = [m["tool_call_id"] for m in body["messages"] if m["role"] == "tool"]
    return calls, results


def _anthropic_pairs(body: dict[str, Any]) -> tuple[list[str], list[str]]:
    blocks = [b for m in body["messages"] if isinstance(m["content"], list) for b in m["content"]]
    calls = [b["id"] for b in blocks if b["type"] == "tool_use"]
    results = [b["tool_use_id"] for b in blocks if b["type"] == "tool_result"]
    return calls, results


def _responses_pairs(body: dict[str, Any]) -> tuple[list[str], list[str]]:
    calls = [i["call_id"] for i in body["input"] if i.get("type") == "function_call"]
    results = [i["call_id"] for i in body["input"] if i.get("type") == "function_call_output"]
    return calls, results


def _nonblank(value: Any) -> bool:
    return isinstance(value, str) and bool(value.strip())


def _check_chat(body: dict[str, Any]) -> None:
    for message in body["messages"]:
        content = message.get("content")
        if isinstance(content, list):
            allowed = {"text"} if message["role"] == "tool" else {"text", "image_url"}
            for part in content:
                assert part["type"] in allowed
                if part["type"] == "text":
                    assert _nonblank(part["text"])
        else:
            assert content is None or _nonblank(content)
        for call in message.get("tool_calls") or []:
            assert isinstance(json.loads(call["function"]["arguments"]), dict)


def _check_anthropic(body: dict[str, Any]) -> None:
    for message in body["messages"]:
        content = message["content"]
        if isinstance(content, str):
            assert _nonblank(content)
            continue
        assert content
        for block in content:
            kind = block["type"]
            assert kind in {"text", "image", "document", "tool_use", "tool_result", "thinking"}
            if kind == "text":
                assert _nonblank(block["text"])
            elif kind == "tool_use":
                assert isinstance(block["input"], dict)
            elif kind == "document":
                assert block["source"]["type"] in {"base64", "text"}
                assert _nonblank(block["source"]["data"])
            elif kind == "tool_result":
                inner = block["content"]
                if isinstance(inner, str):
                    assert _nonblank(inner)
                else:
                    assert inner
                    for part in inner:
                        assert part["type"] in {"text", "image"}
                        if part["type"] == "text":
                            assert _nonblank(part["text"])


def _check_responses(body: dict[str, Any]) -> None:
    user_parts = {"input_text", "input_image", "input_file"}
    for item in body["input"]:
        kind = item.get("type", "message")
        if kind == "message":
            content = item["content"]
            if isinstance(content, str):
                assert _nonblank(content)
                continue
            allowed = {"output_text", "refusal"} if item["role"] == "assistant" else user_parts
            for part in content:
                assert part["type"] in allowed
                if part["type"] in {"input_text", "output_text"}:
                    assert _nonblank(part["text"])
        elif kind == "function_call":
            assert isinstance(json.loads(item["arguments"]), dict)
        elif kind == "function_call_output":
            output = item["output"]
            if isinstance(output, str):
                assert _nonblank(output)
            else:
                assert output
                for part in output:
                    assert part["type"] in user_parts
                    if part["type"] == "input_text":
                        assert _nonblank(part["text"])


@dataclasses.dataclass(frozen=True)
class Case:
    """One protocol's long conversation and the facts the tests check against it."""

    protocol: Protocol
    path: str
    build: Callable[[], dict[str, Any]]
    key: str  # "messages" or "input"
    tail_from: int  # entries from here on are the last keep_last=4 turns
    protected_from: int  # entries from here on: the last user turn, never changed
    steps: int  # distinct fold steps with the default options
    system: Callable[[dict[str, Any]], Any]
    pairs: Callable[[dict[str, Any]], tuple[list[str], list[str]]]
    check: Callable[[dict[str, Any]], None]

    async def fold(
        self, level: int, body: dict[str, Any] | None = None
    ) -> tuple[bool, dict[str, Any]]:
        """(changed, body) after prepare at ``level`` on ``body`` (a fresh one by default)."""
        body = self.build() if body is None else body
        return await run(FoldPlugin(), make_ctx(self.protocol, body, level, self.path)), body


CASES = [
    Case(
        protocol=Protocol.CHAT,
        path="/v1/chat/completions",
        build=chat_body,
        key="messages",
        tail_from=10,
        protected_from=13,
        steps=3,
        system=lambda b: [m for m in b["messages"] if m["role"] in ("system", "developer")],
        pairs=_chat_pairs,
        check=_check_chat,
    ),
    Case(
        protocol=Protocol.MESSAGES,
        path="/v1/messages?beta=true",
        build=anthropic_body,
        key="messages",
        tail_from=7,
        protected_from=10,
        steps=4,
        system=lambda b: b["system"],
        pairs=_anthropic_pairs,
        check=_check_anthropic,
    ),
    Case(
        protocol=Protocol.COUNT_TOKENS,
        path="/v1/messages/count_tokens",
        build=anthropic_body,
        key="messages",
        tail_from=7,
        protected_from=10,
        steps=4,
        system=lambda b: b["system"],
        pairs=_anthropic_pairs,
        check=_check_anthropic,
    ),
    Case(
        protocol=Protocol.RESPONSES,
        path="/v1/responses",
        build=responses_body,
        key="input",
        tail_from=9,
        protected_from=12,
        steps=3,
        system=lambda b: (b["instructions"], b["input"][0]),
        pairs=_responses_pairs,
        check=_check_responses,
    ),
]
IDS = [case.protocol for case in CASES]


# -- behaviour on long conversations -----------------------------------------------------


@pytest.mark.parametrize("case", CASES, ids=IDS)
async def test_each_level_shrinks_more_until_nothing_is_left(case: Case) -> None:
    sizes = [len(encode(case.build()))]
    for level in range(1, case.steps + 1):
        changed, body = await case.fold(level)
        assert changed is True
        sizes.append(len(encode(body)))
    assert sizes == sorted(sizes, reverse=True)
    assert len(set(sizes)) == len(sizes), f"a level did not shrink the body: {sizes}"
    # Past the last step a level acts like the last one.
    _, last = await case.fold(case.steps)
    _, beyond = await case.fold(case.steps + 5)
    assert beyond == last


@pytest.mark.parametrize("case", CASES, ids=IDS)
async def test_higher_level_never_keeps_what_a_lower_one_elided(case: Case) -> None:
    original = case.build()[case.key]
    folded = [(await case.fold(level))[1][case.key] for level in range(1, case.steps + 2)]
    for lower, higher in itertools.pairwise(folded):
        for i, entry in enumerate(lower):
            if entry != original[i]:
                assert higher[i] == entry, f"entry {i} was restored or refolded differently"


@pytest.mark.parametrize("case", CASES, ids=IDS)
async def test_refold_of_the_folded_body_matches_folding_the_original(case: Case) -> None:
    body = case.build()
    for level in range(1, case.steps + 1):
        changed, body = await case.fold(level, body)
        assert changed is True
        assert body == (await case.fold(level))[1], f"level {level} on the folded body differs"
    changed, body_after = await case.fold(case.steps + 1, body)
    assert changed is False
    assert body_after == (await case.fold(case.steps))[1]


@pytest.mark.parametrize("case", CASES, ids=IDS)
@pytest.mark.parametrize("level", [1, 2, 3, 4, 9])
async def test_structure_ids_system_and_protected_end_survive(case: Case, level: int) -> None:
    original = case.build()
    _, body = await case.fold(level)
    assert len(body[case.key]) == len(original[case.key])
    assert case.system(body) == case.system(original)
    assert case.pairs(body) == case.pairs(original)
    calls, results = case.pairs(body)
    assert set(results) <= set(calls)
    assert body[case.key][case.protected_from :] == original[case.key][case.protected_from :]
    if level <= 2:  # the keep_last=4 tail is only touched from level 3 on
        assert body[case.key][case.tail_from :] == original[case.key][case.tail_from :]
    else:
        assert body[case.key][case.tail_from :] != original[case.key][case.tail_from :]
    case.check(body)
    for node in walk(body):
        # Text blocks and parts (a document's plain-text source has a media_type instead).
        kind = node.get("type") if isinstance(node, dict) else None
        if kind in ("text", "input_text", "output_text") and "media_type" not in node:
            assert _nonblank(node["text"]), "an empty text block was produced"
    # Nothing outside the entries changed.
    assert {k: v for k, v in body.items() if k != case.key} == {
        k: v for k, v in original.items() if k != case.key
    }


async def test_chat_level_one_folds_oldest_half_of_bulky_head() -> None:
    _, body = await CASES[0].fold(1)
    messages, original = body["messages"], chat_body()["messages"]
    # Bulky head turns, oldest first: the image [1], tool result [3], write_file [4],
    # pasted log [6], explanation [7], failing test [9]. Level 1 folds the first three.
    image_part = messages[1]["content"][1]
    assert image_part == {"type": "text", "text": "[elided by context-proxy: 9026 bytes]"}
    assert messages[1]["content"][0] == original[1]["content"][0]
    assert messages[3]["content"] == "[elided by context-proxy: 20000 bytes]"
    args = json.loads(messages[4]["tool_calls"][0]["function"]["arguments"])
    assert args == {"path": "parser.py", "content": "[elided by context-proxy: 10000 bytes]"}
    assert messages[4]["tool_calls"][0]["id"] == "call_2"
    assert messages[4]["content"] == original[4]["content"]  # small, kept
    assert messages[6:] == original[6:]


async def test_chat_tool_content_list_becomes_one_text_part_at_level_three() -> None:
    _, body = await CASES[0].fold(3)
    assert body["messages"][11]["content"] == [
        {"type": "text", "text": "[elided by context-proxy: 12000 bytes]"}
    ]
    assert body["messages"][11]["tool_call_id"] == "call_3"


async def test_anthropic_blocks_keep_their_protocol_types() -> None:
    _, body = await CASES[1].fold(4)
    first = body["messages"][0]["content"]
    assert first[0]["text"].startswith("Fix the failing test")
    assert first[1] == {"type": "text", "text": "[elided by context-proxy: 9009 bytes]"}
    document = first[2]
    assert document["type"] == "document" and document["title"] == "spec.pdf"
    # The size counts the strings of the source but not its type tag: 15 + 12000.
    assert document["source"] == {
        "type": "text",
        "media_type": "text/plain",
        "data": "[elided by context-proxy: 12015 bytes]",
    }
    thinking = body["messages"][1]["content"][0]
    assert thinking == anthropic_body()["messages"][1]["content"][0], "signed thinking changed"
    assert body["messages"][2]["content"][0]["content"] == "[elided by context-proxy: 20000 bytes]"
    write = body["messages"][3]["content"][0]
    assert write["input"] == {
        "file_path": "/src/a.py",
        "content": "[elided by context-proxy: 10000 bytes]",
    }
    # Multi-byte text is measured in UTF-8 bytes: 9 + 700 * 16.
    assert body["messages"][6]["content"] == "[elided by context-proxy: 11209 bytes]"
    result = body["messages"][8]["content"][0]
    assert result["tool_use_id"] == "toolu_3"
    assert result["content"][0]["type"] == "text" and len(result["content"]) == 1
    assert result["content"][0]["text"].startswith(MARK)
    # A small text block next to the tool result (with its cache breakpoint) is kept.
    assert body["messages"][8]["content"][1]["cache_control"] == {"type": "ephemeral"}


async def test_anthropic_image_keeps_its_cache_breakpoint() -> None:
    body = anthropic_body()
    body["messages"][0]["content"][1]["cache_control"] = {"type": "ephemeral"}
    _, body = await CASES[1].fold(1, body)
    assert body["messages"][0]["content"][1] == {
        "type": "text",
        "text": "[elided by context-proxy: 9009 bytes]",
        "cache_control": {"type": "ephemeral"},
    }


async def test_responses_items_keep_their_types_and_reasoning_is_untouched() -> None:
    _, body = await CASES[3].fold(3)
    items, original = body["input"], responses_body()["input"]
    assert items[1]["content"][1] == {
        "type": "input_text",
        "text": "[elided by context-proxy: 9022 bytes]",
    }
    assert items[2] == original[2], "encrypted reasoning must not change"
    assert items[4]["output"] == "[elided by context-proxy: 20000 bytes]"
    assistant = items[5]["content"][0]
    assert assistant["type"] == "output_text" and assistant["text"].startswith(MARK)
    assert assistant["annotations"] == []  # their offsets pointed into the elided text
    assert items[6]["content"] == "[elided by context-proxy: 10000 bytes]"
    patch = json.loads(items[7]["arguments"])
    assert patch == {"patch": "[elided by context-proxy: 9000 bytes]", "strip": 1}
    assert items[8]["output"] == [{"type": "input_text", "text": items[8]["output"][0]["text"]}]
    assert items[10]["content"][0]["type"] == "input_text"
    assert items[10]["content"][0]["text"].startswith(MARK)


# -- small, odd and edge-case requests ---------------------------------------------------


SHORT = [
    (
        Protocol.CHAT,
        {
            "model": "m",
            "messages": [
                {"role": "system", "content": "Be brief."},
                {"role": "user", "content": "Hi"},
                {"role": "assistant", "content": "Hello!"},
                {"role": "user", "content": [{"type": "text", "text": "What is 2+2?"}]},
            ],
        },
    ),
    (
        Protocol.MESSAGES,
        {
            "model": "m",
            "max_tokens": 64,
            "system": "Be brief.",
            "messages": [
                {"role": "user", "content": "Hi"},
                {"role": "assistant", "content": [{"type": "text", "text": "Hello!"}]},
                {"role": "user", "content": [{"type": "text", "text": "What is 2+2?"}]},
            ],
        },
    ),
    (
        Protocol.RESPONSES,
        {
            "model": "m",
            "instructions": "Be brief.",
            "input": [
                {"role": "user", "content": "Hi"},
                {"type": "message", "role": "assistant", "content": "Hello!"},
                {"role": "user", "content": [{"type": "input_text", "text": "2+2?"}]},
            ],
        },
    ),
]


@pytest.mark.parametrize(("protocol", "body"), SHORT, ids=[p for p, _ in SHORT])
async def test_nothing_bulky_returns_false_and_leaves_bytes_identical(
    protocol: Protocol, body: dict[str, Any]
) -> None:
    before = encode(body)
    plugin = FoldPlugin()
    for level in (1, 2, 3, 4, 10):
        assert await run(plugin, make_ctx(protocol, body, level, "/v1/x")) is False
    assert encode(body) == before


@pytest.mark.parametrize(
    "body",
    [
        {"messages": 5},
        {"messages": [1, "x", None, {"role": "user", "content": 12}]},
        {"messages": [{"role": "assistant", "content": [{"type": "text", "text": 5}, 7]}, {}]},
        {"messages": [{"role": "user", "content": [{"type": "tool_result", "content": 3}]}] * 3},
        {"input": "a plain string input " * 500},
        {"input": [{"type": "function_call", "arguments": 5}, {"role": "user"}, []]},
        {},
    ],
)
async def test_unexpected_shapes_are_left_alone(body: dict[str, Any]) -> None:
    before = copy.deepcopy(body)
    plugin = FoldPlugin()
    for protocol in (Protocol.CHAT, Protocol.MESSAGES, Protocol.RESPONSES):
        ctx = make_ctx(protocol, body, 3, "/v1/x", message_count=5)
        assert await run(plugin, ctx) is False
    assert body == before


async def test_last_user_turn_is_protected_even_with_keep_last_zero() -> None:
    body = anthropic_body()
    original = anthropic_body()
    plugin = FoldPlugin(keep_last=0)
    # With no tail, the whole history before the last user turn goes in two levels.
    assert await run(plugin, make_ctx(Protocol.MESSAGES, body, 2, "/v1/messages"))
    assert body["messages"][10] == original["messages"][10]
    assert body["messages"][8]["content"][0]["content"][0]["text"].startswith(MARK)
    assert await run(plugin, make_ctx(Protocol.MESSAGES, body, 3, "/v1/messages")) is False


async def test_trailing_assistant_prefill_is_protected() -> None:
    body = anthropic_body()
    body["messages"].append({"role": "assistant", "content": text("prefill", 3000)})
    _, body = await CASES[1].fold(9, body)
    assert body["messages"][-1]["content"] == text("prefill", 3000)
    assert body["messages"][-2] == anthropic_body()["messages"][-1]


async def test_a_level_whose_turns_yield_nothing_moves_on() -> None:
    # The oldest bulky turn is a call whose arguments are large but made of small
    # values: nothing in it can be elided, so level 1 goes on to the next step.
    many_small = json.dumps({"paths": [f"src/module_{i}.py" for i in range(300)]})
    body: dict[str, Any] = {
        "messages": [
            {"role": "user", "content": "list the modules"},
            {
                "role": "assistant",
                "content": None,
                "tool_calls": [
                    {
                        "id": "c1",
                        "type": "function",
                        "function": {"name": "touch", "arguments": many_small},
                    }
                ],
            },
            {"role": "tool", "tool_call_id": "c1", "content": text("touch output", 6000)},
            {"role": "assistant", "content": "done"},
            {"role": "user", "content": "next"},
        ]
    }
    plugin = FoldPlugin(keep_last=0)
    assert await run(plugin, make_ctx(Protocol.CHAT, body, 1, "/v1/chat/completions"))
    assert body["messages"][1]["tool_calls"][0]["function"]["arguments"] == many_small
    assert body["messages"][2]["content"] == "[elided by context-proxy: 6000 bytes]"


async def test_custom_placeholder_and_thresholds() -> None:
    body: dict[str, Any] = {
        "messages": [
            {"role": "user", "content": "x" * 150},
            {"role": "assistant", "content": "y" * 99},
            {"role": "user", "content": [{"type": "text", "text": "é" * 60}]},  # 120 bytes
            {"role": "assistant", "content": "ok"},
            {"role": "user", "content": "z" * 500},
        ]
    }
    plugin = FoldPlugin(keep_last=0, min_bytes=100, placeholder='<cut "{n}">', levels_per_stage=1)
    assert await run(plugin, make_ctx(Protocol.CHAT, body, 1, "/v1/chat/completions"))
    assert body["messages"][0]["content"] == '<cut "150">'
    assert body["messages"][1]["content"] == "y" * 99  # under min_bytes
    assert body["messages"][2]["content"] == [{"type": "text", "text": '<cut "120">'}]
    assert body["messages"][4]["content"] == "z" * 500


async def test_placeholder_inside_arguments_is_recognized_on_refold() -> None:
    # A placeholder with quotes is JSON-escaped inside arguments; a refold must
    # still see that turn as already folded, or level 2 would select other turns.
    def build() -> dict[str, Any]:
        def call(i: int) -> dict[str, Any]:
            args = json.dumps({"path": f"f{i}.py", "content": text(f"file {i}", 3000)})
            fn = {"name": "write", "arguments": args}
            return {"role": "assistant", "tool_calls": [{"id": f"c{i}", "function": fn}]}

        messages: list[dict[str, Any]] = []
        for i in range(4):
            messages += [call(i), {"role": "tool", "tool_call_id": f"c{i}", "content": "ok"}]
        messages.append({"role": "user", "content": "go on"})
        return {"messages": messages}

    options: dict[str, Any] = {"keep_last": 0, "placeholder": 'cut "{n}"', "levels_per_stage": 4}
    refolded = build()
    for level in (1, 2, 3):
        ctx = make_ctx(Protocol.CHAT, refolded, level, "/v1/chat/completions")
        assert await run(FoldPlugin(**options), ctx)
        fresh = build()
        ctx = make_ctx(Protocol.CHAT, fresh, level, "/v1/chat/completions")
        assert await run(FoldPlugin(**options), ctx)
        assert refolded == fresh
    args = json.loads(refolded["messages"][4]["tool_calls"][0]["function"]["arguments"])
    assert args == {"path": "f2.py", "content": 'cut "3000"'}


async def test_non_json_arguments_are_replaced_whole() -> None:
    body: dict[str, Any] = {
        "messages": [
            {
                "role": "assistant",
                "tool_calls": [
                    {"id": "c", "function": {"name": "f", "arguments": "{not json " + "a" * 4000}}
                ],
            },
            {"role": "tool", "tool_call_id": "c", "content": "ok"},
            {"role": "user", "content": "and?"},
        ]
    }
    plugin = FoldPlugin(keep_last=0)
    assert await run(plugin, make_ctx(Protocol.CHAT, body, 1, "/v1/chat/completions"))
    function = body["messages"][0]["tool_calls"][0]["function"]
    assert function == {"name": "f", "arguments": "[elided by context-proxy: 4010 bytes]"}


async def test_folds_through_the_view_without_copying_the_body() -> None:
    messages: list[dict[str, Any]] = []
    for i in range(100):
        messages.append({"role": "user", "content": text(f"user {i}", 40_000)})
        messages.append({"role": "assistant", "content": text(f"assistant {i}", 40_000)})
    body: dict[str, Any] = {"messages": messages}
    folding = make_ctx(Protocol.CHAT, body, 2, "/v1/chat/completions")
    tracemalloc.start()
    try:
        changed = await FoldPlugin().prepare(folding.ctx)
        splice = folding.draft.result(changed)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert changed is True and isinstance(splice, Splice)
    # 8 MB of text folded; a copy of the body (or its parsed tree) would show as
    # megabytes of peak. The replacement pieces are all the new bytes there are.
    assert peak < 512 * 1024, peak
    assert splice.owned_bytes < 196 * 60
    folded = json.loads(splice.join())
    assert folded["messages"][-4:] == messages[-4:]
    assert sum(m["content"].startswith(MARK) for m in folded["messages"]) == 196


# -- wants_body, host integration, options ------------------------------------------------


def _meta(protocol: Protocol, message_count: int = 12) -> WireMetadata:
    return WireMetadata(
        protocol=protocol,
        model=None,
        stream=False,
        message_count=message_count,
        byte_length=1000,
        digest="0" * 32,
        comparable=True,
        session_hint=None,
    )


@pytest.mark.parametrize("protocol", [p.value for p in Protocol])
def test_folds_only_a_conversation_and_never_asks_for_the_whole_object(protocol: str) -> None:
    plugin = FoldPlugin()
    foldable = protocol in {"openai-chat", "openai-responses", "anthropic-messages"} or (
        protocol == "anthropic-count-tokens"
    )
    assert plugin.folds(_meta(protocol), 0) is False
    assert plugin.folds(_meta(protocol), 1) is foldable
    assert plugin.folds(_meta(protocol), 3) is foldable
    assert plugin.folds(_meta(protocol, message_count=1), 2) is False
    for level in range(5):
        assert plugin.wants_body(_meta(protocol), level) is False
        # It declines exactly the prepare runs in which it would do nothing.
        assert plugin.wants_prepare(_meta(protocol), level) is plugin.folds(_meta(protocol), level)
        assert plugin.wants_prepare(_meta(protocol, message_count=1), level) is False


class _Extended(FoldPlugin):
    """A subclass with a prepare of its own: it may act where fold alone would not."""

    async def prepare(self, ctx: PrepareContext) -> bool:
        return await super().prepare(ctx)


def test_a_subclass_with_its_own_prepare_is_never_declined() -> None:
    plugin = _Extended()
    for level in range(3):
        assert plugin.wants_prepare(_meta(Protocol.CHAT), level) is True
        assert plugin.wants_prepare(_meta(Protocol.OPENAI, message_count=1), level) is True
    host = PluginHost([plugin], timeout=5.0)
    assert host.wants_body(_meta(Protocol.CHAT), 0) == [False]


async def test_runs_under_the_plugin_host() -> None:
    host = PluginHost([FoldPlugin()], timeout=5.0)
    body = anthropic_body()
    meta = _meta(Protocol.MESSAGES, len(body["messages"]))
    results = []
    for level in (0, 1):
        draft = Draft(meta.protocol, base=encode(body))
        ctx = PrepareContext(
            meta=meta, fold_level=level, session_id="s", path="/v1/messages", draft=draft
        )
        wants = host.wants_body(meta, level)
        # Level 0: fold declines the run (wants_prepare), so it is not even asked for the body.
        assert wants == ([None] if level == 0 else [False])
        results.append((await host.run_prepare(ctx, wants), draft.result(True)))
        ctx._close()
    assert host.failures == {}
    (zero, unchanged), (one, splice) = results
    assert zero is False and unchanged is None  # level 0 never touches the body
    assert one is True and isinstance(splice, Splice)
    folded = json.loads(splice.join())
    assert folded["messages"][2]["content"][0]["content"].startswith(MARK)


def test_load_plugins_passes_config_options() -> None:
    spec = "plugins.fold:FoldPlugin"
    host = load_plugins([spec], {spec: {"keep_last": 2, "min_bytes": 4096}}, timeout=1.0)
    (plugin,) = host.plugins
    assert isinstance(plugin, FoldPlugin)
    assert (plugin.keep_last, plugin.min_bytes, plugin.max_level) == (2, 4096, 4)
    with pytest.raises(PluginError, match="keep_last"):
        load_plugins([spec], {spec: {"keep_last": -1}}, timeout=1.0)
    with pytest.raises(PluginError, match="bad options"):
        load_plugins([spec], {spec: {"fraction": 0.5}}, timeout=1.0)


@pytest.mark.parametrize(
    ("options", "error", "match"),
    [
        ({"keep_last": -1}, ValueError, "keep_last"),
        ({"keep_last": True}, TypeError, "keep_last"),
        ({"keep_last": "4"}, TypeError, "keep_last"),
        ({"min_bytes": 0}, ValueError, "min_bytes"),
        ({"min_bytes": 2048.0}, TypeError, "min_bytes"),
        ({"levels_per_stage": 0}, ValueError, "levels_per_stage"),
        ({"placeholder": 5}, TypeError, "placeholder"),
        ({"placeholder": ""}, ValueError, "text besides"),
        ({"placeholder": "  {n} "}, ValueError, "text besides"),
        ({"placeholder": "cut {m}"}, ValueError, "only use the field"),
        ({"placeholder": "cut {}"}, ValueError, "only use the field"),
        ({"placeholder": "cut {n:,}"}, ValueError, "only use the field"),
        ({"placeholder": "cut {n!r}"}, ValueError, "only use the field"),
        ({"placeholder": "cut {n"}, ValueError, "not a valid format string"),
        ({"min_bytes": 40}, ValueError, "shorter than min_bytes"),
        ({"carry": 1}, TypeError, "carry"),
        ({"fold_target": 0}, ValueError, "fold_target"),
        ({"fold_target": 1.5}, ValueError, "fold_target"),
        ({"fold_target": "0.8"}, TypeError, "fold_target"),
        ({"fold_headroom": 0.9}, ValueError, "below fold_target"),
        ({"fold_headroom": -0.1}, ValueError, "fold_headroom"),
        ({"max_histories": 0}, ValueError, "max_histories"),
    ],
)
def test_bad_options_are_rejected(options: dict[str, Any], error: type, match: str) -> None:
    with pytest.raises(error, match=match):
        FoldPlugin(**options)


def test_defaults() -> None:
    plugin = FoldPlugin()
    assert plugin.name == "fold"
    assert (plugin.keep_last, plugin.min_bytes, plugin.levels_per_stage) == (4, 2048, 2)
    assert plugin.placeholder == DEFAULT_PLACEHOLDER
    assert plugin.max_level == 4
    assert (plugin.carry, plugin.fold_target, plugin.fold_headroom) == (True, 0.85, 0.6)
    assert plugin.max_histories == 8

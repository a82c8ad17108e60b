"""Request generation for the benchmarks: realistic chat histories in the three protocols.

A coding agent's conversation is mostly prose turns, tool calls and large tool
results (file contents). The text here comes from files every Python install
has: the standard library's source (code and docstrings, as a ``read_file``
tool result would carry) and ``pydoc_data.topics`` (the language reference, as
prose). Slices are picked by a seeded :class:`random.Random`, so a body of a
given size is the same on every run on the same Python, and no two messages of
one body are the same string.

Bodies are built by serializing each message on its own and joining the
pieces, which gives exact control of the size and never holds the body twice.
"""

from __future__ import annotations

import dataclasses
import enum
import json
import random
import sysconfig
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, Final

__all__ = [
    "BenchProtocol",
    "Corpus",
    "MiB",
    "Turn",
    "build_agent_history",
    "build_body",
    "build_small_body",
    "conversation",
    "marker_text",
]

MiB: Final = 1024 * 1024

#: Text a :class:`~benchmarks.plugins.Marker` appends; also used to check it arrived.
_MARKER: Final = "\n\n[context-proxy benchmark marker]"
# Characters of corpus text loaded at most (both sources together): enough variety
# for a 64 MiB body (slices are taken at random offsets), little start-up time.
_CORPUS_CAP: Final = 24 * MiB
_SKIP_DIRS: Final = frozenset({"test", "tests", "idlelib", "site-packages", "__pycache__"})


def marker_text() -> str:
    """The text the benchmark plugin appends to the last user message."""
    return _MARKER


class BenchProtocol(enum.Enum):
    """The three upstream protocols, with what the benchmark needs of each.

    ``first_delta_event`` is the 1-based index of the emulator's first text-delta
    SSE event (``x-emulator: stall_after``): holding there means the answer is
    streaming. Event order per protocol is the emulator's (proxy/_emulator.py).
    """

    CHAT = "chat"
    RESPONSES = "responses"
    MESSAGES = "messages"

    @property
    def path(self) -> str:
        """Request path."""
        return {
            BenchProtocol.CHAT: "/v1/chat/completions",
            BenchProtocol.RESPONSES: "/v1/responses",
            BenchProtocol.MESSAGES: "/v1/messages",
        }[self]

    @property
    def first_delta_event(self) -> int:
        """Events up to and including the first text delta (role chunk + delta for chat;
        created, in_progress, output_item.added, content_part.added, delta for Responses;
        message_start, content_block_start, ping, delta for Anthropic)."""
        return {BenchProtocol.CHAT: 2, BenchProtocol.RESPONSES: 5, BenchProtocol.MESSAGES: 4}[self]

    @property
    def terminal(self) -> bytes:
        """Bytes of the SSE event that ends a complete answer (``[DONE]`` for chat)."""
        return {
            BenchProtocol.CHAT: b"data: [DONE]",
            BenchProtocol.RESPONSES: b"response.completed",
            BenchProtocol.MESSAGES: b"message_stop",
        }[self]

    def headers(self) -> dict[str, str]:
        """Request headers a real client of this protocol sends (credentials are dummies)."""
        if self is BenchProtocol.MESSAGES:
            return {
                "content-type": "application/json",
                "x-api-key": "bench-dummy-key",
                "anthropic-version": "2023-06-01",
            }
        return {"content-type": "application/json", "authorization": "Bearer bench-dummy-key"}


@dataclasses.dataclass(frozen=True, slots=True)
class Turn:
    """One abstract conversation turn.

    ``kind`` is ``user``, ``assistant``, ``call`` (a tool call: ``name`` and JSON
    ``text`` arguments) or ``result`` (the tool's output ``text``). ``call_id``
    ties a call to its result.
    """

    kind: str
    text: str
    name: str = ""
    call_id: str = ""


class Corpus:
    """Real text to cut messages from: stdlib source (code) and the language reference (prose).

    Loading reads up to 24 MiB of files once (about 0.2 s). If neither source is
    found (a stripped Python), words of this module's own docstrings are
    shuffled instead, so the benchmark still runs.
    """

    __slots__ = ("code", "prose")

    def __init__(self, code: str, prose: str) -> None:
        self.code = code
        self.prose = prose

    @classmethod
    def load(cls) -> Corpus:
        """Load the corpus from the running Python's standard library."""
        prose = _load_prose()
        code = _load_code(_CORPUS_CAP - len(prose))
        if len(code) < 1 << 16 or len(prose) < 1 << 14:
            rng = random.Random(7)
            words = (__doc__ or "benchmark text").split()
            filler = " ".join(rng.choice(words) for _ in range(200_000))
            code = code if len(code) >= 1 << 16 else filler
            prose = prose if len(prose) >= 1 << 14 else filler
        return cls(code, prose)

    def slice(self, rng: random.Random, source: str, low: int, high: int) -> str:
        """A slice of ``source`` of ``low``..``high`` characters, starting at a line."""
        size = rng.randint(low, high)
        if size >= len(source):
            return source
        start = rng.randrange(0, len(source) - size)
        line = source.rfind("\n", 0, start)
        start = line + 1 if line >= 0 and start - line < 400 else start
        return source[start : start + size]


def _load_prose() -> str:
    try:
        from pydoc_data import topics
    except ImportError:
        return ""
    return "\n\n".join(topics.topics[key] for key in sorted(topics.topics))


def _load_code(cap: int) -> str:
    root = Path(sysconfig.get_paths()["stdlib"])
    parts: list[str] = []
    total = 0
    for path in sorted(root.rglob("*.py")):
        if _SKIP_DIRS.intersection(path.relative_to(root).parts):
            continue
        try:
            text = path.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError):
            continue
        parts.append(f"# file: {path.relative_to(root)}\n{text}")
        total += len(parts[-1])
        if total >= cap:
            break
    return "\n".join(parts)


_TOOLS: Final = ("read_file", "grep", "run_tests", "list_dir", "edit_file")


def conversation(corpus: Corpus, seed: int) -> Iterator[Turn]:
    """An endless, deterministic agent conversation: user asks, assistant answers and
    calls tools, tools return file contents. Message sizes (characters): user 80-2,000,
    assistant 200-6,000, tool results 1,000-48,000 (most of the bytes, as in real agent
    traffic)."""
    rng = random.Random(seed)
    number = 0
    while True:
        yield Turn("user", corpus.slice(rng, corpus.prose, 80, 2_000))
        for _ in range(rng.randint(1, 4)):
            yield Turn("assistant", corpus.slice(rng, corpus.prose, 200, 6_000))
            number += 1
            call_id = f"call_{seed:x}_{number:06d}"
            name = rng.choice(_TOOLS)
            args = {"path": f"src/module_{rng.randrange(500)}.py", "limit": rng.randrange(2000)}
            yield Turn("call", json.dumps(args), name=name, call_id=call_id)
            yield Turn("result", corpus.slice(rng, corpus.code, 1_000, 48_000), call_id=call_id)


def _dumps(value: Any) -> bytes:
    return json.dumps(value, ensure_ascii=False, separators=(",", ":")).encode()


def _chat_message(turn: Turn) -> dict[str, Any]:
    if turn.kind == "call":
        call = {"name": turn.name, "arguments": turn.text}
        return {
            "role": "assistant",
            "content": None,
            "tool_calls": [{"id": turn.call_id, "type": "function", "function": call}],
        }
    if turn.kind == "result":
        return {"role": "tool", "tool_call_id": turn.call_id, "content": turn.text}
    return {"role": turn.kind, "content": turn.text}


def _responses_item(turn: Turn) -> dict[str, Any]:
    if turn.kind == "call":
        return {
            "type": "function_call",
            "call_id": turn.call_id,
            "name": turn.name,
            "arguments": turn.text,
        }
    if turn.kind == "result":
        return {"type": "function_call_output", "call_id": turn.call_id, "output": turn.text}
    part = "input_text" if turn.kind == "user" else "output_text"
    return {
        "type": "message",
        "role": turn.kind,
        "content": [{"type": part, "text": turn.text}],
    }


def _anthropic_message(turn: Turn) -> dict[str, Any]:
    if turn.kind == "call":
        block = {"type": "tool_use", "id": turn.call_id, "name": turn.name}
        block["input"] = json.loads(turn.text)
        return {"role": "assistant", "content": [block]}
    if turn.kind == "result":
        result = {"type": "tool_result", "tool_use_id": turn.call_id, "content": turn.text}
        return {"role": "user", "content": [result]}
    return {"role": turn.kind, "content": [{"type": "text", "text": turn.text}]}


_SYSTEM: Final = (
    "You are a coding agent working in a large repository. Read files with the tools "
    "before editing them, keep answers short, and run the tests after every change."
)


def _history_start(
    protocol: BenchProtocol, *, usage: bool, user_id: str | None
) -> tuple[bytes, Callable[[Turn], dict[str, Any]], list[bytes]]:
    """The start of a request body in ``protocol``'s shape, up to its open history list.

    Returns ``(prefix, render, pieces)``: the JSON text up to and including the
    history's ``[``, the function that turns a :class:`Turn` into one history item,
    and the items that open every history (chat's system message). ``usage``: a
    chat request asks for usage in its stream (``stream_options``); ``user_id``: an
    Anthropic request names its user in ``metadata``.
    """
    pieces: list[bytes] = []
    render: Callable[[Turn], dict[str, Any]]
    if protocol is BenchProtocol.CHAT:
        head: dict[str, Any] = {"model": "gpt-4.1", "stream": True}
        if usage:
            head["stream_options"] = {"include_usage": True}
        head["max_tokens"] = 4096
        key, render = "messages", _chat_message
        pieces.append(_dumps({"role": "system", "content": _SYSTEM}))
    elif protocol is BenchProtocol.RESPONSES:
        head = {"model": "gpt-4.1", "stream": True, "instructions": _SYSTEM, "store": False}
        key, render = "input", _responses_item
    else:
        head = {
            "model": "claude-sonnet-4",
            "stream": True,
            "max_tokens": 4096,
            "system": [{"type": "text", "text": _SYSTEM}],
        }
        if user_id is not None:
            head["metadata"] = {"user_id": user_id}
        key, render = "messages", _anthropic_message
    return _dumps(head)[:-1] + b',"' + key.encode() + b'":[', render, pieces


def build_body(protocol: BenchProtocol, size: int, corpus: Corpus, *, seed: int = 1) -> bytes:
    """A streamed request body of about ``size`` bytes (a little over, never under,
    for ``size`` above a few KiB) in ``protocol``'s shape, ending with a user turn.

    ``"model"`` and ``"stream": true`` come first, as real clients send them (the
    emulator only scans the ends of bodies over 8 MiB). Returns UTF-8 JSON bytes.
    """
    prefix, render, pieces = _history_start(protocol, usage=True, user_id=f"bench-user-{seed}")
    total = len(prefix) + 2 + sum(len(p) + 1 for p in pieces)
    turns = conversation(corpus, seed)
    for turn in turns:
        pieces.append(_dumps(render(turn)))
        total += len(pieces[-1]) + 1
        if total >= size and turn.kind == "result":
            break
    # The history ends with the user's new question, as every real request does.
    pieces.append(_dumps(render(next(t for t in turns if t.kind == "user"))))
    return b"".join((prefix, b",".join(pieces), b"]}"))


def build_small_body(protocol: BenchProtocol, size: int, corpus: Corpus) -> bytes:
    """A short streamed request of ``size`` bytes or a few under (never over, unless
    ``size`` is below the protocol's bare envelope of ~300 bytes): the system prompt
    and one user question whose text fills the rest. :func:`build_body` cannot go
    this small (its first tool result alone is ~35 KB). Returns UTF-8 JSON bytes.
    """
    text = corpus.prose[: max(size, 0)]
    prefix, render, pieces = _history_start(protocol, usage=True, user_id=None)
    while True:
        raw = b"".join((prefix, b",".join([*pieces, _dumps(render(Turn("user", text)))]), b"]}"))
        if len(raw) <= size or not text:
            return raw
        # Escapes and multi-byte characters make bytes outnumber characters: trim by the excess.
        text = text[: max(0, len(text) - (len(raw) - size))]


def build_agent_history(
    protocol: BenchProtocol,
    size: int,
    corpus: Corpus,
    *,
    result_bytes: int = 300_000,
    seed: int = 3,
) -> bytes:
    """A coding agent's long history of about ``size`` bytes: a system prompt, then
    turns of one tool call and its ~``result_bytes`` result (file contents), then
    the user's question. What the ``refold`` variant sends: most of it is bulky
    tool results that the ``fold`` plugin can elide. Returns UTF-8 JSON bytes.
    """
    rng = random.Random(seed)
    prefix, render, pieces = _history_start(protocol, usage=False, user_id=None)
    pieces.append(_dumps(render(Turn("user", corpus.slice(rng, corpus.prose, 200, 1_000)))))
    total = len(prefix) + sum(len(p) + 1 for p in pieces)
    number = 0
    while total < size:
        number += 1
        call_id = f"call_{seed:x}_{number:06d}"
        args = json.dumps({"path": f"src/module_{rng.randrange(500)}.py"})
        result = corpus.slice(rng, corpus.code, result_bytes - 20_000, result_bytes + 20_000)
        for turn in (
            Turn("call", args, name=rng.choice(_TOOLS), call_id=call_id),
            Turn("result", result, call_id=call_id),
        ):
            pieces.append(_dumps(render(turn)))
            total += len(pieces[-1]) + 1
    question = "Summarize what these files do and where the bug is."
    pieces.append(_dumps(render(Turn("user", question))))
    return b"".join((prefix, b",".join(pieces), b"]}"))

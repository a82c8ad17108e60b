"""The emulator's pure answer builders, rendered to bytes without a server or a socket."""

from __future__ import annotations

import json
from collections.abc import Iterable

from proxy._emulator_frames import (
    AnswerContext,
    Frame,
    SSEFrames,
    chat_stream,
    error_plan,
    escape_text,
    frames_length,
    messages_stream,
    overflow_plan,
)
from proxy._emulator_script import DEFAULT_TEXT, Script


def render(frames: Iterable[Frame]) -> bytes:
    """What the server would write: bytes as they are, streamed text escaped."""
    out = bytearray()
    for frame in frames:
        for part in frame.parts:
            if isinstance(part, bytes):
                out += part
            else:
                for piece in part.source():
                    out += escape_text(piece)
    return bytes(out)


def context(script: Script) -> AnswerContext:
    return AnswerContext(
        script=script,
        rid=7,
        model="m",
        input_tokens=10,
        include_usage=True,
        empty=False,
        sse=SSEFrames(script.crlf),
    )


def data_lines(raw: bytes, newline: bytes = b"\n") -> list[bytes]:
    return [line[6:] for line in raw.split(newline) if line.startswith(b"data: ")]


def test_a_chat_stream_carries_the_text_then_usage_then_done() -> None:
    frames = list(chat_stream(context(Script(chunks=3))))
    raw = render(frames)
    payloads = data_lines(raw)
    assert payloads[-1] == b"[DONE]"
    chunks = [json.loads(p) for p in payloads[:-1]]
    text = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks if c["choices"])
    assert text == DEFAULT_TEXT
    assert chunks[-1]["usage"]["prompt_tokens"] == 10
    assert frames_length(frames) == len(raw)


def test_crlf_scripts_end_every_line_with_crlf() -> None:
    raw = render(messages_stream(context(Script(crlf=True))))
    assert raw.endswith(b"\r\n\r\n") and b"\n" not in raw.replace(b"\r\n", b"")
    events = [line[7:] for line in raw.split(b"\r\n") if line.startswith(b"event: ")]
    assert events[0] == b"message_start" and events[-1] == b"message_stop"


def test_error_plans_take_each_protocol_shape() -> None:
    anthropic = error_plan("anthropic", 529, "busy", rid=3)
    body = json.loads(render(anthropic.frames))
    assert anthropic.status == 529 and body["error"]["type"] == "overloaded_error"
    assert body["request_id"] == "req_emu000003"
    openai = json.loads(render(error_plan("openai", 429, "slow down", rid=3).frames))
    assert openai["error"]["code"] == "rate_limit_exceeded"
    plain = error_plan("plain", 400, "no", rid=3)
    assert plain.content_type.startswith("text/plain") and render(plain.frames) == b"no"


def test_overflow_is_the_real_error_of_each_route() -> None:
    ctx = context(Script())
    chat = json.loads(render(overflow_plan("chat", ctx, 4000, False).frames))
    assert chat["error"]["code"] == "context_length_exceeded"
    assert "1000 tokens" in chat["error"]["message"]
    messages = json.loads(render(overflow_plan("messages", ctx, 4000, False).frames))
    assert messages["error"]["message"].startswith("prompt is too long: 1000 tokens")
    streamed = overflow_plan("responses", ctx, 4000, True)
    assert streamed.status == 200 and streamed.sse
    assert b"response.failed" in render(streamed.frames)

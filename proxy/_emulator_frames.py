"""The emulator's answers as data: SSE frames and JSON bodies of the three APIs (pure).

Given a :class:`~proxy._emulator_script.Script` and a few request facts, these
builders decide an answer (:class:`Plan`: status, content type, frames) without
touching a socket; :mod:`proxy._emulator` writes the frames. Streamed answer text
is not materialized: a :class:`Text` part yields it piece by piece, escaped when
written. The shapes follow the real upstream APIs and are checked by driving the
emulator with the ``openai`` and ``anthropic`` SDKs. Deliberately independent of
``proxy._protocols`` and ``proxy._sse``, so our tests cannot agree with our own bugs.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from http import HTTPStatus
from typing import Any, Final, Literal

from ._emulator_script import DEFAULT_MODEL, Delta, Script, iter_deltas

#: Bytes of streamed text escaped and written at a time.
WRITE_CHUNK: Final = 64 * 1024
_OPENAI_CONTEXT: Final = 128_000
_ANTHROPIC_CONTEXT: Final = 200_000
# Stands where streamed text goes in a serialized payload; a private-use character
# so json.dumps(ensure_ascii=False) keeps it verbatim.
_SLOT: Final = "\ue000emulator-text\ue000"
_SLOT_BYTES: Final = _SLOT.encode()


# --------------------------------------------------------------------------- answer text


def escape_text(piece: str) -> bytes:
    """JSON string-body escaping of one piece; escaping is per character, so pieces concatenate."""
    return json.dumps(piece, ensure_ascii=False)[1:-1].encode()


def dumps(payload: Any) -> bytes:
    """Compact UTF-8 JSON of ``payload`` (non-ASCII kept verbatim), as the APIs send."""
    return json.dumps(payload, ensure_ascii=False, separators=(",", ":")).encode()


# --------------------------------------------------------------------------- frames


@dataclass(frozen=True, slots=True)
class Text:
    """Streamed JSON string content: ``source()`` yields raw text pieces to escape and write."""

    source: Callable[[], Iterator[str]]


Part = bytes | Text


@dataclass(frozen=True, slots=True)
class Frame:
    """One write unit: an SSE event (``counted``), a comment, or half of a JSON body."""

    parts: tuple[Part, ...]
    counted: bool = True
    delta: bool = False
    split_utf8: bool = False


def _frame_from(
    prefix: bytes, data: bytes, suffix: bytes, text: Text | None, **flags: bool
) -> Frame:
    if text is None:
        return Frame((prefix + data + suffix,), **flags)
    before, after = data.split(_SLOT_BYTES, 1)
    return Frame((prefix + before, text, after + suffix), **flags)


class SSEFrames:
    """Builds SSE frames with the script's line ending."""

    __slots__ = ("_nl",)

    def __init__(self, crlf: bool) -> None:
        self._nl = b"\r\n" if crlf else b"\n"

    def event(
        self,
        name: str | None,
        payload: dict[str, Any],
        *,
        text: Text | None = None,
        delta: bool = False,
        split: bool = False,
    ) -> Frame:
        """One SSE event (``event:`` line only if ``name``), payload as compact JSON."""
        nl = self._nl
        head = b"event: " + name.encode() + nl if name else b""
        return _frame_from(
            head + b"data: ", dumps(payload), nl + nl, text, delta=delta, split_utf8=split
        )

    def done(self) -> Frame:
        """The ``data: [DONE]`` event that ends an OpenAI chat stream."""
        return Frame((b"data: [DONE]" + self._nl + self._nl,))

    def comment(self, text: str) -> Frame:
        """An SSE comment (``: text``); not counted as an event."""
        return Frame((b": " + text.encode() + self._nl + self._nl,), counted=False)


def _json_frames(payload: dict[str, Any], text: Text | None) -> list[Frame]:
    """A JSON body as two counted frames: before the answer text, and the rest."""
    data = dumps(payload)
    if text is not None and _SLOT_BYTES in data:
        before, after = data.split(_SLOT_BYTES, 1)
        return [Frame((before,)), Frame((text, after))]
    middle = len(data) // 2
    return [Frame((data[:middle],)), Frame((data[middle:],))]


def frames_length(frames: Iterable[Frame]) -> int:
    """Total bytes ``frames`` write, streamed text escaped (for ``Content-Length``)."""
    total = 0
    for frame in frames:
        for part in frame.parts:
            if isinstance(part, bytes):
                total += len(part)
            else:
                total += sum(len(escape_text(piece)) for piece in part.source())
    return total


# --------------------------------------------------------------------------- answers

Route = Literal["chat", "responses", "messages", "count_tokens", "models", "root"]
Shape = Literal["openai", "anthropic", "plain"]


@dataclass(slots=True)
class Plan:
    """A decided answer: status, headers and the frames to write."""

    status: int
    content_type: str
    frames: Iterable[Frame]
    sse: bool = False
    paced: bool = False
    headers: dict[str, str] = field(default_factory=dict)


@dataclass(slots=True)
class AnswerContext:
    """Per-answer values shared by the protocol renderers.

    Token figures: ``input_tokens`` is the whole prompt; ``cache_read`` and
    ``cache_write`` are the cache-read and cache-write tokens reported in usage;
    ``uncached_input_tokens``, when set, is Anthropic's ``input_tokens`` (which counts
    neither cached part); None reports ``input_tokens`` there.
    """

    script: Script
    rid: int
    model: str
    input_tokens: int
    include_usage: bool
    empty: bool
    sse: SSEFrames
    cache_read: int = 0
    cache_write: int = 0
    uncached_input_tokens: int | None = None
    created: int = field(default_factory=lambda: int(time.time()))
    sequence: int = 0

    @property
    def output_tokens(self) -> int:
        """Output tokens reported: one per text delta, 0 for an empty answer."""
        return 0 if self.empty else self.script.delta_count()

    def deltas(self) -> Iterator[Delta]:
        """The text deltas of this answer (none for an empty answer)."""
        return iter(()) if self.empty else iter_deltas(self.script)

    def full_text(self) -> Text:
        """The whole answer text as one streamed :class:`Text` part."""

        def source() -> Iterator[str]:
            for delta in self.deltas():
                yield from delta.pieces()

        return Text(source)

    def next_sequence(self) -> int:
        """The next Responses ``sequence_number`` (0, 1, 2, ...)."""
        value = self.sequence
        self.sequence += 1
        return value


def _fill(value: Any, text: str) -> Any:
    """A copy of ``value`` with every :data:`_SLOT` string replaced by ``text``."""
    if value == _SLOT:
        return text
    if isinstance(value, dict):
        return {key: _fill(item, text) for key, item in value.items()}
    if isinstance(value, list):
        return [_fill(item, text) for item in value]
    return value


def _delta_frame(
    ctx: AnswerContext, delta: Delta, name: str | None, payload: dict[str, Any]
) -> Frame:
    """A text-delta event; ``payload`` holds :data:`_SLOT` where the delta text goes."""
    if delta.filler:
        return ctx.sse.event(name, payload, text=Text(delta.pieces), delta=True)
    return ctx.sse.event(name, _fill(payload, delta.text), delta=True, split=delta.split)


# OpenAI chat -----------------------------------------------------------------


def _chat_usage(ctx: AnswerContext) -> dict[str, Any]:
    return {
        "prompt_tokens": ctx.input_tokens,
        "completion_tokens": ctx.output_tokens,
        "total_tokens": ctx.input_tokens + ctx.output_tokens,
        "prompt_tokens_details": {"cached_tokens": ctx.cache_read, "audio_tokens": 0},
        "completion_tokens_details": {
            "reasoning_tokens": 0,
            "audio_tokens": 0,
            "accepted_prediction_tokens": 0,
            "rejected_prediction_tokens": 0,
        },
    }


def chat_stream(ctx: AnswerContext) -> Iterator[Frame]:
    """OpenAI chat completion chunks, then the usage chunk if asked, then ``[DONE]``."""
    with_usage = ctx.include_usage or ctx.script.usage
    base: dict[str, Any] = {
        "id": f"chatcmpl-emu{ctx.rid:06d}",
        "object": "chat.completion.chunk",
        "created": ctx.created,
        "model": ctx.model,
        "service_tier": "default",
        "system_fingerprint": "fp_emulator",
    }

    def chunk(delta: dict[str, Any], finish: str | None) -> dict[str, Any]:
        choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}
        payload = {**base, "choices": [choice]}
        if with_usage:
            payload["usage"] = None
        return payload

    yield ctx.sse.event(None, chunk({"role": "assistant", "content": "", "refusal": None}, None))
    for delta in ctx.deltas():
        yield _delta_frame(ctx, delta, None, chunk({"content": _SLOT}, None))
    yield ctx.sse.event(None, chunk({}, "stop"))
    if with_usage:
        yield ctx.sse.event(None, {**base, "choices": [], "usage": _chat_usage(ctx)})
    yield ctx.sse.done()


def chat_json(ctx: AnswerContext) -> list[Frame]:
    """A non-streamed OpenAI chat completion object, as two frames."""
    message: dict[str, Any] = {
        "role": "assistant",
        "content": _SLOT,
        "refusal": None,
        "annotations": [],
    }
    payload: dict[str, Any] = {
        "id": f"chatcmpl-emu{ctx.rid:06d}",
        "object": "chat.completion",
        "created": ctx.created,
        "model": ctx.model,
        "choices": [{"index": 0, "message": message, "logprobs": None, "finish_reason": "stop"}],
        "usage": _chat_usage(ctx),
        "service_tier": "default",
        "system_fingerprint": "fp_emulator",
    }
    return _json_frames(payload, ctx.full_text())


# OpenAI Responses ------------------------------------------------------------


def _responses_usage(ctx: AnswerContext) -> dict[str, Any]:
    return {
        "input_tokens": ctx.input_tokens,
        "input_tokens_details": {"cached_tokens": ctx.cache_read},
        "output_tokens": ctx.output_tokens,
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": ctx.input_tokens + ctx.output_tokens,
    }


def _response_object(
    ctx: AnswerContext,
    status: str,
    output: list[dict[str, Any]],
    usage: dict[str, Any] | None,
    error: dict[str, Any] | None = None,
) -> dict[str, Any]:
    return {
        "id": f"resp_emu{ctx.rid:06d}",
        "object": "response",
        "created_at": ctx.created,
        "status": status,
        "background": False,
        "error": error,
        "incomplete_details": None,
        "instructions": None,
        "max_output_tokens": None,
        "model": ctx.model,
        "output": output,
        "parallel_tool_calls": True,
        "previous_response_id": None,
        "reasoning": {"effort": None, "summary": None},
        "service_tier": "default",
        "store": True,
        "temperature": 1.0,
        "text": {"format": {"type": "text"}},
        "tool_choice": "auto",
        "tools": [],
        "top_p": 1.0,
        "truncation": "disabled",
        "usage": usage,
        "user": None,
        "metadata": {},
    }


def _output_text_part(text: str) -> dict[str, Any]:
    return {"type": "output_text", "annotations": [], "logprobs": [], "text": text}


def _message_item(ctx: AnswerContext, status: str, content: list[dict[str, Any]]) -> dict[str, Any]:
    item_id = f"msg_emu{ctx.rid:06d}"
    return {
        "id": item_id,
        "type": "message",
        "status": status,
        "content": content,
        "role": "assistant",
    }


def _responses_prelude(ctx: AnswerContext) -> Iterator[Frame]:
    for kind in ("response.created", "response.in_progress"):
        payload = {
            "type": kind,
            "sequence_number": ctx.next_sequence(),
            "response": _response_object(ctx, "in_progress", [], None),
        }
        yield ctx.sse.event(kind, payload)


def responses_stream(ctx: AnswerContext) -> Iterator[Frame]:
    """The Responses event sequence, ``response.created`` to ``response.completed``."""
    sse = ctx.sse
    yield from _responses_prelude(ctx)
    output: list[dict[str, Any]] = []
    if not ctx.empty:
        item_id = f"msg_emu{ctx.rid:06d}"
        where = {"item_id": item_id, "output_index": 0, "content_index": 0}
        kind = "response.output_item.added"
        item = _message_item(ctx, "in_progress", [])
        payload = {
            "type": kind,
            "sequence_number": ctx.next_sequence(),
            "output_index": 0,
            "item": item,
        }
        yield sse.event(kind, payload)
        kind = "response.content_part.added"
        payload = {
            "type": kind,
            "sequence_number": ctx.next_sequence(),
            **where,
            "part": _output_text_part(""),
        }
        yield sse.event(kind, payload)
        kind = "response.output_text.delta"
        for delta in ctx.deltas():
            payload = {
                "type": kind,
                "sequence_number": ctx.next_sequence(),
                **where,
                "delta": _SLOT,
                "logprobs": [],
            }
            yield _delta_frame(ctx, delta, kind, payload)
        kind = "response.output_text.done"
        payload = {
            "type": kind,
            "sequence_number": ctx.next_sequence(),
            **where,
            "text": _SLOT,
            "logprobs": [],
        }
        yield sse.event(kind, payload, text=ctx.full_text())
        kind = "response.content_part.done"
        payload = {
            "type": kind,
            "sequence_number": ctx.next_sequence(),
            **where,
            "part": _output_text_part(_SLOT),
        }
        yield sse.event(kind, payload, text=ctx.full_text())
        kind = "response.output_item.done"
        output = [_message_item(ctx, "completed", [_output_text_part(_SLOT)])]
        payload = {
            "type": kind,
            "sequence_number": ctx.next_sequence(),
            "output_index": 0,
            "item": output[0],
        }
        yield sse.event(kind, payload, text=ctx.full_text())
    kind = "response.completed"
    response = _response_object(ctx, "completed", output, _responses_usage(ctx))
    payload = {"type": kind, "sequence_number": ctx.next_sequence(), "response": response}
    yield sse.event(kind, payload, text=ctx.full_text() if output else None)


def responses_json(ctx: AnswerContext) -> list[Frame]:
    """A non-streamed Responses ``response`` object, as two frames."""
    output = [] if ctx.empty else [_message_item(ctx, "completed", [_output_text_part(_SLOT)])]
    payload = _response_object(ctx, "completed", output, _responses_usage(ctx))
    return _json_frames(payload, ctx.full_text())


def _responses_failed_stream(ctx: AnswerContext, message: str) -> Iterator[Frame]:
    yield from _responses_prelude(ctx)
    error = {"code": "context_length_exceeded", "message": message}
    kind = "response.failed"
    response = _response_object(ctx, "failed", [], None, error)
    yield ctx.sse.event(
        kind, {"type": kind, "sequence_number": ctx.next_sequence(), "response": response}
    )


# Anthropic messages ----------------------------------------------------------


def _anthropic_usage(ctx: AnswerContext, output_tokens: int) -> dict[str, Any]:
    usage: dict[str, Any] = {
        "input_tokens": (
            ctx.input_tokens if ctx.uncached_input_tokens is None else ctx.uncached_input_tokens
        ),
        "cache_creation_input_tokens": ctx.cache_write,
        "cache_read_input_tokens": ctx.cache_read,
        "output_tokens": output_tokens,
    }
    if ctx.uncached_input_tokens is not None:
        # The prompt cache writes with the default 5-minute lifetime, as a plain
        # ``cache_control: {"type": "ephemeral"}`` does.
        usage["cache_creation"] = {
            "ephemeral_5m_input_tokens": ctx.cache_write,
            "ephemeral_1h_input_tokens": 0,
        }
    return usage


def _anthropic_message(
    ctx: AnswerContext, content: list[dict[str, Any]], **rest: Any
) -> dict[str, Any]:
    return {
        "id": f"msg_emu{ctx.rid:06d}",
        "type": "message",
        "role": "assistant",
        "model": ctx.model,
        "content": content,
        **rest,
    }


def messages_stream(ctx: AnswerContext) -> Iterator[Frame]:
    """The Anthropic Messages events, ``message_start`` to ``message_stop``."""
    sse = ctx.sse
    message = _anthropic_message(
        ctx, [], stop_reason=None, stop_sequence=None, usage=_anthropic_usage(ctx, 1)
    )
    yield sse.event("message_start", {"type": "message_start", "message": message})
    if ctx.empty:
        yield sse.event("ping", {"type": "ping"})
    else:
        block = {"type": "text", "text": ""}
        payload = {"type": "content_block_start", "index": 0, "content_block": block}
        yield sse.event("content_block_start", payload)
        yield sse.event("ping", {"type": "ping"})
        for delta in ctx.deltas():
            payload = {
                "type": "content_block_delta",
                "index": 0,
                "delta": {"type": "text_delta", "text": _SLOT},
            }
            yield _delta_frame(ctx, delta, "content_block_delta", payload)
        yield sse.event("content_block_stop", {"type": "content_block_stop", "index": 0})
    payload = {
        "type": "message_delta",
        "delta": {"stop_reason": "end_turn", "stop_sequence": None},
        "usage": _anthropic_usage(ctx, ctx.output_tokens),
    }
    yield sse.event("message_delta", payload)
    yield sse.event("message_stop", {"type": "message_stop"})


def messages_json(ctx: AnswerContext) -> list[Frame]:
    """A non-streamed Anthropic ``message`` object, as two frames."""
    content = [] if ctx.empty else [{"type": "text", "text": _SLOT}]
    payload = _anthropic_message(
        ctx,
        content,
        stop_reason="end_turn",
        stop_sequence=None,
        usage=_anthropic_usage(ctx, ctx.output_tokens),
    )
    return _json_frames(payload, ctx.full_text())


# decoration shared by all streams ----------------------------------------------


def decorate(frames: Iterator[Frame], ctx: AnswerContext, route: Route) -> Iterator[Frame]:
    """Add the script's comments, pings and unknown event around a protocol's frames."""
    script, sse = ctx.script, ctx.sse
    unknown_pending = script.unknown_event
    for frame in frames:
        if script.comments and frame.counted:
            yield sse.comment("keep-alive")
        yield frame
        if frame.delta and script.ping:
            if route == "messages":
                yield sse.event("ping", {"type": "ping"})
            else:
                yield sse.comment("ping")
        if unknown_pending and (frame.delta or ctx.output_tokens == 0):
            unknown_pending = False
            payload: dict[str, Any] = {"type": "emulator.unknown"}
            if route == "responses":
                payload["sequence_number"] = ctx.next_sequence()
            payload["note"] = "an event type no client knows (x-emulator unknown_event=1)"
            if script.comments:
                yield sse.comment("keep-alive")
            yield sse.event("emulator.unknown", payload)


# errors ----------------------------------------------------------------------

_ANTHROPIC_ERROR_TYPES: Final = {
    400: "invalid_request_error",
    401: "authentication_error",
    402: "billing_error",
    403: "permission_error",
    404: "not_found_error",
    413: "request_too_large",
    429: "rate_limit_error",
    500: "api_error",
    504: "timeout_error",
    529: "overloaded_error",
}
REASON_PHRASES: Final = {529: "Overloaded"}


def reason_phrase(status: int) -> str:
    """The HTTP reason phrase of ``status`` (529 "Overloaded" as Anthropic sends it)."""
    if status in REASON_PHRASES:
        return REASON_PHRASES[status]
    try:
        return HTTPStatus(status).phrase
    except ValueError:
        return "Error"


def error_plan(
    shape: Shape,
    status: int,
    message: str,
    *,
    rid: int,
    error_type: str | None = None,
    param: str | None = None,
    code: str | None = None,
) -> Plan:
    """An error answer in a protocol's shape.

    OpenAI: ``{"error": {"message", "type", "param", "code"}}``; Anthropic:
    ``{"type": "error", "error": {"type", "message"}, "request_id"}`` (types per
    Anthropic's "Errors" page); plain: the message as ``text/plain``.
    """
    if shape == "plain":
        frame = Frame((message.encode(),))
        return Plan(status, "text/plain; charset=utf-8", [frame])
    if shape == "anthropic":
        kind = error_type or _ANTHROPIC_ERROR_TYPES.get(
            status, "api_error" if status >= 500 else "invalid_request_error"
        )
        payload: dict[str, Any] = {
            "type": "error",
            "error": {"type": kind, "message": message},
            "request_id": f"req_emu{rid:06d}",
        }
    else:
        if error_type is None:
            if status == 429:
                error_type, code = "requests", code or "rate_limit_exceeded"
            elif status == 401:
                error_type, code = "invalid_request_error", code or "invalid_api_key"
            else:
                error_type = "server_error" if status >= 500 else "invalid_request_error"
        payload = {"error": {"message": message, "type": error_type, "param": param, "code": code}}
    return Plan(status, "application/json", [Frame((dumps(payload),))])


def overflow_plan(route: Route, ctx: AnswerContext, body_size: int, stream: bool) -> Plan:
    """The real context-overflow answer of ``route`` for a body of ``body_size`` bytes."""
    script, tokens = ctx.script, body_size // 4
    if script.plain:
        limit = script.context or _OPENAI_CONTEXT
        text = (
            f"This model's maximum context length is {limit} tokens. However, you requested "
            f"{tokens} tokens ({tokens} in the messages, 0 in the completion). Please reduce "
            "the length of the messages or completion."
        )
        return error_plan("plain", 400, text, rid=ctx.rid)
    if route == "messages":
        limit = script.context or _ANTHROPIC_CONTEXT
        text = f"prompt is too long: {tokens} tokens > {limit} maximum"
        return error_plan("anthropic", 400, text, rid=ctx.rid)
    if route == "responses" and stream:
        text = (
            "Your input exceeds the context window of this model. "
            "Please adjust your input and try again."
        )
        frames = decorate(_responses_failed_stream(ctx, text), ctx, route)
        return Plan(200, "text/event-stream; charset=utf-8", frames, sse=True, paced=True)
    limit = script.context or _OPENAI_CONTEXT
    text = (
        f"This model's maximum context length is {limit} tokens. However, your messages "
        f"resulted in {tokens} tokens. Please reduce the length of the messages."
    )
    return error_plan(
        "openai",
        400,
        text,
        rid=ctx.rid,
        error_type="invalid_request_error",
        param="input" if route == "responses" else "messages",
        code="context_length_exceeded",
    )


def models_payload(shape: Shape) -> dict[str, Any]:
    """The ``GET /v1/models`` list in the OpenAI or the Anthropic shape."""
    model: dict[str, Any]
    if shape == "anthropic":
        model = {
            "type": "model",
            "id": DEFAULT_MODEL,
            "display_name": "Emulator 1",
            "created_at": "2025-01-01T00:00:00Z",
        }
        return {
            "data": [model],
            "has_more": False,
            "first_id": DEFAULT_MODEL,
            "last_id": DEFAULT_MODEL,
        }
    model = {
        "id": DEFAULT_MODEL,
        "object": "model",
        "created": 1735689600,
        "owned_by": "context-proxy-emulator",
    }
    return {"object": "list", "data": [model]}

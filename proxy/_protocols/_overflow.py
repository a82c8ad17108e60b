"""Context-window overflow classification of upstream error payloads (pure).

An *overflow* is an upstream refusal because the conversation no longer fits the
model's context window: the proxy answers it by refolding the history at the
next fold level and sending again. Anything else (rate limits, byte-size
limits, auth, 5xx) is passed to the client as is, so this module errs on the
side of "not an overflow".

Sources of the wordings (all seen on the wire):

* OpenAI: HTTP 400, ``error.code == "context_length_exceeded"``, message
  "This model's maximum context length is N tokens. However, your messages
  resulted in M tokens..." (chat) or "Your input exceeds the context window of
  this model..." (Responses).
* Anthropic: HTTP 400 ``invalid_request_error``, "prompt is too long: N tokens
  > M maximum". Its 413 ``request_too_large`` is a byte limit, not the context.
* vLLM (OpenAI-compatible server): "This model's maximum context length is N
  tokens. However, you requested M tokens (...)"; the v1 input processor says
  "The decoder prompt (length N) is longer than the maximum model length of M"
  (the "encoder prompt" variant is about the multimodal encoder cache, not the
  history, so it is excluded); "'max_tokens' or 'max_completion_tokens' is too
  large: X. This model's maximum context length is N tokens and your request
  has M input tokens" is excluded when X alone is >= N (no refold can help).
* SGLang: "The input (N tokens) is longer than the model's context length (M
  tokens)."; "Requested token count exceeds the model's maximum context length
  of N tokens."
* Others seen behind OpenAI-compatible gateways: "Input is too long for
  requested model" (Bedrock), "the request exceeds the available context size"
  (llama.cpp), "This model's maximum prompt length is N" (xAI), "Please reduce
  the length of the messages" (Groq).
"""

from __future__ import annotations

import re
from typing import Final

from ._common import decode_any

__all__ = ["MAX_ERROR_BODY", "is_overflow_payload", "message_says_overflow", "stated_tokens"]

# Error bodies are small; past this size a body is searched as text only (and
# only this much of it), never parsed.
MAX_ERROR_BODY: Final = 64 * 1024

# 413 and 422 because some OpenAI-compatible servers answer an over-long prompt
# with them; 5xx is an upstream fault and is never taken for an overflow.
_OVERFLOW_STATUSES: Final = frozenset({400, 413, 422})

_OVERFLOW_RE: Final = re.compile(
    r"context_length_exceeded"
    r"|max(?:imum)?[ _]context[ _]length"
    r"|longer\s+than\s+the\s+(?:model\W?s\s+context\s+length|maximum\s+model\s+length)"
    r"|exceed\w*\s+(?:the\s+)?(?:model\W?s\s+)?(?:available\s+)?context\s+(?:window|size)"
    r"|context[ _]window[ _]exceeded"
    r"|context[ _]length[ _]exceeded"
    r"|prompt\s+is\s+too\s+long"
    r"|input\s+is\s+too\s+long"
    r"|maximum\s+prompt\s+length"
    r"|reduce\s+the\s+length\s+of\s+the\s+messages",
    re.IGNORECASE,
)
_ENCODER_RE: Final = re.compile(r"encoder\s+prompt", re.IGNORECASE)
_MAX_TOKENS_TOO_LARGE_RE: Final = re.compile(
    r"max_(?:completion_)?tokens'?(?:\s+or\s+'?max_completion_tokens'?)?\s+is\s+too\s+large:\s*(\d+)",
    re.IGNORECASE,
)
_WINDOW_RE: Final = re.compile(r"maximum\s+context\s+length\s+is\s+(\d+)", re.IGNORECASE)

_OVERFLOW_CODES: Final = frozenset({"context_length_exceeded"})


def message_says_overflow(text: str) -> bool:
    """Whether an error message reports a context-window overflow (wordings: module docstring).

    Args:
        text: the error message or plain-text body (keep it bounded; a few KiB).

    Returns:
        ``True`` if a known overflow wording is present and no exclusion applies.
    """
    if _OVERFLOW_RE.search(text) is None:
        return False
    if _ENCODER_RE.search(text) is not None:
        return False
    too_large = _MAX_TOKENS_TOO_LARGE_RE.search(text)
    window = _WINDOW_RE.search(text)
    # Not an overflow of the *history*: the requested output alone fills the window.
    return not (too_large and window and int(too_large.group(1)) >= int(window.group(1)))


def _collect(obj: object, codes: list[str], messages: list[str], depth: int) -> None:
    """Gather code/type strings and message strings from the usual error shapes.

    Shapes: OpenAI ``{"error": {"message", "type", "code"}}``, Anthropic
    ``{"type": "error", "error": {"type", "message"}}``, old vLLM
    ``{"object": "error", "message", "type", "code"}``, FastAPI
    ``{"detail": str | [{"msg": str}]}``, ``{"error": str}``, a bare string.
    """
    if depth > 3:
        return
    if isinstance(obj, str):
        messages.append(obj)
        return
    if isinstance(obj, list):
        for item in obj[:8]:
            _collect(item, codes, messages, depth + 1)
        return
    if not isinstance(obj, dict):
        return
    for key in ("code", "type"):
        value = obj.get(key)
        if isinstance(value, str):
            codes.append(value)
    for key in ("message", "msg"):
        value = obj.get(key)
        if isinstance(value, str):
            messages.append(value)
    for key in ("error", "detail"):
        if key in obj:
            _collect(obj[key], codes, messages, depth + 1)


def is_overflow_payload(status: int, content_type: str | None, body: bytes) -> bool:
    """Whether an upstream error response reports a context-window overflow.

    Protocol-independent: an OpenAI-compatible server behind the Anthropic
    route (or the reverse) is classified by the same rules.

    Args:
        status: HTTP status of the upstream response.
        content_type: its ``Content-Type`` header, if any.
        body: the response body (only the first :data:`MAX_ERROR_BODY` bytes
            are looked at).

    Returns:
        ``True`` for a 400/413/422 whose structured code is
        ``context_length_exceeded`` or whose message matches a known overflow
        wording. Never raises, whatever the bytes.
    """
    if status not in _OVERFLOW_STATUSES or not body:
        return False
    head = bytes(body[:MAX_ERROR_BODY])
    looks_json = head.lstrip()[:1] in (b"{", b"[", b'"') or (
        content_type is not None and "json" in content_type.lower()
    )
    if looks_json and len(body) <= MAX_ERROR_BODY:
        obj = decode_any(head)
        if obj is not None:
            codes: list[str] = []
            messages: list[str] = []
            _collect(obj, codes, messages, 0)
            if _OVERFLOW_CODES.intersection(codes):
                return True
            if messages:
                return any(message_says_overflow(m[:MAX_ERROR_BODY]) for m in messages)
    return message_says_overflow(head.decode("utf-8", "replace"))


# The figures an overflow message states (wordings and sources: the module doc). Each
# pattern gives the prompt's tokens (group "prompt") and/or the window (group "window").
_FIGURES: Final = tuple(
    re.compile(pattern, re.IGNORECASE)
    for pattern in (
        # Anthropic: "prompt is too long: 210000 tokens > 200000 maximum"
        r"too\s+long:\s*(?P<prompt>\d+)\s+tokens\s*>\s*(?P<window>\d+)\s+maximum",
        # vLLM v1: "The decoder prompt (length N) is longer than the maximum model length of M"
        r"decoder\s+prompt\s+\(length\s+(?P<prompt>\d+)\).{0,40}?maximum\s+model\s+length\s+of\s+(?P<window>\d+)",
        # SGLang: "The input (N tokens) is longer than the model's context length (M tokens)"
        r"input\s+\((?P<prompt>\d+)\s+tokens\).{0,40}?context\s+length\s+\((?P<window>\d+)",
        # OpenAI and vLLM: "maximum context length is N tokens"
        r"maximum\s+context\s+length\s+(?:is|of)\s+(?P<window>\d+)",
        # OpenAI: "your messages resulted in M tokens";
        # vLLM: "you requested M tokens (M in the messages, ..."
        r"resulted\s+in\s+(?P<prompt>\d+)\s+tokens",
        r"\((?P<prompt>\d+)\s+in\s+the\s+messages",
    )
)


def stated_tokens(body: bytes) -> tuple[int | None, int | None]:
    """The token figures an overflow error states: ``(prompt tokens, window tokens)``.

    Read from the text of the first :data:`MAX_ERROR_BODY` bytes of an answer
    :func:`is_overflow_payload` classified as an overflow (JSON or plain text:
    the numbers appear unescaped either way). Either figure is ``None`` when the
    wording does not state it (OpenAI Responses says only "exceeds the context
    window"). Never raises.
    """
    text = bytes(body[:MAX_ERROR_BODY]).decode("utf-8", "replace")
    prompt: int | None = None
    window: int | None = None
    for pattern in _FIGURES:
        found = pattern.search(text)
        if found is None:
            continue
        figures = found.groupdict()
        if prompt is None and figures.get("prompt") is not None:
            prompt = int(figures["prompt"])
        if window is None and figures.get("window") is not None:
            window = int(figures["window"])
    return prompt, window

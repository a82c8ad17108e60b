"""The chat usage reader gives exactly what the full decode gives, whatever the bytes.

:func:`proxy._protocols._openai.chat_usage` decodes only payloads holding the bytes
``"usage"`` (a usage key spelled with an escape is not read: the oracle below says
so too). It once also skipped chunks whose ``usage`` is ``null`` by counting bytes,
which measured 2-7 times slower than the typed decode and is gone; these cases
guard any shortcut added later. The oracle is the decode itself, run on every
payload: random JSON objects with ``usage`` at the top and nested, null or not,
spelled with escapes, with odd spacing, duplicated, quoted inside strings, and cut
short; and the chunks real upstreams send.
"""

from __future__ import annotations

import json

from hypothesis import given
from hypothesis import strategies as st

from proxy._protocols import _openai
from proxy._protocols._common import SMALL_EVENT, UsageReport, decode_typed
from proxy._sse import SSEFramer


def decoded_usage(data: bytes) -> UsageReport | None:
    """The usage a full decode of ``data`` finds (what chat_usage returned before the shortcut)."""
    if b'"usage"' not in data:
        return None
    chunk = decode_typed(_openai._CHUNK, data)
    if chunk is None or chunk.usage is None:
        return None
    details = chunk.usage.prompt_tokens_details
    # The answer's model: a top-level "model", when it is a string.
    whole = json.loads(data)
    model = whole.get("model") if isinstance(whole, dict) else None
    return UsageReport(
        input_tokens=chunk.usage.prompt_tokens,
        output_tokens=chunk.usage.completion_tokens,
        cache_read_tokens=None if details is None else details.cached_tokens,
        response_model=model if isinstance(model, str) else None,
    )


_USAGE_VALUES = st.sampled_from(
    [
        b"null",
        b"{}",
        b'{"prompt_tokens":7,"completion_tokens":3}',
        b'{"prompt_tokens":9,"prompt_tokens_details":{"cached_tokens":4}}',
        b'"usage"',
        b"nullx",
        b"[]",
    ]
)
_KEYS = st.sampled_from(
    [b'"usage"', b'"\\u0075sage"', b'"usag\\u0065"', b'"id"', b'"choices"', b'"x"']
)
_COLONS = st.sampled_from([b":", b" :", b": ", b":\n"])
_STRINGS = st.sampled_from(
    [
        b'"usage"',
        b'"\\"usage\\":null"',
        b'"a \\"usage\\": {\\"prompt_tokens\\": 1}"',
        b'"caf\\u00e9"',
    ]
)


@st.composite
def payloads(draw: st.DrawFn) -> bytes:
    members: list[bytes] = []
    for _ in range(draw(st.integers(min_value=0, max_value=5))):
        key = draw(_KEYS)
        kind = draw(st.sampled_from(["usage", "string", "nested", "choices"]))
        if kind == "usage":
            value = draw(_USAGE_VALUES)
        elif kind == "string":
            value = draw(_STRINGS)
        elif kind == "nested":
            value = b'{"usage":' + draw(_USAGE_VALUES) + b"}"
        else:
            value = b'[{"delta":{"content":' + draw(_STRINGS) + b"}}]"
        members.append(key + draw(_COLONS) + value)
    data = b"{" + b",".join(members) + b"}"
    if draw(st.booleans()):
        data = data[: draw(st.integers(min_value=0, max_value=len(data)))]
    return data


@given(payloads())
def test_the_shortcut_never_changes_the_usage_read(data: bytes) -> None:
    assert _openai.chat_usage(data, limit=SMALL_EVENT) == decoded_usage(data)
    assert _openai.chat_usage(data, limit=None) == decoded_usage(data)


@given(
    st.dictionaries(
        st.sampled_from(["usage", "id", "choices", "model", "error"]),
        st.recursive(
            st.none() | st.integers() | st.text(max_size=8),
            lambda inner: (
                st.lists(inner, max_size=3)
                | st.dictionaries(
                    st.sampled_from(["usage", "prompt_tokens", "a"]), inner, max_size=3
                )
            ),
            max_leaves=8,
        ),
    ),
    st.booleans(),
    st.booleans(),
)
def test_the_shortcut_agrees_on_any_json_object(
    obj: dict[str, object], ascii_only: bool, spaced: bool
) -> None:
    separators = (", ", ": ") if spaced else (",", ":")
    data = json.dumps(obj, ensure_ascii=ascii_only, separators=separators).encode()
    assert _openai.chat_usage(data, limit=None) == decoded_usage(data)


CHUNK = (
    b'{"id":"chatcmpl-1","object":"chat.completion.chunk","created":1,"model":"gpt-4.1",'
    b'"choices":[{"index":0,"delta":{"content":"Hi"},"logprobs":null,"finish_reason":null}],'
    b'"usage":null}'
)
LAST = (
    b'{"id":"chatcmpl-1","object":"chat.completion.chunk","created":1,"model":"gpt-4.1",'
    b'"choices":[],"usage":{"prompt_tokens":253,"completion_tokens":3,"total_tokens":256,'
    b'"prompt_tokens_details":{"cached_tokens":0,"audio_tokens":0}}}'
)


def test_real_chunks_read_as_the_decode_reads() -> None:
    assert _openai.chat_usage(CHUNK, limit=None) is None
    assert _openai.chat_usage(LAST, limit=None) == UsageReport(253, 3, 0, response_model="gpt-4.1")
    # The same null chunk with an escape somewhere, or spaced: the same answer.
    escaped = CHUNK.replace(b'"Hi"', b'"\\u00e9"')
    assert _openai.chat_usage(escaped, limit=None) is None
    spaced = CHUNK.replace(b'"usage":null', b'"usage": null')
    assert _openai.chat_usage(spaced, limit=None) is None
    # A nested null usage beside the real one does not hide it.
    nested = LAST[:-1] + b',"x":{"usage":null}}'
    assert _openai.chat_usage(nested, limit=None) == UsageReport(
        253, 3, 0, response_model="gpt-4.1"
    )
    # A usage key spelled only with an escape is not read (the decode alone would).
    only_escaped = LAST.replace(b'"usage"', b'"\\u0075sage"')
    assert _openai.chat_usage(only_escaped, limit=None) is None
    # An escaped key is a usage key too: a null spelled plainly does not hide it.
    hidden = LAST[:-1] + b',"usage":null,"\\u0075sage":{"prompt_tokens":5}}'
    assert _openai.chat_usage(hidden, limit=None) == decoded_usage(hidden)
    # A streamed chunk reads as its data does; [DONE] and a truncated chunk read nothing.
    framed = SSEFramer().feed(b"data: " + LAST + b"\n\ndata: [DONE]\n\n")
    assert [_openai.chat_usage_from_event(e) for e in framed] == [
        UsageReport(253, 3, 0, response_model="gpt-4.1"),
        None,
    ]
    cut = SSEFramer(max_data=10).feed(b"data: " + LAST + b"\n\n")
    assert cut[0].truncated and _openai.chat_usage_from_event(cut[0]) is None

"""The structural view of request bodies and the spliced outbound body (pure, no sockets).

Property tests: on random histories of the three protocols, serialized in random
JSON styles (escaped or raw unicode, compact or indented), random edits made
through the view give an outbound body that decodes to the edited object and is
byte-identical to the input outside the replaced values.
"""

from __future__ import annotations

import json
import random
import tracemalloc
import weakref
from typing import Any

import msgspec
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from proxy._protocols import Protocol
from proxy._structure import BodyView, Draft, EditConflict, Node, ParsedHolder, Splice
from proxy._wire import WireError

# -- strategies ---------------------------------------------------------------------------

_TEXT = st.text(
    alphabet=st.characters(codec="utf-8", exclude_categories=("Cs",))
    | st.sampled_from('"\\/\n\t\x00\x1f'),
    max_size=40,
)
_SCALARS = (
    st.none()
    | st.booleans()
    | st.integers(min_value=-(2**63), max_value=2**63 - 1)
    | st.floats(allow_nan=False, allow_infinity=False)
    | _TEXT
)
_JSON = st.recursive(
    _SCALARS,
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(_TEXT, inner, max_size=4),
    max_leaves=12,
)


@st.composite
def _chat_message(draw: st.DrawFn) -> dict[str, Any]:
    role = draw(st.sampled_from(["system", "user", "assistant", "tool"]))
    message: dict[str, Any] = {"role": role}
    if draw(st.booleans()):
        message["content"] = draw(_TEXT)
    else:
        message["content"] = draw(
            st.lists(
                st.fixed_dictionaries({"type": st.just("text"), "text": _TEXT})
                | st.fixed_dictionaries(
                    {
                        "type": st.just("image_url"),
                        "image_url": st.fixed_dictionaries({"url": _TEXT}),
                    }
                ),
                max_size=3,
            )
        )
    if role == "assistant" and draw(st.booleans()):
        args = json.dumps(draw(st.dictionaries(_TEXT, _JSON, max_size=3)))
        message["tool_calls"] = [
            {"id": draw(_TEXT), "type": "function", "function": {"name": "f", "arguments": args}}
        ]
    if draw(st.booleans()):
        message["extra"] = draw(_JSON)
    return message


@st.composite
def _anthropic_message(draw: st.DrawFn) -> dict[str, Any]:
    block = (
        st.fixed_dictionaries({"type": st.just("text"), "text": _TEXT})
        | st.fixed_dictionaries(
            {"type": st.just("tool_use"), "id": _TEXT, "name": _TEXT, "input": _JSON}
        )
        | st.fixed_dictionaries(
            {
                "type": st.just("tool_result"),
                "tool_use_id": _TEXT,
                "content": _TEXT
                | st.lists(
                    st.fixed_dictionaries({"type": st.just("text"), "text": _TEXT}), max_size=2
                ),
            }
        )
        | st.fixed_dictionaries(
            {
                "type": st.just("image"),
                "source": st.fixed_dictionaries(
                    {"type": st.just("base64"), "media_type": st.just("image/png"), "data": _TEXT}
                ),
            }
        )
    )
    content = draw(_TEXT | st.lists(block, max_size=3))
    return {"role": draw(st.sampled_from(["user", "assistant"])), "content": content}


@st.composite
def _responses_item(draw: st.DrawFn) -> dict[str, Any]:
    kind = draw(st.sampled_from(["message", "function_call", "function_call_output", "other"]))
    if kind == "message":
        parts = st.lists(
            st.fixed_dictionaries(
                {"type": st.sampled_from(["input_text", "output_text"]), "text": _TEXT}
            ),
            max_size=3,
        )
        return {
            "type": "message",
            "role": draw(st.sampled_from(["user", "assistant"])),
            "content": draw(_TEXT | parts),
        }
    if kind == "function_call":
        return {
            "type": "function_call",
            "call_id": draw(_TEXT),
            "name": "f",
            "arguments": json.dumps(draw(_JSON)),
        }
    if kind == "function_call_output":
        return {"type": "function_call_output", "call_id": draw(_TEXT), "output": draw(_TEXT)}
    return {"type": "reasoning", "summary": draw(_JSON)}


_PROTOCOLS = {
    Protocol.CHAT: ("messages", _chat_message()),
    Protocol.MESSAGES: ("messages", _anthropic_message()),
    Protocol.RESPONSES: ("input", _responses_item()),
}


@st.composite
def bodies(draw: st.DrawFn) -> tuple[str, dict[str, Any], bytes]:
    """(protocol, body object, its JSON bytes in a random style)."""
    protocol = draw(st.sampled_from(sorted(_PROTOCOLS)))
    key, item = _PROTOCOLS[protocol]
    body: dict[str, Any] = {"model": draw(_TEXT), key: draw(st.lists(item, max_size=6))}
    if draw(st.booleans()):
        body["metadata"] = draw(_JSON)
    style = draw(st.sampled_from(["compact", "spaced", "indented", "msgspec", "whitespace"]))
    ascii_only = draw(st.booleans())
    if style == "whitespace":
        data = _dumps_with_whitespace(body, random.Random(draw(st.integers(0, 2**32))), ascii_only)
    elif style == "msgspec":
        data = msgspec.json.encode(body)
    elif style == "compact":
        data = json.dumps(body, ensure_ascii=ascii_only, separators=(",", ":")).encode()
    elif style == "spaced":
        data = json.dumps(body, ensure_ascii=ascii_only).encode()
    else:
        data = json.dumps(body, ensure_ascii=ascii_only, indent=draw(st.integers(0, 3))).encode()
    if draw(st.booleans()):
        data = b" \n" + data + b"\r\n "
    return protocol, body, data


# -- helpers ------------------------------------------------------------------------------


def _dumps_with_whitespace(value: Any, rng: random.Random, ascii_only: bool) -> bytes:
    """JSON text of ``value`` with random insignificant whitespace around every token."""

    def ws() -> str:
        return "".join(rng.choice(" \t\n\r") for _ in range(rng.randrange(3)))

    def dump(item: Any) -> str:
        if isinstance(item, dict):
            members = [
                f"{ws()}{json.dumps(k, ensure_ascii=ascii_only)}{ws()}:{ws()}{dump(v)}{ws()}"
                for k, v in item.items()
            ]
            return "{" + ",".join(members) + ws() + "}"
        if isinstance(item, list):
            return "[" + ",".join(f"{ws()}{dump(v)}{ws()}" for v in item) + ws() + "]"
        return json.dumps(item, ensure_ascii=ascii_only)

    return dump(value).encode()


def _check_reads(node: Node, value: Any) -> None:
    """Every node under ``node`` reads back as the matching part of ``value``."""
    assert json.loads(bytes(node.raw())) == value
    if isinstance(value, dict):
        assert node.kind == "object" and not node.opaque
        assert node.keys() == list(value)
        for key, child in node.items():
            _check_reads(child, value[key])
    elif isinstance(value, list):
        assert node.kind == "array" and len(node) == len(value)
        for child, item in zip(node, value, strict=True):
            _check_reads(child, item)
    elif isinstance(value, str):
        assert node.text() == value
        assert node.text_bytes() == len(value.encode("utf-8"))


def _edit_randomly(rng: random.Random, node: Node, holder: Any, key: Any, new: Any) -> None:
    """Replace some values under ``node`` (mirrored in ``holder[key]``), never overlapping."""
    value = holder[key]
    roll = rng.random()
    if roll < 0.2:
        replacement = new(rng)
        if rng.random() < 0.5:
            node.replace(replacement)
        else:
            node.replace_json(json.dumps(replacement).encode())
        holder[key] = replacement
        return
    if isinstance(value, dict):
        for child_key, child in list(node.items()):
            _edit_randomly(rng, child, value, child_key, new)
    elif isinstance(value, list):
        for index, child in enumerate(node):
            _edit_randomly(rng, child, value, index, new)


def _new_value(rng: random.Random) -> Any:
    return rng.choice(
        [None, 7, -1.5, "", 'placeholder é " \\ \u2028', ["x", {"k": "v"}], {"nested": [1, "two"]}]
    )


def _check_outside_edits(original: bytes, view: BodyView, out: bytes) -> None:
    """``out`` is ``original`` with exactly the view's edits applied, byte for byte."""
    pos_in = pos_out = 0
    for start, end, data in view.edits:
        gap = start - pos_in
        assert out[pos_out : pos_out + gap] == original[pos_in:start]
        pos_out += gap
        assert out[pos_out : pos_out + len(data)] == data
        pos_out += len(data)
        pos_in = end
    assert out[pos_out:] == original[pos_in:]


# -- properties ---------------------------------------------------------------------------


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(bodies(), st.integers(0, 2**32))
def test_spliced_body_is_the_edited_object_and_untouched_elsewhere(
    case: tuple[str, dict[str, Any], bytes], seed: int
) -> None:
    protocol, body, data = case
    buffer = bytearray(data)
    view = BodyView(buffer, protocol)
    _check_reads(view.root, body)
    history = view.history
    assert history is not None and len(view.items()) == len(
        body["input" if protocol == Protocol.RESPONSES else "messages"]
    )

    edited = json.loads(data)
    box = {"root": edited}
    _edit_randomly(random.Random(seed), view.root, box, "root", _new_value)
    splice = view.splice()
    out = b"".join(bytes(chunk) for chunk in splice.chunks(7))
    assert out == splice.join() and len(out) == splice.nbytes
    assert json.loads(out) == box["root"] == json.loads(json.dumps(box["root"]))
    _check_outside_edits(data, view, out)
    # Raw segments are views of the one buffer, never copies of it.
    for segment in splice.segments:
        if isinstance(segment, memoryview):
            assert segment.obj is buffer
    assert sum(len(s) for s in splice.segments if isinstance(s, bytes)) == splice.owned_bytes


@settings(max_examples=100, deadline=None)
@given(bodies())
def test_no_edit_splices_to_the_input_bytes(case: tuple[str, dict[str, Any], bytes]) -> None:
    protocol, _, data = case
    view = BodyView(data, protocol)
    list(view.root.items())
    splice = view.splice()
    assert splice.join() == data and splice.owned_bytes == 0
    assert all(isinstance(s, memoryview) for s in splice.segments)


# -- edits --------------------------------------------------------------------------------


def test_replacing_a_parent_supersedes_edits_inside_it_and_the_reverse_conflicts() -> None:
    data = b'{"messages":[{"role":"user","content":"aaaa"},{"role":"user","content":"b"}]}'
    view = BodyView(data, Protocol.CHAT)
    first = view.items()[0]
    first["content"].replace("x")
    first.replace({"role": "user", "content": "y"})
    assert len(view.edits) == 1
    with pytest.raises(EditConflict):
        first["role"].replace("assistant")
    first.replace({"role": "user", "content": "z"})  # the same value again: the last wins
    assert json.loads(view.splice().join())["messages"][0]["content"] == "z"


def test_replace_json_rejects_what_is_not_one_value() -> None:
    view = BodyView(b'{"a":1}', Protocol.CHAT)
    with pytest.raises(WireError):
        view.root["a"].replace_json(b"[1,")
    with pytest.raises(WireError):
        view.root["a"].replace_json(b"1 2")
    with pytest.raises(TypeError):
        view.root["a"].replace({1j})


def test_a_duplicate_key_makes_that_object_opaque_but_still_replaceable() -> None:
    data = b'{"messages":[{"role":"user","content":"first","content":"second!"},{"role":"user"}]}'
    view = BodyView(data, Protocol.CHAT)
    first, second = view.items()
    assert first.opaque and first.get("content") is None and first.keys() == []
    assert bytes(first.raw()) == data[13 : data.index(b',{"role":"user"}')]
    assert second.keys() == ["role"]
    first.replace({"role": "user", "content": "fixed"})
    assert json.loads(view.splice().join())["messages"][0] == {"role": "user", "content": "fixed"}


def test_not_an_object_is_a_wire_error() -> None:
    with pytest.raises(WireError):
        _ = BodyView(b"[1, 2]", Protocol.CHAT).root


def test_history_is_input_for_responses_and_messages_elsewhere() -> None:
    data = b'{"input":[{"type":"message"}],"messages":[1,2]}'
    assert len(BodyView(data, Protocol.RESPONSES).items()) == 1
    assert len(BodyView(data, Protocol.CHAT).items()) == 2
    assert BodyView(b'{"input":"hi"}', Protocol.RESPONSES).items() == []


# -- draft: the two paths -----------------------------------------------------------------


def test_draft_view_edits_then_whole_object_then_view_again() -> None:
    data = b'{"messages":[{"role":"user","content":"hello"}],"model":"m"}'
    draft = Draft(Protocol.CHAT, base=data)
    assert draft.result(reported=True) is None  # nothing asked, nothing changed
    draft.view().items()[0]["content"].replace("edited")
    body = draft.body()  # decoded from the edited body
    assert body["messages"][0]["content"] == "edited"
    body["model"] = "other"
    view = draft.view()  # the object, re-encoded
    assert view.root["model"].text() == "other"
    view.root["model"].replace("third")
    result = draft.result(reported=False)
    assert isinstance(result, Splice)
    assert json.loads(result.join()) == {
        "messages": [{"role": "user", "content": "edited"}],
        "model": "third",
    }


def test_draft_object_counts_as_changed_only_when_reported() -> None:
    draft = Draft(Protocol.CHAT, base=b'{"a":1}')
    draft.body()
    assert draft.result(reported=False) is None
    result = draft.result(reported=True)
    assert isinstance(result, ParsedHolder) and result.body == {"a": 1}


# -- cost ---------------------------------------------------------------------------------


def _big_history(messages: int, size: int) -> bytes:
    rng = random.Random(5)
    items = [{"role": "system", "content": "be brief"}]
    for i in range(messages):
        text = "".join(rng.choice('abc def\n"\\é') for _ in range(64)) * (size // 64)
        items.append(
            {
                "role": "assistant",
                "content": None,
                "tool_calls": [{"id": f"c{i}", "function": {"name": "read", "arguments": "{}"}}],
            }
        )
        items.append({"role": "tool", "tool_call_id": f"c{i}", "content": text})
    return json.dumps({"model": "m", "messages": items}).encode()


def test_editing_every_tool_result_allocates_no_copy_of_the_body() -> None:
    data = bytearray(_big_history(40, 200_000))  # ~10 MB
    tracemalloc.start()
    try:
        view = BodyView(data, Protocol.CHAT)
        for item in view.items():
            content = item.get("content")
            if item["role"].text() == "tool" and content is not None:
                content.replace(f"[elided {content.text_bytes()} bytes]")
        splice = view.splice()
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    # One decoded tool result (~0.3 MB as str) at a time at most, never the body.
    assert peak < len(data) // 10, (peak, len(data))
    assert splice.nbytes < len(data) // 100
    probe = weakref.finalize(view, lambda: None)
    del view
    assert not probe.alive  # the view (and its nodes) go with the last reference
    folded = json.loads(splice.join())
    assert all(
        m["content"].startswith("[elided ") for m in folded["messages"] if m["role"] == "tool"
    )

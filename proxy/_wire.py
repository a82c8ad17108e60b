"""Wire metadata of one request, computed from the raw bytes before any plugin runs.

Pure: no I/O, no aiohttp. docs/design.md §4 is the contract.

:func:`compute_wire_metadata` reads the request's *structure* only: msgspec
Structs whose bulky fields are :class:`msgspec.Raw` views into the body buffer,
decoded one level at a time and only as deep as the comparable verdict needs.
Message text is never turned into ``str`` objects, so a 64 MB chat body of
12,000 messages peaks at about 1.2 MiB of Python objects, not a second copy of
the conversation. The cost grows with the number of history items (about 56
bytes each, for the list of views), not with their text. The views die when the call returns; the
result is scalars only.

:func:`decode_body` / :func:`encode_body` are the full parse and serialization
that exchanges use when a plugin asks for the body.

Every JSON parse in this module goes through :func:`_decode_json`, so a test
can monkeypatch ``proxy._wire._decode_json`` to fail loudly and prove that no
parse happens where none should (e.g. after the request was forwarded).
"""

from __future__ import annotations

import codecs
import dataclasses
from typing import Any, Final, TypeAlias, TypeVar

import msgspec
import xxhash

from ._protocols import Protocol

__all__ = [
    "BodyBytes",
    "WireError",
    "WireMetadata",
    "compute_wire_metadata",
    "decode_body",
    "digest_bytes",
    "encode_body",
    "encodes_plainly",
]

BodyBytes: TypeAlias = bytes | bytearray | memoryview
"""A request body as the body reader hands it over (content-decoded wire bytes)."""

_T = TypeVar("_T")


class WireError(ValueError):
    """The request body is not a UTF-8 JSON object.

    The message is short and fixed; it never quotes the body (bodies carry
    user data and sometimes credentials). Exchanges answer it with a 400 in
    the client's protocol shape.
    """


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class WireMetadata:
    """Scalars describing the request exactly as it arrived (docs/design.md §4).

    ``protocol`` is the :class:`~proxy.Protocol` the request path selected (a
    ``StrEnum``: it compares equal to, formats and serializes as its string value);
    ``model`` is the body's ``model`` string, or ``None`` when absent or not a
    string; ``stream`` is ``True`` only for a JSON ``true`` ``stream`` field;
    ``message_count`` is the length of the history (``messages`` or ``input``;
    1 for a string, 0 when absent or of another shape); ``digest`` is the hex
    xxh3_128 of the wire bytes after content decoding; ``byte_length`` is their
    length in bytes; ``comparable`` is the verdict; ``session_hint`` is the
    session id found in the body (Responses ``prompt_cache_key``, Anthropic
    ``metadata.user_id``), if any.
    """

    protocol: Protocol
    model: str | None
    stream: bool
    message_count: int
    byte_length: int
    digest: str
    comparable: bool
    session_hint: str | None


# --- structural decode ------------------------------------------------------------------

# An empty Raw marks a field that was absent from the JSON object: a present
# field's Raw always spans at least one byte.
_ABSENT: Final = msgspec.Raw()


class _Envelope(msgspec.Struct, forbid_unknown_fields=False, gc=False):
    """The top-level request fields wire metadata needs; everything else is skipped."""

    model: msgspec.Raw = _ABSENT
    stream: msgspec.Raw = _ABSENT
    messages: msgspec.Raw = _ABSENT
    input: msgspec.Raw = _ABSENT
    metadata: msgspec.Raw = _ABSENT
    prompt_cache_key: msgspec.Raw = _ABSENT


class _Item(msgspec.Struct, forbid_unknown_fields=False, gc=False):
    """One history object (message, input item, content part or block)."""

    type: msgspec.Raw = _ABSENT
    audio: msgspec.Raw = _ABSENT
    content: msgspec.Raw = _ABSENT
    output: msgspec.Raw = _ABSENT
    text: msgspec.Raw = _ABSENT
    tool_calls: msgspec.Raw = _ABSENT


class _MessagesEnvelope(msgspec.Struct, forbid_unknown_fields=False, gc=False):
    """:class:`_Envelope` of a small ``messages`` body, its history decoded in the same pass.

    Only for the protocols whose history is ``messages``: ``input`` is not read.
    ``messages`` is ``None`` when absent or JSON ``null``; any other shape than
    a list of objects fails the decode (the caller falls back to ``_Envelope``).
    """

    model: msgspec.Raw = _ABSENT
    stream: msgspec.Raw = _ABSENT
    messages: list[_Item] | None = None
    metadata: msgspec.Raw = _ABSENT
    prompt_cache_key: msgspec.Raw = _ABSENT


class _Metadata(msgspec.Struct, forbid_unknown_fields=False, gc=False):
    """Anthropic ``metadata``."""

    user_id: msgspec.Raw = _ABSENT


class _UserIdObject(msgspec.Struct, forbid_unknown_fields=False, gc=False):
    """The JSON object some Claude Code versions put in ``metadata.user_id``."""

    session_id: msgspec.Raw = _ABSENT


_ENVELOPE_DECODER: Final = msgspec.json.Decoder(_Envelope)
_MESSAGES_ENVELOPE_DECODER: Final = msgspec.json.Decoder(_MessagesEnvelope)
_ITEM_DECODER: Final = msgspec.json.Decoder(_Item)
_LIST_DECODER: Final = msgspec.json.Decoder(list[msgspec.Raw])
_ITEMS_DECODER: Final = msgspec.json.Decoder(list[_Item])
_METADATA_DECODER: Final = msgspec.json.Decoder(_Metadata)
_USER_ID_DECODER: Final = msgspec.json.Decoder(_UserIdObject)
_STR_DECODER: Final = msgspec.json.Decoder(str)
_FULL_DECODER: Final = msgspec.json.Decoder(dict[str, Any])
_ENCODER: Final = msgspec.json.Encoder()

# Characters of a non-ASCII str checked for surrogates per slice: the slice and its
# UTF-8 copy are transient and this small, never the size of the body.
_SURROGATE_SLICE: Final = 256 * 1024
# Deepest nesting encodes_plainly vouches for; msgspec's encoder recurses in C
# under Python's recursion limit (1000), and real bodies nest a dozen levels.
_PLAIN_DEPTH: Final = 256

# First byte of a Raw: a Raw spans exactly one JSON value, no surrounding whitespace.
_QUOTE: Final = ord('"')
_LBRACKET: Final = ord("[")
_LBRACE: Final = ord("{")

# docs/design.md §4: object types that may appear in a comparable history.
_PLAIN_TYPES: Final = frozenset(
    {
        "message",
        "text",
        "input_text",
        "output_text",
        "tool_use",
        "tool_result",
        "function_call",
        "function_call_output",
    }
)
_CALL_TYPES: Final = frozenset({"tool_use", "function_call"})
# The plain types as JSON strings without escapes, the form every SDK sends: a ``type``
# Raw equal to one is that type without a decode (any other form is decoded).
_PLAIN_TYPE_BY_RAW: Final = {b'"%s"' % kind.encode(): kind for kind in _PLAIN_TYPES}
_PLAIN_TYPE_RAW_BYTES: Final = max(len(raw) for raw in _PLAIN_TYPE_BY_RAW)

# Real bodies nest at most ~6 levels (messages > message > content > tool_result >
# content > part); deeper nesting is not a plain history, and the cap bounds both the
# Python recursion and the number of passes over one byte range.
_MAX_DEPTH: Final = 16
# A ``type`` Raw longer than this cannot be one of _PLAIN_TYPES, even fully escaped.
_MAX_TYPE_BYTES: Final = 256
# Scalars kept in WireMetadata end up in logs, metrics and records: a longer
# ``model`` or session string is not a real one and is reported as absent.
_MAX_SCALAR_BYTES: Final = 4096
# UTF-8 validation works on slices of this many bytes so the transient ``str`` stays
# small whatever the body's size: decoding a mostly ASCII slice that holds one astral
# character peaks at ~9x the slice (a 1-byte-per-char str widened to 4), ~38 KiB
# here; 128 KiB slices peaked at ~1 MiB, the size of a 1 MiB body.
# Measured on a 16 MiB agent history, 4-16 KiB slices also validate faster than
# 128 KiB ones (the slice and its str stay in the CPU cache).
_UTF8_CHUNK: Final = 4 * 1024

# A list value up to this many bytes is decoded straight into _Item structs, one pass
# instead of a Raw pass plus one per item; the cap bounds the structs held at once.
_FAST_ITEMS_BYTES: Final = 64 * 1024

# Exchange protocols whose history is `messages` (Responses uses `input`).
_MESSAGES_PROTOCOLS: Final = frozenset({Protocol.CHAT, Protocol.MESSAGES, Protocol.COUNT_TOKENS})


def _decode_json(decoder: msgspec.json.Decoder[_T], data: BodyBytes, /) -> _T:
    """Run ``decoder`` over ``data``: the single JSON parse point of this module.

    Raises whatever :meth:`msgspec.json.Decoder.decode` raises
    (:class:`msgspec.DecodeError`, :class:`msgspec.ValidationError`,
    :class:`RecursionError`). Tests monkeypatch this function.
    """
    return decoder.decode(data)


def _first_byte(raw: msgspec.Raw) -> int:
    """The first byte of ``raw`` (which JSON kind it holds), or -1 when absent."""
    # The view is a temporary, released as the expression ends (no ``with``: its enter
    # and exit were half this function's cost, and it runs several times per item).
    return memoryview(raw)[0] if len(raw) else -1


def _is_present_non_null(raw: msgspec.Raw) -> bool:
    """True when the field was present and not JSON ``null``."""
    size = len(raw)
    return size > 0 and not (size == 4 and bytes(raw) == b"null")


def _short_str(raw: msgspec.Raw, limit: int) -> str | None:
    """``raw`` decoded as a string if it is a JSON string of at most ``limit`` bytes.

    Cannot fail: msgspec validated the string's escapes while skipping it.
    """
    if len(raw) > limit or _first_byte(raw) != _QUOTE:
        return None
    return _decode_json(_STR_DECODER, raw)


def _type_name(raw: msgspec.Raw) -> str | None:
    """``_short_str(raw, _MAX_TYPE_BYTES)``, with a plainly spelled plain type found by its bytes.

    A history item's ``type`` is nearly always one of the plain types without
    escapes: its bytes name it, and the decode (half the cost of judging a
    small item) is skipped. Any other spelling is decoded, as before.
    """
    if len(raw) <= _PLAIN_TYPE_RAW_BYTES:
        known = _PLAIN_TYPE_BY_RAW.get(bytes(raw))
        if known is not None:
            return known
    return _short_str(raw, _MAX_TYPE_BYTES)


def _is_utf8(body: BodyBytes) -> bool:
    """Whether ``body`` is valid UTF-8 (RFC 3629), checked in bounded slices.

    msgspec validates UTF-8 only in the strings it materializes; skipped fields
    and Raw views are not checked, so the structural decode needs this pass.
    """
    if not isinstance(body, memoryview) and body.isascii():
        # ASCII is valid UTF-8. SDKs that escape non-ASCII (json.dumps defaults) send
        # only ASCII; this C scan costs a fraction of a decode and builds no str.
        return True
    decode = codecs.utf_8_decode
    with memoryview(body) as whole, whole.cast("B") as view:
        size = len(view)
        pos = 0
        while pos < size:
            end = min(pos + _UTF8_CHUNK, size)
            try:
                # final=False leaves an incomplete trailing sequence (<= 3 bytes)
                # unconsumed; the next slice starts at it, so `used` is always > 0.
                _, used = decode(view[pos:end], "strict", end == size)
            except UnicodeDecodeError:
                return False
            pos += used
    return True


def _byte_length(body: BodyBytes) -> int:
    """Length of ``body`` in bytes (a memoryview's ``len`` counts items, not bytes)."""
    return body.nbytes if isinstance(body, memoryview) else len(body)


def _parse_object(decoder: msgspec.json.Decoder[_T], body: BodyBytes) -> _T:
    """Top-level parse of a request body with ``decoder`` (whose type is an object).

    Raises WireError when the body is not UTF-8, not JSON, not an object, or nests
    past msgspec's recursion limit.
    """
    if not _is_utf8(body):
        raise WireError("request body is not valid UTF-8")
    reason: str | None = None
    try:
        return _decode_json(decoder, body)
    except msgspec.ValidationError:  # subclass of DecodeError: check it first
        reason = "request body is not a JSON object"
    except msgspec.DecodeError:
        reason = "request body is not valid JSON"
    except RecursionError:
        reason = "request body nests JSON too deeply"
    # Raised outside the except blocks so the msgspec error is not chained.
    raise WireError(reason)


def _object_items(raw: msgspec.Raw) -> list[_Item] | None:
    """The items of a small JSON list whose items are all objects, in one decode.

    ``None`` when ``raw`` is over :data:`_FAST_ITEMS_BYTES` or the decode fails
    for any reason (an item that is not an object, nesting too deep): the
    caller then takes the item-by-item path, which decides such lists exactly
    as before. On success the structs equal what :data:`_ITEM_DECODER` gives
    for each item.
    """
    if len(raw) > _FAST_ITEMS_BYTES:
        return None
    try:
        return _decode_json(_ITEMS_DECODER, raw)
    except (msgspec.DecodeError, RecursionError):
        return None


def _verdict(raw: msgspec.Raw, depth: int) -> bool:
    """The comparable verdict (docs/design.md §4) of one JSON value held in ``raw``."""
    kind = _first_byte(raw)
    if kind == _QUOTE:
        return True
    if depth > _MAX_DEPTH:
        return False
    if kind == _LBRACKET:
        objects = _object_items(raw)
        if objects is not None:
            # Each object item is judged one level down, as _verdict(item, depth + 1) would.
            if objects and depth + 1 > _MAX_DEPTH:
                return False
            return all(_object_verdict(item, depth + 1) for item in objects)
        return all(_verdict(item, depth + 1) for item in _decode_json(_LIST_DECODER, raw))
    if kind == _LBRACE:
        return _object_verdict(_decode_json(_ITEM_DECODER, raw), depth)
    # Numbers, booleans and null are not a history shape.
    return False


def _object_verdict(item: _Item, depth: int) -> bool:
    """The verdict of one history object, rules in docs/design.md §4 order."""
    payload = item.content
    if len(item.type):
        kind = _type_name(item.type)
        if kind is None or kind not in _PLAIN_TYPES:
            return False
        if kind in _CALL_TYPES:
            return True
        if kind == "function_call_output":
            # Responses carries a tool's answer in `output` (string or list of parts).
            payload = item.output
    if _is_present_non_null(item.audio):
        return False
    if _is_present_non_null(payload):
        return _verdict(payload, depth + 1)
    return _first_byte(item.text) == _QUOTE or _first_byte(item.tool_calls) == _LBRACKET


def _history(raw: msgspec.Raw) -> tuple[bool, int]:
    """``(comparable, message_count)`` of a ``messages`` / ``input`` value."""
    kind = _first_byte(raw)
    if kind == _QUOTE:
        return True, 1
    if kind != _LBRACKET:
        return False, 0
    objects = _object_items(raw)
    if objects is not None:
        return _object_history(objects)
    try:
        items = _decode_json(_LIST_DECODER, raw)
    except RecursionError:
        return False, 0
    try:
        comparable = all(_verdict(item, 1) for item in items)
    except RecursionError:
        # Nesting close to the interpreter's limit: not a plain history.
        comparable = False
    return comparable, len(items)


def _session_from_user_id(user_id: str) -> str:
    """The session id inside Claude Code's ``metadata.user_id``, else the whole string.

    Two observed forms: ``user_<hash>_account_<uuid>_session_<uuid>`` and a JSON
    object string with a ``session_id`` member.
    """
    if user_id.lstrip().startswith("{"):
        try:
            # surrogatepass: a lone surrogate from a JSON escape must not raise here;
            # msgspec then rejects the bytes and the whole string is the hint.
            parsed = _decode_json(_USER_ID_DECODER, user_id.encode("utf-8", "surrogatepass"))
        except (msgspec.DecodeError, RecursionError):
            return user_id
        return _short_str(parsed.session_id, _MAX_SCALAR_BYTES) or user_id
    _, sep, tail = user_id.rpartition("_session_")
    return tail if sep and tail else user_id


def _session_hint(protocol: Protocol, envelope: _Envelope | _MessagesEnvelope) -> str | None:
    """The body's session id (docs/design.md §7 table), or None."""
    if protocol is Protocol.RESPONSES:
        return _short_str(envelope.prompt_cache_key, _MAX_SCALAR_BYTES) or None
    if protocol in (Protocol.MESSAGES, Protocol.COUNT_TOKENS):
        if _first_byte(envelope.metadata) != _LBRACE:
            return None
        metadata = _decode_json(_METADATA_DECODER, envelope.metadata)
        user_id = _short_str(metadata.user_id, _MAX_SCALAR_BYTES)
        return _session_from_user_id(user_id) if user_id else None
    return None


def compute_wire_metadata(protocol: Protocol | str, body: BodyBytes, digest: str) -> WireMetadata:
    """Wire metadata of one request body, from a structural decode (docs/design.md §4).

    ``protocol`` is a :class:`Protocol` or its value; ``body`` is the complete
    wire body in bytes after content decoding; ``digest`` is its xxh3_128 hex
    digest, computed by the caller while reading (see :func:`digest_bytes`) and
    passed through unchanged.

    The comparable verdict is applied to ``messages`` (chat, Anthropic messages
    and count_tokens) or ``input`` (Responses):

    * a string is comparable; a list is comparable when all its items are;
    * an object whose ``type`` is present and not one of ``message``, ``text``,
      ``input_text``, ``output_text``, ``tool_use``, ``tool_result``,
      ``function_call``, ``function_call_output`` is not (images, audio,
      documents, files, reasoning and thinking blocks, item references ...);
      a ``type`` that is not a string (``null`` included) is not either;
    * ``tool_use`` and ``function_call`` objects are comparable;
    * an object with a non-null ``audio`` is not;
    * otherwise a present, non-null ``content`` decides (recursively);
      **reading decision:** a ``function_call_output`` item carries its payload
      in ``output`` (a string or a list of parts), so ``output`` plays the role
      of ``content`` for it;
    * else the object is comparable only with a string ``text`` or a list
      ``tool_calls`` (so a ``tool_result`` without ``content`` is not);
    * anything else (numbers, booleans, null, nesting deeper than 16 levels)
      is not comparable.

    An exchange protocol whose history field is absent or of another shape is
    not comparable, with ``message_count`` 0. For the pass-through protocols
    (``openai``, ``anthropic``) the rule applies to ``messages``, else ``input``;
    with neither present the request is comparable with ``message_count`` 0.

    ``session_hint`` is the Responses ``prompt_cache_key`` or the Anthropic
    ``metadata.user_id``; from the latter the session uuid is extracted when
    it has Claude Code's ``..._session_<uuid>`` form or is a JSON object string
    with a string ``session_id``; otherwise the whole string. Empty strings and
    strings over 4096 bytes give ``None`` (likewise for ``model``).

    Never raises for a JSON object of unexpected shape. Raises :class:`WireError`
    when ``body`` is not UTF-8, not valid JSON, not a JSON object, or nests
    deeper than msgspec's recursion limit; :class:`ValueError` for an unknown
    protocol name. No view into ``body`` survives the call.
    """
    proto = protocol if isinstance(protocol, Protocol) else Protocol(protocol)
    size = _byte_length(body)
    if proto in _MESSAGES_PROTOCOLS and size <= _FAST_ITEMS_BYTES:
        quick = _parse_messages_envelope(body)
        if quick is not None:
            return _metadata(proto, quick, _object_history(quick.messages), size, digest)
    envelope = _parse_object(_ENVELOPE_DECODER, body)

    if proto is Protocol.RESPONSES:
        comparable, count = _history(envelope.input)
    elif proto in _MESSAGES_PROTOCOLS or len(envelope.messages):
        comparable, count = _history(envelope.messages)
    elif len(envelope.input):
        comparable, count = _history(envelope.input)
    else:
        comparable, count = True, 0
    return _metadata(proto, envelope, (comparable, count), size, digest)


def _parse_messages_envelope(body: BodyBytes) -> _MessagesEnvelope | None:
    """One-pass decode of a small ``messages`` body, or ``None`` to take the general path.

    Raises WireError when ``body`` is not UTF-8 (as the general path would).
    ``None`` when the decode fails for any reason (not JSON, not an object, a
    ``messages`` that is not a list of objects, nesting too deep): the general
    path then decides the body, errors included, exactly as it always did.
    """
    if not _is_utf8(body):
        raise WireError("request body is not valid UTF-8")
    try:
        return _decode_json(_MESSAGES_ENVELOPE_DECODER, body)
    except (msgspec.DecodeError, RecursionError):
        return None


def _object_history(items: list[_Item] | None) -> tuple[bool, int]:
    """``(comparable, message_count)`` of a history already decoded as objects.

    ``None`` (absent or null) is not comparable, with count 0, as in :func:`_history`.
    """
    if items is None:
        return False, 0
    try:
        comparable = all(_object_verdict(item, 1) for item in items)
    except RecursionError:
        comparable = False
    return comparable, len(items)


def _metadata(
    proto: Protocol,
    envelope: _Envelope | _MessagesEnvelope,
    history: tuple[bool, int],
    byte_length: int,
    digest: str,
) -> WireMetadata:
    """Assemble :class:`WireMetadata` from a decoded envelope, its history verdict and
    the body's length in bytes."""
    comparable, count = history
    return WireMetadata(
        protocol=proto,
        model=_short_str(envelope.model, _MAX_SCALAR_BYTES) or None,
        stream=len(envelope.stream) == 4 and bytes(envelope.stream) == b"true",
        message_count=count,
        byte_length=byte_length,
        digest=digest,
        comparable=comparable,
        session_hint=_session_hint(proto, envelope),
    )


# --- full parse -------------------------------------------------------------------------


def decode_body(body: BodyBytes) -> dict[str, Any]:
    """The fully parsed request body, for plugins that asked for it.

    Costs Python objects of 2-4x the body size (more when the text is not ASCII),
    held until the caller drops the dict.

    ``body`` is the wire body in bytes after content decoding. Returns the
    top-level JSON object as a ``dict``. Raises :class:`WireError` when the body
    is not UTF-8, not valid JSON, not a JSON object, or nests too deeply.
    """
    return _parse_object(_FULL_DECODER, body)


def encode_body(obj: dict[str, Any]) -> bytes:
    """Serialize a (possibly plugin-modified) request body to compact JSON bytes.

    Key order is preserved. Raises :class:`TypeError` for a value JSON cannot
    represent, :class:`RecursionError` for a container that contains itself.
    """
    return _ENCODER.encode(obj)


def encodes_plainly(obj: dict[str, Any]) -> bool:
    """Whether :func:`encode_body` certainly succeeds on ``obj``, without encoding it.

    ``True`` only for a tree of exact ``dict`` (``str`` keys), ``list``, ``str``
    (no surrogate code points), ``int``, ``float``, ``bool`` and ``None``, nested at
    most 256 levels (a cycle exceeds that). ``False`` means "not vouched for", not
    "fails": tuples, ``str`` subclasses and the like are left to the encoder. No
    copy of the body is made (a non-ASCII string is checked in 256 Ki-character
    slices), so the caller may drop the body's other copies before it encodes.
    CPU: under 1 ms per 16 MiB of ASCII text, ~2 ms per million non-ASCII characters.
    """
    stack: list[tuple[Any, int]] = [(obj, 0)]
    while stack:
        node, depth = stack.pop()
        kind = type(node)
        if kind is str:
            if not node.isascii() and _has_surrogate(node):
                return False
        elif kind is dict:
            if depth >= _PLAIN_DEPTH:
                return False
            for key, value in node.items():
                if type(key) is not str or (not key.isascii() and _has_surrogate(key)):
                    return False
                stack.append((value, depth + 1))
        elif kind is list:
            if depth >= _PLAIN_DEPTH:
                return False
            stack.extend((item, depth + 1) for item in node)
        elif node is not None and kind not in (int, float, bool):
            return False
    return True


def _has_surrogate(text: str) -> bool:
    # UTF-8 refuses exactly the surrogate code points; a slice cannot make one.
    for start in range(0, len(text), _SURROGATE_SLICE):
        try:
            text[start : start + _SURROGATE_SLICE].encode()
        except UnicodeEncodeError:
            return True
    return False


def digest_bytes(body: BodyBytes) -> str:
    """The wire digest of ``body``: ``xxhash.xxh3_128_hexdigest`` (32 hex chars).

    The body reader hashes incrementally while reading and gets the same value;
    this one-shot form is for tests and callers that already hold the bytes.
    """
    digest: str = xxhash.xxh3_128_hexdigest(body)
    return digest

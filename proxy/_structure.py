"""A structural view of a request body: edit a 64 MB history without parsing it whole.

Pure: no I/O, no aiohttp. docs/design.md §2 (the *parsed* and *prepared* rows) and
section 5 are the contract.

:class:`BodyView` locates JSON values in the raw body buffer by byte range. It
expands one container at a time, on demand, with the same msgspec structural
decode :mod:`proxy._wire` uses: a container decodes to ``dict[str, Raw]`` or
``list[Raw]``, whose :class:`msgspec.Raw` values are views into the buffer, and a
short walk over the container's own bytes (keys, separators, whitespace; never
the values, whose lengths the Raws give) turns them into byte offsets. Bulky
text is never turned into ``str`` unless a caller asks for that one value
(:meth:`Node.value`, :meth:`Node.text`).

Edits replace one value each (:meth:`Node.replace`, :meth:`Node.replace_json`).
:meth:`BodyView.splice` then describes the outbound body as a :class:`Splice`:
``memoryview`` slices of the raw buffer between the edits, and the replacement
bytes, in order. Nothing joins them; the exchange sends the segments as they
are. So an edited body costs the raw buffer plus the replacement pieces, and the
bytes outside the edits go upstream exactly as the client sent them.

:class:`Draft` is the body of one prepare run as plugins see it: the view by
default, the whole parsed object (``dict``, ~2x the body) for a plugin that
asked for it, converted lazily in either direction.

Nodes always read the body the view was built on: an edit changes what is sent,
not what a node reads.
"""

from __future__ import annotations

import bisect
import mmap
import re
from collections.abc import Iterator
from typing import Any, Final

import msgspec
import xxhash

from . import _wire as wire
from ._protocols import Protocol
from ._wire import WireError

__all__ = [
    "BodyView",
    "Draft",
    "EditConflict",
    "Node",
    "ParsedHolder",
    "Splice",
    "history_key",
]


class EditConflict(ValueError):
    """An edit falls inside a value that an earlier edit already replaced."""


_RAW_DICT: Final = msgspec.json.Decoder(dict[str, msgspec.Raw])
_RAW_LIST: Final = msgspec.json.Decoder(list[msgspec.Raw])
_RAW_OBJECTS: Final = msgspec.json.Decoder(list[dict[str, msgspec.Raw]])
_ANY: Final = msgspec.json.Decoder()
_STR: Final = msgspec.json.Decoder(str)
_CHECK: Final = msgspec.json.Decoder(msgspec.Raw)
_ENCODER: Final = msgspec.json.Encoder()

# JSON insignificant whitespace (RFC 8259 section 2).
_WS: Final = re.compile(rb"[ \t\n\r]*")
# A member's key and the colon after it; keys are short, values are never matched.
_KEY: Final = re.compile(rb'[ \t\n\r]*"((?:[^"\\]|\\.)*)"[ \t\n\r]*:[ \t\n\r]*', re.S)
_COMMA: Final = re.compile(rb"[ \t\n\r]*,[ \t\n\r]*")
_CLOSE: Final = re.compile(rb"[ \t\n\r]*[}\]]")

_KINDS: Final = {
    ord("{"): "object",
    ord("["): "array",
    ord('"'): "string",
    ord("t"): "true",
    ord("f"): "false",
    ord("n"): "null",
}
_BACKSLASH: Final = b"\\"
_LBRACE: Final = ord("{")
_RBRACE: Final = ord("}")
# Decoded strings are measured in slices so a huge non-ASCII one is never encoded whole.
_MEASURE_SLICE: Final = 1 << 16


def history_key(protocol: Protocol | None) -> str:
    """The body field holding the history: ``input`` for Responses, else ``messages``."""
    # ==, not `is`: a caller written against the old ``str`` signature passes the value.
    return "input" if protocol == Protocol.RESPONSES else "messages"


def _utf8_len(text: str) -> int:
    """Size of ``text`` in UTF-8 bytes, with at most a 64 Ki-character transient copy."""
    if text.isascii():
        return len(text)
    return sum(
        len(text[i : i + _MEASURE_SLICE].encode("utf-8", "surrogatepass"))
        for i in range(0, len(text), _MEASURE_SLICE)
    )


def _find(buf: bytes | bytearray | memoryview, needle: bytes, start: int, end: int) -> int:
    """``buf.find(needle, start, end)``, also for a spooled body's view of its mapping.

    A ``memoryview`` has no ``find``; the ``mmap`` under a spooled body's view
    (proxy/_spool.py) searches in place, so no string is copied out of it.
    """
    if not isinstance(buf, memoryview):
        return buf.find(needle, start, end)
    under = buf.obj
    # Only a view of the whole object shares its offsets.
    if isinstance(under, (mmap.mmap, bytes, bytearray)) and len(under) == buf.nbytes:
        return under.find(needle, start, end)
    found = bytes(buf[start:end]).find(needle)
    return found if found < 0 else start + found


class Node:
    """One JSON value of the body, by byte range ``[start, end)`` in the view's buffer.

    Containers expand on first access (one structural decode of their range);
    scalars and strings are decoded only by :meth:`value` / :meth:`text`.
    ``kind`` is ``object``, ``array``, ``string``, ``number``, ``true``,
    ``false`` or ``null``. A container whose members cannot be located exactly
    (an object with a duplicate key) is *opaque*: it has no children, and can
    still be read and replaced whole.
    """

    __slots__ = ("_children", "_keys", "_text_bytes", "_view", "end", "kind", "start")

    def __init__(self, view: _Body, start: int, end: int) -> None:
        self._view = view
        self.start: Final = start
        self.end: Final = end
        self.kind: Final = _KINDS.get(view._buf[start], "number")
        self._children: list[Node] | None = None
        self._keys: dict[str, int] | None = None
        self._text_bytes = -1

    # -- reading ----------------------------------------------------------------------

    @property
    def size(self) -> int:
        """Bytes this value spans in the body (its JSON text, quotes included)."""
        return self.end - self.start

    def raw(self) -> memoryview:
        """The value's JSON text as a read-only view into the buffer (no copy)."""
        return self._view._mv[self.start : self.end]

    def value(self) -> Any:
        """The value decoded to Python objects (``dict``, ``list``, ``str``, numbers).

        Costs Python objects of 2-4x :attr:`size`: meant for small values, or one
        bulky piece at a time.
        """
        with self.raw() as data:
            return wire._decode_json(_ANY, data)

    def text(self) -> str:
        """The decoded string. Raises :class:`TypeError` when this is not a string."""
        if self.kind != "string":
            raise TypeError(f"a JSON {self.kind} is not a string")
        with self.raw() as data:
            return wire._decode_json(_STR, data)

    def text_bytes(self) -> int:
        """UTF-8 bytes of the decoded string (escapes resolved); raises like :meth:`text`.

        Decodes the string only when its JSON text holds an escape; remembered.
        """
        if self._text_bytes < 0:
            if self.kind != "string":
                raise TypeError(f"a JSON {self.kind} is not a string")
            if _find(self._view._buf, _BACKSLASH, self.start, self.end) < 0:
                self._text_bytes = self.end - self.start - 2
            else:
                self._text_bytes = _utf8_len(self.text())
        return self._text_bytes

    def short_text(self, limit: int = 256) -> str | None:
        """The string if this is a string of at most ``limit`` bytes of JSON, else None."""
        if self.kind != "string" or self.size > limit:
            return None
        return self.text()

    # -- structure --------------------------------------------------------------------

    def _expand(self) -> list[Node]:
        if self._children is None:
            if self.kind == "object":
                self._view._expand_object(self)
            elif self.kind == "array":
                self._view._expand_array(self)
            else:
                self._children = []
        assert self._children is not None
        return self._children

    @property
    def opaque(self) -> bool:
        """True for an object whose members could not be located (see the class doc)."""
        self._expand()
        return self.kind == "object" and self._keys is None

    def keys(self) -> list[str]:
        """An object's keys in body order; ``[]`` for other kinds and opaque objects."""
        self._expand()
        return list(self._keys) if self._keys is not None else []

    def get(self, key: str) -> Node | None:
        """An object's member ``key``, or ``None`` (absent, or not an object)."""
        children = self._expand()
        if self._keys is None:
            return None
        index = self._keys.get(key)
        return None if index is None else children[index]

    def items(self) -> Iterator[tuple[str, Node]]:
        """An object's ``(key, node)`` members in body order."""
        children = self._expand()
        if self._keys is not None:
            for key, index in self._keys.items():
                yield key, children[index]

    def __getitem__(self, key: str | int) -> Node:
        """Member ``key`` of an object or item ``key`` of an array; KeyError/IndexError."""
        if isinstance(key, str):
            found = self.get(key)
            if found is None:
                raise KeyError(key)
            return found
        if self.kind != "array":
            raise IndexError(f"a JSON {self.kind} has no items")
        return self._expand()[key]

    def __len__(self) -> int:
        """Members of an object or items of an array (0 for scalars)."""
        return len(self._expand())

    def __iter__(self) -> Iterator[Node]:
        """An array's items (an object's member values) in body order."""
        return iter(self._expand())

    # -- editing ----------------------------------------------------------------------

    def replace(self, value: Any) -> None:
        """Send ``value`` (any JSON-serializable object) in place of this value.

        Raises:
            TypeError: ``value`` is not JSON-serializable.
            EditConflict: this value lies inside one already replaced.
        """
        self._view._edit(self.start, self.end, _ENCODER.encode(value))

    def replace_json(self, data: bytes) -> None:
        """Send the JSON text ``data`` (one complete value, UTF-8) in place of this value.

        Raises:
            WireError: ``data`` is not one JSON value.
            EditConflict: as :meth:`replace`.
        """
        try:
            wire._decode_json(_CHECK, data)
        except (msgspec.DecodeError, RecursionError):
            raise WireError("replacement is not one JSON value") from None
        self._view._edit(self.start, self.end, bytes(data))

    def __repr__(self) -> str:
        return f"<Node {self.kind} [{self.start}:{self.end}]>"


class Splice:
    """An outbound body as segments: slices of one base buffer and replacement bytes.

    ``segments`` concatenated are the body; ``nbytes`` is its length and
    ``owned_bytes`` the replacement bytes' share (the rest is the base buffer's
    memory, kept alive by the slices); ``base_bytes`` is the base buffer's
    size; ``digest`` is the xxh3_128 hex digest of the concatenation, computed
    segment by segment. ``offsets`` gives, per segment, where a slice of the base
    starts in it (``None`` for replacement bytes, or when not known): a spooled
    base is then sent as ranges of its file (proxy/_spool.py).
    """

    __slots__ = (
        "__weakref__",
        "base",
        "base_bytes",
        "digest",
        "nbytes",
        "offsets",
        "owned_bytes",
        "segments",
    )

    def __init__(
        self,
        segments: list[memoryview | bytes],
        base: bytes | bytearray | memoryview,
        offsets: list[int | None] | None = None,
    ) -> None:
        self.segments: Final = tuple(segments)
        self.offsets: Final = (
            tuple(offsets) if offsets is not None else (None,) * len(self.segments)
        )
        #: The buffer the slices view (the raw body, or a re-encoded one).
        self.base: Final = base
        self.base_bytes: Final = len(base)
        self.nbytes: Final = sum(len(s) for s in segments)
        self.owned_bytes: Final = sum(len(s) for s in segments if isinstance(s, bytes))
        hasher = xxhash.xxh3_128()
        for segment in segments:
            hasher.update(segment)
        self.digest: Final = hasher.hexdigest()

    def __len__(self) -> int:
        return self.nbytes

    def chunks(self, max_bytes: int) -> Iterator[memoryview]:
        """The body as ``memoryview`` pieces of at most ``max_bytes``, in order, no copy."""
        for segment in self.segments:
            view = memoryview(segment)
            for start in range(0, len(view), max_bytes):
                yield view[start : start + max_bytes]

    def join(self) -> bytes:
        """The body as one ``bytes`` (a full copy: for tests and the whole-object path)."""
        return b"".join(self.segments)


class _Body:
    """The buffer a view reads and the edits made through it (shared by all its nodes).

    Nodes reference this, not the :class:`BodyView`, so views and nodes form no
    reference cycle: the last reference gone, they are freed at once.
    """

    __slots__ = ("_buf", "_edits", "_mv", "_starts")

    def __init__(self, buffer: bytes | bytearray | memoryview) -> None:
        self._buf = buffer
        self._mv = memoryview(buffer).toreadonly()
        # Edits sorted by start: parallel lists of starts and (start, end, bytes).
        self._starts: list[int] = []
        self._edits: list[tuple[int, int, bytes]] = []

    # -- expansion --------------------------------------------------------------------

    def _expand_object(self, node: Node) -> None:
        # Not released with a `with`: the Raw values hold exports of this slice.
        members = wire._decode_json(_RAW_DICT, self._mv[node.start : node.end])
        walked = self._walk_members(node.start, node.end, members)
        if walked is None or walked[2] != node.end:
            node._children, node._keys = [], None
        else:
            node._keys, node._children, _ = walked

    def _walk_members(
        self, start: int, limit: int, members: dict[str, msgspec.Raw]
    ) -> tuple[dict[str, int], list[Node], int] | None:
        """Byte ranges of the members of the object at ``start``, and its end offset.

        ``members`` come from one decode of that object; only keys, colons,
        commas and whitespace are matched here, values are stepped over by their
        Raw's length. None when the walk disagrees with the bytes: a duplicate
        key (which the decode collapses to its last value) does.
        """
        buf = self._buf
        pos = start + 1
        keys: dict[str, int] = {}
        children: list[Node] = []
        for index, (key, raw) in enumerate(members.items()):
            if index:
                comma = _COMMA.match(buf, pos, limit)
                if comma is None:
                    return None
                pos = comma.end()
            match = _KEY.match(buf, pos, limit)
            if match is None:
                return None
            spelled = match.group(1)
            found = (
                wire._decode_json(_STR, b'"' + spelled + b'"')
                if b"\\" in spelled
                else spelled.decode("utf-8")
            )
            size = len(raw)
            pos = match.end()
            if found != key or size == 0 or pos + size > limit:
                return None
            with memoryview(raw) as raw_view:
                if buf[pos] != raw_view[0] or buf[pos + size - 1] != raw_view[size - 1]:
                    return None
            keys[key] = index
            children.append(Node(self, pos, pos + size))
            pos += size
        close = _CLOSE.match(buf, pos, limit)
        if close is None or buf[close.end() - 1] != _RBRACE:
            return None
        return keys, children, close.end()

    def _expand_array(self, node: Node, *, members: bool = True) -> None:
        """Place an array's items; with ``members``, object items' members too, in one pass.

        The history is placed without members (``BodyView.items``): a one-field
        edit of a 64 MB history then builds one node per item, not one per member
        of every item. Nested arrays (content parts, blocks) are small per item
        and are read whole by whoever reads them, so one pass saves a decode.
        """
        start, end = node.start, node.end
        buf = self._buf
        first = _WS.match(buf, start + 1, end)
        pos = first.end() if first else start + 1
        if members and pos < end and buf[pos] == _LBRACE:
            # Arrays of objects (histories, content parts) expand two levels in one pass.
            try:
                objects = wire._decode_json(_RAW_OBJECTS, self._mv[start:end])
            except msgspec.ValidationError:
                pass
            else:
                children = self._place_objects(pos, end, objects)
                if children is not None:
                    node._children = children
                    return
        items = wire._decode_json(_RAW_LIST, self._mv[start:end])
        children = []
        for index, raw in enumerate(items):
            if index:
                comma = _COMMA.match(buf, pos, end)
                assert comma is not None, "array items are separated by commas"
                pos = comma.end()
            child = Node(self, pos, pos + len(raw))
            children.append(child)
            pos = child.end
        node._children = children

    def _place_objects(
        self, pos: int, end: int, objects: list[dict[str, msgspec.Raw]]
    ) -> list[Node] | None:
        """Nodes for an array's object items starting at ``pos``, already expanded.

        None when one of them cannot be walked (the caller then places the items
        with a plain ``list[Raw]`` decode, and that object becomes opaque).
        """
        buf = self._buf
        children: list[Node] = []
        for index, members in enumerate(objects):
            if index:
                comma = _COMMA.match(buf, pos, end)
                if comma is None:
                    return None
                pos = comma.end()
            walked = self._walk_members(pos, end, members)
            if walked is None:
                return None
            keys, members_nodes, stop = walked
            child = Node(self, pos, stop)
            child._keys, child._children = keys, members_nodes
            children.append(child)
            pos = stop
        return children

    # -- editing ----------------------------------------------------------------------

    def _edit(self, start: int, end: int, data: bytes) -> None:
        """Record ``data`` in place of ``[start, end)``; edits inside it are superseded."""
        starts, edits = self._starts, self._edits
        index = bisect.bisect_right(starts, start)
        if index and edits[index - 1][1] > start:
            before = edits[index - 1]
            if before[0] == start and before[1] == end:
                index -= 1
            else:
                raise EditConflict("this value lies inside a value already replaced")
        stop = index
        while stop < len(edits) and edits[stop][0] < end:
            stop += 1
        del starts[index:stop], edits[index:stop]
        starts.insert(index, start)
        edits.insert(index, (start, end, data))


class BodyView:
    """The structural view of one JSON request body held in ``buffer``.

    ``buffer`` is the complete body (bytes after content decoding) that wire
    metadata already accepted as a UTF-8 JSON object; the view keeps a
    reference to it and never copies it. ``protocol`` (a :class:`~proxy.Protocol`)
    decides :attr:`history`; ``None`` for a view of a value that is not a
    request body (:meth:`of_value`).

    Raises:
        WireError: on first access of :attr:`root`, when the body is not a JSON object.
    """

    __slots__ = ("__weakref__", "_body", "_root", "protocol")

    def __init__(self, buffer: bytes | bytearray | memoryview, protocol: Protocol | None) -> None:
        self._body = _Body(buffer)
        self.protocol: Final = protocol
        self._root: Node | None = None

    @property
    def nbytes(self) -> int:
        """Size of the viewed body in bytes."""
        return len(self._body._buf)

    @classmethod
    def of_value(cls, data: bytes | bytearray, protocol: Protocol | None = None) -> BodyView:
        """A view of ``data`` after checking that it is exactly one JSON value.

        For JSON held inside a string (tool-call arguments); bodies that wire
        metadata accepted need no check. Reach the value with :attr:`top`.

        Raises:
            WireError: ``data`` is not one JSON value (or not UTF-8).
        """
        try:
            wire._decode_json(_CHECK, data)
        except (msgspec.DecodeError, RecursionError):
            raise WireError("not one JSON value") from None
        return cls(data, protocol)

    @property
    def top(self) -> Node:
        """The top-level JSON value, whatever its kind.

        Raises:
            WireError: the buffer holds only whitespace.
        """
        if self._root is None:
            buf = self._body._buf
            pos = _WS.match(buf, 0)
            start = pos.end() if pos else 0
            end = len(buf)
            while end > start and buf[end - 1] in b" \t\n\r":
                end -= 1
            if start >= end:
                raise WireError("empty JSON text")
            self._root = Node(self._body, start, end)
        return self._root

    @property
    def root(self) -> Node:
        """The top-level JSON object.

        Raises:
            WireError: the body is not a JSON object.
        """
        top = self.top
        if top.kind != "object":
            raise WireError("request body is not a JSON object")
        return top

    @property
    def history(self) -> Node | None:
        """``messages`` (chat, Anthropic) or ``input`` (Responses), or None when absent."""
        return self.root.get(history_key(self.protocol))

    def items(self) -> list[Node]:
        """The history items when the history is an array, else ``[]``."""
        history = self.history
        if history is None or history.kind != "array":
            return []
        if history._children is None:
            self._body._expand_array(history, members=False)
        return list(history)

    @property
    def edited(self) -> bool:
        """Whether any value was replaced."""
        return bool(self._body._edits)

    @property
    def edits(self) -> tuple[tuple[int, int, bytes], ...]:
        """The replacements as ``(start, end, new bytes)`` in body order."""
        return tuple(self._body._edits)

    def splice(self) -> Splice:
        """The outbound body: raw slices between the edits and the replacement bytes."""
        body = self._body
        segments: list[memoryview | bytes] = []
        offsets: list[int | None] = []
        pos = 0
        for start, end, data in body._edits:
            if start > pos:
                segments.append(body._mv[pos:start])
                offsets.append(pos)
            if data:
                segments.append(data)
                offsets.append(None)
            pos = end
        if pos < len(body._buf):
            segments.append(body._mv[pos:])
            offsets.append(pos)
        return Splice(segments, body._buf, offsets)

    def release(self) -> None:
        """Drop the nodes and edits and release the buffer view (idempotent)."""
        self._root = None
        self._body._starts.clear()
        self._body._edits.clear()
        self._body._mv.release()


class ParsedHolder:
    """Weak-referenceable owner of a parsed request body (a JSON object as ``dict``).

    ``estimate`` is the wire size the object was decoded from, in bytes: the
    object graph of a text-heavy JSON body is of the same order, and measuring
    it exactly would cost a walk over the whole body.
    """

    __slots__ = ("__weakref__", "body", "estimate")

    def __init__(self, body: dict[str, Any], estimate: int) -> None:
        self.body = body
        self.estimate = estimate


class Draft:
    """The request body during one prepare run, in the form each plugin asks for.

    Starts as ``base`` (the raw wire bytes, viewed through :meth:`view`) or as
    an already parsed ``obj``. :meth:`body` hands out the whole parsed object,
    decoding the current state (the base plus the view's edits, joined for the
    decode: the whole-object path's ~2x cost); :meth:`view` after that
    re-encodes the object into a new base buffer. Plugins that use only the
    view never cause either conversion.

    Raises (from :meth:`body` / :meth:`view`):
        WireError: the body is not a JSON object.
    """

    __slots__ = ("__weakref__", "_base", "_derived", "_object", "_view", "protocol")

    def __init__(
        self,
        protocol: Protocol,
        *,
        base: bytes | bytearray | memoryview | None = None,
        obj: ParsedHolder | None = None,
    ) -> None:
        if (base is None) == (obj is None):
            raise ValueError("a draft starts from exactly one of base or obj")
        self.protocol: Final = protocol
        self._base = base
        self._object = obj
        self._view: BodyView | None = None
        # True once the base is an encoding of a handed-out object, not the wire bytes.
        self._derived = False

    @property
    def object_holder(self) -> ParsedHolder | None:
        """The holder of the parsed object while the body is held as one, else None."""
        return self._object

    def view(self) -> BodyView:
        """The structural view of the current body (built on first use)."""
        if self._view is None:
            if self._object is not None:
                self._base = wire.encode_body(self._object.body)
                self._object = None
                self._derived = True
            assert self._base is not None
            self._view = BodyView(self._base, self.protocol)
        return self._view

    def body(self) -> dict[str, Any]:
        """The whole parsed body (a ``dict``, shared by every plugin that asks)."""
        if self._object is None:
            view, base = self._view, self._base
            assert base is not None
            if view is not None and view.edited:
                joined = view.splice().join()
                self._derived = True
                view.release()
                self._object = ParsedHolder(wire.decode_body(joined), len(joined))
                del joined
            else:
                if view is not None:
                    view.release()
                self._object = ParsedHolder(wire.decode_body(base), len(base))
            self._view = None
            self._base = None
        return self._object.body

    def result(self, reported: bool) -> Splice | ParsedHolder | None:
        """What to send after the run: ``None`` for the body as received.

        ``reported`` is whether a plugin's ``prepare`` said it changed the body.
        An object that was handed out counts as changed only when reported (or
        when it was decoded from edits); view edits always count. A
        :class:`Splice` shares the base buffer; a parsed object must be serialized.
        """
        if self._object is not None:
            return self._object if (reported or self._derived) else None
        view = self._view
        if view is not None and view.edited:
            return view.splice()
        if self._derived and reported:
            assert self._base is not None
            return Splice([memoryview(self._base).toreadonly()], self._base)
        return None

    def release(self) -> None:
        """Drop the view, the object and the base reference (idempotent)."""
        if self._view is not None:
            self._view.release()
        self._view = None
        self._object = None
        self._base = None

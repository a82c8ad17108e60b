"""Built-in ``fold`` plugin: after a context overflow, elide the oldest bulky content.

When the upstream rejects a request as too long for its context window, the proxy
refolds: it runs every ``prepare`` hook again at the next fold level and resends
(docs/design.md §1). This plugin turns the fold level into a smaller request while
keeping it valid for the protocol. Pure: no I/O and nothing from aiohttp.

It works on the structural view (``ctx.view``): it never asks for the whole
parsed object, reads each bulky piece's size from its bytes, and replaces the
pieces it elides in place, so the refolded body the proxy sends is the raw
buffer's slices with the placeholders spliced in (peak about 1.0x the body).

Vocabulary
----------
*Entries* are the items of ``messages`` (OpenAI chat, Anthropic messages and
count_tokens) or of ``input`` when it is a list (OpenAI Responses). System
entries (chat and Responses ``role`` ``system``/``developer``) are never
touched, and neither are Anthropic's top-level ``system`` nor Responses'
``instructions``, which are not entries at all.

A *turn* is a maximal run of consecutive non-system entries spoken by the same
side. The user side is ``role: user``, chat ``tool``/``function`` messages and
Responses ``*_output`` items (``function_call_output``...); everything else is
the assistant side (assistant messages, Responses ``function_call`` and
``reasoning`` items). Anthropic roles alternate, so there a turn is a message;
in chat, an assistant message with ``tool_calls`` and the ``tool`` messages that
answer it are two turns.

The turns are split in three, oldest first:

* **protected**: the last user-side turn and every turn after it (the question
  being asked, e.g. the newest ``tool_result``, and an Anthropic prefill). Never
  changed, whatever the options or the level.
* **tail**: the rest of the last ``keep_last`` turns.
* **head**: everything older.

Levels
------
Only *bulky* turns count: those holding at least one piece of ``min_bytes`` or
more (see below), or a placeholder left by an earlier fold. With
``k = levels_per_stage`` (default 2), schedule step ``s`` (1 to ``2k``) selects

* the oldest ``ceil(min(s, k) / k * H)`` of the ``H`` bulky head turns, and
* the oldest ``ceil(clamp(s - k, 0, k) / k * T)`` of the ``T`` bulky tail turns.

Steps that would select nothing new are dropped, and fold level ``L`` applies
the ``L``-th remaining step (the last one when ``L`` is larger). With the
defaults: level 1 folds the older half of the bulky head turns, level 2 all of
them, level 3 also the older half of the bulky tail turns, level 4
(:attr:`FoldPlugin.max_level`) everything but the protected end. So every level
elides more than the one before while anything is left, and a higher level
never keeps more than a lower one. The proxy refolds from the raw bytes at each
level; because placeholders are recognized (in the JSON text), folding an
already folded body of level ``L - 1`` at level ``L`` gives the same body as
folding the original at level ``L`` too. If a step's turns yield no change after all (their
arguments hold no bulky value, or they only quote a placeholder), the next step
is applied in the same call, so ``True`` always means a smaller body.

Folding a turn replaces each bulky piece in it (one of at least ``min_bytes``
UTF-8 bytes, counting the text and data strings inside it but not its ``type``
tags) with the placeholder, where ``{n}`` is that size. No entry is ever
removed or reordered, and ids (``tool_use.id``/``tool_use_id``,
``tool_calls[].id``/``tool_call_id``, ``call_id``) are never changed, so every
call stays paired with its result. The pieces, per protocol (shapes from the
public API references of OpenAI chat completions, OpenAI Responses and
Anthropic messages):

* a string ``content`` → the placeholder string;
* a text part's text (chat ``text``/``refusal``, Anthropic ``text``, Responses
  ``input_text``/``output_text``/``refusal``) → the placeholder, type kept
  (``output_text`` also loses its ``annotations``, whose offsets no longer fit);
* an image, audio or file part (chat ``image_url``/``input_audio``/``file``,
  Anthropic ``image``, Responses ``input_image``/``input_audio``/``input_file``)
  → a text part of the protocol (``text``; ``input_text`` for Responses) holding
  the placeholder; an Anthropic ``cache_control`` marker is carried over;
* an Anthropic ``document`` → the same document with a plain-text source holding
  the placeholder (title, citations flag and ``cache_control`` kept);
* a tool result as a whole (Anthropic ``tool_result.content``, chat ``tool``
  message ``content``, Responses ``function_call_output.output``) → the
  placeholder string if it was a string, else a one-element list with a text part;
* tool-call arguments (Anthropic ``tool_use.input``, chat
  ``tool_calls[].function.arguments``, Responses ``function_call.arguments``):
  every string value of at least ``min_bytes`` inside them → the placeholder,
  keys and small values kept, so the call still names its file or command;
  arguments that are not JSON are replaced by the placeholder as a whole.

Left alone on purpose: Anthropic ``thinking``/``redacted_thinking`` blocks and
Responses ``reasoning`` items (signed or encrypted; a change is rejected), server
tool blocks, and any type not listed above.

Carried folds
-------------
A level always folds the oldest bulky turns, so what it elided is described by
one *cut*: every bulky piece of a non-system entry before that entry index.
Folding the same bytes up to the same cut gives the same bytes. So once a
session's refolded request was accepted (seen at ``commit``: 2xx), the plugin
keeps the cut with a digest of the entries before it as received, and folds the
session's next request up to that cut at level 0 when its history starts with
the same entries: the upstream receives a byte-identical prefix, without a
rejected round trip. One carried fold is kept per history of the session (keyed
by a digest of its first entries: sub-agents), scalars only. The cut moves
forward (never back) before a send that would pass ``fold_target`` of the
window as learned from overflow errors and accepted requests, or on a refold
after a carried fold overflowed again, aiming at ``fold_headroom``; the same
rules as the levels' hold, since it folds the same pieces of the same turns.
docs/plugins.md ("Carried folds") is the user's description.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import logging
import re
import string
from collections import OrderedDict
from collections.abc import Callable, Mapping
from typing import Any, Final

from proxy import (
    BodyView,
    ClusterUnavailable,
    ExchangeRecord,
    Node,
    Plugin,
    PrepareContext,
    Protocol,
    Scalar,
    SharedSessionState,
    WireError,
    WireMetadata,
    open_session_state,
)

__all__ = ["DEFAULT_PLACEHOLDER", "FoldPlugin"]

log = logging.getLogger("context_proxy.plugins.fold")

DEFAULT_PLACEHOLDER: Final = "[elided by context-proxy: {n} bytes]"

_CHAT: Final = Protocol.CHAT
_RESPONSES: Final = Protocol.RESPONSES
_FOLDABLE: Final = frozenset(
    (Protocol.CHAT, Protocol.RESPONSES, Protocol.MESSAGES, Protocol.COUNT_TOKENS)
)
# Protocols whose folds are carried to the session's next request (count_tokens is
# no turn of the conversation: it neither sets nor uses a carried fold).
_CARRYABLE: Final = frozenset((Protocol.CHAT, Protocol.RESPONSES, Protocol.MESSAGES))
# Sessions whose carried folds are kept at most (least recently used dropped first),
# and exchanges between their fold and their commit: both bound the plugin's memory
# whatever the clients do (a session the proxy forgot without closing it included).
_MAX_SESSIONS: Final = 4096
_MAX_PENDING: Final = 1024
# Seconds a session's carried folds stay in Redis (cluster mode) after their last write.
_SHARED_TTL: Final = 24 * 3600.0

_USER: Final = 0
_ASSISTANT: Final = 1
_SYSTEM: Final = 2
_SYSTEM_ROLES: Final = frozenset({"system", "developer"})
_CHAT_USER_ROLES: Final = frozenset({"user", "tool", "function"})

# Deeper structures are left alone rather than walked: no real request nests this
# far, and the bound keeps a hostile body from costing recursion.
_MAX_DEPTH: Final = 64
# The widest {n} the placeholder must fit under min_bytes with (19 digits).
_LARGEST_N: Final = 10**18


def _utf8_len(text: str) -> int:
    """Size of ``text`` in UTF-8 bytes."""
    return len(text) if text.isascii() else len(text.encode("utf-8", "surrogatepass"))


def _weight(node: Node, depth: int = 0) -> int:
    """UTF-8 bytes of the string values inside ``node``: the text and data it carries.

    Keys, numbers and the values of ``type`` keys (structural tags such as
    ``"image"``) are not counted. Strings are measured without decoding unless
    they hold escapes.
    """
    if node.kind == "string":
        return node.text_bytes()
    if depth >= _MAX_DEPTH:
        return 0
    if node.kind == "object":
        return sum(_weight(v, depth + 1) for k, v in node.items() if k != "type")
    if node.kind == "array":
        return sum(_weight(v, depth + 1) for v in node)
    return 0


def _placeholder_pattern(template: str) -> re.Pattern[bytes]:
    """A bytes regex finding what ``template`` formats to, for any ``n``, in JSON text.

    It matches the placeholder as it appears inside a JSON string (escaped
    once, raw UTF-8 or ASCII-escaped) and inside tool-call arguments, which are
    a JSON document held in a JSON string (escaped twice).

    Raises:
        ValueError: the template is malformed, has a field other than a bare
            ``{n}``, or has no literal text besides it.
    """
    forms: list[list[bytes]] = [[], [], [], []]
    literal_text = ""
    try:
        pieces = list(string.Formatter().parse(template))
    except ValueError as exc:
        raise ValueError(f"fold: placeholder is not a valid format string: {exc}") from None
    for literal, field, spec, conversion in pieces:
        literal_text += literal
        for index, ascii_only in enumerate((False, True)):
            once = json.dumps(literal, ensure_ascii=ascii_only)[1:-1]
            twice = json.dumps(once, ensure_ascii=ascii_only)[1:-1]
            forms[2 * index].append(re.escape(once.encode("utf-8", "surrogatepass")))
            forms[2 * index + 1].append(re.escape(twice.encode("utf-8", "surrogatepass")))
        if field is None:
            continue
        if field != "n" or spec or conversion:
            raise ValueError(f"fold: placeholder may only use the field {{n}}, found {{{field}}}")
        for form in forms:
            form.append(rb"\d+")
    if not literal_text.strip():
        # Anthropic rejects empty text blocks, and a bare number could not be told
        # apart from real content on a refold.
        raise ValueError("fold: placeholder needs some text besides {n}")
    alternatives = list(dict.fromkeys(b"".join(form) for form in forms))
    return re.compile(b"|".join(alternatives))


def _holds(node: Node, pattern: re.Pattern[bytes]) -> bool:
    """Whether the JSON text of ``node`` contains a placeholder (searched in the bytes)."""
    with node.raw() as data:
        return pattern.search(data) is not None


def _role(entry: Node) -> str | None:
    role = entry.get("role")
    return role.short_text() if role is not None else None


def _type(node: Node) -> str | None:
    kind = node.get("type")
    return kind.short_text() if kind is not None else None


def _side(entry: Node, protocol: Protocol | None) -> int:
    """Which side speaks ``entry``: ``_USER``, ``_ASSISTANT`` or ``_SYSTEM``."""
    if entry.kind != "object":
        return _ASSISTANT
    role = _role(entry)
    if role in _SYSTEM_ROLES:
        return _SYSTEM
    if role == "user" or (protocol == _CHAT and role in _CHAT_USER_ROLES):
        return _USER
    if protocol == _RESPONSES and entry.get("role") is None:
        kind = _type(entry)
        if kind is not None and kind.endswith("_output"):
            return _USER
    return _ASSISTANT


def _turns(entries: list[Node], protocol: Protocol | None) -> list[tuple[int, list[int]]]:
    """Group the non-system entries into turns: ``[(side, [entry index, ...]), ...]``."""
    turns: list[tuple[int, list[int]]] = []
    for index, entry in enumerate(entries):
        side = _side(entry, protocol)
        if side == _SYSTEM:
            continue
        if turns and turns[-1][0] == side:
            turns[-1][1].append(index)
        else:
            turns.append((side, [index]))
    return turns


def _share(count: int, steps: int, of: int) -> int:
    """``ceil(count * steps / of)`` in integers (no float rounding at stage edges)."""
    return -(-count * steps // of)


def _truthy(node: Node) -> bool:
    """Python truthiness of the JSON value, without decoding a container."""
    if node.kind in ("object", "array"):
        return len(node) > 0
    if node.kind == "string":
        return node.size > 2
    if node.kind == "number":
        return bool(node.value())
    return node.kind == "true"


class _Elider:
    """One pass over some entries: turns bulky pieces into placeholders, counting them.

    Every method works on nodes of the structural view, replacing values through
    it, and returns whether it found (and, unless ``dry``, replaced) at least
    one bulky piece. A dry elider only looks: it tells which turns are bulky
    without changing anything.
    """

    __slots__ = ("_dry", "_min_bytes", "_placeholder", "elided_bytes", "pieces")

    def __init__(self, min_bytes: int, placeholder: str, *, dry: bool) -> None:
        self._min_bytes = min_bytes
        self._placeholder = placeholder
        self._dry = dry
        self.pieces = 0
        self.elided_bytes = 0

    def for_protocol(self, protocol: Protocol | None) -> Callable[[Node], bool]:
        """The method that folds one entry of ``protocol``."""
        if protocol == _CHAT:
            return self.chat_message
        if protocol == _RESPONSES:
            return self.responses_item
        return self.anthropic_message

    def _spend(self, n: int) -> str:
        self.pieces += 1
        self.elided_bytes += n
        return self._placeholder.format(n=n)

    def _put(self, node: Node, value: Any) -> bool:
        if not self._dry:
            node.replace(value)
        return True

    # -- generic pieces ---------------------------------------------------------------

    def string(self, value: Node | None) -> bool:
        """A string value, replaced by the placeholder string."""
        if value is None or value.kind != "string":
            return False
        n = value.text_bytes()
        if n < self._min_bytes:
            return False
        return self._put(value, self._spend(n))

    def unit(self, value: Node | None, text_type: str | None) -> bool:
        """A content value taken whole: a string, or (with ``text_type``) a list of parts."""
        if value is None:
            return False
        if value.kind == "string":
            return self.string(value)
        if text_type is None or value.kind != "array":
            return False
        n = _weight(value)
        if n < self._min_bytes:
            return False
        return self._put(value, [{"type": text_type, "text": self._spend(n)}])

    def media(self, part: Node, text_type: str) -> bool:
        """An image/audio/file part, replaced by a text part of type ``text_type``."""
        n = _weight(part)
        if n < self._min_bytes:
            return False
        replacement: dict[str, Any] = {"type": text_type, "text": self._spend(n)}
        marker = part.get("cache_control")
        if marker is not None:
            # Keeps the request's Anthropic cache breakpoints where the client put them.
            replacement["cache_control"] = marker.value()
        return self._put(part, replacement)

    def tree(self, node: Node | None, depth: int = 0) -> bool:
        """Every bulky string value inside an object/array, keys and small values kept."""
        if node is None or depth >= _MAX_DEPTH or node.kind not in ("object", "array"):
            return False
        changed = False
        for value in node:
            if value.kind == "string":
                changed = self.string(value) or changed
            elif value.kind in ("object", "array"):
                changed = self.tree(value, depth + 1) or changed
        return changed

    def arguments(self, value: Node | None) -> bool:
        """Tool-call arguments held as a JSON string (OpenAI chat and Responses).

        A dry pass counts any arguments of ``min_bytes`` or more as bulky without
        reading them; the real pass may then find no bulky value inside. The
        arguments document is edited through a view of its own, so its text
        outside the elided values stays as the client wrote it.
        """
        if value is None or value.kind != "string":
            return False
        n = value.text_bytes()
        if n < self._min_bytes:
            return False
        if self._dry:
            self._spend(n)
            return True
        text = value.text()
        try:
            inner = BodyView.of_value(text.encode("utf-8"))
        except (UnicodeEncodeError, WireError):
            # Not JSON (or a lone surrogate that cannot travel as UTF-8): elided whole.
            return self.string(value)
        top = inner.top
        if top.kind == "string":
            size = top.text_bytes()
            if size < self._min_bytes:
                return False
            top.replace(self._spend(size))
        elif not self.tree(top):
            return False
        value.replace(inner.splice().join().decode("utf-8"))
        return True

    # -- protocols --------------------------------------------------------------------

    def chat_message(self, message: Node) -> bool:
        """One OpenAI chat message (user, assistant, tool or legacy function)."""
        changed = False
        content = message.get("content")
        if _role(message) in ("tool", "function"):
            changed = self.unit(content, "text")
        elif content is not None and content.kind == "string":
            changed = self.string(content)
        elif content is not None and content.kind == "array":
            for part in content:
                kind = _type(part) if part.kind == "object" else None
                if kind in ("text", "refusal"):
                    changed = self.string(part.get(kind)) or changed
                elif kind in ("image_url", "input_audio", "file"):
                    changed = self.media(part, "text") or changed
        calls = message.get("tool_calls")
        if calls is not None and calls.kind == "array":
            for call in calls:
                function = call.get("function") if call.kind == "object" else None
                if function is not None and function.kind == "object":
                    changed = self.arguments(function.get("arguments")) or changed
        legacy = message.get("function_call")
        if legacy is not None and legacy.kind == "object":
            changed = self.arguments(legacy.get("arguments")) or changed
        return changed

    def anthropic_message(self, message: Node) -> bool:
        """One Anthropic message (user or assistant), string or list of content blocks."""
        content = message.get("content")
        if content is None:
            return False
        if content.kind == "string":
            return self.string(content)
        if content.kind != "array":
            return False
        changed = False
        for block in content:
            if block.kind != "object":
                continue
            kind = _type(block)
            if kind == "text":
                changed = self.string(block.get("text")) or changed
            elif kind == "image":
                changed = self.media(block, "text") or changed
            elif kind == "document":
                changed = self._document(block) or changed
            elif kind == "tool_result":
                changed = self.unit(block.get("content"), "text") or changed
            elif kind == "tool_use":
                changed = self.tree(block.get("input")) or changed
        return changed

    def _document(self, block: Node) -> bool:
        # A document stays a document (a citation may refer to it by index); only its
        # source becomes a short plain-text one.
        source = block.get("source")
        n = _weight(source) if source is not None else 0
        if source is None or n < self._min_bytes:
            return False
        replacement = {"type": "text", "media_type": "text/plain", "data": self._spend(n)}
        return self._put(source, replacement)

    def responses_item(self, item: Node) -> bool:
        """One OpenAI Responses input item (message, call or call output)."""
        kind = _type(item)
        if kind is None and item.get("role") is not None:
            kind = "message"
        if kind == "message":
            content = item.get("content")
            if content is not None and content.kind == "string":
                return self.string(content)
            if content is not None and content.kind == "array":
                return self._responses_parts(content)
            return False
        if kind == "function_call":
            return self.arguments(item.get("arguments"))
        if kind == "custom_tool_call":
            return self.string(item.get("input"))
        if kind in ("function_call_output", "custom_tool_call_output"):
            return self.unit(item.get("output"), "input_text")
        if kind == "local_shell_call_output":
            return self.string(item.get("output"))
        return False

    def _responses_parts(self, parts: Node) -> bool:
        changed = False
        for part in parts:
            if part.kind != "object":
                continue
            kind = _type(part)
            if kind in ("input_text", "output_text"):
                if self.string(part.get("text")):
                    changed = True
                    annotations = part.get("annotations")
                    if annotations is not None and _truthy(annotations) and not self._dry:
                        annotations.replace([])
            elif kind == "refusal":
                changed = self.string(part.get("refusal")) or changed
            elif kind in ("input_image", "input_audio", "input_file"):
                changed = self.media(part, "input_text") or changed
        return changed


def _check_int(name: str, value: object, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"fold: {name} must be an integer, got {type(value).__name__}")
    if value < minimum:
        raise ValueError(f"fold: {name} must be >= {minimum}, got {value}")
    return value


def _check_share(name: str, value: object) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"fold: {name} must be a number, got {type(value).__name__}")
    if not 0 < value <= 1:
        raise ValueError(f"fold: {name} must be in (0, 1], got {value}")
    return float(value)


_CACHE_MARK: Final = re.compile(rb'"cache_control"')


def _marker_cuts(entry: Node, data: memoryview) -> list[tuple[int, int]]:
    """Byte ranges (body offsets, in order) of the ``cache_control`` members of ``entry``
    and of its content blocks, each with the separator that goes with it.

    Cutting them leaves the text the entry would have without those members, in
    compact and in ``json.dumps`` spacing alike: the comma before a member that
    is not first, or for a first member the comma and spaces after it. ``data``
    is the entry's JSON text.
    """
    cuts: list[tuple[int, int]] = []
    objects = [entry]
    content = entry.get("content")
    if content is not None and content.kind == "array":
        objects += [block for block in content if block.kind == "object"]
    for node in objects:
        members = list(node.items())
        for index, (key, value) in enumerate(members):
            if key != "cache_control":
                continue
            if index > 0:
                cuts.append((members[index - 1][1].end, value.end))
            elif len(members) > 1:
                # Through the comma after it and the spaces after that: the next
                # member's key starts there.
                end = value.end - entry.start
                for _ in range(2):  # bounded: spaces, the comma, spaces
                    while end < len(data) and data[end] in b" \t\r\n":
                        end += 1
                    if end < len(data) and data[end] == ord(","):
                        end += 1
                cuts.append((node.start + 1, end + entry.start))
    cuts.sort()  # the entry's own member may come after its content's
    return cuts


def _hash_entry(hasher: hashlib.blake2b, entry: Node) -> None:
    """Feed ``entry``'s JSON text to ``hasher`` length-prefixed, without its
    ``cache_control`` members (see :func:`_digest`)."""
    with entry.raw() as data:
        cuts = _marker_cuts(entry, data) if _CACHE_MARK.search(data) else []
        if not cuts:
            hasher.update(len(data).to_bytes(8, "little"))
            hasher.update(data)
            return
        start = entry.start
        kept = [(0, cuts[0][0] - start)]
        kept += [(a - start, b - start) for (_, a), (b, _) in itertools.pairwise(cuts)]
        kept.append((cuts[-1][1] - start, len(data)))
        hasher.update(sum(end - begin for begin, end in kept).to_bytes(8, "little"))
        for begin, end in kept:
            hasher.update(data[begin:end])


def _digest(entries: list[Node], stop: int) -> str:
    """Hex digest of the JSON text of ``entries[:stop]`` as received, each length-prefixed.

    The entries are read from the raw buffer (an edit changes what is sent, not
    what a node reads), so the digest is of the history as the client sent it,
    except for prompt-cache breakpoints: ``cache_control`` members (of an entry
    or of its content blocks) are left out, since a client moves them to its
    newest messages every turn (Anthropic's multi-turn caching) and they do not
    change what the fold elides. The client's markers are sent as it sent them.
    """
    hasher = hashlib.blake2b(digest_size=16)
    for entry in entries[:stop]:
        _hash_entry(hasher, entry)
    return hasher.hexdigest()


def _outbound_size(view: BodyView) -> int:
    """Bytes of the body the view would send now: the raw size plus what its edits changed."""
    return view.nbytes + sum(len(data) - (end - start) for start, end, data in view.edits)


def _history_key(entries: list[Node], protocol: Protocol | None, model: str | None) -> str:
    """Digest of the protocol, the model and a history's first entries (up to and
    including the first user-side one).

    Sub-agents of one session (Claude Code's) differ in the entries: their own
    task prompt. The model is part of it because what a fold learned is one
    model's context window: a session that switches to a model with more room
    must not get the old model's elisions.
    """
    first_user = next((i for i, entry in enumerate(entries) if _side(entry, protocol) == _USER), 0)
    hasher = hashlib.blake2b(digest_size=16)
    for part in (str(protocol), model or ""):
        data = part.encode()
        hasher.update(len(data).to_bytes(8, "little"))
        hasher.update(data)
    hasher.update(bytes.fromhex(_digest(entries, first_user + 1)))
    return hasher.hexdigest()


class _History:
    """One request's history as the fold sees it: entries, sides and bulky turns.

    ``bulky`` lists the bulky turns before the protected end (entry indices,
    oldest first); the first ``head`` of them are head turns, the rest tail
    turns. ``protected_at`` is the index of the protected end's first entry: no
    cut goes past it.
    """

    __slots__ = ("bulky", "entries", "head", "protected_at", "sides")

    def __init__(
        self,
        entries: list[Node],
        sides: list[int],
        bulky: list[list[int]],
        head: int,
        protected_at: int,
    ) -> None:
        self.entries = entries
        self.sides = sides
        self.bulky = bulky
        self.head = head
        self.protected_at = protected_at

    def starts_with(self, carried: _Carried) -> bool:
        """Whether this history begins with exactly the prefix ``carried`` was cut in."""
        return 0 < carried.cut <= self.protected_at and (
            _digest(self.entries, carried.cut) == carried.prefix
        )


class _Carried:
    """A carried fold (or one waiting for its exchange's commit): scalars only.

    ``cut``: entries before this index are folded (every bulky piece of a
    non-system entry), the rest are sent as received. ``level``: the fold level
    of the send that set it (0 for a carried fold applied before a first send).
    ``prefix``: digest of ``entries[:cut]`` as received. What it learned of the
    context window: ``window_tokens`` (as an overflow error stated it),
    ``tokens`` for ``tokens_bytes`` bytes (an accepted request's ``input_tokens``
    against its size; or the prompt size an error stated against the body it
    rejected), ``rejected_bytes`` (the smallest body refused as too long).
    ``from_carry``: the fold started from a carried one (so a refold moves its
    cut rather than starting the level schedule).
    """

    __slots__ = (
        "cut",
        "from_carry",
        "key",
        "level",
        "prefix",
        "rejected_bytes",
        "tokens",
        "tokens_bytes",
        "window_tokens",
    )

    def __init__(self, key: str, *, from_carry: bool, learned: _Carried | None) -> None:
        self.key = key
        self.from_carry = from_carry
        self.cut = 0
        self.level = 0
        self.prefix = ""
        self.window_tokens: int | None = learned.window_tokens if learned else None
        self.tokens: int | None = learned.tokens if learned else None
        self.tokens_bytes: int | None = learned.tokens_bytes if learned else None
        self.rejected_bytes: int | None = learned.rejected_bytes if learned else None

    def learn_overflow(self, ctx: PrepareContext) -> None:
        """Take in what the overflow that caused this refold said of the window."""
        rejected = ctx.rejected_bytes
        if rejected is None:
            return
        if self.rejected_bytes is None or rejected < self.rejected_bytes:
            self.rejected_bytes = rejected
        if ctx.window_tokens is not None:
            self.window_tokens = ctx.window_tokens
        if ctx.prompt_tokens is not None and ctx.prompt_tokens > 0:
            self.tokens, self.tokens_bytes = ctx.prompt_tokens, rejected

    def encode(self) -> str:
        """The scalars as one short string (cluster mode's shared hash; see :meth:`decode`)."""
        numbers = (self.window_tokens, self.tokens, self.tokens_bytes, self.rejected_bytes)
        figures = " ".join("-" if n is None else str(n) for n in numbers)
        return f"1 {self.cut} {self.level} {self.prefix} {figures}"

    @classmethod
    def decode(cls, key: str, text: str) -> _Carried | None:
        """A carried fold from :meth:`encode`'s string; ``None`` if it is not one."""
        parts = text.split(" ")
        if len(parts) != 8 or parts[0] != "1":
            return None
        try:
            cut, level = int(parts[1]), int(parts[2])
            figures = [None if p == "-" else int(p) for p in parts[4:]]
        except ValueError:
            return None
        fold = cls(key, from_carry=True, learned=None)
        fold.cut, fold.level, fold.prefix = cut, level, parts[3]
        fold.window_tokens, fold.tokens, fold.tokens_bytes, fold.rejected_bytes = figures
        return fold if cut > 0 else None

    def window_bytes(self) -> int | None:
        """The context window in body bytes, as well as it is known (``None``: unknown).

        The stated window in tokens, at the measured bytes per token; never more
        than the smallest body the upstream refused.
        """
        bound = self.rejected_bytes
        if self.window_tokens is not None and self.tokens and self.tokens_bytes:
            estimate = self.window_tokens * self.tokens_bytes // self.tokens
            bound = estimate if bound is None else min(bound, estimate)
        return bound


class _SessionFolds:
    """A session's carried folds, one per history key, least recently used first."""

    __slots__ = ("applied", "by_key", "dropped", "moves")

    def __init__(self) -> None:
        self.by_key: OrderedDict[str, _Carried] = OrderedDict()
        #: History keys dropped here and not yet deleted from the shared state.
        self.dropped: set[str] = set()
        #: Requests folded before their first send by a carried fold.
        self.applied = 0
        #: Times a carried cut moved forward (hysteresis).
        self.moves = 0


class FoldPlugin(Plugin):
    """Elide ever more of the oldest bulky content at each fold level (see the module doc).

    Carried folds: once a session's request was refolded and accepted, the
    session's next requests that start with the same history prefix are folded
    with the same elisions before their first send (docs/plugins.md, "Carried
    folds"). They need a session id; requests without one fold as before.

    Options (keyword arguments, from the ``[plugin.fold]`` config table):

    ``keep_last`` (int >= 0, default 4)
        Turns at the end left intact through the first ``levels_per_stage``
        levels (the tail). The last user-side turn and what follows it are
        never changed, even with ``keep_last = 0``.
    ``min_bytes`` (int >= 1, default 2048)
        A piece under this many UTF-8 bytes is never elided. Must exceed the
        longest formatted placeholder, so that folding always shrinks and never
        re-elides its own placeholders.
    ``placeholder`` (str, default ``"[elided by context-proxy: {n} bytes]"``)
        The text left in place of a piece; ``{n}`` (optional, no format spec) is
        the number of bytes removed. Needs some text besides ``{n}``; a
        distinctive one lets a refold recognize what it already elided.
    ``levels_per_stage`` (int >= 1, default 2)
        Levels it takes to fold all bulky head turns, and then all bulky tail
        turns: :attr:`max_level` is twice this. Set the proxy's ``max_refolds``
        to :attr:`max_level` to let every stage run.
    ``carry`` (bool, default ``True``)
        Carry a session's accepted fold to its next requests.
    ``fold_target`` (float in (0, 1], default 0.85)
        Share of the learned context window past which a carried fold's cut
        moves forward before the send.
    ``fold_headroom`` (float in (0, 1], below ``fold_target``, default 0.6)
        Share of the learned window a moved cut aims the body at.
    ``max_histories`` (int >= 1, default 8)
        Carried folds kept per session, one per history (sub-agents share a
        session id); the least recently used goes first.
    ``redis_url`` (str, default: the proxy's ``redis_url`` setting)
        Cluster mode: carried folds are also kept in the session's shared
        state in Redis, so another node continues the same cut.
    ``redis_timeout`` (seconds, default: the proxy's ``redis_timeout``, else 1)
        Per Redis command; a Redis that does not answer costs a carried fold,
        never a request.

    Raises:
        TypeError: an option has the wrong type, or is unknown.
        ValueError: an option is out of range, or the placeholder is malformed,
            blank, uses a field other than ``{n}``, or is not shorter than
            ``min_bytes``; ``fold_headroom`` is not below ``fold_target``.
    """

    name = "fold"

    def __init__(
        self,
        *,
        keep_last: int = 4,
        min_bytes: int = 2048,
        placeholder: str = DEFAULT_PLACEHOLDER,
        levels_per_stage: int = 2,
        carry: bool = True,
        fold_target: float = 0.85,
        fold_headroom: float = 0.6,
        max_histories: int = 8,
        redis_url: str | None = None,
        redis_timeout: float = 1.0,
    ) -> None:
        self.keep_last: Final = _check_int("keep_last", keep_last, 0)
        self.min_bytes: Final = _check_int("min_bytes", min_bytes, 1)
        self.levels_per_stage: Final = _check_int("levels_per_stage", levels_per_stage, 1)
        if not isinstance(placeholder, str):
            raise TypeError(f"fold: placeholder must be a string, got {type(placeholder).__name__}")
        self._pattern: Final = _placeholder_pattern(placeholder)
        widest = _utf8_len(placeholder.format(n=_LARGEST_N))
        if widest >= self.min_bytes:
            raise ValueError(
                f"fold: placeholder ({widest} bytes at most) must be shorter than "
                f"min_bytes ({self.min_bytes})"
            )
        self.placeholder: Final = placeholder
        if not isinstance(carry, bool):
            raise TypeError(f"fold: carry must be true or false, got {type(carry).__name__}")
        self.carry: Final = carry
        self.fold_target: Final = _check_share("fold_target", fold_target)
        self.fold_headroom: Final = _check_share("fold_headroom", fold_headroom)
        if self.fold_headroom >= self.fold_target:
            raise ValueError(
                f"fold: fold_headroom ({fold_headroom}) must be below fold_target ({fold_target})"
            )
        self.max_histories: Final = _check_int("max_histories", max_histories, 1)
        # Per session id, its carried folds; least recently used session first.
        self._sessions: OrderedDict[str, _SessionFolds] = OrderedDict()
        # Per (session id, wire digest): the fold an exchange sent last, until its commit.
        self._pending: OrderedDict[tuple[str, str], _Carried] = OrderedDict()
        if redis_url is not None and not isinstance(redis_url, str):
            raise TypeError(f"fold: redis_url must be a string, got {type(redis_url).__name__}")
        if isinstance(redis_timeout, bool) or not isinstance(redis_timeout, (int, float)):
            raise TypeError("fold: redis_timeout must be a number of seconds")
        if not redis_timeout > 0:
            raise ValueError(f"fold: redis_timeout must be > 0, got {redis_timeout}")
        self.redis_url: Final = redis_url or None
        self.redis_timeout: Final = float(redis_timeout)
        # Cluster mode: the shared state (opened in startup), and the sessions whose
        # shared state this node has read (each is read once, on its first request here).
        self._shared: SharedSessionState | None = None
        self._loaded: OrderedDict[str, None] = OrderedDict()

    async def startup(self) -> None:
        """Cluster mode: open the shared session state (connects on first use)."""
        if self.redis_url is not None and self.carry:
            self._shared = open_session_state(
                self.redis_url, name=self.name, timeout=self.redis_timeout
            )

    async def shutdown(self) -> None:
        """Close the shared session state's connections."""
        shared, self._shared = self._shared, None
        if shared is not None:
            await shared.close()

    @property
    def max_level(self) -> int:
        """The highest fold level that can still elide more; higher ones act like it."""
        return 2 * self.levels_per_stage

    def folds(self, meta: WireMetadata, fold_level: int) -> bool:
        """True at fold level >= 1 for chat, Responses, Anthropic messages and count_tokens.

        At level 0, and for a request of at most one entry (nothing but its
        protected end), :meth:`fold` does nothing. At level 0 :meth:`prepare`
        may still apply a carried fold (see :meth:`wants_prepare`).
        """
        return fold_level > 0 and meta.protocol in _FOLDABLE and meta.message_count > 1

    def wants_prepare(self, meta: WireMetadata, fold_level: int) -> bool:
        """Decline the prepare run where :meth:`prepare` does nothing.

        That is where :meth:`folds` is false, except at fold level 0 while some
        session has a carried fold (the request may be one of its turns: the
        session id is not known here). At fold level 0, the first send of every
        request, the proxy then skips the run altogether when no other plugin
        prepares. A subclass that overrides :meth:`prepare` is never declined
        (its hook may do more than fold), unless it overrides this method too.
        """
        if type(self).prepare is not FoldPlugin.prepare:
            return True
        if self.folds(meta, fold_level):
            return True
        return (
            fold_level == 0
            and (bool(self._sessions) or self._shared is not None)
            and meta.protocol in _CARRYABLE
            and meta.message_count > 1
        )

    async def prepare(self, ctx: PrepareContext) -> bool:
        """Fold the request at ``ctx.fold_level`` through ``ctx.view``; see :meth:`fold`.

        With a session id (chat, Responses, Anthropic messages) and ``carry``
        on, a carried fold whose prefix the history starts with is applied at
        level 0 and moved forward on a refold (docs/plugins.md, "Carried folds").
        Never asks for the whole object (``wants_body`` stays ``False``): the
        view edits the bulky values where they are, so a refold of a 64 MB
        history holds the raw bytes plus the placeholders.
        """
        meta, level, session = ctx.meta, ctx.fold_level, ctx.session_id
        if not self.carry or session is None or meta.protocol not in _CARRYABLE:
            if not self.folds(meta, level):
                return False
            return self.fold(ctx.view, level=level)
        if meta.message_count <= 1:
            return False
        if level == 0 and self._shared is not None and session not in self._loaded:
            await self._load(session)
        return self._carried_prepare(ctx, session)

    def fold(self, view: BodyView, *, level: int) -> bool:
        """Replace, through ``view``, the bulky pieces that fold level ``level`` selects.

        ``view`` is the structural view of the request (its ``protocol`` picks
        the history field and shapes). Folding a body already folded at
        ``level - 1`` at ``level`` elides only what the new level adds (its
        placeholders are recognized in the bytes). If the selected turns yield
        no change after all (large arguments without a large value, a quoted
        placeholder), the next steps of the schedule are tried, so ``True``
        always means the body shrank. Never raises on an unexpected shape:
        what it does not recognize it leaves alone.

        Returns:
            True iff the body changed; False at level <= 0, for other protocols,
            and when nothing foldable is left (the proxy then hands the
            upstream's overflow error to the client).
        """
        if level <= 0:
            return False
        history = self._history(view)
        return history is not None and self._fold_level(view, history, level) > 0

    # -- the level schedule -----------------------------------------------------------

    def _history(self, view: BodyView) -> _History | None:
        """The entries, sides and bulky turns of ``view``, or ``None`` if nothing may fold."""
        protocol = view.protocol
        if protocol not in _FOLDABLE:
            return None
        entries = view.items()
        if not entries:
            return None
        sides = [_side(entry, protocol) for entry in entries]
        turns = _turns(entries, protocol)
        protected = max(
            (i for i, (side, _) in enumerate(turns) if side == _USER), default=len(turns) - 1
        )
        if protected <= 0:
            return None
        tail_start = min(protected, max(0, len(turns) - self.keep_last))

        probe = _Elider(self.min_bytes, self.placeholder, dry=True).for_protocol(protocol)

        def bulky(indices: list[int]) -> bool:
            for index in indices:
                entry = entries[index]
                if entry.kind == "object" and (probe(entry) or _holds(entry, self._pattern)):
                    return True
            return False

        head = [indices for _, indices in turns[:tail_start] if bulky(indices)]
        tail = [indices for _, indices in turns[tail_start:protected] if bulky(indices)]
        return _History(entries, sides, head + tail, len(head), turns[protected][1][0])

    def _fold_level(self, view: BodyView, history: _History, level: int) -> int:
        """Fold what level ``level`` of the schedule selects; the cut, 0 if nothing changed.

        The selection is always the oldest bulky turns (all head turns before
        any tail turn), so the folded entries are exactly the non-system ones
        before the cut: :meth:`_fold_to` with that cut gives the same body.
        """
        steps = self._schedule(history.head, len(history.bulky) - history.head)
        if not steps:
            return 0
        elider = _Elider(self.min_bytes, self.placeholder, dry=False)
        fold_entry = elider.for_protocol(view.protocol)
        done = applied = 0
        for step in range(min(level, len(steps)), len(steps) + 1):
            head_want, tail_want = steps[step - 1]
            # A tail turn is selected only once every head turn is.
            want = head_want + tail_want
            for indices in history.bulky[done:want]:
                for index in indices:
                    entry = history.entries[index]
                    if entry.kind == "object":
                        fold_entry(entry)
            done, applied = want, step
            if elider.pieces:
                break
        if not elider.pieces:
            return 0
        log.debug(
            "fold level %d (step %d of %d): elided %d pieces, %d bytes",
            level,
            applied,
            len(steps),
            elider.pieces,
            elider.elided_bytes,
        )
        return history.bulky[done - 1][-1] + 1

    def _schedule(self, head: int, tail: int) -> list[tuple[int, int]]:
        """Distinct ``(head turns, tail turns)`` folded per step, in increasing order."""
        stage = self.levels_per_stage
        steps: list[tuple[int, int]] = []
        previous = (0, 0)
        for step in range(1, 2 * stage + 1):
            current = (
                _share(head, min(step, stage), stage),
                _share(tail, max(0, step - stage), stage),
            )
            if current != previous:
                steps.append(current)
                previous = current
        return steps

    # -- carried folds ------------------------------------------------------------------

    def _fold_to(
        self,
        view: BodyView,
        history: _History,
        cut: int,
        *,
        trigger: int | None,
        target: int | None,
        more: bool,
    ) -> tuple[int, int]:
        """Fold every non-system entry before ``cut``, then move the cut if asked.

        The cut moves forward, one bulky turn at a time, while the body is over
        ``target`` bytes, once it was over ``trigger`` bytes (``None``: never);
        with ``more``, by at least one turn that elides something. Returns the
        cut and the number of pieces elided.
        """
        elider = _Elider(self.min_bytes, self.placeholder, dry=False)
        fold_entry = elider.for_protocol(view.protocol)
        entries = history.entries
        for index in range(cut):
            if history.sides[index] != _SYSTEM and entries[index].kind == "object":
                fold_entry(entries[index])
        size = _outbound_size(view)
        if trigger is None or size <= trigger:
            target = None
        for indices in history.bulky:
            if indices[0] < cut:
                continue
            if not more and (target is None or size <= target):
                break
            before = elider.pieces
            for index in indices:
                if entries[index].kind == "object":
                    fold_entry(entries[index])
            cut = indices[-1] + 1
            if elider.pieces > before:
                more = False
                size = _outbound_size(view)
        return cut, elider.pieces

    def _carried_prepare(self, ctx: PrepareContext, session: str) -> bool:
        """:meth:`prepare` for a request of a session: carried folds applied and kept."""
        level = ctx.fold_level
        folds = self._sessions.get(session)
        if level == 0 and folds is None:
            # Most requests: nothing carried for this session, nothing read.
            return False
        view = ctx.view
        entries = view.items()
        if not entries:
            return False
        key = _history_key(entries, view.protocol, ctx.meta.model)
        carried = folds.by_key.get(key) if folds is not None else None
        if level == 0 and carried is None:
            return False
        history = self._history(view)
        if history is None:
            return False
        if folds is not None and carried is not None:
            self._sessions.move_to_end(session)
            folds.by_key.move_to_end(key)
            if not history.starts_with(carried):
                # Compacted, edited or started over: the elisions no longer fit.
                del folds.by_key[key]
                folds.dropped.add(key)
                carried = None
        pending_key = (session, ctx.meta.digest)
        last = self._pending.get(pending_key) if level > 0 else None
        if level == 0:
            if carried is None or folds is None:
                return False
            fold = _Carried(key, from_carry=True, learned=carried)
            window = fold.window_bytes()
            cut, pieces = self._fold_to(
                view,
                history,
                carried.cut,
                trigger=None if window is None else int(window * self.fold_target),
                target=None if window is None else int(window * self.fold_headroom),
                more=False,
            )
            folds.applied += 1
            if cut != carried.cut:
                folds.moves += 1
        elif last is not None and last.from_carry:
            # A carried fold overflowed again: move its cut (never back), aiming at
            # the headroom of what is now known of the window.
            fold = _Carried(key, from_carry=True, learned=last)
            fold.learn_overflow(ctx)
            window = fold.window_bytes()
            target = None if window is None else int(window * self.fold_headroom)
            cut, pieces = self._fold_to(
                view, history, last.cut, trigger=0, target=target, more=True
            )
            if folds is not None:
                folds.moves += 1
        else:
            fold = _Carried(key, from_carry=False, learned=last)
            fold.learn_overflow(ctx)
            cut = self._fold_level(view, history, level)
            pieces = int(cut > 0)
        if cut <= 0 or pieces == 0:
            return False
        fold.cut, fold.level = cut, level
        fold.prefix = _digest(history.entries, cut)
        self._pending[pending_key] = fold
        self._pending.move_to_end(pending_key)
        while len(self._pending) > _MAX_PENDING:
            self._pending.popitem(last=False)
        return True

    async def _load(self, session: str) -> None:
        """Cluster mode: this node's first request of ``session`` reads its carried folds.

        One Redis round trip under the session lock, once per session and node
        (a session moves only when its node fails or the ring changes). If Redis
        does not answer, the request goes on with what this node knows.
        """
        assert self._shared is not None
        try:
            raw = await self._shared.load(session)
        except ClusterUnavailable:
            log.debug("fold: shared session state unavailable; carried folds not read")
            return
        self._loaded[session] = None
        while len(self._loaded) > _MAX_SESSIONS:
            self._loaded.popitem(last=False)
        found = [(key, _Carried.decode(key, text)) for key, text in raw.items()]
        carried = [fold for _, fold in found if fold is not None]
        if not carried or session in self._sessions:
            return
        folds = self._remember(session)
        for fold in carried[-self.max_histories :]:
            folds.by_key[fold.key] = fold

    def _remember(self, session: str) -> _SessionFolds:
        """The session's carried folds, created if need be, as the most recently used."""
        folds = self._sessions.get(session)
        if folds is None:
            folds = self._sessions[session] = _SessionFolds()
        self._sessions.move_to_end(session)
        while len(self._sessions) > _MAX_SESSIONS:
            self._sessions.popitem(last=False)
        return folds

    def wants_commit(self, session_id: str | None) -> bool:
        """Decline an exchange without a session: :meth:`commit` keeps nothing for it.

        A subclass that overrides :meth:`commit` is never declined (its hook may do
        more), unless it overrides this method too.
        """
        return type(self).commit is not FoldPlugin.commit or session_id is not None

    async def commit(self, record: ExchangeRecord) -> None:
        """Keep the fold of an accepted exchange as its session's carried fold.

        An exchange is accepted when the upstream answered 2xx; its
        ``input_tokens`` against its ``outbound_bytes`` is the window's measure.
        In cluster mode the change is written to the session's shared state.
        """
        session = record.session_id
        if session is None:
            return
        fold = self._pending.pop((session, record.wire_digest), None)
        accepted = fold is not None and 200 <= record.status < 300
        folds = self._sessions.get(session)
        if fold is None or not accepted:
            if folds is not None and folds.dropped:
                await self._share(session, folds, None, [])
            return
        if record.input_tokens:
            fold.tokens, fold.tokens_bytes = record.input_tokens, record.outbound_bytes
        folds = self._remember(session)
        folds.by_key[fold.key] = fold
        folds.by_key.move_to_end(fold.key)
        folds.dropped.discard(fold.key)
        evicted: list[str] = []
        while len(folds.by_key) > self.max_histories:
            evicted.append(folds.by_key.popitem(last=False)[0])
        await self._share(session, folds, fold, evicted)

    async def _share(
        self, session: str, folds: _SessionFolds, fold: _Carried | None, evicted: list[str]
    ) -> None:
        """Cluster mode: write ``fold`` and delete the dropped and ``evicted`` keys."""
        if self._shared is None:
            folds.dropped.clear()
            return
        drop = sorted(folds.dropped.union(evicted))
        put = {} if fold is None else {fold.key: fold.encode()}
        try:
            await self._shared.save(session, put, drop, _SHARED_TTL)
        except ClusterUnavailable:
            # Another node may then start the session over (one rejected round trip).
            log.debug("fold: shared session state unavailable; carried fold kept locally")
            return
        folds.dropped.clear()

    async def session_closed(self, session_id: str) -> None:
        """Forget the session's carried folds (and folds waiting for a commit) on this node.

        The shared copy (cluster mode) stays until its TTL: a node's drain closes
        its sessions too, and another node continues them.
        """
        self._sessions.pop(session_id, None)
        self._loaded.pop(session_id, None)
        for key in [key for key in self._pending if key[0] == session_id]:
            del self._pending[key]

    def session_state(self, session_id: str) -> Mapping[str, Scalar]:
        """The session's carried folds for ``GET /admin/sessions/{id}``.

        ``carried_folds`` (histories with one), ``carried_applied`` (requests
        folded before their first send), ``cut_moves``, and of the most recently
        used one: ``carried_cut`` (entry index), ``carried_level``,
        ``window_tokens`` and ``window_bytes`` (as learned; ``None`` if unknown).
        """
        folds = self._sessions.get(session_id)
        if folds is None:
            return {}
        state: dict[str, Scalar] = {
            "carried_folds": len(folds.by_key),
            "carried_applied": folds.applied,
            "cut_moves": folds.moves,
        }
        if folds.by_key:
            latest = next(reversed(folds.by_key.values()))
            state.update(
                carried_cut=latest.cut,
                carried_level=latest.level,
                window_tokens=latest.window_tokens,
                window_bytes=latest.window_bytes(),
            )
        return state

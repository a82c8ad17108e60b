"""Built-in ``fold`` plugin: after a context overflow, elide the oldest bulky content.

When the upstream rejects a request as too long for its context window, the proxy
refolds: it runs every ``prepare`` hook again at the next fold level and resends
(DESIGN section 1). This plugin turns the fold level into a smaller request while
keeping it valid for the protocol. Pure: no I/O and nothing from aiohttp.

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
never keeps more than a lower one. Because placeholders are recognized, folding
the already folded body of level ``L - 1`` at level ``L`` (a refold that
reuses the parsed body it changed, DESIGN section 2) gives the same body as folding the
original at level ``L``. If a step's turns yield no change after all (their
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
"""

from __future__ import annotations

import json
import logging
import re
import string
from collections.abc import Callable
from typing import Any, Final

from proxy.plugins import Plugin, PrepareContext
from proxy.protocols import Protocol
from proxy.wire import WireMetadata

__all__ = ["DEFAULT_PLACEHOLDER", "FoldPlugin"]

log = logging.getLogger("context_proxy.plugins.fold")

DEFAULT_PLACEHOLDER: Final = "[elided by context-proxy: {n} bytes]"

_CHAT: Final = Protocol.CHAT.value
_RESPONSES: Final = Protocol.RESPONSES.value
_FOLDABLE: Final = frozenset(
    p.value for p in (Protocol.CHAT, Protocol.RESPONSES, Protocol.MESSAGES, Protocol.COUNT_TOKENS)
)

_USER: Final = 0
_ASSISTANT: Final = 1
_SYSTEM: Final = 2
_SYSTEM_ROLES: Final = frozenset({"system", "developer"})
_CHAT_USER_ROLES: Final = frozenset({"user", "tool", "function"})

# Deeper structures are left alone rather than walked: no real request nests this
# far, and the bound keeps a hostile body from costing recursion.
_MAX_DEPTH: Final = 64
# Non-ASCII text is measured in slices so that sizing a huge string never makes a
# full UTF-8 copy of it.
_MEASURE_SLICE: Final = 1 << 16
# The widest {n} the placeholder must fit under min_bytes with (19 digits).
_LARGEST_N: Final = 10**18


def _utf8_len(text: str) -> int:
    """Size of ``text`` in UTF-8 bytes, with at most a 64 Ki-character transient copy."""
    if text.isascii():
        return len(text)
    return sum(
        len(text[i : i + _MEASURE_SLICE].encode("utf-8", "surrogatepass"))
        for i in range(0, len(text), _MEASURE_SLICE)
    )


def _weight(value: Any, depth: int = 0) -> int:
    """UTF-8 bytes of the string values inside ``value``: the text and data it carries.

    Keys, numbers and the values of ``type`` keys (structural tags such as
    ``"image"``) are not counted.
    """
    if isinstance(value, str):
        return _utf8_len(value)
    if depth >= _MAX_DEPTH:
        return 0
    if isinstance(value, dict):
        return sum(_weight(v, depth + 1) for k, v in value.items() if k != "type")
    if isinstance(value, list):
        return sum(_weight(v, depth + 1) for v in value)
    return 0


def _holds(value: Any, pattern: re.Pattern[str], depth: int = 0) -> bool:
    """Whether any string value inside ``value`` contains a match of ``pattern``."""
    if isinstance(value, str):
        return pattern.search(value) is not None
    if depth >= _MAX_DEPTH:
        return False
    if isinstance(value, dict):
        return any(_holds(v, pattern, depth + 1) for v in value.values())
    if isinstance(value, list):
        return any(_holds(v, pattern, depth + 1) for v in value)
    return False


def _placeholder_pattern(template: str) -> re.Pattern[str]:
    """A regex finding what ``template`` formats to, for any ``n``, raw or JSON-escaped.

    The JSON-escaped form is how a placeholder looks inside tool-call arguments,
    which are a JSON document held in a string.

    Raises:
        ValueError: the template is malformed, has a field other than a bare
            ``{n}``, or has no literal text besides it.
    """
    raw: list[str] = []
    escaped: list[str] = []
    literal_text = ""
    try:
        pieces = list(string.Formatter().parse(template))
    except ValueError as exc:
        raise ValueError(f"fold: placeholder is not a valid format string: {exc}") from None
    for literal, field, spec, conversion in pieces:
        literal_text += literal
        raw.append(re.escape(literal))
        escaped.append(re.escape(json.dumps(literal, ensure_ascii=False)[1:-1]))
        if field is None:
            continue
        if field != "n" or spec or conversion:
            raise ValueError(f"fold: placeholder may only use the field {{n}}, found {{{field}}}")
        raw.append(r"\d+")
        escaped.append(r"\d+")
    if not literal_text.strip():
        # Anthropic rejects empty text blocks, and a bare number could not be told
        # apart from real content on a refold.
        raise ValueError("fold: placeholder needs some text besides {n}")
    plain, in_json = "".join(raw), "".join(escaped)
    return re.compile(plain if plain == in_json else f"{plain}|{in_json}")


def _side(entry: Any, protocol: str) -> int:
    """Which side speaks ``entry``: ``_USER``, ``_ASSISTANT`` or ``_SYSTEM``."""
    if not isinstance(entry, dict):
        return _ASSISTANT
    role = entry.get("role")
    if role in _SYSTEM_ROLES:
        return _SYSTEM
    if role == "user" or (protocol == _CHAT and role in _CHAT_USER_ROLES):
        return _USER
    if protocol == _RESPONSES and role is None:
        kind = entry.get("type")
        if isinstance(kind, str) and kind.endswith("_output"):
            return _USER
    return _ASSISTANT


def _turns(entries: list[Any], protocol: str) -> list[tuple[int, list[int]]]:
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


class _Elider:
    """One pass over some entries: turns bulky pieces into placeholders, counting them.

    Every method works in place on the parsed body and returns whether it found
    (and, unless ``dry``, replaced) at least one bulky piece. A dry elider only
    looks: it tells which turns are bulky without changing anything.
    """

    __slots__ = ("_dry", "_min_bytes", "_placeholder", "elided_bytes", "pieces")

    def __init__(self, min_bytes: int, placeholder: str, *, dry: bool) -> None:
        self._min_bytes = min_bytes
        self._placeholder = placeholder
        self._dry = dry
        self.pieces = 0
        self.elided_bytes = 0

    def for_protocol(self, protocol: str) -> Callable[[dict[str, Any]], bool]:
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

    def _put(self, container: Any, key: Any, value: Any) -> bool:
        if not self._dry:
            container[key] = value
        return True

    # -- generic pieces ---------------------------------------------------------------

    def field(self, holder: dict[str, Any], key: str) -> bool:
        """A string field, replaced by the placeholder string."""
        value = holder.get(key)
        if not isinstance(value, str):
            return False
        n = _utf8_len(value)
        if n < self._min_bytes:
            return False
        return self._put(holder, key, self._spend(n))

    def unit(self, holder: dict[str, Any], key: str, text_type: str | None) -> bool:
        """A content value taken whole: a string, or (with ``text_type``) a list of parts."""
        value = holder.get(key)
        if isinstance(value, str):
            return self.field(holder, key)
        if text_type is None or not isinstance(value, list):
            return False
        n = _weight(value)
        if n < self._min_bytes:
            return False
        return self._put(holder, key, [{"type": text_type, "text": self._spend(n)}])

    def media(self, parts: list[Any], index: int, text_type: str) -> bool:
        """An image/audio/file part, replaced by a text part of type ``text_type``."""
        part = parts[index]
        n = _weight(part)
        if n < self._min_bytes:
            return False
        replacement: dict[str, Any] = {"type": text_type, "text": self._spend(n)}
        if "cache_control" in part:
            # Keeps the request's Anthropic cache breakpoints where the client put them.
            replacement["cache_control"] = part["cache_control"]
        return self._put(parts, index, replacement)

    def tree(self, node: Any, depth: int = 0) -> bool:
        """Every bulky string value inside a dict/list, keys and small values kept."""
        if depth >= _MAX_DEPTH:
            return False
        changed = False
        if isinstance(node, dict):
            for key, value in node.items():
                # Assigning an existing key does not resize the dict: iteration stays valid.
                if isinstance(value, str):
                    changed = self.field(node, key) or changed
                elif isinstance(value, dict | list):
                    changed = self.tree(value, depth + 1) or changed
        elif isinstance(node, list):
            for index, value in enumerate(node):
                if isinstance(value, str):
                    n = _utf8_len(value)
                    if n >= self._min_bytes:
                        changed = self._put(node, index, self._spend(n))
                elif isinstance(value, dict | list):
                    changed = self.tree(value, depth + 1) or changed
        return changed

    def arguments(self, holder: dict[str, Any], key: str) -> bool:
        """Tool-call arguments held as a JSON string (OpenAI chat and Responses).

        A dry pass counts any arguments of ``min_bytes`` or more as bulky without
        parsing them; the real pass may then find no bulky value inside.
        """
        raw = holder.get(key)
        if not isinstance(raw, str):
            return False
        n = _utf8_len(raw)
        if n < self._min_bytes:
            return False
        if self._dry:
            self._spend(n)
            return True
        try:
            parsed: Any = json.loads(raw)
        except (ValueError, RecursionError):
            return self.field(holder, key)
        if isinstance(parsed, str):
            inner = _utf8_len(parsed)
            if inner < self._min_bytes:
                return False
            parsed = self._spend(inner)
        elif not self.tree(parsed):
            return False
        # Compact separators: re-encoding must never grow what eliding shrank.
        text = json.dumps(parsed, ensure_ascii=False, separators=(",", ":"))
        try:
            text.encode("utf-8")
        except UnicodeEncodeError:
            # A lone surrogate (legal as a JSON escape) cannot travel as raw UTF-8.
            text = json.dumps(parsed, separators=(",", ":"))
        holder[key] = text
        return True

    # -- protocols --------------------------------------------------------------------

    def chat_message(self, message: dict[str, Any]) -> bool:
        """One OpenAI chat message (user, assistant, tool or legacy function)."""
        changed = False
        if message.get("role") in ("tool", "function"):
            changed = self.unit(message, "content", "text")
        else:
            content = message.get("content")
            if isinstance(content, str):
                changed = self.field(message, "content")
            elif isinstance(content, list):
                for index, part in enumerate(content):
                    if not isinstance(part, dict):
                        continue
                    kind = part.get("type")
                    if kind in ("text", "refusal"):
                        changed = self.field(part, kind) or changed
                    elif kind in ("image_url", "input_audio", "file"):
                        changed = self.media(content, index, "text") or changed
        calls = message.get("tool_calls")
        if isinstance(calls, list):
            for call in calls:
                function = call.get("function") if isinstance(call, dict) else None
                if isinstance(function, dict):
                    changed = self.arguments(function, "arguments") or changed
        legacy = message.get("function_call")
        if isinstance(legacy, dict):
            changed = self.arguments(legacy, "arguments") or changed
        return changed

    def anthropic_message(self, message: dict[str, Any]) -> bool:
        """One Anthropic message (user or assistant), string or list of content blocks."""
        content = message.get("content")
        if isinstance(content, str):
            return self.field(message, "content")
        if not isinstance(content, list):
            return False
        changed = False
        for index, block in enumerate(content):
            if not isinstance(block, dict):
                continue
            kind = block.get("type")
            if kind == "text":
                changed = self.field(block, "text") or changed
            elif kind == "image":
                changed = self.media(content, index, "text") or changed
            elif kind == "document":
                changed = self._document(block) or changed
            elif kind == "tool_result":
                changed = self.unit(block, "content", "text") or changed
            elif kind == "tool_use":
                changed = self.tree(block.get("input")) or changed
        return changed

    def _document(self, block: dict[str, Any]) -> bool:
        # A document stays a document (a citation may refer to it by index); only its
        # source becomes a short plain-text one.
        n = _weight(block.get("source"))
        if n < self._min_bytes:
            return False
        source = {"type": "text", "media_type": "text/plain", "data": self._spend(n)}
        return self._put(block, "source", source)

    def responses_item(self, item: dict[str, Any]) -> bool:
        """One OpenAI Responses input item (message, call or call output)."""
        kind = item.get("type")
        if kind is None and "role" in item:
            kind = "message"
        if kind == "message":
            content = item.get("content")
            if isinstance(content, str):
                return self.field(item, "content")
            if isinstance(content, list):
                return self._responses_parts(content)
            return False
        if kind == "function_call":
            return self.arguments(item, "arguments")
        if kind == "custom_tool_call":
            return self.field(item, "input")
        if kind in ("function_call_output", "custom_tool_call_output"):
            return self.unit(item, "output", "input_text")
        if kind == "local_shell_call_output":
            return self.field(item, "output")
        return False

    def _responses_parts(self, parts: list[Any]) -> bool:
        changed = False
        for index, part in enumerate(parts):
            if not isinstance(part, dict):
                continue
            kind = part.get("type")
            if kind in ("input_text", "output_text"):
                if self.field(part, "text"):
                    changed = True
                    if part.get("annotations") and not self._dry:
                        part["annotations"] = []
            elif kind == "refusal":
                changed = self.field(part, "refusal") or changed
            elif kind in ("input_image", "input_audio", "input_file"):
                changed = self.media(parts, index, "input_text") or changed
        return changed


def _check_int(name: str, value: object, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"fold: {name} must be an integer, got {type(value).__name__}")
    if value < minimum:
        raise ValueError(f"fold: {name} must be >= {minimum}, got {value}")
    return value


class FoldPlugin(Plugin):
    """Elide ever more of the oldest bulky content at each fold level (see the module doc).

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

    Raises:
        TypeError: an option has the wrong type, or is unknown.
        ValueError: an option is out of range, or the placeholder is malformed,
            blank, uses a field other than ``{n}``, or is not shorter than
            ``min_bytes``.
    """

    name = "fold"

    def __init__(
        self,
        *,
        keep_last: int = 4,
        min_bytes: int = 2048,
        placeholder: str = DEFAULT_PLACEHOLDER,
        levels_per_stage: int = 2,
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

    @property
    def max_level(self) -> int:
        """The highest fold level that can still elide more; higher ones act like it."""
        return 2 * self.levels_per_stage

    def wants_body(self, meta: WireMetadata, fold_level: int) -> bool:
        """True at fold level >= 1 for chat, Responses, Anthropic messages and count_tokens.

        At level 0, and for a request of at most one entry (nothing but its
        protected end), the body is never parsed on this plugin's account.
        """
        return fold_level > 0 and meta.protocol in _FOLDABLE and meta.message_count > 1

    async def prepare(self, ctx: PrepareContext) -> bool:
        """Fold ``ctx.body`` in place at ``ctx.fold_level``; see :meth:`fold`.

        Returns False without touching ``ctx.body`` where :meth:`wants_body` said no
        (the host still calls ``prepare`` then, with the body withheld).
        """
        if not self.wants_body(ctx.meta, ctx.fold_level):
            return False
        return self.fold(ctx.body, protocol=ctx.meta.protocol, level=ctx.fold_level)

    def fold(self, body: dict[str, Any], *, protocol: str, level: int) -> bool:
        """Elide the bulky pieces that fold level ``level`` selects, in place.

        ``body`` is the parsed request (JSON object); ``protocol`` a
        :class:`proxy.protocols.Protocol` value. Called again on a body it
        already folded at ``level - 1`` it elides only what the new level adds.
        If the selected turns yield no change after all (large arguments without
        a large value, a quoted placeholder), the next steps of the schedule are
        tried, so ``True`` always means the body shrank. Never raises on an
        unexpected shape: what it does not recognize it leaves alone.

        Returns:
            True iff the body changed; False at level <= 0, for other protocols,
            and when nothing foldable is left (the proxy then hands the
            upstream's overflow error to the client).
        """
        if level <= 0 or protocol not in _FOLDABLE or not isinstance(body, dict):
            return False
        entries = body.get("input" if protocol == _RESPONSES else "messages")
        if not isinstance(entries, list):
            return False
        turns = _turns(entries, protocol)
        protected = max(
            (i for i, (side, _) in enumerate(turns) if side == _USER), default=len(turns) - 1
        )
        if protected <= 0:
            return False
        tail_start = min(protected, max(0, len(turns) - self.keep_last))

        probe = _Elider(self.min_bytes, self.placeholder, dry=True).for_protocol(protocol)

        def bulky(indices: list[int]) -> bool:
            for index in indices:
                entry = entries[index]
                if isinstance(entry, dict) and (probe(entry) or _holds(entry, self._pattern)):
                    return True
            return False

        head = [indices for _, indices in turns[:tail_start] if bulky(indices)]
        tail = [indices for _, indices in turns[tail_start:protected] if bulky(indices)]
        steps = self._schedule(len(head), len(tail))
        if not steps:
            return False

        elider = _Elider(self.min_bytes, self.placeholder, dry=False)
        fold_entry = elider.for_protocol(protocol)
        head_done = tail_done = applied = 0
        for step in range(min(level, len(steps)), len(steps) + 1):
            head_want, tail_want = steps[step - 1]
            for indices in head[head_done:head_want] + tail[tail_done:tail_want]:
                for index in indices:
                    entry = entries[index]
                    if isinstance(entry, dict):
                        fold_entry(entry)
            head_done, tail_done, applied = head_want, tail_want, step
            if elider.pieces:
                break
        if elider.pieces:
            log.debug(
                "fold level %d (step %d of %d): elided %d pieces, %d bytes",
                level,
                applied,
                len(steps),
                elider.pieces,
                elider.elided_bytes,
            )
        return elider.pieces > 0

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

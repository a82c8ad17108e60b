"""Scripts of the local upstream emulator: what one emulated answer does (pure).

A :class:`Script` is parsed from the ``x-emulator`` request header (syntax and
every key: :mod:`proxy._emulator`). No I/O; like the rest of the emulator it
imports nothing from ``proxy._protocols`` or ``proxy._sse``.
"""

from __future__ import annotations

import dataclasses
import math
import re
from collections.abc import Iterator
from dataclasses import dataclass, fields
from typing import Any, Final, Literal
from urllib.parse import quote, unquote

__all__ = [
    "DEFAULT_CHUNKS",
    "DEFAULT_MODEL",
    "DEFAULT_TEXT",
    "SPLIT_UTF8_TEXT",
    "Delta",
    "Script",
    "ScriptError",
    "iter_deltas",
    "parse_script",
    "script_help",
    "window_script",
]

DEFAULT_TEXT: Final = "Hello from the emulator."
DEFAULT_CHUNKS: Final = 3
DEFAULT_MODEL: Final = "emulator-1"
_HOLD_KEY_RE: Final = re.compile(r"[A-Za-z0-9._~-]{1,128}")
_TRUE: Final = frozenset({"1", "true", "yes", "on"})
_FALSE: Final = frozenset({"0", "false", "no", "off"})
#: The extra delta of ``split_utf8``: its euro sign is written split inside its bytes.
SPLIT_UTF8_TEXT: Final = " \u20ac"
_FILLER_BLOCK_CHARS: Final = 64 * 1024  # characters of filler made at a time
# A 64-character unit, so 64 KiB filler pieces continue the pattern without a seam.
_FILLER_UNIT: Final = "0123456789abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ-_"
_FILLER_BLOCK: Final = _FILLER_UNIT * (_FILLER_BLOCK_CHARS // len(_FILLER_UNIT))


# --------------------------------------------------------------------------- scripts


class ScriptError(ValueError):
    """An ``x-emulator`` header or a :class:`Script` field is invalid (message says which)."""


_Kind = Literal["int", "float", "bool", "str", "text"]

# (key, kind, value form, description): one table drives parsing and script_help().
_KEYS: Final[tuple[tuple[str, _Kind, str, str], ...]] = (
    ("chunks", "int", "N", "number of text deltas (default 3)"),
    ("delay", "float", "S", "seconds before every text delta after the first"),
    ("text", "text", "TEXT", "answer text, percent-decoded UTF-8 (`;` as `%3B`)"),
    ("status", "int", "CODE", "error answer of that status (400-599) in the protocol's shape"),
    ("plain", "bool", "1", "errors as `text/plain` (vLLM/sglang style)"),
    ("retry_after", "int", "S", "`Retry-After` header on a `status` error"),
    ("overflow_above", "int", "BYTES", "body larger than BYTES: the real context-overflow error"),
    ("context", "int", "TOKENS", "maximum stated in overflow messages (128000 / 200000)"),
    ("stall_headers", "float", "S", "sleep before sending the response headers"),
    ("stall_after", "int", "N", "pause point for `stall`/`hold`, in events (default 1)"),
    ("stall", "float", "S", "sleep at the pause point, then continue"),
    ("hold", "str", "KEY", "wait at the pause point for `POST /_emulator/release/KEY`"),
    ("cut_after", "int", "N", "abort the connection after N events (no terminal event)"),
    ("long_line", "int", "BYTES", "extra delta of BYTES characters: one huge `data:` line"),
    ("split_utf8", "bool", "1", "extra delta `' €'` written split inside the `€` bytes"),
    ("crlf", "bool", "1", "CRLF line endings"),
    ("comments", "bool", "1", "`: keep-alive` comment before every event"),
    ("ping", "bool", "1", "ping after every delta (`event: ping` or `: ping` comment)"),
    ("unknown_event", "bool", "1", "extra `event: emulator.unknown` after the first delta"),
    ("gzip", "bool", "1", "gzip the response body (`Content-Encoding: gzip`)"),
    ("empty", "bool", "1", "well-formed answer with no content (fake completion)"),
    ("empty_times", "int", "K", "empty only for the first K requests per `x-emulator-key`"),
    ("usage", "bool", "1", "chat streams always end with the usage chunk"),
    ("cache_read", "int", "N", "cache-read input tokens reported in usage"),
    ("prompt_cache", "bool", "1", "cached tokens = prefix shared with a request of the last 5 min"),
)
_KEY_KINDS: Final[dict[str, _Kind]] = {key: kind for key, kind, _, _ in _KEYS}


def _require(condition: bool, message: str) -> None:
    if not condition:
        raise ScriptError(message)


@dataclass(frozen=True, slots=True)
class Script:
    """What one emulated answer does; every field is an ``x-emulator`` key of the same name.

    Units: ``delay``, ``stall``, ``stall_headers`` in seconds (float, 0-3600);
    ``overflow_above``, ``long_line`` in bytes; ``retry_after`` in whole seconds;
    ``context``, ``cache_read`` in tokens; ``stall_after``, ``cut_after`` in events.
    The module docstring documents each key. Raises :class:`ScriptError` on an
    invalid combination or value.
    """

    chunks: int = DEFAULT_CHUNKS
    delay: float = 0.0
    text: str = DEFAULT_TEXT
    status: int | None = None
    plain: bool = False
    retry_after: int | None = None
    overflow_above: int | None = None
    context: int | None = None
    stall_headers: float = 0.0
    stall_after: int | None = None
    stall: float = 0.0
    hold: str | None = None
    cut_after: int | None = None
    long_line: int | None = None
    split_utf8: bool = False
    crlf: bool = False
    comments: bool = False
    ping: bool = False
    unknown_event: bool = False
    gzip: bool = False
    empty: bool = False
    empty_times: int | None = None
    usage: bool = False
    cache_read: int = 0
    prompt_cache: bool = False

    def __post_init__(self) -> None:
        _require(1 <= self.chunks <= 1_000_000, "chunks must be 1..1000000")
        for name in ("delay", "stall", "stall_headers"):
            value = getattr(self, name)
            _require(math.isfinite(value) and 0 <= value <= 3600, f"{name} must be 0..3600 s")
        _require(self.text != "", "text must not be empty")
        _require(self.status is None or 400 <= self.status <= 599, "status must be 400..599")
        for name in ("retry_after", "overflow_above", "stall_after", "cut_after", "empty_times"):
            value = getattr(self, name)
            _require(value is None or value >= 0, f"{name} must be >= 0")
        _require(self.context is None or self.context >= 1, "context must be >= 1")
        _require(self.cache_read >= 0, "cache_read must be >= 0")
        _require(
            not (self.prompt_cache and self.cache_read),
            "prompt_cache and cache_read exclude each other",
        )
        _require(
            self.long_line is None or 1 <= self.long_line <= 1 << 31, "long_line must be 1..2^31"
        )
        _require(
            self.hold is None or _HOLD_KEY_RE.fullmatch(self.hold) is not None,
            "hold must be 1-128 characters of A-Z a-z 0-9 . _ ~ -",
        )
        _require(
            self.stall_after is None or self.stall > 0 or self.hold is not None,
            "stall_after needs stall or hold",
        )

    @property
    def pause_point(self) -> int:
        """Event count (int) after which ``stall`` and ``hold`` apply: ``stall_after`` or 1."""
        return 1 if self.stall_after is None else self.stall_after

    def delta_count(self) -> int:
        """Number of text deltas a non-empty answer emits (= its ``output_tokens``)."""
        return self.chunks + (self.long_line is not None) + self.split_utf8

    def expected_text(self) -> str:
        """The full answer text a client reassembles from a non-empty answer (str).

        Materializes the ``long_line`` filler; meant for tests.
        """
        return "".join(piece for delta in iter_deltas(self) for piece in delta.pieces())

    def to_header(self) -> str:
        """This script as an ``x-emulator`` header value (fields that differ from defaults)."""
        items: list[str] = []
        for f in fields(self):
            value = getattr(self, f.name)
            if value == f.default:
                continue
            if isinstance(value, bool):
                rendered = "1" if value else "0"
            elif f.name == "text":
                rendered = quote(value, safe="")
            else:
                rendered = str(value)
            items.append(f"{f.name}={rendered}")
        return "; ".join(items)


def _convert(key: str, kind: _Kind, value: str, has_value: bool) -> Any:
    if kind == "bool":
        lowered = value.lower()
        if not has_value or lowered in _TRUE:
            return True
        if lowered in _FALSE:
            return False
        raise ScriptError(f"{key} must be a boolean (1/0), got {value!r}")
    if not has_value:
        raise ScriptError(f"{key} needs a value ({key}=...)")
    if kind == "int":
        try:
            return int(value)
        except ValueError:
            raise ScriptError(f"{key} must be an integer, got {value!r}") from None
    if kind == "float":
        try:
            return float(value)
        except ValueError:
            raise ScriptError(f"{key} must be a number of seconds, got {value!r}") from None
    if kind == "text":
        try:
            return unquote(value, errors="strict")
        except UnicodeDecodeError:
            raise ScriptError(f"{key} is not valid percent-encoded UTF-8") from None
    return value


def parse_script(header: str, *, base: Script | None = None) -> Script:
    """Parse an ``x-emulator`` header value (``key=value; key=value``) into a :class:`Script`.

    Keys not given keep their value from ``base`` (default: :class:`Script` defaults).
    Raises :class:`ScriptError` for an unknown or repeated key or an invalid value.
    """
    values: dict[str, Any] = {}
    for raw in header.split(";"):
        item = raw.strip()
        if not item:
            continue
        key, sep, value = item.partition("=")
        key = key.strip().lower()
        kind = _KEY_KINDS.get(key)
        if kind is None:
            raise ScriptError(f"unknown x-emulator key {key!r}")
        if key in values:
            raise ScriptError(f"x-emulator key {key!r} given twice")
        values[key] = _convert(key, kind, value.strip(), bool(sep))
    return dataclasses.replace(base if base is not None else Script(), **values)


def script_help() -> str:
    """A markdown table of every ``x-emulator`` key (key, value, effect), for the README."""
    lines = ["| key | value | effect |", "|---|---|---|"]
    lines.extend(f"| `{key}` | {form} | {text} |" for key, _, form, text in _KEYS)
    return "\n".join(lines) + "\n"


# --------------------------------------------------------------------------- answer text


@dataclass(frozen=True, slots=True)
class Delta:
    """One text delta: literal ``text``, or ``filler`` ASCII characters made on demand."""

    text: str
    filler: int = 0
    split: bool = False

    def pieces(self) -> Iterator[str]:
        """The delta's text: literal text whole, filler in pieces of at most 64 Ki characters."""
        if not self.filler:
            yield self.text
            return
        left = self.filler
        while left > 0:
            size = min(left, len(_FILLER_BLOCK))
            yield _FILLER_BLOCK[:size]
            left -= size


def _split_text(text: str, count: int) -> Iterator[str]:
    if count > len(text):
        text = text * -(-count // len(text))
    length = len(text)
    for index in range(count):
        yield text[index * length // count : (index + 1) * length // count]


def iter_deltas(script: Script) -> Iterator[Delta]:
    """The text deltas ``script`` asks for: its text in ``chunks`` pieces, then extras."""
    for index, piece in enumerate(_split_text(script.text, script.chunks)):
        yield Delta(piece)
        if index == 0 and script.long_line is not None:
            yield Delta("", filler=script.long_line)
    if script.split_utf8:
        yield Delta(SPLIT_UTF8_TEXT, split=True)


def window_script(tokens: int, *, prompt_cache: bool = False) -> Script:
    """The script of an emulator whose context window is ``tokens`` tokens.

    The emulator counts a prompt as body bytes // 4 tokens, so a body of more than
    ``4 * tokens + 3`` bytes is over the window: it gets the protocol's overflow
    error stating ``tokens`` as the maximum (``emulate --context-window-tokens``).
    ``prompt_cache``: the emulator also reports cached tokens (``--prompt-cache``).

    Raises:
        ScriptError: ``tokens`` is below 1.
    """
    _require(tokens >= 1, "context window must be >= 1 token")
    return Script(overflow_above=4 * tokens + 3, context=tokens, prompt_cache=prompt_cache)

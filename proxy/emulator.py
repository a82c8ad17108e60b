"""Local upstream emulator: a real aiohttp server that speaks the three upstream LLM APIs.

It is the *upstream* in every integration test and benchmark, so it answers in the
real wire shapes (checked by driving it with the installed ``openai`` and
``anthropic`` SDKs) and is scriptable per request. It deliberately imports nothing
from ``proxy.protocols`` or ``proxy.sse``: it is an independent implementation of
what the upstream APIs do, so our tests cannot agree with our own bugs.

Routes
------
``POST /v1/chat/completions`` (OpenAI chat), ``POST /v1/responses`` (OpenAI
Responses), ``POST /v1/messages`` with any query string such as ``?beta=true``
(Anthropic), ``POST /v1/messages/count_tokens`` (answers ``{"input_tokens": N}``),
``GET /v1/models`` (the OpenAI list shape, or the Anthropic one when the request
carries ``anthropic-version``), ``GET``/``HEAD /`` (a plain ``ok`` for connectivity
probes). Control routes, not recorded in the stats: ``GET /_emulator/stats``,
``POST /_emulator/reset``, ``POST /_emulator/release/{key}``.

Request bodies
--------------
Read by streaming ``request.content`` (never aiohttp's ``Request.read()``, which would cache
a copy), counting bytes and hashing them (xxh3_128, hex) as they come. Counts and
digest are of the bytes after aiohttp's transparent ``Content-Encoding`` decoding.
A body of at most :data:`PARSE_LIMIT` bytes is decoded with msgspec into the three
fields the emulator needs (``model``, ``stream``, ``stream_options.include_usage``),
so no full object tree is built; a malformed one gets a 400 in the protocol's
shape. A larger body is never held: only its first and last :data:`SCAN_BYTES`
bytes are kept and scanned for those fields (``"stream": true`` sits at either end
in what real clients send).

Usage figures
-------------
Deterministic: ``input_tokens`` = request body bytes // 4 (also what
``count_tokens`` answers); ``output_tokens`` = number of text deltas emitted;
cache-read tokens = the ``cache_read`` key. OpenAI chat ``prompt_tokens`` and
Responses ``input_tokens`` carry the same figure, with the cache read in
``*_tokens_details.cached_tokens``; Anthropic carries it in
``cache_read_input_tokens``. Anthropic's ``message_start`` says
``output_tokens: 1`` as the real API does; the final figure is in ``message_delta``.

The answer text (default ``"Hello from the emulator."``) is split into ``chunks``
character ranges (repeated first when ``chunks`` exceeds its length, so every delta
carries text). :meth:`Script.expected_text` returns exactly what a client should
reassemble.

Script keys
-----------
Per request, header ``x-emulator: key=value; key=value`` (a bare boolean key means
``=1``; booleans accept 1/0/true/false/yes/no/on/off). Header keys override the
app's ``default_script``. An unknown key, a repeated key or a bad value is
answered with 400 in the protocol's error shape.

- ``chunks=N``: number of text deltas (default 3, 1 to 1,000,000).
- ``delay=S``: seconds slept before every text delta after the first.
- ``text=...``: the answer text, percent-decoded as UTF-8 (write ``;`` as ``%3B``).
- ``status=CODE`` (400-599): answer with an error of that status in the protocol's
  real error shape, before any stream.
- ``plain=1``: errors (``status``, ``overflow_above``) get a ``text/plain`` body,
  as vLLM and sglang send.
- ``retry_after=S``: integer seconds put in a ``Retry-After`` header of a
  ``status`` error.
- ``overflow_above=BYTES``: a request body larger than this gets the protocol's
  real context-overflow error. OpenAI chat: 400 ``{"error": {"message": "This
  model's maximum context length is 128000 tokens. However, your messages resulted
  in N tokens. ...", "type": "invalid_request_error", "param": "messages", "code":
  "context_length_exceeded"}}``. Anthropic: 400 ``invalid_request_error`` "prompt
  is too long: N tokens > 200000 maximum". Responses, streaming: 200 SSE with
  ``response.created``, ``response.in_progress``, then ``response.failed`` whose
  ``response.error.code`` is ``context_length_exceeded``; not streaming: the
  OpenAI 400 with ``param`` ``input``. With ``plain=1``: vLLM's plain-text 400.
  N is body bytes // 4 (it can be below the stated maximum for small bodies).
- ``context=TOKENS``: the maximum stated in overflow messages (default 128000 for
  OpenAI and the plain form, 200000 for Anthropic).
- ``stall_headers=S``: sleep S seconds before sending response headers.
- ``stall_after=N``: the *pause point*, counted in events (default 1); needs
  ``stall`` or ``hold``. 0 means right after the headers.
- ``stall=S``: sleep S seconds at the pause point, then continue.
- ``hold=KEY``: at the pause point, wait until ``POST /_emulator/release/KEY`` (or
  :meth:`EmulatorServer.release`), a reset, or the emulator closes; then finish.
  Releases latch: a release that comes first lets the hold pass at once.
- ``cut_after=N``: after N events, abort the connection: no terminal event, the
  client sees a truncated chunked body (0 = right after the headers).
- ``long_line=BYTES``: one extra text delta, right after the first, whose text is
  BYTES ASCII characters, so its ``data:`` line is BYTES plus the event's envelope
  (a few hundred bytes). Written in 64 KiB pieces; never built as one string.
- ``split_utf8=1``: one extra, final text delta ``" \u20ac"``; its event is written
  in two writes split inside the euro sign's UTF-8 bytes, with a drain and a 50 ms
  pause between, so a reader receives the character split across two chunks.
- ``crlf=1``: CRLF line endings on every SSE line.
- ``comments=1``: a ``: keep-alive`` comment before every SSE event.
- ``ping=1``: after every text delta, ``event: ping`` (Anthropic) or a ``: ping``
  comment (OpenAI protocols). Anthropic streams always carry the one real ping
  after ``content_block_start``.
- ``unknown_event=1``: an extra ``event: emulator.unknown`` event after the first
  text delta (after the first event when there is none).
- ``gzip=1``: gzip the response body (``Content-Encoding: gzip``); streams are
  sync-flushed after every write, so events still arrive one by one.
- ``empty=1``: a well-formed answer with no content at all (no text delta, no
  content block, no output item; ``output_tokens`` 0): the fake-completion case.
- ``empty_times=K``: empty only for the first K requests carrying the same
  ``x-emulator-key`` header value (so a retry succeeds); overrides ``empty``.
  Requests without that header share one counter; a reset clears the counters.
- ``usage=1``: OpenAI chat streams always end with the usage chunk (empty
  ``choices``), as ``stream_options.include_usage`` asks.
- ``cache_read=N``: cache-read input tokens reported in usage.

An *event* is one SSE event (comments are not events; ``data: [DONE]`` and pings
are). A non-streaming JSON answer is written as two events: everything before the
answer text, then the rest, so ``hold``, ``stall`` and ``cut_after`` also work on
it. Errors are written in one piece and are not paced.

Instrumentation
---------------
:attr:`EmulatorServer.stats` and ``GET /_emulator/stats`` list one
:class:`RequestRecord` per request (the latest :data:`MAX_RECORDS`): body size and
digest, selected headers with credentials redacted to their first 7 characters,
and the answer's progress (``received``, ``headers_sent``, ``events_sent``,
``bytes_sent``, ``sent_digest`` of the answer bytes, ``finished``, ``aborted_by_peer``,
``cut_by_emulator``, ``closed_at``). The
AppRunner runs with ``handler_cancellation=True``, so a client that hangs up
cancels the handler at once and the record says ``aborted_by_peer``. Every answer
carries an ``x-emulator-request-id`` header with the record's id. In-process
tests wait on records with :meth:`EmulatorServer.wait_received`,
:meth:`~EmulatorServer.wait_headers_sent`, :meth:`~EmulatorServer.wait_events`,
:meth:`~EmulatorServer.wait_holding`, :meth:`~EmulatorServer.wait_aborted` and
:meth:`~EmulatorServer.wait_closed`.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import math
import re
import signal
import time
import zlib
from collections.abc import Awaitable, Callable, Iterable, Iterator
from dataclasses import dataclass, field, fields
from http import HTTPStatus
from typing import Any, Final, Literal
from urllib.parse import quote, unquote

import msgspec
import xxhash
from aiohttp import web

__all__ = [
    "DEFAULT_CHUNKS",
    "DEFAULT_MODEL",
    "DEFAULT_TEXT",
    "MAX_RECORDS",
    "PARSE_LIMIT",
    "SCAN_BYTES",
    "SCRIPT_HEADER",
    "SCRIPT_KEY_HEADER",
    "STATE_KEY",
    "EmulatorServer",
    "EmulatorState",
    "EmulatorWaitError",
    "RequestRecord",
    "Script",
    "ScriptError",
    "build_emulator_app",
    "parse_script",
    "run_emulator",
    "script_help",
    "start_emulator",
]

DEFAULT_TEXT: Final = "Hello from the emulator."
DEFAULT_CHUNKS: Final = 3
DEFAULT_MODEL: Final = "emulator-1"
#: Bodies up to this size (bytes) are decoded; larger ones are only scanned at both ends.
PARSE_LIMIT: Final = 8 * 1024 * 1024
#: Bytes kept from each end of a body too large to decode.
SCAN_BYTES: Final = 16 * 1024
#: Records kept in the stats; older ones are dropped so a long benchmark stays small.
MAX_RECORDS: Final = 10_000

SCRIPT_HEADER: Final = "x-emulator"
SCRIPT_KEY_HEADER: Final = "x-emulator-key"

_SPLIT_UTF8_TEXT: Final = " \u20ac"
_SPLIT_PAUSE: Final = 0.05  # seconds between the two halves of a split character
_WRITE_CHUNK: Final = 64 * 1024
_OPENAI_CONTEXT: Final = 128_000
_ANTHROPIC_CONTEXT: Final = 200_000
_SHUTDOWN_TIMEOUT: Final = 2.0  # seconds aiohttp waits for handlers once holds are released
# A 64-character unit, so 64 KiB filler pieces continue the pattern without a seam.
_FILLER_UNIT: Final = "0123456789abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ-_"
_FILLER_BLOCK: Final = _FILLER_UNIT * (_WRITE_CHUNK // len(_FILLER_UNIT))
# Stands where streamed text goes in a serialized payload; a private-use character
# so json.dumps(ensure_ascii=False) keeps it verbatim.
_SLOT: Final = "\ue000emulator-text\ue000"
_SLOT_BYTES: Final = _SLOT.encode()
_HOLD_KEY_RE: Final = re.compile(r"[A-Za-z0-9._~-]{1,128}")
_REDACTED_HEADERS: Final = ("authorization", "x-api-key")
_RECORDED_HEADERS: Final = (
    "authorization",
    "x-api-key",
    "anthropic-version",
    "anthropic-beta",
    "session-id",
    "x-claude-code-session-id",
    "x-session-id",
    "content-type",
    "accept-encoding",
    "user-agent",
    SCRIPT_HEADER,
    SCRIPT_KEY_HEADER,
)
_TRUE: Final = frozenset({"1", "true", "yes", "on"})
_FALSE: Final = frozenset({"0", "false", "no", "off"})


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
        return "".join(piece for delta in _iter_deltas(self) for piece in delta.pieces())

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
class _Delta:
    """One text delta: literal ``text``, or ``filler`` ASCII characters made on demand."""

    text: str
    filler: int = 0
    split: bool = False

    def pieces(self) -> Iterator[str]:
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


def _iter_deltas(script: Script) -> Iterator[_Delta]:
    for index, piece in enumerate(_split_text(script.text, script.chunks)):
        yield _Delta(piece)
        if index == 0 and script.long_line is not None:
            yield _Delta("", filler=script.long_line)
    if script.split_utf8:
        yield _Delta(_SPLIT_UTF8_TEXT, split=True)


def _escape(piece: str) -> bytes:
    """JSON string-body escaping of one piece; escaping is per character, so pieces concatenate."""
    return json.dumps(piece, ensure_ascii=False)[1:-1].encode()


def _dumps(payload: Any) -> bytes:
    return json.dumps(payload, ensure_ascii=False, separators=(",", ":")).encode()


# --------------------------------------------------------------------------- frames


@dataclass(frozen=True, slots=True)
class _Text:
    """Streamed JSON string content: ``source()`` yields raw text pieces to escape and write."""

    source: Callable[[], Iterator[str]]


_Part = bytes | _Text


@dataclass(frozen=True, slots=True)
class _Frame:
    """One write unit: an SSE event (``counted``), a comment, or half of a JSON body."""

    parts: tuple[_Part, ...]
    counted: bool = True
    delta: bool = False
    split_utf8: bool = False


def _frame_from(
    prefix: bytes, data: bytes, suffix: bytes, text: _Text | None, **flags: bool
) -> _Frame:
    if text is None:
        return _Frame((prefix + data + suffix,), **flags)
    before, after = data.split(_SLOT_BYTES, 1)
    return _Frame((prefix + before, text, after + suffix), **flags)


class _SSE:
    """Builds SSE frames with the script's line ending."""

    __slots__ = ("_nl",)

    def __init__(self, crlf: bool) -> None:
        self._nl = b"\r\n" if crlf else b"\n"

    def event(
        self,
        name: str | None,
        payload: dict[str, Any],
        *,
        text: _Text | None = None,
        delta: bool = False,
        split: bool = False,
    ) -> _Frame:
        nl = self._nl
        head = b"event: " + name.encode() + nl if name else b""
        return _frame_from(
            head + b"data: ", _dumps(payload), nl + nl, text, delta=delta, split_utf8=split
        )

    def done(self) -> _Frame:
        return _Frame((b"data: [DONE]" + self._nl + self._nl,))

    def comment(self, text: str) -> _Frame:
        return _Frame((b": " + text.encode() + self._nl + self._nl,), counted=False)


def _json_frames(payload: dict[str, Any], text: _Text | None) -> list[_Frame]:
    """A JSON body as two counted frames: before the answer text, and the rest."""
    data = _dumps(payload)
    if text is not None and _SLOT_BYTES in data:
        before, after = data.split(_SLOT_BYTES, 1)
        return [_Frame((before,)), _Frame((text, after))]
    middle = len(data) // 2
    return [_Frame((data[:middle],)), _Frame((data[middle:],))]


def _frames_length(frames: Iterable[_Frame]) -> int:
    total = 0
    for frame in frames:
        for part in frame.parts:
            if isinstance(part, bytes):
                total += len(part)
            else:
                total += sum(len(_escape(piece)) for piece in part.source())
    return total


# --------------------------------------------------------------------------- records


@dataclass(slots=True, eq=False)
class RequestRecord:
    """What the emulator saw and did for one request; live, updated as the answer proceeds.

    ``id`` counts from 1 (restarts on reset). Times are ``time.monotonic()`` seconds.
    ``body_bytes`` and ``body_digest`` (xxh3_128 hex, None until the body is read)
    are of the body after Content-Encoding decoding. ``headers`` holds selected
    request headers, ``authorization`` and ``x-api-key`` cut to 7 characters + "…".
    ``aborted_by_peer``: the client closed the connection before the answer ended;
    ``cut_by_emulator``: ``cut_after`` aborted it. ``bytes_sent`` counts response body
    bytes on the wire (after gzip); ``sent_digest`` (xxh3_128 hex) is of the body bytes
    written before gzip, i.e. what a decoding client reads, set once the answer ends.
    """

    id: int
    method: str
    path: str
    query: str
    content_length: int | None
    content_encoding: str | None
    chunked: bool
    headers: dict[str, str]
    started_at: float
    script: str | None = None
    body_bytes: int = 0
    body_digest: str | None = None
    model: str | None = None
    stream: bool | None = None
    received: bool = False
    status: int | None = None
    headers_sent: bool = False
    headers_sent_at: float | None = None
    events_sent: int = 0
    bytes_sent: int = 0
    sent_digest: str | None = None
    holding: str | None = None
    finished: bool = False
    aborted_by_peer: bool = False
    cut_by_emulator: bool = False
    closed_at: float | None = None

    @property
    def closed(self) -> bool:
        """True once the handler has ended, whatever the outcome."""
        return self.closed_at is not None

    def to_json(self) -> dict[str, Any]:
        """The record as a JSON-ready dict (field name → value)."""
        return {f.name: getattr(self, f.name) for f in fields(self)}


def _redact(value: str) -> str:
    return value[:7] + "\u2026"


class EmulatorWaitError(RuntimeError):
    """A waited-for request ended without reaching the awaited state (it never will)."""


class EmulatorState:
    """Shared state of one emulator app: records, hold latches, empty counters, closing flag.

    Lives on the app under :data:`STATE_KEY`; :class:`EmulatorServer` exposes it to
    in-process tests. All methods run on the server's event loop.
    """

    __slots__ = (
        "_changed",
        "_closing",
        "_empty_counts",
        "_holds",
        "_next_id",
        "_records",
        "_waiters",
        "default_script",
    )

    def __init__(self, default_script: Script | None = None) -> None:
        self.default_script = default_script if default_script is not None else Script()
        self._records: dict[int, RequestRecord] = {}
        self._next_id = 1
        self._changed = asyncio.Event()
        self._waiters = 0
        self._holds: dict[str, asyncio.Event] = {}
        self._empty_counts: dict[str, int] = {}
        self._closing = asyncio.Event()

    @property
    def closing(self) -> bool:
        """True once :meth:`begin_close` ran: sleeps and holds end at once."""
        return self._closing.is_set()

    @property
    def records(self) -> list[RequestRecord]:
        """The kept records, oldest first (a new list of the live records)."""
        return list(self._records.values())

    def record(self, request_id: int) -> RequestRecord:
        """The record with this id; raises ``KeyError`` if unknown or already dropped."""
        return self._records[request_id]

    def open_record(self, request: web.BaseRequest) -> RequestRecord:
        """Create and keep the record of a request that just arrived."""
        headers: dict[str, str] = {}
        for name in _RECORDED_HEADERS:
            value = request.headers.get(name)
            if value is not None:
                headers[name] = _redact(value) if name in _REDACTED_HEADERS else value
        length = request.headers.get("Content-Length")
        record = RequestRecord(
            id=self._next_id,
            method=request.method,
            path=request.path,
            query=request.query_string,
            content_length=int(length) if length is not None and length.isdigit() else None,
            content_encoding=request.headers.get("Content-Encoding"),
            chunked="chunked" in request.headers.get("Transfer-Encoding", "").lower(),
            headers=headers,
            started_at=time.monotonic(),
            script=request.headers.get(SCRIPT_HEADER),
        )
        self._next_id += 1
        self._records[record.id] = record
        while len(self._records) > MAX_RECORDS:
            del self._records[next(iter(self._records))]
        self.notify()
        return record

    def notify(self) -> None:
        """Wake every waiter to re-check its condition (cheap when nobody waits)."""
        if self._waiters:
            self._changed.set()
            self._changed = asyncio.Event()

    async def wait_for(
        self,
        request_id: int,
        done: Callable[[RequestRecord], bool],
        what: str,
        within: float,
    ) -> RequestRecord:
        """Wait up to ``within`` seconds until record ``request_id`` satisfies ``done``.

        Raises ``TimeoutError`` when the deadline passes and
        :class:`EmulatorWaitError` as soon as the request has ended without it.
        """
        loop = asyncio.get_running_loop()
        deadline = loop.time() + within
        while True:
            record = self._records.get(request_id)
            if record is not None:
                if done(record):
                    return record
                if record.closed:
                    raise EmulatorWaitError(f"request {request_id} ended without being {what}")
            remaining = deadline - loop.time()
            if remaining <= 0:
                raise TimeoutError(f"request {request_id} not {what} within {within} s")
            changed = self._changed
            self._waiters += 1
            try:
                async with asyncio.timeout(remaining):
                    await changed.wait()
            except TimeoutError:
                raise TimeoutError(f"request {request_id} not {what} within {within} s") from None
            finally:
                self._waiters -= 1

    def _hold_event(self, key: str) -> asyncio.Event:
        event = self._holds.get(key)
        if event is None:
            event = self._holds[key] = asyncio.Event()
        return event

    def release(self, key: str) -> None:
        """Release every hold on ``key``, now and later (the release latches until reset)."""
        self._hold_event(key).set()

    async def hold(self, key: str) -> None:
        """Wait until ``key`` is released, the state is reset, or the emulator closes."""
        if self.closing:
            return
        await self._hold_event(key).wait()

    async def sleep(self, seconds: float) -> None:
        """Sleep ``seconds``, cut short when the emulator closes (so shutdown is quick)."""
        if seconds <= 0 or self.closing:
            return
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(seconds):
                await self._closing.wait()

    def take_empty(self, key: str, times: int) -> bool:
        """Count one request for ``key``; True while it is among the first ``times``."""
        seen = self._empty_counts.get(key, 0)
        self._empty_counts[key] = seen + 1
        return seen < times

    def reset(self) -> None:
        """Forget records, counters and release latches; pending holds are released first."""
        for event in self._holds.values():
            event.set()
        self._holds.clear()
        self._records.clear()
        self._empty_counts.clear()
        self._next_id = 1
        self.notify()

    def begin_close(self) -> None:
        """Enter closing: end every sleep and hold so in-flight answers finish promptly."""
        self._closing.set()
        for event in self._holds.values():
            event.set()
        self.notify()


STATE_KEY: Final = web.AppKey("emulator_state", EmulatorState)


# --------------------------------------------------------------------------- request bodies


class _StreamOptions(msgspec.Struct):
    include_usage: bool | None = None


class _RequestHead(msgspec.Struct):
    """The only fields the emulator reads; msgspec skips the rest without building them."""

    model: str | None = None
    stream: bool | None = None
    stream_options: _StreamOptions | None = None


# The look-behind skips keys quoted inside a JSON string (escaped as \").
_MODEL_RE: Final = re.compile(rb'(?<!\\)"model"\s*:\s*"((?:[^"\\]|\\.){0,512})"')
_STREAM_RE: Final = re.compile(rb'(?<!\\)"stream"\s*:\s*(true|false)')
_INCLUDE_USAGE_RE: Final = re.compile(rb'(?<!\\)"include_usage"\s*:\s*(true|false)')


@dataclass(slots=True)
class _Body:
    size: int
    digest: str
    model: str | None = None
    stream: bool = False
    include_usage: bool = False
    error: str | None = None


async def _read_body(request: web.BaseRequest, record: RequestRecord) -> _Body:
    hasher = xxhash.xxh3_128()
    # A declared length over the limit means nothing is kept from the first byte on.
    declared = record.content_length
    kept: bytearray | None = (
        None if declared is not None and declared > PARSE_LIMIT else bytearray()
    )
    head = b""
    tail = b""
    size = 0
    while True:
        chunk = await request.content.readany()
        if not chunk:
            break
        size += len(chunk)
        record.body_bytes = size
        hasher.update(chunk)
        if kept is not None:
            kept += chunk
            if len(kept) > PARSE_LIMIT:
                head = bytes(kept[:SCAN_BYTES])
                kept = None
        elif len(head) < SCAN_BYTES:
            head += chunk[: SCAN_BYTES - len(head)]
        tail = (tail + chunk[-SCAN_BYTES:])[-SCAN_BYTES:]
    body = _Body(size=size, digest=hasher.hexdigest())
    if kept is not None and size <= PARSE_LIMIT:
        _decode_head(kept, body)
    else:
        _scan_ends(head, tail, body)
    return body


def _decode_head(data: bytearray, body: _Body) -> None:
    try:
        parsed = msgspec.json.decode(data, type=_RequestHead)
    except msgspec.DecodeError as exc:
        body.error = str(exc)
        return
    body.model = parsed.model
    body.stream = bool(parsed.stream)
    options = parsed.stream_options
    body.include_usage = bool(options is not None and options.include_usage)


def _scan_ends(head: bytes, tail: bytes, body: _Body) -> None:
    for region in (head, tail):
        match = _MODEL_RE.search(region)
        if match is not None and body.model is None:
            with contextlib.suppress(ValueError):
                body.model = str(json.loads(b'"' + match.group(1) + b'"'))
        stream = _STREAM_RE.search(region)
        body.stream = body.stream or (stream is not None and stream.group(1) == b"true")
        usage = _INCLUDE_USAGE_RE.search(region)
        body.include_usage = body.include_usage or (usage is not None and usage.group(1) == b"true")


# --------------------------------------------------------------------------- answers

_Route = Literal["chat", "responses", "messages", "count_tokens", "models", "root"]
_Shape = Literal["openai", "anthropic", "plain"]


@dataclass(slots=True)
class _Plan:
    """A decided answer: status, headers and the frames to write."""

    status: int
    content_type: str
    frames: Iterable[_Frame]
    sse: bool = False
    paced: bool = False
    headers: dict[str, str] = field(default_factory=dict)


@dataclass(slots=True)
class _Ctx:
    """Per-answer values shared by the protocol renderers."""

    script: Script
    rid: int
    model: str
    input_tokens: int
    include_usage: bool
    empty: bool
    sse: _SSE
    created: int = field(default_factory=lambda: int(time.time()))
    sequence: int = 0

    @property
    def output_tokens(self) -> int:
        return 0 if self.empty else self.script.delta_count()

    def deltas(self) -> Iterator[_Delta]:
        return iter(()) if self.empty else _iter_deltas(self.script)

    def full_text(self) -> _Text:
        def source() -> Iterator[str]:
            for delta in self.deltas():
                yield from delta.pieces()

        return _Text(source)

    def next_sequence(self) -> int:
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


def _delta_frame(ctx: _Ctx, delta: _Delta, name: str | None, payload: dict[str, Any]) -> _Frame:
    """A text-delta event; ``payload`` holds :data:`_SLOT` where the delta text goes."""
    if delta.filler:
        return ctx.sse.event(name, payload, text=_Text(delta.pieces), delta=True)
    return ctx.sse.event(name, _fill(payload, delta.text), delta=True, split=delta.split)


# OpenAI chat -----------------------------------------------------------------


def _chat_usage(ctx: _Ctx) -> dict[str, Any]:
    return {
        "prompt_tokens": ctx.input_tokens,
        "completion_tokens": ctx.output_tokens,
        "total_tokens": ctx.input_tokens + ctx.output_tokens,
        "prompt_tokens_details": {"cached_tokens": ctx.script.cache_read, "audio_tokens": 0},
        "completion_tokens_details": {
            "reasoning_tokens": 0,
            "audio_tokens": 0,
            "accepted_prediction_tokens": 0,
            "rejected_prediction_tokens": 0,
        },
    }


def _chat_stream(ctx: _Ctx) -> Iterator[_Frame]:
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


def _chat_json(ctx: _Ctx) -> list[_Frame]:
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


def _responses_usage(ctx: _Ctx) -> dict[str, Any]:
    return {
        "input_tokens": ctx.input_tokens,
        "input_tokens_details": {"cached_tokens": ctx.script.cache_read},
        "output_tokens": ctx.output_tokens,
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": ctx.input_tokens + ctx.output_tokens,
    }


def _response_object(
    ctx: _Ctx,
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


def _message_item(ctx: _Ctx, status: str, content: list[dict[str, Any]]) -> dict[str, Any]:
    item_id = f"msg_emu{ctx.rid:06d}"
    return {
        "id": item_id,
        "type": "message",
        "status": status,
        "content": content,
        "role": "assistant",
    }


def _responses_prelude(ctx: _Ctx) -> Iterator[_Frame]:
    for kind in ("response.created", "response.in_progress"):
        payload = {
            "type": kind,
            "sequence_number": ctx.next_sequence(),
            "response": _response_object(ctx, "in_progress", [], None),
        }
        yield ctx.sse.event(kind, payload)


def _responses_stream(ctx: _Ctx) -> Iterator[_Frame]:
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


def _responses_json(ctx: _Ctx) -> list[_Frame]:
    output = [] if ctx.empty else [_message_item(ctx, "completed", [_output_text_part(_SLOT)])]
    payload = _response_object(ctx, "completed", output, _responses_usage(ctx))
    return _json_frames(payload, ctx.full_text())


def _responses_failed_stream(ctx: _Ctx, message: str) -> Iterator[_Frame]:
    yield from _responses_prelude(ctx)
    error = {"code": "context_length_exceeded", "message": message}
    kind = "response.failed"
    response = _response_object(ctx, "failed", [], None, error)
    yield ctx.sse.event(
        kind, {"type": kind, "sequence_number": ctx.next_sequence(), "response": response}
    )


# Anthropic messages ----------------------------------------------------------


def _anthropic_usage(ctx: _Ctx, output_tokens: int) -> dict[str, Any]:
    return {
        "input_tokens": ctx.input_tokens,
        "cache_creation_input_tokens": 0,
        "cache_read_input_tokens": ctx.script.cache_read,
        "output_tokens": output_tokens,
    }


def _anthropic_message(ctx: _Ctx, content: list[dict[str, Any]], **rest: Any) -> dict[str, Any]:
    return {
        "id": f"msg_emu{ctx.rid:06d}",
        "type": "message",
        "role": "assistant",
        "model": ctx.model,
        "content": content,
        **rest,
    }


def _messages_stream(ctx: _Ctx) -> Iterator[_Frame]:
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


def _messages_json(ctx: _Ctx) -> list[_Frame]:
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


def _decorate(frames: Iterator[_Frame], ctx: _Ctx, route: _Route) -> Iterator[_Frame]:
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
_REASONS: Final = {529: "Overloaded"}


def _reason(status: int) -> str:
    if status in _REASONS:
        return _REASONS[status]
    try:
        return HTTPStatus(status).phrase
    except ValueError:
        return "Error"


def _error_plan(
    shape: _Shape,
    status: int,
    message: str,
    *,
    rid: int,
    error_type: str | None = None,
    param: str | None = None,
    code: str | None = None,
) -> _Plan:
    """An error answer in a protocol's shape.

    OpenAI: ``{"error": {"message", "type", "param", "code"}}``; Anthropic:
    ``{"type": "error", "error": {"type", "message"}, "request_id"}`` (types per
    Anthropic's "Errors" page); plain: the message as ``text/plain``.
    """
    if shape == "plain":
        frame = _Frame((message.encode(),))
        return _Plan(status, "text/plain; charset=utf-8", [frame])
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
    return _Plan(status, "application/json", [_Frame((_dumps(payload),))])


def _shape_of(route: _Route, request: web.BaseRequest) -> _Shape:
    if route in ("messages", "count_tokens"):
        return "anthropic"
    if route == "models":
        return "anthropic" if "anthropic-version" in request.headers else "openai"
    if route == "root":
        return "plain"
    return "openai"


def _overflow_plan(route: _Route, ctx: _Ctx, body: _Body, stream: bool) -> _Plan:
    script, tokens = ctx.script, body.size // 4
    if script.plain:
        limit = script.context or _OPENAI_CONTEXT
        text = (
            f"This model's maximum context length is {limit} tokens. However, you requested "
            f"{tokens} tokens ({tokens} in the messages, 0 in the completion). Please reduce "
            "the length of the messages or completion."
        )
        return _error_plan("plain", 400, text, rid=ctx.rid)
    if route == "messages":
        limit = script.context or _ANTHROPIC_CONTEXT
        text = f"prompt is too long: {tokens} tokens > {limit} maximum"
        return _error_plan("anthropic", 400, text, rid=ctx.rid)
    if route == "responses" and stream:
        text = (
            "Your input exceeds the context window of this model. "
            "Please adjust your input and try again."
        )
        frames = _decorate(_responses_failed_stream(ctx, text), ctx, route)
        return _Plan(200, "text/event-stream; charset=utf-8", frames, sse=True, paced=True)
    limit = script.context or _OPENAI_CONTEXT
    text = (
        f"This model's maximum context length is {limit} tokens. However, your messages "
        f"resulted in {tokens} tokens. Please reduce the length of the messages."
    )
    return _error_plan(
        "openai",
        400,
        text,
        rid=ctx.rid,
        error_type="invalid_request_error",
        param="input" if route == "responses" else "messages",
        code="context_length_exceeded",
    )


def _models_payload(shape: _Shape) -> dict[str, Any]:
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


def _plan_answer(
    route: _Route,
    request: web.BaseRequest,
    state: EmulatorState,
    script: Script,
    body: _Body,
    rid: int,
) -> _Plan:
    shape = _shape_of(route, request)
    if script.status is not None:
        reason = _reason(script.status)
        message = f"Emulated {script.status} error (x-emulator status={script.status})."
        plan = _error_plan(
            "plain" if script.plain else shape,
            script.status,
            reason if script.plain else message,
            rid=rid,
        )
        if script.retry_after is not None:
            plan.headers["Retry-After"] = str(script.retry_after)
        return plan
    if route == "root":
        return _Plan(200, "text/plain; charset=utf-8", [_Frame((b"ok\n",))])
    if route == "models":
        return _Plan(200, "application/json", [_Frame((_dumps(_models_payload(shape)),))])
    if body.error is not None:
        return _error_plan(
            shape,
            400,
            "We could not parse the JSON body of your request. "
            f"({body.error}; the body must be a JSON object.)",
            rid=rid,
        )
    tokens = body.size // 4
    if route == "count_tokens":
        return _Plan(200, "application/json", [_Frame((_dumps({"input_tokens": tokens}),))])
    if script.empty_times is not None:
        key = request.headers.get(SCRIPT_KEY_HEADER, "")
        empty = state.take_empty(key, script.empty_times)
    else:
        empty = script.empty
    ctx = _Ctx(
        script=script,
        rid=rid,
        model=body.model or DEFAULT_MODEL,
        input_tokens=tokens,
        include_usage=body.include_usage,
        empty=empty,
        sse=_SSE(script.crlf),
    )
    if script.overflow_above is not None and body.size > script.overflow_above:
        return _overflow_plan(route, ctx, body, body.stream)
    if body.stream:
        render = {"chat": _chat_stream, "responses": _responses_stream}.get(route, _messages_stream)
        frames = _decorate(render(ctx), ctx, route)
        return _Plan(200, "text/event-stream; charset=utf-8", frames, sse=True, paced=True)
    build = {"chat": _chat_json, "responses": _responses_json}.get(route, _messages_json)
    return _Plan(200, "application/json", build(ctx), paced=True)


# --------------------------------------------------------------------------- delivery


class _Cut(Exception):
    """``cut_after`` reached: abort the connection."""


class _Wire:
    """Writes frames to one response: JSON escaping of streamed text, gzip, byte counts."""

    __slots__ = ("_gzip", "_hasher", "_record", "_request", "_response", "_state")

    def __init__(
        self,
        request: web.BaseRequest,
        response: web.StreamResponse,
        state: EmulatorState,
        record: RequestRecord,
        gzip: bool,
    ) -> None:
        self._request = request
        self._response = response
        self._state = state
        self._record = record
        self._gzip = zlib.compressobj(6, zlib.DEFLATED, 16 + zlib.MAX_WBITS) if gzip else None
        self._hasher = xxhash.xxh3_128()

    def digest(self) -> str:
        """xxh3_128 hex of the body bytes written so far, before gzip."""
        return self._hasher.hexdigest()

    async def _send(self, data: bytes) -> None:
        plain = data
        if self._gzip is not None:
            # A sync flush per write, so each event reaches the client when written.
            data = self._gzip.compress(data) + self._gzip.flush(zlib.Z_SYNC_FLUSH)
        if data:
            await self._response.write(data)
            self._record.bytes_sent += len(data)
        self._hasher.update(plain)

    async def send_frame(self, frame: _Frame) -> None:
        if frame.split_utf8:
            await self._send_split(b"".join(p for p in frame.parts if isinstance(p, bytes)))
            return
        buffer = bytearray()
        for part in frame.parts:
            if isinstance(part, bytes):
                buffer += part
                continue
            for piece in part.source():
                buffer += _escape(piece)
                if len(buffer) >= _WRITE_CHUNK:
                    await self._send(bytes(buffer))
                    buffer.clear()
        if buffer:
            await self._send(bytes(buffer))

    async def _send_split(self, data: bytes) -> None:
        # Split right after the lead byte of the first multi-byte character.
        lead = next((i for i, byte in enumerate(data) if byte >= 0xC0), len(data) // 2)
        await self._send(data[: lead + 1])
        await self._request.writer.drain()
        await self._state.sleep(_SPLIT_PAUSE)
        await self._send(data[lead + 1 :])

    async def finish(self) -> None:
        if self._gzip is not None:
            tail = self._gzip.flush()
            await self._response.write(tail)
            self._record.bytes_sent += len(tail)
        await self._response.write_eof()


async def _pace(events: int, script: Script, state: EmulatorState, record: RequestRecord) -> None:
    if events == script.pause_point:
        await state.sleep(script.stall)
        if script.hold is not None:
            record.holding = script.hold
            state.notify()
            try:
                await state.hold(script.hold)
            finally:
                record.holding = None
    if script.cut_after == events:
        raise _Cut


def _cut_connection(request: web.BaseRequest) -> None:
    transport = request.transport
    if transport is None:
        return
    if transport.get_write_buffer_size():
        # close() still delivers the events already written, then ends the connection.
        transport.close()
    else:
        transport.abort()


async def _deliver(
    request: web.BaseRequest,
    plan: _Plan,
    script: Script,
    state: EmulatorState,
    record: RequestRecord,
) -> web.StreamResponse:
    headers = {"Content-Type": plan.content_type, **plan.headers}
    if plan.sse:
        headers["Cache-Control"] = "no-cache"
    if script.gzip:
        headers["Content-Encoding"] = "gzip"
    frames: Iterable[_Frame] = plan.frames
    response = web.StreamResponse(
        status=plan.status, reason=_REASONS.get(plan.status), headers=headers
    )
    if not plan.sse and not script.gzip:
        frames = list(frames)
        response.content_length = _frames_length(frames)
    if request.method == "HEAD":
        # StreamResponse does not drop a HEAD body by itself (web.Response would).
        frames = ()
    response.headers["x-emulator-request-id"] = str(record.id)
    record.status = plan.status
    wire = _Wire(request, response, state, record, script.gzip)
    try:
        await response.prepare(request)
        record.headers_sent = True
        record.headers_sent_at = time.monotonic()
        state.notify()
        if plan.paced:
            await _pace(0, script, state, record)
        delta_seen = False
        for frame in frames:
            if frame.delta:
                if delta_seen:
                    await state.sleep(script.delay)
                delta_seen = True
            await wire.send_frame(frame)
            if frame.counted:
                record.events_sent += 1
                state.notify()
                if plan.paced:
                    await _pace(record.events_sent, script, state, record)
        await wire.finish()
        record.finished = True
    except _Cut:
        record.cut_by_emulator = True
        _cut_connection(request)
    except ConnectionError:
        # A write found the connection gone (aiohttp's ClientConnectionResetError is one).
        record.aborted_by_peer = not state.closing
    finally:
        record.sent_digest = wire.digest()
    return response


async def _handle(request: web.Request, route: _Route) -> web.StreamResponse:
    state = request.app[STATE_KEY]
    record = state.open_record(request)
    try:
        script_error: str | None = None
        script = state.default_script
        header = request.headers.get(SCRIPT_HEADER)
        if header is not None:
            try:
                script = parse_script(header, base=state.default_script)
            except ScriptError as exc:
                script_error = str(exc)
        body = await _read_body(request, record)
        record.body_digest = body.digest
        record.model = body.model
        record.stream = body.stream
        record.received = True
        state.notify()
        if script_error is not None:
            plan = _error_plan(
                _shape_of(route, request), 400, f"x-emulator: {script_error}", rid=record.id
            )
            return await _deliver(request, plan, Script(), state, record)
        await state.sleep(script.stall_headers)
        plan = _plan_answer(route, request, state, script, body, record.id)
        if route in ("chat", "responses"):
            plan.headers["x-request-id"] = f"req_emu{record.id:06d}"
        elif route in ("messages", "count_tokens"):
            plan.headers["request-id"] = f"req_emu{record.id:06d}"
        return await _deliver(request, plan, script, state, record)
    except asyncio.CancelledError:
        # handler_cancellation=True: the client hung up (or shutdown cancelled us).
        if not state.closing and not record.cut_by_emulator and not record.finished:
            record.aborted_by_peer = True
        raise
    except ConnectionError:
        # The body read failed because the client went away mid-upload; aiohttp
        # treats the failed write of this answer as a premature disconnect.
        record.aborted_by_peer = not state.closing
        return web.Response(status=400, text="request closed before body completed")
    finally:
        record.closed_at = time.monotonic()
        state.notify()


def _route_handler(route: _Route) -> Callable[[web.Request], Awaitable[web.StreamResponse]]:
    async def handler(request: web.Request) -> web.StreamResponse:
        return await _handle(request, route)

    handler.__name__ = f"emulate_{route}"
    return handler


async def _stats(request: web.Request) -> web.Response:
    records = [record.to_json() for record in request.app[STATE_KEY].records]
    return web.json_response({"requests": records})


async def _reset(request: web.Request) -> web.Response:
    request.app[STATE_KEY].reset()
    return web.json_response({"reset": True})


async def _release(request: web.Request) -> web.Response:
    key = request.match_info["key"]
    request.app[STATE_KEY].release(key)
    return web.json_response({"released": key})


async def _on_shutdown(app: web.Application) -> None:
    app[STATE_KEY].begin_close()


def build_emulator_app(*, default_script: Script | None = None) -> web.Application:
    """Build the emulator's aiohttp application (routes in the module docstring).

    ``default_script`` applies to requests without an ``x-emulator`` header; header
    keys override it field by field. Run it with ``handler_cancellation=True`` (as
    :func:`start_emulator` does) or peer aborts are only seen on a failed write.
    """
    app = web.Application()
    app[STATE_KEY] = EmulatorState(default_script)
    app.router.add_post("/v1/chat/completions", _route_handler("chat"))
    app.router.add_post("/v1/responses", _route_handler("responses"))
    app.router.add_post("/v1/messages", _route_handler("messages"))
    app.router.add_post("/v1/messages/count_tokens", _route_handler("count_tokens"))
    app.router.add_get("/v1/models", _route_handler("models"))
    app.router.add_get("/", _route_handler("root"))
    app.router.add_get("/_emulator/stats", _stats)
    app.router.add_post("/_emulator/reset", _reset)
    app.router.add_post("/_emulator/release/{key}", _release)
    app.on_shutdown.append(_on_shutdown)
    return app


# --------------------------------------------------------------------------- server


class EmulatorServer:
    """A started emulator on a loopback port; an async context manager that closes it.

    ``url`` is ``http://host:port`` (no trailing slash; OpenAI SDKs want
    ``url + "/v1"``, Anthropic SDKs ``url``). The ``wait_*`` methods take a request
    id and ``within``, a timeout in seconds, return the live :class:`RequestRecord`, raise
    ``TimeoutError`` at the deadline and :class:`EmulatorWaitError` as soon as the
    request ended without reaching the awaited state.
    """

    __slots__ = ("_closed", "_runner", "host", "port", "state")

    def __init__(self, runner: web.AppRunner, state: EmulatorState, host: str, port: int) -> None:
        self._runner = runner
        self._closed = False
        self.state = state
        self.host = host
        self.port = port

    @property
    def url(self) -> str:
        """Base URL, e.g. ``http://127.0.0.1:40123``."""
        return f"http://{self.host}:{self.port}"

    @property
    def stats(self) -> list[RequestRecord]:
        """Records of the requests seen since start or the last reset, oldest first."""
        return self.state.records

    def record(self, request_id: int) -> RequestRecord:
        """The record of request ``request_id``; raises ``KeyError`` if unknown."""
        return self.state.record(request_id)

    def release(self, key: str) -> None:
        """Release the holds on ``key`` (same as ``POST /_emulator/release/KEY``)."""
        self.state.release(key)

    def reset(self) -> None:
        """Same as ``POST /_emulator/reset``: records, counters and latches start afresh."""
        self.state.reset()

    async def wait_received(self, request_id: int, within: float = 5.0) -> RequestRecord:
        """Wait until request ``request_id``'s body has been read completely."""
        return await self.state.wait_for(request_id, lambda r: r.received, "received", within)

    async def wait_headers_sent(self, request_id: int, within: float = 5.0) -> RequestRecord:
        """Wait until the response headers of request ``request_id`` are sent."""
        return await self.state.wait_for(
            request_id, lambda r: r.headers_sent, "sent headers", within
        )

    async def wait_events(self, request_id: int, count: int, within: float = 5.0) -> RequestRecord:
        """Wait until at least ``count`` events of request ``request_id`` are written."""
        return await self.state.wait_for(
            request_id, lambda r: r.events_sent >= count, f"past {count} events", within
        )

    async def wait_holding(self, request_id: int, within: float = 5.0) -> RequestRecord:
        """Wait until request ``request_id`` sits in its ``hold``."""
        return await self.state.wait_for(
            request_id, lambda r: r.holding is not None, "holding", within
        )

    async def wait_aborted(self, request_id: int, within: float = 5.0) -> RequestRecord:
        """Wait until request ``request_id`` is recorded as aborted by the peer."""
        return await self.state.wait_for(
            request_id, lambda r: r.aborted_by_peer, "aborted by the peer", within
        )

    async def wait_closed(self, request_id: int, within: float = 5.0) -> RequestRecord:
        """Wait until the handler of request ``request_id`` has ended, whatever the outcome."""
        return await self.state.wait_for(request_id, lambda r: r.closed, "closed", within)

    async def close(self) -> None:
        """Release holds, end sleeps, stop listening and wait (≤ 2 s) for handlers. Idempotent."""
        if self._closed:
            return
        self._closed = True
        self.state.begin_close()
        await self._runner.cleanup()

    async def __aenter__(self) -> EmulatorServer:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.close()


async def start_emulator(
    host: str = "127.0.0.1", port: int = 0, *, default_script: Script | None = None
) -> EmulatorServer:
    """Start an emulator on ``host:port`` (port 0: an ephemeral port) and return it started.

    Raises ``OSError`` if the address cannot be bound.
    """
    app = build_emulator_app(default_script=default_script)
    runner = web.AppRunner(
        app, handler_cancellation=True, shutdown_timeout=_SHUTDOWN_TIMEOUT, access_log=None
    )
    await runner.setup()
    try:
        site = web.TCPSite(runner, host, port)
        await site.start()
    except BaseException:
        await runner.cleanup()
        raise
    bound_port = int(runner.addresses[0][1])
    return EmulatorServer(runner, app[STATE_KEY], host, bound_port)


async def _serve_until_signal(host: str, port: int) -> None:
    server = await start_emulator(host, port)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGINT, signal.SIGTERM):
        with contextlib.suppress(NotImplementedError):
            loop.add_signal_handler(signum, stop.set)
    print(f"context-proxy emulator listening on {server.url}", flush=True)
    try:
        await stop.wait()
    finally:
        await server.close()


def run_emulator(host: str, port: int) -> None:
    """Run an emulator until SIGINT/SIGTERM (blocking; for ``context-proxy emulate``).

    Prints ``context-proxy emulator listening on URL`` once bound (port 0 shows
    the real port). Raises ``OSError`` if the address cannot be bound.
    """
    asyncio.run(_serve_until_signal(host, port))

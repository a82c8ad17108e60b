"""Local upstream emulator: a real aiohttp server that speaks the three upstream LLM APIs.

It is the *upstream* in every integration test and benchmark, so it answers in the
real wire shapes (checked by driving it with the installed ``openai`` and
``anthropic`` SDKs) and is scriptable per request. It deliberately imports nothing
from ``proxy._protocols`` or ``proxy._sse``: it is an independent implementation of
what the upstream APIs do, so our tests cannot agree with our own bugs.

aiohttp is a dependency of the emulator only, in the ``testing`` extra: the proxy
never imports this module (nor :mod:`proxy._demo`, :mod:`proxy.testing`).

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
- ``prompt_cache=1``: cache-read tokens are the prompt's prefix shared with an
  accepted request of the same route and model in the last 5 minutes, in whole
  blocks of 1,024 tokens (see :mod:`proxy._emulator_cache`); excludes ``cache_read``.
  Anthropic then also reports the rest of the whole blocks as cache writes
  (``cache_creation_input_tokens``, all of the 5-minute kind) and counts neither
  cached part in ``input_tokens``, as the real API does; OpenAI reports no writes.

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
import json
import re
import signal
import ssl
import time
import zlib
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass, fields
from typing import Any, Final

import msgspec
import xxhash
from aiohttp import web

from ._emulator_cache import BLOCK_TOKENS, PrefixChain, PromptCache
from ._emulator_frames import (
    REASON_PHRASES,
    WRITE_CHUNK,
    AnswerContext,
    Frame,
    Plan,
    Route,
    Shape,
    SSEFrames,
    chat_json,
    chat_stream,
    decorate,
    dumps,
    error_plan,
    escape_text,
    frames_length,
    messages_json,
    messages_stream,
    models_payload,
    overflow_plan,
    reason_phrase,
    responses_json,
    responses_stream,
)
from ._emulator_script import (
    DEFAULT_CHUNKS,
    DEFAULT_MODEL,
    DEFAULT_TEXT,
    Script,
    ScriptError,
    parse_script,
    script_help,
)

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

#: Bodies up to this size (bytes) are decoded; larger ones are only scanned at both ends.
PARSE_LIMIT: Final = 8 * 1024 * 1024
#: Bytes kept from each end of a body too large to decode.
SCAN_BYTES: Final = 16 * 1024
#: Records kept in the stats; older ones are dropped so a long benchmark stays small.
MAX_RECORDS: Final = 10_000

SCRIPT_HEADER: Final = "x-emulator"
SCRIPT_KEY_HEADER: Final = "x-emulator-key"

_SPLIT_PAUSE: Final = 0.05  # seconds between the two halves of a split character
_SHUTDOWN_TIMEOUT: Final = 2.0  # seconds aiohttp waits for handlers once holds are released
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


# --------------------------------------------------------------------------- records


@dataclass(slots=True, eq=False)
class RequestRecord:
    """What the emulator saw and did for one request; live, updated as the answer proceeds.

    ``id`` counts from 1 (restarts on reset). Times are ``time.monotonic()`` seconds.
    ``body_bytes`` and ``body_digest`` (xxh3_128 hex, None until the body is read)
    are of the body after Content-Encoding decoding. ``headers`` holds selected
    request headers, ``authorization`` and ``x-api-key`` cut to 7 characters + "…".
    ``aborted_by_peer``: the client closed the connection before the answer ended;
    ``cut_by_emulator``: ``cut_after`` aborted it. ``cached_tokens`` and
    ``cache_write_tokens`` are the cache figures the answer reports (``prompt_cache=1``).
    ``bytes_sent`` counts response body bytes on the wire (after gzip); ``sent_digest``
    (xxh3_128 hex) is of the body bytes written before gzip, i.e. what a decoding client
    reads, set once the answer ends.
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
    cached_tokens: int = 0
    cache_write_tokens: int = 0
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
        "prompt_cache",
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
        #: Prefixes of accepted requests, for ``prompt_cache=1`` (cleared by :meth:`reset`).
        self.prompt_cache = PromptCache()

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
        self.prompt_cache.clear()
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
    chain: PrefixChain | None = None


async def _read_body(
    request: web.BaseRequest, record: RequestRecord, chained: bool = False
) -> _Body:
    hasher = xxhash.xxh3_128()
    chain = PrefixChain() if chained else None
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
        if chain is not None:
            chain.feed(chunk)
        if kept is not None:
            kept += chunk
            if len(kept) > PARSE_LIMIT:
                head = bytes(kept[:SCAN_BYTES])
                kept = None
        elif len(head) < SCAN_BYTES:
            head += chunk[: SCAN_BYTES - len(head)]
        tail = (tail + chunk[-SCAN_BYTES:])[-SCAN_BYTES:]
    body = _Body(size=size, digest=hasher.hexdigest(), chain=chain)
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


def _shape_of(route: Route, request: web.BaseRequest) -> Shape:
    if route in ("messages", "count_tokens"):
        return "anthropic"
    if route == "models":
        return "anthropic" if "anthropic-version" in request.headers else "openai"
    if route == "root":
        return "plain"
    return "openai"


def _plan_answer(
    route: Route,
    request: web.BaseRequest,
    state: EmulatorState,
    script: Script,
    body: _Body,
    record: RequestRecord,
) -> Plan:
    rid = record.id
    shape = _shape_of(route, request)
    if script.status is not None:
        reason = reason_phrase(script.status)
        message = f"Emulated {script.status} error (x-emulator status={script.status})."
        plan = error_plan(
            "plain" if script.plain else shape,
            script.status,
            reason if script.plain else message,
            rid=rid,
        )
        if script.retry_after is not None:
            plan.headers["Retry-After"] = str(script.retry_after)
        return plan
    if route == "root":
        return Plan(200, "text/plain; charset=utf-8", [Frame((b"ok\n",))])
    if route == "models":
        return Plan(200, "application/json", [Frame((dumps(models_payload(shape)),))])
    if body.error is not None:
        return error_plan(
            shape,
            400,
            "We could not parse the JSON body of your request. "
            f"({body.error}; the body must be a JSON object.)",
            rid=rid,
        )
    tokens = body.size // 4
    if route == "count_tokens":
        return Plan(200, "application/json", [Frame((dumps({"input_tokens": tokens}),))])
    if script.empty_times is not None:
        key = request.headers.get(SCRIPT_KEY_HEADER, "")
        empty = state.take_empty(key, script.empty_times)
    else:
        empty = script.empty
    ctx = AnswerContext(
        script=script,
        rid=rid,
        model=body.model or DEFAULT_MODEL,
        input_tokens=tokens,
        include_usage=body.include_usage,
        empty=empty,
        sse=SSEFrames(script.crlf),
        cache_read=script.cache_read,
    )
    if script.overflow_above is not None and body.size > script.overflow_above:
        return overflow_plan(route, ctx, body.size, body.stream)
    if body.chain is not None:
        _use_prompt_cache(state.prompt_cache, (route, ctx.model), body.chain, ctx)
        record.cached_tokens, record.cache_write_tokens = ctx.cache_read, ctx.cache_write
    if body.stream:
        render = {"chat": chat_stream, "responses": responses_stream}.get(route, messages_stream)
        frames = decorate(render(ctx), ctx, route)
        return Plan(200, "text/event-stream; charset=utf-8", frames, sse=True, paced=True)
    build = {"chat": chat_json, "responses": responses_json}.get(route, messages_json)
    return Plan(200, "application/json", build(ctx), paced=True)


def _use_prompt_cache(
    cache: PromptCache, scope: tuple[str, str], chain: PrefixChain, ctx: AnswerContext
) -> None:
    """Set ``ctx``'s cache figures from ``cache`` and store this accepted prompt's prefix."""
    hit = cache.cached_blocks(scope, chain)
    cache.store(scope, chain)
    ctx.cache_read = hit * BLOCK_TOKENS
    if scope[0] == "messages":
        # Anthropic bills the uncached whole blocks as a cache write and leaves both
        # cached parts out of input_tokens; OpenAI reports reads only, inside the total.
        ctx.cache_write = (len(chain.digests) - hit) * BLOCK_TOKENS
        ctx.uncached_input_tokens = ctx.input_tokens - ctx.cache_read - ctx.cache_write


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

    async def send_frame(self, frame: Frame) -> None:
        if frame.split_utf8:
            await self._send_split(b"".join(p for p in frame.parts if isinstance(p, bytes)))
            return
        buffer = bytearray()
        for part in frame.parts:
            if isinstance(part, bytes):
                buffer += part
                continue
            for piece in part.source():
                buffer += escape_text(piece)
                if len(buffer) >= WRITE_CHUNK:
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
    plan: Plan,
    script: Script,
    state: EmulatorState,
    record: RequestRecord,
) -> web.StreamResponse:
    headers = {"Content-Type": plan.content_type, **plan.headers}
    if plan.sse:
        headers["Cache-Control"] = "no-cache"
    if script.gzip:
        headers["Content-Encoding"] = "gzip"
    frames: Iterable[Frame] = plan.frames
    response = web.StreamResponse(
        status=plan.status, reason=REASON_PHRASES.get(plan.status), headers=headers
    )
    if not plan.sse and not script.gzip:
        frames = list(frames)
        response.content_length = frames_length(frames)
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


async def _handle(request: web.Request, route: Route) -> web.StreamResponse:
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
        body = await _read_body(request, record, chained=script.prompt_cache)
        record.body_digest = body.digest
        record.model = body.model
        record.stream = body.stream
        record.received = True
        state.notify()
        if script_error is not None:
            plan = error_plan(
                _shape_of(route, request), 400, f"x-emulator: {script_error}", rid=record.id
            )
            return await _deliver(request, plan, Script(), state, record)
        await state.sleep(script.stall_headers)
        plan = _plan_answer(route, request, state, script, body, record)
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


def _route_handler(route: Route) -> Callable[[web.Request], Awaitable[web.StreamResponse]]:
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


_SETTLE_TURNS: Final = 5
"""Loop turns :meth:`EmulatorServer.close` gives peer disconnects already under way."""


class EmulatorServer:
    """A started emulator on a loopback port; an async context manager that closes it.

    ``url`` is ``http://host:port`` (no trailing slash; OpenAI SDKs want
    ``url + "/v1"``, Anthropic SDKs ``url``). The ``wait_*`` methods take a request
    id and ``within``, a timeout in seconds, return the live :class:`RequestRecord`, raise
    ``TimeoutError`` at the deadline and :class:`EmulatorWaitError` as soon as the
    request ended without reaching the awaited state.
    """

    __slots__ = ("_closed", "_runner", "host", "port", "state", "tls")

    def __init__(
        self,
        runner: web.AppRunner,
        state: EmulatorState,
        host: str,
        port: int,
        *,
        tls: bool = False,
    ) -> None:
        self._runner = runner
        self._closed = False
        self.state = state
        self.host = host
        self.port = port
        #: Whether it serves https (``start_emulator(tls=...)``).
        self.tls = tls

    @property
    def url(self) -> str:
        """Base URL, e.g. ``http://127.0.0.1:40123`` (``https://`` when it serves TLS)."""
        return f"{'https' if self.tls else 'http'}://{self.host}:{self.port}"

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
        # A client that hung up just before (a proxy aborting its upstream request on
        # its way out) is seen on the loop's next turns: its record says so, not "closing".
        for _ in range(_SETTLE_TURNS):
            await asyncio.sleep(0)
        self.state.begin_close()
        await self._runner.cleanup()

    async def __aenter__(self) -> EmulatorServer:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.close()


async def start_emulator(
    host: str = "127.0.0.1",
    port: int = 0,
    *,
    default_script: Script | None = None,
    tls: ssl.SSLContext | None = None,
) -> EmulatorServer:
    """Start an emulator on ``host:port`` (port 0: an ephemeral port) and return it started.

    ``tls``, a server context holding a certificate, makes it an https upstream
    (to test TLS, a private CA and tunnels through a forward proxy); ``host``
    may then be a name the certificate carries (``localhost``).

    Raises ``OSError`` if the address cannot be bound.
    """
    app = build_emulator_app(default_script=default_script)
    runner = web.AppRunner(
        app, handler_cancellation=True, shutdown_timeout=_SHUTDOWN_TIMEOUT, access_log=None
    )
    await runner.setup()
    try:
        site = web.TCPSite(runner, host, port, ssl_context=tls)
        await site.start()
    except BaseException:
        await runner.cleanup()
        raise
    bound_port = int(runner.addresses[0][1])
    return EmulatorServer(runner, app[STATE_KEY], host, bound_port, tls=tls is not None)


async def _serve_until_signal(host: str, port: int, default_script: Script | None) -> None:
    server = await start_emulator(host, port, default_script=default_script)
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


def run_emulator(host: str, port: int, *, default_script: Script | None = None) -> None:
    """Run an emulator until SIGINT/SIGTERM (blocking; for ``context-proxy emulate``).

    Prints ``context-proxy emulator listening on URL`` once bound (port 0 shows
    the real port). Raises ``OSError`` if the address cannot be bound.
    """
    asyncio.run(_serve_until_signal(host, port, default_script))

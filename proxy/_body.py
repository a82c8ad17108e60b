"""Request body reader: size limit, content decoding, disconnects, idle timeout (I/O edge).

docs/design.md §3 is the spec. :func:`read_body` turns a request body stream
(:class:`proxy._front.BodyStream`) into exactly one
``bytearray`` holding the decoded body, plus the xxh3_128 digest
of those bytes and the number of bytes that crossed the wire. Every way a read
can end is one of two things:

* a :class:`ReadResult` that owns the only buffer, or
* a :class:`BodyError` subclass carrying the HTTP status, a short ``kind`` for
  metrics and a message that is safe to show the client; by the time it is
  raised the reader has dropped every buffer, decoder and timer it made.

Cancellation (a client that hangs up cancels the handler task, proxy/_front.py)
propagates unchanged after the same cleanup.

This module is the driver: it reads chunks, keeps the clock and hands the bytes
to the pure parts in :mod:`proxy._coding` (the decoder chain and the body sink),
whose names it re-exports.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable
from typing import Final, NamedTuple

from ._coding import (
    MAX_CONTENT_CODINGS,
    SUPPORTED_CODINGS,
    ZSTD_BLOCK_MAX_BYTES,
    ZSTD_MAX_WINDOW_BYTES,
    BodyEncodingError,
    BodyError,
    BodySink,
    BodyTooLarge,
    ContentDecoder,
    SpillTarget,
    encoded_size_cap,
    io_piece_bytes,
    parse_content_encoding,
)
from ._fdlimit import EXHAUSTION_ERRNOS
from ._front import BodyStream, ClientBodyError, ClientFramingError
from ._spool import SpoolNoDescriptor

__all__ = [
    "DEFAULT_CHUNK_BYTES",
    "MAX_CONTENT_CODINGS",
    "SUPPORTED_CODINGS",
    "ZSTD_MAX_WINDOW_BYTES",
    "BodyBusy",
    "BodyEncodingError",
    "BodyError",
    "BodyFraming",
    "BodyIncomplete",
    "BodyMemory",
    "BodyTimeout",
    "BodyTooLarge",
    "ReadResult",
    "check_content_length",
    "encoded_size_cap",
    "parse_content_encoding",
    "read_body",
]

DEFAULT_CHUNK_BYTES: Final = 256 * 1024
"""Bytes asked of the payload per read; also the size of one decoded piece."""

#: Stands in for the read deadline when no read can wait (reusable, stateless).
_NO_TIMER: Final = contextlib.nullcontext()


# --------------------------------------------------------------------------- errors


class BodyIncomplete(BodyError):
    """400: the client closed the connection, or sent fewer bytes than declared, mid-body."""

    status = 400
    kind = "incomplete"

    def __init__(self) -> None:
        super().__init__("request closed before body completed")


class BodyFraming(BodyError):
    """400: the client broke the body's framing (a bad chunk size, chunk data over its size).

    Not a hang-up: the client may still be connected and reads the answer
    (RFC 9112 §7.1); the connection closes after it, since the rest of the
    stream cannot be framed. ``message`` is the parser's description of the fault.
    """

    status = 400
    kind = "malformed_request"

    def __init__(self, fault: str) -> None:
        super().__init__(f"the request body's framing is broken ({fault})")


class BodyTimeout(BodyError):
    """408: no body byte arrived for ``idle_timeout`` seconds, or the body missed its deadline.

    ``BodyTimeout(seconds)`` is the idle case; :meth:`deadline` the total one.
    """

    status = 408
    kind = "timeout"

    def __init__(self, idle_timeout: float, *, message: str | None = None) -> None:
        super().__init__(message or f"no request body bytes received for {idle_timeout:g} seconds")

    @classmethod
    def deadline(cls, body_timeout: float) -> BodyTimeout:
        """408: the whole body was not received within ``body_timeout`` seconds."""
        return cls(
            body_timeout,
            message=f"request body not received within {body_timeout:g} seconds",
        )


class BodyBusy(BodyError):
    """503: the proxy's budget for bodies being read at once (``max_reading_bytes``) is spent.

    Raised by the caller's ``on_growth`` callback; retryable (answer with ``Retry-After``).
    """

    status = 503
    kind = "busy"

    def __init__(self) -> None:
        super().__init__("too many request bodies are being read at once; retry later")


class BodyMemory(BodyError):
    """503: memory for the body could not be had (its reservation or a growth failed).

    ``MemoryError`` from the buffer (a declared ``Content-Length`` reserves that
    much address space at the first body byte; a chunked or coded body grows)
    or from a decoder, typically under an address-space limit (``ulimit -v``,
    ``RLIMIT_AS``) or when ``mmap`` fails. Retryable: answer with ``Retry-After``.
    By the time it is raised the partial buffer is freed.
    """

    status = 503
    kind = "memory"

    def __init__(self) -> None:
        super().__init__("the proxy could not reserve memory for the request body; retry later")


def _detached(exc: BodyError) -> BodyError:
    """Cut ``exc`` loose from the frames it was raised through.

    A traceback keeps every frame it passed alive with all their locals (chunks,
    decoders, the buffer's owner), and ``__context__`` keeps a codec exception and
    its frames alive; the caller may hold the error for a long time (logs, metrics).
    """
    exc.__traceback__ = None
    exc.__context__ = None
    exc.__cause__ = None
    return exc


# --------------------------------------------------------------------------- header checks


def check_content_length(
    content_length: int | None, content_encoding: str | None, limit: int
) -> None:
    """Refuse a body whose declared size is already too large, before a byte is read.

    Args:
        content_length: the ``Content-Length`` in bytes, None when absent (chunked).
        content_encoding: the raw ``Content-Encoding`` value or None.
        limit: largest decoded body accepted, in bytes.

    With no content coding the declared length is the body size, so more than
    ``limit`` is refused. With a coding the decoded size is unknown until read;
    only a declared length above :func:`encoded_size_cap` is refused here.

    Raises:
        BodyTooLarge: 413, carrying ``limit``.
        BodyEncodingError: 415 when ``content_encoding`` cannot be decoded at all.
        ValueError: ``content_length`` or ``limit`` is negative (a caller bug).
    """
    _check_declared(content_length, parse_content_encoding(content_encoding), limit)


def _check_declared(content_length: int | None, codings: tuple[str, ...], limit: int) -> None:
    if limit < 0:
        raise ValueError(f"limit must be >= 0 bytes, got {limit}")
    if content_length is None:
        return
    if content_length < 0:
        raise ValueError(f"content_length must be >= 0 bytes, got {content_length}")
    if content_length > (encoded_size_cap(limit) if codings else limit):
        raise BodyTooLarge(limit)


# --------------------------------------------------------------------------- reading


class ReadResult(NamedTuple):
    """A body read to the end (immutable: a NamedTuple is built in one C call, a frozen
    dataclass's ``__init__`` is an ``object.__setattr__`` call per field).

    Attributes:
        buffer: the decoded body, exactly its length; the only copy, owned by the
            caller: a ``bytearray`` on the heap, or for a spooled body a read-only
            ``memoryview`` of ``spool``'s mapping.
        digest: hex xxh3_128 of ``buffer`` (docs/design.md §4), computed while reading.
        wire_bytes: bytes received on the wire (after transfer decoding, before
            content decoding); equals ``len(buffer)`` with no content coding.
        spool: the spill target holding a spooled body (the caller closes it,
            which ends ``buffer``), ``None`` for a heap body.
    """

    buffer: bytearray | memoryview
    digest: str
    wire_bytes: int
    spool: SpillTarget | None = None


async def read_body(
    content: BodyStream,
    *,
    content_length: int | None,
    content_encoding: str | None,
    limit: int,
    idle_timeout: float,
    body_timeout: float | None = None,
    chunk_bytes: int = DEFAULT_CHUNK_BYTES,
    on_growth: Callable[[int], None] | None = None,
    spill: Callable[[], SpillTarget] | None = None,
    spill_above: int = 0,
) -> ReadResult:
    """Read and decode a request body within ``limit`` bytes (docs/design.md §3).

    ``content`` MUST yield the body as it crossed the wire (content coding
    included): the decoding and its limit are applied here, once.

    Args:
        content: ``request.content``, the body as the server edge receives it
            (transfer coding undone, content coding not); nothing else may read
            it concurrently.
        content_length: ``request.content_length`` (bytes) or None for chunked.
        content_encoding: the ``Content-Encoding`` value or None; see
            :func:`parse_content_encoding` for the accepted codings.
        limit: largest decoded body accepted, in bytes (an exactly ``limit``-byte
            body passes).
        idle_timeout: seconds without a single body byte before giving up; the
            clock restarts on every chunk, so a slow but moving upload is fine.
        body_timeout: seconds the whole read may take, counted from the call
            (None: no total deadline); a trickle that keeps the idle clock at
            bay is cut here. Both clocks share one timer.
        chunk_bytes: bytes asked of the payload per read (64-256 KiB is right);
            also roughly the largest decoded piece a decoder produces at once.
            An uncoded body with a declared length is read in pieces of about
            1/64 of it (:func:`proxy._coding.io_piece_bytes`: never under
            16 KiB, never over ``chunk_bytes``).
        on_growth: called with the number of bytes the decoded buffer grew by,
            after each chunk that grew it (resident memory follows these, see
            :class:`proxy._coding.BodySink`); a :class:`BodyError` it raises ends
            the read with that error (e.g. a 503 when a shared budget is spent).
        spill: opens the spool file of a body over ``spill_above`` bytes
            (docs/design.md §2, "the spool"): a declared length over it goes
            there from its first byte, a body without one once it crosses it.
            The decoded bytes are written there as they come; the target's
            errors (a full disk, its budget: 503s) end the read like any
            BodyError, with the partial file closed.
        spill_above: the spool threshold in bytes (0: never spill).

    Returns:
        ReadResult owning the only buffer.

    Raises:
        BodyTooLarge: 413, from the declared length before reading, or as soon as
            the decoded size (or the wire size of an encoded body, see
            :func:`encoded_size_cap`) passes the limit; reading stops there.
        BodyIncomplete: 400, the client closed mid-body.
        BodyFraming: 400, the client broke the body's chunked framing.
        BodyTimeout: 408, no progress for ``idle_timeout`` seconds, or the body
            not complete after ``body_timeout`` seconds.
        BodyEncodingError: 415 for an unknown coding (before reading), 400 for
            corrupt or truncated coded data.
        BodyMemory: 503, the buffer's reservation or growth (or a decoder's
            allocation) raised ``MemoryError``, or a spooled body's ``mmap``
            failed; the partial buffer (or file) is freed. For want of a file
            descriptor (``EMFILE``), :class:`~proxy._spool.SpoolNoDescriptor` instead.
        asyncio.CancelledError: propagated unchanged (the handler was cancelled,
            usually because the client hung up); the caller logs it.
        ValueError: ``limit``, ``idle_timeout`` or ``chunk_bytes`` out of range.

    Whatever the outcome, nothing is left behind: the buffer is freed on failure
    (its storage released even if a frame still points at it), decoders and
    chunks are dropped, the one idle timer is cancelled, no task or callback is
    registered. After a BodyError the rest of the body is unread, so answer with
    ``Connection: close`` (``SmallAnswer(..., close=True)``) unless lingering is wanted.
    """
    if idle_timeout <= 0 or chunk_bytes <= 0 or (body_timeout is not None and body_timeout <= 0):
        raise ValueError("idle_timeout, body_timeout and chunk_bytes must be > 0")
    codings = parse_content_encoding(content_encoding)
    _check_declared(content_length, codings, limit)
    sink = BodySink(
        limit, None if codings else content_length, spill=spill, spill_above=spill_above
    )
    if content_length is not None and not codings:
        # Only ever smaller than asked: the transient piece scales with the body.
        # The same size the server reads this body's socket in (proxy/_front.py),
        # so a read takes one queued part whole instead of joining several.
        chunk_bytes = io_piece_bytes(content_length, chunk_bytes)
    decoder: ContentDecoder | None = None
    if codings:
        piece = max(chunk_bytes, ZSTD_BLOCK_MAX_BYTES)
        decoder = ContentDecoder(codings, sink.write, piece=piece, limit=limit)
    wire_cap = encoded_size_cap(limit) if codings else limit
    try:
        failure, wire_bytes = await _pump(
            content,
            sink,
            decoder,
            expected=content_length,
            wire_cap=wire_cap,
            limit=limit,
            idle_timeout=idle_timeout,
            body_timeout=body_timeout,
            chunk_bytes=chunk_bytes,
            on_growth=on_growth,
        )
    except BaseException:
        sink.release()
        raise
    finally:
        if decoder is not None:
            decoder.release()
        decoder = None
    if failure is not None:
        sink.release()
        try:
            raise failure
        finally:
            # The traceback keeps this frame; without this it would keep the
            # error itself too, a cycle only the garbage collector can break.
            failure = None
    spooled = sink.spilled
    buffer, digest = sink.take()
    if spooled is None:
        return ReadResult(buffer=buffer, digest=digest, wire_bytes=wire_bytes)
    try:
        view = spooled.map()
    except (OSError, MemoryError) as exc:
        spooled.close()
        if isinstance(exc, OSError) and exc.errno in EXHAUSTION_ERRNOS:
            # mmap holds a duplicate of the file's descriptor: the limit, not memory.
            raise _detached(SpoolNoDescriptor()) from None
        raise _detached(BodyMemory()) from None
    return ReadResult(buffer=view, digest=digest, wire_bytes=wire_bytes, spool=spooled)


async def _pump(
    content: BodyStream,
    sink: BodySink,
    decoder: ContentDecoder | None,
    *,
    expected: int | None,
    wire_cap: int,
    limit: int,
    idle_timeout: float,
    body_timeout: float | None,
    chunk_bytes: int,
    on_growth: Callable[[int], None] | None,
) -> tuple[BodyError | None, int]:
    """Move the body from ``content`` into ``sink``: (error to raise or None, wire bytes).

    BodyErrors are returned, not raised, detached from their traceback so the
    caller can raise them outside any ``except`` block (no ``__context__``).
    """
    wire = 0
    chunk = b""
    # One timer for the whole read, for both clocks: its deadline is the nearer
    # of "idle_timeout after the last chunk" and the body deadline, pushed back
    # on each chunk. No task or timer per read call.
    # A body already received whole (a small one, usually: the parser has seen its
    # end) cannot keep a read waiting: no timer at all then, nor a look at the clock
    # (the loop and its time are read only for a timer: both are used with it alone).
    # (An absolute deadline: timeout_at. asyncio.timeout would take it as a delay, and a
    # body whose first byte never came waited ~2 x the loop clock, not idle_timeout.)
    timer: asyncio.Timeout | None = None
    hard = float("inf")
    if not content.is_eof():
        loop = asyncio.get_running_loop()
        if body_timeout is not None:
            hard = loop.time() + body_timeout
        timer = asyncio.timeout_at(min(loop.time() + idle_timeout, hard))
    try:
        async with timer if timer is not None else _NO_TIMER:
            while True:
                try:
                    chunk = await content.read(chunk_bytes)
                except ClientFramingError as fault:  # the client is still there
                    return BodyFraming(str(fault)), wire
                except ClientBodyError:  # the client left
                    return BodyIncomplete(), wire
                if not chunk:
                    break
                wire += len(chunk)
                if wire > wire_cap:
                    return BodyTooLarge(limit), wire
                held = sink.size
                try:
                    if decoder is None:
                        sink.write(chunk)
                    else:
                        decoder.feed(chunk)
                except MemoryError:
                    # Not the client's fault and not a bug: a 503 to retry, not a 500.
                    return BodyMemory(), wire
                chunk = b""
                if on_growth is not None and sink.size > held:
                    on_growth(sink.size - held)
                if timer is not None:
                    timer.reschedule(min(loop.time() + idle_timeout, hard))
        if expected is not None and wire != expected:
            return BodyIncomplete(), wire
        if decoder is not None:
            held = sink.size
            try:
                decoder.finish()
            except MemoryError:
                return BodyMemory(), wire
            if on_growth is not None and sink.size > held:
                on_growth(sink.size - held)
    except TimeoutError:
        if timer is None or not timer.expired():
            raise
        if body_timeout is not None and loop.time() >= hard:
            return BodyTimeout.deadline(body_timeout), wire
        return BodyTimeout(idle_timeout), wire
    except BodyError as exc:
        return _detached(exc), wire
    finally:
        chunk = b""
    return None, wire

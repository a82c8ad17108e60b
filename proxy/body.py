"""Request body reader: size limit, content decoding, disconnects, idle timeout (I/O edge).

DESIGN section 3 is the spec. :func:`read_body` turns an aiohttp request payload
into exactly one ``bytearray`` holding the decoded body, plus the xxh3_128 digest
of those bytes and the number of bytes that crossed the wire. Every way a read
can end is one of two things:

* a :class:`ReadResult` that owns the only buffer, or
* a :class:`BodyError` subclass carrying the HTTP status, a short ``kind`` for
  metrics and a message that is safe to show the client; by the time it is
  raised the reader has dropped every buffer, decoder and timer it made.

Cancellation (the app runs with ``handler_cancellation=True``, so a client that
hangs up cancels the handler task) propagates unchanged after the same cleanup.

Memory: with ``Content-Length`` and no content coding the body is read into one
``bytearray`` of exactly that size (allocated when the first byte arrives) by
slice assignment, so the peak is the body plus aiohttp's read buffer (about two
chunks). Chunked or encoded bodies grow one ``bytearray``. Every decoder hands
out pieces of at most about one chunk (zlib ``max_length``, brotli
``output_buffer_limit``, zstd by walking block headers), so a 1 KB bomb that
would expand to gigabytes costs the limit plus a chunk or two before the 413.
"""

from __future__ import annotations

import asyncio
import dataclasses
import zlib
from collections.abc import Callable
from typing import Final

import aiohttp
import brotli
import xxhash
import zstandard
from aiohttp.http_exceptions import HttpProcessingError
from aiohttp.streams import EofStream

__all__ = [
    "DEFAULT_CHUNK_BYTES",
    "MAX_CONTENT_CODINGS",
    "SUPPORTED_CODINGS",
    "ZSTD_MAX_WINDOW_BYTES",
    "BodyEncodingError",
    "BodyError",
    "BodyIncomplete",
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

MAX_CONTENT_CODINGS: Final = 4
"""Most stacked codings accepted (``gzip, br`` is 2); each one costs decoder state."""

SUPPORTED_CODINGS: Final = frozenset({"gzip", "x-gzip", "deflate", "br", "zstd"})
"""Content-Encoding tokens read_body decodes, lower case (``identity`` is skipped)."""

ZSTD_MAX_WINDOW_BYTES: Final = 8 * 1024 * 1024
"""Largest zstd window accepted: the 8 MB limit of the ``zstd`` HTTP content coding
(RFC 9659). A frame asking for more is a 400, so a 20-byte header cannot
make the decoder allocate hundreds of megabytes."""

# RFC 8878 section 3.1.1.2.4: Block_Maximum_Size is min(Window_Size, 128 KB); no
# block, whatever its type, regenerates more than this.
_ZSTD_BLOCK_MAX: Final = 128 * 1024


# --------------------------------------------------------------------------- errors


class BodyError(Exception):
    """The request body could not be read; the caller answers ``status`` and forwards nothing.

    Attributes:
        status: HTTP status to answer (int).
        kind: short machine name for logs and metrics (``too_large``, ``incomplete``,
            ``timeout``, ``bad_encoding``, ``unsupported_encoding``).
        message: one sentence safe to show the client; never contains body bytes.
        limit: the size limit in bytes for ``too_large``, else None.

    The exception never references the body buffer, a chunk or a decoder.
    """

    status: int = 400
    kind: str = "body_error"

    def __init__(self, message: str, *, limit: int | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.limit = limit


class BodyTooLarge(BodyError):
    """413: the body (decoded size, or the declared ``Content-Length``) exceeds ``limit`` bytes."""

    status = 413
    kind = "too_large"

    def __init__(self, limit: int) -> None:
        super().__init__(f"request body exceeds the limit of {limit} bytes", limit=limit)


class BodyIncomplete(BodyError):
    """400: the client closed, or aiohttp reported broken framing, before the body was complete."""

    status = 400
    kind = "incomplete"

    def __init__(self) -> None:
        super().__init__("request closed before body completed")


class BodyTimeout(BodyError):
    """408: no body byte arrived for ``idle_timeout`` seconds."""

    status = 408
    kind = "timeout"

    def __init__(self, idle_timeout: float) -> None:
        super().__init__(f"no request body bytes received for {idle_timeout:g} seconds")


class BodyEncodingError(BodyError):
    """400 ``bad_encoding`` (corrupt or truncated coded data) or 415 ``unsupported_encoding``.

    Use the two constructors; ``coding`` is the Content-Encoding token concerned.
    """

    status = 400
    kind = "bad_encoding"

    @classmethod
    def corrupt(cls, coding: str, detail: str = "is not valid") -> BodyEncodingError:
        """400: "request body <detail> <coding> data", e.g. detail "ends before the end of its"."""
        err = cls(f"request body {detail} {coding} data")
        err.status = 400
        err.kind = "bad_encoding"
        return err

    @classmethod
    def unsupported(cls, reason: str) -> BodyEncodingError:
        """415: the Content-Encoding header cannot be decoded (``reason`` says why)."""
        err = cls(reason)
        err.status = 415
        err.kind = "unsupported_encoding"
        return err


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


def parse_content_encoding(value: str | None) -> tuple[str, ...]:
    """Content codings of a ``Content-Encoding`` value, in the order they were applied.

    RFC 9110 section 8.4: the value is a comma-separated list of codings, listed
    in the order they were applied, so ``"gzip, br"`` is decoded br first. Tokens
    are case-insensitive; ``x-gzip`` is ``gzip`` (RFC 9110 section 8.4.1.3);
    ``identity`` and empty list elements are skipped. Several header lines must be
    joined with ``", "`` by the caller.

    Returns:
        e.g. ``("gzip", "br")``; ``()`` for None, "" or identity.

    Raises:
        BodyEncodingError: 415 for an unknown token or more than
            :data:`MAX_CONTENT_CODINGS` codings.
    """
    if not value:
        return ()
    codings: list[str] = []
    for raw in value.split(","):
        token = raw.strip().lower()
        if not token or token == "identity":
            continue
        if token not in SUPPORTED_CODINGS:
            shown = token if len(token) <= 32 else token[:32] + "..."
            raise BodyEncodingError.unsupported(f"unsupported Content-Encoding {shown!r}")
        codings.append("gzip" if token == "x-gzip" else token)
    if len(codings) > MAX_CONTENT_CODINGS:
        raise BodyEncodingError.unsupported(
            f"more than {MAX_CONTENT_CODINGS} stacked content codings"
        )
    return tuple(codings)


def encoded_size_cap(limit: int) -> int:
    """Most bytes an encoded form of a body of at most ``limit`` bytes may take.

    Incompressible data grows by a few bytes per block when coded (deflate stored
    blocks: 5 bytes per 64 KiB; zstd raw blocks: 3 per 128 KiB; brotli
    uncompressed meta-blocks less), plus a header; ``limit / 64 + 64 KiB`` covers
    that with room to spare. Wire bytes and intermediate layers of a stacked
    coding are held to this cap, so a stream that inflates into padding (a zstd
    skippable frame, a gzip comment) cannot make the reader work forever.
    """
    return limit + limit // 64 + 64 * 1024


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


# --------------------------------------------------------------------------- the sink


class _Sink:
    """The one decoded-body buffer, its running digest and the decoded-size limit.

    ``presize`` (the declared length of an identity body) is allocated on the
    first write, not up front: a client that sends headers and then nothing
    costs no memory while the idle timeout runs.
    """

    __slots__ = ("_buf", "_hasher", "_limit", "_presize", "_size")

    def __init__(self, limit: int, presize: int | None) -> None:
        self._buf = bytearray()
        self._hasher = xxhash.xxh3_128()
        self._limit = limit
        self._presize = presize or 0
        self._size = 0

    def write(self, data: bytes) -> None:
        """Append ``data``; raises BodyTooLarge (413) instead of passing the limit."""
        end = self._size + len(data)
        if end > self._limit:
            raise BodyTooLarge(self._limit)
        if self._presize:
            self._buf = bytearray(self._presize)
            self._presize = 0
        # One copy: into a pre-sized buffer this is a memcpy, past its end (no
        # declared length) it is an amortised append.
        self._buf[self._size : end] = data
        self._hasher.update(data)
        self._size = end

    def take(self) -> tuple[bytearray, str]:
        """Hand the buffer and the hex digest to the caller; the sink keeps nothing."""
        buf = self._buf
        self._buf = bytearray()
        return buf, self._hasher.hexdigest()

    def release(self) -> None:
        """Free the buffer's storage even if some frame still references the object."""
        del self._buf[:]
        self._buf = bytearray()
        self._presize = 0


# --------------------------------------------------------------------------- decoders

_Emit = Callable[[bytes], None]


class _Stage:
    """One content-coding decoder in a chain: input in, bounded pieces out to ``emit``.

    ``piece`` bounds the bytes one decoder call may produce; ``cap`` bounds the
    total this stage produces (413 past it). ``feed`` and ``finish`` raise
    BodyEncodingError (400) for corrupt or truncated data and let the limit
    errors of later stages through.
    """

    __slots__ = ("_cap", "_coding", "_emit", "_fed", "_limit", "_piece", "_produced")

    def __init__(self, coding: str, emit: _Emit, *, piece: int, cap: int, limit: int) -> None:
        self._coding = coding
        self._emit = emit
        self._piece = piece
        self._cap = cap
        self._limit = limit
        self._produced = 0
        self._fed = False

    def _push(self, out: bytes) -> None:
        self._produced += len(out)
        if self._produced > self._cap:
            raise BodyTooLarge(self._limit)
        self._emit(out)

    def feed(self, data: bytes) -> None:
        raise NotImplementedError

    def finish(self) -> None:
        raise NotImplementedError

    def _truncated(self) -> BodyEncodingError:
        return BodyEncodingError.corrupt(self._coding, "ends before the end of its")


def _looks_like_zlib(b0: int, b1: int) -> bool:
    """RFC 1950 section 2.2: CM = 8 (deflate), CINFO <= 7, and CMF*256 + FLG divisible by 31."""
    return (b0 & 0x0F) == 8 and (b0 >> 4) <= 7 and ((b0 << 8) | b1) % 31 == 0


class _ZlibStage(_Stage):
    """gzip (RFC 1952, members may be concatenated) or deflate.

    ``deflate`` is meant to be zlib-wrapped (RFC 9110 section 8.4.1.2) but some
    clients send raw deflate; like browsers, the first two bytes decide. Output
    is bounded with ``max_length``: what did not fit stays in ``unconsumed_tail``
    and zlib's window and is drained before more input is given.
    """

    __slots__ = ("_d", "_head", "_multi", "_wbits")

    def __init__(self, coding: str, emit: _Emit, *, piece: int, cap: int, limit: int) -> None:
        super().__init__(coding, emit, piece=piece, cap=cap, limit=limit)
        self._multi = coding == "gzip"
        # gzip framing; for deflate the first two bytes decide (see feed).
        self._wbits = 16 + zlib.MAX_WBITS if self._multi else 0
        self._d = zlib.decompressobj(self._wbits) if self._multi else None
        self._head = b""

    def feed(self, data: bytes) -> None:
        if not data:
            return
        self._fed = True
        if self._d is None:
            head = self._head + data[:2]
            if len(head) < 2:
                self._head = head
                return
            self._wbits = zlib.MAX_WBITS if _looks_like_zlib(head[0], head[1]) else -zlib.MAX_WBITS
            self._d = zlib.decompressobj(self._wbits)
            pending, self._head = self._head, b""
            if pending:
                self._run(pending)
        self._run(data)

    def _run(self, data: bytes) -> None:
        more = True
        while more:
            d = self._d
            assert d is not None
            if d.eof:
                if not self._multi:
                    raise BodyEncodingError.corrupt(self._coding, "has bytes after the end of its")
                d = self._d = zlib.decompressobj(self._wbits)
            try:
                out = d.decompress(data, self._piece)
            except zlib.error:
                raise BodyEncodingError.corrupt(self._coding) from None
            if out:
                self._push(out)
            if d.eof:
                data = d.unused_data
                more = bool(data)
            else:
                data = d.unconsumed_tail
                # A full piece may leave output in zlib's window with no input left.
                more = bool(data) or len(out) == self._piece

    def finish(self) -> None:
        if self._fed and (self._d is None or not self._d.eof):
            raise self._truncated()


class _BrotliStage(_Stage):
    """br (RFC 7932) with brotli 1.2's ``output_buffer_limit``.

    brotli grows its output in blocks and stops growing once past the limit, so a
    call returns up to about twice the limit: ask for half a piece. After a call
    that hit the limit it must be called with empty input until
    ``can_accept_more_data()``; output can remain buffered even then, so each feed
    drains until a call returns nothing.
    """

    __slots__ = ("_d",)

    def __init__(self, coding: str, emit: _Emit, *, piece: int, cap: int, limit: int) -> None:
        super().__init__(coding, emit, piece=piece, cap=cap, limit=limit)
        self._d = brotli.Decompressor()

    def feed(self, data: bytes) -> None:
        if not data:
            return
        self._fed = True
        try:
            out = self._d.process(data, output_buffer_limit=self._piece // 2)
        except brotli.error:
            raise BodyEncodingError.corrupt(self._coding) from None
        if out:
            self._push(out)
        self._drain()

    def _drain(self) -> None:
        d = self._d
        while True:
            try:
                out = d.process(b"", output_buffer_limit=self._piece // 2)
            except brotli.error:
                raise BodyEncodingError.corrupt(self._coding) from None
            if out:
                self._push(out)
            elif d.can_accept_more_data() or d.is_finished():
                return
            else:
                # Would loop forever: the decoder neither yields nor takes input.
                raise BodyEncodingError.corrupt(self._coding)

    def finish(self) -> None:
        if not self._fed:
            return
        self._drain()
        if not self._d.is_finished():
            raise self._truncated()


# Frame walker states (RFC 8878 section 3.1). Value states collect a little-endian
# field; skip states pass over a counted run of bytes.
_Z_MAGIC, _Z_DESCRIPTOR, _Z_BLOCK_HEADER, _Z_SKIP_SIZE = 0, 1, 2, 3
_Z_HEADER_REST, _Z_BLOCK_BODY, _Z_CHECKSUM, _Z_SKIP_BODY = 4, 5, 6, 7
_ZSTD_MAGIC: Final = 0xFD2FB528
_ZSTD_SKIPPABLE_MASK: Final = 0xFFFFFFF0
_ZSTD_SKIPPABLE_MAGIC: Final = 0x184D2A50
_DID_BYTES: Final = (0, 1, 2, 4)
_FCS_BYTES: Final = (0, 2, 4, 8)


def _zstd_block(header: int) -> tuple[bool, int, int]:
    """(last, content bytes, most bytes regenerated) of a 3-byte zstd Block_Header.

    RFC 8878 section 3.1.1.2: bit 0 Last_Block, bits 1-2 Block_Type (0 raw, 1 RLE,
    2 compressed, 3 reserved), bits 3-23 Block_Size. Raises BodyEncodingError for
    a reserved type or a size above Block_Maximum_Size.
    """
    last = bool(header & 1)
    block_type = (header >> 1) & 3
    size = header >> 3
    if block_type == 3 or size > _ZSTD_BLOCK_MAX:
        raise BodyEncodingError.corrupt("zstd")
    if block_type == 1:
        return last, 1, size
    if block_type == 0:
        return last, size, size
    return last, size, _ZSTD_BLOCK_MAX


class _ZstdFramer:
    """Walks the zstd frame structure alongside the decoder to bound each call's output.

    ``ZstdDecompressionObj.decompress`` has no output limit: it returns everything
    the input decodes to, and an RLE block turns 4 bytes into 128 KiB. Walking
    block headers (never block contents) tells how much input to hand over so that
    one call regenerates at most about ``budget`` bytes, and whether the stream
    stopped between frames (complete) or inside one (truncated).
    """

    __slots__ = ("_block_out", "_checksum", "_field", "_last", "_need", "_state")

    def __init__(self) -> None:
        self._state = _Z_MAGIC
        self._need = 4
        self._field = bytearray()
        self._checksum = False
        self._last = False
        self._block_out = 0

    @property
    def between_frames(self) -> bool:
        """True when every frame seen so far is complete (the stream may end here)."""
        return self._state == _Z_MAGIC and not self._field

    def advance(self, data: memoryview, budget: int) -> int:
        """Consume a prefix of ``data`` that regenerates at most ``budget`` bytes.

        At least one byte is consumed; a prefix may exceed ``budget`` only by the
        single block it starts with (at most 128 KiB). Raises BodyEncodingError for
        an unknown frame magic or a malformed block header.
        """
        end = len(data)
        pos = 0
        spent = self._block_out if self._state == _Z_BLOCK_BODY else 0
        while pos < end:
            state = self._state
            if state >= _Z_HEADER_REST:
                take = min(self._need, end - pos)
                pos += take
                self._need -= take
                if not self._need:
                    self._after_skip()
                continue
            if state == _Z_BLOCK_HEADER and spent and not self._field and end - pos >= 3:
                header = int.from_bytes(data[pos : pos + 3], "little")
                if spent + _zstd_block(header)[2] > budget:
                    return pos
            take = min(self._need - len(self._field), end - pos)
            self._field += data[pos : pos + take]
            pos += take
            if len(self._field) == self._need:
                value = int.from_bytes(self._field, "little")
                self._field.clear()
                spent += self._on_field(state, value)
        return pos

    def _on_field(self, state: int, value: int) -> int:
        if state == _Z_MAGIC:
            if value == _ZSTD_MAGIC:
                self._goto(_Z_DESCRIPTOR, 1)
            elif (value & _ZSTD_SKIPPABLE_MASK) == _ZSTD_SKIPPABLE_MAGIC:
                self._goto(_Z_SKIP_SIZE, 4)
            else:
                raise BodyEncodingError.corrupt("zstd")
            return 0
        if state == _Z_DESCRIPTOR:
            # RFC 8878 section 3.1.1.1.1: FCS flag (bits 7-6), Single_Segment
            # (bit 5), Content_Checksum (bit 2), Dictionary_ID flag (bits 1-0).
            single = bool(value & 0x20)
            fcs = _FCS_BYTES[value >> 6] or (1 if single else 0)
            self._checksum = bool(value & 0x04)
            self._goto(_Z_HEADER_REST, (0 if single else 1) + _DID_BYTES[value & 3] + fcs)
            return 0
        if state == _Z_BLOCK_HEADER:
            self._last, content, regenerated = _zstd_block(value)
            self._block_out = regenerated
            self._goto(_Z_BLOCK_BODY, content)
            return regenerated
        self._goto(_Z_SKIP_BODY, value)
        return 0

    def _goto(self, state: int, need: int) -> None:
        self._state = state
        self._need = need
        if state >= _Z_HEADER_REST and not need:
            self._after_skip()

    def _after_skip(self) -> None:
        state = self._state
        self._block_out = 0
        if state == _Z_HEADER_REST or (state == _Z_BLOCK_BODY and not self._last):
            self._goto(_Z_BLOCK_HEADER, 3)
        elif state == _Z_BLOCK_BODY and self._checksum:
            self._goto(_Z_CHECKSUM, 4)
        else:
            self._goto(_Z_MAGIC, 4)


class _ZstdStage(_Stage):
    """zstd (RFC 8878): one or more frames, skippable frames allowed, window <= 8 MB."""

    __slots__ = ("_d", "_framer")

    def __init__(self, coding: str, emit: _Emit, *, piece: int, cap: int, limit: int) -> None:
        super().__init__(coding, emit, piece=piece, cap=cap, limit=limit)
        dctx = zstandard.ZstdDecompressor(max_window_size=ZSTD_MAX_WINDOW_BYTES)
        self._d = dctx.decompressobj(read_across_frames=True)
        self._framer = _ZstdFramer()

    def feed(self, data: bytes) -> None:
        if not data:
            return
        self._fed = True
        view = memoryview(data)
        pos = 0
        while pos < len(view):
            n = self._framer.advance(view[pos:], self._piece)
            try:
                out = self._d.decompress(view[pos : pos + n])
            except zstandard.ZstdError:
                raise BodyEncodingError.corrupt(self._coding) from None
            pos += n
            if out:
                self._push(out)

    def finish(self) -> None:
        if self._fed and not self._framer.between_frames:
            raise self._truncated()


_STAGES: Final[dict[str, type[_Stage]]] = {
    "gzip": _ZlibStage,
    "deflate": _ZlibStage,
    "br": _BrotliStage,
    "zstd": _ZstdStage,
}


class _Decoder:
    """The chain of stages for a stacked Content-Encoding, wire side first."""

    __slots__ = ("_stages",)

    def __init__(self, codings: tuple[str, ...], sink: _Emit, *, piece: int, limit: int) -> None:
        stages: list[_Stage] = []
        emit = sink
        cap = limit
        # The first coding applied is the last one undone: build from the sink out.
        for coding in codings:
            stage = _STAGES[coding](coding, emit, piece=piece, cap=cap, limit=limit)
            stages.append(stage)
            emit = stage.feed
            cap = encoded_size_cap(limit)
        stages.reverse()
        self._stages = stages

    def feed(self, data: bytes) -> None:
        self._stages[0].feed(data)

    def finish(self) -> None:
        # Each finish may flush output into the next stage, so go wire side first.
        for stage in self._stages:
            stage.finish()

    def release(self) -> None:
        self._stages = []


# --------------------------------------------------------------------------- reading


@dataclasses.dataclass(frozen=True, slots=True)
class ReadResult:
    """A body read to the end.

    Attributes:
        buffer: the decoded body, exactly its length; the only copy, owned by the caller.
        digest: hex xxh3_128 of ``buffer`` (DESIGN section 4), computed while reading.
        wire_bytes: bytes received on the wire (after transfer decoding, before
            content decoding); equals ``len(buffer)`` with no content coding.
    """

    buffer: bytearray
    digest: str
    wire_bytes: int


# What aiohttp puts into a request payload when the client goes away or breaks the
# framing: the protocol's ConnectionResetError("Connection lost"), the parser's
# ContentLengthError / TransferEncodingError (HttpProcessingError), client errors.
_PAYLOAD_ERRORS: Final = (
    HttpProcessingError,
    aiohttp.ClientError,
    OSError,
    asyncio.IncompleteReadError,
    EofStream,
)


async def read_body(
    content: aiohttp.StreamReader,
    *,
    content_length: int | None,
    content_encoding: str | None,
    limit: int,
    idle_timeout: float,
    chunk_bytes: int = DEFAULT_CHUNK_BYTES,
) -> ReadResult:
    """Read and decode a request body within ``limit`` bytes (DESIGN section 3).

    The server MUST run with ``auto_decompress=False`` (e.g.
    ``web.AppRunner(app, auto_decompress=False, handler_cancellation=True)``):
    otherwise aiohttp inflates the body itself, with no limit, before this
    function sees a byte, and the decoding done here would be applied twice.

    Args:
        content: ``request.content``; nothing else may read it concurrently. Never
            use aiohttp's ``Request.read()``: it caches a second copy on the request.
        content_length: ``request.content_length`` (bytes) or None for chunked.
        content_encoding: the ``Content-Encoding`` value or None; see
            :func:`parse_content_encoding` for the accepted codings.
        limit: largest decoded body accepted, in bytes (an exactly ``limit``-byte
            body passes).
        idle_timeout: seconds without a single body byte before giving up; the
            clock restarts on every chunk, so a slow but moving upload is fine.
        chunk_bytes: bytes asked of the payload per read (64-256 KiB is right);
            also roughly the largest decoded piece a decoder produces at once.

    Returns:
        ReadResult owning the only buffer.

    Raises:
        BodyTooLarge: 413, from the declared length before reading, or as soon as
            the decoded size (or the wire size of an encoded body, see
            :func:`encoded_size_cap`) passes the limit; reading stops there.
        BodyIncomplete: 400, the client closed or broke the framing mid-body.
        BodyTimeout: 408, no progress for ``idle_timeout`` seconds.
        BodyEncodingError: 415 for an unknown coding (before reading), 400 for
            corrupt or truncated coded data.
        asyncio.CancelledError: propagated unchanged (the handler was cancelled,
            usually because the client hung up); the caller logs it.
        ValueError: ``limit``, ``idle_timeout`` or ``chunk_bytes`` out of range.

    Whatever the outcome, nothing is left behind: the buffer is freed on failure
    (its storage released even if a frame still points at it), decoders and
    chunks are dropped, the one idle timer is cancelled, no task or callback is
    registered. After a BodyError the rest of the body is unread, so answer with
    ``Connection: close`` (``response.force_close()``) unless lingering is wanted.
    """
    if idle_timeout <= 0 or chunk_bytes <= 0:
        raise ValueError("idle_timeout and chunk_bytes must be > 0")
    codings = parse_content_encoding(content_encoding)
    _check_declared(content_length, codings, limit)
    sink = _Sink(limit, None if codings else content_length)
    decoder: _Decoder | None = None
    if codings:
        piece = max(chunk_bytes, _ZSTD_BLOCK_MAX)
        decoder = _Decoder(codings, sink.write, piece=piece, limit=limit)
    wire_cap = encoded_size_cap(limit) if codings else limit
    try:
        failure, wire_bytes = await _pump(
            content, sink, decoder, content_length, wire_cap, limit, idle_timeout, chunk_bytes
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
    buffer, digest = sink.take()
    return ReadResult(buffer=buffer, digest=digest, wire_bytes=wire_bytes)


async def _pump(
    content: aiohttp.StreamReader,
    sink: _Sink,
    decoder: _Decoder | None,
    expected: int | None,
    wire_cap: int,
    limit: int,
    idle_timeout: float,
    chunk_bytes: int,
) -> tuple[BodyError | None, int]:
    """Move the body from ``content`` into ``sink``: (error to raise or None, wire bytes).

    BodyErrors are returned, not raised, detached from their traceback so the
    caller can raise them outside any ``except`` block (no ``__context__``).
    """
    loop = asyncio.get_running_loop()
    wire = 0
    chunk = b""
    # One timer for the whole read, pushed back on each chunk: no task or timer
    # per read call.
    idle = asyncio.timeout(idle_timeout)
    try:
        async with idle:
            while True:
                try:
                    chunk = await content.read(chunk_bytes)
                except _PAYLOAD_ERRORS:
                    return BodyIncomplete(), wire
                if not chunk:
                    break
                wire += len(chunk)
                if wire > wire_cap:
                    return BodyTooLarge(limit), wire
                if decoder is None:
                    sink.write(chunk)
                else:
                    decoder.feed(chunk)
                chunk = b""
                idle.reschedule(loop.time() + idle_timeout)
        if expected is not None and wire != expected:
            return BodyIncomplete(), wire
        if decoder is not None:
            decoder.finish()
    except TimeoutError:
        if not idle.expired():
            raise
        return BodyTimeout(idle_timeout), wire
    except BodyError as exc:
        return _detached(exc), wire
    finally:
        chunk = b""
    return None, wire

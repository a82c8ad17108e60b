"""Content codings of request bodies, sans-I/O: parse, decode with bounded output, collect.

Pure: bytes in, bytes out; no sockets, no event loop, no clock. :mod:`proxy._body`
is the I/O edge that feeds it from a request payload (docs/design.md §3).

* :func:`parse_content_encoding` turns a ``Content-Encoding`` value into the
  codings to undo; :func:`encoded_size_cap` bounds the wire size of a coded body.
* :class:`ContentDecoder` undoes a stack of codings (gzip, deflate, br, zstd),
  handing out pieces of at most about one chunk each (zlib ``max_length``,
  brotli ``output_buffer_limit``, zstd by walking block headers), so a 1 KB
  bomb that would expand to gigabytes costs the limit plus a chunk or two
  before the 413.
* :class:`BodySink` is the one decoded-body buffer with its running xxh3_128
  digest and the decoded-size limit.

Errors are :class:`BodyError` subclasses carrying the HTTP status to answer:
:class:`BodyTooLarge` (413) and :class:`BodyEncodingError` (400 or 415).
"""

from __future__ import annotations

import ctypes
import zlib
from collections.abc import Callable, Iterator
from typing import Final, Protocol

import brotli
import xxhash
import zstandard

__all__ = [
    "MAX_CONTENT_CODINGS",
    "SUPPORTED_CODINGS",
    "ZSTD_BLOCK_MAX_BYTES",
    "ZSTD_MAX_WINDOW_BYTES",
    "BodyEncodingError",
    "BodyError",
    "BodySink",
    "BodyTooLarge",
    "ContentDecoder",
    "SpillTarget",
    "encoded_size_cap",
    "io_piece_bytes",
    "parse_content_encoding",
    "reserve",
]

MAX_CONTENT_CODINGS: Final = 4
"""Most stacked codings accepted (``gzip, br`` is 2); each one costs decoder state."""

SUPPORTED_CODINGS: Final = frozenset({"gzip", "x-gzip", "deflate", "br", "zstd"})
"""Content-Encoding tokens ContentDecoder undoes, lower case (``identity`` is skipped)."""

ZSTD_MAX_WINDOW_BYTES: Final = 8 * 1024 * 1024
"""Largest zstd window accepted: the 8 MB limit of the ``zstd`` HTTP content coding
(RFC 9659). A frame asking for more is a 400, so a 20-byte header cannot
make the decoder allocate hundreds of megabytes."""

ZSTD_BLOCK_MAX_BYTES: Final = 128 * 1024
"""Most bytes one zstd block regenerates, whatever its type (RFC 8878 section 3.1.1.2.4:
Block_Maximum_Size is min(Window_Size, 128 KB)); the smallest useful decoder piece."""

PIECES_PER_BODY: Final = 64
"""A body moves through I/O in pieces of about 1/64 of its size (:func:`io_piece_bytes`)."""

MIN_PIECE_BYTES: Final = 16 * 1024
"""The smallest I/O piece: below this the per-call cost outweighs the memory saved."""


def io_piece_bytes(body_bytes: int, most: int) -> int:
    """Bytes per I/O piece (a socket read from the client, a slice sent upstream) for a body.

    Each piece costs several transients beside the body's one buffer: a read,
    the transport's receive buffer, the HTTP parser's copy of the body part in
    it, what waits in the payload queue and the piece being copied into the
    body's buffer; a send, the transport's copy of a slice it could not send at
    once. They are freed heap that stays resident until the next
    ``malloc_trim``, so a fixed piece size is a fixed cost that a small body
    pays as a large share: at 256 KiB (asyncio's own read size) the pieces of a
    1 MiB body cost 0.6 of it, at 1/16 of the body still 0.25. At
    1/:data:`PIECES_PER_BODY` they stay within about 0.07 of it (measured with
    ``bench memory``), never under :data:`MIN_PIECE_BYTES` and never over ``most`` (the
    caller's cap, e.g. 256 KiB, which keeps large bodies to as few calls as
    before). A ``most`` under the floor wins (the caller asked for less). Both
    sizes in bytes; returns at least 1.
    """
    return max(1, min(most, max(MIN_PIECE_BYTES, body_bytes // PIECES_PER_BODY)))


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


# --------------------------------------------------------------------------- codings


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
            # The value is not echoed (a header value is never shown): name what is accepted.
            accepted = ", ".join(sorted(SUPPORTED_CODINGS | {"identity"}))
            raise BodyEncodingError.unsupported(
                f"unsupported Content-Encoding; accepted codings: {accepted}"
            )
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


# --------------------------------------------------------------------------- the sink


def _load_resize() -> Callable[[bytearray, int], int] | None:
    try:
        resize = ctypes.pythonapi.PyByteArray_Resize
    except AttributeError:  # not CPython
        return None
    resize.argtypes = [ctypes.py_object, ctypes.c_ssize_t]
    resize.restype = ctypes.c_int
    found: Callable[[bytearray, int], int] = resize
    return found


_resize: Final = _load_resize()


def reserve(size: int) -> bytearray:
    """A ``bytearray`` of ``size`` bytes whose storage is allocated but not written.

    ``bytearray(size)`` zero-fills, which makes every page resident at once: a
    client that declares 100 MB and sends one byte would cost 100 MB of RAM.
    CPython's ``PyByteArray_Resize`` on an empty array only allocates (``malloc``;
    at this size an anonymous mapping whose pages the kernel provides on first
    write), so memory becomes resident as the body is written into it. The
    contents are undefined until written: the caller must overwrite all
    ``size`` bytes before anyone reads them.

    Outside CPython this falls back to an empty array that the caller's slice
    assignments grow (amortised appends; still resident only as written).

    Raises:
        MemoryError: the address space could not be reserved.
    """
    buf = bytearray()
    _grow(buf, size)
    return buf


def _grow(buf: bytearray, size: int) -> None:
    """Make ``len(buf) == size`` (>= its length) without writing the new bytes.

    CPython allocates exactly ``size + 1`` bytes when ``size`` is more than 1.125
    times the current allocation and 1.125 x ``size`` otherwise; callers that
    care about the exact allocation grow by more than that factor.
    """
    if size > len(buf) and _resize is not None and _resize(buf, size) != 0:
        raise MemoryError(f"cannot reserve {size} bytes")


def _next_capacity(length: int, needed: int, limit: int) -> int:
    """Capacity in bytes to grow a ``length``-byte buffer to, to hold ``needed`` bytes.

    Geometric (x1.25 plus 4 KiB: amortised O(1) appends), never past ``limit``,
    and always more than 1.125 x the old size so that CPython allocates exactly
    what is asked (see :func:`_grow`). A step whose successor would land within
    1.125 x of ``limit`` goes to ``limit`` at once, so the last step is exact too:
    a buffer never holds more than ``limit`` bytes of storage.
    """
    capacity = max(needed, length + (length >> 2) + 4096)
    if capacity + (capacity >> 3) + 16 >= limit:
        capacity = limit
    return capacity


class SpillTarget(Protocol):
    """Where :class:`BodySink` moves a large body (``proxy._spool.SpoolFile``)."""

    def write(self, data: bytes | bytearray | memoryview, /) -> None:
        """Append all of ``data``; raises a :class:`BodyError` (a 503) when it cannot."""

    def close(self) -> object:
        """Close it and give its space back (idempotent)."""

    def map(self) -> memoryview:
        """The bytes written, as a read-only view (called once, after the last write)."""


class BodySink:
    """The one decoded-body buffer, its running digest and the decoded-size limit.

    Memory is resident for the bytes written so far, never for bytes only
    declared (docs/design.md §2, "reading"). ``presize`` (the declared length of
    an identity body) is reserved with :func:`reserve` on the first write,
    untouched, and filled in place by slice assignment, so an honestly sized
    body is one allocation of exactly its size and no copy on growth. Without
    ``presize`` (chunked or coded bodies) the buffer grows by appending; large
    blocks are separate mappings that ``realloc`` moves with ``mremap``, so
    growth does not copy either.

    With ``spill`` (docs/design.md §2, "the spool"), a body over
    ``spill_above`` bytes goes to the target ``spill()`` returns instead: from
    its first byte when ``presize`` is over it (nothing is reserved then), or,
    when the bytes written cross it, the heap part is copied there and freed at
    once. The digest covers every byte either way.
    """

    __slots__ = (
        "_buf",
        "_file",
        "_hasher",
        "_limit",
        "_presize",
        "_size",
        "_spill",
        "_spill_above",
    )

    def __init__(
        self,
        limit: int,
        presize: int | None,
        *,
        spill: Callable[[], SpillTarget] | None = None,
        spill_above: int = 0,
    ) -> None:
        """``limit``: largest body in bytes; ``presize``: declared exact size in bytes or None;
        ``spill``/``spill_above``: the spool and its threshold in bytes (0: never)."""
        self._buf = bytearray()
        self._hasher = xxhash.xxh3_128()
        self._limit = limit
        self._presize = presize or 0
        self._size = 0
        self._spill = spill if spill_above > 0 else None
        self._spill_above = spill_above
        self._file: SpillTarget | None = None
        if self._spill is not None and self._presize > spill_above:
            # Bound for the spool from its first byte: no heap reserved, none grown.
            self._presize = 0
            self._spill_above = 0

    @property
    def size(self) -> int:
        """Bytes written so far (the resident part of the buffer, or the spooled bytes)."""
        return self._size

    @property
    def spilled(self) -> SpillTarget | None:
        """The spill target once the body moved there, else ``None``."""
        return self._file

    def write(self, data: bytes) -> None:
        """Append ``data``; raises BodyTooLarge (413) instead of passing the limit, and
        whatever the spill target raises (a 503) when it cannot take the bytes."""
        end = self._size + len(data)
        if end > self._limit:
            raise BodyTooLarge(self._limit)
        if self._file is None and self._spill is not None and end > self._spill_above:
            self._move_to_spill()
        target = self._file
        if target is not None:
            target.write(data)
            self._hasher.update(data)
            self._size = end
            return
        buf = self._buf
        if self._presize:
            buf = self._buf = reserve(self._presize)
            self._presize = 0
        if end > len(buf):
            # No declared length (or a write past it): grow the storage, not
            # past the limit, leaving the new bytes unwritten until copied in.
            _grow(buf, _next_capacity(len(buf), end, self._limit))
        # One copy, a memcpy into storage already there (outside CPython, past
        # the end an amortised append).
        buf[self._size : end] = data
        self._hasher.update(data)
        self._size = end

    def _move_to_spill(self) -> None:
        """Open the spill target and move the heap part there (already hashed)."""
        assert self._spill is not None
        target = self._file = self._spill()
        if self._size:
            with memoryview(self._buf) as view:
                target.write(view[: self._size])
        del self._buf[:]
        self._buf = bytearray()
        self._presize = 0

    def take(self) -> tuple[bytearray, str]:
        """Hand the buffer (exactly the bytes written) and the hex digest over; keep nothing.

        For a spilled body the buffer is empty: the bytes are in :attr:`spilled`,
        which the caller now owns.
        """
        buf = self._buf
        self._buf = bytearray()
        self._file = None
        if len(buf) != self._size:
            # A reservation not filled to its end: never hand out undefined bytes.
            del buf[self._size :]
        return buf, self._hasher.hexdigest()

    def release(self) -> None:
        """Free the buffer's storage even if some frame still references the object,
        and close the spill target (its partial file goes)."""
        del self._buf[:]
        self._buf = bytearray()
        self._presize = 0
        target, self._file = self._file, None
        if target is not None:
            target.close()


# --------------------------------------------------------------------------- decoders

_Emit = Callable[[bytes], None]


class _Stage:
    """One content-coding decoder in a chain: input in, bounded pieces out, lazily.

    ``piece`` bounds the bytes one decoder call may produce; ``cap`` bounds the
    total this stage produces (413 past it, see :meth:`count`). :meth:`decode`
    and :meth:`flush` are generators: each decoder call runs when the next piece
    is asked for, so a consumer that takes one piece at a time holds one piece
    (and the input not yet decoded), never the whole output of its input. They
    raise BodyEncodingError (400) for corrupt or truncated data.
    """

    __slots__ = ("__weakref__", "_cap", "_coding", "_fed", "_limit", "_piece", "_produced")

    def __init__(self, coding: str, *, piece: int, cap: int, limit: int) -> None:
        self._coding = coding
        self._piece = piece
        self._cap = cap
        self._limit = limit
        self._produced = 0
        self._fed = False

    def count(self, out: bytes) -> None:
        """Book ``out`` as produced by this stage; BodyTooLarge (413) past its cap."""
        self._produced += len(out)
        if self._produced > self._cap:
            raise BodyTooLarge(self._limit)

    def decode(self, data: bytes) -> Iterator[bytes]:
        """The decoded pieces of the next input bytes (empty input: none)."""
        raise NotImplementedError

    def flush(self) -> Iterator[bytes]:
        """The input ended: what the codec still holds, then BodyEncodingError if unfinished."""
        raise NotImplementedError

    def _truncated(self) -> BodyEncodingError:
        return BodyEncodingError.corrupt(self._coding, "ends before the end of its")


# Compressed bytes handed to zlib per call (see _ZlibStage._run), and decoded
# bytes asked back: zlib builds its output in blocks and joins them, so a
# smaller piece also halves the transient copy. Calls are cheap at this size.
_ZLIB_SLICE: Final = 16 * 1024
_ZLIB_PIECE: Final = 64 * 1024


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

    def __init__(self, coding: str, *, piece: int, cap: int, limit: int) -> None:
        super().__init__(coding, piece=piece, cap=cap, limit=limit)
        self._multi = coding == "gzip"
        # gzip framing; for deflate the first two bytes decide (see feed).
        self._wbits = 16 + zlib.MAX_WBITS if self._multi else 0
        self._d = zlib.decompressobj(self._wbits) if self._multi else None
        self._head = b""

    def decode(self, data: bytes) -> Iterator[bytes]:
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
                yield from self._run(pending)
        yield from self._run(data)

    def _run(self, data: bytes) -> Iterator[bytes]:
        # Input goes in slices: zlib copies what a bounded call did not consume
        # into ``unconsumed_tail`` on every call, which for a bomb (one input byte
        # per thousand output bytes) would copy most of a chunk per piece.
        view = memoryview(data)
        for start in range(0, len(view), _ZLIB_SLICE):
            yield from self._run_slice(view[start : start + _ZLIB_SLICE])

    def _run_slice(self, data: bytes | memoryview) -> Iterator[bytes]:
        more = True
        while more:
            d = self._d
            assert d is not None
            if d.eof:
                if not self._multi:
                    raise BodyEncodingError.corrupt(self._coding, "has bytes after the end of its")
                d = self._d = zlib.decompressobj(self._wbits)
            try:
                out = d.decompress(data, _ZLIB_PIECE)
            except zlib.error:
                raise BodyEncodingError.corrupt(self._coding) from None
            if out:
                yield out
            if d.eof:
                data = d.unused_data
                more = bool(data)
            else:
                data = d.unconsumed_tail
                # A full piece may leave output in zlib's window with no input left.
                more = bool(data) or len(out) == _ZLIB_PIECE

    def flush(self) -> Iterator[bytes]:
        if self._fed and (self._d is None or not self._d.eof):
            raise self._truncated()
        yield from ()


class _BrotliStage(_Stage):
    """br (RFC 7932) with brotli 1.2's ``output_buffer_limit``.

    brotli grows its output in blocks and stops growing once past the limit, so a
    call returns up to about twice the limit: ask for half a piece. After a call
    that hit the limit it must be called with empty input until
    ``can_accept_more_data()``; output can remain buffered even then, so each feed
    drains until a call returns nothing.
    """

    __slots__ = ("_d",)

    def __init__(self, coding: str, *, piece: int, cap: int, limit: int) -> None:
        super().__init__(coding, piece=piece, cap=cap, limit=limit)
        self._d = brotli.Decompressor()

    def decode(self, data: bytes) -> Iterator[bytes]:
        if not data:
            return
        self._fed = True
        try:
            out = self._d.process(data, output_buffer_limit=self._piece // 2)
        except brotli.error:
            raise BodyEncodingError.corrupt(self._coding) from None
        if out:
            yield out
        yield from self._drain()

    def _drain(self) -> Iterator[bytes]:
        d = self._d
        while True:
            try:
                out = d.process(b"", output_buffer_limit=self._piece // 2)
            except brotli.error:
                raise BodyEncodingError.corrupt(self._coding) from None
            if out:
                yield out
            elif d.can_accept_more_data() or d.is_finished():
                return
            else:
                # Would loop forever: the decoder neither yields nor takes input.
                raise BodyEncodingError.corrupt(self._coding)

    def flush(self) -> Iterator[bytes]:
        if not self._fed:
            return
        yield from self._drain()
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
    if block_type == 3 or size > ZSTD_BLOCK_MAX_BYTES:
        raise BodyEncodingError.corrupt("zstd")
    if block_type == 1:
        return last, 1, size
    if block_type == 0:
        return last, size, size
    return last, size, ZSTD_BLOCK_MAX_BYTES


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

    def __init__(self, coding: str, *, piece: int, cap: int, limit: int) -> None:
        super().__init__(coding, piece=piece, cap=cap, limit=limit)
        dctx = zstandard.ZstdDecompressor(max_window_size=ZSTD_MAX_WINDOW_BYTES)
        self._d = dctx.decompressobj(read_across_frames=True)
        self._framer = _ZstdFramer()

    def decode(self, data: bytes) -> Iterator[bytes]:
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
                yield out

    def flush(self) -> Iterator[bytes]:
        if self._fed and not self._framer.between_frames:
            raise self._truncated()
        yield from ()


_STAGES: Final[dict[str, type[_Stage]]] = {
    "gzip": _ZlibStage,
    "deflate": _ZlibStage,
    "br": _BrotliStage,
    "zstd": _ZstdStage,
}


class ContentDecoder:
    """Undoes a stack of content codings: pushed to ``sink``, or pulled piece by piece.

    :meth:`feed` / :meth:`finish` hand every decoded piece to ``sink`` before
    they return; :meth:`pieces` / :meth:`end_pieces` decode only as far as the
    caller iterates, one decoder call per piece, so a consumer that forwards a
    piece before it asks for the next holds about one piece per stage however
    much the input expands (a decompression bomb).

    Args:
        codings: from :func:`parse_content_encoding`, in the order applied
            (``("gzip", "br")`` is undone br first); at least one.
        sink: called with each decoded piece, in order (e.g. ``BodySink.write``),
            by :meth:`feed` and :meth:`finish` (``None``: pull only);
            a piece is at most about ``piece`` bytes (one zstd block more at worst).
        piece: bytes one decoder call may produce; at least
            :data:`ZSTD_BLOCK_MAX_BYTES` keeps zstd within it.
        limit: largest decoded body in bytes; the output of every inner stage
            is held to :func:`encoded_size_cap` of it.

    ``feed`` and ``finish`` (and iterating ``pieces`` and ``end_pieces``) raise
    :class:`BodyEncodingError` (400) for corrupt or truncated data and
    :class:`BodyTooLarge` (413) past a cap; ``feed`` and ``finish`` pass on
    whatever ``sink`` raises. Each ``pieces`` iterator is used up before the
    next wire bytes are given. After :meth:`release` the decoder holds no codec
    state and must not be fed again.
    """

    # Weak-referenceable so tests can prove a read leaves no decoder alive.
    __slots__ = ("__weakref__", "_sink", "_stages")

    def __init__(
        self, codings: tuple[str, ...], sink: _Emit | None = None, *, piece: int, limit: int
    ) -> None:
        stages: list[_Stage] = []
        cap = limit
        # The first coding applied is the last one undone: built from the output
        # side out (only the innermost stage has the decoded body's limit as its cap).
        for coding in codings:
            stages.append(_STAGES[coding](coding, piece=piece, cap=cap, limit=limit))
            cap = encoded_size_cap(limit)
        stages.reverse()
        self._stages = stages
        self._sink = sink

    def pieces(self, data: bytes) -> Iterator[bytes]:
        """The decoded pieces of the next wire bytes (any split is fine), decoded as iterated."""
        return self._through(0, self._stages[0].decode(data))

    def end_pieces(self) -> Iterator[bytes]:
        """The wire ended: what the codecs still hold, decoded as iterated; then
        BodyEncodingError if a coding is unfinished."""
        # Each flush may yield output into the next stage, so go wire side first.
        for index, stage in enumerate(self._stages):
            yield from self._through(index, stage.flush())

    def _through(self, index: int, outs: Iterator[bytes]) -> Iterator[bytes]:
        """Stage ``index``'s pieces ``outs``, undone by the stages after it."""
        stage = self._stages[index]
        inner = index + 1
        for out in outs:
            stage.count(out)
            if inner == len(self._stages):
                yield out
            else:
                yield from self._through(inner, self._stages[inner].decode(out))

    def feed(self, data: bytes) -> None:
        """Decode the next wire bytes into ``sink`` (any split is fine; empty is a no-op)."""
        sink = self._sink
        assert sink is not None, "a pull-only decoder is read with pieces()"
        for out in self.pieces(data):
            sink(out)

    def finish(self) -> None:
        """The wire ended: flush into ``sink``, and raise BodyEncodingError if a coding
        is unfinished."""
        sink = self._sink
        assert sink is not None, "a pull-only decoder is read with end_pieces()"
        for out in self.end_pieces():
            sink(out)

    def release(self) -> None:
        """Drop every stage and its codec state (idempotent)."""
        self._stages = []

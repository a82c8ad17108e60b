"""The outbound body in send slices: views of the buffers it lives in, never joined.

An exchange's outbound body (the raw buffer, a :class:`~proxy._structure.Splice`
over it, or a re-serialized body) goes upstream as slices of
:func:`send_slice_bytes` (docs/design.md §1 step 5); the parts that are a spooled
body's bytes go as :class:`~proxy._spool.FileSlice` ranges of its file, sent with
``sendfile`` where the connection allows. Nothing here holds a buffer beyond
the pass that reads it: the exchange owns them (proxy/_exchange.py).
"""

from __future__ import annotations

from collections.abc import Callable, Generator, Iterator
from typing import Final

from ._coding import io_piece_bytes
from ._holders import BodyHolder
from ._spool import FileSlice, SpoolFile
from ._structure import Splice

__all__ = ["SEND_SLICE_MAX_BYTES", "SlicePass", "body_slices", "send_slice_bytes"]

#: Largest slice of the outbound body sent upstream at once. Python 3.11's socket
#: transport copies whatever it cannot send at once into its own buffer, so one
#: large ``bytes`` would be copied whole; slices bound that copy to one slice, and
#: a smaller body gets smaller slices (:func:`send_slice_bytes`).
SEND_SLICE_MAX_BYTES: Final = 256 * 1024


def send_slice_bytes(body_bytes: int) -> int:
    """Bytes per slice when sending a ``body_bytes``-byte outbound body upstream.

    1/64 of the body within [16 KiB, :data:`SEND_SLICE_MAX_BYTES`]
    (:func:`proxy._coding.io_piece_bytes`): the transport's copy of an unsent
    slice then costs at most 1/64 of the body.
    """
    return io_piece_bytes(body_bytes, SEND_SLICE_MAX_BYTES)


def body_slices(
    holder: BodyHolder | Splice, spool: SpoolFile | None, piece: int
) -> Generator[memoryview | FileSlice, None, None]:
    """``holder``'s bytes in order, as slices of at most ``piece`` bytes, no copy.

    ``spool``: the spool file ``holder`` is (a view of its mapping) or is spliced
    from, whose ranges go as :class:`~proxy._spool.FileSlice`; ``None`` for a
    heap body. A plain holder is not referenced past the start of the pass (its
    buffer may be released while the last slices are in flight; a view keeps
    what they need).
    """
    if spool is not None:
        if not isinstance(holder, Splice):
            del holder
            yield from spool.slices(0, spool.size, piece)
            return
        for segment, offset in zip(holder.segments, holder.offsets, strict=True):
            if offset is None:
                yield from _views(memoryview(segment), piece)
            else:
                yield from spool.slices(offset, offset + len(segment), piece)
        return
    if isinstance(holder, Splice):
        # Segment by segment, never joined; the slices are views of raw.
        yield from holder.chunks(piece)
        return
    view = memoryview(holder.data)
    del holder
    try:
        yield from _views(view, piece)
    finally:
        view.release()


Slices = Generator[memoryview | FileSlice, None, None]


class SlicePass:
    """One pass over a body's slices as an async iterator (``async for``, ``aclose()``):
    ``start()`` makes the slices at the first step, and whatever it raises is raised
    there. Not an async generator: the event loop keeps a weak set entry and a
    finalizer for each of those (one a request), and the slices need no await.
    """

    __slots__ = ("_slices", "_start")

    def __init__(self, start: Callable[[], Slices]) -> None:
        self._start: Callable[[], Slices] | None = start
        self._slices: Slices | None = None

    def __aiter__(self) -> SlicePass:
        return self

    async def __anext__(self) -> memoryview | FileSlice:
        slices = self._slices
        if slices is None:
            start, self._start = self._start, None
            if start is None:  # ended, or closed
                raise StopAsyncIteration
            slices = self._slices = start()
        try:
            return next(slices)
        except StopIteration:
            self._slices = None
            raise StopAsyncIteration from None

    async def aclose(self) -> None:
        """End the pass: its slices let go of the body (idempotent)."""
        self._start = None
        slices, self._slices = self._slices, None
        if slices is not None:
            slices.close()


def _views(view: memoryview, piece: int) -> Iterator[memoryview]:
    for start in range(0, len(view), piece):
        yield view[start : start + piece]

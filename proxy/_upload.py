"""Sending a request body to an upstream: :class:`FlowControl` and :func:`upload`.

The memory contract's side of the send (docs/design.md §1 and §2): the body goes
out as slices of the buffers it already lives in, a spooled one from its file
with ``sendfile``; what a transport cannot take at once is handed to it as a copy
of at most one slice, never as a view that would keep the body past the release
boundary.
"""

from __future__ import annotations

import asyncio
import os
import typing
from collections.abc import AsyncIterable, Callable
from typing import Final

from ._http1 import ClientConnection, ClientState
from ._spool import FileSlice

__all__ = ["FlowControl", "Piece", "upload"]

#: One piece of an outbound body: bytes in memory, or a range of a spooled body's
#: file (sent with ``sendfile`` on a plain TCP connection, see :func:`upload`).
Piece: typing.TypeAlias = memoryview | FileSlice

# A body of at most this many bytes leaves with the request head in one write.
_COALESCE_BYTES: Final = 16 * 1024

# Enum members read on every request, as module constants: an Enum class attribute
# is looked up through the enum metaclass's __getattr__ hook, many times a global's cost.
_SEND_BODY: Final = ClientState.SEND_BODY


class FlowControl:
    """Why one connection's reading or writing is paused, and the upload's one waiter.

    Reading pauses while the answer's unread body is over
    :data:`proxy._upstream.READ_HIGH_WATER_BYTES` (the reader resumes it); writing pauses while
    the transport's buffer is full (it says so). :meth:`wait_writable` returns
    when writing may go on, or when :meth:`interrupt` says the upload should look
    again (an answer came, the connection was lost).
    """

    __slots__ = ("_transport", "_waiter", "read_paused", "write_paused")

    def __init__(self, transport: asyncio.Transport) -> None:
        self._transport = transport
        self._waiter: asyncio.Future[None] | None = None
        self.read_paused = False
        self.write_paused = False

    def pause_reading(self) -> None:
        if not self.read_paused:
            self.read_paused = True
            self._transport.pause_reading()

    def resume_reading(self) -> None:
        if self.read_paused:
            self.read_paused = False
            self._transport.resume_reading()

    def pause_writing(self) -> None:
        self.write_paused = True

    def resume_writing(self) -> None:
        self.write_paused = False
        self.interrupt()

    def interrupt(self) -> None:
        """Wake the upload's wait, whatever the reason."""
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    async def wait_writable(self) -> None:
        """Wait once: until writing resumes or :meth:`interrupt` (the caller looks again)."""
        self._waiter = asyncio.get_running_loop().create_future()
        try:
            await self._waiter
        finally:
            self._waiter = None


async def upload(
    transport: asyncio.Transport,
    flow: FlowControl | None,
    machine: ClientConnection,
    head: bytes,
    body: AsyncIterable[Piece],
    body_bytes: int,
    over: Callable[[asyncio.Transport], bool],
) -> None:
    """Write the request ``head`` and the ``body_bytes`` of ``body``'s slices to
    ``transport``, waiting while it is full (``flow``), telling ``machine`` what went.

    ``over(transport)`` says the rest must not be sent; the upload then stops and
    the request is abandoned (the connection is not reused). The caller's rule: a
    final answer that is not a success (a 413, a 401, a redirect) ends the upload
    (RFC 9112 section 9.3 lets a client stop sending on a response that says the
    body is not wanted), a 2xx head (a server streaming before it reads) does not,
    and a lost connection does (no write goes to a closed transport).

    On a plain TCP connection whose transport has nothing buffered, a slice
    goes straight to the socket: a :class:`~proxy._spool.FileSlice` (a range
    of a spooled body) with ``os.sendfile`` (page cache to socket), a heap
    slice with ``os.write``; what the socket cannot take now goes to the
    transport as a copy, never as a view of the body, since some transports
    (uvloop's; asyncio's from Python 3.12) keep what they cannot send as the
    object given, which would keep the whole body past the release boundary.
    On TLS a heap slice is written as it is (encrypted into the TLS buffer at
    once), a spooled one as a copy.

    Raises:
        StateError: the slices do not add up to ``body_bytes`` (a caller's bug).
    """
    assert flow is not None
    pieces = aiter(body)
    # Declared here for the finally below (see there).
    piece: Piece | None = None
    view: memoryview | None = None
    rest: memoryview | None = None
    try:
        if body_bytes <= _COALESCE_BYTES:
            # A small body leaves with its head in one write (one syscall).
            parts = [head]
            async for piece in pieces:
                parts.append(bytes(piece.view if isinstance(piece, FileSlice) else piece))
                machine.send_body(len(parts[-1]))
                del piece
            transport.write(b"".join(parts))
            if machine.our_state is _SEND_BODY:
                machine.send_end()
            return
        transport.write(head)
        # Looked up only here: a small body (above) never goes to the socket directly.
        native = transport.get_extra_info("sslcontext") is None
        sock = transport.get_extra_info("socket") if native else None
        async for piece in pieces:
            while flow.write_paused and not over(transport):
                await flow.wait_writable()
            if over(transport):
                machine.abandon()
                return
            machine.send_body(len(piece))
            sent = 0
            if sock is not None and not transport.get_write_buffer_size():
                # Straight to the socket only behind an empty transport buffer,
                # so bytes keep their order; the transport writes the rest.
                try:
                    if isinstance(piece, FileSlice):
                        sent = os.sendfile(sock.fileno(), piece.fd, piece.offset, len(piece))
                    else:
                        sent = os.write(sock.fileno(), piece)
                except BlockingIOError:
                    sent = 0
                except OSError:
                    # A broken socket: the transport sees it on its next read.
                    machine.abandon()
                    return
            view = piece.view if isinstance(piece, FileSlice) else piece
            if sent < len(view):
                # A copy of the rest (at most one slice): uvloop and asyncio's
                # selector transports from Python 3.12 on keep what they cannot
                # send now as the object given, and a view there would keep the
                # whole body (its buffer, or the spool's mapping) past the
                # release boundary. TLS encrypts a heap slice at once: it gets
                # the view (a spooled one is copied all the same).
                rest = view[sent:]
                copy = sock is not None or isinstance(piece, FileSlice)
                transport.write(bytes(rest) if copy else rest)
                del rest
            del view
            del piece  # the transport copied what it could not send
        machine.send_end()
    finally:
        # An upload cut from outside (the head's deadline, the client gone) ends with an
        # exception whose traceback keeps this frame alive past the release boundary:
        # the slice in hand must not be among its locals (a view of a spooled body made
        # the mapping's close fail).
        piece = view = rest = None  # noqa: F841  (read by nobody: the traceback holds them)
        close = getattr(pieces, "aclose", None)
        if close is not None:
            await close()

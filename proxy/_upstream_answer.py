"""The answer an upstream request gives the relay: :class:`UpstreamAnswer`.

Apart from :mod:`proxy._upstream` (the connection that makes it) so that the
driver stays within its size; the answer reads, keeps and drops its connection
through :class:`AnswerSource`, what the driver's connection offers it.
"""

from __future__ import annotations

import typing
from collections.abc import Coroutine
from typing import Any, Final

from multidict import CIMultiDict, CIMultiDictProxy

from ._http1 import ClientConnection, Fault

__all__ = ["AnswerSource", "UpstreamAnswer"]

_NO_FIELDS: Final[CIMultiDictProxy[str]] = CIMultiDictProxy(CIMultiDict())


class AnswerSource(typing.Protocol):
    """What an :class:`UpstreamAnswer` needs of its connection (``proxy._upstream``'s)."""

    machine: ClientConnection
    #: The body's end was read; ``cut``: why the answer is unusable (``None``: it is not).
    ended: bool
    cut: Fault | None

    def read_body(self) -> Coroutine[Any, Any, bytes]:
        """The next body bytes, ``b""`` once it ended (see :meth:`UpstreamAnswer.read`)."""
        ...

    def finish(self) -> None:
        """Done with the answer: pool the connection if it can be reused."""
        ...

    def abort(self) -> None:
        """Close the connection now."""
        ...


class UpstreamAnswer:
    """An upstream answer whose head is here: status, header fields, the body to read.

    The body is read with :meth:`read` (pieces as they come, ``b""`` at its
    end); afterwards :meth:`release` keeps the connection for the next
    request, and :meth:`close` (for an answer not read to its end) drops it,
    which is how the upstream learns nobody reads on.
    """

    __slots__ = ("_conn", "content_type", "headers", "status", "wait_s")

    def __init__(
        self,
        conn: AnswerSource,
        status: int,
        fields: list[tuple[str, str]],
        wait_s: float | None = None,
    ) -> None:
        self._conn: AnswerSource | None = conn
        self.status = status
        #: Seconds from starting to send the request to the complete response head
        #: (nginx's ``$upstream_header_time``); ``None`` when not measured.
        self.wait_s = wait_s
        #: The answer's header fields (empty after :meth:`drop_head`).
        self.headers: CIMultiDictProxy[str] = CIMultiDictProxy(CIMultiDict(fields))
        raw_type = self.headers.get("Content-Type")
        #: The media type, lowercased, without parameters (``""``: no Content-Type).
        self.content_type = (
            raw_type.split(";", 1)[0].strip().lower() if raw_type is not None else ""
        )

    @property
    def arrived(self) -> bool:
        """Whether body bytes (or the body's end, or a failure) are here: a read will not wait."""
        conn = self._conn
        return conn is None or conn.machine.has_events or conn.ended or conn.cut is not None

    @property
    def ended(self) -> bool:
        """Whether the body's end was parsed (bytes may still wait to be read)."""
        conn = self._conn
        return conn is None or conn.machine.ended

    @property
    def at_eof(self) -> bool:
        """Whether the body ended and every byte of it was read."""
        conn = self._conn
        return conn is None or (conn.machine.ended and not conn.machine.buffered_bytes)

    def read(self) -> Coroutine[Any, Any, bytes]:
        """The next body bytes (all that are here, joined), ``b""`` once it ended (awaitable).

        The connection's own coroutine is handed over: an idle stream waits in
        one frame less (each is held per open stream).

        Raises:
            AnswerCut: the connection closed before the body's end, or its framing broke.
            IdleReadTimeout: nothing came for the pool's ``idle_read`` seconds.
        """
        conn = self._conn
        if conn is None:
            return _nothing()
        return conn.read_body()

    def drop_head(self) -> None:
        """Forget the header fields (the client's head was built from them); idempotent."""
        self.headers = _NO_FIELDS

    def release(self) -> None:
        """Done with the answer: keep the connection if the body was read to its end."""
        conn = self._conn
        if conn is not None:
            self._conn = None
            conn.finish()

    def close(self) -> None:
        """Drop the connection (the body may be unread); idempotent."""
        conn = self._conn
        if conn is not None:
            self._conn = None
            conn.abort()


async def _nothing() -> bytes:
    return b""

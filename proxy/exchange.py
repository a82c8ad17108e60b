"""The exchange: the one owner of every buffer of one request (DESIGN sections 1 and 2).

Every buffer an exchange holds is dropped in this file, and only here:

==========  ==============================================  ==========================
buffer      held from                                       dropped by
==========  ==============================================  ==========================
raw         :meth:`Exchange.attach_body` (the wire bytes)   :meth:`_drop_raw` (via
                                                            prepare, release, close)
parsed      :meth:`Exchange._prepare_at` (only when a       :meth:`release`, :meth:`close`
            plugin wants the body, or on refold)
outbound    raw itself, or the re-serialized body           :meth:`release` unless a
                                                            resend is still possible;
                                                            :meth:`drop_outbound`,
                                                            :meth:`close`
preparer    :meth:`Exchange.bind_preparer`                  :meth:`release`, :meth:`close`
==========  ==============================================  ==========================

``release()`` is the boundary: as soon as no refold can follow (the upstream
accepted the request: 2xx headers and, for Responses, output started; or it
answered an error that no refold can cure; or the fold levels are used up,
before the last send) the raw buffer, the parsed body
and the preparer go. It is idempotent, counts whether it really ran (exactly
once per exchange), and :meth:`Exchange.close`, which the handler calls in
``finally``, runs it on every early exit. Buffers live in small weak-referenceable
holders (``bytes``, ``bytearray`` and ``dict`` cannot be weak-referenced) so
tests can put a finalizer on them.
"""

from __future__ import annotations

import contextlib
import dataclasses
import enum
import itertools
import logging
import time
from collections.abc import AsyncIterator, Callable
from contextlib import AbstractAsyncContextManager
from typing import Any, Final

import xxhash

from . import wire
from .plugins import ExchangeRecord, PluginHost, PrepareContext
from .protocols import Protocol
from .wire import WireMetadata

__all__ = [
    "BodyHolder",
    "Exchange",
    "HeldBytes",
    "ParsedHolder",
    "Phase",
    "Preparer",
]

log = logging.getLogger("context_proxy.exchange")

_ids = itertools.count(1)

#: Slice size for sending the outbound body upstream. Python 3.11's socket
#: transport copies whatever it cannot send at once into its own buffer, so one
#: large ``bytes`` would be copied whole; slices bound that copy to one slice.
SEND_SLICE_BYTES: Final = 256 * 1024


class Phase(enum.Enum):
    """Where an exchange is in its life.

    Phases move forward in the order listed, with two loops back: a refold
    goes from ``sent`` to ``prepared`` again, and a fake-completion resend
    from ``accepted`` to ``sent``.
    """

    READING = "reading"
    PARSED = "parsed"
    PREPARED = "prepared"
    SENT = "sent"
    ACCEPTED = "accepted"
    STREAMING = "streaming"
    COMMITTED = "committed"
    CLOSED = "closed"


class BodyHolder:
    """Weak-referenceable owner of one body buffer (``bytes`` or ``bytearray``)."""

    __slots__ = ("__weakref__", "data")

    def __init__(self, data: bytes | bytearray) -> None:
        self.data = data

    def __len__(self) -> int:
        return len(self.data)


class ParsedHolder:
    """Weak-referenceable owner of the parsed request body (a JSON object as ``dict``).

    ``estimate`` is the wire size the object was decoded from, in bytes: the
    object graph of a text-heavy JSON body is of the same order, and measuring
    it exactly would cost a walk over the whole body.
    """

    __slots__ = ("__weakref__", "body", "estimate")

    def __init__(self, body: dict[str, Any], estimate: int) -> None:
        self.body = body
        self.estimate = estimate


@dataclasses.dataclass(frozen=True, slots=True)
class HeldBytes:
    """Bytes an exchange holds right now, by kind. ``parsed`` is an estimate."""

    raw: int
    parsed: int
    outbound: int

    @property
    def total(self) -> int:
        """``raw + parsed + outbound`` in bytes."""
        return self.raw + self.parsed + self.outbound


class Preparer:
    """The prepare closure: what an exchange needs to run ``prepare`` hooks again.

    ``lock`` returns the session's lock context (or a null context when the
    request has no session); prepare hooks run inside it (DESIGN section 6,
    rule 2). Dropped at release so nothing it reaches outlives the boundary.
    """

    __slots__ = ("host", "lock", "session_id")

    def __init__(
        self,
        host: PluginHost,
        lock: Callable[[], AbstractAsyncContextManager[object]],
        session_id: str | None,
    ) -> None:
        self.host = host
        self.lock = lock
        self.session_id = session_id


class Exchange:
    """One request's buffers, phase and bookkeeping scalars.

    Built by the app when a request arrives; driven by the relay; closed in the
    handler's ``finally``. All sizes are bytes, times seconds (monotonic unless
    named ``*_wall``).

    Args:
        protocol: the request's protocol.
        method: HTTP method.
        path: request path (no query string).
        query: the raw query string ('' when none), forwarded unchanged.
        keep_for_resend: keep the outbound body after release while a
            fake-completion retry may still resend it.
        on_release: called with the number of bytes each drop let go (the
            app hands them to :class:`proxy._alloc.Allocator` so freed pages
            go back to the OS).
    """

    __slots__ = (
        "_outbound",
        "_parsed",
        "_preparer",
        "_raw",
        "error",
        "fold_level",
        "id",
        "keep_for_resend",
        "meta",
        "method",
        "on_release",
        "outbound_digest",
        "outbound_size",
        "outcome",
        "path",
        "phase",
        "protocol",
        "query",
        "reading_bytes",
        "refolds",
        "releases",
        "response_bytes",
        "retries",
        "session_id",
        "started",
        "started_wall",
        "status",
        "ttfb",
        "usage",
    )

    def __init__(
        self,
        *,
        protocol: Protocol,
        method: str,
        path: str,
        query: str = "",
        keep_for_resend: bool = False,
        on_release: Callable[[int], object] | None = None,
    ) -> None:
        self.id: Final = f"ex-{next(_ids)}"
        self.protocol: Final = protocol
        self.method: Final = method
        self.path: Final = path
        self.query: Final = query
        self.keep_for_resend = keep_for_resend
        self.on_release = on_release
        #: While reading: the body bytes admitted for this request (its declared
        #: length), counted as ``raw`` by :meth:`held_bytes` until the body arrives.
        self.reading_bytes = 0
        self.phase = Phase.READING
        self.started: Final = time.monotonic()
        self.started_wall: Final = time.time()
        self._raw: BodyHolder | None = None
        self._parsed: ParsedHolder | None = None
        self._outbound: BodyHolder | None = None
        self._preparer: Preparer | None = None
        self.meta: WireMetadata | None = None
        self.session_id: str | None = None
        self.fold_level = 0
        self.refolds = 0
        self.retries = 0
        self.releases = 0
        self.outbound_size = 0
        self.outbound_digest: str | None = None
        self.status = 0
        self.outcome = "ok"
        self.error: str | None = None
        self.response_bytes = 0
        self.ttfb: float | None = None
        self.usage: tuple[int | None, int | None, int | None] = (None, None, None)

    # ------------------------------------------------------------------ reading

    def attach_body(self, buffer: bytearray, meta: WireMetadata) -> None:
        """Take ownership of the body read from the wire and its metadata.

        The raw buffer is the outbound body until a plugin changes the body.
        """
        self._raw = BodyHolder(buffer)
        self._outbound = self._raw
        self.outbound_size = len(buffer)
        self.outbound_digest = meta.digest
        self.meta = meta
        self.phase = Phase.PARSED

    def bind_preparer(self, preparer: Preparer) -> None:
        """Set the prepare closure used at fold level 0 and by every refold."""
        self._preparer = preparer
        self.session_id = preparer.session_id

    @property
    def raw_holder(self) -> BodyHolder | None:
        """The holder of the raw wire bytes, or ``None`` once dropped (for tests and metrics)."""
        return self._raw

    @property
    def parsed_holder(self) -> ParsedHolder | None:
        """The holder of the parsed body, or ``None`` when never parsed or dropped."""
        return self._parsed

    @property
    def can_refold(self) -> bool:
        """Whether a refold is still possible: the body was read and not released yet."""
        return self._preparer is not None and self.meta is not None

    @property
    def outbound_holder(self) -> BodyHolder | None:
        """The holder of the body to send upstream, or ``None`` once dropped."""
        return self._outbound

    # ---------------------------------------------------------------- preparing

    async def prepare(self) -> None:
        """Run the prepare hooks at fold level 0.

        Raises:
            RuntimeError: called without a body or after release.
            wire.WireError: a plugin wanted the body and it is not a JSON object.
        """
        await self._prepare_at(0)

    async def refold(self) -> bool:
        """Re-run prepare at the next fold level after a context overflow.

        Returns ``True`` when the outbound body changed and is smaller than
        before, i.e. a resend may succeed; ``False`` when nothing shrank (the
        caller then relays the upstream's error unchanged). ``refolds`` counts
        only the refolds that shrank the body, so upstream requests = 1 +
        ``refolds`` + ``retries``; ``fold_level`` counts every prepare run.
        """
        before = self.outbound_size
        changed = await self._prepare_at(self.fold_level + 1)
        shrank = changed and self.outbound_size < before
        if shrank:
            self.refolds += 1
        return shrank

    async def _prepare_at(self, level: int) -> bool:
        preparer, meta = self._preparer, self.meta
        if preparer is None or meta is None or self._outbound is None:
            raise RuntimeError(f"{self.id}: prepare after release or before the body was read")
        self.fold_level = level
        host = preparer.host
        wants = host.wants_body(meta, level)
        changed = False
        async with preparer.lock():
            if any(wants) and self._parsed is None:
                self._parse_raw()
            ctx = PrepareContext(
                meta=meta,
                fold_level=level,
                session_id=preparer.session_id,
                path=self.path,
                body=self._parsed.body if self._parsed is not None else None,
            )
            try:
                changed = await host.run_prepare(ctx, wants)
            finally:
                ctx._close()
        if changed:
            self._reserialize()
        self.phase = Phase.PREPARED
        return changed

    def _parse_raw(self) -> None:
        """Materialize the full parsed body from the raw bytes (once per exchange)."""
        raw = self._raw
        if raw is None:
            raise RuntimeError(f"{self.id}: the raw body is gone; cannot parse it again")
        self._parsed = ParsedHolder(wire.decode_body(raw.data), len(raw.data))

    def _reserialize(self) -> None:
        """A plugin changed the parsed body: it becomes the outbound body.

        The raw buffer is dropped first, so the peak is parsed + new outbound,
        not raw + parsed + outbound (the parsed object stays for refolds).
        """
        assert self._parsed is not None
        before = self._held_total()
        self._drop_raw()
        self._outbound = None
        self._freed(before)
        data = wire.encode_body(self._parsed.body)
        self._outbound = BodyHolder(data)
        self.outbound_size = len(data)
        self.outbound_digest = xxhash.xxh3_128_hexdigest(data)

    def _drop_raw(self) -> None:
        # When the raw buffer is also the outbound body, the outbound reference
        # keeps it alive on purpose (untouched bodies are forwarded as is).
        self._raw = None

    # ------------------------------------------------------------------ sending

    async def outbound_chunks(self) -> AsyncIterator[memoryview]:
        """The outbound body as ``memoryview`` slices of ``SEND_SLICE_BYTES``, no copy.

        Each call starts a fresh pass (a resend sends the same bytes again).

        Raises:
            RuntimeError: the outbound body was already released.
        """
        holder = self._outbound
        if holder is None:
            raise RuntimeError(f"{self.id}: outbound body already released")
        view = memoryview(holder.data)
        del holder
        try:
            for start in range(0, len(view), SEND_SLICE_BYTES):
                yield view[start : start + SEND_SLICE_BYTES]
        finally:
            view.release()

    def mark_sent(self) -> None:
        """The request went upstream (again, after a refold or retry)."""
        self.phase = Phase.SENT

    def accept(self) -> None:
        """The release boundary: the upstream accepted the request; no refold can follow."""
        self.release()
        self.phase = Phase.ACCEPTED

    def mark_streaming(self) -> None:
        """The first response byte is going to the client; no resend can follow."""
        if self._outbound is not None:
            self.drop_outbound()
        if self.ttfb is None:
            self.ttfb = time.monotonic() - self.started
        self.phase = Phase.STREAMING

    # ---------------------------------------------------------------- releasing

    def release(self, *, keep_outbound: bool = False) -> None:
        """Drop the raw buffer, the parsed body and the preparer; idempotent.

        Called as soon as no refold can follow: before the last send when the
        fold levels are used up (``keep_outbound=True``: that send still needs
        the outbound body), else at :meth:`accept`. The outbound body survives
        only while ``keep_outbound`` or ``keep_for_resend`` is set (a
        fake-completion retry may still resend it); a later call without them
        drops it. Its digest and size stay as scalars either way. ``releases``
        is 1 once the drop has run, and never more.
        """
        before = self._held_total()
        if not (self.keep_for_resend or keep_outbound):
            self._outbound = None
        if not self.releases:
            self.releases = 1
            self._preparer = None
            self._parsed = None
            self._drop_raw()
        self._freed(before)

    def drop_outbound(self) -> None:
        """No resend can follow any more: let the outbound body go."""
        before = self._held_total()
        self.keep_for_resend = False
        self._outbound = None
        self._drop_raw()
        self._freed(before)

    def close(self) -> None:
        """Final cleanup in the handler's ``finally``: nothing is held afterwards."""
        self.keep_for_resend = False
        self.release()
        before = self._held_total()
        self._outbound = None
        self._freed(before)
        self.phase = Phase.CLOSED

    def _held_total(self) -> int:
        return self._held_sum() if self.on_release is not None else 0

    def _held_sum(self) -> int:
        """``held_bytes().total`` without building the record (several calls per exchange)."""
        raw = len(self._raw) if self._raw is not None else self.reading_bytes
        parsed = self._parsed.estimate if self._parsed is not None else 0
        out = self._outbound
        outbound = len(out) if out is not None and out is not self._raw else 0
        return raw + parsed + outbound

    def _freed(self, before: int) -> None:
        """Tell ``on_release`` how many bytes the last drop let go (if any)."""
        if self.on_release is not None:
            freed = before - self._held_sum()
            if freed > 0:
                self.on_release(freed)

    def held_bytes(self) -> HeldBytes:
        """What this exchange holds now, by kind (the raw buffer counts once even
        when it is also the outbound body)."""
        raw = len(self._raw) if self._raw is not None else self.reading_bytes
        parsed = self._parsed.estimate if self._parsed is not None else 0
        out = self._outbound
        outbound = len(out) if out is not None and out is not self._raw else 0
        return HeldBytes(raw, parsed, outbound)

    # ------------------------------------------------------------- bookkeeping

    def commit_record(self) -> ExchangeRecord:
        """Enter the committed phase and return the scalars-only record for ``commit`` hooks."""
        self.phase = Phase.COMMITTED
        meta = self.meta
        input_tokens, output_tokens, cache_read = self.usage
        return ExchangeRecord(
            exchange_id=self.id,
            session_id=self.session_id,
            protocol=str(self.protocol),
            path=self.path,
            model=meta.model if meta else None,
            stream=meta.stream if meta else False,
            wire_digest=meta.digest if meta else "",
            comparable=meta.comparable if meta else False,
            message_count=meta.message_count if meta else 0,
            request_bytes=meta.byte_length if meta else 0,
            outbound_bytes=self.outbound_size,
            outbound_digest=self.outbound_digest,
            status=self.status,
            outcome=self.outcome,
            fold_level=self.fold_level,
            refolds=self.refolds,
            retries=self.retries,
            input_tokens=input_tokens,
            output_tokens=output_tokens,
            cache_read_tokens=cache_read,
            response_bytes=self.response_bytes,
            started_at=self.started_wall,
            ttfb_s=self.ttfb,
            duration_s=time.monotonic() - self.started,
            error=self.error,
        )

    def age(self) -> float:
        """Seconds since the request arrived."""
        return time.monotonic() - self.started

    def __repr__(self) -> str:
        return f"<Exchange {self.id} {self.protocol} {self.phase.value} held={self.held_bytes()}>"


def null_lock() -> AbstractAsyncContextManager[object]:
    """The lock context for a request without a session."""
    return contextlib.nullcontext()

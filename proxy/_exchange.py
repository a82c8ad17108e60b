"""The exchange: the one owner of every buffer of one request (docs/design.md §1 and §2).

Every buffer an exchange holds is dropped in this file, and only here (docs/design.md
§2, "Who drops what"). ``release()`` is the boundary: once no refold can follow (the
upstream accepted the request, or answered an error no refold can cure, or the fold
levels are used up before the last send) the raw buffer, the parsed body and the
preparer go; it runs exactly once, and :meth:`Exchange.close` (the handler's
``finally``) runs it on every early exit. The phases move along
:data:`proxy._phases.TRANSITIONS`; the scalars and the commit record are the
exchange's base (:class:`proxy._books.Books`). Running the ``prepare`` hooks
(:mod:`proxy._prepare`) and slicing the outbound body (:mod:`proxy._slices`) happen
elsewhere, and hand every buffer they make to the methods here.
"""

from __future__ import annotations

import time
import typing
from collections.abc import AsyncIterator, Callable, Generator, MutableMapping

import xxhash

from . import _wire as wire
from ._books import Books
from ._holders import BodyHolder, HeadHolder, HeldBytes, heap_parts, on_view
from ._phases import TRANSITIONS, IllegalTransition, Phase
from ._plugins import ExchangeRecord
from ._protocols import Protocol
from ._slices import SlicePass, body_slices, send_slice_bytes
from ._spool import FileSlice, SpoolFile
from ._structure import Draft, ParsedHolder, Splice
from ._wire import WireMetadata

__all__ = ["Exchange", "Observer", "Preparing"]

# Phases read on every request, as module constants: an Enum class attribute is looked
# up through the enum metaclass, many times a global's cost.
_READING, _PARSED, _PREPARED, _SENT = Phase.READING, Phase.PARSED, Phase.PREPARED, Phase.SENT
_ACCEPTED, _STREAMING, _COMMITTED = Phase.ACCEPTED, Phase.STREAMING, Phase.COMMITTED
_CLOSED = Phase.CLOSED

#: ``observer(exchange, old_phase, new_phase)``, called after every phase move.
Observer = Callable[["Exchange", Phase, Phase], object]


class Preparing(typing.Protocol):
    """The prepare closure kept until release (``proxy._prepare.Preparer``, not imported)."""

    session_id: str | None


class Exchange(Books):
    """One request's buffers and phase, over its bookkeeping scalars (:class:`Books`).

    Built by the app, driven by the relay, closed in the handler's ``finally``.
    Sizes are bytes. A phase move :data:`TRANSITIONS` does not allow raises
    :class:`IllegalTransition` from any method.

    Args:
        protocol, method, path, query: the request's (see :class:`Books`).
        keep_for_resend: keep the outbound body after release while a
            fake-completion retry may still resend it.
        on_release: called with the number of bytes each drop let go (the
            app hands them to :class:`proxy._alloc.Allocator` so freed pages
            go back to the OS).
        observer: called as ``observer(exchange, old_phase, new_phase)`` after
            every phase move (tests watch an exchange through it).
    """

    __slots__ = (
        "_draft",
        "_headers",
        "_outbound",
        "_parsed",
        "_phase",
        "_preparer",
        "_raw",
        "_spool",
        "keep_for_resend",
        "observer",
        "on_release",
        "releases",
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
        observer: Observer | None = None,
    ) -> None:
        super().__init__(protocol, method, path, query)
        self.keep_for_resend = keep_for_resend
        self.on_release = on_release
        self.observer = observer
        self._phase = _READING
        self._raw: BodyHolder | None = None
        self._parsed: ParsedHolder | None = None
        self._draft: Draft | None = None
        self._outbound: BodyHolder | Splice | None = None
        self._headers: MutableMapping[str, str] | None = None
        self._preparer: Preparing | None = None
        self._spool: SpoolFile | None = None
        self.releases = 0

    @property
    def phase(self) -> Phase:
        """The current phase; it changes only through the methods below."""
        return self._phase

    def _move(self, new: Phase) -> None:
        """Go to ``new`` (:meth:`_check`, inline), then tell the observer."""
        old = self._phase
        if new not in TRANSITIONS[old]:
            raise IllegalTransition(self.id, old, new)
        self._phase = new
        if self.observer is not None:
            self.observer(self, old, new)

    def _check(self, new: Phase) -> None:
        """Raise :class:`IllegalTransition`, before any work, if ``new`` is no legal move."""
        if new not in TRANSITIONS[self._phase]:
            raise IllegalTransition(self.id, self._phase, new)

    def start_reading(self, declared_bytes: int) -> None:
        """The body is being read; ``declared_bytes`` is its Content-Length (0: none).

        A declaration reserves no memory (docs/design.md §2): only bytes received
        (``count_received``) count as ``raw``. Raises ``IllegalTransition`` past ``reading``.
        """
        if self._phase is not _READING:
            raise IllegalTransition(self.id, self._phase, _READING)
        self.declared_bytes = declared_bytes
        self.reading_bytes = 0

    def adopt_spool(self, spool: SpoolFile) -> SpoolFile:
        """Own the spool file of the body being read, from its first byte; returns it. It is
        closed when neither raw nor the outbound body is a view of it, or in :meth:`close`."""
        self._spool = spool
        return spool

    @property
    def spool(self) -> SpoolFile | None:
        """The body's spool file while it is open (for tests and metrics), else ``None``."""
        return self._spool

    def attach_body(self, buffer: bytearray | memoryview, meta: WireMetadata) -> None:
        """Take the body read from the wire (for a spooled body, the read-only view of
        its file's mapping) and its metadata; raw is the outbound body until a plugin
        changes the body. Raises ``IllegalTransition`` past ``reading``."""
        self._check(_PARSED)
        self._raw = BodyHolder(buffer)
        self._outbound = self._raw
        self.outbound_size = len(buffer)
        self.outbound_digest = meta.digest
        self.meta = meta
        self._move(_PARSED)

    def bind_preparer(self, preparer: Preparing) -> None:
        """Set the prepare closure used at fold level 0 and by every refold."""
        self._preparer = preparer
        self.session_id = preparer.session_id

    @property
    def raw_holder(self) -> BodyHolder | None:
        """The holder of the raw wire bytes, or ``None`` once dropped (for tests and metrics)."""
        return self._raw

    @property
    def parsed_holder(self) -> ParsedHolder | None:
        """The parsed body's holder (while prepare runs: the one a plugin took), or ``None``."""
        if self._draft is not None and self._draft.object_holder is not None:
            return self._draft.object_holder
        return self._parsed

    @property
    def can_refold(self) -> bool:
        """Whether a refold is still possible: the body was read and not released yet."""
        return self._preparer is not None and self.meta is not None

    def attach_headers(self, headers: MutableMapping[str, str]) -> None:
        """Take the header fields to send upstream (every send, a resend too); they go
        with the outbound body, so an idle open stream keeps neither."""
        self._headers = headers

    @property
    def outbound_headers(self) -> MutableMapping[str, str] | None:
        """The header fields to send upstream, or ``None`` once dropped (no send can follow)."""
        return self._headers

    @property
    def outbound_holder(self) -> BodyHolder | Splice | None:
        """The body to send upstream (raw's holder, a splice over raw, or the
        re-serialized body's holder), or ``None`` once dropped."""
        return self._outbound

    @property
    def preparer(self) -> Preparing | None:
        """The prepare closure (``proxy._prepare.Preparer``), ``None`` once released."""
        return self._preparer

    def begin_prepare(self, level: int) -> WireMetadata:
        """A prepare run at fold ``level`` starts (``proxy._prepare``); returns the metadata.

        Raises:
            RuntimeError: no body was read, or it was released.
            IllegalTransition: the phase cannot move to ``prepared``.
        """
        meta = self.meta
        if self._preparer is None or meta is None or self._outbound is None:
            raise RuntimeError(f"{self.id}: prepare after release or before the body was read")
        self._check(_PREPARED)
        if self._raw is None and self._parsed is None:
            raise RuntimeError(f"{self.id}: the raw body is gone; cannot prepare again")
        self.fold_level = level
        return meta

    def open_draft(self) -> Draft:
        """The body as plugins see it during one run, until :meth:`close_draft`: the body
        as received (raw), or the object a whole-object edit of an earlier level made."""
        if self._raw is not None:
            draft = Draft(self.protocol, base=self._raw.data)
        else:
            assert self._parsed is not None  # begin_prepare checked one of them is there
            draft = Draft(self.protocol, obj=self._parsed)
        self._draft = draft
        return draft

    def close_draft(self) -> None:
        """The run's hooks are done: the draft and what it decoded go."""
        draft, self._draft = self._draft, None
        if draft is not None:
            draft.release()

    def end_prepare(self) -> None:
        """The prepare run is over: the phase becomes ``prepared``."""
        self._move(_PREPARED)

    def adopt_splice(self, splice: Splice) -> None:
        """Edits made through the view: the splice over raw becomes the outbound body. Raw
        stays (the splice is views of it; a refold splices it anew); the old outbound goes."""
        before = self._held_total()
        self._outbound = splice
        self.outbound_size = splice.nbytes
        self.outbound_digest = splice.digest
        self._freed(before)
        self._settle_spool()

    def adopt_object(self, parsed: ParsedHolder) -> None:
        """A plugin changed the whole parsed object: it becomes the outbound body.

        When :func:`wire.encodes_plainly` vouches for the object, the raw buffer
        (or the last outbound body) is dropped before the new body is serialized:
        the peak is parsed + new outbound, not raw + parsed + new outbound (~1 B
        less). Otherwise it is serialized first, so that an object a plugin left
        unserializable costs nothing: the body as before the run is still there.
        The parsed object stays for refolds.

        Raises:
            TypeError, ValueError, RecursionError, OverflowError: the object cannot
                be serialized (nothing was changed).
        """
        data = None if wire.encodes_plainly(parsed.body) else wire.encode_body(parsed.body)
        before = self._held_total()
        self._parsed = parsed
        self._raw = None
        self._outbound = None
        self._freed(before)
        self._settle_spool()
        if data is None:
            data = wire.encode_body(parsed.body)
        self._outbound = BodyHolder(data)
        self.outbound_size = len(data)
        self.outbound_digest = xxhash.xxh3_128_hexdigest(data)

    def discard_object(self, parsed: ParsedHolder) -> None:
        """Forget a whole-object edit that could not be serialized; the outbound body
        stays as before the run. The object kept from an earlier level was changed in
        place, so later refolds start from that level's serialization instead."""
        if parsed is not self._parsed:
            return  # a fresh decode of raw, held by nobody else
        before = self._held_total()
        self._parsed = None
        outbound = self._outbound
        if isinstance(outbound, BodyHolder):
            self._raw = outbound
        self._freed(before)

    def _on_spool(self, holder: BodyHolder | Splice | None) -> bool:
        """Whether ``holder`` is (or is spliced from) the spool file's mapping."""
        return on_view(holder, self._spool.view if self._spool is not None else None)

    def _settle_spool(self, *, closing: bool = False) -> None:
        """Close the spool file (mapping, descriptor, disk space) once neither raw nor
        the outbound body is a view of it; while it is being read, only ``closing``."""
        spool = self._spool
        if spool is None or self._on_spool(self._raw) or self._on_spool(self._outbound):
            return
        if spool.view is None and not closing:
            return  # still being written by the reader
        self._spool = None
        spool.close()
        if self.on_release is not None and spool.size:
            # Not heap itself, but reading, viewing and folding its bytes left freed
            # heap in proportion to them (read pieces, parse transients): the same
            # trim a heap body's release brings (proxy/_alloc.py).
            self.on_release(spool.size)

    def outbound_chunks(self) -> AsyncIterator[memoryview | FileSlice]:
        """The outbound body in slices (:func:`proxy._slices.body_slices`), no copy: an async
        iterator with ``aclose()``; each call starts a fresh pass (a resend sends the same
        bytes again). Its first step raises ``RuntimeError`` if the body was released."""
        return SlicePass(self._slices)

    def _slices(self) -> Generator[memoryview | FileSlice, None, None]:
        holder = self._outbound
        if holder is None:
            raise RuntimeError(f"{self.id}: outbound body already released")
        spool = self._spool if self._on_spool(holder) else None
        return body_slices(holder, spool, send_slice_bytes(self.outbound_size))

    def mark_sent(self) -> None:
        """The request went upstream (again, after a refold or retry)."""
        self._move(_SENT)

    def accept(self) -> None:
        """The release boundary: the upstream accepted the request; no refold can follow.
        Idempotent once accepted (a gated stream accepts again when its gate opens)."""
        if self._phase is _ACCEPTED:
            self.release()
            return
        self._check(_ACCEPTED)
        self.release()
        self._move(_ACCEPTED)

    def mark_streaming(self, *, upstream_head: HeadHolder | None = None) -> None:
        """The first response byte is going to the client; no resend can follow.
        ``upstream_head`` (the answer the client's head was built from) forgets its fields."""
        self._check(_STREAMING)
        if self._outbound is not None or self._headers is not None:
            self.drop_outbound()
        if upstream_head is not None:
            upstream_head.drop_head()
        if self.ttfb is None:
            self.ttfb = time.monotonic() - self.started
        self._move(_STREAMING)

    def release(self, *, keep_outbound: bool = False) -> None:
        """Drop the raw buffer, the parsed body and the preparer; idempotent.

        Called once no refold can follow: at :meth:`accept`, or before the last send
        when the fold levels are used up (``keep_outbound``: that send needs the body).
        The outbound body and its fields survive only while ``keep_outbound`` or
        ``keep_for_resend`` is set; their size and digest stay. ``releases`` is 1 after.
        """
        drops_outbound = not (self.keep_for_resend or keep_outbound) and (
            self._outbound is not None or self._headers is not None
        )
        if self.releases and not drops_outbound:
            # Released before and nothing more to let go (close() after accept()): no
            # held bytes change, so none are counted twice over.
            self._settle_spool()
            return
        before = self._held_total()
        if drops_outbound:
            self._outbound = None
            self._headers = None
        if not self.releases:
            self.releases = 1
            self._preparer = None
            self._parsed = None
            # When raw is also the outbound body, the outbound reference keeps it alive
            # on purpose (untouched bodies are forwarded as is).
            self._raw = None
        self._freed(before)
        self._settle_spool()

    def drop_outbound(self) -> None:
        """No resend can follow any more: let the outbound body and its header fields go."""
        before = self._held_total()
        self.keep_for_resend = False
        self._outbound = None
        self._headers = None
        self._raw = None
        self._freed(before)
        self._settle_spool()

    def close(self) -> None:
        """Final cleanup in the handler's ``finally``: nothing is held afterwards (idempotent)."""
        if self._phase is _CLOSED:
            return
        self.keep_for_resend = False
        # Drops the outbound body and its fields too (keep_for_resend is off now); what
        # the response side held is no heap of ours to report.
        self.release()
        self.response_held = 0
        # A body whose read failed never became raw: its partial file goes too.
        self._raw = None
        self._settle_spool(closing=True)
        self._move(_CLOSED)

    def _heap(self) -> tuple[int, int, int]:
        """Heap bytes held: ``(raw, parsed, outbound beyond raw)``, see ``heap_parts``."""
        # parsed_holder, inline: this runs around every drop (a few a request).
        draft, spool = self._draft, self._spool
        held = None if draft is None else draft.object_holder
        parsed = self._parsed if held is None else held
        view = spool.view if spool is not None else None
        return heap_parts(
            self._raw, parsed, self._outbound, view, spool is not None, self.reading_bytes
        )

    def _held_total(self) -> int:
        """``held_bytes().total`` when drops are reported (else 0: nothing compares it)."""
        return sum(self._heap()) if self.on_release is not None else 0

    def _freed(self, before: int) -> None:
        """Tell ``on_release`` how many bytes the last drop let go (if any)."""
        if self.on_release is not None:
            freed = before - sum(self._heap())
            if freed > 0:
                self.on_release(freed)

    def held_bytes(self) -> HeldBytes:
        """What this exchange holds now, by kind (the raw buffer counts once even
        when it is also the outbound body)."""
        spooled = self._spool.size if self._spool is not None else 0
        return HeldBytes(*self._heap(), self.response_held, spooled)

    def begin_commit(self) -> ExchangeRecord:
        """Enter the committed phase; the record for the ``commit`` hooks. Raises
        :class:`IllegalTransition` when already committed or closed (a commit runs once)."""
        self._move(_COMMITTED)
        return self.commit_record()

    def skip_commit(self) -> None:
        """Enter the committed phase without a record (no plugin has a ``commit`` hook);
        raises as :meth:`begin_commit`."""
        self._move(_COMMITTED)

    def __repr__(self) -> str:
        return f"<Exchange {self.id} {self.protocol} {self._phase.value} held={self.held_bytes()}>"

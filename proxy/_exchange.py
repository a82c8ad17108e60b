"""The exchange: the one owner of every buffer of one request (docs/design.md §1 and §2).

Every buffer an exchange holds is dropped in this file, and only here:

==========  ==============================================  ==========================
buffer      held from                                       dropped by
==========  ==============================================  ==========================
raw         :meth:`Exchange.attach_body` (the wire bytes)   :meth:`_drop_raw` (via
                                                            prepare, release, close)
draft       :meth:`Exchange.open_draft` (the body as        :meth:`close_draft`, at the
            plugins see it during one prepare run of        end of that run
            :mod:`proxy._prepare`: the structural view,
            or the parsed object)
parsed      :meth:`Exchange.adopt_object` (only when a      :meth:`release`, :meth:`close`
            plugin took the whole object and changed it)
outbound    raw itself; a :class:`~proxy._structure.Splice` :meth:`release` unless a
            (slices of raw plus replacement pieces: raw     resend is still possible;
            lives while it does); or the re-serialized      :meth:`drop_outbound`,
            body (whole-object path)                        :meth:`close`
preparer    :meth:`Exchange.bind_preparer`                  :meth:`release`, :meth:`close`
headers     :meth:`Exchange.attach_headers` (the header     with the outbound body:
            fields to send upstream, a copy built from      :meth:`release` unless a
            the client's; a resend sends them again)        resend is still possible;
                                                            :meth:`drop_outbound`,
                                                            :meth:`close`
head        the upstream answer's header fields (in the     :meth:`mark_streaming`,
            client's ``UpstreamAnswer``): read to build     through the answer's
            the client's response head, never again         ``drop_head()``
response    the relay's held stream head, JSON head and     the relay; accounted here
            partial-event tail (:meth:`hold_response`)      (``held_bytes().response``)
spool       :meth:`Exchange.adopt_spool` (a body over       :meth:`_settle_spool`, once
            ``spool_above_bytes``: its anonymous file from  neither raw nor the outbound
            the first byte; raw is then a view of its       body is a view of it (release,
            read-only mapping)                              drop_outbound, close)
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

The phase is a state machine: :data:`~proxy._phases.TRANSITIONS` lists every
legal move and any other raises :class:`~proxy._phases.IllegalTransition`. The
bookkeeping scalars (status, outcome, error, byte counts, usage, retries) and
the commit record are the exchange's base, :class:`proxy._books.Books`, written
only through its named methods. Running the ``prepare`` hooks is
:mod:`proxy._prepare`'s job and slicing the outbound body :mod:`proxy._slices`'s;
both hand every buffer they make to the methods here.
"""

from __future__ import annotations

import time
import typing
from collections.abc import AsyncIterator, Callable, MutableMapping

import xxhash

from . import _wire as wire
from ._books import Books
from ._holders import BodyHolder, HeadHolder, HeldBytes, heap_parts, on_view
from ._phases import TRANSITIONS, IllegalTransition, Phase
from ._plugins import ExchangeRecord
from ._plugins import Outcome as Outcome  # re-exported: the exchange machine sets it
from ._protocols import Protocol
from ._slices import SEND_SLICE_MAX_BYTES, body_slices, send_slice_bytes
from ._spool import FileSlice, SpoolFile
from ._structure import Draft, ParsedHolder, Splice
from ._wire import WireMetadata

__all__ = [
    "SEND_SLICE_MAX_BYTES",
    "TRANSITIONS",
    "BodyHolder",
    "Exchange",
    "HeadHolder",
    "HeldBytes",
    "IllegalTransition",
    "Observer",
    "Outcome",
    "Overflow",
    "ParsedHolder",
    "Phase",
    "Preparing",
    "send_slice_bytes",
]

#: ``observer(exchange, old_phase, new_phase)``, called after every phase move.
Observer = Callable[["Exchange", Phase, Phase], object]


#: ``(refused body bytes, prompt tokens, window tokens)`` a refold's hooks see
#: (``None`` for a figure the upstream's error did not state).
Overflow = tuple[int, int | None, int | None]


class Preparing(typing.Protocol):
    """The prepare closure an exchange keeps until release (``proxy._prepare.Preparer``).

    The exchange only holds and drops it: running the hooks is the preparer's job,
    and this module does not import it.
    """

    @property
    def session_id(self) -> str | None:
        """The session the hooks run for (``None``: none)."""

    async def run(self, ex: Exchange, level: int, overflow: Overflow | None) -> bool:
        """One prepare run at fold ``level``; whether the outbound body changed."""


class Exchange(Books):
    """One request's buffers and phase, over its bookkeeping scalars (:class:`Books`).

    Built by the app when a request arrives; driven by the relay; closed in the
    handler's ``finally``. All sizes are bytes.

    Args:
        protocol, method, path, query: the request's (see :class:`Books`).
        keep_for_resend: keep the outbound body after release while a
            fake-completion retry may still resend it.
        on_release: called with the number of bytes each drop let go (the
            app hands them to :class:`proxy._alloc.Allocator` so freed pages
            go back to the OS).
        observer: called as ``observer(exchange, old_phase, new_phase)`` after
            every phase move (tests watch an exchange through it).

    Raises:
        IllegalTransition: from any method whose phase move
            :data:`TRANSITIONS` does not allow.
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
        self._phase = Phase.READING
        self._raw: BodyHolder | None = None
        self._parsed: ParsedHolder | None = None
        self._draft: Draft | None = None
        self._outbound: BodyHolder | Splice | None = None
        self._headers: MutableMapping[str, str] | None = None
        self._preparer: Preparing | None = None
        self._spool: SpoolFile | None = None
        self.releases = 0

    # -------------------------------------------------------------------- phase

    @property
    def phase(self) -> Phase:
        """The current phase; it changes only through the methods below."""
        return self._phase

    def _move(self, new: Phase) -> None:
        """Go to ``new`` (:meth:`_check` first), then tell the observer."""
        old = self._phase
        self._check(new)
        self._phase = new
        if self.observer is not None:
            self.observer(self, old, new)

    def _check(self, new: Phase) -> None:
        """Raise :class:`IllegalTransition`, before any work, if ``new`` is no legal move."""
        if new not in TRANSITIONS[self._phase]:
            raise IllegalTransition(self.id, self._phase, new)

    # ------------------------------------------------------------------ reading

    def start_reading(self, declared_bytes: int) -> None:
        """The body is being read; ``declared_bytes`` is its Content-Length (0: none).

        A declaration reserves no memory (docs/design.md §2, "reading"), so it does
        not count as held: only bytes received (:meth:`count_received`) count as ``raw``.

        Raises:
            IllegalTransition: not in the ``reading`` phase.
        """
        if self._phase is not Phase.READING:
            raise IllegalTransition(self.id, self._phase, Phase.READING)
        self.declared_bytes = declared_bytes
        self.reading_bytes = 0

    def adopt_spool(self, spool: SpoolFile) -> SpoolFile:
        """Own the spool file of the body being read, from its first byte; returns it.

        From here on the exchange closes it, whatever happens: at the release
        boundary (or when the outbound body that is a view of it goes), or in
        :meth:`close`.
        """
        self._spool = spool
        return spool

    @property
    def spool(self) -> SpoolFile | None:
        """The body's spool file while it is open (for tests and metrics), else ``None``."""
        return self._spool

    def attach_body(self, buffer: bytearray | memoryview, meta: WireMetadata) -> None:
        """Take ownership of the body read from the wire and its metadata.

        The raw buffer is the outbound body until a plugin changes the body. A
        spooled body is the read-only view of its spool file's mapping
        (:meth:`adopt_spool` came first).

        Raises:
            IllegalTransition: not in the ``reading`` phase.
        """
        self._check(Phase.PARSED)
        self._raw = BodyHolder(buffer)
        self._outbound = self._raw
        self.outbound_size = len(buffer)
        self.outbound_digest = meta.digest
        self.meta = meta
        self._move(Phase.PARSED)

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
        """The holder of the parsed body (while prepare runs: the one a plugin took),
        or ``None`` when never parsed or dropped."""
        if self._draft is not None and self._draft.object_holder is not None:
            return self._draft.object_holder
        return self._parsed

    @property
    def can_refold(self) -> bool:
        """Whether a refold is still possible: the body was read and not released yet."""
        return self._preparer is not None and self.meta is not None

    def attach_headers(self, headers: MutableMapping[str, str]) -> None:
        """Take the header fields to send upstream (every send uses them, a resend too).

        They go with the outbound body: an idle open stream keeps neither.
        """
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

    # ---------------------------------------------------------------- preparing

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
        self._check(Phase.PREPARED)
        if self._raw is None and self._parsed is None:
            raise RuntimeError(f"{self.id}: the raw body is gone; cannot prepare again")
        self.fold_level = level
        return meta

    def open_draft(self) -> Draft:
        """The body as plugins see it during one run (close it with :meth:`close_draft`).

        Each run starts from the body as received (raw), or from the object a
        whole-object plugin changed at an earlier level (raw is gone then).
        """
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
        self._move(Phase.PREPARED)

    def adopt_splice(self, splice: Splice) -> None:
        """Edits made through the view: the splice over raw becomes the outbound body.

        Raw stays (the splice's slices are views of it; a refold builds a new
        splice from it); only the previous outbound body goes.
        """
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
        self._drop_raw()
        self._outbound = None
        self._freed(before)
        self._settle_spool()
        if data is None:
            data = wire.encode_body(parsed.body)
        self._outbound = BodyHolder(data)
        self.outbound_size = len(data)
        self.outbound_digest = xxhash.xxh3_128_hexdigest(data)

    def discard_object(self, parsed: ParsedHolder) -> None:
        """Forget a whole-object edit that could not be serialized.

        The outbound body stays as before the run. When ``parsed`` is the object
        kept from an earlier level it was changed in place, so later refolds
        start from the outbound body of that level instead (it is that object's
        serialization, a :class:`BodyHolder`).
        """
        if parsed is not self._parsed:
            return  # a fresh decode of raw, held by nobody else
        before = self._held_total()
        self._parsed = None
        outbound = self._outbound
        if isinstance(outbound, BodyHolder):
            self._raw = outbound
        self._freed(before)

    def _drop_raw(self) -> None:
        # When the raw buffer is also the outbound body, the outbound reference
        # keeps it alive on purpose (untouched bodies are forwarded as is).
        self._raw = None

    def _on_spool(self, holder: BodyHolder | Splice | None) -> bool:
        """Whether ``holder`` is (or is spliced from) the spool file's mapping."""
        return on_view(holder, self._raw_view)

    @property
    def _raw_view(self) -> memoryview | None:
        """The spooled body's view while the spool is open (the raw buffer as read)."""
        return self._spool.view if self._spool is not None else None

    def _settle_spool(self, *, closing: bool = False) -> None:
        """Close the spool file once neither raw nor the outbound body is a view of it.

        The one place it closes (the release boundary for the spooled bytes):
        the mapping and the descriptor go, and with them the disk space. While
        the body is still being read only ``closing`` (:meth:`close`) closes it.
        """
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

    # ------------------------------------------------------------------ sending

    async def outbound_chunks(self) -> AsyncIterator[memoryview | FileSlice]:
        """The outbound body in slices (:func:`proxy._slices.body_slices`), no copy; each
        call starts a fresh pass (a resend sends the same bytes again).

        Raises:
            RuntimeError: the outbound body was already released.
        """
        holder = self._outbound
        if holder is None:
            raise RuntimeError(f"{self.id}: outbound body already released")
        spool = self._spool if self._on_spool(holder) else None
        slices = body_slices(holder, spool, send_slice_bytes(self.outbound_size))
        del holder, spool
        try:
            for chunk in slices:
                yield chunk
        finally:
            slices.close()

    def mark_sent(self) -> None:
        """The request went upstream (again, after a refold or retry)."""
        self._move(Phase.SENT)

    def accept(self) -> None:
        """The release boundary: the upstream accepted the request; no refold can follow.

        Idempotent once accepted (a gated stream accepts again when its gate opens).
        """
        if self._phase is Phase.ACCEPTED:
            self.release()
            return
        self._check(Phase.ACCEPTED)
        self.release()
        self._move(Phase.ACCEPTED)

    def mark_streaming(self, *, upstream_head: HeadHolder | None = None) -> None:
        """The first response byte is going to the client; no resend can follow.

        ``upstream_head``, the upstream's answer whose head the client's response
        head was built from, forgets its header fields here.
        """
        self._check(Phase.STREAMING)
        if self._outbound is not None or self._headers is not None:
            self.drop_outbound()
        if upstream_head is not None:
            upstream_head.drop_head()
        if self.ttfb is None:
            self.ttfb = time.monotonic() - self.started
        self._move(Phase.STREAMING)

    # ---------------------------------------------------------------- releasing

    def release(self, *, keep_outbound: bool = False) -> None:
        """Drop the raw buffer, the parsed body and the preparer; idempotent.

        Called as soon as no refold can follow: before the last send when the
        fold levels are used up (``keep_outbound=True``: that send still needs
        the outbound body), else at :meth:`accept`. The outbound body and its
        header fields survive only while ``keep_outbound`` or ``keep_for_resend`` is set (a
        fake-completion retry may still resend it); a later call without them
        drops it. Its digest and size stay as scalars either way. ``releases``
        is 1 once the drop has run, and never more.
        """
        before = self._held_total()
        if not (self.keep_for_resend or keep_outbound):
            self._outbound = None
            self._headers = None
        if not self.releases:
            self.releases = 1
            self._preparer = None
            self._parsed = None
            self._drop_raw()
        self._freed(before)
        self._settle_spool()

    def drop_outbound(self) -> None:
        """No resend can follow any more: let the outbound body and its header fields go."""
        before = self._held_total()
        self.keep_for_resend = False
        self._outbound = None
        self._headers = None
        self._drop_raw()
        self._freed(before)
        self._settle_spool()

    def close(self) -> None:
        """Final cleanup in the handler's ``finally``: nothing is held afterwards.

        Idempotent: closing a closed exchange does nothing.
        """
        if self._phase is Phase.CLOSED:
            return
        self.keep_for_resend = False
        self.release()
        before = self._held_total()
        self._outbound = None
        self._headers = None
        self.response_held = 0
        self._freed(before)
        # A body whose read failed never became raw: its partial file goes too.
        self._raw = None
        self._settle_spool(closing=True)
        self._move(Phase.CLOSED)

    def _heap(self) -> tuple[int, int, int]:
        """Heap bytes held: ``(raw, parsed, outbound beyond raw)``, see ``heap_parts``."""
        raw, parsed, out, view = self._raw, self.parsed_holder, self._outbound, self._raw_view
        return heap_parts(raw, parsed, out, view, self._spool is not None, self.reading_bytes)

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
        self._move(Phase.COMMITTED)
        return self.commit_record()

    def skip_commit(self) -> None:
        """Enter the committed phase without a record (no plugin has a ``commit`` hook);
        raises as :meth:`begin_commit`."""
        self._move(Phase.COMMITTED)

    def __repr__(self) -> str:
        return f"<Exchange {self.id} {self.protocol} {self._phase.value} held={self.held_bytes()}>"

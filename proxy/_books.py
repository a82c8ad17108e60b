"""The scalars one exchange books: status, outcome, error, counts, usage, timings.

:class:`Books` is the part of :class:`proxy._exchange.Exchange` that holds no
buffer: the figures its commit record (``Exchange.commit_record``), the access
line, the metrics and the traces read. They are written through the named
methods here, or by the exchange's own methods where they follow a buffer (the
metadata, the outbound size and digest, the fold level, the bytes being read),
never assigned from outside. Sizes are bytes, times seconds (monotonic unless
named ``*_wall``).
"""

from __future__ import annotations

import itertools
import time
from typing import Final

from ._plugins import ExchangeRecord, Outcome
from ._protocols import Protocol, UsageReport
from ._wire import WireMetadata

__all__ = ["Books"]

_ids = itertools.count(1)
#: Usage before the upstream reported any (a NamedTuple: one shared value serves all).
_NO_USAGE: Final = UsageReport()

# Enum members read on every request, as module constants: an Enum class attribute
# is looked up through the enum metaclass's __getattr__ hook, many times a global's cost.
_OK: Final = Outcome.OK
_UPSTREAM_ERROR: Final = Outcome.UPSTREAM_ERROR
_CLIENT_GONE: Final = Outcome.CLIENT_GONE


class Books:
    """The bookkeeping scalars of one exchange (a base of ``Exchange``).

    Args:
        protocol: the request's protocol.
        method: HTTP method.
        path: request path (no query string).
        query: the raw query string ('' when none), forwarded unchanged.

    Attributes:
        id: ``ex-<n>``, unique in the process.
        meta: the body's wire metadata once read (``None``: no body parsed).
        received_bytes: once the read settled, the decoded body bytes received
            (0: no body), whether or not they made a request (invalid JSON, a
            body cut short are booked too).
        fold_level: the last prepare run's fold level.
        outbound_size, outbound_digest: the outbound body's size and digest
            (kept after the body itself is released).
        session_id: the session it belongs to, ``None`` until known (or none).
        status: the HTTP status the client got (or the upstream's last, while relaying).
        outcome: how it ended; ``error`` the error code or message with it.
        refolds: refolds that shrank the body; ``retries`` fake-completion resends.
        response_bytes: answer bytes handed to the client.
        ttfb: seconds from arrival to the first answer byte, ``None`` before it.
        upstream_status, upstream_s: the last upstream attempt's status and
            seconds from send to its head; ``None`` while nothing came back.
        usage: the token usage the upstream reported.
        started, started_wall: arrival (monotonic, wall clock).
    """

    __slots__ = (
        "_complete",
        "declared_bytes",
        "error",
        "fold_level",
        "id",
        "meta",
        "method",
        "outbound_digest",
        "outbound_size",
        "outcome",
        "path",
        "protocol",
        "query",
        "reading_bytes",
        "received_bytes",
        "refolds",
        "response_bytes",
        "response_held",
        "retries",
        "session_id",
        "started",
        "started_wall",
        "status",
        "ttfb",
        "upstream_s",
        "upstream_status",
        "usage",
    )

    def __init__(self, protocol: Protocol, method: str, path: str, query: str) -> None:
        self.id: Final = f"ex-{next(_ids)}"
        self.protocol: Final = protocol
        self.method: Final = method
        self.path: Final = path
        self.query: Final = query
        self.meta: WireMetadata | None = None
        #: While reading: the body's declared Content-Length (0: none), and the
        #: bytes received so far, which ``held_bytes()`` counts as ``raw``.
        self.declared_bytes = 0
        self.reading_bytes = 0
        self.received_bytes = 0
        #: Bytes the response side holds now (see :meth:`hold_response`).
        self.response_held = 0
        self.fold_level = 0
        self.outbound_size = 0
        self.outbound_digest: str | None = None
        self.started: Final = time.monotonic()
        self.started_wall: Final = time.time()
        self.session_id: str | None = None
        self.status = 0
        self.outcome = _OK
        self.error: str | None = None
        self._complete = False
        self.refolds = 0
        self.retries = 0
        self.response_bytes = 0
        self.ttfb: float | None = None
        self.upstream_status: int | None = None
        self.upstream_s: float | None = None
        self.usage = _NO_USAGE

    def count_received(self, nbytes: int) -> None:
        """The body buffer grew by ``nbytes`` bytes; they count as ``raw`` while reading."""
        self.reading_bytes += nbytes

    def end_reading(self) -> None:
        """The read settled (body, error or cancel): the bytes being read no longer count.

        They are kept as :attr:`received_bytes` (the access line's ``request_bytes``).
        """
        self.received_bytes = self.reading_bytes
        self.reading_bytes = 0

    def hold_response(self, nbytes: int) -> None:
        """The response side holds ``nbytes`` bytes now (stream head, JSON head,
        partial-event tail together); shown as ``held_bytes().response``."""
        self.response_held = nbytes

    def set_session(self, session_id: str | None) -> None:
        """The session this exchange belongs to (``None``: none), known once its body is read."""
        self.session_id = session_id

    def upstream_answered(self, status: int, wait_s: float | None = None) -> None:
        """The upstream's HTTP status for the current attempt (a refold or resend answers anew).

        ``wait_s``: seconds from send to the response head, for the access log.
        """
        self.status = status
        self.upstream_status = status
        self.upstream_s = wait_s

    def conclude(self, status: int, outcome: Outcome, error: str | None = None) -> None:
        """The final status, outcome and error when the proxy answers itself (a 4xx/5xx of ours)."""
        self.status = status
        self.outcome = outcome
        self.error = error

    def set_outcome(self, outcome: Outcome, error: str | None = None) -> None:
        """The outcome (and error message) without touching the status."""
        self.outcome = outcome
        self.error = error

    def response_complete(self) -> None:
        """Every byte of the answer was handed to the client's connection.

        After this a hang-up is no longer a failure of this exchange (see :meth:`client_gone`).
        """
        self._complete = True

    def client_gone(self) -> None:
        """The client hung up: the outcome becomes ``client_gone`` unless the answer was
        already complete, or the outcome already names a failure of the proxy's own side
        (an upstream that failed, a cancel, a rejection) that says more."""
        if not self._complete and self.outcome in (_OK, _UPSTREAM_ERROR):
            self.outcome = _CLIENT_GONE

    def count_refold(self) -> None:
        """One more refold that shrank the outbound body."""
        self.refolds += 1

    def count_retry(self) -> None:
        """One more fake-completion resend."""
        self.retries += 1

    def count_response_bytes(self, nbytes: int) -> None:
        """``nbytes`` more response bytes went to the client."""
        self.response_bytes += nbytes

    def set_usage(self, tokens: UsageReport) -> None:
        """Token usage the upstream reported (``None`` for a count it did not report),
        as :meth:`protocols.UsageMeter.totals` gives it."""
        self.usage = tokens

    def age(self) -> float:
        """Seconds since the request arrived."""
        return time.monotonic() - self.started

    def commit_record(self) -> ExchangeRecord:
        """The scalars-only record for ``commit`` hooks as of now (no phase change).

        Only an exchange route's parsed body has a digest (docs/plugins.md,
        "ExchangeRecord fields"): a request refused before its body was parsed,
        and a passthrough route (whose body is opaque to the proxy), get
        ``wire_digest`` ``""`` and ``outbound_digest`` ``None``, so no ledger gate
        compares them with a conversation's history. ``request_bytes`` is then the
        decoded body bytes received before the exchange ended (0 when none were).
        """
        meta = self.meta
        tokens = self.usage
        digest = meta.digest if meta is not None and self.protocol.is_exchange else ""
        return ExchangeRecord(
            exchange_id=self.id,
            session_id=self.session_id,
            protocol=self.protocol,
            path=self.path,
            model=meta.model if meta else None,
            stream=meta.stream if meta else False,
            wire_digest=digest,
            comparable=meta.comparable if meta else False,
            message_count=meta.message_count if meta else 0,
            request_bytes=meta.byte_length if meta else self.received_bytes,
            outbound_bytes=self.outbound_size,
            outbound_digest=self.outbound_digest if digest else None,
            status=self.status,
            outcome=self.outcome,
            fold_level=self.fold_level,
            refolds=self.refolds,
            retries=self.retries,
            input_tokens=tokens.input_tokens,
            output_tokens=tokens.output_tokens,
            cache_read_tokens=tokens.cache_read_tokens,
            cache_write_tokens=tokens.cache_write_tokens,
            cache_write_5m_tokens=tokens.cache_write_5m_tokens,
            cache_write_1h_tokens=tokens.cache_write_1h_tokens,
            response_bytes=self.response_bytes,
            started_at=self.started_wall,
            ttfb_s=self.ttfb,
            duration_s=time.monotonic() - self.started,
            error=self.error,
        )

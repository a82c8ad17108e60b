"""The application: routes, admission, the exchange handler, drain, shutdown.

``build_app(settings)`` returns a :class:`ProxyApp`; :func:`running` serves it
on the proxy's own HTTP/1.1 server edge (:mod:`proxy._front`: a client that
hangs up cancels its handler, which aborts the upstream request; bodies are
decoded by :mod:`proxy._body` under the size limit) and :func:`serve` runs it
until SIGTERM/SIGINT or ``POST /admin/shutdown`` and then drains
(docs/design.md §6, "Process shutdown").
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import time
import traceback
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from typing import TYPE_CHECKING, Final

from . import _fdlimit as fdlimit
from . import _logs as logs
from . import _protocols as protocols
from . import _wire as wire
from ._admin import admin_guard, admin_routes
from ._answer import SmallAnswer
from ._body import (
    BodyBusy,
    BodyError,
    BodyIncomplete,
    BodyMemory,
    check_content_length,
    read_body,
)
from ._cancel import PROXY_SHUTDOWN, orderly_cancel_reason
from ._config import ConfigError, Settings
from ._exchange import Exchange, Outcome, Phase, Preparer, null_lock
from ._front import Answer, Request, StreamAnswer
from ._headers import forward_headers
from ._listener import FrontServer
from ._plugins import PluginHost, load_plugins
from ._protocols import Protocol
from ._relay import ClientGone, Upstream, egress_problems, error_response, relay
from ._session_ids import resolve_session_id
from ._sessions import SessionClosed
from ._spool import SpoolBusy, SpoolFile, SpoolFull, SpoolNoDescriptor
from ._state import AppState
from ._tracing import ExchangeTrace, start_tracing

if TYPE_CHECKING:
    from opentelemetry.trace import TracerProvider

__all__ = ["AppState", "ProxyApp", "build_app", "running", "serve"]

log = logging.getLogger("context_proxy")

#: The error code of a request refused because its session's commits are behind
#: (``max_pending_commits``); such a refusal is not booked (see :func:`_book`).
_COMMIT_BACKLOG: Final = "commit_backlog"

#: Requests refused for want of memory: this line once per 10 s, then a count.
_MEMORY_REFUSED: Final = (
    "request refused with 503: memory could not be reserved (an address-space limit?)"
)

_BODY_METHODS: Final = frozenset({"POST", "PUT", "PATCH"})

#: Answered even on a connection accepted from the descriptor reserve (they need none).
_PROBES: Final = frozenset({"/healthz", "/readyz", "/metrics"})


def _reject(
    protocol: Protocol,
    status: int,
    message: str,
    state: AppState,
    *,
    code: str | None = None,
    retry_after: str | None = None,
    close: bool = False,
) -> SmallAnswer:
    """An error answer in the client's protocol; a 503 carries ``Retry-After``.

    ``retry_after`` (whole seconds, as sent) overrides the ``retry_after``
    setting, e.g. with a tombstone's remaining TTL. The connection closes after
    it when ``close`` is set or the proxy drains.
    """
    if retry_after is None and status == 503:
        retry_after = str(state.settings.retry_after)
    headers = {"Retry-After": retry_after} if retry_after is not None else None
    return error_response(
        protocol, status, message, code=code, headers=headers, close=close or state.draining
    )


async def handle_exchange(request: Request, state: AppState, *, shed: bool = False) -> Answer:
    """Proxy one request: admit, read the body, prepare, relay, commit.

    Every request routed to an exchange or a passthrough is booked once, whatever
    its end (:func:`_book`), except one refused while the proxy drains (the
    plugins may already have shut down) or for its session's commit backlog.
    ``shed``: the connection came from the descriptor reserve; the request is
    refused with 503 ``fd_reserve`` before its body is read (and booked).
    """
    settings = state.settings
    route = protocols.route(request.method, request.path, request.headers)
    if route is None:
        return error_response(Protocol.OPENAI, 404, f"unknown route {request.path}")
    protocol = route.protocol
    draining = state.draining
    ex = Exchange(
        protocol=protocol,
        method=request.method,
        path=request.path,
        query=request.query_string,
        keep_for_resend=settings.fake_completion_retries > 0,
        on_release=state.allocator.released,
    )
    # Each request runs in a task of its own: the id marks this task's records only.
    logs.EXCHANGE_ID.set(ex.id)
    task = asyncio.current_task()
    assert task is not None
    tracing = state.tracing
    trace = (
        None
        if tracing is None or draining
        else tracing.exchange(ex, request.headers, _peername(request))
    )
    state.exchanges[ex.id] = ex
    state.handlers.add(task)
    state.metrics.in_flight.inc()
    try:
        if draining:
            # Refused, logged and counted like any refusal, but not booked (_book).
            ex.conclude(503, Outcome.REJECTED, PROXY_SHUTDOWN.code)
            return _reject(protocol, 503, PROXY_SHUTDOWN.message, state, code=PROXY_SHUTDOWN.code)
        if shed:
            return _shed(ex, state)
        return await _run_exchange(request, state, ex, route.upstream, task, trace)
    except BodyError as exc:
        ex.conclude(exc.status, Outcome.REJECTED, exc.kind)
        if exc.kind == "incomplete":
            _gone_mid_body(state, ex)
        elif isinstance(exc, BodyMemory):
            _memory_refused(state)
        elif isinstance(exc, SpoolFull):
            state.metrics.spool_full.inc()
        elif isinstance(exc, SpoolNoDescriptor):
            state.metrics.fd_exhausted.inc()
        # The rest of the body was never read: close rather than drain it.
        return _reject(protocol, exc.status, exc.message, state, code=exc.kind, close=True)
    except wire.WireError as exc:
        ex.conclude(400, Outcome.REJECTED, "invalid_json")
        return _reject(protocol, 400, str(exc), state, code="invalid_json")
    except SessionClosed as exc:
        ex.conclude(503, Outcome.REJECTED, "session_closed")
        # Retrying is pointless until the tombstone expires: say when that is.
        return _reject(
            protocol,
            503,
            "session closed",
            state,
            code="session_closed",
            retry_after=exc.retry_after_header,
        )
    except ClientGone:
        _client_gone(state, ex)
        # Raised, an ordinary hang-up would be logged by aiohttp as a server error with
        # a traceback. The connection is closing: this answer is dropped without a word.
        return SmallAnswer(499, reason="Client Closed Request", close=True)
    except asyncio.CancelledError as exc:
        reason = orderly_cancel_reason(exc)
        if reason is not None:
            if ex.phase is Phase.STREAMING:
                raise  # the answer is out: nothing left to tell the client
            # An orderly stop (session shutdown, drain) before the relay answered, e.g.
            # in prepare: the client gets a 503 in its protocol, not a dropped connection.
            task.uncancel()
            ex.conclude(503, Outcome.CANCELLED, reason.message)
            # Closing in READING: the rest of the body was never read.
            return _reject(
                protocol,
                503,
                reason.message,
                state,
                code=reason.code,
                close=ex.phase is Phase.READING,
            )
        if ex.phase is Phase.READING:
            _gone_mid_body(state, ex)
        else:
            _client_gone(state, ex)
        raise
    except MemoryError:
        # Past the body read (its own MemoryError is a BodyMemory): parsing the body,
        # a plugin's prepare, the relay. Pressure, not a bug: a 503 to retry.
        return _out_of_memory(request, state, ex)
    except Exception as exc:
        return _internal_error(request, state, ex, exc)
    finally:
        del state.exchanges[ex.id]
        state.handlers.discard(task)
        state.metrics.in_flight.dec()
        _book(state, ex)
        ex.close()
        # After close: an exchange released only there is counted too.
        state.metrics.finished(ex)
        if trace is not None:
            trace.end(ex)
        if settings.access_log:
            logs.log_access(
                ex,
                route=request.path,
                peer=_peer(request),
                user_agent=request.headers.get("User-Agent"),
            )


def _book(state: AppState, ex: Exchange) -> None:
    """Book a finished exchange exactly once: the one place every record starts from.

    Called from the handler's ``finally`` for every exchange, admitted or
    refused: a body refused before or while it was read (413, 415, 408, 503
    ``busy``/``fd_reserve``), one that is not JSON (400), a client gone
    mid-body, a passthrough route. The record of an exchange without a parsed
    exchange body has no digest (``wire_digest`` ``""``, see
    :meth:`Exchange.commit_record`). It runs as tracked work of its own
    (proxy/_commits.py): a client that hangs up now cannot cancel it, and the
    keep-alive connection's next request does not wait for it. Synchronous with
    leaving the session's ``track()`` span, so a session shutdown that waited
    for this exchange finds its commit pending.

    Not booked (it enters the committed phase without a record): a request
    refused because its session's commits are behind (``commit_backlog``), one
    refused because the proxy drains (``proxy_shutdown``), and every exchange
    when no plugin has a ``commit`` hook (counted only).
    """
    if ex.error == _COMMIT_BACKLOG:
        # Booking the refusal would queue one more record behind the session's
        # backlog, so the bound would not hold.
        ex.skip_commit()
    elif ex.outcome is Outcome.REJECTED and ex.error == PROXY_SHUTDOWN.code:
        # Refused on arrival during the drain, which may have shut the plugins down.
        ex.skip_commit()
    elif state.commits.hooked:
        state.commits.start(ex.begin_commit())
    else:
        ex.skip_commit()  # no plugin books anything: no record, no task
        state.commits.count_unbooked()


def _peername(request: Request) -> tuple[str, int] | None:
    """The client socket's address and port, ``None`` if unknown."""
    transport = request.transport
    info = transport.get_extra_info("peername") if transport is not None else None
    if not isinstance(info, tuple) or len(info) < 2:
        return None
    return str(info[0]), int(info[1])


def _peer(request: Request) -> str | None:
    """The client socket's ``address:port`` (IPv6 in brackets), ``None`` if unknown."""
    peer = _peername(request)
    if peer is None:
        return None
    host, port = peer
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def _internal_error(request: Request, state: AppState, ex: Exchange, exc: Exception) -> SmallAnswer:
    """A bug or an unforeseen failure in the proxy's own code: 500, never a traceback page.

    Logged once with the exception's class, the exchange id and the code location
    (file, line, function) that raised, never the exception's text, which may
    quote a header value or a piece of the body. Counted in
    ``context_proxy_internal_errors``; the exchange is committed with outcome
    ``error``. When the answer has already begun, a 500 can no longer be sent:
    the connection is closed so the client sees a truncated answer, not a spliced one.
    """
    frames = traceback.extract_tb(exc.__traceback__)
    where = f"{os.path.basename(frames[-1].filename)}:{frames[-1].lineno} in {frames[-1].name}"
    log.error("%s %s: internal error %s at %s", ex.id, ex.protocol, type(exc).__name__, where)
    del frames, exc  # the traceback holds the handler's frames (and the body they reach)
    state.metrics.internal_errors.labels(str(ex.protocol)).inc()
    ex.conclude(500, Outcome.ERROR, "internal_error")
    if ex.phase is Phase.STREAMING:
        return _cut(request, 500)
    # Closing: the request may not have been read to its end.
    return error_response(
        ex.protocol,
        500,
        f"internal proxy error (exchange {ex.id})",
        code="internal_error",
        close=True,
    )


def _cut(request: Request, status: int) -> SmallAnswer:
    """An answer already begun that cannot go on: the connection is closed, so the
    client sees a cut answer (a status line can no longer be sent); ``status`` is
    the exchange's, for the books."""
    transport = request.transport
    if transport is not None:
        transport.close()
    return SmallAnswer(status, close=True)


def _memory_refused(state: AppState) -> None:
    """Count a request refused for want of memory; log it (one line per 10 s, no request data)."""
    state.metrics.memory_refused.inc()
    state.memory_refusals.event(_MEMORY_REFUSED, _MEMORY_REFUSED)


def _out_of_memory(request: Request, state: AppState, ex: Exchange) -> SmallAnswer:
    """A ``MemoryError`` in an exchange outside its body read: 503 with ``Retry-After``.

    Counted and logged as :func:`_memory_refused`. The exchange's buffers go
    with it (``ex.close()`` in the handler's ``finally``). Once the answer has
    begun a status can no longer be sent: the connection is closed (a cut
    answer, as after an internal error).
    """
    _memory_refused(state)
    ex.conclude(503, Outcome.ERROR, BodyMemory.kind)
    if ex.phase is Phase.STREAMING:
        return _cut(request, 503)
    # Closing: the request may not have been read to its end.
    return _reject(ex.protocol, 503, BodyMemory().message, state, code=BodyMemory.kind, close=True)


def _gone_mid_body(state: AppState, ex: Exchange) -> None:
    """The client hung up before its body completed (seen as a payload error or a cancel)."""
    log.warning("%s: client closed the connection before the body completed", ex.id)
    # The same error whichever way the hang-up was seen (a payload error or a cancel).
    ex.set_outcome(Outcome.CLIENT_GONE, BodyIncomplete.kind)
    state.metrics.disconnects.labels(Phase.READING.value).inc()


def _client_gone(state: AppState, ex: Exchange) -> None:
    ex.client_gone()
    state.metrics.disconnects.labels(ex.phase.value).inc()


def _over_reading_budget(state: AppState, declared: int) -> bool:
    """Whether a body declaring ``declared`` bytes cannot fit in ``max_reading_bytes`` now.

    ``state.reading_bytes`` counts bytes *received* by the reads in progress (a
    declaration reserves no memory, so it is not charged); a body whose declared
    size would not fit next to them is refused before its upload. One body is
    always admitted (the limit per body is ``max_body_bytes``).
    """
    reading = state.reading_bytes
    return reading > 0 and reading + declared > state.settings.max_reading_bytes


def _shed(ex: Exchange, state: AppState) -> SmallAnswer:
    """503 ``fd_reserve`` for a request on a connection from the descriptor reserve.

    Counted in ``context_proxy_fd_exhausted_total``; the body is never read, so
    the connection closes.
    """
    state.metrics.fd_exhausted.inc()
    ex.conclude(503, Outcome.REJECTED, "fd_reserve")
    return _reject(
        ex.protocol, 503, fdlimit.EXHAUSTED_MESSAGE, state, code="fd_reserve", close=True
    )


def _busy(ex: Exchange, state: AppState, refusal: BodyError | None = None) -> SmallAnswer:
    """503 + Retry-After before the body is read: ``max_reading_bytes`` (or ``refusal``'s
    budget, e.g. ``max_spool_bytes``) cannot take it now."""
    error = refusal if refusal is not None else BodyBusy()
    ex.conclude(503, Outcome.REJECTED, error.kind)
    # Closing: the body was never read.
    return _reject(ex.protocol, 503, error.message, state, code=error.kind, close=True)


class _ReadingAccount:
    """Charges one body read's received heap bytes to the shared ``max_reading_bytes`` budget.

    ``grow`` is the reader's ``on_growth`` callback: the bytes the body buffer
    grew by are charged as they arrive, to the app's total and the exchange's
    held bytes. Past the budget, a read that shares it with others ends with
    :class:`~proxy._body.BodyBusy` (503); a read alone may grow to ``max_body_bytes``.
    ``spooled`` is called when the body moves to the spool: what it charged is
    returned and its later bytes are the spool's (``max_spool_bytes``), not the
    heap budget's, since they no longer take memory. ``settle`` returns
    everything charged (idempotent); call it in ``finally``.
    """

    __slots__ = ("_charged", "_ex", "_spooled", "_state")

    def __init__(self, state: AppState, ex: Exchange) -> None:
        self._state = state
        self._ex = ex
        self._charged = 0
        self._spooled = False

    def spooled(self) -> None:
        """The body now lives in the spool: stop charging the heap budget for it."""
        self._spooled = True
        self.settle()

    def grow(self, nbytes: int) -> None:
        state = self._state
        self._ex.count_received(nbytes)
        if self._spooled:
            return
        self._charged += nbytes
        state.reading_bytes += nbytes
        if (
            state.reading_bytes > state.settings.max_reading_bytes
            and state.reading_bytes > self._charged
        ):
            raise BodyBusy()

    def settle(self) -> None:
        self._state.reading_bytes -= self._charged
        self._charged = 0


async def _run_exchange(
    request: Request,
    state: AppState,
    ex: Exchange,
    upstream_name: str,
    task: asyncio.Task[object],
    trace: ExchangeTrace | None,
) -> Answer:
    settings = state.settings
    body_hint: str | None = None
    opaque = False
    if request.method in _BODY_METHODS or request.body_exists:
        codings = request.headers.getall("Content-Encoding", [])
        encoding = ", ".join(codings) if codings else None
        check_content_length(request.content_length, encoding, settings.max_body_bytes)
        declared = request.content_length or 0
        spool = state.spool
        # A body the spool takes from its first byte (a plain declared length over the
        # threshold) never takes heap: max_spool_bytes admits it, not the heap budget.
        spooled_at_once = encoding is None and spool.wants(declared)
        if not spooled_at_once and _over_reading_budget(state, declared):
            return _busy(ex, state)
        if not spool.admits(declared):
            spool.busy += 1
            return _busy(ex, state, SpoolBusy())
        if request.headers.get("Expect") is not None:
            # RFC 9110 §10.1.1: the refusals above (413, 415, 503) went out instead
            # of 100 (Continue), before the upload; now the client may send its body.
            # Any other expectation never gets here (_refuse_expectation).
            await request.send_continue()
        ex.start_reading(declared)
        account = _ReadingAccount(state, ex)

        def spill() -> SpoolFile:
            # Owned by the exchange from its first byte: closed on every outcome.
            file = ex.adopt_spool(spool.open())
            state.metrics.spooled.inc()
            account.spooled()
            return file

        try:
            result = await read_body(
                request.content,
                content_length=request.content_length,
                content_encoding=encoding,
                limit=settings.max_body_bytes,
                idle_timeout=settings.body_idle_timeout,
                body_timeout=settings.body_timeout,
                chunk_bytes=settings.body_chunk_bytes,
                on_growth=account.grow,
                spill=spill,
                spill_above=settings.spool_above_bytes,
            )
        finally:
            account.settle()
            ex.end_reading()
        # Every body byte went through a read piece that is freed heap now (proxy/_alloc.py).
        state.allocator.released(result.wire_bytes)
        try:
            meta = wire.compute_wire_metadata(ex.protocol, result.buffer, result.digest)
        except wire.WireError:
            if ex.protocol.is_exchange:
                raise
            # A passthrough body need not be JSON (a multipart file upload): it goes
            # upstream verbatim, described by its size and digest only, unprepared.
            meta = wire.WireMetadata(
                protocol=ex.protocol,
                model=None,
                stream=False,
                message_count=0,
                byte_length=len(result.buffer),
                digest=result.digest,
                comparable=False,
                session_hint=None,
            )
            opaque = True
        ex.attach_body(result.buffer, meta)
        state.metrics.bodies_read.inc()
        del result
        body_hint = meta.session_hint
    sid = resolve_session_id(
        request.headers,
        header_order=settings.session_headers,
        body_hint=body_hint if settings.session_from_body else None,
        from_bearer=settings.session_from_bearer,
    )
    logs.SESSION_ID.set(sid)
    # Before admission: a request refused there (a closed session) is booked with it too.
    ex.set_session(sid)
    if sid is None and settings.require_session and ex.protocol.is_exchange:
        ex.conclude(400, Outcome.REJECTED, "session_required")
        return _reject(ex.protocol, 400, "a session id is required", state, code="session_required")
    assert state.upstream is not None
    backlog = settings.max_pending_commits
    if (
        sid is not None
        and backlog
        and state.commits.pending_for(sid) + state.registry.in_flight_of(sid) >= backlog
    ):
        # The session's commits are booked one at a time under its lock: a hook slower
        # than the session's request rate would queue records without bound. Its
        # exchanges in flight count too: each one's commit is on its way.
        ex.conclude(503, Outcome.REJECTED, _COMMIT_BACKLOG)
        return _reject(
            ex.protocol,
            503,
            f"the session's bookkeeping is behind ({backlog} pending commit"
            f"{'' if backlog == 1 else 's'})",
            state,
            code=_COMMIT_BACKLOG,
        )
    # Cluster admission (one Redis round trip), then the local one; both refuse a
    # tombstoned session. Nothing below, the stream included, calls Redis.
    async with state.admitted(sid, ex, task):
        if ex.meta is not None and not opaque:
            ex.bind_preparer(
                Preparer(
                    state.host,
                    (lambda: state.registry.locked(sid)) if sid else null_lock,
                    sid,
                )
            )
            await ex.prepare()
        response = await relay(
            request,
            ex,
            state.upstream,
            # The target as the client sent it: decoding would turn %3F into a query,
            # %2F into a path separator, %0D%0A into nothing.
            target=state.upstream.target(upstream_name, request.raw_path, request.query_string),
            headers=forward_headers(request.headers),
            settings=settings,
            trace=trace,
        )
        if isinstance(response, StreamAnswer):
            # Every byte of the answer is with the connection: a hang-up from now on
            # (an SDK closing at the last byte) does not make it a failed exchange.
            ex.response_complete()
            # A connection already closed (the client left after the last byte, or
            # the relay cut a broken body) has nothing more to receive.
            with contextlib.suppress(ConnectionError):
                await response.write_eof()
        return response


def _path_protocol(path: str) -> Protocol:
    """The error shape for a request no route decided: Anthropic's under ``/v1/messages``."""
    return Protocol.MESSAGES if path.startswith("/v1/messages") else Protocol.OPENAI


def _refuse_expectation(request: Request) -> SmallAnswer:
    """417 for an ``Expect`` other than ``100-continue``, on any path, before routing.

    JSON in the path's protocol shape (Anthropic under ``/v1/messages``, else
    OpenAI); the value is never echoed. The body was not read: the connection closes.
    """
    protocol = _path_protocol(request.path)
    return error_response(protocol, 417, "only Expect: 100-continue is supported", close=True)


def _route_error(request: Request, status: int, allow: str | None = None) -> SmallAnswer:
    """404 or 405 for a path or method no route serves: JSON (OpenAI shape, or
    Anthropic's under ``/v1/messages``), ``Allow`` listing the methods on a 405."""
    protocol = _path_protocol(request.path)
    reason = "Not Found" if status == 404 else "Method Not Allowed"
    return error_response(
        protocol,
        status,
        f"{reason}: {request.method} {request.path}",
        headers={"Allow": allow} if allow else None,
    )


async def _answer(answer: SmallAnswer) -> SmallAnswer:
    return answer


def _root(request: Request) -> SmallAnswer:
    """``HEAD /`` and ``GET /``: answer at once (Claude Code preconnects with HEAD)."""
    if request.method not in ("GET", "HEAD"):
        return _route_error(request, 405, "GET,HEAD")
    return SmallAnswer.text("context-proxy\n")


class ProxyApp:
    """The proxy application: its :class:`AppState` and the dispatch of every request.

    Routes: ``/v1/...`` (any method) is an exchange or a passthrough
    (:func:`handle_exchange`); ``GET|HEAD /``; the health, metrics and admin
    routes (:mod:`proxy._admin`); anything else 404, a known path with another
    method 405, both as JSON errors.
    """

    __slots__ = ("environ", "state")

    def __init__(self, state: AppState, environ: Mapping[str, str] | None = None) -> None:
        self.state = state
        #: Where the upstream client reads ``HTTPS_PROXY`` and the rest (proxy/_egress.py);
        #: ``None``: the process environment.
        self.environ = environ

    def dispatch(self, request: Request) -> Awaitable[Answer]:
        """The answer to ``request`` (awaitable: the handler's coroutine, not a frame
        of its own, which an open stream would hold for as long as it lasts)."""
        state = self.state
        expect = request.headers.get("Expect")
        path = request.path
        if expect is not None and expect.strip().lower() != "100-continue":
            return _answer(_refuse_expectation(request))
        if path.startswith("/v1/"):
            return handle_exchange(request, state)
        if path == "/":
            return _answer(_root(request))
        refusal = admin_guard(request, state)
        if refusal is not None:
            return _answer(refusal)
        routes = admin_routes(path, request.raw_path)
        if routes is None:
            return _answer(_route_error(request, 404))
        method = "GET" if request.method == "HEAD" else request.method
        handler = routes.get(method)
        if handler is None:
            allow = ",".join(sorted({*routes, *(("HEAD",) if "GET" in routes else ())}))
            return _answer(_route_error(request, 405, allow))
        return handler(request, state)

    def shed(self, request: Request) -> Awaitable[Answer]:
        """The answer on a connection accepted from the descriptor reserve (proxy/_fdlimit.py).

        ``/healthz``, ``/readyz`` and ``/metrics`` are answered as ever (they need
        no descriptor); anything else gets a 503 with ``Retry-After`` in its
        protocol's shape, counted in ``context_proxy_fd_exhausted_total``, and
        the connection closes (its body, if any, is not read). A ``/v1/`` request
        goes through :func:`handle_exchange` (``shed=True``) so that it is booked
        like every exchange: an unknown route is its 404 there, a draining proxy
        its 503 "proxy is shutting down".
        """
        state = self.state
        if request.path in _PROBES and request.method in ("GET", "HEAD"):
            return self.dispatch(request)
        if request.path.startswith("/v1/"):
            return handle_exchange(request, state, shed=True)  # booked, as every exchange
        state.metrics.fd_exhausted.inc()
        protocol = _path_protocol(request.path)
        return _answer(
            _reject(protocol, 503, fdlimit.EXHAUSTED_MESSAGE, state, code="fd_reserve", close=True)
        )

    def upstream_sockets(self) -> int:
        """Upstream sockets the pool holds (in use or idle): descriptors already spent."""
        upstream = self.state.upstream
        if upstream is None:
            return 0
        return upstream.pool.connections_in_use + upstream.pool.idle_connections

    async def startup(self) -> None:
        """Start the plugins, list their stored sessions, open the upstream pool, join
        the cluster (in that order).

        Plugins first: when one refuses to start, nothing else is left open.

        Raises:
            ConfigError: ``spool_dir`` is missing or unwritable (checked first).
            Exception: a plugin's ``startup`` failed, or the cluster cannot start.
        """
        state = self.state
        problem = state.spool.problem()
        if problem is not None:
            raise ConfigError(problem)
        await state.host.startup()
        # Sessions the plugins loaded from storage (the ledger's) are listed, not live.
        now = time.time()
        stored = sorted(state.host.stored_sessions().items(), key=lambda item: item[1])
        listed = sum(state.registry.add_stored(sid, now - last) for sid, last in stored)
        if stored:
            log.info("%d stored session(s) listed as not live", listed)
        state.upstream = Upstream(state.settings, self.environ)
        if state.cluster is not None:
            await state.cluster.start()

    async def cleanup(self) -> None:
        """Close the upstream pool (after the drain); export the spans still batched."""
        if self.state.upstream is not None:
            await self.state.upstream.close()
        if self.state.tracing is not None:
            await self.state.tracing.close()


def build_app(
    settings: Settings,
    *,
    host: PluginHost | None = None,
    clock: Callable[[], float] = time.monotonic,
    environ: Mapping[str, str] | None = None,
    tracer_provider: TracerProvider | None = None,
) -> ProxyApp:
    """Build the proxy application.

    ``host`` overrides the plugins named in ``settings`` (tests pass their own);
    ``clock`` is the session registry's monotonic clock in seconds (tests inject
    one to expire tombstones without sleeping); ``environ`` is where the
    upstream client reads ``HTTPS_PROXY``, ``HTTP_PROXY`` and ``NO_PROXY``
    (``None``: the process environment); ``tracer_provider`` is where the spans
    go with ``tracing = "otel"`` (default: the global provider if one was set,
    else one the SDK builds from the process's ``OTEL_*`` variables,
    proxy/_tracing.py).

    Raises:
        proxy._plugins.PluginError: a configured plugin cannot be loaded.
        ConfigError: ``tracing = "otel"`` without the extra ``context-proxy[otel]``,
            or ``OTEL_TRACES_EXPORTER`` names an exporter that is not installed.
    """
    if host is None:
        host = load_plugins(
            settings.plugins,
            settings.plugin,
            timeout=settings.plugin_timeout,
            # Cluster mode: a plugin taking redis_url (the ledger) shares the proxy's Redis.
            shared=(
                {"redis_url": settings.redis_url, "redis_timeout": settings.redis_timeout}
                if settings.redis_url
                else None
            ),
        )
    tracing = start_tracing(tracer_provider) if settings.tracing == "otel" else None
    return ProxyApp(AppState(settings, host, clock=clock, tracing=tracing), environ)


@contextlib.asynccontextmanager
async def running(app: ProxyApp, host: str, port: int) -> AsyncIterator[int]:
    """Serve ``app`` on ``host:port`` (0 = ephemeral) and yield the bound port.

    On exit the app drains (grace from settings) and shuts down: in-flight
    exchanges get the grace, then the listener and every connection close.

    Raises:
        OSError: the address cannot be bound (start-up is undone first).
    """
    state = app.state
    await app.startup()
    server = FrontServer(
        app.dispatch,
        header_timeout=state.settings.header_timeout,
        # Trims the heap once no answer has ended for a while (proxy/_alloc.py).
        on_request_done=state.allocator.idle,
        draining=lambda: state.draining,
        fd_budget=fdlimit.FdBudget(
            state.settings.fd_reserve, upstream_sockets=app.upstream_sockets
        ),
        shed_handler=app.shed,
    )
    try:
        bound = await server.start(host, port)
    except BaseException:
        # Start-up already ran (plugins, the upstream pool): undo it before reporting.
        await state.drain(0)
        await app.cleanup()
        raise
    try:
        yield bound
    finally:
        await state.drain(state.settings.shutdown_grace)
        await server.shutdown(grace=1.0)
        await app.cleanup()


async def serve(settings: Settings) -> None:
    """Run the proxy until SIGTERM/SIGINT or ``POST /admin/shutdown``, then drain and exit.

    Raises:
        ConfigError: ``fd_reserve`` leaves too little of the descriptor limit to serve.
        OSError: the address cannot be bound.
    """
    app = build_app(settings)
    state = app.state
    # Process-wide, so only here (not in build_app: tests embed apps in their runner).
    state.allocator.tune()
    before, limit = fdlimit.raise_nofile_limit()
    fd_problem = fdlimit.reserve_problem(settings.fd_reserve, limit)
    if fd_problem is not None:
        raise ConfigError(fd_problem)
    egress = egress_problems(settings, os.environ)
    if egress:
        raise ConfigError(egress[0])
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, state.stop.set)
    async with running(app, settings.host, settings.port) as port:
        state.allocator.idle()  # start-up's freed heap goes back once it is quiet
        plugins = ", ".join(p.name or type(p).__name__ for p in state.host.plugins)
        log.info("plugins enabled: %s", plugins or "none")
        log.info("event loop: %s", type(loop).__module__.split(".")[0])
        log.info(
            "file descriptor limit: %d%s (each open stream holds two)",
            limit,
            f" (raised from {before})" if limit != before else "",
        )
        log.info(
            "context-proxy listening on http://%s:%d (openai → %s, anthropic → %s)",
            settings.host,
            port,
            settings.upstream_openai,
            settings.upstream_anthropic,
        )
        if state.upstream is not None:
            for name, target in state.upstream.targets.items():
                if target.via is not None:  # shown without its credentials
                    log.info(
                        "egress: %s upstream through %s (from %s)",
                        name,
                        target.via.shown,
                        target.via.source,
                    )
        await state.stop.wait()
        log.info("shutting down: readiness is now 503; grace %.1fs", settings.shutdown_grace)
        state.draining = True
    log.info("context-proxy stopped")

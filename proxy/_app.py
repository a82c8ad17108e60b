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
import functools
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
from ._admission import BodyAdmission, ReadingAccount, admit, admit_session
from ._answer import SmallAnswer
from ._body import BodyIncomplete, read_body
from ._cancel import PROXY_SHUTDOWN, orderly_cancel_reason
from ._config import ConfigError, Settings
from ._exchange import Exchange
from ._front import Answer, Request, StreamAnswer
from ._headers import forward_headers
from ._listener import FrontServer
from ._phases import Phase
from ._plugins import Outcome, PluginHost, load_plugins
from ._prepare import Preparer, null_lock, prepare
from ._protocols import Protocol
from ._refusals import COMMIT_BACKLOG, Effect, Refusal, Shed, resolve
from ._relay import ClientGone, Upstream, egress_problems, error_response, relay
from ._session_ids import resolve_session_id
from ._spool import SpoolFile
from ._state import AppState
from ._tracing import ExchangeTrace, start_tracing

if TYPE_CHECKING:
    from opentelemetry.trace import TracerProvider

__all__ = ["AppState", "ProxyApp", "build_app", "running", "serve"]

log = logging.getLogger("context_proxy")

#: Requests refused for want of memory: this line once per 10 s, then a count.
_MEMORY_REFUSED: Final = (
    "request refused with 503: memory could not be reserved (an address-space limit?)"
)

#: Answered even on a connection accepted from the descriptor reserve (they need none).
_PROBES: Final = frozenset({"/healthz", "/readyz", "/metrics"})

# Enum members read on every request, as module constants: an Enum class attribute
# is looked up through the enum metaclass's __getattr__ hook, many times a global's cost.
_REJECTED: Final = Outcome.REJECTED


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
    Every error is answered from one table (proxy/_refusals.py, :func:`_refuse`).
    """
    route = protocols.route(request.method, request.path, request.headers)
    if route is None:
        return error_response(_path_protocol(request.path), 404, f"unknown route {request.path}")
    ex = Exchange(
        protocol=route.protocol,
        method=request.method,
        path=request.path,
        query=request.query_string,
        keep_for_resend=state.settings.fake_completion_retries > 0,
        on_release=state.on_release,
    )
    # Each request runs in a task of its own: the id marks this task's records only.
    logs.EXCHANGE_ID.set(ex.id)
    task = asyncio.current_task()
    assert task is not None
    tracing = state.tracing  # a request refused during the drain is not traced (nor booked)
    trace = (
        None
        if tracing is None or state.draining
        else tracing.exchange(ex, request.headers, _peername(request))
    )
    state.exchanges[ex.id] = ex
    state.handlers.add(task)
    state.metrics.in_flight.inc()
    try:
        return await _run_exchange(request, state, ex, route.upstream, task, trace, shed=shed)
    except ClientGone:
        _client_gone(state, ex)
        # The connection is closing: this answer is dropped without a word (raised, an
        # ordinary hang-up would be logged as a server error with a traceback).
        return SmallAnswer(499, reason="Client Closed Request", close=True)
    except asyncio.CancelledError as exc:
        answer = _cancelled(state, ex, exc, task)
        if answer is None:
            raise
        return answer
    except Exception as exc:
        return _refuse(request, state, ex, exc)
    finally:
        _finish(request, state, ex, task, trace)


def _finish(
    request: Request,
    state: AppState,
    ex: Exchange,
    task: asyncio.Task[object],
    trace: ExchangeTrace | None,
) -> None:
    """The end of every exchange, whatever happened: unlisted, booked, closed, logged."""
    del state.exchanges[ex.id]
    state.handlers.discard(task)
    state.metrics.in_flight.dec()
    _book(state, ex)
    ex.close()
    # After close: an exchange released only there is counted too.
    state.metrics.finished(ex)
    if trace is not None:
        trace.end(ex)
    # The line's arguments (the peer's address is a transport look-up) only for a line
    # that is written: the access logger is off under a log level above INFO.
    if state.settings.access_log and logs.ACCESS_LOG.isEnabledFor(logging.INFO):
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
    whose session no plugin's ``commit`` takes (none has the hook, or each
    ``wants_commit`` declined it: counted only).
    """
    if ex.error == COMMIT_BACKLOG:
        # Booking the refusal would queue one more record behind the session's
        # backlog, so the bound would not hold.
        ex.skip_commit()
    elif ex.outcome is _REJECTED and ex.error == PROXY_SHUTDOWN.code:
        # Refused on arrival during the drain, which may have shut the plugins down.
        ex.skip_commit()
    elif state.commits.hooked and (takers := state.host.committers(ex.session_id)):
        record = ex.begin_commit()
        if len(takers) == len(state.host.implementing("commit")):
            state.commits.start(record)
        else:  # some declined: only the others' hooks run
            state.commits.start(
                record, run=functools.partial(state.host.run_commit, plugins=takers)
            )
    else:
        # No plugin books anything (none has a commit hook, or each declined this
        # exchange's session in wants_commit): no record, no task.
        ex.skip_commit()
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


def _refuse(request: Request, state: AppState, ex: Exchange, exc: Exception) -> SmallAnswer:
    """The answer to ``exc`` from :data:`proxy._refusals.ANSWERS`; the exchange is concluded.

    The row's side effect runs (:data:`_EFFECTS`); its outcome, status and code
    are booked. When the answer has already begun and the row says ``cut``, a
    status can no longer be sent: the connection is closed so the client sees a
    truncated answer, not a spliced one (:func:`_cut`).
    """
    refusal = resolve(exc, ex.id)
    rule = refusal.rule
    ex.conclude(refusal.status, rule.outcome, refusal.code)
    _EFFECTS[rule.effect](state, ex, exc)
    del exc  # its traceback holds the handler's frames (and the body they reach)
    if rule.cut and ex.phase is Phase.STREAMING:
        return _cut(request, refusal.status)
    return _refusal_answer(ex.protocol, state, refusal)


def _refusal_answer(protocol: Protocol, state: AppState, refusal: Refusal) -> SmallAnswer:
    """``refusal`` as JSON in ``protocol``'s shape (a 503 with ``Retry-After``)."""
    return _reject(
        protocol,
        refusal.status,
        refusal.message,
        state,
        code=refusal.code,
        retry_after=refusal.retry_after,
        close=refusal.rule.close,
    )


def _internal_error(state: AppState, ex: Exchange, exc: BaseException) -> None:
    """A bug or an unforeseen failure in the proxy's own code (answered 500, never a
    traceback page): logged once with the exception's class, the exchange id and
    the code location (file, line, function) that raised, never the exception's
    text, which may quote a header value or a piece of the body; counted in
    ``context_proxy_internal_errors``."""
    frames = traceback.extract_tb(exc.__traceback__)
    where = f"{os.path.basename(frames[-1].filename)}:{frames[-1].lineno} in {frames[-1].name}"
    log.error("%s %s: internal error %s at %s", ex.id, ex.protocol, type(exc).__name__, where)
    del frames, exc
    state.metrics.internal_errors.labels(str(ex.protocol)).inc()


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


def _gone_mid_body(state: AppState, ex: Exchange) -> None:
    """The client hung up before its body completed (seen as a payload error or a cancel)."""
    log.warning("%s: client closed the connection before the body completed", ex.id)
    # The same error whichever way the hang-up was seen (a payload error or a cancel).
    ex.set_outcome(Outcome.CLIENT_GONE, BodyIncomplete.kind)
    state.metrics.disconnects.labels(Phase.READING.value).inc()


def _client_gone(state: AppState, ex: Exchange) -> None:
    ex.client_gone()
    state.metrics.disconnects.labels(ex.phase.value).inc()


def _effect(state: AppState, ex: Exchange | None, exc: BaseException | None) -> None:
    """Nothing beside the answer (:attr:`Effect.NONE`)."""


def _gone_effect(state: AppState, ex: Exchange | None, exc: BaseException | None) -> None:
    assert ex is not None  # only an exchange's body is read
    _gone_mid_body(state, ex)


def _internal_effect(state: AppState, ex: Exchange | None, exc: BaseException | None) -> None:
    assert ex is not None and exc is not None  # a bug is raised inside an exchange
    _internal_error(state, ex, exc)


#: What each :class:`~proxy._refusals.Effect` does: ``effect(state, exchange, error)``
#: (``None``, ``None`` for a refusal outside an exchange: the descriptor reserve's).
_EFFECTS: Final[
    Mapping[Effect, Callable[[AppState, Exchange | None, BaseException | None], None]]
] = {
    Effect.NONE: _effect,
    Effect.GONE_MID_BODY: _gone_effect,
    Effect.MEMORY: lambda state, ex, exc: _memory_refused(state),
    Effect.SPOOL_FULL: lambda state, ex, exc: state.metrics.spool_full.inc(),
    Effect.FD_EXHAUSTED: lambda state, ex, exc: state.metrics.fd_exhausted.inc(),
    Effect.INTERNAL: _internal_effect,
}


def _cancelled(
    state: AppState, ex: Exchange, exc: asyncio.CancelledError, task: asyncio.Task[object]
) -> SmallAnswer | None:
    """The answer to a cancel of the handler, or ``None`` when it must propagate.

    An orderly stop (session shutdown, drain) before the answer began, e.g. in
    prepare: the client gets a 503 in its protocol, not a dropped connection
    (the cancel is taken back). A client gone, or an orderly stop once the
    answer is out, propagates (counted as a disconnect for a client gone).
    """
    reason = orderly_cancel_reason(exc)
    if reason is not None:
        if ex.phase is Phase.STREAMING:
            return None  # the answer is out: nothing left to tell the client
        task.uncancel()
        ex.conclude(503, Outcome.CANCELLED, reason.message)
        # Closing in READING: the rest of the body was never read.
        return _reject(
            ex.protocol,
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
    return None


async def _run_exchange(
    request: Request,
    state: AppState,
    ex: Exchange,
    upstream_name: str,
    task: asyncio.Task[object],
    trace: ExchangeTrace | None,
    *,
    shed: bool,
) -> Answer:
    """Admit, read, find the session, then prepare and relay inside the session's admission.

    Raises whatever the table of proxy/_refusals.py answers (the caller does).
    """
    admission = admit(state, request.head, shed=shed)
    preparable = admission is not None and await _read_body(request, state, ex, admission)
    sid = _session_of(request, state, ex)
    upstream = state.upstream
    assert upstream is not None
    # Cluster admission (one Redis round trip), then the local one; both refuse a
    # tombstoned session. Nothing below, the stream included, calls Redis.
    async with state.admitted(sid, ex, task):
        if preparable:
            ex.bind_preparer(Preparer(state.host, _session_lock(state, sid), sid))
            await prepare(ex)
        response = await relay(
            request,
            ex,
            upstream,
            # The target as the client sent it: decoding would turn %3F into a query,
            # %2F into a path separator, %0D%0A into nothing.
            target=upstream.target(upstream_name, request.raw_path, request.query_string),
            headers=forward_headers(request.headers),
            settings=state.settings,
            trace=trace,
        )
        if isinstance(response, StreamAnswer):
            # Every byte of the answer is with the connection: a hang-up from now on
            # (an SDK closing at the last byte) does not make it a failed exchange.
            ex.response_complete()
            # A connection already closed (the client left after the last byte, or
            # the relay cut a broken body) has nothing more to receive. (A try, not
            # contextlib.suppress: that is three Python calls on every streamed answer.)
            try:  # noqa: SIM105
                await response.write_eof()
            except ConnectionError:
                pass
        return response


def _session_lock(
    state: AppState, sid: str | None
) -> Callable[[], contextlib.AbstractAsyncContextManager[object]]:
    """The lock context factory of a request's session (``sid``; none: a null lock).

    A function of its own, not a lambda in the handler: variables a closure captures
    are cells for the whole function that makes it, two more objects kept per open
    stream (the handler's frame lives as long as the stream)."""
    registry = state.registry
    return (lambda: registry.locked(sid)) if sid else null_lock


async def _read_body(
    request: Request, state: AppState, ex: Exchange, admission: BodyAdmission
) -> bool:
    """Read the admitted body into the exchange (after ``100 Continue`` when the client
    expects one); whether plugins may prepare it.

    A passthrough body need not be JSON (a multipart file upload): it goes upstream
    verbatim, described by its size and digest only, unprepared (``False``).

    Raises:
        proxy._body.BodyError: the read failed (limits, deadlines, a hang-up, budgets).
        proxy._wire.WireError: an exchange route's body is not a JSON object.
    """
    if request.headers.get("Expect") is not None:
        # RFC 9110 §10.1.1: a refusal of admit() went out instead of 100 (Continue),
        # before the upload; now the client may send its body. Any other
        # expectation never gets here (_refuse_expectation).
        await request.send_continue()
    settings, spool = state.settings, state.spool
    ex.start_reading(admission.declared)
    account = ReadingAccount(state, ex)

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
            content_encoding=admission.encoding,
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
    preparable = True
    try:
        meta = wire.compute_wire_metadata(ex.protocol, result.buffer, result.digest)
    except wire.WireError:
        if ex.protocol.is_exchange:
            raise
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
        preparable = False
    ex.attach_body(result.buffer, meta)
    state.metrics.bodies_read.inc()
    return preparable


def _session_of(request: Request, state: AppState, ex: Exchange) -> str | None:
    """The request's session id (headers, then the body's hint, then the bearer), admitted.

    Set on the exchange before the session's admission: a request refused there
    (a closed session, a backlog) is booked with it too.

    Raises:
        proxy._refusals.SessionRequired, proxy._refusals.CommitBacklog: see
            :func:`proxy._admission.admit_session`.
    """
    settings = state.settings
    hint = ex.meta.session_hint if ex.meta is not None else None
    sid = resolve_session_id(
        request.headers,
        header_order=settings.session_headers,
        body_hint=hint if settings.session_from_body else None,
        from_bearer=settings.session_from_bearer,
    )
    logs.SESSION_ID.set(sid)
    ex.set_session(sid)
    admit_session(state, ex.protocol, sid)
    return sid


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
        # No exchange to book: the Shed row's answer and counter, as for a /v1/ request.
        refusal = resolve(Shed(), "")
        _EFFECTS[refusal.rule.effect](state, None, None)
        return _answer(_refusal_answer(_path_protocol(request.path), state, refusal))

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
        state.collector.start()  # the full collections' time valve (proxy/_gc.py)
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

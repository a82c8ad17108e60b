"""The upstream edge: a small driver performing a :class:`~proxy._stream.StreamGate`'s actions.

One call of :func:`relay` drives one exchange from "prepared" to "streaming is
over": it sends the outbound body as ``memoryview`` slices, makes a gate for
each upstream answer, feeds it the decoded body chunk by chunk and performs
what it returns: the release boundary (:meth:`Exchange.accept`), the client's
headers, writes with backpressure, a refold or a resend (a new attempt), the
grace read after the terminal event, the end. Every decision about the answer
(event boundaries, the gate before first output, overflow, the stream end
rule, usage) is the gate's; this module only does the I/O around it.
"""

from __future__ import annotations

import asyncio
import enum
import logging
import os
import ssl
from collections.abc import Coroutine, Iterator, Mapping
from typing import TYPE_CHECKING, Any, Final

from multidict import CIMultiDict

from . import _protocols as protocols
from ._answer import SmallAnswer
from ._cancel import orderly_cancel_reason
from ._coding import BodyError, ContentDecoder, parse_content_encoding
from ._config import Settings
from ._egress import EgressError, choose_proxy
from ._exchange import Exchange
from ._fdlimit import EXHAUSTED_MESSAGE, is_fd_exhaustion
from ._front import Answer, Request, StreamAnswer
from ._headers import response_headers
from ._logs import LogLimiter
from ._plugins import Outcome
from ._prepare import refold
from ._protocols import Protocol
from ._stream import (
    Accept,
    Action,
    Fail,
    Finish,
    Forward,
    GateState,
    Linger,
    Open,
    Refold,
    Reject,
    Resend,
    StreamGate,
    Usage,
)
from ._upstream import (
    BadResponseHead,
    PoolBusy,
    PoolClosed,
    UpstreamAnswer,
    UpstreamError,
    UpstreamPool,
    UpstreamTarget,
)

__all__ = [
    "ClientGone",
    "Upstream",
    "egress_problems",
    "error_response",
    "relay",
    "upstream_targets",
    "upstream_tls",
]

if TYPE_CHECKING:
    from ._tracing import AttemptReason, AttemptTrace, ExchangeTrace

log = logging.getLogger("context_proxy.relay")

#: Bytes one decoder call may produce from a content-coded upstream answer.
DECODE_PIECE_BYTES: Final = 256 * 1024
# Decoded answers have no size limit (a long stream is fine); the decoders want one.
_NO_LIMIT: Final = 1 << 62


class ClientGone(Exception):
    """The client closed its connection; the upstream request was aborted."""


class _UpstreamFailure(Exception):
    """No usable answer from the upstream: ``status`` 502, 503 (out of descriptors) or 504."""

    def __init__(self, status: int, outcome: Outcome, message: str, detail: str = "") -> None:
        super().__init__(message)
        self.status = status
        self.outcome = outcome
        self.message = message
        # For the log only (e.g. the error's class name); the client gets ``message``.
        self.detail = detail


def _read_failure(exc: BaseException) -> str:
    """Plain words for a body read that failed (what follows "upstream stream failed: ").

    The client's own words (a close, broken framing, the idle-read bound), or the
    grace after the terminal event running out (a plain ``TimeoutError``).
    """
    if isinstance(exc, UpstreamError):
        return str(exc)
    return "upstream sent nothing for too long mid-answer"


#: Seconds between two summary lines of one upstream's failures.
FAILURE_LOG_INTERVAL: Final = 10.0


def upstream_targets(settings: Settings, environ: Mapping[str, str]) -> dict[str, UpstreamTarget]:
    """Each upstream's target and route (:func:`proxy._egress.choose_proxy`), by name.

    Raises:
        ValueError: an upstream base URL is not ``http(s)://host[:port][/path]``.
        EgressError: the proxy URL chosen for one is unusable (a ``ValueError`` too).
    """
    targets = {}
    for name, base in (
        ("openai", settings.upstream_openai),
        ("anthropic", settings.upstream_anthropic),
    ):
        direct = UpstreamTarget(base)
        via = choose_proxy(
            direct.tls,
            direct.host,
            direct.port,
            setting=settings.upstream_proxy,
            environ=environ,
        )
        targets[name] = direct if via is None else UpstreamTarget(base, via)
    return targets


def upstream_tls(ca_file: str | None) -> ssl.SSLContext | None:
    """The context verifying upstream TLS: the system's trust store plus the PEM bundle
    ``ca_file`` (the ``upstream_ca_file`` setting); ``None`` without one (the pool
    makes the default context on its first https connect).

    Raises:
        EgressError: ``ca_file`` cannot be read or holds no PEM certificate (the
            message starts ``upstream_ca_file:`` and names the path).
    """
    if ca_file is None:
        return None
    context = ssl.create_default_context()
    try:
        context.load_verify_locations(cafile=ca_file)
    except ssl.SSLError:  # (an OSError too: first)
        raise EgressError(f"upstream_ca_file: {ca_file} holds no usable PEM certificate") from None
    except OSError as exc:
        reason = exc.strerror or type(exc).__name__
        raise EgressError(f"upstream_ca_file: cannot read {ca_file}: {reason}") from None
    return context


def egress_problems(settings: Settings, environ: Mapping[str, str]) -> list[str]:
    """What keeps the upstream client from starting with ``settings`` in ``environ``:
    a bad proxy URL (from the setting or the environment) or an unreadable
    ``upstream_ca_file``; one line each, never a credential. Never raises."""
    problems = []
    try:
        targets = upstream_targets(settings, environ)
    except EgressError as exc:
        problems.append(str(exc))
    else:
        problems += _loop_problems(settings, targets)
    try:
        upstream_tls(settings.upstream_ca_file)
    except EgressError as exc:
        problems.append(str(exc))
    return problems


#: Host names and addresses that reach this machine's loopback, as a proxy URL names them.
_LOOPBACK_NAMES: Final = frozenset({"localhost", "::1", "0.0.0.0", "::"})


def _loop_problems(settings: Settings, targets: Mapping[str, UpstreamTarget]) -> list[str]:
    """The upstreams whose first hop (the forward proxy, else the upstream itself) is
    this proxy's own listening address: each request would come back to it and go out
    again, one connection pair per hop, until the descriptors run out (one request
    took all 20,000 in 11 s). Only a fixed ``port`` is checked (0 picks one at bind)."""
    if settings.port == 0:
        return []
    own = {settings.host.lower(), *_LOOPBACK_NAMES}
    problems = []
    for name, target in targets.items():
        via = target.via
        host, port = (target.host, target.port) if via is None else (via.host, via.port)
        host = host.lower()
        if port == settings.port and (host in own or host.startswith("127.")):
            first = "upstream" if via is None else f"egress proxy {via.shown} (from {via.source})"
            problems.append(
                f"{name} upstream: its {first} is this proxy itself "
                f"({settings.host}:{settings.port}): every request would loop through it"
            )
    return problems


class Upstream:
    """The upstream HTTP client: one :class:`~proxy._upstream.UpstreamPool` for all exchanges.

    There is no total timeout (it would cut a long stream): ``connect`` bounds
    the TCP/TLS connect, ``header_timeout`` the wait for response headers, and
    ``idle_read`` the silence between two reads of the body (seconds each).
    Each upstream's route (direct, or through a forward proxy) is chosen here,
    once, from ``settings`` and ``environ`` (the process environment when
    ``None``): see :mod:`proxy._egress`.

    Raises:
        ValueError: an upstream base URL is not ``http(s)://host[:port][/path]``.
        EgressError: a proxy URL is unusable, or ``upstream_ca_file`` cannot be
            loaded (:func:`egress_problems` reports both beforehand).
    """

    __slots__ = ("failures", "header_timeout", "pool", "targets")

    def __init__(self, settings: Settings, environ: Mapping[str, str] | None = None) -> None:
        self.targets: Final[Mapping[str, UpstreamTarget]] = upstream_targets(
            settings, os.environ if environ is None else environ
        )
        self.header_timeout: Final = settings.upstream_header_timeout
        self.pool = UpstreamPool(
            connect_timeout=settings.upstream_connect_timeout,
            idle_read=settings.upstream_idle_read_timeout,
            max_connections=settings.upstream_max_connections,
            tls_context=upstream_tls(settings.upstream_ca_file),
        )
        #: Failed requests, per upstream and outcome: the first is logged, then one
        #: summary line per 10 s with the count (an upstream down would otherwise
        #: cost a warning per request; the access log keeps its line per request).
        self.failures: Final = LogLimiter(log, interval=FAILURE_LOG_INTERVAL)

    def target(self, upstream: str, path: str, query: str) -> tuple[UpstreamTarget, str]:
        """Where ``path`` and the raw ``query`` string (kept as sent) go on ``upstream``."""
        target = self.targets[upstream]
        return target, target.request_target(path, query)

    def log_failure(self, ex: Exchange, target: UpstreamTarget, failure: _UpstreamFailure) -> None:
        """The warning of one failed upstream request, rate-limited per upstream and outcome."""
        detail = f" ({failure.detail})" if failure.detail else ""
        self.failures.event(
            f"upstream {target.host_field} failed ({failure.outcome})",
            "%s %s: %s%s",
            ex.id,
            ex.protocol,
            failure.message,
            detail,
        )

    async def close(self) -> None:
        """Close the pool (open upstream connections are closed); summarise failures."""
        self.failures.flush()
        await self.pool.close()


def error_response(
    protocol: Protocol,
    status: int,
    message: str,
    *,
    code: str | None = None,
    headers: Mapping[str, str] | None = None,
    close: bool = False,
) -> SmallAnswer:
    """A JSON error in the client's protocol shape (docs/design.md §7); ``close``:
    the connection closes after it."""
    return SmallAnswer(
        status,
        body=protocols.error_body(protocol, status, message, code=code),
        content_type="application/json",
        headers=headers,
        close=close,
    )


class _Decoder:
    """Undoes the upstream answer's content codings, one piece at a time; knows
    whether the coded body ended.

    The wire bytes given to :meth:`feed` (or the end, :meth:`finish`) are decoded
    only as the relay asks for pieces (:meth:`next_piece`), each at most about
    :data:`DECODE_PIECE_BYTES`, and the relay asks for the next one once it has
    forwarded the last (client backpressure included). So an answer that expands
    a thousandfold (a gzip bomb) is held a piece at a time, not a wire chunk's
    worth of output; and a refold request seen in one piece leaves the rest
    undecoded for when the refold is declined.
    """

    __slots__ = ("_decoder", "_pieces", "codings", "ended", "failure")

    def __init__(self, codings: tuple[str, ...]) -> None:
        self.codings = codings
        self.ended = False
        #: Why the coded data is unusable past the pieces taken (``None``: it is fine).
        self.failure: str | None = None
        self._decoder = ContentDecoder(codings, piece=DECODE_PIECE_BYTES, limit=_NO_LIMIT)
        self._pieces: Iterator[bytes] | None = None

    @property
    def decoding(self) -> bool:
        """Whether the bytes fed (or the end) may still give pieces: ask before reading on."""
        return self._pieces is not None

    def feed(self, data: bytes) -> None:
        """The next wire bytes, decoded by the next :meth:`next_piece` calls."""
        self._pieces = self._decoder.pieces(data)

    def finish(self) -> None:
        """The wire body ended: the codecs' rest comes from :meth:`next_piece`, then
        the check that the coded data ended."""
        self.ended = True
        self._pieces = self._decoder.end_pieces()

    def next_piece(self) -> bytes | None:
        """The next decoded piece; ``None`` once the bytes fed are decoded.

        Corrupt data (or coded data that stopped before its end, e.g. a gzip
        body without its trailer) ends the body here: :attr:`failure` says why.
        """
        pieces = self._pieces
        if pieces is None:
            return None
        try:
            return next(pieces)
        except StopIteration:
            pass
        except BodyError:
            # What decoded before the damage went to the gate; the end follows.
            what = "truncated" if self.ended else "corrupt"
            self.failure = f"{what} {'+'.join(self.codings)} body"
            self.ended = True
        self._pieces = None
        return None

    def release(self) -> None:
        """Drop the codec state and the bytes not yet decoded (idempotent)."""
        self._decoder.release()
        self._pieces = None


def _finishes(actions: list[Action], start: int) -> bool:
    """Whether ``actions[start:]`` ends the answer (``Finish``) with nothing to write before.

    Between them only usage and a ``Linger`` (moot when the end is already here).
    """
    if start >= len(actions) or not isinstance(actions[-1], Finish):
        return False
    # A loop, not all() over a generator: a generator and its frame on every answer.
    for action in actions[start:-1]:  # noqa: SIM110
        if not isinstance(action, (Usage, Linger)):
            return False
    return True


class _Verdict(enum.Enum):
    """How one upstream answer ended, for the attempt loop (:meth:`_Relay.run`)."""

    #: The answer went to the client (or the client's answer is decided): no new attempt.
    DONE = "done"
    #: The exchange was re-prepared at the next fold level: send the smaller body.
    REFOLD = "refold"
    #: A fake-completion resend of the same body.
    RETRY = "retry"


# Gate states after which nothing more may be fed: the driver acts on what it has first.
_DECIDING: Final = (GateState.DONE, GateState.REFOLDING)

# Enum members read on every request, as module constants: an Enum class attribute
# is looked up through the enum metaclass's __getattr__ hook, many times a global's cost.
_DONE: Final = _Verdict.DONE
_RETRY: Final = _Verdict.RETRY
_REFOLD: Final = _Verdict.REFOLD
_TERMINAL: Final = GateState.TERMINAL


class _Relay:
    """One relay call: the attempts of one exchange and the gate of the current answer."""

    __slots__ = (
        "client",
        "ex",
        "gate",
        "linger_until",
        "max_refolds",
        "max_retries",
        "rejection",
        "request",
        "retry_after",
        "target",
        "trace",
        "upstream",
    )

    def __init__(
        self,
        request: Request,
        ex: Exchange,
        upstream: Upstream,
        target: tuple[UpstreamTarget, str],
        headers: CIMultiDict[str],
        settings: Settings,
        trace: ExchangeTrace | None,
    ) -> None:
        self.request = request
        self.trace = trace
        self.ex = ex
        self.upstream = upstream
        self.target = target
        # Owned by the exchange from here on: dropped with the outbound body.
        ex.attach_headers(headers)
        self.max_refolds = settings.max_refolds
        self.max_retries = settings.fake_completion_retries
        self.retry_after = settings.retry_after
        self.client: StreamAnswer | None = None
        self.gate: StreamGate | None = None
        self.rejection: SmallAnswer | None = None
        # Loop time by which the upstream must end its body after the terminal event.
        self.linger_until: float | None = None

    # ------------------------------------------------------------------ sending

    async def _send(self) -> UpstreamAnswer:
        ex = self.ex
        headers = ex.outbound_headers
        if headers is None:
            raise RuntimeError(f"{ex.id}: send after the outbound header fields were dropped")
        has_body = ex.outbound_holder is not None
        if has_body:
            headers["Content-Length"] = str(ex.outbound_size)
        # Sent from here on: the upload and the wait for headers are one phase.
        ex.mark_sent()
        where, path = self.target
        try:
            return await self.upstream.pool.request(
                where,
                ex.method,
                path,
                headers,
                ex.outbound_chunks if has_body else None,
                ex.outbound_size if has_body else 0,
                head_timeout=self.upstream.header_timeout,
            )
        except PoolClosed as exc:
            raise _UpstreamFailure(503, Outcome.CANCELLED, str(exc)) from None
        except PoolBusy as exc:
            # The proxy's own limit (upstream_max_connections): the upstream never saw
            # it. Logged once, with every failure, by run().
            raise _UpstreamFailure(503, Outcome.REJECTED, str(exc)) from None
        except TimeoutError as exc:
            # No head in time (HeadTimeout), or no connection in time (ConnectTimeout).
            raise _UpstreamFailure(504, Outcome.UPSTREAM_TIMEOUT, str(exc)) from None
        except BadResponseHead as exc:
            # Our own words (the head's bytes may hold a header value).
            raise _UpstreamFailure(502, Outcome.UPSTREAM_ERROR, str(exc)) from None
        except UpstreamError as exc:
            if is_fd_exhaustion(exc):
                # Our limit, not the upstream's fault: the client may retry (here or elsewhere).
                raise _UpstreamFailure(503, Outcome.REJECTED, EXHAUSTED_MESSAGE) from None
            # The class name helps whoever reads the log; the client gets plain words.
            raise _UpstreamFailure(
                502, Outcome.UPSTREAM_UNREACHABLE, str(exc), type(exc).__name__
            ) from None

    def _attempt(self, reason: AttemptReason) -> AttemptTrace | None:
        """The span of the attempt about to be sent; it puts its trace context in the
        outbound header fields (``None`` when they are already gone)."""
        trace = self.trace
        headers = self.ex.outbound_headers
        assert trace is not None
        if headers is None:
            return None
        where = self.target[0]
        return trace.attempt(self.ex, headers, reason=reason, host=where.host, port=where.port)

    def _can_refold(self) -> bool:
        # After release the preparer is gone: an overflow seen later (e.g. in a
        # chat stream gated for a resend) goes to the client as it came.
        return self.ex.can_refold and self.ex.fold_level < self.max_refolds

    # ---------------------------------------------------------------- main loop

    async def run(self) -> Answer:
        """The attempts, then the answer (or an error response to return)."""
        ex = self.ex
        # The loop and its cancel handling in one coroutine: each frame of the
        # await chain lives as long as the stream, idle or not.
        attempt_reason: AttemptReason = "first"
        try:
            while True:
                if self.request.client_gone():
                    raise ClientGone
                if not self._can_refold():
                    # The release boundary comes before the last send: the parsed
                    # body must not sit in memory while the upstream reads and thinks.
                    ex.release(keep_outbound=True)
                attempt = None if self.trace is None else self._attempt(attempt_reason)
                try:
                    try:
                        resp = await self._send()
                    except _UpstreamFailure as failure:
                        if attempt is not None:
                            attempt.failed(failure.outcome)
                        ex.release()
                        ex.conclude(failure.status, failure.outcome, failure.message)
                        self.upstream.log_failure(ex, self.target[0], failure)
                        retry = (
                            {"Retry-After": str(self.retry_after)}
                            if failure.status == 503
                            else None
                        )
                        return error_response(
                            ex.protocol, failure.status, failure.message, headers=retry
                        )
                    if attempt is not None:
                        attempt.answered(resp.status)
                    try:
                        verdict = await self._answer(resp)
                    finally:
                        # Closing (not releasing) an unfinished response drops its
                        # connection, which is how the upstream learns we are gone.
                        if resp.at_eof:
                            resp.release()
                        else:
                            resp.close()
                finally:
                    if attempt is not None:
                        attempt.end()
                if verdict is _DONE:
                    if self.rejection is not None:
                        return self.rejection
                    assert self.client is not None
                    return self.client
                # A new attempt: what the last gate held (the head of a refolded answer) goes.
                self.gate = None
                ex.hold_response(0)
                if verdict is _RETRY:
                    ex.count_retry()
                    attempt_reason = "resend"
                else:
                    # _Verdict.REFOLD: the exchange was already re-prepared (_refold); send again.
                    attempt_reason = "refold"
        except asyncio.CancelledError as exc:
            reason = orderly_cancel_reason(exc)
            if reason is None:
                raise
            return await self._orderly_stop(reason.message, reason.code)

    async def _orderly_stop(self, message: str, code: str) -> Answer:
        """An orderly stop (session shutdown, process drain), not a client gone:
        the client still gets a well-formed end in its own protocol."""
        task = asyncio.current_task()
        if task is not None:
            task.uncancel()
        ex = self.ex
        ex.release()
        gate = self.gate
        if self.client is not None and self.client.prepared and gate is not None:
            await self._perform(gate.abort(message, code=code), outcome=Outcome.CANCELLED)
            return self.client
        ex.conclude(503, Outcome.CANCELLED, message)
        # Like every 503 of the proxy: tell the client when to come back.
        retry = {"Retry-After": str(self.retry_after)}
        return error_response(ex.protocol, 503, message, code=code, headers=retry)

    async def _answer(self, resp: UpstreamAnswer) -> _Verdict:
        """Drive one upstream answer through a fresh gate to its :class:`_Verdict`."""
        ex = self.ex
        ex.upstream_answered(resp.status, resp.wait_s)
        meta = ex.meta
        try:
            codings = parse_content_encoding(",".join(resp.headers.getall("Content-Encoding", ())))
        except BodyError:
            # Not one the upstream client offered (it sends Accept-Encoding itself).
            message = "upstream answered with a content coding the proxy cannot decode"
            ex.release()
            ex.conclude(502, Outcome.UPSTREAM_ERROR, message)
            log.warning("%s %s: %s", ex.id, ex.protocol, message)
            self.rejection = error_response(ex.protocol, 502, message)
            return _DONE
        # Each attempt starts clean: a refold or resend discards what the last one saw.
        gate = self.gate = StreamGate(
            ex.protocol,
            status=resp.status,
            content_type=resp.content_type,
            stream_requested=meta is not None and meta.stream,
            can_refold=self._can_refold(),
            may_resend=ex.retries < self.max_retries,
        )
        self.linger_until = None
        # When the answer's first bytes came with its head, the client's head waits
        # for them (the next read returns at once): both leave in one write.
        verdict = await self._perform(gate.start(), resp=resp, send_head=not resp.arrived)
        ex.hold_response(gate.held_bytes())
        if verdict is not None:
            return verdict
        decoder = _Decoder(codings) if codings else None
        try:
            while verdict is None:
                # The read is awaited here, not in a helper coroutine: an idle
                # stream waits in this frame, and every frame of the chain is
                # held per open stream.
                if decoder is not None and (decoder.decoding or decoder.ended):
                    actions = self._drain(gate, decoder)
                else:
                    try:
                        # The grace read needs no timer when the body's end is here.
                        if self.linger_until is None or resp.ended:
                            chunk = await resp.read()
                        else:
                            async with asyncio.timeout_at(self.linger_until):
                                chunk = await resp.read()
                    except (UpstreamError, TimeoutError) as exc:
                        actions = self._read_failed(gate, exc)
                    else:
                        actions = self._take(resp, gate, decoder, chunk)
                        del chunk  # not held while the next read waits
                verdict = await self._perform(actions, resp=resp)
                del actions  # the events written: not held while the next read waits
                # The response side's buffers (held head, partial-event tail, JSON head).
                ex.hold_response(gate.held_bytes())
        finally:
            if decoder is not None:
                decoder.release()
        return verdict

    def _read_failed(self, gate: StreamGate, exc: BaseException) -> list[Action]:
        """The body read failed (or the grace after the terminal event ran out)."""
        if self.linger_until is not None:
            log.info(
                "%s: upstream did not end its body after the final event (%s); closed it",
                self.ex.id,
                type(exc).__name__,
            )
        else:
            log.info("%s: upstream body read failed (%s)", self.ex.id, type(exc).__name__)
        return gate.end(clean=False, reason=_read_failure(exc))

    def _take(
        self,
        resp: UpstreamAnswer,
        gate: StreamGate,
        decoder: _Decoder | None,
        chunk: bytes,
    ) -> list[Action]:
        """Give the gate the chunk just read from ``resp`` (``b""``: the body ended),
        decoded first."""
        if decoder is None:
            if not chunk:
                return gate.end(clean=True)
            actions = gate.feed(chunk)
            if resp.at_eof and (
                gate.state is _TERMINAL or (not gate.framed and gate.state not in _DECIDING)
            ):
                # The body ended with this chunk, and the answer is whole: a plain one
                # (JSON), or an event stream whose terminal event came in it (R1:
                # nothing may follow). The end goes in the same batch, so the answer
                # leaves with its end in one write (one syscall less per small stream).
                # A stream that ended without its terminal event keeps the general
                # path: its last events, then the in-band error.
                actions += gate.end(clean=True)
            return actions
        if chunk:
            decoder.feed(chunk)
        else:
            decoder.finish()
        return self._drain(gate, decoder)

    @staticmethod
    def _drain(gate: StreamGate, decoder: _Decoder) -> list[Action]:
        """Feed the gate the next decoded piece (one: its writes are done before the
        next is decoded); the end after the last."""
        piece = decoder.next_piece()
        if piece is not None:
            return gate.feed(piece)
        if decoder.ended:
            failure = decoder.failure
            return gate.end(clean=failure is None, reason=failure or "")
        return []  # these wire bytes are decoded: read on

    # ------------------------------------------------------------------ actions

    async def _perform(
        self,
        actions: list[Action],
        *,
        resp: UpstreamAnswer | None = None,
        outcome: Outcome = Outcome.STREAM_ERROR,
        send_head: bool = True,
    ) -> _Verdict | None:
        """Do what the gate asked, in order; a verdict once the answer is over.

        A client head still waiting afterwards is sent (unless ``send_head`` is
        false: the caller knows the next batch follows without waiting). One
        coroutine per batch, the writes awaited in it (no frame per write): it
        runs for every read of every answer.
        """
        ex = self.ex
        for index, action in enumerate(actions):
            if isinstance(action, Forward):
                data = action.data
                if _finishes(actions, index + 1):
                    for rest in actions[index + 1 : -1]:
                        if isinstance(rest, Usage):
                            ex.set_usage(rest.tokens)
                    await self._write_last(data)
                    return _DONE
                client = self.client
                assert client is not None
                try:
                    await client.write(data)
                except ConnectionError as exc:
                    raise ClientGone from exc
                ex.count_response_bytes(len(data))
            elif isinstance(action, Accept):
                ex.accept()
            elif isinstance(action, Open):
                assert resp is not None
                if action.upstream_error:
                    ex.set_outcome(Outcome.UPSTREAM_ERROR)
                await self._start_client(resp)
            elif isinstance(action, Linger):
                # The final event is out: a hang-up from now on is no failure.
                ex.response_complete()
                if action.failed:  # booked as a failed upstream answer, as an error status is
                    ex.set_outcome(Outcome.UPSTREAM_ERROR)
                self.linger_until = asyncio.get_running_loop().time() + action.seconds
            elif isinstance(action, Usage):
                ex.set_usage(action.tokens)
            elif isinstance(action, Finish):
                return _DONE
            elif isinstance(action, Fail):
                self._send_head()
                self._fail(action, outcome)
                return _DONE
            elif isinstance(action, Refold):
                return await self._refold(action, resp)
            elif isinstance(action, Resend):
                if self.request.client_gone():
                    raise ClientGone
                log.info("%s: empty completion; resending (retry %d)", ex.id, ex.retries + 1)
                return _RETRY
            else:
                assert isinstance(action, Reject)
                ex.conclude(action.status, Outcome.UPSTREAM_ERROR, action.message)
                log.warning("%s %s: %s", ex.id, ex.protocol, action.message)
                self.rejection = error_response(ex.protocol, action.status, action.message)
                return _DONE
        if send_head:
            self._send_head()
        return None

    async def _refold(self, action: Refold, resp: UpstreamAnswer | None) -> _Verdict | None:
        """Re-prepare at the next fold level; ``refold`` means send again.

        Never after the client has gone (nobody would read the answer), and
        only when the body shrank; else the gate relays the upstream's answer.
        """
        ex = self.ex
        if self.request.client_gone():
            raise ClientGone
        if await refold(ex, prompt_tokens=action.prompt_tokens, window_tokens=action.window_tokens):
            log.info("%s: %s; refolded to level %d", ex.id, action.reason, ex.fold_level)
            return _REFOLD
        assert self.gate is not None
        return await self._perform(self.gate.refold_declined(), resp=resp)

    def _fail(self, action: Fail, outcome: Outcome) -> None:
        ex = self.ex
        ex.set_outcome(outcome, action.message)
        log.warning("%s %s: %s", ex.id, ex.protocol, action.message)
        if action.cut:
            # Not an event stream (a JSON body, a file): an event appended to it would
            # corrupt it. Cut the connection instead; the client sees a truncated body,
            # which SDKs treat as a connection error (and retry).
            transport = self.request.transport
            if transport is not None:
                transport.close()

    async def _start_client(self, resp: UpstreamAnswer) -> None:
        # The head waits for the first body bytes: it leaves with them, one write (a
        # syscall) per answer; a whole answer that arrived in one piece leaves in one
        # write with its end. The relay sends a head still waiting at the end of each
        # batch of actions (_send_head) unless the next batch is already here (body
        # bytes that came with the upstream's head): a client never waits on the upstream.
        client = StreamAnswer(resp.status, response_headers(resp.headers))
        # The upstream's head is in the client's now: the exchange lets it go.
        self.ex.mark_streaming(upstream_head=resp)
        self.client = client
        try:
            await client.prepare(self.request)
        except ConnectionError as exc:
            raise ClientGone from exc

    def _send_head(self) -> None:
        """Send the client's response head if it still waits for body bytes."""
        client = self.client
        if client is not None and client.prepared and not self.request.client_gone():
            client.send_head()

    async def _write_last(self, data: bytes) -> None:
        """Write the answer's last bytes and its end at once (one write with a waiting head)."""
        assert self.client is not None
        if self.request.client_gone():
            raise ClientGone
        # Handed to the connection below: a hang-up from now on is no failure (as
        # the handler's own end of the answer, proxy/_app.py).
        self.ex.response_complete()
        # A try, not contextlib.suppress: that is three Python calls on every answer.
        try:  # noqa: SIM105
            await self.client.write_eof(data)
        except ConnectionError:
            pass
        self.ex.count_response_bytes(len(data))


def relay(
    request: Request,
    ex: Exchange,
    upstream: Upstream,
    *,
    target: tuple[UpstreamTarget, str],
    headers: CIMultiDict[str],
    settings: Settings,
    trace: ExchangeTrace | None = None,
) -> Coroutine[Any, Any, Answer]:
    """Send ``ex`` to ``target`` and relay the answer to ``request``'s client (awaitable).

    The header fields go to ``ex`` (:meth:`Exchange.attach_headers`), which
    drops them when no send can follow. ``trace`` (tracing on) gets a span per
    upstream attempt, whose trace context goes upstream in the header fields.
    Returns the response already prepared and written (or a plain error
    response to return). Upstream 4xx/5xx pass through with their status and
    body; unreachable → 502, no headers in time → 504, both in the client's
    protocol shape; a stream that dies mid-way ends with an in-band error event.

    Raises:
        ClientGone: the client disconnected; the upstream request was closed.
        asyncio.CancelledError: the handler was cancelled (the upstream
            request is closed on the way out).
    """
    # The coroutine itself, not awaited here: one frame less held per open stream.
    return _Relay(request, ex, upstream, target, headers, settings, trace).run()

"""The upstream edge: send an exchange, refold on overflow, relay the answer (I/O).

One call of :func:`relay` drives one exchange from "prepared" to "streaming is
over": it sends the outbound body as ``memoryview`` slices, classifies the
upstream's answer, refolds on a context overflow, resends on an empty answer
when fake-completion retry is armed, calls :meth:`Exchange.accept` (the release
boundary) as soon as no refold can follow, and relays the response bytes to the
client exactly as received, with backpressure in both directions.

SSE bytes are forwarded at event boundaries (a partial event waits for its end,
up to :data:`PARTIAL_EVENT_CAP` bytes) so that a stream that dies mid-way can
be closed with a well-formed in-band error event instead of half a JSON line.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Mapping
from typing import Final

import aiohttp
from aiohttp import web
from multidict import CIMultiDict, CIMultiDictProxy

from . import protocols
from .config import Settings
from .exchange import Exchange, Outcome
from .protocols import Protocol
from .sessions import shutdown_cause
from .sse import SSEFramer

__all__ = [
    "ERROR_BODY_CAP",
    "HEAD_HOLD_CAP",
    "PARTIAL_EVENT_CAP",
    "SHUTDOWN_CANCEL",
    "ClientGone",
    "Upstream",
    "orderly_cancel_reason",
    "relay",
]

log = logging.getLogger("context_proxy.relay")

#: Bytes of an upstream error body read to classify it (overflow or not).
ERROR_BODY_CAP: Final = 1 << 20
#: Bytes of a stream's head held back while a refold or resend is still possible.
HEAD_HOLD_CAP: Final = 4 << 20
#: Bytes of one unfinished SSE event held back before it is forwarded anyway.
PARTIAL_EVENT_CAP: Final = 1 << 20
#: Bytes of a non-streaming JSON answer kept to read its usage.
USAGE_JSON_CAP: Final = 1 << 20
#: Seconds to wait for the upstream's end of body once the final SSE event was relayed.
#: A healthy upstream ends it within a round trip (the connection then stays pooled);
#: one that keeps it open must not keep the client's complete answer from ending.
TERMINAL_EOF_GRACE: Final = 0.5

# RFC 9110 section 7.6.1 plus the de-facto ones; never forwarded in either direction.
HOP_BY_HOP: Final = frozenset(
    {
        "connection",
        "keep-alive",
        "proxy-authenticate",
        "proxy-authorization",
        "proxy-connection",
        "te",
        "trailer",
        "transfer-encoding",
        "upgrade",
    }
)
# Recomputed by us: the body was decoded and is re-framed on each side.
_REQUEST_DROP: Final = HOP_BY_HOP | {
    "host",
    "content-length",
    "content-encoding",
    "accept-encoding",
}
_RESPONSE_DROP: Final = HOP_BY_HOP | {"content-length", "content-encoding", "server", "date"}


#: Prefix of the cancellation message of an orderly stop (see :func:`orderly_cancel_reason`).
SHUTDOWN_CANCEL: Final = "context-proxy: proxy shutting down"


class ClientGone(Exception):
    """The client closed its connection; the upstream request was aborted."""


def orderly_cancel_reason(exc: asyncio.CancelledError) -> str | None:
    """Why the handler was cancelled, if it was an orderly stop; ``None`` otherwise.

    An orderly stop is a session shutdown (the registry cancels with a
    :class:`~proxy.sessions.SessionShutdown` marker) or the process drain
    (:data:`SHUTDOWN_CANCEL`). Any other cancellation means the client is gone.
    """
    if shutdown_cause(exc) is not None:
        return "session closed"
    if exc.args and exc.args[0] == SHUTDOWN_CANCEL:
        return "proxy shutting down"
    return None


class _UpstreamFailure(Exception):
    """No usable answer from the upstream: ``status`` 502 or 504 goes to the client."""

    def __init__(self, status: int, outcome: Outcome, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.outcome = outcome
        self.message = message


class Upstream:
    """The upstream HTTP client: one pooled ``aiohttp.ClientSession`` for all exchanges.

    There is no total timeout (it would cut a long stream): ``connect`` bounds
    the TCP/TLS connect, ``header_timeout`` the wait for response headers, and
    ``idle_read`` the silence between two reads of the body (seconds each).
    """

    __slots__ = ("bases", "header_timeout", "session")

    def __init__(self, settings: Settings) -> None:
        self.bases: Final[Mapping[str, str]] = {
            "openai": settings.upstream_openai.rstrip("/"),
            "anthropic": settings.upstream_anthropic.rstrip("/"),
        }
        self.header_timeout: Final = settings.upstream_header_timeout
        self.session = aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(limit=settings.upstream_max_connections),
            timeout=aiohttp.ClientTimeout(
                total=None,
                connect=settings.upstream_connect_timeout,
                sock_read=settings.upstream_idle_read_timeout,
            ),
            # A proxy must not carry one client's cookies into another's requests.
            cookie_jar=aiohttp.DummyCookieJar(),
            auto_decompress=True,
            trust_env=False,
        )

    def url(self, upstream: str, path: str, query: str) -> str:
        """The upstream URL for ``path`` and the raw ``query`` string (kept as sent)."""
        return f"{self.bases[upstream]}{path}" + (f"?{query}" if query else "")

    async def close(self) -> None:
        """Close the pool (open upstream connections are closed)."""
        await self.session.close()


def _connection_listed(headers: CIMultiDictProxy[str]) -> frozenset[str]:
    """Field names listed in ``Connection``: hop-by-hop too (RFC 9110 section 7.6.1)."""
    return frozenset(
        token.strip().lower()
        for value in headers.getall("Connection", ())
        for token in value.split(",")
        if token.strip()
    )


def _end_to_end(headers: CIMultiDictProxy[str], drop: frozenset[str]) -> CIMultiDict[str]:
    """``headers`` without ``drop`` and without the fields ``Connection`` names."""
    listed = _connection_listed(headers)
    # Usually nothing is listed (HTTP/1.1 keep-alive needs no Connection field): no union.
    dropped = drop | listed if listed else drop
    out: CIMultiDict[str] = CIMultiDict()
    for name, value in headers.items():
        if name.lower() not in dropped:
            out.add(name, value)
    return out


def forward_headers(headers: CIMultiDictProxy[str]) -> CIMultiDict[str]:
    """End-to-end request headers for the upstream (hop-by-hop and framing dropped)."""
    return _end_to_end(headers, _REQUEST_DROP)


def _response_headers(headers: CIMultiDictProxy[str]) -> CIMultiDict[str]:
    return _end_to_end(headers, _RESPONSE_DROP)


def error_response(
    protocol: Protocol,
    status: int,
    message: str,
    *,
    code: str | None = None,
    headers: Mapping[str, str] | None = None,
) -> web.Response:
    """A JSON error in the client's protocol shape (DESIGN section 7)."""
    return web.Response(
        status=status,
        body=protocols.error_body(protocol, status, message, code=code),
        content_type="application/json",
        headers=headers,
    )


def _client_gone(request: web.Request) -> bool:
    transport = request.transport
    return transport is None or transport.is_closing()


async def _read_capped(resp: aiohttp.ClientResponse, cap: int) -> tuple[bytes, bool]:
    """Up to ``cap`` bytes of the body and whether the whole body fit."""
    buf = bytearray()
    while len(buf) < cap:
        chunk = await resp.content.readany()
        if not chunk:
            return bytes(buf), True
        buf += chunk
    return bytes(buf), resp.content.at_eof()


class _Relay:
    """State of one relay call; see :func:`relay`."""

    __slots__ = (
        "client",
        "ex",
        "framer",
        "headers",
        "max_refolds",
        "max_retries",
        "request",
        "retry_after",
        "tail",
        "target",
        "upstream",
        "usage",
    )

    def __init__(
        self,
        request: web.Request,
        ex: Exchange,
        upstream: Upstream,
        target: str,
        headers: CIMultiDict[str],
        settings: Settings,
    ) -> None:
        self.request = request
        self.ex = ex
        self.upstream = upstream
        self.target = target
        self.headers = headers
        self.max_refolds = settings.max_refolds
        self.max_retries = settings.fake_completion_retries
        self.retry_after = settings.retry_after
        self.client: web.StreamResponse | None = None
        self.framer: SSEFramer | None = None
        self.tail = bytearray()
        self.usage = protocols.UsageMeter(ex.protocol)

    # ------------------------------------------------------------------ sending

    async def _send(self) -> aiohttp.ClientResponse:
        ex = self.ex
        if ex.outbound_holder is not None:
            self.headers["Content-Length"] = str(ex.outbound_size)
        # Sent from here on: the upload and the wait for headers are one phase.
        ex.mark_sent()
        try:
            async with asyncio.timeout(self.upstream.header_timeout):
                resp = await self.upstream.session.request(
                    ex.method,
                    self.target,
                    headers=self.headers,
                    data=ex.outbound_chunks() if ex.outbound_holder is not None else None,
                    allow_redirects=False,
                    skip_auto_headers=("Content-Type",),
                )
        except TimeoutError:
            raise _UpstreamFailure(
                504, Outcome.UPSTREAM_TIMEOUT, "upstream sent no response headers in time"
            ) from None
        except aiohttp.ClientError as exc:
            raise _UpstreamFailure(
                502, Outcome.UPSTREAM_UNREACHABLE, f"upstream unreachable: {type(exc).__name__}"
            ) from None
        return resp

    def _can_refold(self) -> bool:
        # After release the preparer is gone: an overflow seen later (e.g. in a
        # chat stream gated for a resend) goes to the client as it came.
        return self.ex.can_refold and self.ex.fold_level < self.max_refolds

    async def _refold(self, what: str) -> bool:
        """Re-prepare at the next fold level if that may help; ``True`` means resend.

        Never after the client has gone, never past ``max_refolds``, and only
        when the body shrank (else the upstream's error goes to the client).
        """
        ex = self.ex
        if not self._can_refold() or _client_gone(self.request) or not await ex.refold():
            return False
        log.info("%s: %s; refolded to level %d", ex.id, what, ex.fold_level)
        return True

    # ---------------------------------------------------------------- main loop

    async def run(self) -> web.StreamResponse:
        try:
            return await self._run()
        except asyncio.CancelledError as exc:
            reason = orderly_cancel_reason(exc)
            if reason is None:
                raise
            # An orderly stop (session shutdown, process drain), not a client gone:
            # the client still gets a well-formed end in its own protocol.
            task = asyncio.current_task()
            if task is not None:
                task.uncancel()
            ex = self.ex
            ex.release()
            if self.client is not None and self.client.prepared:
                await self._fail_stream(reason, outcome=Outcome.CANCELLED)
                return self.client
            ex.conclude(503, Outcome.CANCELLED, reason)
            # Like every 503 of the proxy: tell the client when to come back.
            retry = {"Retry-After": str(self.retry_after)}
            return error_response(ex.protocol, 503, reason, code="unavailable", headers=retry)

    async def _run(self) -> web.StreamResponse:
        ex = self.ex
        while True:
            if _client_gone(self.request):
                raise ClientGone
            if not self._can_refold():
                # The release boundary comes before the last send: the parsed
                # body must not sit in memory while the upstream reads and thinks.
                ex.release(keep_outbound=True)
            try:
                resp = await self._send()
            except _UpstreamFailure as failure:
                ex.release()
                ex.conclude(failure.status, failure.outcome, failure.message)
                log.warning("%s %s: %s", ex.id, ex.protocol, failure.message)
                return error_response(ex.protocol, failure.status, failure.message)
            try:
                verdict = await self._answer(resp)
            finally:
                # Closing (not releasing) an unfinished response drops its connection,
                # which is how the upstream learns we are gone.
                if resp.content.at_eof():
                    resp.release()
                else:
                    resp.close()
            if verdict == "done":
                assert self.client is not None
                return self.client
            if verdict == "retry":
                ex.count_retry()
            # "refold": the exchange already re-prepared itself; send again.

    async def _answer(self, resp: aiohttp.ClientResponse) -> str:
        """Handle one upstream answer: ``done``, ``refold`` or ``retry``."""
        ex = self.ex
        ex.upstream_answered(resp.status)
        # Each attempt starts clean: a refold or resend discards what the last one saw.
        self.framer = None
        self.tail.clear()
        ex.hold_response(0)
        self.usage = protocols.UsageMeter(ex.protocol)
        if resp.status >= 400:
            head, whole = await _read_capped(resp, ERROR_BODY_CAP)
            overflow = whole and protocols.is_overflow_response(
                ex.protocol, resp.status, resp.content_type, head
            )
            if overflow and await self._refold("context overflow"):
                return "refold"
            ex.accept()
            ex.set_outcome(Outcome.UPSTREAM_ERROR)
            await self._start_client(resp)
            await self._write(head)
            await self._pump(resp, gated=False)
            return "done"
        is_sse = resp.content_type == "text/event-stream"
        defer_accept = is_sse and ex.protocol is Protocol.RESPONSES and self._can_refold()
        # Only the exchange protocols have a known stream grammar (output, final event);
        # a passthrough stream (e.g. a stored response replayed) is relayed as it comes.
        gated = (
            is_sse and ex.protocol.is_exchange and (defer_accept or ex.retries < self.max_retries)
        )
        if not defer_accept:
            ex.accept()
        if is_sse:
            self.framer = SSEFramer()
        if not gated:
            await self._start_client(resp)
        return await self._pump(resp, gated=gated)

    # --------------------------------------------------------------- streaming

    async def _start_client(self, resp: aiohttp.ClientResponse) -> None:
        self.ex.mark_streaming()
        client = web.StreamResponse(status=resp.status, headers=_response_headers(resp.headers))
        self.client = client
        try:
            await client.prepare(self.request)
        except ConnectionError as exc:
            raise ClientGone from exc

    async def _write(self, data: bytes | bytearray | memoryview) -> None:
        if not data:
            return
        assert self.client is not None
        try:
            await self.client.write(data)
        except ConnectionError as exc:
            raise ClientGone from exc
        self.ex.count_response_bytes(len(data))

    async def _forward(self, chunk: bytes) -> None:
        """Forward ``chunk`` up to the last complete SSE event boundary."""
        framer = self.framer
        if framer is None:
            await self._write(chunk)
            return
        pending = framer.pending_bytes
        tail = self.tail
        if pending == 0 and not tail:
            await self._write(chunk)
            return
        if pending > PARTIAL_EVENT_CAP:
            # An enormous event: forward what we have; memory stays bounded.
            if tail:
                await self._write(tail)
                tail.clear()
            await self._write(chunk)
            return
        tail += chunk
        ready = len(tail) - pending
        if ready > 0:
            # The unfinished event moves to a fresh buffer rather than cutting the sent
            # bytes out of this one: a failed send keeps the view alive (in the error's
            # traceback), and a bytearray with a live view cannot be resized.
            self.tail = tail[ready:]
            await self._write(memoryview(tail)[:ready])

    async def _pump(self, resp: aiohttp.ClientResponse, *, gated: bool) -> str:
        """Relay the body; while ``gated``, hold the head back (refold/resend possible)."""
        ex = self.ex
        framer = self.framer
        held = bytearray()
        json_head = bytearray() if framer is None else None
        saw_output = saw_terminal = overflow = False
        # The client's SDK stops at the final event of a known stream: stop there too, so
        # an upstream that holds the body open or cuts it afterwards cannot spoil the answer.
        ends_at_terminal = ex.protocol.is_exchange
        try:
            async for chunk in resp.content.iter_any():
                if framer is not None:
                    for event in framer.feed(chunk):
                        self.usage.feed_event(event)
                        # Only the first output event matters (gate, resend); skipping the
                        # check afterwards saves a JSON decode per chat chunk.
                        if not saw_output and protocols.is_output_event(ex.protocol, event):
                            saw_output = True
                        elif protocols.is_terminal_event(ex.protocol, event):
                            saw_terminal = True
                        if (
                            gated
                            and not saw_output
                            and protocols.is_overflow_event(ex.protocol, event)
                        ):
                            overflow = True
                elif json_head is not None:
                    if len(json_head) + len(chunk) <= USAGE_JSON_CAP:
                        json_head += chunk
                    else:
                        json_head = None
                if not gated:
                    await self._forward(chunk)
                    self._account(held, json_head)
                    if saw_terminal and ends_at_terminal:
                        break
                    continue
                held += chunk
                if overflow and await self._refold("overflow in stream"):
                    return "refold"
                # An overflow that cannot be refolded goes to the client as the upstream sent it.
                if saw_output or overflow or len(held) > HEAD_HOLD_CAP:
                    gated = False
                    await self._open_gate(resp, held)
                    held = bytearray()
                self._account(held, json_head)
                if saw_terminal and ends_at_terminal:
                    break
        except (aiohttp.ClientPayloadError, aiohttp.ClientConnectionError, TimeoutError) as exc:
            if gated:
                await self._open_gate(resp, held)
            await self._fail_stream(f"upstream stream failed: {type(exc).__name__}")
            return "done"
        if gated:
            if not saw_output and ex.retries < self.max_retries and not _client_gone(self.request):
                log.info("%s: empty completion; resending (retry %d)", ex.id, ex.retries + 1)
                return "retry"
            await self._open_gate(resp, held)
        if saw_terminal and not resp.content.at_eof():
            await self._after_terminal(resp)
        if framer is not None:
            for event in framer.close():
                # A final event ended by a lone CR only completes at EOF.
                self.usage.feed_event(event)
                if protocols.is_terminal_event(ex.protocol, event):
                    saw_terminal = True
            if self.tail:
                await self._write(self.tail)
                self.tail.clear()
            if not saw_terminal and resp.status < 400 and ex.protocol.is_exchange:
                await self._fail_stream("upstream stream ended without its final event")
                return "done"
        elif json_head is not None:
            self.usage.feed_json(bytes(json_head))
        ex.hold_response(0)
        ex.set_usage(
            self.usage.input_tokens, self.usage.output_tokens, self.usage.cache_read_tokens
        )
        return "done"

    def _account(self, held: bytearray, json_head: bytearray | None) -> None:
        """Tell the exchange what the response side holds: head, JSON head, event tail."""
        head = len(json_head) if json_head is not None else 0
        self.ex.hold_response(len(held) + head + len(self.tail))

    async def _after_terminal(self, resp: aiohttp.ClientResponse) -> None:
        """Relay what follows the final event until the upstream's end of body.

        Waits at most :data:`TERMINAL_EOF_GRACE` seconds; a silence or a cut there
        is not a failure of the answer, which is complete. The upstream connection
        is closed (not pooled) when the body did not end.
        """
        framer = self.framer
        try:
            async with asyncio.timeout(TERMINAL_EOF_GRACE):
                while chunk := await resp.content.readany():
                    if framer is not None:
                        for event in framer.feed(chunk):
                            self.usage.feed_event(event)
                    await self._forward(chunk)
        except (aiohttp.ClientPayloadError, aiohttp.ClientConnectionError, TimeoutError) as exc:
            log.info(
                "%s: upstream did not end its body after the final event (%s); closed it",
                self.ex.id,
                type(exc).__name__,
            )

    async def _open_gate(self, resp: aiohttp.ClientResponse, held: bytearray) -> None:
        """No refold or resend any more: release, send headers and the held head."""
        self.ex.accept()
        await self._start_client(resp)
        if held:
            # The framer already saw these bytes; forward them as one chunk.
            await self._forward(bytes(held))

    async def _fail_stream(self, message: str, *, outcome: Outcome = Outcome.STREAM_ERROR) -> None:
        """End a broken stream with the protocol's in-band error event.

        A body that is not an event stream cannot carry one: its connection is
        closed instead, so the client sees a truncated body, never a spliced one.
        """
        ex = self.ex
        ex.set_outcome(outcome, message)
        ex.set_usage(
            self.usage.input_tokens, self.usage.output_tokens, self.usage.cache_read_tokens
        )
        log.warning("%s %s: %s", ex.id, ex.protocol, message)
        framer = self.framer
        if framer is None:
            # Not an event stream (a JSON body, a file): an event appended to it would
            # corrupt it. Cut the connection instead; the client sees a truncated body,
            # which SDKs treat as a connection error (and retry).
            transport = self.request.transport
            if transport is not None:
                transport.close()
            return
        if framer.mid_event and not self.tail:
            # Part of the event already went out: end it so the error parses on its own.
            await self._write(b"\n\n")
        self.tail.clear()
        await self._write(protocols.inband_error(ex.protocol, message))


async def relay(
    request: web.Request,
    ex: Exchange,
    upstream: Upstream,
    *,
    target: str,
    headers: CIMultiDict[str],
    settings: Settings,
) -> web.StreamResponse:
    """Send ``ex`` to ``target`` and relay the answer to ``request``'s client.

    Returns the response already prepared and written (or a plain error
    response to return). Upstream 4xx/5xx pass through with their status and
    body; unreachable → 502, no headers in time → 504, both in the client's
    protocol shape; a stream that dies mid-way ends with an in-band error event.

    Raises:
        ClientGone: the client disconnected; the upstream request was closed.
        asyncio.CancelledError: the handler was cancelled (the upstream
            request is closed on the way out).
    """
    return await _Relay(request, ex, upstream, target, headers, settings).run()

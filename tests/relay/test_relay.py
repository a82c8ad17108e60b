"""The relay (proxy/_relay.py) against a fake pool and a fake client connection: no sockets.

Each test hands :func:`proxy._relay.relay` a prepared :class:`~proxy._exchange.Exchange`,
an :class:`~proxy._relay.Upstream` whose pool is a script of answers (or errors),
and a :class:`~proxy._front.Request` whose connection records the bytes written to
the client. What is checked is what a client and an operator would see: the bytes
the client gets, the status and outcome booked on the exchange, how many times the
upstream was asked, and whether the upstream connection was kept (released) or
dropped (closed) afterwards.
"""

from __future__ import annotations

import asyncio
import base64
import gzip
import json
import random
from collections.abc import AsyncIterable, Callable, Iterable, Mapping
from typing import Any, Final, cast

import pytest
from multidict import CIMultiDict, CIMultiDictProxy

from proxy import _wire as wire
from proxy._answer import SmallAnswer
from proxy._cancel import SHUTDOWN_CANCEL
from proxy._config import Settings
from proxy._exchange import Exchange
from proxy._front import Request, StreamAnswer
from proxy._http1 import NEED_DATA, RequestHead, Response, ServerConnection
from proxy._phases import Phase
from proxy._plugins import Outcome, Plugin, PluginHost, PrepareContext
from proxy._prepare import Preparer, null_lock, prepare
from proxy._protocols import Protocol
from proxy._relay import ClientGone, Upstream, relay
from proxy._upstream import (
    AnswerCut,
    ConnectFailed,
    HeadTimeout,
    PoolBusy,
    UpstreamAnswer,
    UpstreamTarget,
)

CHAT: Final = "/v1/chat/completions"
BODY: Final = b'{"model":"m","stream":true,"messages":[{"role":"user","content":"hi"}]}'
SSE_TYPE: Final = "text/event-stream"
WAIT_S: Final = 5.0  # seconds: the bound on each relay call (none should take 0.1 s)


def _chunk(text: str) -> bytes:
    """One chat completion chunk event carrying ``text``."""
    payload = {
        "id": "c1",
        "object": "chat.completion.chunk",
        "model": "m",
        "choices": [{"index": 0, "delta": {"content": text}, "finish_reason": None}],
    }
    return b"data: " + json.dumps(payload).encode() + b"\n\n"


FINAL: Final = (
    b'data: {"id":"c1","object":"chat.completion.chunk","model":"m",'
    b'"choices":[{"index":0,"delta":{},"finish_reason":"stop"}],'
    b'"usage":{"prompt_tokens":7,"completion_tokens":2,"total_tokens":9}}\n\n'
    b"data: [DONE]\n\n"
)
OVERFLOW: Final = json.dumps(
    {
        "error": {
            "message": "This model's maximum context length is 8192 tokens. However, "
            "your messages resulted in 9000 tokens.",
            "type": "invalid_request_error",
            "param": "messages",
            "code": "context_length_exceeded",
        }
    }
).encode()


def _split(received: bytes) -> tuple[bytes, bytes, bool]:
    """The client's bytes as (head, body, ended): a chunked body is unframed, and
    ``ended`` says its last chunk came; a ``Content-Length`` body is taken as is."""
    head, _, rest = received.partition(b"\r\n\r\n")
    if b"transfer-encoding: chunked" not in head.lower():
        return head, rest, True
    body = bytearray()
    for _ in range(10_000):  # bounded: each pass takes one chunk
        size_line, sep, rest = rest.partition(b"\r\n")
        if not sep:
            return head, bytes(body), False
        size = int(size_line, 16)
        if size == 0:
            return head, bytes(body), rest == b"\r\n"
        body += rest[:size]
        rest = rest[size + 2 :]
    raise AssertionError("more than 10,000 chunks")


class FakeAnswer:
    """An upstream answer whose head is here; its body is a script of reads.

    Each item of ``reads`` is what one :meth:`read` returns (bytes) or raises (an
    exception) or waits for (an :class:`asyncio.Event`, a silent upstream); after
    the last, ``b""`` (the end). ``fields`` are header fields
    besides its ``Content-Type``. ``released`` / ``closed`` say
    what the relay did with the connection afterwards.
    """

    __slots__ = (
        "_reads",
        "_unended",
        "closed",
        "content_type",
        "headers",
        "released",
        "status",
        "wait_s",
    )

    def __init__(
        self,
        status: int,
        content_type: str,
        reads: Iterable[bytes | Exception | asyncio.Event],
        fields: Mapping[str, str] | None = None,
    ) -> None:
        self.status = status
        self.headers: CIMultiDictProxy[str] = CIMultiDictProxy(
            CIMultiDict({"Content-Type": content_type, **(fields or {})})
        )
        self.content_type = content_type
        self.wait_s = 0.001
        self._reads = list(reads)
        # The body did not end although no read is left: cut, or silent for now.
        self._unended = False
        self.released = False
        self.closed = False

    @property
    def arrived(self) -> bool:
        return bool(self._reads)

    @property
    def ended(self) -> bool:
        return not self._reads and not self._unended

    @property
    def at_eof(self) -> bool:
        # A body cut short (or still going) did not end: its connection must not be kept.
        return not self._reads and not self._unended

    async def read(self) -> bytes:
        if not self._reads:
            return b""
        item = self._reads.pop(0)
        if isinstance(item, asyncio.Event):
            # A silent upstream, until the test sets it (or cancels): its body goes on.
            self._unended = True
            await item.wait()
            self._unended = False
            return await self.read()
        if isinstance(item, Exception):
            self._reads.clear()
            self._unended = True
            raise item
        return item

    def drop_head(self) -> None:
        self.headers = CIMultiDictProxy(CIMultiDict())

    def release(self) -> None:
        self.released = True

    def close(self) -> None:
        self.closed = True


class FakePool:
    """Stands for :class:`~proxy._upstream.UpstreamPool`: each request takes the next
    scripted answer (or raises the next scripted error) and is recorded."""

    __slots__ = ("answers", "sent")

    def __init__(self, answers: Iterable[FakeAnswer | Exception]) -> None:
        self.answers = list(answers)
        #: Per request: the target path, its header fields and its body bytes.
        self.sent: list[tuple[str, dict[str, str], bytes]] = []

    async def request(
        self,
        target: UpstreamTarget,
        method: str,
        path: str,
        fields: Mapping[str, str],
        body: Callable[[], AsyncIterable[memoryview | bytes]] | None = None,
        body_bytes: int = 0,
        *,
        head_timeout: float | None = None,
    ) -> UpstreamAnswer:
        data = b"".join([bytes(piece) async for piece in body()]) if body is not None else b""
        self.sent.append((path, dict(fields), data))
        answer = self.answers.pop(0)
        if isinstance(answer, Exception):
            raise answer
        return cast(UpstreamAnswer, answer)

    async def close(self) -> None:
        """Nothing to close: no connection was ever opened."""


class _Transport:
    """The part of a transport :meth:`Request.client_gone` and the relay use."""

    __slots__ = ("closing",)

    def __init__(self) -> None:
        self.closing = False

    def is_closing(self) -> bool:
        return self.closing

    def close(self) -> None:
        self.closing = True


class FakeClientConn:
    """The client's connection as :class:`StreamAnswer` uses it (``proxy._request.Link``);
    keeps what is written. Its HTTP/1.1 machine is the real one, answering a request
    like :func:`_request`'s.

    ``gone_after`` writes, the client hangs up (the transport is lost).
    """

    __slots__ = ("gone_after", "http", "transport", "wire", "writing_paused")

    def __init__(self, gone_after: int | None = None) -> None:
        self.transport: _Transport | None = _Transport()
        self.http = ServerConnection(lambda: 0.0, header_timeout=30.0)
        self.http.receive_data(
            b"POST %s HTTP/1.1\r\nHost: x\r\nContent-Length: %d\r\n\r\n%s"
            % (CHAT.encode(), len(BODY), bytes(BODY))
        )
        for _ in range(10):  # bounded: a head, the body, its end
            if self.http.next_event() is NEED_DATA:
                break
        self.writing_paused = False
        self.gone_after = gone_after
        self.wire: list[bytes] = []

    def write(self, data: bytes) -> None:
        self.wire.append(data)
        if self.gone_after is not None and len(self.wire) >= self.gone_after:
            self.transport = None

    async def drain(self) -> None:
        if self.transport is None:
            raise ConnectionResetError("the client closed the connection")

    def send_head(self, head: Response) -> bytes:
        return self.http.send(head)

    def pause_for_body(self) -> None:
        pass

    def body_drained(self) -> None:
        pass

    @property
    def received(self) -> bytes:
        return b"".join(self.wire)


class Shrinker(Plugin):
    """Halves the last user message at each fold level past 0 (a refold that shrinks)."""

    name = "shrinker"

    async def prepare(self, ctx: PrepareContext) -> bool:
        if ctx.fold_level == 0:
            return False
        last = ctx.view.items()[-1]["content"]
        last.replace(last.text()[: len(last.text()) // 2])
        return True


def _exchange(plugins: list[Plugin] | None = None) -> Exchange:
    buffer = bytearray(BODY)
    meta = wire.compute_wire_metadata(Protocol.CHAT, buffer, wire.digest_bytes(buffer))
    ex = Exchange(protocol=Protocol.CHAT, method="POST", path=CHAT, keep_for_resend=True)
    ex.attach_body(buffer, meta)
    ex.bind_preparer(Preparer(PluginHost(plugins or [], timeout=5.0), null_lock, None))
    return ex


def _request(conn: FakeClientConn) -> Request:
    head = RequestHead(
        "POST",
        CHAT,
        CIMultiDictProxy(CIMultiDict({"Content-Length": str(len(BODY))})),
        (1, 1),
        keep_alive=True,
        content_length=len(BODY),
        chunked=False,
    )
    return Request(head, cast(Any, conn))


class Run:
    """One relay call's parts, for the assertions."""

    __slots__ = ("_settings", "conn", "ex", "pool", "request", "upstream")

    def __init__(
        self,
        answers: Iterable[FakeAnswer | Exception],
        *,
        plugins: list[Plugin] | None = None,
        gone_after: int | None = None,
    ) -> None:
        settings = Settings(upstream_openai="http://upstream.invalid:9")
        self.upstream = Upstream(settings, environ={})
        self.pool = FakePool(answers)
        self.upstream.pool = cast(Any, self.pool)
        self.ex = _exchange(plugins)
        self.conn = FakeClientConn(gone_after)
        self.request = _request(self.conn)
        self._settings = settings

    async def relay(self) -> object:
        """The relay's result: a prepared :class:`StreamAnswer` or a small answer."""
        await prepare(self.ex)
        async with asyncio.timeout(WAIT_S):
            return await relay(
                self.request,
                self.ex,
                self.upstream,
                target=self.upstream.target("openai", CHAT, ""),
                headers=CIMultiDict({"Content-Type": "application/json"}),
                settings=self._settings,
            )


async def test_a_2xx_stream_reaches_the_client_whole_and_keeps_the_connection() -> None:
    answer = FakeAnswer(200, SSE_TYPE, [_chunk("Hel"), _chunk("lo"), FINAL])
    run = Run([answer])
    result = await run.relay()
    assert isinstance(result, StreamAnswer) and result.status == 200
    head, body, ended = _split(run.conn.received)
    assert head.startswith(b"HTTP/1.1 200 OK\r\n")
    # Every event, byte for byte and in order, then the body's end.
    assert body == _chunk("Hel") + _chunk("lo") + FINAL and ended
    # One request upstream, the body as prepared, its length declared.
    ((path, fields, sent),) = run.pool.sent
    assert path == CHAT and sent == BODY and fields["Content-Length"] == str(len(BODY))
    assert run.ex.phase is Phase.STREAMING and run.ex.outcome is Outcome.OK
    assert run.ex.usage is not None
    assert (run.ex.usage.input_tokens, run.ex.usage.output_tokens) == (7, 2)
    assert answer.released and not answer.closed


async def test_an_upstream_error_head_passes_through_with_its_status_and_body() -> None:
    body = b'{"error":{"message":"invalid api key","type":"auth","code":"invalid_api_key"}}'
    answer = FakeAnswer(401, "application/json", [body])
    run = Run([answer])
    result = await run.relay()
    assert isinstance(result, StreamAnswer) and result.status == 401
    head, received, ended = _split(run.conn.received)
    assert head.startswith(b"HTTP/1.1 401 Unauthorized\r\n")
    assert received == body and ended
    assert run.ex.outcome is Outcome.UPSTREAM_ERROR
    assert len(run.pool.sent) == 1
    assert answer.released and not answer.closed


@pytest.mark.parametrize(
    ("error", "status", "outcome", "retry_after"),
    [
        (
            ConnectFailed("upstream.invalid", 9, ConnectionRefusedError()),
            502,
            Outcome.UPSTREAM_UNREACHABLE,
            False,
        ),
        (HeadTimeout("no answer head within 60 s"), 504, Outcome.UPSTREAM_TIMEOUT, False),
        (PoolBusy("no free upstream connection"), 503, Outcome.REJECTED, True),
    ],
    ids=["unreachable", "no-head-in-time", "pool-busy"],
)
async def test_no_upstream_answer_is_an_error_in_the_clients_shape(
    error: Exception, status: int, outcome: Outcome, retry_after: bool
) -> None:
    run = Run([error])
    result = await run.relay()
    assert isinstance(result, SmallAnswer)
    answer = result
    assert answer.status == status
    shape = json.loads(answer.body)
    assert set(shape) == {"error"} and shape["error"]["message"] == str(error)
    assert ("Retry-After" in answer.headers) is retry_after
    # Nothing was written to the client by the relay: the small answer is the handler's.
    assert run.conn.wire == []
    assert run.ex.status == status and run.ex.outcome is outcome


async def test_a_cut_stream_ends_with_an_in_band_error_and_drops_the_connection() -> None:
    answer = FakeAnswer(200, SSE_TYPE, [_chunk("Hel"), AnswerCut("connection closed mid-body")])
    run = Run([answer])
    result = await run.relay()
    assert isinstance(result, StreamAnswer)
    _, body, _ = _split(run.conn.received)
    # The event that came, then an error event in the protocol's shape (no [DONE]).
    first, sep, tail = body.partition(b"\n\n")
    assert first + sep == _chunk("Hel")
    assert tail.startswith(b"data: ") and tail.endswith(b"\n\n")
    error = json.loads(tail[len(b"data: ") :])["error"]
    assert error["code"] == "upstream_stream_error"
    assert "connection closed mid-body" in error["message"]
    assert run.ex.outcome is Outcome.STREAM_ERROR
    assert answer.closed and not answer.released


async def test_a_client_gone_mid_stream_ends_the_relay_and_drops_the_upstream() -> None:
    # The client's connection is lost after the first write (the head and first event).
    answer = FakeAnswer(200, SSE_TYPE, [_chunk("Hel"), _chunk("lo"), _chunk("!"), FINAL])
    run = Run([answer], gone_after=1)
    with pytest.raises(ClientGone):
        await run.relay()
    assert len(run.conn.wire) == 1 and _chunk("lo") not in run.conn.received
    # The upstream learns nobody reads on: its connection is closed, not kept.
    assert answer.closed and not answer.released
    assert len(run.pool.sent) == 1


async def test_an_overflow_is_refolded_and_sent_again_the_client_sees_only_the_second() -> None:
    overflow = FakeAnswer(400, "application/json", [OVERFLOW])
    answer = FakeAnswer(200, SSE_TYPE, [_chunk("ok"), FINAL])
    run = Run([overflow, answer], plugins=[Shrinker()])
    result = await run.relay()
    assert isinstance(result, StreamAnswer) and result.status == 200
    _, body, ended = _split(run.conn.received)
    assert body == _chunk("ok") + FINAL and ended
    (_, _, first), (_, _, second) = run.pool.sent
    assert first == BODY and len(second) < len(BODY)
    assert run.ex.fold_level == 1 and run.ex.outcome is Outcome.OK
    assert overflow.released or overflow.closed


async def test_an_overflow_no_refold_shrinks_reaches_the_client_as_the_upstream_sent_it() -> None:
    overflow = FakeAnswer(400, "application/json", [OVERFLOW])
    run = Run([overflow])
    result = await run.relay()
    assert isinstance(result, StreamAnswer) and result.status == 400
    _, body, ended = _split(run.conn.received)
    assert body == OVERFLOW and ended
    assert len(run.pool.sent) == 1
    assert run.ex.outcome is Outcome.UPSTREAM_ERROR


_TEXT: Final = base64.b64encode(random.Random(7).randbytes(6000)).decode()
COMPLETION: Final = json.dumps(
    {
        "id": "c1",
        "object": "chat.completion",
        "model": "m",
        # Incompressible text: half of the coded body holds about half of it.
        "choices": [{"index": 0, "message": {"role": "assistant", "content": _TEXT}}],
    }
).encode()


async def test_a_gzip_answer_reaches_the_client_decoded_without_its_coding() -> None:
    coded = gzip.compress(COMPLETION)
    half = len(coded) // 2
    answer = FakeAnswer(
        200, "application/json", [coded[:half], coded[half:]], {"Content-Encoding": "gzip"}
    )
    run = Run([answer])
    result = await run.relay()
    assert isinstance(result, StreamAnswer) and result.status == 200
    # The relay leaves the end to the handler (proxy/_app.py), which writes it.
    await result.write_eof()
    head, body, ended = _split(run.conn.received)
    assert b"content-encoding" not in head.lower()
    assert body == COMPLETION and ended
    assert run.ex.outcome is Outcome.OK
    assert answer.released and not answer.closed


async def test_a_gzip_answer_cut_short_cuts_the_client_connection_instead_of_ending_it() -> None:
    coded = gzip.compress(COMPLETION)
    answer = FakeAnswer(
        200, "application/json", [coded[: len(coded) // 2]], {"Content-Encoding": "gzip"}
    )
    run = Run([answer])
    await run.relay()
    _, body, ended = _split(run.conn.received)
    # A JSON body cannot carry an error event: the client sees a truncated body
    # (its connection closed), never a complete-looking one.
    assert not ended and len(body) < len(COMPLETION)
    transport = run.conn.transport
    assert transport is not None and transport.closing
    assert run.ex.outcome is Outcome.STREAM_ERROR


@pytest.mark.parametrize(
    ("message", "code"),
    [(SHUTDOWN_CANCEL, "proxy_shutdown"), (None, None)],
    ids=["process-drain", "client-gone"],
)
async def test_a_cancel_mid_stream_ends_it_in_band_only_when_it_is_an_orderly_stop(
    message: str | None, code: str | None
) -> None:
    silent = asyncio.Event()  # never set: the upstream goes quiet after one event
    answer = FakeAnswer(200, SSE_TYPE, [_chunk("Hel"), silent])
    run = Run([answer])
    task = asyncio.create_task(run.relay())
    for _ in range(100):  # bounded: the first event is written within a few loop turns
        if _chunk("Hel") in run.conn.received:
            break
        await asyncio.sleep(0)
    task.cancel(message)
    if code is None:
        # A plain cancel is the server edge's for a client that hung up: it propagates.
        with pytest.raises(asyncio.CancelledError):
            await task
    else:
        result = await task
        assert isinstance(result, StreamAnswer)
        _, body, _ = _split(run.conn.received)
        first, _, tail = body.partition(b"\n\n")
        assert first + b"\n\n" == _chunk("Hel")
        error = json.loads(tail.removeprefix(b"data: "))["error"]
        assert error["code"] == code
        assert run.ex.outcome is Outcome.CANCELLED
    # Either way the upstream learns nobody reads on.
    assert answer.closed and not answer.released

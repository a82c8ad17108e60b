"""The server edge's listener: accepting client connections, admission by descriptors,
shutdown.

Each accepted socket becomes a :class:`proxy._front.ClientConnection` (the
driver of one connection); this module owns the set of them, the accept loop
(paused below the descriptor floor, :class:`proxy._fdlimit.FdBudget`) and a
bounded shutdown (idle connections close at once, busy ones after their answer).
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import logging
import socket
from collections.abc import Callable
from typing import Final

from ._answer import SmallAnswer
from ._fdlimit import EXHAUSTED_MESSAGE, FdBudget, Verdict
from ._front import Answer, ClientConnection, Handler, Request
from ._http1 import KEEPALIVE_TIMEOUT
from ._logs import LogLimiter
from ._protocols import Protocol, error_body

__all__ = ["FrontServer"]

log = logging.getLogger("context_proxy.server")

#: The descriptor floor's warning (and its summaries' subject), once per 10 s.
_FD_LOW: Final = (
    "file descriptors low: new connections answered 503 (probes answered), "
    "accepting paused below the floor (fd_reserve)"
)

_SHUTDOWN_TURNS: Final = 20
"""Loop turns shutdown waits for aborted connections to report their loss."""

_ACCEPT_BATCH: Final = 64
"""Connections accepted per readiness of the listening socket (the loop's other work runs
between batches)."""

_RESUME_CHECK_S: Final = 0.05
"""Seconds between checks of the descriptors while accepting is paused (a closed connection
checks at once; descriptors freed elsewhere, an idle upstream socket closing, are seen so)."""

_ACCEPT_ERRNOS: Final = frozenset({errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM})


async def _shed_answer(request: Request) -> Answer:
    """A request on a connection accepted from the descriptor reserve, with no
    ``shed_handler`` given: 503 (OpenAI shape) with ``Retry-After``."""
    return SmallAnswer(
        503,
        body=error_body(Protocol.OPENAI, 503, EXHAUSTED_MESSAGE),
        headers={"Content-Type": "application/json", "Retry-After": "5"},
        close=True,
    )


class FrontServer:
    """The listener and its client connections.

    Accepting is the server's own (not ``asyncio.Server``'s), so that it can
    stop and resume: with an :class:`~proxy._fdlimit.FdBudget`, each waiting
    connection is served, shed (accepted from the descriptor reserve: its
    request goes to ``shed_handler``, the connection closes after the answer
    and may take :data:`SHED_TIMEOUT` seconds for its head) or left in the
    kernel's queue while descriptors are too few (accepting resumes as a
    connection closes, or within :data:`_RESUME_CHECK_S` seconds of
    descriptors freeing elsewhere). ``EMFILE`` on ``accept`` pauses it too.

    Args:
        handler: answers each request (:data:`Handler`).
        header_timeout: seconds from a request head's first incomplete piece to
            its end; past it the connection closes without an answer.
        keepalive_timeout: seconds an idle keep-alive connection is kept.
        on_request_done: called (no arguments) after every answer is finished.
        draining: whether the proxy is draining (answers then close their connection).
        fd_budget: admission by free descriptors; None: every connection is served.
        shed_handler: answers a request on a shed connection (default: a 503,
            OpenAI shape, ``Retry-After: 5``); it must need no descriptor.

    Raises:
        ValueError: a timeout is not positive.
    """

    __slots__ = (
        "_adopting",
        "_emptied",
        "_listening",
        "_made_pending",
        "_paused",
        "_resume_timer",
        "_shed_log",
        "_sockets",
        "clock",
        "connections",
        "draining",
        "fd_budget",
        "handler",
        "header_timeout",
        "keepalive_timeout",
        "loop",
        "on_request_done",
        "served",
        "shed_handler",
    )

    def __init__(
        self,
        handler: Handler,
        *,
        header_timeout: float,
        keepalive_timeout: float = KEEPALIVE_TIMEOUT,
        on_request_done: Callable[[], object] | None = None,
        draining: Callable[[], bool] = lambda: False,
        fd_budget: FdBudget | None = None,
        shed_handler: Handler | None = None,
    ) -> None:
        if header_timeout <= 0 or keepalive_timeout <= 0:
            raise ValueError("header_timeout and keepalive_timeout must be > 0 seconds")
        self.handler = handler
        self.header_timeout = header_timeout
        self.keepalive_timeout = keepalive_timeout
        self.on_request_done = on_request_done
        self.draining = draining
        self.fd_budget = fd_budget
        self.shed_handler: Handler = shed_handler or _shed_answer
        self.loop = asyncio.get_running_loop()
        #: The loop's clock, one bound method every connection's machine shares.
        self.clock = self.loop.time
        self.connections: set[ClientConnection] = set()
        #: Client connections open and served (not shed), for the descriptor budget.
        self.served = 0
        self._made_pending = 0
        self._sockets: list[socket.socket] = []
        self._listening = False
        self._paused = False
        self._resume_timer: asyncio.Handle | None = None
        # Accepted sockets whose transport is being made (referenced until it is).
        self._adopting: set[asyncio.Task[None]] = set()
        self._shed_log = LogLimiter(log)
        # Set by shutdown: resolved when the last connection is lost.
        self._emptied: asyncio.Future[None] | None = None

    async def start(self, host: str, port: int) -> int:
        """Listen on ``host:port`` (0: an ephemeral port); the bound port.

        Every address ``host`` resolves to gets a socket (IPv6 ones IPv6 only),
        as ``loop.create_server`` binds them.

        Raises:
            OSError: the address cannot be bound.
        """
        infos = await self.loop.getaddrinfo(
            host, port, family=socket.AF_UNSPEC, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE
        )
        seen: set[tuple[int, object]] = set()
        try:
            for family, kind, proto, _, address in infos:
                if (family, address) in seen:
                    continue
                seen.add((family, address))
                sock = socket.socket(family, kind, proto)
                self._sockets.append(sock)
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
                if family == socket.AF_INET6 and hasattr(socket, "IPPROTO_IPV6"):
                    sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
                sock.bind(address)
                sock.listen(1024)
                sock.setblocking(False)
        except BaseException:
            self._close_sockets()
            raise
        if not self._sockets:
            raise OSError(f"no address to listen on for {host!r}")
        self._listening = True
        self._watch()
        return int(self._sockets[0].getsockname()[1])

    # -- accepting

    def _watch(self) -> None:
        for sock in self._sockets:
            self.loop.add_reader(sock.fileno(), self._accept, sock)

    def _unwatch(self) -> None:
        for sock in self._sockets:
            self.loop.remove_reader(sock.fileno())

    def _accept(self, sock: socket.socket) -> None:
        budget = self.fd_budget
        for _ in range(_ACCEPT_BATCH):  # bounded: the loop's other work runs between batches
            verdict = Verdict.SERVE if budget is None else budget.verdict(self._serving())
            if verdict is Verdict.PAUSE:
                self._shed_log.event(_FD_LOW, _FD_LOW)
                self._pause()
                return
            try:
                conn, _ = sock.accept()
            except (BlockingIOError, InterruptedError):
                return
            except ConnectionAbortedError:
                continue
            except OSError as exc:
                if exc.errno not in _ACCEPT_ERRNOS:
                    raise  # the loop logs it; the reader stays
                # Out of descriptors anyway (opened elsewhere): wait for some to free.
                self._shed_log.event(_FD_LOW, _FD_LOW)
                self._pause()
                return
            if budget is not None:
                budget.accepted()
            shed = verdict is Verdict.SHED
            if shed:
                self._shed_log.event(_FD_LOW, _FD_LOW)
            else:
                self._made_pending += 1
            conn.setblocking(False)
            task = self.loop.create_task(self._adopt(conn, shed))
            self._adopting.add(task)
            task.add_done_callback(self._adopting.discard)

    def _serving(self) -> int:
        """Served connections, those whose transport is still being made included."""
        return self.served + self._made_pending

    async def _adopt(self, conn: socket.socket, shed: bool) -> None:
        try:
            await self.loop.connect_accepted_socket(lambda: ClientConnection(self, shed=shed), conn)
        except (OSError, RuntimeError):
            # The client left before its transport was made (or the loop is closing).
            conn.close()
        finally:
            if not shed:
                self._made_pending -= 1
            self._resume_soon()

    def _pause(self) -> None:
        if self._paused or not self._listening:
            return
        self._paused = True
        self._unwatch()
        self._resume_timer = self.loop.call_later(_RESUME_CHECK_S, self._resume_check)

    def _resume_soon(self) -> None:
        if self._paused and self._listening:
            if self._resume_timer is not None:
                self._resume_timer.cancel()
            self._resume_timer = self.loop.call_soon(self._resume_check)

    def _resume_check(self) -> None:
        self._resume_timer = None
        if not self._paused or not self._listening:
            return
        budget = self.fd_budget
        if budget is not None and budget.verdict(self._serving()) is Verdict.PAUSE:
            self._resume_timer = self.loop.call_later(_RESUME_CHECK_S, self._resume_check)
            return
        self._paused = False
        self._watch()  # a connection waiting in the queue makes the socket readable at once

    def _close_sockets(self) -> None:
        if self._listening and not self._paused:
            self._unwatch()
        self._listening = False
        if self._resume_timer is not None:
            self._resume_timer.cancel()
            self._resume_timer = None
        for sock in self._sockets:
            sock.close()
        self._sockets = []
        self._shed_log.flush()

    def made(self, conn: ClientConnection) -> None:
        """``conn`` has its transport (connection side: its ``connection_made``)."""
        self.connections.add(conn)
        if not conn.shed:
            self.served += 1

    def lost(self, conn: ClientConnection) -> None:
        """``conn`` is closed (connection side: its ``connection_lost``)."""
        connections = self.connections
        if conn in connections and not conn.shed:
            self.served -= 1
        connections.discard(conn)
        self._resume_soon()
        emptied = self._emptied
        if not connections and emptied is not None and not emptied.done():
            emptied.set_result(None)

    async def shutdown(self, grace: float) -> None:
        """Stop listening, close idle connections, give busy ones ``grace`` seconds
        to finish their answer (its last bytes taken by the client), then drop every
        connection left."""
        self._close_sockets()
        loop = self.loop
        deadline = loop.time() + grace
        busy = [c.task for c in list(self.connections) if not c.close_idle()]
        running = [t for t in busy if t is not None]
        if running:
            await asyncio.wait(running, timeout=grace)
        if self.connections:
            # A closed transport still holds what a slow client has not taken yet (the
            # end of an answer that finished in time): it is lost once that is out. The
            # grace covers it; whatever is left at its end goes.
            emptied = self._emptied = loop.create_future()
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout_at(deadline):
                    await emptied
            self._emptied = None
        for conn in list(self.connections):
            conn.abort()
        for _ in range(_SHUTDOWN_TURNS):  # bounded: each lost connection reports in a turn or two
            if not self.connections:
                break
            await asyncio.sleep(0)

"""Reaching an upstream: where its URL points, the route to it, and the connect.

:class:`UpstreamTarget` is one upstream base URL parsed once, with its route
(direct, or through a forward proxy from :mod:`proxy._egress`).
:class:`Connector` opens a connection on that route within ``connect_timeout``
and hands it to the caller's protocol object: a host name's addresses are
resolved (kept :data:`DNS_TTL_S` seconds) and raced (RFC 8305), an https
upstream behind a proxy is reached in a ``CONNECT`` tunnel (RFC 9110 section
9.3.6), and TLS is set up with the upstream itself (SNI is its name).

Errors are :mod:`proxy._upstream_errors`' (our own words, never the peer's bytes).
"""

from __future__ import annotations

import asyncio
import http
import ipaddress
import socket
import ssl
import typing
import urllib.parse
from collections.abc import Mapping
from typing import Any, Final

import cachetools
from multidict import CIMultiDict, CIMultiDictProxy

from ._egress import ForwardProxy
from ._http1 import Request
from ._upstream_errors import ConnectFailed, ConnectTimeout, TunnelFailed

__all__ = [
    "ACCEPT_ENCODING",
    "DNS_TTL_S",
    "HAPPY_EYEBALLS_DELAY_S",
    "MAX_TUNNEL_HEAD_BYTES",
    "USER_AGENT",
    "Connector",
    "RouteKey",
    "UpstreamTarget",
    "status_words",
]

#: Seconds before the next address of a host name is tried beside a slow one (RFC 8305).
HAPPY_EYEBALLS_DELAY_S: Final = 0.25
#: Seconds a host name's addresses are kept (aiohttp's default DNS cache time).
DNS_TTL_S: Final = 10.0
#: What the proxy accepts from upstreams (it decodes answers itself, piece by piece).
ACCEPT_ENCODING: Final = "gzip, deflate, br"
#: The ``User-Agent`` sent when the client sent none (and in ``CONNECT``).
USER_AGENT: Final = "context-proxy"
#: Most bytes of a proxy's answer to ``CONNECT`` read before it is refused.
MAX_TUNNEL_HEAD_BYTES: Final = 16 * 1024


class UpstreamTarget:
    """Where one upstream base URL points: scheme, host, port, path prefix (parsed once),
    and the route to it: direct, or ``via`` a forward proxy (:mod:`proxy._egress`).

    Through a proxy an https upstream is reached in a ``CONNECT`` tunnel (the TLS
    handshake, SNI included, is with the upstream inside it); an http one gets the
    absolute-form request target and the proxy's ``Proxy-Authorization`` field
    (RFC 9112 section 3.2.2). Pooled connections are kept per target and route
    (:attr:`key`).

    Raises:
        ValueError: ``base`` is not an ``http://`` or ``https://`` URL with a host.
    """

    __slots__ = (
        "authority",
        "host",
        "host_field",
        "key",
        "literal",
        "origin",
        "port",
        "prefix",
        "proxy_fields",
        "tls",
        "via",
    )

    def __init__(self, base: str, via: ForwardProxy | None = None) -> None:
        parts = urllib.parse.urlsplit(base)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ValueError(f"upstream base URL must be http(s)://host[:port][/path]: {base!r}")
        self.tls = parts.scheme == "https"
        self.host = parts.hostname
        default = 443 if self.tls else 80
        self.port = parts.port or default
        shown = f"[{self.host}]" if ":" in self.host else self.host
        self.host_field = shown if self.port == default else f"{shown}:{self.port}"
        self.prefix = parts.path.rstrip("/")
        #: ``host:port`` with the port always there (a ``CONNECT`` target).
        self.authority = f"{shown}:{self.port}"
        self.via = via
        self.key = (self.tls, self.host, self.port, via.key if via is not None else "")
        #: Whether ``host`` is an IP address (nothing to resolve).
        self.literal = _is_ip(self.host)
        plain_via = via is not None and not self.tls
        # An http upstream through a proxy: the request line names the whole URL.
        self.origin = f"http://{self.host_field}" if plain_via else ""
        #: Header fields every request head carries for the route (name, value pairs).
        self.proxy_fields: tuple[tuple[str, str], ...] = (
            (("Proxy-Authorization", via.authorization),)
            if plain_via and via is not None and via.authorization is not None
            else ()
        )

    def request_target(self, path: str, query: str) -> str:
        """The request target for ``path`` and the raw ``query`` (kept as sent): the
        origin form, or the absolute form for an http upstream through a proxy."""
        target = f"{self.origin}{self.prefix}{path}"
        return f"{target}?{query}" if query else target

    def request_head(self, method: str, path: str, fields: Mapping[str, str]) -> Request:
        """The request head for this upstream: ``Host``, the route's fields, ``fields`` as
        given, ``Accept`` and ``User-Agent`` when absent, and ``Accept-Encoding`` (what
        the proxy decodes); ``path`` is the request target (:meth:`request_target`).

        Raises:
            ValueError: a field name or value holds CR or LF (it would split the head).
        """
        lines = [("Host", self.host_field), *self.proxy_fields, *fields.items()]
        if not _has_field(fields, "accept"):
            lines.append(("Accept", "*/*"))
        if not _has_field(fields, "user-agent"):
            lines.append(("User-Agent", USER_AGENT))
        lines.append(("Accept-Encoding", ACCEPT_ENCODING))
        return Request(method, path, lines)


#: One address to connect to: family, socket type, protocol, socket address.
_Address = tuple[int, int, int, Any]
#: What pooled connections are kept by: TLS, upstream host and port, and the proxy's
#: ``host:port`` (``""``: direct), so a tunnel is reused for its own target only.
RouteKey = tuple[bool, str, int, str]


class Connector:
    """Opens connections to upstreams on their routes, each within ``connect_timeout``
    seconds (through a forward proxy: the connect to it, the ``CONNECT`` and the
    handshake). ``tls_context`` verifies https upstreams (default: the system's
    trust store, made on first use). Host names' addresses are kept in a small
    cache (64 names, :data:`DNS_TTL_S` seconds).
    """

    __slots__ = ("_dns", "connect_timeout", "tls_context")

    def __init__(self, connect_timeout: float, tls_context: ssl.SSLContext | None = None) -> None:
        self.connect_timeout = connect_timeout
        # Made on the first https connect unless given (the system trust store costs
        # a few hundred KiB and a file read).
        self.tls_context = tls_context
        self._dns: cachetools.TTLCache[tuple[str, int], list[_Address]] = cachetools.TTLCache(
            maxsize=64, ttl=DNS_TTL_S
        )

    async def connect(self, protocol: asyncio.Protocol, target: UpstreamTarget) -> None:
        """Connect ``protocol`` (its ``connection_made`` is called) to ``target`` on its
        route, within ``connect_timeout``.

        Raises:
            ConnectFailed: the connect (to the upstream or to its proxy) or the TLS
                handshake failed.
            ConnectTimeout: it all took over ``connect_timeout``.
            TunnelFailed: the proxy did not open the ``CONNECT`` tunnel.
        """
        loop = asyncio.get_running_loop()
        context = None
        if target.tls:
            if self.tls_context is None:
                self.tls_context = ssl.create_default_context()
            context = self.tls_context
        via = target.via
        # The TLS handshake (through a tunnel too) is with the upstream: SNI is its name.
        hostname = target.host if context is not None else None
        try:
            async with asyncio.timeout(self.connect_timeout):
                if via is None:
                    # A host name's addresses are raced here (asyncio's own race, its
                    # happy_eyeballs_delay, costs ~8 KiB of RSS per connection under a
                    # burst of connects, and uvloop has none); an IP address is direct.
                    if target.literal:
                        await loop.create_connection(
                            lambda: protocol,  # the caller's protocol object, made before
                            target.host,
                            target.port,
                            ssl=context,
                            server_hostname=hostname,
                        )
                        return
                    sock = await self._race(loop, target.host, target.port)
                else:
                    sock = await self._via(loop, target, via)
                await loop.create_connection(
                    lambda: protocol, sock=sock, ssl=context, server_hostname=hostname
                )
        except TimeoutError:
            where = f"{target.host}:{target.port}"
            if via is not None:
                where += f" through the egress proxy {via.shown}"
            raise ConnectTimeout(f"could not connect to the upstream at {where} in time") from None
        except OSError as exc:
            raise ConnectFailed(target.host, target.port, exc) from exc

    async def _via(
        self, loop: asyncio.AbstractEventLoop, target: UpstreamTarget, via: ForwardProxy
    ) -> socket.socket:
        """A socket connected to ``via`` and, for an https ``target``, tunnelled to it.

        The proxy's addresses are raced as a direct upstream's are (an IP address is
        connected to directly).

        Raises:
            ConnectFailed: the proxy could not be reached (``proxy`` set).
            TunnelFailed: the proxy refused the tunnel or broke off.
        """
        try:
            if via.literal:
                family = socket.AF_INET6 if ":" in via.host else socket.AF_INET
                sock = await _connect_to(
                    loop, (family, socket.SOCK_STREAM, 0, (via.host, via.port))
                )
            else:
                sock = await self._race(loop, via.host, via.port)
        except OSError as exc:
            raise ConnectFailed(via.host, via.port, exc, proxy=via) from exc
        if not target.tls:
            return sock  # absolute-form requests go to the proxy as they are
        try:
            await _open_tunnel(loop, sock, target, via)
        except BaseException:
            sock.close()
            raise
        return sock

    async def _addresses(
        self, loop: asyncio.AbstractEventLoop, host: str, port: int
    ) -> list[_Address]:
        """``host``'s addresses, families interleaved (RFC 8305 section 4), kept
        :data:`DNS_TTL_S` seconds (a resolution is a round trip through a thread).

        Raises:
            OSError: the name did not resolve (``socket.gaierror``).
        """
        key = (host, port)
        found = self._dns.get(key)
        if found is None:
            infos = await loop.getaddrinfo(host, port, type=socket.SOCK_STREAM)
            found = _interleave([(f, t, p, addr) for f, t, p, _name, addr in infos])
            if not found:
                raise socket.gaierror(socket.EAI_NONAME, "no address")
            self._dns[key] = found
        return found

    async def _race(self, loop: asyncio.AbstractEventLoop, host: str, port: int) -> socket.socket:
        """A connected socket to one of ``host``'s addresses (RFC 8305 section 5).

        The first address is tried alone; each :data:`HAPPY_EYEBALLS_DELAY_S` without a
        connection (or at once when an attempt fails) the next one starts beside it;
        the first to connect wins and the others are cancelled and closed. A name with
        one address costs no task.

        Raises:
            OSError: every address failed (the first address's error).
        """
        addresses = await self._addresses(loop, host, port)
        if len(addresses) == 1:
            return await _connect_to(loop, addresses[0])
        waiting = list(addresses)
        attempts: set[asyncio.Task[socket.socket]] = set()
        errors: list[OSError] = []
        try:
            for _ in range(2 * len(addresses)):  # bounded: each turn starts or ends one
                if waiting:
                    task = loop.create_task(_connect_to(loop, waiting.pop(0)))
                    task.add_done_callback(_retrieve)
                    attempts.add(task)
                if not attempts:
                    break
                done, _ = await asyncio.wait(
                    attempts,
                    timeout=HAPPY_EYEBALLS_DELAY_S if waiting else None,
                    return_when=asyncio.FIRST_COMPLETED,
                )
                for task in done:
                    attempts.discard(task)
                    failure = task.exception()
                    if failure is None:
                        return task.result()
                    errors.append(typing.cast(OSError, failure))
            # Every attempt ended (the loop's bound allows each to start and to end).
            raise errors[0] if errors else OSError("no address of the upstream connected")
        finally:
            for task in attempts:
                if task.done() and not task.cancelled() and task.exception() is None:
                    task.result().close()  # connected too, but second
                else:
                    task.cancel()


def _interleave(addresses: list[_Address]) -> list[_Address]:
    """Alternate the address families, the first family first (RFC 8305 section 4)."""
    by_family: dict[int, list[_Address]] = {}
    for address in addresses:
        by_family.setdefault(address[0], []).append(address)
    queues = list(by_family.values())
    out: list[_Address] = []
    for index in range(max(len(q) for q in queues) if queues else 0):
        out.extend(q[index] for q in queues if index < len(q))
    return out


async def _connect_to(loop: asyncio.AbstractEventLoop, address: _Address) -> socket.socket:
    """A non-blocking socket connected to ``address`` (closed if that fails or is cancelled).

    Raises:
        OSError: the connect failed.
    """
    family, type_, proto, sockaddr = address
    sock = socket.socket(family, type_, proto)
    try:
        sock.setblocking(False)
        await loop.sock_connect(sock, sockaddr)
    except BaseException:
        sock.close()
        raise
    return sock


async def _open_tunnel(
    loop: asyncio.AbstractEventLoop, sock: socket.socket, target: UpstreamTarget, via: ForwardProxy
) -> None:
    """Ask the proxy on ``sock`` for a tunnel to ``target`` (RFC 9110 section 9.3.6).

    Writes ``CONNECT host:port`` (with ``Proxy-Authorization`` when the proxy URL
    has credentials) and reads the answer's head, at most
    :data:`MAX_TUNNEL_HEAD_BYTES`, in as many reads as the proxy takes within the
    connect timeout. Any 2xx opens the tunnel; the proxy's body after another
    status is not read (the socket is closed).

    Raises:
        TunnelFailed: a status other than 2xx (``status`` set), no HTTP answer, a
            close or a reset before the head's end, or bytes after a 2xx head
            (nothing may come before the client's TLS hello).
    """
    authority = target.authority
    lines = [f"CONNECT {authority} HTTP/1.1", f"Host: {authority}", f"User-Agent: {USER_AGENT}"]
    if via.authorization is not None:
        lines.append(f"Proxy-Authorization: {via.authorization}")
    request = ("\r\n".join(lines) + "\r\n\r\n").encode("utf-8", "surrogateescape")
    head = bytearray()
    try:
        await loop.sock_sendall(sock, request)
        # Each read adds at least one byte: the size bound bounds the reads too, and
        # the connect timeout the time (a proxy may write its head line by line).
        for _ in range(MAX_TUNNEL_HEAD_BYTES + 1):
            data = await loop.sock_recv(sock, MAX_TUNNEL_HEAD_BYTES + 1 - len(head))
            if not data:
                break
            head += data
            if b"\r\n\r\n" in head or len(head) > MAX_TUNNEL_HEAD_BYTES:
                break
    except OSError:
        raise TunnelFailed(
            via, authority, None, f"dropped the connection during CONNECT to {authority}"
        ) from None
    status = _tunnel_status(bytes(head[: head.find(b"\r\n")]) if b"\r\n" in head else b"")
    end = head.find(b"\r\n\r\n")
    if status is None or (end < 0 and 200 <= status < 300):
        if not head:
            words = "closed the connection before answering"
        elif status is not None and len(head) > MAX_TUNNEL_HEAD_BYTES:
            words = f"sent an answer head over {MAX_TUNNEL_HEAD_BYTES} bytes to"
        elif status is not None:
            words = "closed the connection in the middle of its answer to"
        else:
            words = "sent no HTTP answer to"
        raise TunnelFailed(via, authority, None, f"{words} CONNECT {authority}")
    if not 200 <= status < 300:
        raise TunnelFailed(
            via, authority, status, f"refused CONNECT to {authority}: {status_words(status)}"
        )
    if end + 4 != len(head):
        raise TunnelFailed(via, authority, status, f"sent bytes after CONNECT to {authority}")


def _tunnel_status(line: bytes) -> int | None:
    """The status of a status line (``HTTP/1.1 200 Connection established``); ``None``
    if it is not one."""
    version, _, rest = line.partition(b" ")
    code = rest[:3]
    if not version.startswith(b"HTTP/1.") or len(code) != 3 or not code.isdigit():
        return None
    return int(code)


def status_words(status: int) -> str:
    """``407 Proxy Authentication Required``, with what it means for the operator."""
    try:
        phrase = http.HTTPStatus(status).phrase
    except ValueError:
        phrase = "unknown status"
    hint = _TUNNEL_HINTS.get(status, "")
    return f"{status} {phrase}{hint}"


_CREDENTIALS_HINT: Final = (
    " (proxy credentials missing or wrong: the user:password in the proxy URL)"
)
_TUNNEL_HINTS: Final = {
    # 407 is the standard answer; tinyproxy sends 401 to credentials it refuses.
    401: _CREDENTIALS_HINT,
    407: _CREDENTIALS_HINT,
    403: " (the proxy does not allow this host or port)",
}


def _retrieve(task: asyncio.Task[socket.socket]) -> None:
    """Mark an attempt's failure as seen (a loser's error is no news)."""
    if not task.cancelled():
        task.exception()


def _is_ip(host: str) -> bool:
    try:
        ipaddress.ip_address(host)
    except ValueError:
        return False
    return True


def _has_field(fields: Mapping[str, str], lowered: str) -> bool:
    """Whether ``fields`` has a field named ``lowered`` (lower case), in any case."""
    if isinstance(fields, (CIMultiDict, CIMultiDictProxy)):
        return lowered in fields  # the relay's own: a lookup, case-insensitive
    return any(name.lower() == lowered for name in fields)

"""The upstream client's errors: :class:`UpstreamError` and its family, in our own words.

``str()`` of each is what the proxy says about the failure (and logs); never the
upstream's or the forward proxy's bytes, since a header value may hold a secret.
Raised by :mod:`proxy._connect` (reaching the upstream) and :mod:`proxy._upstream`
(the exchange on the connection); the relay maps them to answers.
"""

from __future__ import annotations

import socket
import ssl

from ._egress import ForwardProxy

__all__ = [
    "AnswerCut",
    "BadResponseHead",
    "ConnectFailed",
    "ConnectTimeout",
    "HeadTimeout",
    "IdleReadTimeout",
    "PoolBusy",
    "PoolClosed",
    "ServerDisconnected",
    "TunnelFailed",
    "UpstreamError",
]


class UpstreamError(Exception):
    """No usable answer (or no complete body) from the upstream; ``str()`` is our words."""


class ConnectFailed(UpstreamError):
    """The TCP or TLS connect failed: ``host``, ``port`` and the ``OSError`` behind it.

    ``proxy`` is the forward proxy when the failure was the connect to it (then
    ``host`` and ``port`` are the proxy's); a TLS failure through a tunnel is the
    upstream's, as without a proxy.
    """

    def __init__(
        self, host: str, port: int, os_error: OSError, proxy: ForwardProxy | None = None
    ) -> None:
        where = f"{host}:{port}"
        if proxy is not None:
            # The proxy's URL without its credentials, and the variable that named it.
            peer = f"egress proxy {proxy.shown} (from {proxy.source})"
        else:
            peer = "upstream"
        if isinstance(os_error, ConnectionRefusedError):
            words = f"{peer} refused the connection at {where}"
        elif isinstance(os_error, ssl.SSLCertVerificationError):
            # OpenSSL's reason ("self-signed certificate", "hostname mismatch"): no secret.
            reason = os_error.verify_message or "not trusted"
            words = f"{peer}'s TLS certificate could not be verified at {where}: {reason}"
        elif isinstance(os_error, ssl.SSLError):
            words = f"TLS handshake with the {peer} at {where} failed"
        elif isinstance(os_error, socket.gaierror):
            words = f"{peer} host name did not resolve ({where})"
        else:
            words = f"could not connect to the {peer} at {where}"
        super().__init__(words)
        self.host = host
        self.port = port
        self.os_error = os_error
        self.proxy = proxy
        self.__cause__ = os_error


class TunnelFailed(UpstreamError):
    """The forward proxy did not open a ``CONNECT`` tunnel to the upstream.

    ``status`` is the proxy's answer (407: credentials missing or wrong, 403: the
    target is not allowed, 502: the proxy could not reach the upstream), or
    ``None`` when it closed or sent no HTTP answer. ``str()`` is our words: the
    status and its standard reason phrase, never the proxy's own bytes.
    """

    def __init__(self, proxy: ForwardProxy, authority: str, status: int | None, words: str) -> None:
        super().__init__(f"egress proxy {proxy.shown} (from {proxy.source}) {words}")
        self.proxy = proxy
        self.authority = authority
        self.status = status


class ConnectTimeout(UpstreamError, TimeoutError):
    """The connect did not complete within ``connect_timeout`` seconds."""


class ServerDisconnected(UpstreamError):
    """The upstream closed the connection before a complete response head."""


class BadResponseHead(UpstreamError):
    """The response head could not be parsed, or is over a limit (our words say which)."""


class AnswerCut(UpstreamError):
    """The answer's body did not end as its framing says (closed early, bad chunking)."""


class PoolClosed(UpstreamError):
    """The pool was closed (the proxy shuts down): no request goes out any more."""


class PoolBusy(UpstreamError):
    """Every connection the pool may open (``max_connections``) stayed in use: the
    proxy's own limit, not the upstream's fault."""


class HeadTimeout(UpstreamError, TimeoutError):
    """The answer's head did not come in time."""


class IdleReadTimeout(UpstreamError, TimeoutError):
    """No body bytes for ``idle_read`` seconds mid-answer."""

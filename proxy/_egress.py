"""Egress: which forward proxy, if any, an upstream is reached through (pure).

Companies route outbound traffic through an HTTP forward proxy named by the
``HTTPS_PROXY`` / ``HTTP_PROXY`` environment variables, with ``NO_PROXY``
listing what goes direct. This module decides the route of each upstream once,
at start-up; the connections themselves are :mod:`proxy._upstream`'s (an HTTP
``CONNECT`` tunnel for an https upstream, RFC 9110 section 9.3.6; the
absolute-form request target for an http one, RFC 9112 section 3.2.2).

Precedence, highest first:

1. the ``upstream_proxy`` setting (``CONTEXT_PROXY_UPSTREAM_PROXY``), one proxy
   for every upstream, whatever its scheme;
2. ``https_proxy`` then ``HTTPS_PROXY`` for an https upstream, ``http_proxy``
   then ``HTTP_PROXY`` for an http one (the lowercase form wins, as in curl and
   Python's ``urllib``; an empty value is unset);
3. direct.

``no_proxy`` (else ``NO_PROXY``) exempts upstreams from 1 and 2, as curl applies
it to a ``--proxy`` too. ``ALL_PROXY`` is not read (it usually names a SOCKS
proxy, which the client does not speak).

A proxy URL's credentials (``http://user:pass@host:port``) become a
``Proxy-Authorization: Basic`` field (RFC 7617); nothing here keeps or shows
them in any other form: :attr:`ForwardProxy.shown` is the URL without them.
"""

from __future__ import annotations

import base64
import ipaddress
import urllib.parse
from collections.abc import Mapping
from typing import Final

__all__ = ["EgressError", "ForwardProxy", "NoProxy", "choose_proxy"]

#: The port of a proxy URL that names none (curl's default, and Squid's).
DEFAULT_PROXY_PORT: Final = 1080


class EgressError(ValueError):
    """A proxy URL that cannot be used; ``str()`` names where it came from, never its
    credentials."""


class ForwardProxy:
    """An HTTP forward proxy, parsed from its URL (``http://[user:pass@]host[:port]``).

    A URL without a scheme (``proxy.corp:3128``) is taken as ``http://``, as curl
    takes it. ``authorization`` is the ``Proxy-Authorization`` value for the URL's
    credentials (``None`` without any); user name and password are percent-decoded
    and joined as UTF-8 (RFC 7617 section 2.1).

    Raises:
        EgressError: the scheme is not ``http`` (an ``https://`` or ``socks5://``
            proxy is not supported), the URL has no host or a bad port, or an
            ``@`` after its host (credentials with an unencoded ``/``, ``?`` or ``#``).
            ``source`` (the setting's or variable's name) starts the message.
    """

    __slots__ = ("authorization", "host", "key", "literal", "port", "shown", "source")

    def __init__(self, url: str, source: str) -> None:
        text = url.strip()
        if "://" not in text:
            text = "http://" + text
        parts = urllib.parse.urlsplit(text)
        if "@" in text[len(parts.scheme) + 3 + len(parts.netloc) :]:
            # A "/", "?" or "#" in unencoded credentials ends the authority early: the
            # user name and part of the password would be taken for host and port, and
            # shown as such in every log line and error body.
            raise EgressError(
                f"{source}: the proxy URL has an '@' after its host: percent-encode "
                "'/', '?', '#' and '@' in the user name and password"
            )
        if parts.scheme.lower() != "http":
            raise EgressError(
                f"{source}: only http:// forward proxies are supported, not {parts.scheme}://"
            )
        try:
            port = parts.port
        except ValueError:
            raise EgressError(f"{source}: the proxy URL's port is not a number 0-65535") from None
        if not parts.hostname:
            raise EgressError(f"{source}: the proxy URL has no host")
        self.source = source
        self.host = parts.hostname
        self.port = port or DEFAULT_PROXY_PORT
        shown = f"[{self.host}]" if ":" in self.host else self.host
        #: The proxy's URL without credentials: what logs and errors show.
        self.shown = f"http://{shown}:{self.port}"
        self.key = f"{shown}:{self.port}"
        self.literal = _is_ip(self.host)
        self.authorization: str | None = None
        if parts.username is not None or parts.password is not None:
            user = urllib.parse.unquote(parts.username or "")
            password = urllib.parse.unquote(parts.password or "")
            token = base64.b64encode(f"{user}:{password}".encode()).decode("ascii")
            self.authorization = f"Basic {token}"

    def __repr__(self) -> str:
        # Never the credentials.
        return f"ForwardProxy({self.shown!r}, from {self.source})"


class NoProxy:
    """A ``NO_PROXY`` list: which upstream hosts are reached directly.

    Comma-separated entries, matched against the upstream's host as configured
    (no name is resolved), case-insensitively, the way curl and requests read them:

    * ``*`` alone: every host;
    * a name (``example.com``, ``.example.com`` or ``*.example.com``): that host
      and every name under it (``api.example.com``), not ``notexample.com``;
    * an IP address (``10.1.2.3``, ``::1`` or ``[::1]``): that address;
    * a network in CIDR notation (``10.0.0.0/8``, ``fd00::/8``): every address in it;
    * any of these with ``:port``: only on that port (``localhost:8443``).

    Blank entries are skipped; an entry that is none of these never matches.
    """

    __slots__ = ("_everything", "_names", "_networks")

    def __init__(self, value: str) -> None:
        self._everything = False
        # (name, port or None): a suffix match on name boundaries.
        self._names: list[tuple[str, int | None]] = []
        self._networks: list[tuple[ipaddress.IPv4Network | ipaddress.IPv6Network, int | None]] = []
        for raw in value.split(","):
            entry = raw.strip().lower()
            if not entry:
                continue
            if entry == "*":
                self._everything = True
                continue
            host, port = _split_port(entry)
            try:
                network = ipaddress.ip_network(host.strip("[]"), strict=False)
            except ValueError:
                name = host.removeprefix("*").lstrip(".")
                if name:
                    self._names.append((name, port))
            else:
                self._networks.append((network, port))

    def bypasses(self, host: str, port: int) -> bool:
        """Whether ``host`` (a name or an IP address, without brackets) on ``port`` goes direct."""
        if self._everything:
            return True
        host = host.lower().rstrip(".")
        try:
            address = ipaddress.ip_address(host.strip("[]"))
        except ValueError:
            for name, only in self._names:
                if only is not None and only != port:
                    continue
                if host == name or host.endswith("." + name):
                    return True
            return False
        return any(
            address in network and (only is None or only == port)
            for network, only in self._networks
        )


def _split_port(entry: str) -> tuple[str, int | None]:
    """``host:port`` into its parts; a bare IPv6 address (many colons) has no port."""
    if entry.startswith("["):
        close = entry.find("]")
        rest = entry[close + 1 :] if close >= 0 else ""
        host = entry[: close + 1] if close >= 0 else entry
        if rest.startswith(":") and rest[1:].isdigit():
            return host, int(rest[1:])
        return host, None
    if entry.count(":") == 1:
        host, _, port = entry.partition(":")
        if port.isdigit():
            return host, int(port)
    return entry, None


def _env(environ: Mapping[str, str], name: str) -> tuple[str, str] | None:
    """The value of ``name`` (lowercase first, then uppercase) and the variable it came
    from; ``None`` when both are unset or empty."""
    for key in (name, name.upper()):
        value = environ.get(key)
        if value is not None and value.strip():
            return value, key
    return None


def choose_proxy(
    tls: bool,
    host: str,
    port: int,
    *,
    setting: str | None,
    environ: Mapping[str, str],
) -> ForwardProxy | None:
    """The forward proxy for the upstream at ``host``:``port`` (``tls``: https), or
    ``None`` for a direct connection; the precedence is the module's.

    ``setting`` is the ``upstream_proxy`` setting (``None``: unset); ``environ``
    is the process environment (tests pass their own).

    Raises:
        EgressError: the chosen URL cannot be used (the message names the setting
            or variable it came from, never the credentials).
    """
    no_proxy = _env(environ, "no_proxy")
    if no_proxy is not None and NoProxy(no_proxy[0]).bypasses(host, port):
        return None
    if setting is not None and setting.strip():
        return ForwardProxy(setting, "upstream_proxy")
    found = _env(environ, "https_proxy" if tls else "http_proxy")
    if found is None:
        return None
    return ForwardProxy(*found)


def _is_ip(host: str) -> bool:
    try:
        ipaddress.ip_address(host)
    except ValueError:
        return False
    return True

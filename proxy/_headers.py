"""Which header fields cross the proxy, in either direction (pure).

A proxy forwards end-to-end fields and drops hop-by-hop ones (RFC 9110
section 7.6.1: the fixed list plus whatever ``Connection`` names). It also
drops the framing fields it recomputes: bodies are decoded and re-framed on
each side, so ``Content-Length`` and ``Content-Encoding`` describe bytes the
other side never sees.
"""

from __future__ import annotations

from typing import Final

from multidict import CIMultiDict, CIMultiDictProxy

__all__ = ["HOP_BY_HOP", "forward_headers", "response_headers"]

#: RFC 9110 section 7.6.1 plus the de-facto ones; never forwarded in either direction.
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
    # Answered by the proxy itself (proxy/_app.py) before it read the body.
    "expect",
    "host",
    "content-length",
    "content-encoding",
    "accept-encoding",
}
_RESPONSE_DROP: Final = HOP_BY_HOP | {"content-length", "content-encoding", "server", "date"}


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
    # Usually there is no Connection field (HTTP/1.1 keep-alive needs none): one lookup,
    # no set built.
    dropped = drop | _connection_listed(headers) if "Connection" in headers else drop
    # A copy (multidict copies its table whole, in C), then the dropped names out of it:
    # a name's lowercase is what multidict matches it by, so a name is removed exactly
    # when its lowercase is dropped, and the rest keep their order. Python code runs
    # once a dropped name present (a few), not once a field.
    out = CIMultiDict(headers)
    for name in dropped.intersection(map(str.lower, headers)):
        out.popall(name)
    return out


def forward_headers(headers: CIMultiDictProxy[str]) -> CIMultiDict[str]:
    """End-to-end request headers for the upstream (hop-by-hop and framing dropped)."""
    return _end_to_end(headers, _REQUEST_DROP)


def response_headers(headers: CIMultiDictProxy[str]) -> CIMultiDict[str]:
    """End-to-end upstream response headers for the client (hop-by-hop and framing dropped)."""
    return _end_to_end(headers, _RESPONSE_DROP)

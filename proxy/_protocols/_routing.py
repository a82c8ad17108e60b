"""Request routing: which protocol and upstream a request path belongs to (pure)."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Final

from ._common import Protocol, Upstream

__all__ = ["Route", "route"]

# Every Anthropic SDK sends anthropic-version; x-api-key is Anthropic's auth
# header (OpenAI clients send Authorization: Bearer).
_ANTHROPIC_HEADERS: Final = ("anthropic-version", "x-api-key")
_EXACT: Final = {
    "/v1/chat/completions": Protocol.CHAT,
    "/v1/responses": Protocol.RESPONSES,
    "/v1/messages": Protocol.MESSAGES,
    "/v1/messages/count_tokens": Protocol.COUNT_TOKENS,
}


@dataclasses.dataclass(frozen=True, slots=True)
class Route:
    """Where a request goes: its protocol and the upstream that serves it."""

    protocol: Protocol
    upstream: Upstream


_ROUTES: Final = {p: Route(p, p.upstream) for p in Protocol}


def _has_header(headers: Mapping[str, str], name: str) -> bool:
    """Header ``name`` (lower case) present with a non-empty value, any key case."""
    value = headers.get(name)
    if value is None:
        # A plain dict is case-sensitive; the front's CIMultiDictProxy (multidict) is not.
        value = next((v for k, v in headers.items() if k.lower() == name), None)
    return bool(value)


def route(method: str, path: str, headers: Mapping[str, str]) -> Route | None:
    """Decide the protocol and upstream of a request.

    Rules, in order (the query string is ignored):

    * ``POST /v1/chat/completions`` → CHAT, ``POST /v1/responses`` → RESPONSES,
      ``POST /v1/messages`` → MESSAGES, ``POST /v1/messages/count_tokens`` →
      COUNT_TOKENS, all exactly (no trailing slash). These are the exchange
      protocols and are POST only: another method on those paths (e.g.
      OpenAI's ``GET /v1/chat/completions`` listing stored completions) is a
      passthrough to the same upstream.
    * ``/v1/responses/...`` → OPENAI; ``/v1/messages/...`` → ANTHROPIC.
    * any other ``/v1/...`` → ANTHROPIC if the request carries an
      ``anthropic-version`` or ``x-api-key`` header (both APIs have e.g.
      ``GET /v1/models`` and ``/v1/files``), else OPENAI.

    Args:
        method: HTTP method, any case.
        path: request path, optionally with a query string.
        headers: request headers (a case-insensitive mapping or a plain dict).

    Returns:
        The :class:`Route`, or ``None`` when the path is not under ``/v1/`` or
        contains ``.`` / ``..`` segments, plain or percent-encoded (never
        forwarded upstream).
    """
    path = path.partition("?")[0]
    # First: an exact path holds no dot segment, and nearly every request has one.
    exact = _EXACT.get(path)
    if exact is not None:
        if method.upper() == "POST":
            return _ROUTES[exact]
        return _ROUTES[Protocol.OPENAI if exact.upstream == "openai" else Protocol.ANTHROPIC]
    if not path.startswith("/v1/"):
        return None
    if any(seg in (".", "..") for seg in path.lower().replace("%2e", ".").split("/")):
        return None
    if path.startswith("/v1/responses/"):
        return _ROUTES[Protocol.OPENAI]
    if path.startswith("/v1/messages/"):
        return _ROUTES[Protocol.ANTHROPIC]
    if any(_has_header(headers, name) for name in _ANTHROPIC_HEADERS):
        return _ROUTES[Protocol.ANTHROPIC]
    return _ROUTES[Protocol.OPENAI]

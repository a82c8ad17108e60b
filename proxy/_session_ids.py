"""Which session a request belongs to: header, body hint or bearer digest (pure).

Session ids are shown by the admin view and written to logs, so an id is
bounded in length, printable, and never a credential: a value taken from a
credential header is always replaced by a digest. No I/O and no state; the
registry (:mod:`proxy._sessions`) and the admin routes both use these functions,
so an operator naming a session by its bearer token finds the same id the
request handler computed.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping, Sequence
from typing import Final

from multidict import CIMultiDict, CIMultiDictProxy

__all__ = [
    "BEARER_ID_PREFIX",
    "DEFAULT_SESSION_HEADERS",
    "HASHED_ID_PREFIX",
    "MAX_SESSION_ID_CHARS",
    "bearer_session_id",
    "normalize_session_id",
    "resolve_session_id",
]

DEFAULT_SESSION_HEADERS: Final = ("x-session-id", "x-claude-code-session-id", "session-id")
"""Header names searched, in order, when the ``session_headers`` setting is not given."""

MAX_SESSION_ID_CHARS: Final = 256
"""Longest session id (in characters) kept verbatim; longer ones are hashed."""

HASHED_ID_PREFIX: Final = "h:"
"""Prefix of an id replaced by its digest because it was too long or not printable."""

BEARER_ID_PREFIX: Final = "b:"
"""Prefix of an id derived from a credential header (always a digest, never the token)."""

# Values of these headers are credentials: an id derived from one is always a digest,
# because session ids are shown by the admin view and written to logs.
_CREDENTIAL_HEADERS: Final = frozenset(
    {"authorization", "proxy-authorization", "x-api-key", "api-key", "x-goog-api-key"}
)


def _digest(value: str) -> str:
    # surrogatepass: a header decoded with surrogateescape must hash, not raise.
    data = value.encode("utf-8", "surrogatepass")
    return hashlib.blake2b(data, digest_size=16).hexdigest()


def normalize_session_id(value: str | None) -> str | None:
    """The session id carried by one raw value, or ``None`` if it carries none.

    Surrounding whitespace is stripped; an empty result is ``None``. Case is
    preserved. A value longer than :data:`MAX_SESSION_ID_CHARS` characters, or
    one containing a non-printable character (``str.isprintable``, which
    excludes control characters such as CR/LF, so an id cannot forge log lines),
    is replaced by ``"h:" + 32 hex digits`` (BLAKE2b-128 of the stripped value)
    rather than ignored, so such a client still gets one stable, bounded
    session. The mapping is idempotent: normalizing a normalized id returns it.
    """
    if value is None:
        return None
    value = value.strip()
    if not value:
        return None
    if len(value) > MAX_SESSION_ID_CHARS or not value.isprintable():
        return HASHED_ID_PREFIX + _digest(value)
    return value


def bearer_session_id(authorization: str) -> str | None:
    """The session id of an ``Authorization: Bearer <token>`` value, or ``None``.

    The auth-scheme is matched case-insensitively (RFC 9110 section 11.1). The
    id is ``"b:" + 32 hex digits`` (BLAKE2b-128 of the token), never the token
    itself: the Authorization header is where API keys travel, and session ids
    appear in the admin view and in logs. The admin layer computes the same id
    with this function when an operator names a session by its bearer token.
    """
    parts = authorization.strip().split(None, 1)
    if len(parts) != 2 or parts[0].lower() != "bearer":
        return None
    token = parts[1].strip()
    return BEARER_ID_PREFIX + _digest(token) if token else None


def resolve_session_id(
    headers: Mapping[str, str],
    *,
    header_order: Sequence[str] = DEFAULT_SESSION_HEADERS,
    body_hint: str | None = None,
    from_bearer: bool = False,
) -> str | None:
    """Decide the session id of a request, or ``None`` if it names none.

    Sources, first usable one wins:

    1. the headers named in ``header_order`` (the ``session_headers`` setting),
       in that order, names matched case-insensitively; for a repeated header
       the first non-blank occurrence counts;
    2. ``body_hint``: the id found in the body (Responses ``prompt_cache_key``,
       Anthropic ``metadata.user_id``), computed by the wire module;
    3. only if ``from_bearer``: ``Authorization: Bearer <token>``, as the
       digest described in :func:`bearer_session_id`.

    Blank values are skipped; every value goes through
    :func:`normalize_session_id` (length bound, case preserved). A header named
    in ``header_order`` that carries credentials (``authorization``,
    ``x-api-key``, ...) is digested like a bearer token. Works with a plain
    ``dict`` as well as a case-insensitive multidict; O(number of headers).
    """
    if isinstance(headers, (CIMultiDict, CIMultiDictProxy)):
        sid, authorization = _from_ci_headers(headers, header_order, from_bearer)
    else:
        sid, authorization = _from_any_headers(headers, header_order, from_bearer)
    if sid is not None:
        return sid
    hint = normalize_session_id(body_hint)
    if hint is not None:
        return hint
    if authorization is not None:
        return bearer_session_id(authorization)
    return None


def _header_session_id(key: str, value: str) -> str | None:
    """The id one value of header ``key`` (lower case) carries: a credential's is a digest."""
    if key in _CREDENTIAL_HEADERS:
        stripped = value.strip()
        return BEARER_ID_PREFIX + _digest(stripped) if stripped else None
    return normalize_session_id(value)


def _from_ci_headers(
    headers: CIMultiDict[str] | CIMultiDictProxy[str],
    header_order: Sequence[str],
    from_bearer: bool,
) -> tuple[str | None, str | None]:
    """:func:`_from_any_headers` for a case-insensitive multidict (the request's own).

    A lookup per name in ``header_order`` instead of a pass over every field
    with its name lower-cased: the same answer, for a third of the cost.
    """
    for name in header_order:
        for value in headers.getall(name, ()):
            sid = _header_session_id(name.lower(), value)
            if sid is not None:
                return sid, None
    if from_bearer:
        # An Authorization named in the order was taken above unless blank (no id either).
        values = headers.getall("Authorization", ())
        return None, values[0] if values else None
    return None, None


def _from_any_headers(
    headers: Mapping[str, str], header_order: Sequence[str], from_bearer: bool
) -> tuple[str | None, str | None]:
    """The id the first usable header in ``header_order`` carries, and the first
    ``Authorization`` value when ``from_bearer`` and it is not in the order.

    One pass over ``headers`` (any mapping; names matched lower-cased).
    """
    slots: dict[str, int] = {}
    for position, name in enumerate(header_order):
        slots.setdefault(name.lower(), position)
    found: list[str | None] = [None] * len(header_order)
    authorization: str | None = None
    for name, value in headers.items():
        key = name.lower()
        index = slots.get(key)
        if index is not None:
            if found[index] is None:
                found[index] = _header_session_id(key, value)
        elif from_bearer and key == "authorization" and authorization is None:
            authorization = value
    return next((sid for sid in found if sid is not None), None), authorization

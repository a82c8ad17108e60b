"""Health, readiness, metrics and the admin API.

Open to anyone: ``GET /healthz`` (alive), ``GET /readyz`` (503 while draining),
``GET /metrics`` (Prometheus text). Under ``/admin/`` (loopback, an address in
``admin_allow``, or ``Authorization: Bearer <admin_token>``; otherwise 403):
``GET /admin/sessions[?limit=N&cursor=C|?tombstoned=true]``, ``GET|DELETE /admin/sessions/{id}``,
``GET /admin/usage[?by=session|model&since=T&limit=N&cursor=C]``, ``GET /admin/exchanges``,
``POST /admin/shutdown``, and the live page (:mod:`proxy._live`): ``GET /admin/``
and its files, ``GET /admin/events``.

The peer address is the socket's, never ``X-Forwarded-For`` (a header any
client can set). No admin answer ever contains a body, a prompt or a key.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import datetime
import hmac
import ipaddress
import logging
import math
import urllib.parse
from collections.abc import Awaitable, Callable
from typing import Any, Final

from ._answer import SmallAnswer
from ._front import Answer, Request
from ._live import exchange_views, page_asset, page_routes, stream_events
from ._plugins import UsageQuery
from ._sessions import SessionCloseError, SessionInfo
from ._state import AppState

log = logging.getLogger("context_proxy.admin")

__all__ = ["AdminHandler", "admin_guard", "admin_routes"]


def _allowed(request: Request, state: AppState) -> bool:
    settings = state.settings
    token = settings.admin_token
    if token:
        auth = request.headers.get("Authorization", "")
        scheme, _, value = auth.partition(" ")
        # Compared as bytes: compare_digest refuses str with non-ASCII characters
        # (TypeError, a 500), and a header may carry any byte (surrogate-escaped).
        offered = value.strip().encode("utf-8", "surrogateescape")
        if scheme.lower() == "bearer" and hmac.compare_digest(offered, token.encode("utf-8")):
            return True
    peer = request.transport.get_extra_info("peername") if request.transport else None
    host = peer[0] if isinstance(peer, tuple) and peer else None
    if not isinstance(host, str):
        return False
    return _canonical(host) in {_canonical(allowed) for allowed in settings.admin_allow}


def _canonical(address: str) -> str:
    """``::ffff:127.0.0.1`` (a dual-stack listener's view of IPv4) → ``127.0.0.1``."""
    try:
        ip = ipaddress.ip_address(address)
    except ValueError:
        return address
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        return str(ip.ipv4_mapped)
    return str(ip)


def _forbidden() -> SmallAnswer:
    return SmallAnswer.json({"error": "forbidden"}, status=403)


async def healthz(request: Request, state: AppState) -> SmallAnswer:
    """Alive: 200 as long as the event loop answers."""
    return SmallAnswer.json({"status": "ok"})


async def readyz(request: Request, state: AppState) -> SmallAnswer:
    """Ready: 200, or 503 from the moment shutdown begins (also in degraded cluster mode)."""
    if state.draining:
        return SmallAnswer.json({"status": "draining"}, status=503)
    if state.cluster is not None:
        # Still ready while Redis is down: the node serves with its local view
        # (docs/cluster.md, "When Redis dies"); the body says so.
        cluster = "degraded" if state.cluster.degraded else "ok"
        return SmallAnswer.json({"status": "ready", "cluster": cluster})
    return SmallAnswer.json({"status": "ready"})


async def metrics(request: Request, state: AppState) -> SmallAnswer:
    """Prometheus text exposition (version 0.0.4)."""
    body = state.metrics.render()
    return SmallAnswer(body=body, headers={"Content-Type": "text/plain; version=0.0.4"})


def _ttl_view(remaining: float | None) -> float | None:
    return None if remaining is None else round(remaining, 3)


def _info_view(info: SessionInfo, tombstone_ttl_s: float | None) -> dict[str, Any]:
    return {
        "id": info.id,
        "in_flight": info.in_flight,
        "pinned": info.pinned,
        "requests": info.requests,
        "idle_s": round(info.idle_s, 3),
        "live": info.live,
        "tombstoned": info.tombstoned,
        "tombstone_ttl_s": _ttl_view(tombstone_ttl_s) if info.tombstoned else None,
    }


def _closed_view(sid: str, remaining: float) -> dict[str, Any]:
    """A session whose state is gone but whose tombstone lives (``remaining`` seconds)."""
    return {
        "id": sid,
        "in_flight": 0,
        "pinned": False,
        "requests": None,
        "idle_s": None,
        "live": False,
        "tombstoned": True,
        "tombstone_ttl_s": _ttl_view(remaining),
        "plugins": None,
    }


async def _tombstone_left(state: AppState, sid: str) -> float | None:
    """Seconds the tombstone of ``sid`` still lives: the node's view, else Redis's.

    In cluster mode a node that missed the close (started later, or down when it
    was announced) still sees the tombstone in Redis; a Redis outage falls back
    to the local view (``None`` here).
    """
    left = state.registry.tombstone_remaining(sid)
    if left is None and state.cluster is not None:
        left = await state.cluster.tombstone_left(sid)
    return left


#: Seconds a status read waits for a prepare or commit holding the session lock.
STATUS_READ_TIMEOUT = 2.0


#: Sessions in one ``GET /admin/sessions`` page when ``limit`` is not given.
SESSIONS_PAGE_DEFAULT: Final = 100
#: Largest ``limit`` accepted: a page of this many, read and encoded, holds the loop
#: about 2 ms, p99 3.3 ms (measured at 100,000 sessions on a 2-core machine; 500: 4.8 ms).
SESSIONS_PAGE_MAX: Final = 250


def _page_limit(raw: str | None) -> int | None:
    """``limit`` from the query: the default when absent, ``None`` when not 1..max."""
    if raw is None:
        return SESSIONS_PAGE_DEFAULT
    # isascii: str.isdigit() is true of "²" and other digits int() refuses.
    if not (raw.isascii() and raw.isdigit()) or not 1 <= int(raw) <= SESSIONS_PAGE_MAX:
        return None
    return int(raw)


async def list_sessions(request: Request, state: AppState) -> SmallAnswer:
    """One page of the sessions: in-flight count, pinned, last activity, live, tombstoned.

    ``live`` is ``false`` for a session a plugin loaded from its storage at
    start-up (the ledger's) that no request of this process has reached yet.

    ``?limit=N`` (1 to :data:`SESSIONS_PAGE_MAX`, default
    :data:`SESSIONS_PAGE_DEFAULT`) sessions in creation order, after
    ``?cursor=C``; the answer's ``next_cursor`` is the token of the following
    page (``null`` after the last). The work is O(page), whatever the number
    of sessions: the loop is never held for a walk of all of them. 400 for a
    bad ``limit`` or a cursor this process did not issue (it restarted).

    With ``?tombstoned=true``: only the tombstoned ones instead, those still
    being closed (with their state) and those closed (state gone, tombstone
    alive), each with ``tombstone_ttl_s``, from this node's view: the same
    pages, the closes in progress on the first one, then the closed ones
    (at most ``tombstone_cap`` in all) oldest tombstone first.
    """
    registry = state.registry
    limit = _page_limit(request.query.get("limit"))
    if limit is None:
        return SmallAnswer.json(
            {"error": f"limit: expected an integer from 1 to {SESSIONS_PAGE_MAX}"}, status=400
        )
    cursor = request.query.get("cursor") or None
    if request.query.get("tombstoned", "").lower() not in ("true", "1", "yes"):
        try:
            page = registry.page(cursor, limit)
        except ValueError as exc:
            return SmallAnswer.json({"error": str(exc)}, status=400)
        views = [
            _info_view(i, registry.tombstone_remaining(i.id) if i.tombstoned else None)
            for i in page.sessions
        ]
        return SmallAnswer.json({"sessions": views, "next_cursor": page.next_cursor})
    try:
        closed, next_cursor = registry.tombstoned_page(cursor, limit)
    except ValueError as exc:
        return SmallAnswer.json({"error": str(exc)}, status=400)
    out: list[dict[str, Any]] = []
    for sid, left in closed:
        info = registry.info(sid)
        out.append(_closed_view(sid, left) if info is None else _info_view(info, left))
    return SmallAnswer.json({"sessions": out, "next_cursor": next_cursor})


#: ``by`` values of ``GET /admin/usage``; the first is the default.
USAGE_BY: Final = ("model", "session")


def _since(raw: str | None) -> float | None:
    """``since`` from the query: Unix seconds or an ISO-8601 time (UTC unless it
    names an offset), as Unix seconds; ``None`` when absent.

    Raises:
        ValueError: neither form, or not finite.
    """
    if raw is None or raw == "":
        return None
    try:
        seconds = float(raw)
    except ValueError:
        when = datetime.datetime.fromisoformat(raw)  # raises ValueError itself
        if when.tzinfo is None:
            when = when.replace(tzinfo=datetime.UTC)
        seconds = when.timestamp()
    if not math.isfinite(seconds):
        raise ValueError(raw)
    return seconds


def _usage_cursor(key: str) -> str:
    """The opaque ``next_cursor`` after the row ``key`` (URL-safe base64 of the key)."""
    return base64.urlsafe_b64encode(key.encode("utf-8", "surrogateescape")).decode("ascii")


def _usage_after(cursor: str) -> str:
    """The row key a :func:`_usage_cursor` token stands for.

    Raises:
        ValueError: not a token this endpoint issues.
    """
    try:
        raw = base64.urlsafe_b64decode(cursor.encode("ascii"))
    except (binascii.Error, UnicodeEncodeError) as exc:
        raise ValueError(cursor) from exc
    # Strict UTF-8 (UnicodeDecodeError is a ValueError): keys are text, and a lone
    # surrogate would only fail later, in the store's query.
    if not raw or _usage_cursor(raw.decode("utf-8")) != cursor:
        raise ValueError(cursor)
    return raw.decode("utf-8")


def _bad_request(message: str) -> SmallAnswer:
    return SmallAnswer.json({"error": message}, status=400)


async def usage(request: Request, state: AppState) -> SmallAnswer:
    """Token usage per model or per session, from the plugin that keeps it (``usage``).

    Query: ``by`` (``model``, the default, or ``session``); ``since`` (Unix
    seconds or ISO-8601, UTC unless an offset is given): only the rows last
    seen at or after it, with their whole totals; ``limit`` (1 to
    :data:`SESSIONS_PAGE_MAX`, default :data:`SESSIONS_PAGE_DEFAULT`) and
    ``cursor`` (a previous answer's ``next_cursor``), rows in ascending key order.

    Answer: ``{"by", "rows": [{"key", "requests", "input_tokens",
    "cached_input_tokens", "cache_write_tokens", "output_tokens",
    "last_seen"}], "next_cursor"}``; tokens are counts, ``last_seen`` Unix
    seconds. 400 for a bad parameter, 404 when no plugin keeps usage, 503 when
    the plugin failed to answer (logged by the plugin host).
    """
    query = request.query
    by = query.get("by") or USAGE_BY[0]
    if by not in USAGE_BY:
        return _bad_request(f"by: expected one of {', '.join(USAGE_BY)}")
    limit = _page_limit(query.get("limit"))
    if limit is None:
        return _bad_request(f"limit: expected an integer from 1 to {SESSIONS_PAGE_MAX}")
    try:
        since = _since(query.get("since"))
    except ValueError:
        return _bad_request("since: expected Unix seconds or an ISO-8601 time")
    cursor = query.get("cursor") or None
    try:
        after = None if cursor is None else _usage_after(cursor)
    except ValueError:
        return _bad_request("cursor: not one this endpoint issued (start again without one)")
    if not state.host.keeps_usage:
        return SmallAnswer.json(
            {"error": 'no usage kept: enable the usage plugin (plugins = [..., "usage"])'},
            status=404,
        )
    page = await state.host.usage_page(UsageQuery(by=by, since=since, after=after, limit=limit))
    if page is None:
        return SmallAnswer.json({"error": "the usage plugin failed to answer"}, status=503)
    rows = [
        {
            "key": row.key,
            "requests": row.requests,
            "input_tokens": row.input_tokens,
            "cached_input_tokens": row.cached_input_tokens,
            "cache_write_tokens": row.cache_write_tokens,
            "output_tokens": row.output_tokens,
            "last_seen": row.last_seen,
        }
        for row in page.rows
    ]
    next_cursor = _usage_cursor(page.rows[-1].key) if page.more and page.rows else None
    return SmallAnswer.json({"by": by, "rows": rows, "next_cursor": next_cursor})


async def get_session(request: Request, state: AppState, sid: str) -> SmallAnswer:
    """One session, with each plugin's scalar state for it.

    The read is taken under the session's lock (between two commits) when it
    can be had within :data:`STATUS_READ_TIMEOUT`; otherwise the lock-free
    registry view is returned with ``"plugins": null``. A closed session (state
    dropped, tombstone alive) answers 200 with ``tombstoned: true`` and
    ``tombstone_ttl_s``; 404 only when neither state nor tombstone exists.
    """
    view: dict[str, Any]
    try:
        async with asyncio.timeout(STATUS_READ_TIMEOUT):
            status = await state.registry.status(sid, probe=state.host.session_state)
    except TimeoutError:
        info = state.registry.info(sid)
        if info is None:
            return await _closed_or_missing(state, sid)
        view = _info_view(info, state.registry.tombstone_remaining(sid))
        view["plugins"] = None
        return SmallAnswer.json(view)
    if status is None:
        return await _closed_or_missing(state, sid)
    view = _info_view(status.info, state.registry.tombstone_remaining(sid))
    view["plugins"] = dict(status.state)
    return SmallAnswer.json(view)


async def _closed_or_missing(state: AppState, sid: str) -> SmallAnswer:
    left = await _tombstone_left(state, sid)
    if left is None:
        return SmallAnswer.json({"error": "no such session"}, status=404)
    return SmallAnswer.json(_closed_view(sid, left))


_WAIT_VALUES: Final = {"true": True, "1": True, "false": False, "0": False}


async def delete_session(request: Request, state: AppState, sid: str) -> SmallAnswer:
    """``shutdown_session``: tombstone, wait up to the timeout, cancel stragglers, drop.

    By default the answer comes once the close is done (it can take up to
    ``session_shutdown_timeout`` seconds while in-flight exchanges finish), with
    the counts. ``?wait=false`` answers 202 at once and finishes the close in
    the background; the tombstone is set before the answer (embedded mode) and
    a failure is logged. In cluster mode the close holds on every node
    (:meth:`ClusterNode.close_session`) and the answer adds ``expired``,
    ``remaining`` and ``degraded``.
    """
    grace = state.settings.session_shutdown_timeout
    wait = _WAIT_VALUES.get(request.query.get("wait", "true").strip().lower())
    if wait is None:
        return SmallAnswer.json({"error": "wait: expected true or false"}, status=400)
    if not wait:
        if state.cluster is not None:
            task = asyncio.create_task(state.cluster.close_session(sid, grace))
            # Referenced until done (the loop keeps only weak references to tasks).
            closing = state.background_closes
            closing.add(task)
            task.add_done_callback(closing.discard)
            task.add_done_callback(lambda done: _log_failure(sid, done))
        else:
            # Synchronous: the tombstone is set before the 202 goes out; the close
            # runs in the registry's own task, which close_all at shutdown awaits.
            future = state.registry.start_shutdown(sid, grace)
            future.add_done_callback(lambda done: _log_failure(sid, done))
        return SmallAnswer.json({"id": sid, "status": "closing"}, status=202)
    try:
        if state.cluster is not None:
            # Every node: tombstone in Redis, close command on the stream, wait for
            # the session's in-flight set; counts are cluster-wide (docs/cluster.md).
            closed = await state.cluster.close_session(sid, grace)
            return SmallAnswer.json(
                {
                    "id": sid,
                    "finished": closed.finished,
                    "cancelled": closed.cancelled,
                    "expired": closed.expired,
                    "remaining": closed.remaining,
                    "already_closed": closed.already_closed,
                    "degraded": closed.degraded,
                }
            )
        result = await state.registry.shutdown_session(sid, grace)
    except SessionCloseError as exc:
        return SmallAnswer.json({"id": sid, "error": f"cleanup failed: {exc}"}, status=500)
    return SmallAnswer.json(
        {
            "id": sid,
            "finished": result.finished,
            "cancelled": result.cancelled,
            "already_closed": result.already_closed,
        }
    )


def _log_failure(sid: str, done: asyncio.Future[Any]) -> None:
    """Log the failure of a session close nobody waits for (``?wait=false``)."""
    if done.cancelled():
        return
    exc = done.exception()
    if exc is not None:
        log.error("closing session %s in the background failed: %s", sid, exc)


async def list_exchanges(request: Request, state: AppState) -> SmallAnswer:
    """Each in-flight exchange: session, protocol, phase, bytes held by kind, age
    (:func:`proxy._live.exchange_views`)."""
    return SmallAnswer.json({"exchanges": exchange_views(state)})


async def shutdown(request: Request, state: AppState) -> SmallAnswer:
    """Begin graceful shutdown (as SIGTERM does); answers 202 at once."""
    state.draining = True
    state.stop.set()
    return SmallAnswer.json({"status": "draining"}, status=202)


AdminHandler = Callable[[Request, AppState], Awaitable[Answer]]
"""A health, metrics or admin route's handler: a small answer, or a streamed one
(``/admin/events``)."""

_PLAIN_ROUTES: Final[dict[str, dict[str, AdminHandler]]] = {
    "/healthz": {"GET": healthz},
    "/readyz": {"GET": readyz},
    "/metrics": {"GET": metrics},
    "/admin/sessions": {"GET": list_sessions},
    "/admin/usage": {"GET": usage},
    "/admin/exchanges": {"GET": list_exchanges},
    "/admin/events": {"GET": stream_events},
    "/admin/shutdown": {"POST": shutdown},
}
_SESSION_PREFIX: Final = "/admin/sessions/"


def _session_routes(sid: str) -> dict[str, AdminHandler]:
    async def get(request: Request, state: AppState) -> SmallAnswer:
        return await get_session(request, state, sid)

    async def delete(request: Request, state: AppState) -> SmallAnswer:
        return await delete_session(request, state, sid)

    return {"GET": get, "DELETE": delete}


def _page_route(name: str) -> dict[str, AdminHandler]:
    async def get(request: Request, state: AppState) -> SmallAnswer:
        return page_asset(name)

    return {"GET": get}


def admin_routes(path: str, raw_path: str | None = None) -> dict[str, AdminHandler] | None:
    """The handlers of ``path`` (percent-decoded) by method, or None when it is no admin route.

    A ``GET`` route answers ``HEAD`` too (the caller sends no body for it).
    ``/admin/sessions/{id}``: the id is one segment of ``raw_path`` (the path as
    sent; ``path`` when not given), percent-decoded, so an id with a ``/`` in it
    (``team/42``) is named as ``team%2F42``, as ``context-proxy sessions`` does.
    """
    routes = _PLAIN_ROUTES.get(path)
    if routes is not None:
        return routes
    asset = page_routes(path)
    if asset is not None:
        return _page_route(asset)
    raw = path if raw_path is None else raw_path
    if raw.startswith(_SESSION_PREFIX):
        segment = raw[len(_SESSION_PREFIX) :]
        if segment and "/" not in segment:
            return _session_routes(urllib.parse.unquote(segment))
    return None


def admin_guard(request: Request, state: AppState) -> SmallAnswer | None:
    """403 for a path under ``/admin/`` unless the peer or the token is allowed; else None."""
    if request.path.startswith("/admin/") and not _allowed(request, state):
        return _forbidden()
    return None

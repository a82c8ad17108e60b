"""The live admin page: ``GET /admin/`` (HTML, CSS, JS shipped in ``proxy/_page/``) and
``GET /admin/events``, a server-sent event stream of snapshots of the proxy.

A snapshot is scalars only, the same fields as ``GET /admin/exchanges`` plus the
process's RSS and the bytes held by phase; it never holds a prompt, a body, a
header value or a key. The page draws everything from snapshots and from the
other admin routes; it makes no request outside this proxy (its CSP says so).

The event stream ends on its own at drain (``AppState.stop``), so it never
holds shutdown up, and after :data:`EVENTS_MAX_S` seconds (an ``EventSource``
reconnects by itself), so that no stream lives unbounded.
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib.resources
import json
import os
import time
from typing import Any, Final

from multidict import CIMultiDict

from ._answer import SmallAnswer
from ._front import Answer, Request, StreamAnswer
from ._state import AppState

__all__ = [
    "EVENTS_INTERVAL_S",
    "EVENTS_MAX_S",
    "exchange_views",
    "page_asset",
    "rss_bytes",
    "snapshot",
    "stream_events",
]

#: Seconds between two snapshots on ``GET /admin/events``.
EVENTS_INTERVAL_S: Final = 1.0
#: Seconds one event stream lasts at most; the browser's ``EventSource`` then reconnects.
EVENTS_MAX_S: Final = 600.0
#: Milliseconds an ``EventSource`` waits before reconnecting (the SSE ``retry`` field).
_RETRY_MS: Final = 2000

#: The page's files by the name they are served under (below ``/admin/``).
_ASSETS: Final = {
    "": ("index.html", "text/html; charset=utf-8"),
    "page.css": ("page.css", "text/css; charset=utf-8"),
    "page.js": ("page.js", "text/javascript; charset=utf-8"),
}
#: Nothing but this proxy: no CDN, no inline script, no frame, no form elsewhere.
_CSP: Final = (
    "default-src 'self'; img-src 'self'; object-src 'none'; base-uri 'none'; "
    "frame-ancestors 'none'; form-action 'none'"
)


def rss_bytes() -> int | None:
    """The process's resident set size in bytes, from ``/proc/self/statm`` (Linux);
    ``None`` where that file does not exist."""
    try:
        with open("/proc/self/statm", "rb") as statm:
            fields = statm.read().split()
    except OSError:
        return None
    return int(fields[1]) * os.sysconf("SC_PAGE_SIZE")


def exchange_views(state: AppState) -> list[dict[str, Any]]:
    """Each in-flight exchange as ``GET /admin/exchanges`` lists it (scalars only).

    Keys: ``id``, ``session`` (or None), ``protocol``, ``phase``, ``fold_level``,
    ``declared_bytes`` (Content-Length of a body being read, 0: none),
    ``held_bytes`` (``raw``, ``parsed``, ``outbound``, ``response``, ``total`` of memory,
    and ``spooled``: body bytes in a spool file, not in ``total``; bytes),
    ``age_s`` (seconds).
    """
    out = []
    for ex in list(state.exchanges.values()):
        held = ex.held_bytes()
        out.append(
            {
                "id": ex.id,
                "session": ex.session_id,
                "protocol": str(ex.protocol),
                "phase": ex.phase.value,
                "fold_level": ex.fold_level,
                # Only received bytes are held; the declared size is what is on its way.
                "declared_bytes": ex.declared_bytes,
                "held_bytes": {
                    "raw": held.raw,
                    "parsed": held.parsed,
                    "outbound": held.outbound,
                    "response": held.response,
                    "total": held.total,
                    # In the spool file (disk and page cache), not in process memory.
                    "spooled": held.spooled,
                },
                "age_s": round(ex.age(), 3),
            }
        )
    return out


def snapshot(state: AppState) -> dict[str, Any]:
    """One ``snapshot`` event's data.

    Keys: ``time`` (Unix seconds), ``rss_bytes`` (int or None), ``draining``,
    ``held_by_phase`` (phase → heap bytes held by the exchanges in it),
    ``spooled_bytes`` (body bytes the exchanges keep in spool files, not in the heap)
    and ``exchanges`` (:func:`exchange_views`).
    """
    exchanges = exchange_views(state)
    by_phase: dict[str, int] = {}
    spooled = 0
    for view in exchanges:
        phase = view["phase"]
        held = view["held_bytes"]
        by_phase[phase] = by_phase.get(phase, 0) + held["total"]
        spooled += held.get("spooled", 0)
    return {
        "time": round(time.time(), 3),
        "rss_bytes": rss_bytes(),
        "draining": state.draining,
        "held_by_phase": by_phase,
        "spooled_bytes": spooled,
        "exchanges": exchanges,
    }


#: Seconds a ``snapshot`` event is reused for the other viewers' periodic events: with
#: many viewers and many exchanges in flight, one snapshot per viewer per second kept the
#: event loop busy (about 5 ms per 1,000 exchanges, each).
_SHARED_S: Final = EVENTS_INTERVAL_S / 2


def _snapshot_event(state: AppState, now: float, fresh: bool) -> bytes:
    """The encoded ``snapshot`` event for a viewer at loop time ``now`` (seconds): the
    one another viewer got less than :data:`_SHARED_S` ago, unless ``fresh`` (a
    viewer's first, which must show the state as it is when it connects)."""
    cached = state.snapshot_event
    if not fresh and cached is not None and 0 <= now - cached[0] < _SHARED_S:
        return cached[1]
    event = _event("snapshot", snapshot(state))
    state.snapshot_event = (now, event)
    return event


def _event(name: str, data: dict[str, Any]) -> bytes:
    # One data line: JSON escapes every line break, so the event cannot be split
    # (WHATWG HTML, "Interpreting an event stream").
    return b"event: %s\ndata: %s\n\n" % (name.encode(), json.dumps(data).encode())


def page_asset(name: str) -> SmallAnswer:
    """The page's file ``name`` ("" is the HTML), with a CSP allowing only this origin.

    Raises:
        KeyError: ``name`` is none of the page's files (the router never asks for one).
    """
    filename, content_type = _ASSETS[name]
    body = importlib.resources.files("proxy").joinpath("_page", filename).read_bytes()
    return SmallAnswer(
        body=body,
        headers={
            "Content-Type": content_type,
            "Content-Security-Policy": _CSP,
            "Cache-Control": "no-store",
            "X-Content-Type-Options": "nosniff",
            "Referrer-Policy": "no-referrer",
        },
    )


def page_routes(path: str) -> str | None:
    """The page's file name for ``path`` (``/admin/``, ``/admin/page.js``...), else None."""
    if not path.startswith("/admin/"):
        return None
    name = path[len("/admin/") :]
    return name if name in _ASSETS else None


async def stream_events(request: Request, state: AppState) -> Answer:
    """``GET /admin/events``: a ``snapshot`` event at once, then one every
    :data:`EVENTS_INTERVAL_S` seconds.

    Ends with an ``end`` event when the proxy drains, and without one after
    :data:`EVENTS_MAX_S` seconds. A client that reads slower than snapshots
    come holds the stream back (the next one waits for the last to be taken),
    never a queue of them. Viewers share a snapshot made less than
    :data:`_SHARED_S` ago, except for their first. ``HEAD`` gets the head only.
    """
    headers = CIMultiDict(
        {
            "Content-Type": "text/event-stream",
            "Cache-Control": "no-store",
            # nginx in front (docs/deploy.md) would otherwise buffer the stream.
            "X-Accel-Buffering": "no",
        }
    )
    answer = StreamAnswer(200, headers)
    try:
        if request.method == "HEAD":
            # A streamed answer's head: no length (a SmallAnswer's would say 0, and a
            # GET's stream has none).
            await answer.prepare(request)
            await answer.write_eof()
            return answer
        await answer.prepare(request)
        await answer.write(b"retry: %d\n\n" % _RETRY_MS)
        loop = asyncio.get_running_loop()
        deadline = loop.time() + EVENTS_MAX_S
        fresh = True
        while True:  # bounded: EVENTS_MAX_S, or the drain
            await answer.write(_snapshot_event(state, loop.time(), fresh))
            fresh = False
            left = deadline - loop.time()
            if left <= 0:
                break
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(min(EVENTS_INTERVAL_S, left)):
                    await state.stop.wait()  # set when the drain begins
            if state.stop.is_set():
                await answer.write(_event("end", {"reason": "draining"}))
                break
        await answer.write_eof()
    except ConnectionError:
        pass  # the client left: nothing more to send
    return answer

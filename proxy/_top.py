"""``context-proxy top``: the in-flight exchanges of a running proxy, live in the terminal.

Reads the proxy's ``GET /admin/events`` stream (:mod:`proxy._live`: a snapshot a
second) and draws each snapshot as a table with ``rich.live``; ``--once`` prints
the first snapshot and exits. Like the page, it shows scalars only: never a
prompt, a body, a header value or a key.
"""

from __future__ import annotations

import http.client
import json
import urllib.error
import urllib.request
from collections.abc import Generator
from typing import Any, Final

from rich.console import Console, Group, RenderableType
from rich.table import Table
from rich.text import Text

__all__ = ["READ_TIMEOUT_S", "TopError", "cell", "print_once", "render", "snapshots"]

#: Seconds without a byte from the event stream before ``top`` gives up (snapshots
#: come every second).
READ_TIMEOUT_S: Final = 10.0
#: Widest a session id gets in the table; longer ones end in an ellipsis.
SESSION_WIDTH: Final = 14


def cell(value: object) -> Text:
    """``str(value)`` as a table cell shown as it is: never read as rich markup (a
    session id or model ``[/x]`` would raise ``MarkupError``, ``[bold]`` would style),
    and with every non-printable character but a line break (ESC, BEL, CR, ...)
    written as its Python escape (``\\x1b``), so a client-chosen name cannot drive
    the operator's terminal; a line break starts a line of the cell."""
    text = str(value)
    if not text.isprintable():
        text = "".join(
            c if c.isprintable() or c == "\n" else c.encode("unicode_escape").decode() for c in text
        )
    return Text(text)


class TopError(Exception):
    """The event stream could not be opened or read; the message says why (one line).

    ``status`` is the HTTP status of a refusal (e.g. 403), else None.
    """

    def __init__(self, message: str, status: int | None = None) -> None:
        super().__init__(message)
        self.status = status


def snapshots(base: str, token: str | None) -> Generator[dict[str, Any], None, None]:
    """Each ``snapshot`` of ``{base}/admin/events``, until the proxy drains (its ``end``
    event).

    A stream the proxy closed at the end of its life (``EVENTS_MAX_S``, no ``end``
    event) is opened again, as a browser's ``EventSource`` would.

    Raises:
        TopError: a stream could not be opened (refused, not there, no proxy), broke,
            sent nothing for :data:`READ_TIMEOUT_S` seconds, or ended before its
            first snapshot.
    """
    url = f"{base}/admin/events"
    while True:  # bounded: a stream is opened again only after one lived its whole life
        drained = yield from _stream(url, token)
        if drained:
            return


def _stream(url: str, token: str | None) -> Generator[dict[str, Any], None, bool]:
    """The snapshots of one event stream; True when it ended with ``end`` (drain)."""
    request = urllib.request.Request(url, headers={"Accept": "text/event-stream"})
    if token:
        request.add_header("Authorization", f"Bearer {token}")
    try:
        resp = urllib.request.urlopen(request, timeout=READ_TIMEOUT_S)
    except urllib.error.HTTPError as exc:
        raise TopError(f"{url}: HTTP {exc.code}", exc.code) from None
    except OSError as exc:
        raise TopError(f"{url}: {exc}") from None
    seen = 0
    with resp:
        event = "message"
        try:
            for raw in resp:  # bounded: the proxy ends the stream (EVENTS_MAX_S at most)
                line = raw.rstrip(b"\r\n")
                if line.startswith(b"event: "):
                    event = line[len(b"event: ") :].decode()
                elif line.startswith(b"data: ") and event == "snapshot":
                    seen += 1
                    yield _snapshot(url, line[len(b"data: ") :])
                elif line.startswith(b"data: ") and event == "end":
                    return True
                elif not line:
                    event = "message"
        except (OSError, http.client.HTTPException) as exc:  # a timeout, a reset, a cut chunk
            raise TopError(f"{url}: {exc or type(exc).__name__}") from None
    if not seen:
        # The proxy sends a snapshot at once: a stream ended before one is not its
        # end of life (something in between cut it), and opening it again at once
        # would go round without end.
        raise TopError(f"{url}: the event stream ended before its first snapshot")
    return False


def _snapshot(url: str, data: bytes) -> dict[str, Any]:
    """One snapshot event's data as a dict.

    Raises:
        TopError: it is not a JSON object (``--url`` names something else).
    """
    try:
        snap = json.loads(data)
    except ValueError:  # JSONDecodeError and UnicodeDecodeError alike
        snap = None
    if not isinstance(snap, dict):
        raise TopError(f"{url}: a snapshot event that is not a JSON object (not a context-proxy?)")
    return snap


def _size(n: object) -> str:
    """Bytes in at most 5 characters: ``0``, ``812``, ``9.5K``, ``977K``, ``1.9M``, ``12G``."""
    if not isinstance(n, int):
        return "-"
    if n < 1024:
        return str(n)
    value = n / 1024
    for unit in ("K", "M", "G", "T"):
        if value < 1000 or unit == "T":
            return f"{value:.1f}{unit}" if value < 10 else f"{value:.0f}{unit}"
        value /= 1024
    raise AssertionError("unreachable")  # pragma: no cover


#: The kinds of held bytes, as the table names them.
_KINDS: Final = (
    ("raw", "raw"),
    ("parsed", "parsed"),
    ("outbound", "out"),
    ("response", "resp"),
    ("spooled", "spool"),
)


def _held_cell(held: dict[str, Any]) -> str:
    """``2.9M raw=1.9M out=977K`` (total, then each kind holding bytes); ``0`` for none.

    A space only between kinds: the cell folds there, never inside one.
    """
    kinds = " ".join(f"{label}={_size(held.get(key))}" for key, label in _KINDS if held.get(key))
    # ``total`` is the heap's: a spooled body (spool=) is in a file, not in it.
    return f"{_size(held.get('total'))} {kinds}" if kinds else "0"


def render(snap: dict[str, Any]) -> RenderableType:
    """One snapshot as a summary line and a table (exchange, protocol, session, phase,
    fold level, age in seconds, bytes held: total and by kind); fits 80 columns."""
    exchanges: list[dict[str, Any]] = snap.get("exchanges") or []
    held = snap.get("held_by_phase") or {}
    total = sum(v for v in held.values() if isinstance(v, int))
    by_phase = ", ".join(f"{phase} {_size(v)}" for phase, v in held.items())
    rss = _size(snap.get("rss_bytes"))
    summary = f"RSS {rss} · {len(exchanges)} in flight · held {_size(total)}"
    if by_phase:
        summary += f" ({by_phase})"
    spooled = snap.get("spooled_bytes")
    if isinstance(spooled, int) and spooled:
        summary += f" · spooled {_size(spooled)}"
    if snap.get("draining"):
        summary += " · draining"
    if not exchanges:
        return Group(Text(summary, overflow="fold"), Text("no exchange in flight"))
    table = Table(box=None, pad_edge=False, header_style="bold", show_edge=False, padding=(0, 1))
    table.add_column("id", no_wrap=True)
    table.add_column("protocol", no_wrap=True)
    table.add_column("session", no_wrap=True, overflow="ellipsis", max_width=SESSION_WIDTH)
    table.add_column("phase", no_wrap=True)
    table.add_column("fold", no_wrap=True, justify="right")
    table.add_column("age", no_wrap=True, justify="right")
    # Folds between kinds (at the spaces), never inside a number.
    table.add_column("held", overflow="fold", min_width=12)
    for ex in exchanges:
        table.add_row(
            cell(ex.get("id")),
            cell(ex.get("protocol")),
            cell(ex.get("session") or "-"),
            cell(ex.get("phase")),
            cell(ex.get("fold_level")),
            f"{float(ex.get('age_s') or 0):.0f}s",
            _held_cell(ex.get("held_bytes") or {}),
        )
    return Group(Text(summary, overflow="fold"), table)


def print_once(snap: dict[str, Any], width: int) -> str:
    """``render(snap)`` as plain text ``width`` columns wide, trailing blanks dropped."""
    console = Console(width=width, soft_wrap=False, color_system=None)
    with console.capture() as captured:
        console.print(render(snap))
    return "\n".join(line.rstrip() for line in captured.get().splitlines())

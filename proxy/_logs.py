"""Log records of one proxy process: text or JSON lines, the access log, quiet bursts.

* :func:`setup_logging` installs one handler on the root logger writing to stderr,
  as text (``2026-12-01 09:00:00,123 INFO context_proxy: ...``) or as one JSON
  object per line (``log_format = "json"``) with ``timestamp`` (ISO 8601, UTC),
  ``level``, ``logger``, ``message`` and, where known, ``exchange_id`` and
  ``session_id``.
* The exchange and session a record belongs to travel in the context variables
  :data:`EXCHANGE_ID` and :data:`SESSION_ID`: each request handler runs in its
  own task (so its own context copy), and background work spawned from it
  (commits) inherits them. A filter on the handler copies them onto every record.
* :func:`log_access` writes the access line of one exchange (logger
  ``context_proxy.access``): method, route, status, outcome, request and response
  bytes, time to first byte, duration, fold level, exchange and session id.
  Never a header value (other than the session id the client chose to send), a
  query string, a key or a body.
* :class:`LogLimiter` logs the first of a run of similar events (one upstream
  unreachable, one Redis down) and then one summary line per interval with the
  count, instead of a line per event.
* :class:`BurstFilter` keeps a storm of identical failures (``Too many open
  files`` from every accept and connect while descriptors are exhausted) down to
  a few lines per window plus one summary line.
"""

from __future__ import annotations

import asyncio
import contextvars
import datetime
import json
import logging
import re
import sys
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Final, Literal

from ._fdlimit import EXHAUSTED_MESSAGE, is_fd_exhaustion

if TYPE_CHECKING:
    from ._exchange import Exchange

__all__ = [
    "ACCESS_LOG",
    "EXCHANGE_ID",
    "SESSION_ID",
    "BurstFilter",
    "JsonFormatter",
    "LogLimiter",
    "RedactingFormatter",
    "log_access",
    "setup_logging",
]

#: Id of the exchange the running task works for (``None`` outside one).
EXCHANGE_ID: Final[contextvars.ContextVar[str | None]] = contextvars.ContextVar(
    "context_proxy_exchange_id", default=None
)
#: Session id of that exchange, once resolved.
SESSION_ID: Final[contextvars.ContextVar[str | None]] = contextvars.ContextVar(
    "context_proxy_session_id", default=None
)

ACCESS_LOG: Final = logging.getLogger("context_proxy.access")

#: Fields of an access record, in the order the text line shows them.
_ACCESS_FIELDS: Final = (
    "method",
    "route",
    "status",
    "outcome",
    "request_bytes",
    "response_bytes",
    "ttfb_s",
    "duration_s",
    "fold_level",
    "upstream_status",
    "upstream_s",
    "peer",
    "model",
    "user_agent",
    "exchange_id",
    "session_id",
)

#: Characters of the client's User-Agent kept on an access line.
USER_AGENT_CHARS: Final = 80
_CONTROL: Final = re.compile(r"[\x00-\x1f\x7f-\x9f]")


def clean_user_agent(value: str | None) -> str | None:
    """The User-Agent as logged: control characters removed, at most 80 characters.

    ``None`` (no header) stays ``None``; the text line shows it as ``-``. A value that
    is empty once cleaned (only control characters, or an empty header) is ``"-"``
    in both formats, so the field never reads as an empty, easily misparsed token.
    """
    if value is None:
        return None
    return _CONTROL.sub("", value)[:USER_AGENT_CHARS] or "-"


_CREDENTIAL_MARKERS: Final = ("authorization", "x-api-key", "bearer ")
_WITHHELD: Final = "[log line withheld: it named a credential]"


def _names_a_credential(text: str) -> bool:
    lowered = text.lower()
    return any(marker in lowered for marker in _CREDENTIAL_MARKERS)


class _ContextFilter(logging.Filter):
    """Puts the task's exchange and session id on every record it passes."""

    def filter(self, record: logging.LogRecord) -> bool:
        if not hasattr(record, "exchange_id"):
            record.exchange_id = EXCHANGE_ID.get()
        if not hasattr(record, "session_id"):
            record.session_id = SESSION_ID.get()
        return True


class RedactingFormatter(logging.Formatter):
    """Text lines; belt and braces: a line naming a credential header is withheld."""

    def format(self, record: logging.LogRecord) -> str:
        text = super().format(record)
        if _names_a_credential(text):
            return f"{record.levelname} {record.name}: {_WITHHELD}"
        return text


class JsonFormatter(logging.Formatter):
    """One JSON object per record, on one line (newlines inside values are escaped).

    Keys: ``timestamp`` (ISO 8601 UTC, milliseconds), ``level``, ``logger``,
    ``message``, ``exchange_id`` and ``session_id`` when known, the access
    fields on access records, ``exception`` (the formatted traceback) when the
    record carries one. A record naming a credential header has its message
    and traceback withheld, as in the text form.
    """

    def format(self, record: logging.LogRecord) -> str:
        message = record.getMessage()
        exception = self.formatException(record.exc_info) if record.exc_info else None
        if _names_a_credential(message) or (exception and _names_a_credential(exception)):
            message, exception = _WITHHELD, None
        out: dict[str, Any] = {
            "timestamp": datetime.datetime.fromtimestamp(record.created, datetime.UTC).isoformat(
                timespec="milliseconds"
            ),
            "level": record.levelname,
            "logger": record.name,
            "message": message,
        }
        for key in ("exchange_id", "session_id"):
            value = getattr(record, key, None)
            if value is not None:
                out[key] = value
        access = getattr(record, "access", None)
        if isinstance(access, dict):
            # The fields are keys of their own: the message does not repeat them.
            out["message"] = "access"
            out.update(access)
        if exception:
            out["exception"] = exception
        return json.dumps(out, ensure_ascii=False, default=str)


_PLAIN: Final = re.compile(r"[\w.:/@+-]+")


def _text_value(value: object) -> str:
    """A value for a ``key=value`` line: bare if plain, else JSON-quoted (no line breaks)."""
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:.6f}"
    text = str(value)
    return text if _PLAIN.fullmatch(text) else json.dumps(text)


def log_access(
    ex: Exchange,
    *,
    route: str,
    peer: str | None = None,
    user_agent: str | None = None,
) -> None:
    """Write the access line of one finished exchange (INFO on ``context_proxy.access``).

    ``route`` is the request path without its query string (which may carry a
    key). Sizes are bytes: ``request_bytes`` is the decoded body received (one
    refused, e.g. not JSON, too), ``response_bytes`` what was relayed to the
    client from the upstream (0 when the proxy answered itself); times are seconds.
    ``peer`` is the client socket's ``address:port``; ``user_agent`` the raw header,
    cleaned by :func:`clean_user_agent` here (the one header value logged); ``model``
    the request's model as parsed.
    """
    if not ACCESS_LOG.isEnabledFor(logging.INFO):
        return
    fields: dict[str, object] = {
        "method": ex.method,
        "route": route,
        "status": ex.status,
        "outcome": str(ex.outcome),
        "request_bytes": ex.received_bytes,
        "response_bytes": ex.response_bytes,
        "ttfb_s": None if ex.ttfb is None else round(ex.ttfb, 6),
        "duration_s": round(ex.age(), 6),
        "fold_level": ex.fold_level,
        "upstream_status": ex.upstream_status,
        "upstream_s": None if ex.upstream_s is None else round(ex.upstream_s, 6),
        "peer": peer,
        "model": ex.meta.model if ex.meta is not None else None,
        "user_agent": clean_user_agent(user_agent),
        "exchange_id": ex.id,
        "session_id": ex.session_id,
    }
    line = " ".join(f"{key}={_text_value(fields[key])}" for key in _ACCESS_FIELDS)
    ACCESS_LOG.info(
        "%s",
        line,
        extra={"access": fields, "exchange_id": ex.id, "session_id": ex.session_id},
    )


class _Run:
    """One key's run of events: when its window began, how many were not logged, the timer."""

    __slots__ = ("start", "suppressed", "timer")

    def __init__(self, start: float) -> None:
        self.start = start
        self.suppressed = 0
        self.timer: asyncio.TimerHandle | None = None


class LogLimiter:
    """One line for the first of a run of similar events, then a summary line per interval.

    For failures that repeat once per request while a dependency is down (an
    upstream unreachable, Redis down): the first event of a quiet key is logged
    in full; the next ones within ``interval`` seconds are only counted, and when
    the window ends one line says how many there were::

        limiter = LogLimiter(log, interval=10.0)
        limiter.event("upstream 10.0.0.5:443 unreachable", "%s: upstream refused ...", ex_id)
        # ... 4,999 more within 10 s, then, once:
        # "upstream 10.0.0.5:443 unreachable: 4999 more in the last 10 s"

    The summary is written when the window ends (a loop timer, when called on a
    running event loop) or, without a loop, by the first event after it ends or
    by :meth:`flush`. While events keep coming, there is one summary per
    interval and no other line; after a quiet interval the next event is logged
    in full again. Keys name the dependency and the kind of failure (a
    handful per process): their state is kept, a few dozen bytes each.

    Args:
        logger: where the lines go.
        interval: seconds of one window (> 0).
        level: the level of both the first line and the summaries.
        clock: monotonic seconds; injectable for tests.

    Raises:
        ValueError: ``interval`` is not a finite number > 0.
    """

    __slots__ = ("_clock", "_level", "_logger", "_runs", "interval")

    def __init__(
        self,
        logger: logging.Logger,
        *,
        interval: float = 10.0,
        level: int = logging.WARNING,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if not (interval > 0 and interval < float("inf")):
            raise ValueError(f"interval must be a finite number > 0, got {interval!r}")
        self.interval: Final = float(interval)
        self._logger = logger
        self._level = level
        self._clock = clock
        self._runs: dict[str, _Run] = {}

    def event(self, key: str, msg: str, *args: object) -> bool:
        """One event of ``key``; returns whether ``msg % args`` was logged (else counted).

        ``key`` is also the summary's subject, so it must say what failed
        (never a header value, a key or a body: it is logged).
        """
        now = self._clock()
        run = self._runs.get(key)
        if run is not None and now - run.start >= self.interval:
            if run.suppressed == 0:
                run = None  # a quiet window: this one starts a new run
            else:
                # The window ended without its timer (no loop): summarise, count this one.
                self._summarise(key, run, now)
                run.suppressed = 1
                self._arm(key, run)
                return False
        if run is None:
            self._cancel(key)
            self._runs[key] = _Run(now)
            self._logger.log(self._level, msg, *args)
            return True
        run.suppressed += 1
        self._arm(key, run)
        return False

    def suppressed(self, key: str) -> int:
        """Events of ``key`` counted and not yet reported by a summary."""
        run = self._runs.get(key)
        return 0 if run is None else run.suppressed

    def flush(self) -> None:
        """Write the summary of every key with unreported events now (e.g. at shutdown)."""
        now = self._clock()
        for key, run in list(self._runs.items()):
            if run.timer is not None:
                run.timer.cancel()
                run.timer = None
            if run.suppressed:
                self._summarise(key, run, now)

    def _summarise(self, key: str, run: _Run, now: float) -> None:
        seconds = max(now - run.start, 0.0)
        self._logger.log(
            self._level, "%s: %d more in the last %.0f s", key, run.suppressed, seconds
        )
        run.start, run.suppressed = now, 0

    def _arm(self, key: str, run: _Run) -> None:
        if run.timer is not None:
            return
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            return  # no loop: the next event after the window, or flush(), summarises
        delay = max(run.start + self.interval - self._clock(), 0.0)
        run.timer = loop.call_later(delay, self._window_ended, key)

    def _window_ended(self, key: str) -> None:
        run = self._runs.get(key)
        if run is None:
            return
        run.timer = None
        if run.suppressed:
            self._summarise(key, run, self._clock())

    def _cancel(self, key: str) -> None:
        run = self._runs.get(key)
        if run is not None and run.timer is not None:
            run.timer.cancel()


def _is_fd_exhaustion(record: logging.LogRecord) -> bool:
    """Whether ``record`` is part of a descriptor-exhaustion storm.

    Besides the ``EMFILE`` errors themselves: CPython 3.11's accept loop
    (``BaseSelectorEventLoop._accept_connection``) keeps calling ``accept()``
    after ``EMFILE`` and schedules one ``_start_serving`` retry per failed call;
    retries still pending when the listener closes each log a ``ValueError``
    traceback ("Invalid file descriptor: -1").
    """
    if record.exc_info and is_fd_exhaustion(record.exc_info[1]):
        return True
    message = record.getMessage()
    if record.name == "asyncio" and "_start_serving" in message:
        return True
    return "Too many open files" in message or EXHAUSTED_MESSAGE in message


class _Window:
    """Records of one logger in the current window: when it began, passed, dropped."""

    __slots__ = ("dropped", "passed", "start")

    def __init__(self) -> None:
        self.start = float("-inf")
        self.passed = 0
        self.dropped = 0


class BurstFilter(logging.Filter):
    """At most ``burst`` descriptor-exhaustion records per logger per ``window`` seconds.

    While descriptors are exhausted every accept and every upstream connect
    fails, and asyncio and the proxy would log each (with a traceback: in one
    measurement 213,000 lines in 8 seconds). Past ``burst`` records of one
    logger in one window the rest are counted and dropped; the first such
    record after the window ends is let through with the count of those
    dropped appended. Records that pass lose their traceback and line breaks
    (one line each: the cause is the limit, not the code). Other records pass
    untouched. ``clock`` is monotonic seconds (tests inject one).
    """

    def __init__(
        self,
        *,
        burst: int = 5,
        window: float = 10.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        super().__init__()
        self.burst = burst
        self.window = window
        self._clock = clock
        # Keyed by logger name: a handful of loggers (asyncio, the relay, the server).
        self._windows: dict[str, _Window] = {}

    def filter(self, record: logging.LogRecord) -> bool:
        if not _is_fd_exhaustion(record):
            return True
        w = self._windows.get(record.name)
        if w is None:
            w = self._windows[record.name] = _Window()
        now = self._clock()
        note = ""
        if now - w.start >= self.window:
            if w.dropped:
                note = (
                    f" ({w.dropped} similar record(s) dropped in the last"
                    f" {self.window:g}s: out of file descriptors)"
                )
            w.start, w.passed, w.dropped = now, 0, 0
        if w.passed >= self.burst:
            w.dropped += 1
            return False
        w.passed += 1
        message = record.getMessage()
        if record.exc_info and record.exc_info[1] is not None:
            message = f"{message}: {record.exc_info[1]!r}"
        # asyncio's handler records add "handle: ..." and "socket: ..." lines.
        record.msg = message.split("\n", 1)[0] + note
        record.args = ()
        record.exc_info = record.exc_text = None
        return True


#: Loggers whose warnings only ever say what a client sent (kept at ERROR by
#: :func:`setup_logging`).
_CLIENT_DRIVEN_LOGGERS: Final = (
    "opentelemetry.trace.propagation.tracecontext",
    "opentelemetry.baggage.propagation",
)


def setup_logging(level: str, fmt: Literal["text", "json"] = "text") -> None:
    """Log every record (ours, asyncio's, the libraries') to stderr in ``fmt``, at ``level``.

    :func:`log_access` writes the proxy's access lines. OpenTelemetry's
    propagators are kept at ERROR: their warnings are about a client's
    ``traceparent`` / ``baggage`` fields, one per request.
    """
    handler = logging.StreamHandler(sys.stderr)
    handler.addFilter(_ContextFilter())
    handler.addFilter(BurstFilter())
    if fmt == "json":
        handler.setFormatter(JsonFormatter())
    else:
        handler.setFormatter(RedactingFormatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.upper())
    # OpenTelemetry's propagators warn of every over-long or malformed traceparent,
    # tracestate or baggage a client sends: a line per request anyone can cause.
    for name in _CLIENT_DRIVEN_LOGGERS:
        logging.getLogger(name).setLevel(logging.ERROR)

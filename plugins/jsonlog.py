"""Example plugin: one JSON line per exchange, in a size-rotated file.

This is the plugin to copy when you write your own; every comment says why.
Enable it with::

    plugins = ["fold", "jsonlog"]

    [plugin.jsonlog]
    path = "/var/log/context-proxy/exchanges.jsonl"
    max_bytes = 10485760
    backups = 3

Each line is :meth:`ExchangeRecord.as_dict` of one finished exchange: sizes,
status, outcome, digests, token counts and timings. Never a body, never a
header: the record has none, so this plugin cannot leak a prompt or an API key.
"""

from __future__ import annotations

import json
import logging
import logging.handlers
import os
from typing import ClassVar, Final

from proxy import ExchangeRecord, Plugin

__all__ = ["JsonLogPlugin"]


class JsonLogPlugin(Plugin):
    """Appends one JSON object per exchange to ``path``, rotating by size.

    Options (the ``[plugin.jsonlog]`` table):

    ``path`` (str)
        The log file; its directory must exist. Default
        ``"context-proxy-exchanges.jsonl"``.
    ``max_bytes`` (int, bytes, >= 0)
        Rotate before a line would take the file past this size; 0 never
        rotates. Default 10 MiB.
    ``backups`` (int, >= 1)
        Rotated files kept: ``path.1`` (newest) .. ``path.<backups>``.
        Default 3.

    Raises:
        ValueError: on construction, for an option out of range.
    """

    # The name used in logs, metrics, the admin view and the [plugin.<name>] table.
    name: ClassVar[str] = "jsonlog"

    def __init__(
        self,
        *,
        path: str = "context-proxy-exchanges.jsonl",
        max_bytes: int = 10 * 1024 * 1024,
        backups: int = 3,
    ) -> None:
        # Validate every option here: the proxy turns a ValueError into one clear
        # "bad options" error at start-up. Open nothing yet: constructing a plugin
        # must be free of side effects (``context-proxy plugins`` may build one
        # only to check the config).
        if not isinstance(path, str) or not path:
            raise ValueError("path: expected a non-empty string")
        if not (isinstance(max_bytes, int) and max_bytes >= 0):
            raise ValueError(f"max_bytes: expected an int >= 0, got {max_bytes!r}")
        # The standard library's rotation with no backups reopens the same file and
        # keeps appending, so the file would never shrink: refuse it.
        if not (isinstance(backups, int) and backups >= 1):
            raise ValueError(f"backups: expected an int >= 1, got {backups!r}")
        self.path: Final = os.path.abspath(path)
        self.max_bytes: Final = max_bytes
        self.backups: Final = backups
        # A logger of our own, one per file. Dots would make a logger hierarchy
        # out of the path, so they are replaced.
        self._logger: Final = logging.getLogger(
            "context_proxy.jsonlog." + self.path.replace(".", "_")
        )
        self._handler: logging.handlers.RotatingFileHandler | None = None

    async def startup(self) -> None:
        """Open the file. Raises ``OSError`` (fatal at start-up) if it cannot be opened.

        Also raises ``RuntimeError`` if another jsonlog plugin of this process
        writes the same file (two rotating handlers on one file corrupt it).
        """
        # Acquire resources here, not in __init__: a failure in startup() stops
        # the proxy with the plugin's name in the message, before any request.
        # Look for our own kind of handler only: test tools and log collectors may
        # attach theirs to any logger.
        for other in self._logger.handlers:
            if isinstance(other, logging.handlers.RotatingFileHandler):
                raise RuntimeError(f"{self.path} is already written by another jsonlog plugin")
        # The standard library does the rotation (rename path -> path.1 ...), so this
        # plugin has no file bookkeeping of its own to get wrong. delay=False opens
        # the file now, so an unwritable path fails here and not at the first request.
        handler = logging.handlers.RotatingFileHandler(
            self.path, maxBytes=self.max_bytes, backupCount=self.backups, encoding="utf-8"
        )
        handler.setFormatter(logging.Formatter("%(message)s"))
        # Not propagating keeps every line out of the root logger: the exchange
        # log never ends up interleaved with the proxy's own log on stderr.
        self._logger.propagate = False
        self._logger.setLevel(logging.INFO)
        self._logger.addHandler(handler)
        self._handler = handler

    async def commit(self, record: ExchangeRecord) -> None:
        """Write ``record`` as one JSON line.

        Raises:
            ValueError: a float field is NaN or infinite (not valid JSON).
            RuntimeError: called before :meth:`startup`.
        """
        # Runs on the event loop, so it must be quick. The handler writes and
        # flushes the line synchronously: a line is well under 1 KiB and lands in
        # the OS page cache in microseconds, and rotation is one rename per
        # max_bytes. That is cheaper than a thread hop per line. On a slow or
        # network disk, put a logging.handlers.QueueHandler on the logger and run
        # this handler in a QueueListener thread instead.
        #
        # Keep only scalars from the record (here: none at all, it is written out
        # and dropped). The record is frozen and holds no body, so it is safe to
        # serialize whole. allow_nan=False: a NaN would make the line invalid
        # JSON; the host logs the ValueError and skips this plugin for the record.
        if self._handler is None:
            # Before startup() the logger has no handler and would hand the line
            # to the root logger: refuse instead.
            raise RuntimeError("jsonlog plugin used before startup()")
        line = json.dumps(record.as_dict(), separators=(",", ":"), allow_nan=False)
        self._logger.info("%s", line)

    async def shutdown(self) -> None:
        """Flush and close the file; called once, after every session was closed."""
        # Whatever a plugin buffers must reach disk here: after shutdown the
        # process exits. close() flushes, and removing the handler lets a later
        # plugin instance (tests, a restarted app) reuse the same path.
        handler, self._handler = self._handler, None
        if handler is not None:
            self._logger.removeHandler(handler)
            handler.close()

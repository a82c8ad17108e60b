"""A plugin for the cluster tests: each node process appends the ids it is told
are closed (``session_closed``) to ``<directory>/closed-<pid>.log``, one per line,
so a test can see which node's plugins were told. This module holds no tests.
"""

from __future__ import annotations

import os
from pathlib import Path

from proxy import Plugin

__all__ = ["ClosedLog", "closed_ids"]


class ClosedLog(Plugin):
    """Records every ``session_closed`` call of this process (``directory``: a path)."""

    name = "closed_log"

    def __init__(self, directory: str) -> None:
        self._path = Path(directory) / f"closed-{os.getpid()}.log"

    async def session_closed(self, session_id: str) -> None:
        # A few bytes per close, in a test: a blocking append is fine here.
        with self._path.open("a") as fh:
            fh.write(session_id + "\n")


def closed_ids(directory: Path, pid: int) -> list[str]:
    """The ids the process ``pid`` was told are closed, in order."""
    path = directory / f"closed-{pid}.log"
    return path.read_text().splitlines() if path.exists() else []

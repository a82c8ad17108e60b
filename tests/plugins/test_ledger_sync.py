"""The ledger's ``sync`` option (issue 20, item 10): ``"commit"`` writes every commit in
its own fsynced transaction, so a ``kill -9`` right after the commits finished loses
none; the default (``"debounced"``) loses what the debounce had not written yet.

A real ``python -m proxy serve`` child with the ledger, in front of the emulator;
the commits are known finished from ``context_proxy_commits_total{event="finished"}``
(the client has its answer before the commit hooks run), then SIGKILL, then the
SQLite file is read.
"""

from __future__ import annotations

import asyncio
import os
import signal
import sqlite3
from pathlib import Path

import aiohttp
import pytest

from plugins.ledger import LedgerPlugin
from proxy.testing import make_record, proxy_process, start_emulator
from tests.support.e2e import finished_commits

N_ANSWERS = 25
BOUND_S = 20.0


def _saved_requests(db: Path, sid: str) -> int:
    if not db.exists():
        return 0
    conn = sqlite3.connect(db)
    try:
        row = conn.execute("SELECT requests FROM sessions WHERE session_id = ?", (sid,)).fetchone()
    finally:
        conn.close()
    return 0 if row is None else int(row[0])


@pytest.mark.parametrize(("sync", "saved"), [("commit", N_ANSWERS), ("debounced", 0)])
async def test_kill_9_right_after_the_commits_finished(
    tmp_path: Path, sync: str, saved: int
) -> None:
    """``commit``: all N on disk. ``debounced`` (the default, here with a debounce no
    test outlives): none of them, the documented cost of a kill -9."""
    db = tmp_path / "ledger.db"
    config = tmp_path / "proxy.toml"
    config.write_text(
        f'plugins = ["ledger"]\n[plugin.ledger]\npath = "{db}"\nsync = "{sync}"\ndebounce = 3600\n'
    )
    emulator = await start_emulator()
    try:
        async with (
            proxy_process("--upstream-openai", emulator.url, config=config) as child,
            aiohttp.ClientSession() as http,
        ):
            for i in range(N_ANSWERS):
                body = {"model": "m", "messages": [{"role": "user", "content": f"turn {i}"}]}
                async with http.post(
                    f"{child.url}/v1/chat/completions",
                    json=body,
                    headers={"x-session-id": "kill9"},
                ) as resp:
                    assert resp.status == 200
                    await resp.read()
            async with asyncio.timeout(BOUND_S):
                # A child process offers nothing to wait on: poll its metrics.
                while await finished_commits(http, child.url) < N_ANSWERS:  # noqa: ASYNC110
                    await asyncio.sleep(0.01)
            os.kill(child.pid, signal.SIGKILL)
            status = await child.stop()
            # Killed, not stopped: no shutdown ran (it would write every pending change).
            # 255 is asyncio's child watcher finding the pid already reaped (seen once
            # in a full run), not an exit of the proxy's own.
            assert status in (-signal.SIGKILL, 255), status
            assert "context-proxy stopped" not in child.output
    finally:
        await emulator.close()
    assert _saved_requests(db, "kill9") == saved


async def test_commit_mode_writes_each_commit_identical_retries_included(tmp_path: Path) -> None:
    ledger = LedgerPlugin(path=str(tmp_path / "l.db"), sync="commit", debounce=3600)
    await ledger.startup()
    try:
        record = make_record(session_id="s", wire_digest="d1")
        for _ in range(3):  # the same digest: identical retries after the first
            await ledger.commit(record)
        assert ledger.writes == 3
        assert not ledger.flush_scheduled
        assert _saved_requests(tmp_path / "l.db", "s") == 3
    finally:
        await ledger.shutdown()
    with pytest.raises(ValueError, match="sync"):
        LedgerPlugin(sync="always")


def test_the_sync_benchmark_prints_both_modes(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from benchmarks.ledger_sync import main

    assert main(["--commits", "40", "--sessions", "4", "--dir", str(tmp_path)]) == 0
    rows = [line.split() for line in capsys.readouterr().out.splitlines()[1:]]
    assert [(row[0], row[1], row[-1]) for row in rows] == [
        ("debounced", "40", "1"),
        ("commit", "40", "40"),
    ]

"""What the ledger's ``sync = "commit"`` costs against the default debounced writes.

``python -m benchmarks.ledger_sync [--commits N] [--sessions S] [--dir DIR]`` drives
the ledger plugin's commit hook directly (no proxy, no network): ``N`` commits
spread over ``S`` sessions, one commit per session at a time as the proxy's session
lock allows, all sessions at once. Each commit is a new digest (a gate change, the
case that must reach the disk). For each mode it prints commits per second (wall),
CPU per commit (process CPU, the SQLite worker thread included, microseconds) and
the transactions written; debounced includes its final flush. The file lives in
``DIR`` (default: a temporary directory), so the fsync is that disk's.
"""

from __future__ import annotations

import argparse
import asyncio
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from plugins.ledger import LedgerPlugin
from proxy.testing import make_record

__all__ = ["SyncResult", "main", "measure"]


@dataclass(frozen=True, slots=True)
class SyncResult:
    """One mode's run: commits per second (wall), CPU microseconds per commit, transactions."""

    mode: str
    commits: int
    commits_per_s: float
    cpu_us_per_commit: float
    transactions: int


async def measure(mode: str, commits: int, sessions: int, directory: Path) -> SyncResult:
    """Run ``commits`` commits over ``sessions`` sessions with ``sync = mode``.

    Raises:
        ValueError: ``mode`` is not a ``sync`` value, or a count is < 1.
    """
    if commits < 1 or sessions < 1:
        raise ValueError("commits and sessions must be >= 1")
    path = directory / f"ledger-{mode}.db"
    for suffix in ("", "-wal", "-shm"):  # a fresh file: set-up, before anything is timed
        Path(f"{path}{suffix}").unlink(missing_ok=True)  # noqa: ASYNC240
    ledger = LedgerPlugin(path=str(path), sync=mode)
    await ledger.startup()
    per_session = -(-commits // sessions)

    async def session(index: int) -> None:
        for n in range(per_session):  # bounded
            if index * per_session + n >= commits:
                return
            record = make_record(session_id=f"bench-{index}", wire_digest=f"d-{index}-{n}")
            await ledger.commit(record)

    cpu, wall = time.process_time(), time.perf_counter()
    try:
        await asyncio.gather(*(session(i) for i in range(sessions)))
        await ledger.flush()  # debounced: what is still pending, for a fair total
        wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
        transactions = ledger.writes
    finally:
        await ledger.shutdown()
    return SyncResult(
        mode=mode,
        commits=commits,
        commits_per_s=commits / wall,
        cpu_us_per_commit=cpu / commits * 1e6,
        transactions=transactions,
    )


def main(argv: list[str] | None = None) -> int:
    """Print one row per mode; exit status 0."""
    parser = argparse.ArgumentParser(prog="python -m benchmarks.ledger_sync", description=__doc__)
    parser.add_argument("--commits", type=int, default=5000, help="commits per mode [5000]")
    parser.add_argument("--sessions", type=int, default=8, help="sessions committing at once [8]")
    parser.add_argument("--dir", type=Path, help="where the SQLite files go [a temporary dir]")
    args = parser.parse_args(argv)

    async def run(directory: Path) -> list[SyncResult]:
        return [
            await measure(mode, args.commits, args.sessions, directory)
            for mode in ("debounced", "commit")
        ]

    if args.dir is not None:
        args.dir.mkdir(parents=True, exist_ok=True)
        results = asyncio.run(run(args.dir))
    else:
        with tempfile.TemporaryDirectory(prefix="ledger-sync-") as scratch:
            results = asyncio.run(run(Path(scratch)))
    head = ("sync", "commits", "commits/s", "CPU us/commit", "transactions")
    print(f"{head[0]:<10} {head[1]:>8} {head[2]:>10} {head[3]:>14} {head[4]:>13}")
    for r in results:
        print(
            f"{r.mode:<10} {r.commits:>8} {r.commits_per_s:>10.0f} "
            f"{r.cpu_us_per_commit:>14.0f} {r.transactions:>13}"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

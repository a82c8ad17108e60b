"""One session's commit rate, one node against cluster mode, and a hung Redis.

``python -m benchmarks.commit_rate``: a redis-server on a free loopback port,
first the commit path alone (``--requests`` records handed to the commit tracker
of one session at once, timed until each is booked, in cluster mode until the
ledger's gate in Redis holds it: ``commit_path_ratio``, target >= 0.8), then
the emulator and a proxy in this process with the ledger, usage and a counting
plugin, run twice in one go: **single** (no ``redis_url``: the ledger in SQLite)
and **cluster** (``redis_url`` set: admission and the ledger's gate in Redis).
Each run sends ``--requests`` requests for one session from ``--concurrency``
workers and measures the commits booked per second (first request to last
commit booked) and the answers per second (first request to last answer); the
figures that matter are the ratio cluster / single of commits, measured in the
same run (target >= 0.8), and commits per second over answers per second in
each mode (1.0: the commits keep up with the answers, nothing queues). Cluster
mode's answers themselves pay the admission round trip.

``--hang S`` then runs cluster mode again with Redis stopped (SIGSTOP) for ``S``
seconds under ``--sessions`` sessions sending ``--rate`` requests/s each, and
reports commits lost (for the counting plugin and in the ledger's Redis
counters), peak pending commits and held sessions, RSS before and after, and
the time from SIGCONT until the ledger had applied everything it held.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import resource
import shutil
import signal
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import aiohttp

from plugins.ledger import LedgerPlugin
from plugins.usage import UsagePlugin
from proxy import ExchangeRecord, Plugin
from proxy._cluster import RedisStore
from proxy.testing import make_record, proxy_with_emulator

from ._cluster import start_redis
from ._harness import free_port

__all__ = ["main"]


class _Tally(Plugin):
    """Counts every commit (a plugin that needs no Redis)."""

    name = "tally"

    def __init__(self) -> None:
        self.booked = 0

    async def commit(self, record: ExchangeRecord) -> None:
        self.booked += 1


def _body(sid: str, n: int) -> bytes:
    return json.dumps(
        {"model": "m", "messages": [{"role": "user", "content": f"{sid} turn {n}"}]}
    ).encode()


def _rss_mib() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


async def _rate(
    redis_url: str | None, requests: int, concurrency: int, tmp: Path
) -> tuple[float, float]:
    """Commits booked per second for one session, and answers per second."""
    ledger = LedgerPlugin(
        path=str(tmp / f"ledger-{bool(redis_url)}.db"), redis_url=redis_url, debounce=0.5
    )
    tally = _Tally()
    extra: dict[str, Any] = {"redis_url": redis_url} if redis_url else {}
    async with (
        proxy_with_emulator(plugins=[ledger, UsagePlugin(), tally], **extra) as h,
        aiohttp.ClientSession() as http,
    ):
        counter = iter(range(requests))

        async def worker() -> None:
            for n in counter:  # bounded: the shared iterator
                async with http.post(
                    h.url + "/v1/chat/completions",
                    data=_body("rate", n),
                    headers={"x-session-id": "rate"},
                ) as resp:
                    await resp.read()
                    assert resp.status == 200, resp.status  # none refused, none lost

        began = time.monotonic()
        await asyncio.gather(*(worker() for _ in range(concurrency)))
        answered = time.monotonic() - began
        await h.settle(within=600.0)
        elapsed = time.monotonic() - began
        assert tally.booked == requests, (tally.booked, requests)
        return requests / elapsed, requests / answered


async def _commit_path(redis_url: str | None, commits: int, tmp: Path) -> float:
    """Commits booked per second for one session, the request path left out: ``commits``
    records handed to the proxy's commit tracker at once (the session lock, the
    ledger, usage and a counting plugin), timed until every one is booked."""
    ledger = LedgerPlugin(
        path=str(tmp / f"path-{bool(redis_url)}.db"), redis_url=redis_url, debounce=0.5
    )
    tally = _Tally()
    extra: dict[str, Any] = {"redis_url": redis_url} if redis_url else {}
    async with proxy_with_emulator(plugins=[ledger, UsagePlugin(), tally], **extra) as h:
        records = [
            make_record(session_id="path", exchange_id=f"x{n}", wire_digest=f"{n:032x}")
            for n in range(commits)
        ]
        began = time.monotonic()
        for record in records:
            h.state.commits.start(record)
        await h.settle(within=600.0)
        await ledger.flush()  # cluster mode: until Redis holds every one
        elapsed = time.monotonic() - began
        assert tally.booked == commits, (tally.booked, commits)
        return commits / elapsed


async def _hang(
    redis: Any, redis_url: str, hang: float, sessions: int, rate: float, redis_timeout: float
) -> dict[str, Any]:
    ledger = LedgerPlugin(path=":memory:", redis_url=redis_url, redis_timeout=redis_timeout)
    tally = _Tally()
    sids = [f"hang-{n}" for n in range(sessions)]
    sent = dict.fromkeys(sids, 0)
    peak = {"pending": 0, "held_sessions": 0}
    async with (
        proxy_with_emulator(
            plugins=[ledger, UsagePlugin(), tally], redis_url=redis_url, redis_timeout=redis_timeout
        ) as h,
        aiohttp.ClientSession() as http,
    ):

        async def load(sid: str, seconds: float) -> None:
            end = time.monotonic() + seconds
            while time.monotonic() < end:  # bounded by the clock
                n = sent[sid]
                async with http.post(
                    h.url + "/v1/chat/completions",
                    data=_body(sid, n),
                    headers={"x-session-id": sid},
                ) as resp:
                    await resp.read()
                sent[sid] = n + 1
                peak["pending"] = max(peak["pending"], len(h.state.commits.pending))
                peak["held_sessions"] = max(peak["held_sessions"], ledger.gate_sessions_held)
                await asyncio.sleep(1.0 / rate)

        await asyncio.gather(*(load(sid, 2.0) for sid in sids))
        rss_before = _rss_mib()
        os.kill(redis.pid, signal.SIGSTOP)
        try:
            await asyncio.gather(*(load(sid, hang) for sid in sids))
            held = ledger.gate_held
            rss_hung = _rss_mib()
        finally:
            resumed = time.monotonic()
            os.kill(redis.pid, signal.SIGCONT)
        for _ in range(60_000):  # bounded
            if ledger.gate_held == 0:
                break
            await asyncio.sleep(0.001)
        recovery = time.monotonic() - resumed
        await asyncio.gather(*(load(sid, 2.0) for sid in sids))
        await h.settle(within=120.0)
        await ledger.flush()
        commits = h.state.commits
        store = RedisStore(redis_url, timeout=2.0, max_connections=2)
        try:
            in_redis = {sid: int((await store.ledger_state(sid))["requests"]) for sid in sids}
        finally:
            await store.close()
        total = sum(sent.values())
        return {
            "hang_s": hang,
            "sessions": sessions,
            "rate_per_session": rate,
            "redis_timeout": redis_timeout,
            "commits": total,
            "held_at_sigcont": held,
            "lost_tally": total - tally.booked,
            "lost_ledger": total - sum(in_redis.values()),
            "timed_out": commits.count("timed_out"),
            "failed": commits.count("failed"),
            "peak_pending": peak["pending"],
            "peak_held_sessions": peak["held_sessions"],
            "rss_mib": [round(rss_before, 1), round(rss_hung, 1), round(_rss_mib(), 1)],
            "recovery_s": round(recovery, 3),
        }


async def _main(args: argparse.Namespace) -> dict[str, Any]:
    binary = shutil.which("redis-server") or "/usr/bin/redis-server"
    with tempfile.TemporaryDirectory() as tmpdir:
        tmp = Path(tmpdir)
        port = free_port()
        redis = start_redis(binary, port, tmp / "redis")
        url = f"redis://127.0.0.1:{port}/0"
        try:
            # Single and cluster alternate, round after round, and each figure is the
            # median of its rounds: this machine's speed drifts by tens of percent
            # within a minute, and a ratio of neighbours cancels most of it.
            rounds = []
            for _ in range(args.rounds):
                rounds.append(
                    (
                        await _rate(None, args.requests, args.concurrency, tmp),
                        await _rate(url, args.requests, args.concurrency, tmp),
                    )
                )
            single = statistics.median(s for (s, _), _c in rounds)
            single_answers = statistics.median(a for (_, a), _c in rounds)
            cluster = statistics.median(c for _s, (c, _) in rounds)
            cluster_answers = statistics.median(a for _s, (_, a) in rounds)
            round_ratios = [round(c / s, 3) for (s, _), (c, _) in rounds]
            paths = []
            for _ in range(args.rounds):
                paths.append(
                    (
                        await _commit_path(None, args.requests, tmp),
                        await _commit_path(url, args.requests, tmp),
                    )
                )
            path_single = statistics.median(s for s, _ in paths)
            path_cluster = statistics.median(c for _, c in paths)
            path_ratios = [round(c / s, 3) for s, c in paths]
            out: dict[str, Any] = {
                "commit_path_single_per_s": round(path_single, 1),
                "commit_path_cluster_per_s": round(path_cluster, 1),
                "commit_path_ratio": round(statistics.median(path_ratios), 3),
                "commit_path_round_ratios": path_ratios,
                "single_commits_per_s": round(single, 1),
                "single_answers_per_s": round(single_answers, 1),
                "cluster_commits_per_s": round(cluster, 1),
                "cluster_answers_per_s": round(cluster_answers, 1),
                # The median of the rounds' own ratios (cluster / single, neighbours).
                "ratio": round(statistics.median(round_ratios), 3),
                "round_ratios": round_ratios,
                # Commits keep up with answers (1.0: none queued behind the last answer).
                "single_commits_per_answer_rate": round(single / single_answers, 3),
                "cluster_commits_per_answer_rate": round(cluster / cluster_answers, 3),
            }
            if args.hang:
                out["hang"] = await _hang(
                    redis, url, args.hang, args.sessions, args.rate, args.redis_timeout
                )
        finally:
            os.kill(redis.pid, signal.SIGCONT)
            redis.terminate()
            redis.wait(10)
    return out


def main(argv: list[str] | None = None) -> int:
    """Run and print the figures as JSON; exit status 0."""
    parser = argparse.ArgumentParser(prog="python -m benchmarks.commit_rate")
    parser.add_argument("--requests", type=int, default=3000)
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument(
        "--rounds", type=int, default=5, help="single/cluster pairs, alternating (median)"
    )
    parser.add_argument("--hang", type=float, default=0.0, help="seconds of SIGSTOP (0: none)")
    parser.add_argument("--sessions", type=int, default=4)
    parser.add_argument("--rate", type=float, default=5.0, help="requests/s per session")
    parser.add_argument("--redis-timeout", type=float, default=0.5)
    args = parser.parse_args(argv)
    resource.setrlimit(resource.RLIMIT_NOFILE, resource.getrlimit(resource.RLIMIT_NOFILE))
    print(json.dumps(asyncio.run(_main(args)), indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

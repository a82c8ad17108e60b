"""``context-proxy bench cluster``: one node against three behind nginx, and the
cost of the Redis admission round trip.

Everything runs on this machine, each server its own process: the emulator,
a redis-server on a free loopback port, and

* **single**: one node without Redis (the embedded default);
* **single+redis**: one node with ``redis_url`` (admission and deregistration
  through Redis, the ledger off);
* **three+nginx**: three nodes with Redis behind nginx configured as in
  docs/cluster.md (consistent hash of the session headers).

Figures:

* **admission round trip**: the admission script (tombstone check + in-flight
  registration) timed from this process against the same redis-server,
  ``--rtt`` calls one after another; the median is the latency cluster mode adds
  to a request's start. Target: <= 0.3 ms on loopback.
* **added latency**: median time to the end of a small streamed answer,
  ``--requests`` sequential requests per target (interleaved), minus single's.
* **throughput**: requests per second with ``--concurrency`` workers sending
  ``--concurrent-requests`` requests over ``--sessions`` session ids.

Outputs in ``--out``: ``cluster.json``, ``cluster.md``. Needs redis-server and
nginx on PATH (or /usr/sbin).
"""

from __future__ import annotations

import asyncio
import dataclasses
import shutil
import statistics
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Final

import aiohttp
import click

from proxy._cluster import RedisStore

from . import _report as rpt
from ._cluster import nginx_config, start_redis
from ._harness import (
    CONTEXT_SETTINGS,
    HOST,
    Service,
    free_port,
    raise_nofile_limit,
    run_command,
    start_emulator,
    start_proxy,
)
from ._nginx import nginx_argv

__all__ = ["ADMISSION_TARGET", "Options", "command", "main", "summary_table"]

#: Seconds: the median admission round trip cluster mode may add on loopback.
ADMISSION_TARGET: Final = 0.0003
_BODY: Final = {
    "model": "m",
    "stream": True,
    "messages": [{"role": "user", "content": "benchmark " * 50}],
}
_WARMUP: Final = 20


@dataclasses.dataclass(frozen=True, slots=True)
class Options:
    """The command-line options of ``context-proxy bench cluster`` (see :func:`command`)."""

    rtt: int
    requests: int
    concurrency: int
    concurrent_requests: int
    sessions: int
    out: Path
    quiet: bool


@click.command(
    context_settings=CONTEXT_SETTINGS,
    help="One node against three behind nginx; the Redis admission round trip.",
)
@click.option(
    "--rtt", type=click.IntRange(min=1), default=2000, help="admission calls timed [2000]"
)
@click.option(
    "--requests",
    type=click.IntRange(min=1),
    default=300,
    help="sequential requests per target [300]",
)
@click.option(
    "--concurrency", type=click.IntRange(min=1), default=32, help="concurrent workers [32]"
)
@click.option(
    "--concurrent-requests",
    type=click.IntRange(min=1),
    default=2000,
    help="requests per throughput run [2000]",
)
@click.option("--sessions", type=click.IntRange(min=1), default=64, help="session ids used [64]")
@click.option(
    "--out", type=click.Path(path_type=Path), default=Path("bench-results"), help="output dir"
)
@click.option("--quiet", is_flag=True, help="no terminal tables")
def command(**options: Any) -> int:
    """``context-proxy bench cluster``."""
    return _run(Options(**options))


def _binary(name: str) -> str:
    found = shutil.which(name) or shutil.which(name, path="/usr/sbin:/usr/local/sbin")
    if found is None:
        raise RuntimeError(f"{name} is not installed")
    return found


async def _admission_rtt(url: str, calls: int) -> list[float]:
    """Seconds per admission script call (each followed, untimed, by its deregistration)."""
    store = RedisStore(url, timeout=1.0, max_connections=4)
    samples: list[float] = []
    try:
        for n in range(calls + _WARMUP):
            sid = f"bench-{n % 64}"
            began = time.perf_counter()
            await store.admit(sid, f"bench|0|ex-{n}", ttl=15.0)
            elapsed = time.perf_counter() - began
            await store.deregister(sid, f"bench|0|ex-{n}", cancelled=False)
            if n >= _WARMUP:
                samples.append(elapsed)
    finally:
        await store.close()
    return samples


async def _one(http: aiohttp.ClientSession, url: str, sid: str) -> float:
    began = time.perf_counter()
    async with http.post(
        f"{url}/v1/chat/completions", json=_BODY, headers={"x-session-id": sid}
    ) as resp:
        await resp.read()
        if resp.status != 200:
            raise RuntimeError(f"{url}: HTTP {resp.status}")
    return time.perf_counter() - began


async def _sequential(
    http: aiohttp.ClientSession, targets: dict[str, str], count: int
) -> dict[str, list[float]]:
    times: dict[str, list[float]] = {name: [] for name in targets}
    for n in range(count + _WARMUP):
        for name, url in targets.items():  # interleaved: drift hits every target alike
            elapsed = await _one(http, url, f"seq-{n % 16}")
            if n >= _WARMUP:
                times[name].append(elapsed)
    return times


async def _throughput(url: str, workers: int, total: int, sessions: int) -> float:
    """Requests per second."""
    connector = aiohttp.TCPConnector(limit=workers)
    async with aiohttp.ClientSession(connector=connector) as http:
        began = time.perf_counter()

        async def worker(w: int) -> None:
            for n in range(w, total, workers):
                await _one(http, url, f"tp-{n % sessions}")

        await asyncio.gather(*(worker(w) for w in range(workers)))
        return total / (time.perf_counter() - began)


async def _collect(args: Options, log_dir: Path) -> dict[str, Any]:
    redis_bin, nginx_bin = _binary("redis-server"), _binary("nginx")
    services: list[Service] = []
    redis_proc = nginx_proc = None
    try:
        redis_port = free_port()
        redis_proc = start_redis(redis_bin, redis_port, log_dir / "redis")
        redis_url = f"redis://{HOST}:{redis_port}/0"
        emulator = start_emulator(log_dir)
        services.append(emulator)

        def node(name: str, redis: bool) -> Service:
            env = {"CONTEXT_PROXY_NODE_ID": name}
            if redis:
                env["CONTEXT_PROXY_REDIS_URL"] = redis_url
            service = start_proxy(emulator.url, log_dir, plugins=(), env=env, name=name)
            services.append(service)
            return service

        single = node("single", redis=False)
        single_redis = node("single-redis", redis=True)
        three = [node(f"node-{n}", redis=True) for n in range(3)]
        async with aiohttp.ClientSession() as http:
            for service in services:
                await service.wait_ready(http)
        nginx_port = free_port()
        nginx_dir = log_dir / "nginx"
        nginx_dir.mkdir(parents=True, exist_ok=True)
        ports = [int(s.url.rsplit(":", 1)[1]) for s in three]
        (nginx_dir / "nginx.conf").write_text(nginx_config(nginx_port, ports))
        nginx_proc = await asyncio.create_subprocess_exec(
            *nginx_argv(nginx_bin, nginx_dir, nginx_dir / "nginx.conf"),
            stdout=asyncio.subprocess.DEVNULL,
            stderr=asyncio.subprocess.DEVNULL,
        )
        nginx_url = f"http://{HOST}:{nginx_port}"
        async with aiohttp.ClientSession() as http:
            for _ in range(200):  # bounded: 10 s
                try:
                    await _one(http, nginx_url, "probe")
                    break
                except (aiohttp.ClientError, OSError, RuntimeError):
                    await asyncio.sleep(0.05)
            else:
                raise RuntimeError("nginx did not start")
            rtt = await _admission_rtt(redis_url, args.rtt)
            targets = {
                "single": single.url,
                "single+redis": single_redis.url,
                "three+nginx": nginx_url,
            }
            sequential = await _sequential(http, targets, args.requests)
        throughput = {
            name: await _throughput(url, args.concurrency, args.concurrent_requests, args.sessions)
            for name, url in (("single", single.url), ("three+nginx", nginx_url))
        }
        return {"admission_rtt_s": rtt, "sequential_s": sequential, "rps": throughput}
    finally:
        if nginx_proc is not None and nginx_proc.returncode is None:
            nginx_proc.terminate()
            await nginx_proc.wait()
        for service in reversed(services):
            await service.stop()
        if redis_proc is not None:
            redis_proc.terminate()
            redis_proc.wait(10)


def _ms(seconds: float) -> str:
    return f"{seconds * 1000:.3f} ms"


def main(argv: Sequence[str]) -> int:
    """Entry point of ``context-proxy bench cluster`` and ``python -m benchmarks.cluster``.

    Returns 0 when the run completed (a missed target is reported, not an
    error), 1 when a server failed, 2 for bad options (click's usage error).
    """
    return run_command(command, "context-proxy bench cluster", argv)


def summary_table(data: dict[str, Any], args: Options) -> rpt.Table:
    """The terminal and Markdown table of one run's ``data`` (what :func:`_collect` returns)."""
    rtt = statistics.median(data["admission_rtt_s"])
    medians = {name: statistics.median(v) for name, v in data["sequential_s"].items()}
    table = rpt.Table(
        title="Cluster mode on one machine",
        columns=["figure", "single", "single+redis", "three+nginx"],
    )
    table.add(
        "admission round trip, median", "-", f"{_ms(rtt)} {rpt.verdict(rtt, ADMISSION_TARGET)}", "-"
    )
    table.add(
        "request, median", *(_ms(medians[n]) for n in ("single", "single+redis", "three+nginx"))
    )
    table.add(
        "added vs single, median",
        "-",
        _ms(medians["single+redis"] - medians["single"]),
        _ms(medians["three+nginx"] - medians["single"]),
    )
    rps = data["rps"]
    table.add("requests/s", f"{rps['single']:.0f}", "-", f"{rps['three+nginx']:.0f}")
    table.notes.append(
        f"admission target <= {_ms(ADMISSION_TARGET)}; {args.rtt} calls, "
        f"{args.requests} sequential requests per target, {args.concurrency} workers x "
        f"{args.concurrent_requests} requests for requests/s"
    )
    return table


def _run(args: Options) -> int:
    raise_nofile_limit()
    reporter = rpt.Reporter(quiet=args.quiet)
    out: Path = args.out
    log_dir = out / "logs" / "cluster"
    if log_dir.exists():
        shutil.rmtree(log_dir)
    try:
        data = asyncio.run(_collect(args, log_dir))
    except (RuntimeError, OSError, TimeoutError) as exc:
        reporter.note(f"benchmark failed: {exc}")
        return 1
    table = summary_table(data, args)
    data["summary"] = {
        "admission_rtt_median_s": statistics.median(data["admission_rtt_s"]),
        "admission_target_s": ADMISSION_TARGET,
        "request_median_s": {
            name: statistics.median(v) for name, v in data["sequential_s"].items()
        },
        "rps": data["rps"],
    }
    rpt.write_json(out / "cluster.json", data)
    rpt.write_markdown(out / "cluster.md", [table])
    if not args.quiet:
        reporter.print_table(table)
    return 0


if __name__ == "__main__":  # pragma: no cover
    import sys

    sys.exit(main(sys.argv[1:]))

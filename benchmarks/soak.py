"""``context-proxy bench soak``: many streamed requests, clients hanging up at random phases.

One proxy process (with the ``fold`` and ``usage`` plugins, session ids on every
request) in front of the emulator takes ``-n`` (default 10,000) streamed requests
of ``--size`` KiB (default 200) over the three protocols in turn, ``-c`` (default
50) at a time. A ``--hangup`` fraction (default 0.2) of the clients hang up at a
random phase, in equal shares: mid-body (half the body sent), waiting for the
response headers (whole body sent, then closed), mid-stream (after the first
bytes of the answer) and right after the last byte (the terminal event read; of a
chunked answer, not its end). The others read their answer to the end, chunked or
of a declared length (a small answer that came whole leaves with its length).

Every ``--every`` (default 1,000) requests it prints the proxy's RSS and open file
descriptors (idle, RSS as a median over 0.3 s). At the end: the RSS slope after
warm-up (least squares over the samples after the first ``--warmup`` requests,
KiB per 1,000 requests), exchanges left in ``/admin/exchanges``, open file
descriptors at the end over the count at the start (after at most 20 s for the
upstream pool to close idle connections; its remaining keep-alive connections and
this benchmark's own admin connection are not counted as leaked), and commits booked
(``context_proxy_commits_total{event="finished"}``) against exchanges finished
(the sum of ``context_proxy_requests_total``: each must be committed exactly once,
a client gone mid-body too). Also reported: exchanges whose body was read
(``context_proxy_exchanges_read_total``). Targets: slope ≤ 1 KiB per 1,000
requests, 0 exchanges and 0 fds leaked, commits booked = exchanges finished.

Output: ``soak.json`` in ``--out``; the exit status is 0 when the run completed
(targets are reported, not enforced), 1 when a server failed, 2 for bad options.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import datetime
import os
import random
import re
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Final
from urllib.parse import urlsplit

import aiohttp
import click
import psutil

from . import _report as rpt
from ._harness import (
    CONTEXT_SETTINGS,
    admin_exchanges,
    open_client_and_emulator,
    raise_nofile_limit,
    run_collect,
    run_command,
    start_proxy,
    wait_proxy_idle,
)
from ._workload import BenchProtocol, Corpus, build_body

__all__ = ["FATES", "Options", "command", "main", "rss_slope"]

#: What a client does: read to the end, or hang up at one of four phases.
FATES: Final = ("complete", "mid_body", "waiting_headers", "mid_stream", "after_last_byte")
_IO_TIMEOUT: Final = 60.0  # seconds for any one client step; a longer one is a failure
_FD_SETTLE_S: Final = 20.0  # seconds the idle proxy gets to close pooled upstream connections
_SESSIONS: Final = 64  # distinct session ids, so commits share session locks
_METRIC: Final = re.compile(r"^(?P<name>[a-z_]+)(?:\{(?P<labels>[^}]*)\})?\s+(?P<value>\S+)$", re.M)

#: Targets (README's soak figures).
SLOPE_TARGET_KIB: Final = 1.0


@dataclasses.dataclass(frozen=True, slots=True)
class Options:
    """The command-line options of ``context-proxy bench soak`` (see :func:`command`)."""

    requests: int
    concurrency: int
    size: float  # KiB per request body
    hangup: float  # fraction of clients that hang up, in [0, 1]
    every: int
    warmup: int | None  # None: 2 x every
    seed: int
    out: Path
    quiet: bool


@click.command(
    context_settings=CONTEXT_SETTINGS,
    help="Many streamed requests with random hang-ups: leaks and exactly-once commits.",
)
@click.option(
    "-n", "--requests", type=click.IntRange(min=1), default=10_000, help="requests [10000]"
)
@click.option("-c", "--concurrency", type=click.IntRange(min=1), default=50, help="at once [50]")
@click.option(
    "--size",
    type=click.FloatRange(min=0, min_open=True),
    default=200.0,
    help="KiB per request body [200]",
)
@click.option(
    "--hangup",
    type=click.FloatRange(0, 1),
    default=0.2,
    help="fraction of clients that hang up [0.2]",
)
@click.option(
    "--every", type=click.IntRange(min=1), default=1000, help="sample every N requests [1000]"
)
@click.option(
    "--warmup",
    type=click.IntRange(min=0),
    default=None,
    help="requests before the slope counts [2 x every]",
)
@click.option("--seed", type=int, default=1, help="random seed [1]")
@click.option(
    "--out", type=click.Path(path_type=Path), default=Path("bench-results"), help="output dir"
)
@click.option("--quiet", is_flag=True, help="no per-sample lines")
@click.pass_context
def command(ctx: click.Context, /, **options: Any) -> int:
    """``context-proxy bench soak``."""
    return _run(Options(**options), list(ctx.obj or []))


# ------------------------------------------------------------------------- process


def _rss(pid: int) -> int:
    """Resident set size of ``pid`` in bytes (``VmRSS``)."""
    with open(f"/proc/{pid}/status", encoding="ascii") as status:
        for line in status:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    return 0


def _fds(pid: int) -> int:
    """Open file descriptors of ``pid``."""
    return len(os.listdir(f"/proc/{pid}/fd"))


def _sockets(pid: int, proxy_url: str, upstream_url: str) -> dict[str, int]:
    """The proxy's open TCP sockets by kind and state, e.g. ``{"upstream ESTABLISHED": 40}``
    (``client``: accepted from clients; ``listen``; ``upstream``: to the emulator)."""
    listen_port = urlsplit(proxy_url).port
    upstream_port = urlsplit(upstream_url).port
    kinds: dict[str, int] = {}
    for conn in psutil.Process(pid).net_connections(kind="tcp"):
        if conn.status == psutil.CONN_LISTEN:
            kind = "listen"
        elif conn.raddr and conn.raddr.port == upstream_port:
            kind = "upstream"
        elif conn.laddr and conn.laddr.port == listen_port:
            kind = "client"
        else:
            kind = "other"
        key = f"{kind} {conn.status}"
        kinds[key] = kinds.get(key, 0) + 1
    return kinds


def _expected(sockets: dict[str, int]) -> int:
    """Sockets open at the end that are no leak: pooled upstream, our own admin client."""
    return sockets.get("upstream ESTABLISHED", 0) + min(1, sockets.get("client ESTABLISHED", 0))


def rss_slope(points: Sequence[tuple[int, int]]) -> float:
    """Least-squares slope of ``(requests, rss_bytes)`` points, in KiB per 1,000 requests.

    ``nan`` with fewer than two points or no spread in ``requests``.
    """
    if len(points) < 2:
        return float("nan")
    xs = [float(x) for x, _ in points]
    ys = [float(y) for _, y in points]
    mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
    var = sum((x - mx) ** 2 for x in xs)
    if var == 0:
        return float("nan")
    slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True)) / var
    return slope * 1000 / 1024


async def _metrics(session: aiohttp.ClientSession, url: str) -> dict[str, float]:
    """``GET /metrics`` as ``{"name{labels}": value}``."""
    async with session.get(url + "/metrics") as resp:
        resp.raise_for_status()
        text = await resp.text()
    out: dict[str, float] = {}
    for match in _METRIC.finditer(text):
        labels = match["labels"]
        out[f"{match['name']}{{{labels}}}" if labels else match["name"]] = float(match["value"])
    return out


async def _median_rss(pid: int, samples: int = 15, every: float = 0.02) -> int:
    """Median RSS of ``pid`` over ``samples`` reads ``every`` seconds apart, bytes."""
    values = []
    for _ in range(samples):
        values.append(_rss(pid))
        await asyncio.sleep(every)
    return sorted(values)[len(values) // 2]


# -------------------------------------------------------------------------- client


async def _read_head(reader: asyncio.StreamReader) -> tuple[int, bool, int | None]:
    """The answer's status, whether its body is chunked, and its Content-Length (or None)."""
    head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), _IO_TIMEOUT)
    status = int(head.split(b" ", 2)[1])
    lower = head.lower()
    at = lower.find(b"\r\ncontent-length:")
    length = None
    if at >= 0:
        length = int(lower[at + len(b"\r\ncontent-length:") : lower.index(b"\r\n", at + 2)])
    return status, b"transfer-encoding: chunked" in lower, length


async def _read_body(
    reader: asyncio.StreamReader,
    chunked: bool,
    length: int | None,
    terminal: bytes,
    *,
    stop: str,
) -> bool:
    """Read the answer (chunked, ``length`` bytes, or to the connection's end); ``stop`` =
    ``end`` (to the end), ``first`` (first bytes) or ``terminal`` (just past the terminal
    event). Whether the terminal event came."""
    seen = b""
    while True:
        if not chunked and length is not None:
            if length == 0:
                return terminal in seen
            data = await asyncio.wait_for(reader.read(min(length, 65536)), _IO_TIMEOUT)
            if not data:
                return False  # the connection ended before the declared length
            length -= len(data)
        elif chunked:
            size = int((await asyncio.wait_for(reader.readuntil(b"\r\n"), _IO_TIMEOUT))[:-2], 16)
            if size == 0:
                await asyncio.wait_for(reader.readuntil(b"\r\n"), _IO_TIMEOUT)
                return terminal in seen
            data = await asyncio.wait_for(reader.readexactly(size + 2), _IO_TIMEOUT)
            data = data[:-2]
        else:
            data = await asyncio.wait_for(reader.read(65536), _IO_TIMEOUT)
            if not data:
                return terminal in seen
        seen = (seen + data)[-8192:]
        if stop == "first":
            return False
        if stop == "terminal":
            at = seen.find(terminal)
            if at >= 0 and b"\n\n" in seen[at:]:
                return True


async def _one(
    url: str, protocol: BenchProtocol, body: bytes, fate: str, sid: str
) -> tuple[str, bool]:
    """One request over its own connection; ``(fate, answered completely)``."""
    parts = urlsplit(url)
    assert parts.hostname is not None and parts.port is not None
    reader, writer = await asyncio.open_connection(parts.hostname, parts.port)
    complete = False
    try:
        head = [f"POST {protocol.path} HTTP/1.1", f"Host: {parts.netloc}"]
        head += [f"{k}: {v}" for k, v in protocol.headers().items()]
        head += [f"Content-Length: {len(body)}", f"x-session-id: {sid}"]
        writer.write(("\r\n".join(head) + "\r\n\r\n").encode("latin-1"))
        if fate == "mid_body":
            writer.write(body[: len(body) // 2])
            await asyncio.wait_for(writer.drain(), _IO_TIMEOUT)
            return fate, False
        writer.write(body)
        await asyncio.wait_for(writer.drain(), _IO_TIMEOUT)
        if fate == "waiting_headers":
            return fate, False
        status, chunked, length = await _read_head(reader)
        stop = {"mid_stream": "first", "after_last_byte": "terminal"}.get(fate, "end")
        complete = await _read_body(reader, chunked, length, protocol.terminal, stop=stop)
        complete = complete and status == 200
        return fate, complete
    finally:
        writer.close()
        with contextlib.suppress(OSError):
            await writer.wait_closed()


# ---------------------------------------------------------------------------- run


async def _collect(args: Options, reporter: rpt.Reporter, log_dir: Path) -> dict[str, Any]:
    started = time.monotonic()
    started_wall = datetime.datetime.now(datetime.UTC)
    corpus = Corpus.load()
    protocols = list(BenchProtocol)
    bodies = {p: build_body(p, int(args.size * 1024), corpus) for p in protocols}
    rng = random.Random(args.seed)
    hang_fates = FATES[1:]
    plan = [
        (
            protocols[i % len(protocols)],
            rng.choice(hang_fates) if rng.random() < args.hangup else "complete",
        )
        for i in range(args.requests)
    ]
    samples: list[dict[str, Any]] = []
    counts: dict[str, int] = dict.fromkeys(FATES, 0)
    completed: dict[str, int] = dict.fromkeys(FATES, 0)
    errors: dict[str, int] = {}
    async with open_client_and_emulator(log_dir) as (session, emulator):
        proxy = start_proxy(emulator.url, log_dir, plugins=("fold", "usage"))
        async with proxy:
            await proxy.wait_ready(session)
            pid = proxy.pid
            rss0 = await _median_rss(pid)
            samples.append({"requests": 0, "rss": rss0, "fds": _fds(pid), "t_s": 0.0})
            if not args.quiet:
                reporter.note(
                    f"start: RSS {rpt.fmt_bytes(samples[0]['rss'])}, fds {samples[0]['fds']}"
                )
            sem = asyncio.Semaphore(args.concurrency)
            done = 0

            async def run(index: int) -> None:
                nonlocal done
                protocol, fate = plan[index]
                async with sem:
                    try:
                        _, ok = await _one(
                            proxy.url, protocol, bodies[protocol], fate, f"soak-{index % _SESSIONS}"
                        )
                    except (OSError, TimeoutError, asyncio.IncompleteReadError, ValueError) as exc:
                        if fate == "complete":
                            key = type(exc).__name__
                            errors[key] = errors.get(key, 0) + 1
                        ok = False
                counts[fate] += 1
                completed[fate] += int(ok)
                done += 1

            batch = args.every
            for start in range(0, args.requests, batch):  # bounded by -n
                proxy.check_alive()
                await asyncio.gather(
                    *(run(i) for i in range(start, min(start + batch, args.requests)))
                )
                # Sampled idle (no exchange in flight), as the median of a short window,
                # so the slope compares like with like.
                await wait_proxy_idle(session, proxy.url, within=60.0)
                sample = {
                    "requests": done,
                    "rss": await _median_rss(pid),
                    "fds": _fds(pid),
                    "t_s": time.monotonic() - started,
                }
                samples.append(sample)
                if not args.quiet:
                    reporter.note(
                        f"{done:>7} requests: RSS {rpt.fmt_bytes(sample['rss'])}, "
                        f"fds {sample['fds']}"
                    )
            # Idle: every handler and every commit finished (bounded wait).
            left: list[dict[str, Any]] = []
            metrics: dict[str, float] = {}
            deadline = time.monotonic() + 30.0
            while time.monotonic() < deadline:
                left = await admin_exchanges(session, proxy.url)
                metrics = await _metrics(session, proxy.url)
                booked = metrics.get('context_proxy_commits_total{event="finished"}', 0.0)
                started_commits = metrics.get('context_proxy_commits_total{event="started"}', 0.0)
                if not left and booked + _failed(metrics) >= started_commits:
                    break
                await asyncio.sleep(0.1)
            # The upstream pool closes idle connections after its keep-alive timeout
            # (aiohttp: 15 s); what stays open beyond that, over the idle start, leaked.
            fds_idle = _fds(pid)
            fd_deadline = time.monotonic() + _FD_SETTLE_S
            while fds_idle > samples[0]["fds"] and time.monotonic() < fd_deadline:
                await asyncio.sleep(0.5)
                fds_idle = _fds(pid)
            open_sockets = _sockets(pid, proxy.url, emulator.url)
            final = {
                "requests": done,
                "rss": await _median_rss(pid),
                "fds": fds_idle,
                "t_s": time.monotonic() - started,
            }
    warmup = args.warmup if args.warmup is not None else 2 * args.every
    steady = [(s["requests"], s["rss"]) for s in samples if s["requests"] >= warmup]
    after_warmup = next((s for s in samples if s["requests"] >= warmup), samples[-1])
    admitted = int(metrics.get("context_proxy_exchanges_read_total", 0.0))
    finished = int(
        sum(v for k, v in metrics.items() if k.startswith("context_proxy_requests_total{"))
    )
    booked_final = int(metrics.get('context_proxy_commits_total{event="finished"}', 0.0))
    return {
        "benchmark": "soak",
        "started_at": started_wall.isoformat(),
        "wall_s": time.monotonic() - started,
        "options": {
            "requests": args.requests,
            "concurrency": args.concurrency,
            "size_kib": args.size,
            "hangup": args.hangup,
            "every": args.every,
            "warmup": warmup,
            "seed": args.seed,
        },
        "fates": counts,
        "completed": completed,
        "client_errors": errors,
        "samples": samples,
        "final": final,
        "rss_slope_kib_per_1000": rss_slope(steady),
        "exchanges_left": len(left),
        "fds_start": samples[0]["fds"],
        "fds_after_warmup": after_warmup["fds"],
        "fds_final": final["fds"],
        # Not leaks: the upstream pool's idle keep-alive connections and this
        # benchmark's own connection for /admin and /metrics.
        "fds_leaked": max(0, final["fds"] - samples[0]["fds"] - _expected(open_sockets)),
        "sockets_at_end": open_sockets,
        "exchanges_admitted": admitted,
        "exchanges_finished": finished,
        "commits_booked": booked_final,
        "commits_failed": int(_failed(metrics)),
    }


def _failed(metrics: dict[str, float]) -> float:
    return metrics.get('context_proxy_commits_total{event="failed"}', 0.0) + metrics.get(
        'context_proxy_commits_total{event="timed_out"}', 0.0
    )


def main(argv: Sequence[str]) -> int:
    """Entry point of ``context-proxy bench soak`` and ``python -m benchmarks.soak``.

    Returns 0 when the run completed (targets are reported, not enforced), 1
    when a server failed, 2 for bad options (click's usage error).
    """
    return run_command(command, "context-proxy bench soak", argv)


def _run(args: Options, argv: Sequence[str]) -> int:
    raise_nofile_limit()
    reporter = rpt.Reporter(quiet=False)
    out: Path = args.out
    doc = run_collect(_collect, args, reporter, out / "logs" / "soak")
    if doc is None:
        return 1
    doc["command"] = " ".join(["context-proxy bench soak", *argv])
    slope = doc["rss_slope_kib_per_1000"]
    verdicts = {
        "slope": slope <= SLOPE_TARGET_KIB if slope == slope else None,
        "exchanges_left": doc["exchanges_left"] == 0,
        "fds_leaked": doc["fds_leaked"] == 0,
        "commits": doc["commits_booked"] == doc["exchanges_finished"],
    }
    doc["targets_met"] = verdicts
    out.mkdir(parents=True, exist_ok=True)
    rpt.write_json(out / "soak.json", doc)
    reporter.note(
        f"{doc['options']['requests']} requests in {doc['wall_s']:.0f} s "
        f"(fates {doc['fates']}): RSS slope after warm-up {slope:.2f} KiB per 1,000 requests "
        f"(target <= {SLOPE_TARGET_KIB:g}); exchanges left {doc['exchanges_left']}; fds "
        f"{doc['fds_start']} at the start, {doc['fds_final']} idle at the end; commits booked "
        f"{doc['commits_booked']} / exchanges finished {doc['exchanges_finished']} "
        f"({doc['exchanges_admitted']} with a body read); "
        f"wrote {out / 'soak.json'}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

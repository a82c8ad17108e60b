"""``context-proxy bench overhead``: added latency and memory per idle stream.

Three targets answer the same small streamed requests (a 2 KiB chat request,
the emulator's default 3-delta answer): the emulator **direct**, **this proxy**
(default settings) and the **naive** baseline, each its own process.

* **Latency**: time to first byte of the answer body (TTFB) and to its end
  (total), per request, from one keep-alive client session. Sequentially
  (``--requests``, targets interleaved round-robin so drift hits all alike) and
  with ``--concurrency`` workers (``--concurrent-requests`` per target, one
  target at a time). *Added latency* = a proxy's median minus direct's median.
  Targets: this proxy's added median latency within 0.1 ms of the naive
  proxy's sequentially, within 2 ms with concurrent workers, or better.
* **Throughput**: ``--concurrency`` workers send ``--throughput-requests``
  small requests (``--throughput-bytes``, 1 KB) to each proxy, JSON answers
  and streamed ones, in alternating rounds so load from elsewhere hits both
  alike. Figures: requests per second and CPU seconds per request of the proxy
  process (user + system from ``/proc``). Targets: this proxy's requests/s >=
  1.0x the naive proxy's, its CPU per request <= 1.0x. Both run on the same
  event loop (``--event-loop``, asyncio by default), which the output names.
* **Idle streams**: a fresh process of each proxy holds ``--streams`` (500)
  answers open at once (emulator ``hold``, after the first text delta); the
  RSS growth over the idle process divided by the stream count is the memory
  each open idle stream costs. These requests carry a ~37 KB history
  (``build_body``'s smallest), which the naive proxy keeps per stream. Both
  RSS figures are sampled after ``_SETTLE_S`` seconds without a new request
  (idle streams are idle: a real one waits seconds to minutes for its next
  token), which lets this proxy's allocator trim after the burst
  (proxy/_alloc.py, ``quiet_after``); both proxies get the same wait.
  Target: at most ``IDLE_STREAM_TARGET_BYTES`` (24 KiB) per stream for this proxy.
* **Slow streams** (``--slow-streams``, 4,000; 0 skips them): that many answers at
  once through each target in turn (direct, this proxy, naive; ``--slow-rounds``
  alternating rounds, pooled), each one text
  delta every ``--slow-gap`` second, started evenly over ``--slow-ramp`` seconds
  (benchmarks/_slow.py). Figures: streams complete, and the gap between a stream's
  consecutive deltas as the client saw it, minus the scripted gap, at p50 / p99
  while all streams are open, with a histogram in the JSON. Targets: every stream
  completes; this proxy's p99 at most ``SLOW_GAP_ADDED_TARGET`` (25 ms) over
  direct's, in the same run.

Outputs in ``--out``: ``overhead.json``, ``overhead.md``.
"""

from __future__ import annotations

import asyncio
import dataclasses
import datetime
import math
import statistics
import sys
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from types import SimpleNamespace
from typing import Any, Final

import aiohttp
import click

from . import _report as rpt
from ._harness import (
    CONTEXT_SETTINGS,
    EmulatorControl,
    RssSampler,
    Service,
    StreamCall,
    cpu_seconds,
    median_rss,
    open_client_and_emulator,
    raise_nofile_limit,
    run_collect,
    run_command,
    start_naive,
    start_proxy,
)
from ._slow import SlowStreamFigures, run_slow_streams
from ._workload import BenchProtocol, Corpus, build_body, build_small_body

__all__ = [
    "ADDED_LATENCY_SLACK",
    "CPU_RATIO_TARGET",
    "IDLE_STREAM_TARGET_BYTES",
    "RPS_RATIO_TARGET",
    "SEQUENTIAL_LATENCY_SLACK",
    "SLOW_GAP_ADDED_TARGET",
    "command",
    "main",
]

#: Seconds this proxy's median added latency may exceed the naive proxy's, sequentially.
SEQUENTIAL_LATENCY_SLACK: Final = 0.0001
#: The same with concurrent workers (both CPU-bound there: queueing dominates).
ADDED_LATENCY_SLACK: Final = 0.002
#: This proxy's requests/s at least this multiple of the naive proxy's (same run).
RPS_RATIO_TARGET: Final = 1.0
#: This proxy's CPU seconds per request at most this multiple of the naive proxy's.
CPU_RATIO_TARGET: Final = 1.0
#: Bytes of RSS one open idle stream may cost this proxy.
IDLE_STREAM_TARGET_BYTES: Final = 24 * 1024
#: Seconds this proxy's p99 gap between slow-stream events may exceed direct's.
SLOW_GAP_ADDED_TARGET: Final = 0.025
_THROUGHPUT_ROUNDS: Final = 4
_SMALL_BYTES: Final = 2048
_WARMUP: Final = 20
_TARGETS: Final = ("direct", "ours", "naive")
_REQUEST_TIMEOUT: Final = 60.0
#: Seconds without a new request before the idle-stream RSS samples (over the
#: proxy's 1 s allocator quiet period, with a margin for a loaded machine).
_SETTLE_S: Final = 2.5


@click.command(
    context_settings=CONTEXT_SETTINGS,
    help=(
        "Added latency against the upstream direct, small-request throughput and CPU "
        "against the naive proxy, and memory per idle stream."
    ),
)
@click.option(
    "--requests",
    type=click.IntRange(min=1),
    default=300,
    help="sequential requests per target [300]",
)
@click.option(
    "--concurrency", type=click.IntRange(min=1), default=50, help="concurrent workers [50]"
)
@click.option(
    "--concurrent-requests",
    type=click.IntRange(min=1),
    default=1000,
    help="requests per target in the concurrent run [1000]",
)
@click.option(
    "--throughput-requests",
    type=click.IntRange(min=1),
    default=2000,
    help="requests per proxy and answer kind in the throughput run [2000]",
)
@click.option(
    "--throughput-bytes",
    type=click.IntRange(min=1),
    default=1024,
    help="body size there, bytes [1024]",
)
@click.option(
    "--event-loop",
    type=click.Choice(["uvloop", "asyncio"]),
    default="asyncio",
    help="both proxies [asyncio]",
)
@click.option(
    "--streams", type=click.IntRange(min=1), default=500, help="idle streams held open [500]"
)
@click.option(
    "--slow-streams",
    type=click.IntRange(min=0),
    default=4000,
    help="slow streams at once per target, 0: none [4000]",
)
@click.option(
    "--slow-rounds",
    type=click.IntRange(min=1),
    default=2,
    help="alternating rounds through the targets, gaps pooled [2]",
)
@click.option(
    "--slow-deltas",
    type=click.IntRange(min=2),
    default=15,
    help="text deltas per slow stream [15]",
)
@click.option(
    "--slow-gap",
    type=click.FloatRange(min=0.01, max=60),
    default=1.0,
    help="seconds between a slow stream's deltas [1.0]",
)
@click.option(
    "--slow-ramp",
    type=click.FloatRange(min=0, max=600),
    default=4.0,
    help="seconds over which the slow streams start [4.0]",
)
@click.option(
    "--protocol", type=click.Choice([p.value for p in BenchProtocol]), default="chat", help="[chat]"
)
@click.option(
    "--out", type=click.Path(path_type=Path), default=Path("bench-results"), help="output dir"
)
@click.option("--quiet", is_flag=True, help="no progress bar")
@click.pass_context
def command(ctx: click.Context, /, **options: Any) -> int:
    """``context-proxy bench overhead``."""
    return _run(SimpleNamespace(**options), list(ctx.obj or []))


@dataclasses.dataclass(slots=True)
class Timings:
    """Per-request times of one target in one mode, seconds."""

    ttfb: list[float] = dataclasses.field(default_factory=list)
    total: list[float] = dataclasses.field(default_factory=list)
    failures: int = 0
    wall_s: float = 0.0

    def summary(self) -> dict[str, float | int]:
        """Median, p90 and max (seconds) of both figures, the failure count, requests/s."""
        out: dict[str, float | int] = {"requests": len(self.total), "failures": self.failures}
        for name, values in (("ttfb", self.ttfb), ("total", self.total)):
            data = sorted(values)
            out[f"{name}_median_s"] = statistics.median(data) if data else math.nan
            out[f"{name}_p90_s"] = data[int(0.9 * (len(data) - 1))] if data else math.nan
            out[f"{name}_max_s"] = data[-1] if data else math.nan
        out["requests_per_s"] = len(self.total) / self.wall_s if self.wall_s else math.nan
        return out


async def _one(
    session: aiohttp.ClientSession, url: str, protocol: BenchProtocol, body: bytes, into: Timings
) -> None:
    started = time.perf_counter()
    call = StreamCall(session, url, protocol, body, script=None, clock=time.perf_counter)
    outcome = await call.result(_REQUEST_TIMEOUT)
    if not outcome.complete:
        into.failures += 1
        return
    into.ttfb.append(outcome.first_byte_at - started)
    into.total.append(outcome.done_at - started)


async def _sequential(
    session: aiohttp.ClientSession,
    urls: dict[str, str],
    protocol: BenchProtocol,
    body: bytes,
    count: int,
    steps: rpt.Steps,
) -> dict[str, Timings]:
    results = {name: Timings() for name in urls}
    for _ in range(_WARMUP):
        for url in urls.values():
            await _one(session, url, protocol, body, Timings())
    steps.describe("latency, sequential")
    started = time.perf_counter()
    for _ in range(count):
        for name, url in urls.items():
            await _one(session, url, protocol, body, results[name])
    wall = time.perf_counter() - started
    for timings in results.values():
        timings.wall_s = wall / len(urls)
    steps.advance()
    return results


async def _concurrent(
    session: aiohttp.ClientSession,
    urls: dict[str, str],
    protocol: BenchProtocol,
    body: bytes,
    count: int,
    workers: int,
    steps: rpt.Steps,
) -> dict[str, Timings]:
    results: dict[str, Timings] = {}
    for name, url in urls.items():
        steps.describe(f"latency, {workers} concurrent: {name}")
        timings = Timings()

        async def worker(tickets: Iterator[int], url: str = url, into: Timings = timings) -> None:
            # Workers share one iterator: together they make exactly len(tickets) requests.
            for _ in tickets:
                await _one(session, url, protocol, body, into)

        warm = iter(range(_WARMUP))
        await asyncio.gather(*(worker(warm) for _ in range(min(workers, _WARMUP))))
        timings.ttfb.clear()
        timings.total.clear()
        timed = iter(range(count))
        started = time.perf_counter()
        await asyncio.gather(*(worker(timed) for _ in range(workers)))
        timings.wall_s = time.perf_counter() - started
        results[name] = timings
        steps.advance()
    return results


@dataclasses.dataclass(slots=True)
class Throughput:
    """One proxy's throughput for one answer kind, summed over the rounds."""

    requests: int = 0
    failures: int = 0
    wall_s: float = 0.0
    cpu_s: float = 0.0

    @property
    def rps(self) -> float:
        """Requests per second."""
        return self.requests / self.wall_s if self.wall_s else math.nan

    @property
    def cpu_per_request(self) -> float:
        """CPU seconds (user + system) of the proxy process per request."""
        return self.cpu_s / self.requests if self.requests else math.nan


async def _burst(
    session: aiohttp.ClientSession,
    svc: Service,
    protocol: BenchProtocol,
    body: bytes,
    count: int,
    workers: int,
    into: Throughput | None,
) -> None:
    url = svc.url + protocol.path
    headers = protocol.headers()
    tickets = iter(range(count))
    failures = 0

    async def worker() -> None:
        nonlocal failures
        for _ in tickets:
            async with session.post(url, data=body, headers=headers) as resp:
                await resp.read()
                failures += resp.status != 200

    cpu = cpu_seconds(svc.pid)
    started = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(workers)))
    if into is not None:
        into.wall_s += time.perf_counter() - started
        into.cpu_s += cpu_seconds(svc.pid) - cpu
        into.requests += count
        into.failures += failures


async def _throughput(
    session: aiohttp.ClientSession,
    services: dict[str, Service],
    protocol: BenchProtocol,
    size: int,
    count: int,
    workers: int,
    steps: rpt.Steps,
) -> dict[str, dict[str, Throughput]]:
    # build_body cannot go under ~37 KB (its first tool result): 1 KB means 1 KB here.
    streamed = build_small_body(protocol, size, Corpus.load())
    bodies = {
        "json": streamed.replace(b'"stream":true', b'"stream":false', 1),
        "streamed": streamed,
    }
    results: dict[str, dict[str, Throughput]] = {}
    per_round = max(1, count // _THROUGHPUT_ROUNDS)
    for kind, body in bodies.items():
        steps.describe(f"throughput, {workers} concurrent, {kind}")
        results[kind] = {name: Throughput() for name in services}
        for svc in services.values():
            await _burst(session, svc, protocol, body, _WARMUP * 5, workers, None)
        for _ in range(_THROUGHPUT_ROUNDS):
            for name, svc in services.items():
                await _burst(session, svc, protocol, body, per_round, workers, results[kind][name])
        steps.advance()
    return results


@dataclasses.dataclass(slots=True)
class StreamFigures:
    """Memory of one proxy process holding ``streams`` idle answers open (bytes)."""

    proxy: str
    streams: int
    idle_rss: int = 0
    held_rss: int = 0
    after_rss: int = 0
    opened: int = 0
    failures: int = 0

    @property
    def per_stream(self) -> float:
        """RSS growth per open stream, bytes."""
        return (self.held_rss - self.idle_rss) / self.streams if self.streams else math.nan


async def _idle_streams(
    session: aiohttp.ClientSession,
    svc: Service,
    control: EmulatorControl,
    protocol: BenchProtocol,
    body: bytes,
    count: int,
) -> StreamFigures:
    figures = StreamFigures(svc.name, count)
    await svc.wait_ready(session)
    sampler = RssSampler(svc.pid).start()
    try:
        await _one(session, svc.url, protocol, body, Timings())
        await asyncio.sleep(_SETTLE_S)
        figures.idle_rss = await median_rss(sampler, 0.2)
        key = f"idle-{svc.name}"
        script = f"hold={key}; stall_after={protocol.first_delta_event}"
        calls = [StreamCall(session, svc.url, protocol, body, script=script) for _ in range(count)]
        try:
            async with asyncio.timeout(120.0):
                await control.wait_holding(key, count, within=120.0)
                for call in calls:
                    await call.first_byte.wait()
            figures.opened = sum(1 for call in calls if call.outcome.received)
            await asyncio.sleep(_SETTLE_S)
            figures.held_rss = await median_rss(sampler, 0.2)
            await control.release(key)
            outcomes = [await call.result(_REQUEST_TIMEOUT) for call in calls]
            figures.failures = sum(1 for o in outcomes if not o.complete)
            await asyncio.sleep(0.2)
            figures.after_rss = await median_rss(sampler, 0.2)
        finally:
            if not all(call.task.done() for call in calls):
                await control.release(key)
                for call in calls:
                    await call.cancel()
        svc.check_alive()
    finally:
        sampler.stop()
    return figures


@dataclasses.dataclass(slots=True)
class Results:
    """Everything one overhead run measured."""

    sequential: dict[str, Timings]
    concurrent: dict[str, Timings]
    streams: list[StreamFigures]
    throughput: dict[str, dict[str, Throughput]]
    slow: dict[str, SlowStreamFigures]
    wall_s: float
    started: datetime.datetime


async def _collect(args: SimpleNamespace, reporter: rpt.Reporter, log_dir: Path) -> Results:
    started = time.monotonic()
    started_wall = datetime.datetime.now(datetime.UTC)
    protocol = BenchProtocol(args.protocol)
    corpus = Corpus.load()
    small = build_small_body(protocol, _SMALL_BYTES, corpus)
    # The idle streams keep the history they were measured with (~37 KB: build_body's
    # smallest), so their figures stay comparable with earlier runs.
    body = build_body(protocol, _SMALL_BYTES, corpus)
    async with open_client_and_emulator(log_dir) as (session, emulator):
        control = EmulatorControl(session, emulator.url)
        slow_steps = len(_TARGETS) * args.slow_rounds if args.slow_streams else 0
        with reporter.progress(1 + len(_TARGETS) + 2 + slow_steps + 2, "overhead") as steps:
            loop = args.event_loop
            ours = start_proxy(emulator.url, log_dir, name="proxy-latency", event_loop=loop)
            naive = start_naive(emulator.url, log_dir, name="naive-latency", event_loop=loop)
            async with ours, naive:
                await ours.wait_ready(session)
                await naive.wait_ready(session)
                urls = {"direct": emulator.url, "ours": ours.url, "naive": naive.url}
                sequential = await _sequential(session, urls, protocol, small, args.requests, steps)
                concurrent = await _concurrent(
                    session,
                    urls,
                    protocol,
                    small,
                    args.concurrent_requests,
                    args.concurrency,
                    steps,
                )
                throughput = await _throughput(
                    session,
                    {"ours": ours, "naive": naive},
                    protocol,
                    args.throughput_bytes,
                    args.throughput_requests,
                    args.concurrency,
                    steps,
                )
                slow = await _slow_streams(args, urls, control, protocol, small, steps)
            streams = []
            for name, start in (("ours", start_proxy), ("naive", start_naive)):
                steps.describe(f"{args.streams} idle streams: {name}")
                await control.reset()
                svc = start(emulator.url, log_dir, name=f"{name}-streams", event_loop=loop)
                async with svc:
                    streams.append(
                        await _idle_streams(session, svc, control, protocol, body, args.streams)
                    )
                steps.advance()
    return Results(
        sequential,
        concurrent,
        streams,
        throughput,
        slow,
        time.monotonic() - started,
        started_wall,
    )


async def _slow_streams(
    args: SimpleNamespace,
    urls: dict[str, str],
    control: EmulatorControl,
    protocol: BenchProtocol,
    body: bytes,
    steps: rpt.Steps,
) -> dict[str, SlowStreamFigures]:
    """``args.slow_streams`` slow streams through each target in turn (none when 0), for
    ``args.slow_rounds`` rounds: load from elsewhere that comes and goes hits every
    target alike. Each target's rounds are pooled."""
    results: dict[str, SlowStreamFigures] = {}
    if not args.slow_streams:
        return results
    for _ in range(args.slow_rounds):
        for name, url in urls.items():
            steps.describe(f"{args.slow_streams} slow streams: {name}")
            await control.reset()  # the emulator keeps a record per request: start empty
            figures = await run_slow_streams(
                name,
                url,
                protocol,
                body,
                streams=args.slow_streams,
                deltas=args.slow_deltas,
                gap=args.slow_gap,
                ramp=args.slow_ramp,
            )
            if name in results:
                results[name].add(figures)
            else:
                results[name] = figures
            steps.advance()
    return results


def _ms(seconds: float) -> str:
    return "n/a" if math.isnan(seconds) else f"{seconds * 1000:.2f}"


def _latency_table(results: Results, args: SimpleNamespace) -> rpt.Table:
    table = rpt.Table(
        title=(
            "Latency of small streamed requests: median ms direct, and ms each proxy adds "
            "over direct"
        ),
        columns=(
            "run",
            "figure",
            "direct",
            "ours +",
            "naive +",
            "÷ naive",
            "target",
            "verdict",
        ),
    )
    modes: Sequence[tuple[str, dict[str, Timings], float]] = (
        (f"{args.requests} seq", results.sequential, SEQUENTIAL_LATENCY_SLACK),
        (
            f"{args.concurrent_requests} at {args.concurrency}",
            results.concurrent,
            ADDED_LATENCY_SLACK,
        ),
    )
    for mode, timings, slack in modes:
        for figure in ("ttfb", "total"):
            med = {name: timings[name].summary()[f"{figure}_median_s"] for name in _TARGETS}
            added_ours = med["ours"] - med["direct"]
            added_naive = med["naive"] - med["direct"]
            ratio = _ratio(added_ours, added_naive)
            table.add(
                mode,
                "TTFB" if figure == "ttfb" else "total",
                _ms(med["direct"]),
                f"+{_ms(added_ours)}",
                f"+{_ms(added_naive)}",
                rpt.fmt_ratio(ratio),
                f"naive+{slack * 1000:g}",
                rpt.verdict(added_ours, added_naive + slack),
            )
    failures = {
        f"{mode}/{name}": t.failures
        for mode, group in (("seq", results.sequential), ("conc", results.concurrent))
        for name, t in group.items()
        if t.failures
    }
    if failures:
        table.notes.append(f"failed requests (not timed): {failures}")
    table.notes.append(
        "N seq: N requests one after another; N at C: N requests, C at once. TTFB: first "
        "byte of the answer body; total: end of the answer; ÷ naive: added ms over added "
        "ms; target: at most the naive proxy's added ms plus this. One keep-alive client "
        "session; p90 and throughput are in overhead.json."
    )
    return table


def _ratio(ours: float, naive: float) -> float:
    """``ours / naive``, or NaN (printed ``n/a``, a MISS) when the baseline is not a positive
    number: 0 CPU seconds measured means too few samples, not an infinitely cheap proxy."""
    if math.isnan(ours) or math.isnan(naive) or naive <= 0:
        return math.nan
    return ours / naive


def _throughput_table(results: Results, args: SimpleNamespace) -> rpt.Table:
    table = rpt.Table(
        title=(
            f"Throughput: {args.concurrency} concurrent {args.throughput_bytes}-byte requests, "
            f"{args.throughput_requests} per proxy and kind, both on {args.event_loop}"
        ),
        columns=("answer", "figure", "ours", "naive", "÷ naive", "target", "verdict"),
    )
    for kind, by_name in results.throughput.items():
        ours, naive = by_name["ours"], by_name["naive"]
        rps_ratio = _ratio(ours.rps, naive.rps)
        table.add(
            kind,
            "requests/s",
            f"{ours.rps:.0f}",
            f"{naive.rps:.0f}",
            rpt.fmt_ratio(rps_ratio),
            f">= {RPS_RATIO_TARGET:g}",
            rpt.verdict(-rps_ratio, -RPS_RATIO_TARGET),
        )
        cpu_ratio = _ratio(ours.cpu_per_request, naive.cpu_per_request)
        table.add(
            kind,
            "CPU µs/request",
            f"{ours.cpu_per_request * 1e6:.0f}",
            f"{naive.cpu_per_request * 1e6:.0f}",
            rpt.fmt_ratio(cpu_ratio),
            f"<= {CPU_RATIO_TARGET:g}",
            rpt.verdict(cpu_ratio, CPU_RATIO_TARGET),
        )
    failures = {
        f"{kind}/{name}": t.failures
        for kind, by_name in results.throughput.items()
        for name, t in by_name.items()
        if t.failures
    }
    if failures:
        table.notes.append(f"non-200 answers: {failures}")
    table.notes.append(
        f"CPU: user + system seconds of the proxy process (its CPU-time clock, ns); "
        f"{_THROUGHPUT_ROUNDS} alternating rounds per kind, summed; n/a: the naive proxy's "
        "CPU read 0 s. The naive proxy runs on the same event loop."
    )
    return table


def _streams_table(results: Results, args: SimpleNamespace) -> rpt.Table:
    table = rpt.Table(
        title=(
            "Memory per open idle stream (answers held open by the upstream), "
            f"both on {args.event_loop}"
        ),
        columns=(
            "proxy",
            "streams",
            "idle RSS",
            "RSS open",
            "per stream",
            "÷ naive",
            "target",
            "verdict",
        ),
    )
    naive = next((s for s in results.streams if s.proxy.startswith("naive")), None)
    for figures in results.streams:
        ratio = (
            figures.per_stream / naive.per_stream if naive and naive.per_stream > 0 else math.nan
        )
        ours = figures.proxy.startswith("ours")
        table.add(
            "ours" if ours else "naive",
            f"{figures.opened}/{figures.streams}",
            rpt.fmt_bytes(figures.idle_rss),
            rpt.fmt_bytes(figures.held_rss),
            rpt.fmt_bytes(figures.per_stream),
            rpt.fmt_ratio(ratio),
            f"<= {rpt.fmt_bytes(IDLE_STREAM_TARGET_BYTES)}" if ours else "",
            rpt.verdict(figures.per_stream, IDLE_STREAM_TARGET_BYTES) if ours else "",
        )
    table.notes.append(
        "streams: open / asked; RSS open: with all streams open; per stream: (RSS open - "
        "idle RSS) / streams."
    )
    return table


def _slow_table(results: Results, args: SimpleNamespace) -> rpt.Table:
    table = rpt.Table(
        title=(
            f"Slow streams: {args.slow_streams} at once, a delta every {args.slow_gap:g} s; "
            "added gap, ms"
        ),
        columns=("target", "complete", "gaps", "p50", "p99", "max", "p99 - direct", "verdict"),
    )
    direct = results.slow.get("direct")
    for name, figures in results.slow.items():
        over_direct = math.nan
        if direct is not None and name != "direct":
            over_direct = figures.added(0.99) - direct.added(0.99)
        verdict = ""
        if name == "ours":
            complete = figures.complete == figures.streams
            verdict = rpt.verdict(over_direct, SLOW_GAP_ADDED_TARGET) if complete else rpt.MISS
        table.add(
            name,
            f"{figures.complete}/{figures.streams}",
            str(len(figures.gaps)),
            _ms(figures.added(0.5)),
            _ms(figures.added(0.99)),
            _ms(figures.added(1.0)),
            "" if name == "direct" else f"+{_ms(over_direct)}",
            verdict,
        )
    errors = {name: f.errors for name, f in results.slow.items() if f.errors}
    if errors:
        table.notes.append(f"failed streams: {errors}")
    table.notes.append(
        "gaps: between consecutive deltas of a stream, counted while every stream was "
        f"open, {args.slow_rounds} alternating rounds pooled; p50/p99/max of gap minus "
        f"{args.slow_gap:g} s. Target: every stream "
        f"complete, ours' p99 at most direct's + {SLOW_GAP_ADDED_TARGET * 1000:g} ms. "
        "Histogram in overhead.json."
    )
    return table


def _document(results: Results, args: SimpleNamespace, argv: Sequence[str]) -> dict[str, Any]:
    return {
        "benchmark": "overhead",
        "started_at": results.started.isoformat(),
        "wall_s": results.wall_s,
        "command": " ".join(["context-proxy bench overhead", *argv]),
        "options": {
            "requests": args.requests,
            "concurrency": args.concurrency,
            "concurrent_requests": args.concurrent_requests,
            "streams": args.streams,
            "protocol": args.protocol,
            "sequential_latency_slack_s": SEQUENTIAL_LATENCY_SLACK,
            "added_latency_slack_s": ADDED_LATENCY_SLACK,
            "event_loop": args.event_loop,
            "idle_stream_target_bytes": IDLE_STREAM_TARGET_BYTES,
            "slow_streams": args.slow_streams,
            "slow_rounds": args.slow_rounds,
            "slow_deltas": args.slow_deltas,
            "slow_gap_s": args.slow_gap,
            "slow_ramp_s": args.slow_ramp,
            "slow_gap_added_target_s": SLOW_GAP_ADDED_TARGET,
        },
        "sequential": {name: t.summary() for name, t in results.sequential.items()},
        "concurrent": {name: t.summary() for name, t in results.concurrent.items()},
        "event_loop": args.event_loop,
        "throughput": {
            kind: {
                name: {
                    **dataclasses.asdict(t),
                    "requests_per_s": t.rps,
                    "cpu_s_per_request": t.cpu_per_request,
                }
                for name, t in by_name.items()
            }
            for kind, by_name in results.throughput.items()
        },
        "idle_streams": [
            {**dataclasses.asdict(s), "per_stream_bytes": s.per_stream} for s in results.streams
        ],
        "slow_streams": {name: f.summary() for name, f in results.slow.items()},
    }


def main(argv: list[str]) -> int:
    """Entry point of ``context-proxy bench overhead`` (and ``python -m benchmarks.overhead``).

    Returns 0 when the run completed (targets missed are reported, not an error),
    1 when a server failed, 2 for bad options.
    """
    return run_command(command, "context-proxy bench overhead", argv)


def _run(args: SimpleNamespace, argv: Sequence[str]) -> int:
    limits = raise_nofile_limit()
    # The proxy holds two descriptors per open stream (client and upstream side).
    held = max(args.streams, args.slow_streams)
    if limits[0] < 2 * held + 200:
        print(
            f"warning: open-file limit {limits[0]} may be too low for {held} streams",
            file=sys.stderr,
        )
    reporter = rpt.Reporter(quiet=args.quiet)
    out: Path = args.out
    results = run_collect(_collect, args, reporter, out / "logs" / "overhead")
    if results is None:
        return 1
    tables = [
        _latency_table(results, args),
        _throughput_table(results, args),
        _streams_table(results, args),
    ]
    if results.slow:
        tables.append(_slow_table(results, args))
    for table in tables:
        reporter.print_table(table)
    out.mkdir(parents=True, exist_ok=True)
    rpt.write_json(out / "overhead.json", _document(results, args, argv))
    rpt.write_markdown(
        out / "overhead.md",
        tables,
        f"Command: `{' '.join(['context-proxy bench overhead', *argv])}`, "
        f"wall time {results.wall_s:.0f} s.",
    )
    reporter.note(
        f"wall time {results.wall_s:.0f} s; wrote {out / 'overhead.json'}, {out / 'overhead.md'}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

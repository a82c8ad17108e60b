"""``context-proxy bench memory``: request-memory lifetime of this proxy against a naive one.

For every body size (MiB) and protocol, a fresh process of this proxy per
*variant*, a fresh naive baseline process and a fresh nginx (a reverse proxy
that spools request bodies to a temporary file, :mod:`benchmarks._nginx`; its
master and worker sampled together; left out, with a line saying so, when no
nginx binary is found) each take ``--repeats`` large streamed requests, one
after the other, after a small warm-up request. Each
answer is held open by the emulator (``x-emulator: hold=KEY``) until the
benchmark has sampled it, then released. Growth figures are RSS minus the
process's idle RSS before its first large request, divided by the body size B.
The idle RSS is read once the process has been idle for longer than this
proxy's idle trim (``proxy._alloc.DEFAULT_IDLE_AFTER``): before it, the idle
heap still holds the warm-up's freed memory, which the first large request
reuses without its RSS growing (a 1 MiB body then looked ~1 MiB smaller than
it is). The naive baseline gets the same wait.

* **peak**: the largest RSS from the request's first byte to its end (5 ms
  samples, and the kernel's ``VmHWM``, reset before each request through
  ``/proc/PID/clear_refs``);
* **mid-stream**: median RSS over 100 ms while the answer is held open;
* **after**: median RSS over 100 ms, 200 ms after the answer ended.

Each figure also in its anonymous (``RssAnon``) and file-backed (``RssFile``)
parts, and per request the time to first byte and the CPU seconds the process
spent (:attr:`Sample.ttfb_s`, :attr:`Sample.cpu_s`).

Variants of this proxy (the naive baseline is the same in all):

* ``plain``: default plugins (``fold``, which never reads the body at fold
  level 0); held after the first text delta, i.e. while streaming.
* ``plugin``: plus :class:`benchmarks.plugins.Marker`, which parses and rewrites
  every body; held after the first text delta.
* ``retry``: ``fake_completion_retries=1``; held *before* the first output
  event, the window in which a resend may still need the body.
* ``edit``: plus :class:`benchmarks.plugins.ViewMarker`, which changes one small
  field through the structural view; held after the first text delta.
* ``refold``: an agent history (a system prompt, then turns of a tool call and
  its ~300 KB result) that the emulator refuses with the real context-overflow
  error while it is over 0.75 B; ``fold`` refolds it at level 1 and resends;
  held after the first text delta of the refolded answer. Peak is over the
  whole exchange (both sends).

With ``plain`` and ``heap`` selected, every case whose body is spooled gets
their time to first byte and CPU per request side by side, as ratios
(:func:`spool_costs`). ``--turns N`` (default 50; 0: skip) runs two more
processes, the defaults and ``spool_above_bytes = 0``, side by side through
``--repeats`` rounds of N streamed ~``--turn-kb`` KB Anthropic Messages turns
(under the threshold: nothing should change) and reports their CPU per request
(:func:`measure_turn_cpu`).

With ``refold`` selected, the run also times one refold of each protocol's
largest agent history in the benchmark process (``fold`` through the view,
splice, digest and slices) against ``json.loads`` + ``json.dumps`` of the same
body (what a naive proxy does to edit it), in CPU seconds.

``--sequential N`` adds N back-to-back requests of ``--sequential-size`` MiB to
one process per proxy and shows RSS after each (the allocator's retention).
Outputs in ``--out`` (default ``bench-results/``): ``memory.json`` (every
figure), ``memory.md`` (the tables), ``memory.png`` (RSS over time); with
``--publish`` also ``docs/bench-memory.{json,png,md}`` (``--publish-name`` replaces
``bench-memory``: the spool's run is published as ``docs/bench-spool.*``).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import datetime
import itertools
import json
import math
import os
import platform
import shutil
import sys
import time
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from pathlib import Path
from types import SimpleNamespace
from typing import Any, Final

import aiohttp
import click

from proxy._alloc import DEFAULT_IDLE_AFTER
from proxy._config import Settings

from . import _report as rpt
from ._harness import (
    CONTEXT_SETTINGS,
    EmulatorControl,
    RssSampler,
    Service,
    StreamCall,
    admin_exchanges,
    cpu_seconds,
    held_metrics,
    median_rss,
    open_client_and_emulator,
    raise_nofile_limit,
    read_vm_hwm,
    reset_vm_hwm,
    run_collect,
    run_command,
    start_naive,
    start_proxy,
    wait_proxy_idle,
)
from ._nginx import BODY_BUFFER_BYTES, find_nginx, nginx_pids, start_nginx
from ._workload import BenchProtocol, Corpus, MiB, build_agent_history, build_body

__all__ = [
    "AFTER_LIMIT",
    "VARIANTS",
    "Bench",
    "Case",
    "ProcessRun",
    "Results",
    "Sample",
    "SpoolCost",
    "TurnCpu",
    "Variant",
    "build_tables",
    "collect",
    "command",
    "converted",
    "main",
    "measure_batch",
    "measure_turn_cpu",
    "no_worse",
    "open_bench",
    "out_option",
    "plot_document",
    "plot_memory",
    "run_json",
    "run_process",
    "spool_cost_table",
    "spool_costs",
    "turn_cpu_table",
    "write_outputs",
]

MARKER_PLUGIN: Final = "benchmarks.plugins:Marker"
VIEW_MARKER_PLUGIN: Final = "benchmarks.plugins:ViewMarker"
#: The refold variant's upstream refuses bodies above this share of B.
REFOLD_OVERFLOW: Final = 0.75
#: Target: CPU of one refold over CPU of json.loads + json.dumps of the same body.
REFOLD_CPU_LIMIT: Final = 0.5
#: RSS after a response may exceed the idle RSS by at most this many body sizes.
AFTER_LIMIT: Final = 0.05
#: Seconds between the end of an answer and the start of the "after" window.
_SETTLE: Final = 0.2
#: Seconds of sampling for a "median RSS" figure.
_WINDOW: Final = 0.1
#: Seconds one large request may take in total (a 64 MiB body through the naive
#: proxy takes about 2 s on 2 cores; this only catches a hang).
_REQUEST_TIMEOUT: Final = 600.0
_WARMUP_BYTES: Final = 64 * 1024
_PHASES_OPEN: Final = frozenset({"sent", "accepted", "streaming"})
#: Small turns each spool setting gets before the measured rounds (imports, pools, caches).
_TURN_WARMUP: Final = 10
_SPOOL_ENV: Final = "CONTEXT_PROXY_SPOOL_ABOVE_BYTES"
#: Anonymous RSS growth limits (x B) for a body the spool takes: at the
#: peak, and while the answer streams. Its pages are file-backed (RssFile) instead.
ANON_PEAK_LIMIT: Final = 0.05
ANON_MID_LIMIT: Final = 0.01
#: Bodies over this many bytes are spooled by default (``spool_above_bytes``).
SPOOL_ABOVE_DEFAULT: Final = Settings().spool_above_bytes


@dataclasses.dataclass(frozen=True, slots=True)
class Variant:
    """One configuration of this proxy, with the targets that apply to it.

    ``hold`` is where the emulator holds the answer: ``delta`` (after the first
    text delta: streaming) or ``head`` (before any output event). Limits are
    multiples of the body size B. ``workload`` is ``default`` (build_body) or
    ``agent`` (build_agent_history); ``overflow`` > 0 makes the emulator refuse
    sends larger than that share of B with the context-overflow error.
    """

    name: str
    plugins: tuple[str, ...]
    retries: int
    hold: str
    peak_limit: float
    mid_limit: float
    description: str
    workload: str = "default"
    overflow: float = 0.0
    #: ``CONTEXT_PROXY_*`` settings of this variant (``heap``: the spool off).
    env: tuple[tuple[str, str], ...] = ()
    #: Anonymous RSS growth limits, x B, for a body the spool takes;
    #: ``None``: reported, no target (the heap path).
    anon_peak_limit: float | None = ANON_PEAK_LIMIT
    anon_mid_limit: float | None = ANON_MID_LIMIT
    #: A shorter description for the plot's panel title, which must fit on one line
    #: over its panel ("": the description).
    short: str = ""


VARIANTS: Final = {
    "plain": Variant(
        "plain", ("fold",), 0, "delta", 1.1, 0.05, "default plugins, none reads the body"
    ),
    "heap": Variant(
        "heap",
        ("fold",),
        0,
        "delta",
        1.1,
        0.05,
        "plain with the spool off (spool_above_bytes=0): every body in the heap",
        env=((_SPOOL_ENV, "0"),),
        short="plain with the spool off",
        anon_peak_limit=None,
        anon_mid_limit=None,
    ),
    "plugin": Variant(
        "plugin",
        ("fold", MARKER_PLUGIN),
        0,
        "delta",
        2.2,
        0.05,
        "Marker plugin parses and rewrites every body",
        # The whole-object path parses the body into Python objects: ~2 B of heap.
        anon_peak_limit=None,
        anon_mid_limit=None,
    ),
    "retry": Variant(
        "retry",
        ("fold",),
        1,
        "head",
        1.1,
        1.05,
        "fake_completion_retries=1, sampled before output starts",
        # Held before output, the spool still open for a resend: no anonymous-memory target.
        anon_peak_limit=None,
        anon_mid_limit=None,
    ),
    "edit": Variant(
        "edit",
        ("fold", VIEW_MARKER_PLUGIN),
        0,
        "delta",
        1.1,
        0.05,
        "ViewMarker changes one small field through the structural view",
    ),
    "refold": Variant(
        "refold",
        ("fold",),
        0,
        "delta",
        1.25,
        0.05,
        "agent history refused with the context-overflow error, refolded by fold and resent",
        workload="agent",
        overflow=REFOLD_OVERFLOW,
        short="context overflow, refolded by fold and resent",
    ),
}


@dataclasses.dataclass(slots=True)
class Sample:
    """One large request through one proxy process. RSS figures in bytes; times in
    seconds on the process's sampler clock."""

    body_bytes: int
    idle_rss: int
    idle_anon: int = 0
    idle_file: int = 0
    peak_anon: int = 0
    mid_anon: int = 0
    peak_file: int = 0
    mid_file: int = 0
    before_rss: int = 0
    peak_rss: int = 0
    hwm_rss: int = 0
    mid_rss: int = 0
    after_rss: int = 0
    upstream_bytes: int = 0
    held_admin: list[dict[str, Any]] = dataclasses.field(default_factory=list)
    held_metrics: dict[str, int] = dataclasses.field(default_factory=dict)
    held_after: int = 0
    complete: bool = False
    error: str | None = None
    t_start: float = math.nan
    t_uploaded: float = math.nan
    t_held: float = math.nan
    t_release: float = math.nan
    t_end: float = math.nan
    #: Seconds from the request's first byte sent to the first answer byte received
    #: (for a batch: the last call's); CPU seconds (user + system) the process (for nginx:
    #: master and workers) spent from the first byte sent to the answer's end.
    ttfb_s: float = math.nan
    cpu_s: float = math.nan

    def growth(self, rss: int) -> float:
        """``(rss - idle_rss) / body_bytes`` (a multiple of B)."""
        return (rss - self.idle_rss) / self.body_bytes

    @property
    def peak(self) -> float:
        """Peak growth over idle, x B (the larger of the sampled peak and VmHWM)."""
        return self.growth(max(self.peak_rss, self.hwm_rss))

    @property
    def mid(self) -> float:
        """Mid-stream growth over idle, x B."""
        return self.growth(self.mid_rss)

    @property
    def after(self) -> float:
        """Growth over idle after the response, x B."""
        return self.growth(self.after_rss)

    @property
    def anon_peak(self) -> float:
        """Peak anonymous RSS growth over idle, x B (RssAnon: the process's own memory)."""
        return (self.peak_anon - self.idle_anon) / self.body_bytes

    @property
    def anon_mid(self) -> float:
        """Mid-stream anonymous RSS growth over idle, x B."""
        return (self.mid_anon - self.idle_anon) / self.body_bytes

    @property
    def file_peak(self) -> float:
        """Peak file-backed RSS growth over idle, x B (RssFile: a spooled body's mapping)."""
        return (self.peak_file - self.idle_file) / self.body_bytes

    @property
    def file_mid(self) -> float:
        """Mid-stream file-backed RSS growth over idle, x B."""
        return (self.mid_file - self.idle_file) / self.body_bytes

    @property
    def held_mid(self) -> int:
        """Bytes this proxy's own accounting said it held mid-stream (all exchanges)."""
        return sum(int(ex["held_bytes"]["total"]) for ex in self.held_admin)

    def to_json(self) -> dict[str, Any]:
        """Every field, plus the derived ratios."""
        data = dataclasses.asdict(self)
        data.update(
            peak_growth_x_body=self.peak,
            mid_growth_x_body=self.mid,
            after_growth_x_body=self.after,
            anon_peak_growth_x_body=self.anon_peak,
            anon_mid_growth_x_body=self.anon_mid,
            file_peak_growth_x_body=self.file_peak,
            file_mid_growth_x_body=self.file_mid,
            held_mid_bytes=self.held_mid,
        )
        return data


@dataclasses.dataclass(slots=True)
class ProcessRun:
    """Every sample of one proxy process, and its RSS timeline."""

    proxy: str
    variant: str | None
    protocol: str
    samples: list[Sample]
    pid: int
    times: list[float]
    rss: list[int]
    marks: list[tuple[float, str]]
    anon: list[int] = dataclasses.field(default_factory=list)
    file: list[int] = dataclasses.field(default_factory=list)


@dataclasses.dataclass(slots=True)
class Bench:
    """What every case of one run shares: HTTP session, emulator, logs, options."""

    session: aiohttp.ClientSession
    emulator: Service
    control: EmulatorControl
    log_dir: Path
    interval: float
    proxy_env: dict[str, str]
    proxy_module: str
    max_body: int
    #: The nginx binary (None: not installed, no nginx column).
    nginx: str | None = None
    keys: itertools.count[int] = dataclasses.field(default_factory=itertools.count)

    def key(self) -> str:
        """A fresh hold key."""
        return f"mem{next(self.keys)}"

    def start(self, proxy: str, variant: Variant | None, name: str) -> Service:
        """Start a fresh process of ``proxy`` (``ours``, ``naive`` or ``nginx``)."""
        if proxy == "naive":
            return start_naive(self.emulator.url, self.log_dir, name=name)
        if proxy == "nginx":
            assert self.nginx is not None
            return start_nginx(self.nginx, self.emulator.url, self.log_dir, name=name)
        assert variant is not None
        return start_proxy(
            self.emulator.url,
            self.log_dir,
            plugins=variant.plugins,
            fake_completion_retries=variant.retries,
            max_body_bytes=self.max_body,
            env={**self.proxy_env, **dict(variant.env)},
            module=self.proxy_module,
            name=name,
        )


@contextlib.asynccontextmanager
async def open_bench(args: SimpleNamespace, log_dir: Path, max_body: int) -> AsyncIterator[Bench]:
    """An HTTP session and a running emulator for one benchmark run.

    Reads ``interval``, ``proxy_env`` and ``proxy_module`` from ``args``;
    ``max_body`` (bytes) becomes this proxy's ``max_body_bytes``. The client
    pool is unbounded (500 held streams need 500 connections).
    """
    async with open_client_and_emulator(log_dir) as (session, emulator):
        yield Bench(
            session=session,
            emulator=emulator,
            control=EmulatorControl(session, emulator.url),
            log_dir=log_dir,
            interval=args.interval,
            proxy_env=dict(args.proxy_env),
            proxy_module=args.proxy_module,
            max_body=max_body,
        )


def _script(protocol: BenchProtocol, key: str, hold: str, overflow_above: int = 0) -> str:
    after = protocol.first_delta_event if hold == "delta" else 1
    script = f"hold={key}; stall_after={after}; chunks=8"
    return f"{script}; overflow_above={overflow_above}" if overflow_above else script


async def _warm_up(
    bench: Bench,
    svc: Service,
    sampler: RssSampler,
    protocol: BenchProtocol,
    body: bytes,
    hold: str,
    ours: bool,
) -> None:
    # Imports, the upstream connection pool, first-use caches and the
    # connections the measurement itself opens (its admin and metrics probes
    # while an answer is held) happen here, with the same steps as a measured
    # request, so the idle baseline is that of a proxy that has served this
    # traffic: what stays afterwards is per-connection state, not body memory.
    warm = await measure_batch(bench, svc, sampler, protocol, body, 1, hold, (0, 0, 0), ours)
    if not warm.complete:
        raise RuntimeError(f"{svc.name}: warm-up request failed: {warm.error}")


async def measure_batch(
    bench: Bench,
    svc: Service,
    sampler: RssSampler,
    protocol: BenchProtocol,
    body: bytes,
    count: int,
    hold: str,
    idle: tuple[int, int, int],
    ours: bool,
    overflow: float = 0.0,
) -> Sample:
    """Send ``count`` concurrent copies of ``body`` through ``svc``, hold their answers
    open, sample, release, and measure what is left (one :class:`Sample`, whose
    ``body_bytes`` is ``count * len(body)``).

    Raises:
        TimeoutError: the batch did not reach its hold or end within 10 minutes.
    """
    sample = Sample(
        body_bytes=count * len(body), idle_rss=idle[0], idle_anon=idle[1], idle_file=idle[2]
    )
    sample.before_rss = await median_rss(sampler, _WINDOW)
    key = bench.key()
    script = _script(protocol, key, hold, int(overflow * len(body)))
    for pid in sampler.pids:
        reset_vm_hwm(pid)
    cpu_before = sum(cpu_seconds(pid) for pid in sampler.pids)
    sample.t_start = sampler.mark("send")
    calls = [
        StreamCall(bench.session, svc.url, protocol, body, script=script, clock=sampler.now)
        for _ in range(count)
    ]
    try:
        async with asyncio.timeout(_REQUEST_TIMEOUT):
            await bench.control.wait_holding(key, count, within=_REQUEST_TIMEOUT)
            if hold == "delta" or not ours:
                for call in calls:
                    await call.first_byte.wait()
            else:
                # Gated (retry armed): the clients see nothing yet; wait until this
                # proxy has the upstream's headers for all, i.e. they sit in the gate.
                while True:
                    exchanges = await admin_exchanges(bench.session, svc.url)
                    if sum(ex["phase"] in _PHASES_OPEN for ex in exchanges) >= count:
                        break
                    await asyncio.sleep(0.01)
        sample.t_uploaded = max(call.outcome.upload_done for call in calls)
        sample.t_held = sampler.mark("held")
        sample.mid_rss = await median_rss(sampler, _WINDOW)
        sample.mid_anon = sampler.median_of(sampler.anon, sample.t_held, sampler.now())
        sample.mid_file = sampler.median_of(sampler.file, sample.t_held, sampler.now())
        if ours:
            sample.held_admin = await admin_exchanges(bench.session, svc.url)
            sample.held_metrics = await held_metrics(bench.session, svc.url)
        sample.upstream_bytes = await bench.control.body_bytes(key)
        sample.t_release = sampler.mark("release")
        await bench.control.release(key)
        outcomes = [await call.result(_REQUEST_TIMEOUT) for call in calls]
        sample.cpu_s = sum(cpu_seconds(pid) for pid in sampler.pids) - cpu_before
        failed = [o for o in outcomes if not o.complete]
        sample.complete = not failed
        sample.error = failed[0].error if failed else None
        sample.t_end = sampler.mark("end")
        firsts = [o.first_byte_at for o in outcomes]
        if not any(math.isnan(first) for first in firsts):
            sample.ttfb_s = max(firsts) - sample.t_start
        if ours:
            await wait_proxy_idle(bench.session, svc.url)
            sample.held_after = sum((await held_metrics(bench.session, svc.url)).values())
        await asyncio.sleep(_SETTLE)
        sample.after_rss = await median_rss(sampler, _WINDOW)
        sample.peak_rss = sampler.peak(sample.t_start, sampler.now())
        # Per process; summed, an upper bound of the processes' joint peak (nginx's
        # master holds still while its worker works).
        sample.hwm_rss = sum(read_vm_hwm(pid) for pid in sampler.pids)
        sample.peak_anon = sampler.peak_of(sampler.anon, sample.t_start, sample.t_end)
        sample.peak_file = sampler.peak_of(sampler.file, sample.t_start, sample.t_end)
    finally:
        if not all(call.task.done() for call in calls):
            await bench.control.release(key)
            for call in calls:
                await call.cancel()
    svc.check_alive()
    return sample


async def run_process(
    bench: Bench,
    proxy: str,
    variant: Variant | None,
    protocol: BenchProtocol,
    bodies: Sequence[bytes],
    warmup: bytes,
    hold: str,
    *,
    concurrency: int = 1,
) -> ProcessRun:
    """Start a fresh ``proxy`` process, warm it up and send ``bodies`` one after another
    (each as ``concurrency`` concurrent copies, see :func:`measure_batch`).

    Raises:
        ServiceError: the process did not start or died.
        TimeoutError: a request hung past 10 minutes.
    """
    name = f"{proxy}-{variant.name if variant else 'baseline'}-{protocol.value}"
    svc = bench.start(proxy, variant, name)
    async with svc:
        await svc.wait_ready(bench.session)
        # nginx: the master and its workers, all of them counted.
        also = nginx_pids(svc.pid)[1:] if proxy == "nginx" else ()
        sampler = RssSampler(svc.pid, bench.interval, also=also).start()
        try:
            ours = proxy == "ours"
            await _warm_up(bench, svc, sampler, protocol, warmup, hold, ours)
            # Idle as a user's proxy is idle: past its idle trim.
            await asyncio.sleep(DEFAULT_IDLE_AFTER + _SETTLE)
            since = sampler.now()
            idle_rss = await median_rss(sampler, _WINDOW)
            now = sampler.mark("idle")
            idle = (
                idle_rss,
                sampler.median_of(sampler.anon, since, now),
                sampler.median_of(sampler.file, since, now),
            )
            overflow = variant.overflow if variant is not None else 0.0
            samples = [
                await measure_batch(
                    bench, svc, sampler, protocol, body, concurrency, hold, idle, ours, overflow
                )
                for body in bodies
            ]
        finally:
            sampler.stop()
    return ProcessRun(
        proxy=proxy,
        variant=variant.name if variant else None,
        protocol=protocol.value,
        samples=samples,
        pid=svc.pid,
        times=sampler.times,
        rss=sampler.rss,
        marks=sampler.marks,
        anon=sampler.anon,
        file=sampler.file,
    )


# --------------------------------------------------------------------------- options


def _sizes(text: str) -> list[float]:
    try:
        sizes = [float(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise click.BadParameter(f"expected MiB numbers like 1,16,64: {text!r}") from None
    if not sizes or any(size <= 0 for size in sizes):
        raise click.BadParameter("sizes must be positive MiB numbers")
    return sizes


def _choices(allowed: Sequence[str]) -> Callable[[str], list[str]]:
    def parse(text: str) -> list[str]:
        items = [part.strip() for part in text.split(",") if part.strip()]
        bad = [item for item in items if item not in allowed]
        if bad or not items:
            raise click.BadParameter(f"choose from {', '.join(allowed)}: {text!r}")
        return items

    return parse


def _env_pair(text: str) -> tuple[str, str]:
    name, sep, value = text.partition("=")
    if not sep or not name:
        raise click.BadParameter(f"expected NAME=VALUE, got {text!r}")
    return name, value


def converted(convert: Callable[[str], Any]) -> Any:
    """A click callback applying ``convert`` to a string option (or to each of a repeated one)."""

    def callback(ctx: click.Context, param: click.Parameter, value: Any) -> Any:
        if isinstance(value, tuple):
            return [convert(item) for item in value]
        return convert(value) if isinstance(value, str) else value

    return callback


#: The ``--out`` option every benchmark command has.
out_option: Final = click.option(
    "--out", type=click.Path(path_type=Path), default=Path("bench-results"), help="output dir"
)


#: Click settings shared by the benchmark commands.
@click.command(
    context_settings=CONTEXT_SETTINGS,
    help="Request-memory lifetime of context-proxy against a naive proxy.",
)
@click.option(
    "--sizes", default="1,16,64", callback=converted(_sizes), help="body sizes, MiB [1,16,64]"
)
@click.option(
    "--protocols",
    default=",".join(p.value for p in BenchProtocol),
    callback=converted(_choices([p.value for p in BenchProtocol])),
    help="chat,responses,messages [all]",
)
@click.option(
    "--variants",
    default=",".join(VARIANTS),
    callback=converted(_choices(list(VARIANTS))),
    help="plain,heap,plugin,retry,edit,refold [all]",
)
@click.option("--repeats", type=click.IntRange(min=1), default=3, help="requests per case [3]")
@click.option(
    "--sequential",
    type=click.IntRange(min=0),
    default=20,
    help="back-to-back requests for the RSS-after trend (0: skip) [20]",
)
@click.option("--sequential-size", type=float, default=16.0, help="MiB per sequential request [16]")
@click.option(
    "--turns",
    type=click.IntRange(min=0),
    default=50,
    help="small turns per round (--repeats rounds), CPU with the spool on and off (0: skip) [50]",
)
@click.option(
    "--turn-kb", type=click.FloatRange(min=1), default=100.0, help="KB per small turn [100]"
)
@click.option(
    "--out", type=click.Path(path_type=Path), default=Path("bench-results"), help="output dir"
)
@click.option(
    "--publish",
    is_flag=True,
    help="also write docs/bench-memory.png, .json and .md (for the README)",
)
@click.option("--publish-dir", type=click.Path(path_type=Path), default=Path("docs"), help="[docs]")
@click.option(
    "--publish-name",
    default="bench-memory",
    help="file name the published copies get in --publish-dir, before the suffix [bench-memory]",
)
@click.option(
    "--replot",
    type=click.Path(path_type=Path, exists=True, dir_okay=False),
    metavar="JSON",
    help="run nothing: redraw memory.png in --out (and, with --publish, "
    "bench-memory.png) from an earlier memory.json",
)
@click.option(
    "--proxy-env",
    multiple=True,
    callback=converted(_env_pair),
    metavar="NAME=VALUE",
    help="environment variable for this proxy's process (repeatable), "
    "e.g. MALLOC_MMAP_THRESHOLD_=1048576",
)
@click.option(
    "--proxy-module",
    default="proxy",
    help="run this proxy as `python -m MODULE serve` (a locally patched build) [proxy]",
)
@click.option("--interval", type=float, default=0.005, help="RSS sampling interval, s [0.005]")
@click.option("--quiet", is_flag=True, help="no progress bar")
@click.pass_context
def command(ctx: click.Context, /, **options: Any) -> int:
    """``context-proxy bench memory``: the options become the ``args`` of :func:`collect`."""
    args = SimpleNamespace(**options, argv=list(ctx.obj or []))
    return _run(args)


# --------------------------------------------------------------------------- running


@dataclasses.dataclass(slots=True)
class Case:
    """One (size, protocol) pair with its processes' results; ``body_bytes`` is B (for a
    concurrent batch, N x B). ``label`` names it in tables (default: size and protocol)."""

    size_mib: float
    protocol: BenchProtocol
    body_bytes: int
    ours: dict[str, ProcessRun] = dataclasses.field(default_factory=dict)
    naive: ProcessRun | None = None
    label: str = ""
    #: nginx spooling bodies to a file (None: not installed, or not run).
    nginx: ProcessRun | None = None
    #: This proxy's ``spool_above_bytes`` in the run (0: never spool); bodies over it are
    #: spooled by every variant but ``heap``.
    spool_above: int = SPOOL_ABOVE_DEFAULT

    @property
    def spooled(self) -> bool:
        """Whether this case's body goes to the spool (the variants that keep the default)."""
        return 0 < self.spool_above < self.body_bytes

    @property
    def title(self) -> str:
        """``16 MiB chat (B = 16,784,604 bytes)`` or the label."""
        name = self.label or f"{self.size_mib:g} MiB {self.protocol.value}"
        return f"{name} (B = {self.body_bytes:,} bytes)"


@dataclasses.dataclass(slots=True)
class Results:
    """Everything one run measured."""

    cases: list[Case]
    sequential: list[ProcessRun]
    variants: list[Variant]
    wall_s: float
    started: datetime.datetime
    refold_cpu: list[RefoldCpu] = dataclasses.field(default_factory=list)
    turn_cpu: TurnCpu | None = None
    #: Why there is no nginx column (None: there is one).
    nginx_skipped: str | None = None


@dataclasses.dataclass(slots=True)
class TurnCpu:
    """CPU per request of small turns below the spool threshold, spool on against off.

    Two processes of this proxy, default settings (``on``) and ``spool_above_bytes = 0``
    (``off``), each sent ``turns`` streamed requests of ``body_bytes`` one after the
    other per round; ``on`` and ``off`` hold each round's CPU seconds per request
    (user + system of the process), rounds alternating which process goes first.
    """

    protocol: str
    body_bytes: int
    turns: int
    on: list[float] = dataclasses.field(default_factory=list)
    off: list[float] = dataclasses.field(default_factory=list)
    failures: int = 0

    @property
    def ratio(self) -> float:
        """Median CPU per request with the spool on over the median with it off."""
        return _ratio(rpt.stat(self.on), rpt.stat(self.off))


@dataclasses.dataclass(frozen=True, slots=True)
class SpoolCost:
    """Time to first byte and CPU per request of one case's spooled bodies (the ``plain``
    variant) against the same bodies in the heap (``heap``), from the same run.

    Each :class:`~benchmarks._report.Stat` is over the case's complete samples, in
    seconds (:attr:`Sample.ttfb_s`, :attr:`Sample.cpu_s`).
    """

    label: str
    body_bytes: int
    ttfb_spooled: rpt.Stat
    ttfb_heap: rpt.Stat
    cpu_spooled: rpt.Stat
    cpu_heap: rpt.Stat

    @property
    def ttfb_ratio(self) -> float:
        """Median time to first byte, spooled over heap."""
        return _ratio(self.ttfb_spooled, self.ttfb_heap)

    @property
    def cpu_ratio(self) -> float:
        """Median CPU seconds per request, spooled over heap."""
        return _ratio(self.cpu_spooled, self.cpu_heap)


def spool_costs(cases: Sequence[Case]) -> list[SpoolCost]:
    """A :class:`SpoolCost` for every case whose body is spooled and that ran both the
    ``plain`` and the ``heap`` variant."""
    costs = []
    for case in cases:
        plain, heap = case.ours.get("plain"), case.ours.get("heap")
        if plain is None or heap is None or not case.spooled:
            continue
        costs.append(
            SpoolCost(
                label=case.label or f"{case.size_mib:g} MiB {case.protocol.value}",
                body_bytes=case.body_bytes,
                ttfb_spooled=_stats(plain.samples, "ttfb_s"),
                ttfb_heap=_stats(heap.samples, "ttfb_s"),
                cpu_spooled=_stats(plain.samples, "cpu_s"),
                cpu_heap=_stats(heap.samples, "cpu_s"),
            )
        )
    return costs


def no_worse(ours: rpt.Stat, base: rpt.Stat) -> str:
    """PASS when ``ours``' median is at most ``base``'s, or within ``base``'s own spread
    (at most its largest sample: a difference the repeats of one configuration show
    too); MISS otherwise or when either has no samples."""
    if not ours.n or not base.n:
        return rpt.MISS
    return rpt.PASS if ours.median <= base.max else rpt.MISS


@dataclasses.dataclass(frozen=True, slots=True)
class RefoldCpu:
    """CPU seconds (median of ``repeats``) of one refold against a naive re-encode.

    ``ours_s``: a fresh structural view of the body, ``fold`` at level 1, the
    splice, its digest and iterating its send slices. ``naive_s``:
    ``json.loads`` then ``json.dumps`` of the same body. ``body_bytes`` is B;
    ``sent_bytes`` the refolded body's size.
    """

    protocol: str
    body_bytes: int
    sent_bytes: int
    ours_s: float
    naive_s: float

    @property
    def ratio(self) -> float:
        """``ours_s / naive_s``."""
        return self.ours_s / self.naive_s if self.naive_s > 0 else math.nan


def measure_refold_cpu(protocol: BenchProtocol, body: bytes, repeats: int = 3) -> RefoldCpu:
    """Time one refold of ``body`` in this process (see :class:`RefoldCpu`), in CPU seconds."""
    from plugins.fold import FoldPlugin
    from proxy._protocols import Protocol
    from proxy._structure import BodyView

    wire_protocol = {
        BenchProtocol.CHAT: Protocol.CHAT,
        BenchProtocol.RESPONSES: Protocol.RESPONSES,
        BenchProtocol.MESSAGES: Protocol.MESSAGES,
    }[protocol]
    fold = FoldPlugin()
    ours: list[float] = []
    naive: list[float] = []
    sent = 0
    for _ in range(repeats):
        start = time.process_time()
        view = BodyView(body, wire_protocol)
        if not fold.fold(view, level=1):
            raise RuntimeError(f"refold cpu: fold found nothing to elide in {protocol.value}")
        splice = view.splice()
        sent = sum(len(chunk) for chunk in splice.chunks(256 * 1024))
        del view, splice
        ours.append(time.process_time() - start)
        start = time.process_time()
        # What benchmarks/naive.py does to a body it forwards.
        json.dumps(json.loads(body)).encode()
        naive.append(time.process_time() - start)
    return RefoldCpu(
        protocol.value,
        len(body),
        sent,
        sorted(ours)[len(ours) // 2],
        sorted(naive)[len(naive) // 2],
    )


async def _send_turns(
    bench: Bench, svc: Service, protocol: BenchProtocol, body: bytes, count: int
) -> int:
    """Send ``count`` streamed requests of ``body`` through ``svc`` one after the other,
    each answer read to its end; returns how many did not answer 200."""
    failures = 0
    for _ in range(count):  # bounded: count requests of at most _REQUEST_TIMEOUT each
        async with asyncio.timeout(_REQUEST_TIMEOUT):
            async with bench.session.post(
                svc.url + protocol.path, data=body, headers=protocol.headers()
            ) as resp:
                await resp.read()
                failures += resp.status != 200
    return failures


async def measure_turn_cpu(
    bench: Bench, protocol: BenchProtocol, body: bytes, turns: int, rounds: int
) -> TurnCpu:
    """CPU per request of ``body`` (under the spool threshold) with the spool on and off
    (see :class:`TurnCpu`): both processes run side by side, ``rounds`` rounds of
    ``turns`` requests each after a warm-up of :data:`_TURN_WARMUP`.

    Raises:
        ServiceError: a process did not start or died.
        TimeoutError: a request hung past 10 minutes.
    """
    result = TurnCpu(protocol.value, len(body), turns)
    on = bench.start("ours", VARIANTS["plain"], f"ours-turns-spool-on-{protocol.value}")
    off = bench.start("ours", VARIANTS["heap"], f"ours-turns-spool-off-{protocol.value}")
    async with on, off:
        for svc in (on, off):
            await svc.wait_ready(bench.session)
            await _send_turns(bench, svc, protocol, body, _TURN_WARMUP)
        for round_no in range(rounds):
            # Alternate who goes first: a slow spell of the shared machine hits both.
            for svc, into in ((on, result.on), (off, result.off))[:: 1 if round_no % 2 else -1]:
                before = cpu_seconds(svc.pid)
                result.failures += await _send_turns(bench, svc, protocol, body, turns)
                into.append((cpu_seconds(svc.pid) - before) / turns)
        on.check_alive()
        off.check_alive()
    return result


async def collect(args: SimpleNamespace, reporter: rpt.Reporter, log_dir: Path) -> Results:
    """Run the benchmark described by ``args`` (the options of :data:`command`).

    Server logs go to ``log_dir``. Raises :class:`~benchmarks._harness.ServiceError`
    when a server did not start or died (its log is named), ``TimeoutError`` when a
    request hung.
    """
    started = time.monotonic()
    started_wall = datetime.datetime.now(datetime.UTC)
    protocols = [BenchProtocol(p) for p in args.protocols]
    variants = [VARIANTS[v] for v in args.variants]
    biggest = max([*args.sizes, args.sequential_size if args.sequential else 0.0])
    seq_variants = [v for v in variants if v.name in ("plain", "plugin")]
    nginx = find_nginx()
    nginx_skipped = None if nginx else "nginx is not installed (PATH, /usr/sbin): no nginx column"
    if nginx_skipped:
        reporter.note(f"[yellow]skipped:[/yellow] {nginx_skipped}")
    spool_above = int(dict(args.proxy_env).get(_SPOOL_ENV, SPOOL_ABOVE_DEFAULT))
    steps = len(args.sizes) * len(protocols) * (len(variants) + 1 + bool(nginx))
    steps += (len(seq_variants) + 1) if args.sequential else 0
    steps += bool(args.turns)
    turn_cpu: TurnCpu | None = None
    corpus = Corpus.load()
    cases: list[Case] = []
    sequential: list[ProcessRun] = []
    refold_cpu: list[RefoldCpu] = []
    max_body = max(100 * MiB, int(biggest * MiB * 2))
    async with open_bench(args, log_dir, max_body) as bench:
        bench.nginx = nginx
        with reporter.progress(steps, "memory") as progress:
            for size in args.sizes:
                for protocol in protocols:
                    body = build_body(protocol, int(size * MiB), corpus)
                    warmup = build_body(protocol, _WARMUP_BYTES, corpus, seed=2)
                    case = Case(size, protocol, len(body), spool_above=spool_above)
                    cases.append(case)
                    bodies = [body] * args.repeats
                    agent: bytes | None = None
                    for variant in variants:
                        progress.describe(f"{size:g} MiB {protocol.value} ours/{variant.name}")
                        await bench.control.reset()
                        sent = bodies
                        if variant.workload == "agent":
                            agent = agent or build_agent_history(protocol, int(size * MiB), corpus)
                            sent = [agent] * args.repeats
                        case.ours[variant.name] = await run_process(
                            bench, "ours", variant, protocol, sent, warmup, variant.hold
                        )
                        progress.advance()
                    if agent is not None and size == max(args.sizes):
                        refold_cpu.append(measure_refold_cpu(protocol, agent))
                    del agent
                    progress.describe(f"{size:g} MiB {protocol.value} naive")
                    await bench.control.reset()
                    case.naive = await run_process(
                        bench, "naive", None, protocol, bodies, warmup, "delta"
                    )
                    progress.advance()
                    if nginx:
                        progress.describe(f"{size:g} MiB {protocol.value} nginx")
                        await bench.control.reset()
                        case.nginx = await run_process(
                            bench, "nginx", None, protocol, bodies, warmup, "delta"
                        )
                        progress.advance()
                    del body, bodies
            if args.turns:
                # A Claude Code turn: an Anthropic messages request of ~100 KB, streamed.
                progress.describe(f"{args.turn_kb:g} KB turns, spool on / off")
                await bench.control.reset()
                turn_body = build_body(BenchProtocol.MESSAGES, int(args.turn_kb * 1000), corpus)
                turn_cpu = await measure_turn_cpu(
                    bench, BenchProtocol.MESSAGES, turn_body, args.turns, args.repeats
                )
                progress.advance()
            if args.sequential:
                protocol = protocols[0]
                body = build_body(protocol, int(args.sequential_size * MiB), corpus)
                warmup = build_body(protocol, _WARMUP_BYTES, corpus, seed=2)
                bodies = [body] * args.sequential
                for seq_variant in [*seq_variants, None]:
                    label = seq_variant.name if seq_variant else "naive"
                    progress.describe(f"sequential {label}")
                    await bench.control.reset()
                    sequential.append(
                        await run_process(
                            bench,
                            "ours" if seq_variant else "naive",
                            seq_variant,
                            protocol,
                            bodies,
                            warmup,
                            "delta",
                        )
                    )
                    progress.advance()
    return Results(
        cases,
        sequential,
        variants,
        time.monotonic() - started,
        started_wall,
        refold_cpu,
        turn_cpu=turn_cpu,
        nginx_skipped=nginx_skipped,
    )


def write_outputs(args: SimpleNamespace, results: Results, reporter: rpt.Reporter) -> list[Path]:
    """Print the tables and write JSON, Markdown and PNG (and the published copies).

    Returns the paths written.
    """
    cases, sequential, variants = results.cases, results.sequential, results.variants
    doc = _document(args, cases, sequential, variants, results.wall_s, results.started)
    doc["refold_cpu"] = [
        {**dataclasses.asdict(row), "ratio": row.ratio, "limit": REFOLD_CPU_LIMIT}
        for row in results.refold_cpu
    ]
    costs = spool_costs(cases)
    doc["spool_cost"] = [
        {
            "label": cost.label,
            "body_bytes": cost.body_bytes,
            **{
                name: getattr(cost, name).as_dict()
                for name in ("ttfb_spooled", "ttfb_heap", "cpu_spooled", "cpu_heap")
            },
            "ttfb_ratio": cost.ttfb_ratio,
            "cpu_ratio": cost.cpu_ratio,
            "ttfb_pass": no_worse(cost.ttfb_spooled, cost.ttfb_heap) == rpt.PASS,
            "cpu_pass": no_worse(cost.cpu_spooled, cost.cpu_heap) == rpt.PASS,
        }
        for cost in costs
    ]
    turns = results.turn_cpu
    doc["turn_cpu"] = (
        None
        if turns is None
        else {
            **dataclasses.asdict(turns),
            "ratio": turns.ratio,
            "pass": no_worse(rpt.stat(turns.on), rpt.stat(turns.off)) == rpt.PASS,
        }
    )
    doc["nginx_skipped"] = results.nginx_skipped
    tables = build_tables(cases, sequential, variants, args.repeats)
    if results.nginx_skipped:
        tables[1].notes.append(f"Skipped: {results.nginx_skipped}.")
    if costs:
        tables.append(spool_cost_table(costs))
    if turns is not None:
        tables.append(turn_cpu_table(turns))
    if results.refold_cpu:
        tables.append(refold_cpu_table(results.refold_cpu))
    for table in tables:
        reporter.print_table(table)
    out: Path = args.out
    out.mkdir(parents=True, exist_ok=True)
    rpt.write_json(out / "memory.json", doc)
    rpt.write_markdown(out / "memory.md", tables, _preamble(args, results.wall_s))
    plot_memory(out / "memory.png", doc)
    paths = [out / "memory.json", out / "memory.md", out / "memory.png"]
    if args.publish:
        docs: Path = args.publish_dir
        docs.mkdir(parents=True, exist_ok=True)
        for src in list(paths):
            target = docs / f"{args.publish_name}{src.suffix}"
            shutil.copyfile(src, target)
            paths.append(target)
    reporter.note(f"wall time {results.wall_s:.0f} s; wrote " + ", ".join(map(str, paths)))
    return paths


# --------------------------------------------------------------------------- results


def _stats(samples: Sequence[Sample], attr: str) -> rpt.Stat:
    return rpt.stat(getattr(s, attr) for s in samples if s.complete)


def _ratio(ours: rpt.Stat, naive: rpt.Stat) -> float:
    if math.isnan(ours.median) or math.isnan(naive.median) or naive.median <= 0:
        return math.nan
    return ours.median / naive.median


def _held_text(samples: Sequence[Sample]) -> str:
    if not samples:
        return "n/a"
    held = sorted(samples, key=lambda s: s.held_mid)[len(samples) // 2]
    phases = sorted({str(ex["phase"]) for ex in held.held_admin})
    kinds = {
        kind: sum(int(ex["held_bytes"][kind]) for ex in held.held_admin)
        for kind in ("raw", "parsed", "outbound", "response")
    }
    detail = ", ".join(f"{k} {rpt.fmt_bytes(v)}" for k, v in kinds.items() if v)
    where = "/".join(phases) or "-"
    return f"{rpt.fmt_bytes(held.held_mid)} ({where}{': ' + detail if detail else ''})"


_FIGURE_ATTR: Final = {
    "peak": "peak",
    "mid-stream": "mid",
    "after": "after",
    "anon peak": "anon_peak",
    "anon mid-stream": "anon_mid",
}
#: Figures shown beside the targets, with none of their own.
_INFO_FIGURES: Final = {"file peak": "file_peak", "file mid-stream": "file_mid"}


def _checks(case: Case, variant: Variant) -> list[tuple[str, str, rpt.Stat, float]]:
    run = case.ours[variant.name]
    checks = [
        ("peak", f"<= {variant.peak_limit:g}", _stats(run.samples, "peak"), variant.peak_limit),
        ("mid-stream", f"<= {variant.mid_limit:g}", _stats(run.samples, "mid"), variant.mid_limit),
        ("after", f"<= {AFTER_LIMIT:g}", _stats(run.samples, "after"), AFTER_LIMIT),
    ]
    # Anonymous memory targets apply to bodies the spool takes (over its threshold).
    if case.spooled:
        for figure, attr, limit in (
            ("anon peak", "anon_peak", variant.anon_peak_limit),
            ("anon mid-stream", "anon_mid", variant.anon_mid_limit),
        ):
            if limit is not None:
                checks.append((figure, f"<= {limit:g}", _stats(run.samples, attr), limit))
    return checks


def build_tables(
    cases: Sequence[Case],
    sequential: Sequence[ProcessRun],
    variants: Sequence[Variant],
    repeats: int,
    *,
    title: str = "",
) -> list[rpt.Table]:
    """The summary of targets, the per-case table and (with ``sequential``) the trend table.

    ``title`` replaces the per-case table's title.
    """
    main_table = rpt.Table(
        title=title
        or (
            "Memory: RSS growth over the idle process, as a multiple of the body size B "
            f"(median [min, max] of {repeats} requests)"
        ),
        columns=(
            "variant",
            "figure",
            "ours",
            "naive",
            "nginx",
            "target",
            "verdict",
        ),
    )
    # What the proxy says it holds mid-stream (GET /admin/exchanges) beside what RSS
    # shows; its own table keeps the figures table within 80 columns.
    held_table = rpt.Table(
        title="This proxy's own accounting mid-stream: GET /admin/exchanges, total (phase: kinds)",
        columns=("variant", "held"),
    )
    # (figure, variant) -> size label -> worst median over protocols, and the limit.
    worst: dict[str, dict[str, float]] = {}
    limits: dict[str, float] = {}
    sizes: list[str] = []
    for case in cases:
        size_label = case.label or f"{case.size_mib:g} MiB"
        if size_label not in sizes:
            sizes.append(size_label)
        main_table.section(case.title)
        held_table.section(case.title)
        naive = case.naive.samples if case.naive else []
        nginx = case.nginx.samples if case.nginx else None
        for variant in variants:
            run = case.ours[variant.name]
            for figure, target, value, limit in _checks(case, variant):
                naive_stat = _stats(naive, _FIGURE_ATTR[figure])
                ok = rpt.verdict(value.median, limit)
                main_table.add(
                    variant.name,
                    figure,
                    rpt.fmt_ratio(value),
                    # Medians only for the naive proxy and nginx: their ranges are in the JSON.
                    rpt.fmt_ratio(naive_stat.median) if naive_stat.n else "n/a",
                    _median_text(nginx, _FIGURE_ATTR[figure]),
                    target,
                    ok,
                )
                if figure == "mid-stream":
                    held_table.add(variant.name, _held_text(run.samples))
                key = f"{figure} ({variant.name})"
                limits[key] = limit
                per_size = worst.setdefault(key, {})
                if not value.median <= per_size.get(size_label, -math.inf):
                    per_size[size_label] = value.median
            # RssAnon and RssFile apart, every variant (with a target above where one is set).
            checked = {c[0] for c in _checks(case, variant)}
            for info, attr in {
                "anon peak": "anon_peak",
                "anon mid-stream": "anon_mid",
                **_INFO_FIGURES,
            }.items():
                if info in checked:
                    continue
                info_stat = _stats(run.samples, attr)
                naive_info = _stats(naive, attr)
                main_table.add(
                    variant.name,
                    info,
                    rpt.fmt_ratio(info_stat),
                    rpt.fmt_ratio(naive_info.median) if naive_info.n else "n/a",
                    _median_text(nginx, attr),
                    "-",
                    "-",
                )
            failed = [s for s in run.samples if not s.complete]
            if failed:
                main_table.notes.append(
                    f"{case.title} {variant.name}: "
                    f"{len(failed)} request(s) failed: {failed[0].error}"
                )
    main_table.notes.extend(
        [
            "peak: max RSS during the request (5 ms samples and VmHWM); mid-stream: answer held "
            "open by the upstream; after: 200 ms after the response ended. Growth is over the "
            "idle RSS of the same process before its first large request. anon / file: the "
            "anonymous (RssAnon) and file-backed (RssFile) parts of RSS, from /proc/PID/status: "
            "a spooled body is read through a file mapping, which is RssFile. nginx: a "
            "reverse proxy that spools request bodies over "
            f"{BODY_BUFFER_BYTES // 1024} KiB to a temporary file (master and worker "
            "counted; '-': nginx not run).",
            *(f"{v.name}: {v.description}." for v in variants),
        ]
    )
    tables = [main_table, held_table]
    seq_size = ""
    if sequential and sequential[0].samples:
        seq_size = f"{sequential[0].samples[0].body_bytes / MiB:.0f} MiB"
        if seq_size not in sizes:
            sizes.append(seq_size)
    summary = rpt.Table(
        title=(
            "Targets: this proxy's RSS growth x B, worst protocol per size "
            f"(median of {repeats}), against the limit"
        ),
        columns=("target", "limit", *sizes),
    )
    for key, per_size in worst.items():
        limit = limits[key]
        summary.add(
            key,
            f"{limit:g}",
            *(
                f"{rpt.fmt_ratio(per_size[size])} {rpt.verdict(per_size[size], limit)}"
                if size in per_size
                else "-"
                for size in sizes
            ),
        )
    if sequential:
        tables.append(_sequential_table(sequential))
        for seq in sequential:
            if seq.proxy == "ours" and seq.samples:
                last = seq.samples[-1].after
                summary.add(
                    f"after {len(seq.samples)} in a row ({seq.variant})",
                    f"{AFTER_LIMIT:g}",
                    *(
                        f"{rpt.fmt_ratio(last)} {rpt.verdict(last, AFTER_LIMIT)}"
                        if size == seq_size
                        else "-"
                        for size in sizes
                    ),
                )
    summary.notes.append(
        "Each cell: the largest median over the protocols at that size, then PASS or MISS."
    )
    tables.insert(0, summary)
    return tables


def _median_text(samples: Sequence[Sample] | None, attr: str) -> str:
    """The median of ``attr`` over ``samples`` as a table cell; ``-`` when not run."""
    if samples is None:
        return "-"
    value = _stats(samples, attr)
    return rpt.fmt_ratio(value.median) if value.n else "n/a"


def _ms(value: rpt.Stat) -> str:
    """Seconds as ``median [min, max]`` in milliseconds: three significant digits, whole
    milliseconds from 100 ms."""
    if not value.n:
        return "n/a"
    lo, mid, hi = (
        f"{ms:.0f}" if ms >= 100 else f"{ms:.3g}"
        for ms in (v * 1000 for v in (value.min, value.median, value.max))
    )
    return f"{mid} [{lo}, {hi}]"


def spool_cost_table(costs: Sequence[SpoolCost]) -> rpt.Table:
    """Time to first byte and CPU per request, spooled against heap bodies (same run)."""
    table = rpt.Table(
        title="Spooled bodies against heap bodies: time to first byte and CPU per request",
        columns=("figure", "spooled", "heap", "÷ heap", "target", "verdict"),
    )
    for cost in costs:
        table.section(f"{cost.label} (B = {cost.body_bytes:,} bytes)")
        for figure, ours, base, ratio in (
            ("TTFB, ms", cost.ttfb_spooled, cost.ttfb_heap, cost.ttfb_ratio),
            ("CPU/request, ms", cost.cpu_spooled, cost.cpu_heap, cost.cpu_ratio),
        ):
            table.add(
                figure,
                _ms(ours),
                _ms(base),
                rpt.fmt_ratio(ratio),
                "<= heap",
                no_worse(ours, base),
            )
    table.notes.extend(
        [
            "median [min, max] of the repeats; spooled: the plain variant, heap: the same "
            "bodies with spool_above_bytes = 0. TTFB (time to first byte): from the first "
            "byte sent to the first answer byte (the whole upload, then the upstream's first "
            "event). CPU: user + system seconds of the proxy process (its CPU-time clock, "
            "what /proc/PID/stat counts in ticks) from the first byte sent to the answer's end.",
            "verdict: PASS when the spooled median is at most the heap's largest sample "
            "(within the heap path's own spread).",
        ]
    )
    return table


def turn_cpu_table(turns: TurnCpu) -> rpt.Table:
    """CPU per small turn with the spool on against off (same run)."""
    on, off = rpt.stat(turns.on), rpt.stat(turns.off)
    table = rpt.Table(
        title=(
            f"Below the spool threshold: CPU per {turns.body_bytes / 1000:.0f} KB "
            f"{turns.protocol} turn, spool on against off"
        ),
        columns=("figure", "spool on", "spool off", "÷ off", "target", "verdict"),
    )
    table.add(
        "CPU/request, ms",
        _ms(on),
        _ms(off),
        rpt.fmt_ratio(turns.ratio),
        "<= off",
        no_worse(on, off),
    )
    table.notes.append(
        f"median [min, max] over {len(turns.on)} rounds of {turns.turns} streamed turns "
        "one after the other, per process; spool on: the defaults (spool_above_bytes = "
        f"{SPOOL_ABOVE_DEFAULT:,}), off: 0. CPU: user + system of the process. verdict: "
        "PASS when on's median is at most off's largest round."
        + (f" {turns.failures} request(s) failed." if turns.failures else "")
    )
    return table


def refold_cpu_table(rows: Sequence[RefoldCpu]) -> rpt.Table:
    """CPU of one refold against json.loads + json.dumps of the same body."""
    table = rpt.Table(
        title="CPU of one refold of the agent history (fold level 1), against a naive re-encode",
        columns=(
            "protocol",
            "B",
            "sent",
            "ours s",
            "naive s",
            "÷ naive",
            "target",
            "verdict",
        ),
    )
    for row in rows:
        table.add(
            row.protocol,
            rpt.fmt_bytes(row.body_bytes),
            rpt.fmt_bytes(row.sent_bytes),
            f"{row.ours_s:.3f}",
            f"{row.naive_s:.3f}",
            f"{row.ratio:.2f}",
            f"<= {REFOLD_CPU_LIMIT:g}",
            rpt.verdict(row.ratio, REFOLD_CPU_LIMIT),
        )
    table.notes.append(
        "CPU seconds, median of 3 in the benchmark process (time.process_time). ours: "
        "structural view, fold, splice, digest and send slices; naive: json.loads + json.dumps."
    )
    return table


def _sequential_table(runs: Sequence[ProcessRun]) -> rpt.Table:
    count = max(len(run.samples) for run in runs)
    picks = sorted({1, 2, 3, 5, 10, count} & set(range(1, count + 1)))
    table = rpt.Table(
        title="RSS after each of N back-to-back requests, growth over idle x B (trend)",
        columns=("proxy", *(f"#{i}" for i in picks), "max", "target", "verdict"),
    )
    for run in runs:
        afters = [s.after for s in run.samples]
        label = f"ours/{run.variant}" if run.proxy == "ours" else "naive"
        verdict = rpt.verdict(afters[-1], AFTER_LIMIT) if run.proxy == "ours" else "-"
        table.add(
            label,
            *(rpt.fmt_ratio(afters[i - 1]) for i in picks),
            rpt.fmt_ratio(max(afters)),
            f"<= {AFTER_LIMIT:g}" if run.proxy == "ours" else "-",
            verdict,
        )
    table.notes.append("verdict: RSS after the last request within 0.05 x B of the idle RSS.")
    return table


def run_json(run: ProcessRun | None) -> dict[str, Any] | None:
    """A process run as JSON: its samples and the median/min/max of each figure."""
    if run is None:
        return None
    return {
        "proxy": run.proxy,
        "variant": run.variant,
        "protocol": run.protocol,
        "samples": [s.to_json() for s in run.samples],
        "summary": {
            name: _stats(run.samples, name).as_dict()
            for name in ("peak", "mid", "after", "anon_peak", "anon_mid", "file_peak", "file_mid")
        },
    }


def _document(
    args: SimpleNamespace,
    cases: Sequence[Case],
    sequential: Sequence[ProcessRun],
    variants: Sequence[Variant],
    wall: float,
    started: datetime.datetime,
) -> dict[str, Any]:
    case_docs = []
    for case in cases:
        naive = case.naive.samples if case.naive else []
        ours_docs = {}
        for variant in variants:
            run = case.ours[variant.name]
            entry = run_json(run) or {}
            entry["targets"] = [
                {
                    "figure": figure,
                    "limit_x_body": limit,
                    "median_x_body": value.median,
                    "pass": rpt.verdict(value.median, limit) == rpt.PASS,
                }
                for figure, _, value, limit in _checks(case, variant)
            ]
            entry["ratio_to_naive"] = {
                name: _ratio(_stats(run.samples, name), _stats(naive, name))
                for name in ("peak", "mid", "after", "anon_peak", "anon_mid")
            }
            ours_docs[variant.name] = entry
        case_docs.append(
            {
                "size_mib": case.size_mib,
                "protocol": case.protocol.value,
                "body_bytes": case.body_bytes,
                "ours": ours_docs,
                "naive": run_json(case.naive),
                "nginx": run_json(case.nginx),
                "spool_above_bytes": case.spool_above,
            }
        )
    return {
        "benchmark": "memory",
        "started_at": started.isoformat(),
        "wall_s": wall,
        "command": " ".join(["context-proxy bench memory", *args.argv]),
        "machine": {
            "python": platform.python_version(),
            "platform": platform.platform(),
            "cpus": os.cpu_count(),
        },
        "options": {
            "sizes_mib": args.sizes,
            "protocols": args.protocols,
            "variants": {v.name: dataclasses.asdict(v) for v in variants},
            "repeats": args.repeats,
            "sequential": args.sequential,
            "sequential_size_mib": args.sequential_size,
            "interval_s": args.interval,
            "proxy_env": dict(args.proxy_env),
            "proxy_module": args.proxy_module,
            "after_limit_x_body": AFTER_LIMIT,
        },
        "cases": case_docs,
        "sequential": [run_json(run) for run in sequential],
        "timelines": _timelines(cases, sequential, variants),
    }


def _timeline(run: ProcessRun, points: int = 1500) -> dict[str, Any]:
    """The RSS timeline from the first large request on, x B over idle, thinned to ``points``."""
    first = run.samples[0]
    start = first.t_start
    rows = [
        (t, r, a, f)
        for t, r, a, f in zip(run.times, run.rss, run.anon, run.file, strict=False)
        if t >= start - 0.05
    ]
    step = max(1, len(rows) // points)
    # Keep each stride's maximum so thinning never hides a peak.
    thinned = [max(rows[i : i + step], key=lambda p: p[1]) for i in range(0, len(rows), step)]
    return {
        "proxy": run.proxy,
        "variant": run.variant,
        "protocol": run.protocol,
        "body_bytes": first.body_bytes,
        "t_s": [round(t - start, 4) for t, *_ in thinned],
        "growth_x_body": [round(first.growth(r), 4) for _, r, _, _ in thinned],
        "anon_growth_x_body": [
            round((a - first.idle_anon) / first.body_bytes, 4) for _, _, a, _ in thinned
        ],
        "file_growth_x_body": [
            round((f - first.idle_file) / first.body_bytes, 4) for _, _, _, f in thinned
        ],
        "marks": [(round(t - start, 4), label) for t, label in run.marks if t >= start],
    }


def _plotted_case(cases: Sequence[Case]) -> Case:
    """The case whose timeline is plotted: the largest size, its first protocol run."""
    largest = max(case.size_mib for case in cases)
    return next(case for case in cases if case.size_mib == largest)


def _timelines(
    cases: Sequence[Case], sequential: Sequence[ProcessRun], variants: Sequence[Variant]
) -> list[dict[str, Any]]:
    if not cases:
        return []
    biggest = _plotted_case(cases)
    runs = [biggest.ours[v.name] for v in variants]
    runs.extend(run for run in (biggest.naive, biggest.nginx) if run is not None)
    return [_timeline(run) for run in runs if run.samples]


def plot_memory(
    path: Path,
    doc: Mapping[str, Any],
    *,
    title: str = "context-proxy vs a naive proxy and nginx: request memory over time",
) -> None:
    """Save the PNG from a result document (``memory.json``, see :func:`_document`):
    RSS over time of the largest case per variant against the naive proxy, held-open
    windows shaded, and the sequential trend. Growth is over the idle RSS, divided by
    the request body size B."""
    ylabel = "RSS growth ÷ request body size"
    variants: Mapping[str, Mapping[str, Any]] = doc["options"]["variants"]
    panels: list[rpt.Panel] = []
    timelines: Sequence[Mapping[str, Any]] = doc["timelines"]
    naive = next((t for t in timelines if t["proxy"] == "naive"), None)
    nginx = next((t for t in timelines if t["proxy"] == "nginx"), None)
    plain = next((t for t in timelines if t["variant"] == "plain"), None)
    for timeline in timelines:
        if timeline["proxy"] != "ours":
            continue
        variant = variants[timeline["variant"]]
        name = variant["name"]
        series = [_series(f"context-proxy ({name})", timeline, _COLOURS[name])]
        if timeline.get("anon_growth_x_body"):
            # RSS split as the kernel sees it: anonymous (own memory) and file-backed.
            for kind, colour, style in (("anon", _COLOURS[name], ":"), ("file", "#7f7f7f", "--")):
                series.append(
                    rpt.Series(
                        f"{name}: RssAnon (its own memory)"
                        if kind == "anon"
                        else f"{name}: RssFile (a spooled body's mapping)",
                        timeline["t_s"],
                        timeline[f"{kind}_growth_x_body"],
                        colour=colour,
                        style=style,
                    )
                )
        if name in ("refold", "edit") and plain is not None:
            # The edited and refolded paths beside the plain one.
            series.append(_series("context-proxy (plain)", plain, _COLOURS["plain"]))
        if naive:
            series.append(_series("naive proxy", naive, _COLOURS["naive"]))
        if nginx:
            series.append(_series("nginx (spools to a file)", nginx, _COLOURS["nginx"]))
            if name == "plain" and nginx.get("anon_growth_x_body"):
                # Its split once, beside the plain path: the buffer is its own memory.
                for kind, style in (("anon", ":"), ("file", "--")):
                    series.append(
                        rpt.Series(
                            f"nginx: {'RssAnon' if kind == 'anon' else 'RssFile'}",
                            nginx["t_s"],
                            nginx[f"{kind}_growth_x_body"],
                            colour=_COLOURS["nginx"],
                            style=style,
                        )
                    )
        size = timeline["body_bytes"] / MiB
        panels.append(
            rpt.Panel(
                title=f"RSS over time, {size:.0f} MiB {timeline['protocol']}: "
                f"{name} ({variant.get('short') or variant['description']})",
                xlabel="seconds since the first large request",
                ylabel=ylabel,
                series=series,
                hlines=[
                    (variant["peak_limit"], f"peak target {variant['peak_limit']:g}"),
                    (variant["mid_limit"], f"mid-stream target {variant['mid_limit']:g}"),
                ],
            )
        )
    sequential: Sequence[Mapping[str, Any]] = [run for run in doc["sequential"] if run]
    if sequential and sequential[0]["samples"]:
        series = []
        for run in sequential:
            label = f"context-proxy ({run['variant']})" if run["proxy"] == "ours" else "naive proxy"
            afters = [s["after_growth_x_body"] for s in run["samples"]]
            xs = [float(i + 1) for i in range(len(afters))]
            colour = _COLOURS[run["variant"] or "naive"]
            series.append(rpt.Series(label, xs, afters, colour=colour))
        count = len(sequential[0]["samples"])
        size = sequential[0]["samples"][0]["body_bytes"] / MiB
        after_limit = doc["options"]["after_limit_x_body"]
        panels.append(
            rpt.Panel(
                title=f"RSS after each of {count} back-to-back {size:.0f} MiB requests",
                xlabel="request number",
                ylabel=ylabel,
                series=series,
                hlines=[(after_limit, f"after target {after_limit:g}")],
                step=True,
            )
        )
    rpt.plot_series(path, title, panels)


def plot_document(
    cases: Sequence[Case], sequential: Sequence[ProcessRun], variants: Sequence[Variant]
) -> dict[str, Any]:
    """The parts of a result document that :func:`plot_memory` reads."""
    return {
        "options": {
            "variants": {v.name: dataclasses.asdict(v) for v in variants},
            "after_limit_x_body": AFTER_LIMIT,
        },
        "sequential": [run_json(run) for run in sequential],
        "timelines": _timelines(cases, sequential, variants),
    }


def replot(source: Path, target: Path) -> None:
    """Redraw the PNG at ``target`` from an existing ``memory.json`` at ``source``."""
    plot_memory(target, json.loads(source.read_text(encoding="utf-8")))


_COLOURS: Final = {
    "plain": "#1f77b4",
    "plugin": "#2ca02c",
    "retry": "#9467bd",
    "edit": "#17becf",
    "refold": "#ff7f0e",
    "heap": "#8c564b",
    "naive": "#d62728",
    "nginx": "#009e73",
}


def _series(label: str, timeline: Mapping[str, Any], colour: str) -> rpt.Series:
    marks: dict[str, list[float]] = {}
    for at, name in timeline["marks"]:
        marks.setdefault(name, []).append(at)
    spans = list(zip(marks.get("held", []), marks.get("release", []), strict=False))
    return rpt.Series(
        label,
        timeline["t_s"],
        timeline["growth_x_body"],
        colour=colour,
        spans=spans,
        span_label=f"answer held open ({label.split(' ')[0]})",
    )


def _preamble(args: SimpleNamespace, wall: float) -> str:
    return (
        f"Command: `{' '.join(['context-proxy bench memory', *args.argv])}`, "
        f"wall time {wall:.0f} s, Python {platform.python_version()}, "
        f"{os.cpu_count()} CPUs."
    )


def main(argv: list[str]) -> int:
    """Entry point of ``context-proxy bench memory`` (and ``python -m benchmarks.memory``).

    Returns 0 when the run completed (targets missed are reported, not an error),
    1 when a server failed, 2 for bad options.
    """
    return run_command(command, "context-proxy bench memory", argv)


def _run(args: SimpleNamespace) -> int:
    if args.replot is not None:
        targets = [args.out / "memory.png"]
        if args.publish:
            targets.append(args.publish_dir / f"{args.publish_name}.png")
        for target in targets:
            replot(args.replot, target)
        print("wrote " + ", ".join(map(str, targets)))
        return 0
    raise_nofile_limit()
    reporter = rpt.Reporter(quiet=args.quiet)
    results = run_collect(collect, args, reporter, args.out / "logs" / "memory")
    if results is None:
        return 1
    write_outputs(args, results, reporter)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

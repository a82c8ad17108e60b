"""``context-proxy bench instructions``: user-space instructions per request, under callgrind.

Wall-clock and CPU-clock ratios (``bench overhead``) move by about ±0.1 from run to
run on a loaded machine, more than most single optimisations. Instructions executed
do not depend on load: this benchmark runs each proxy (this one with the ``fold``
plugin, and the naive baseline, both on asyncio) as its own process under
``valgrind --tool=callgrind`` with ``PYTHONHASHSEED=0``, sends ``--warmup`` requests
of each kind, zeroes the counters (``callgrind_control -z``), sends ``--requests``
small requests (``--bytes``, 1 KB chat, ``--concurrency`` at once) and dumps them
(``callgrind_control -d``): the dump's ``summary`` (Ir, instructions executed in user
space, the interpreter and every library included, the kernel not) divided by the
request count is the figure. JSON answers, then streamed ones, per process.

Figures: Ir/request for this proxy and the naive one per answer kind, and the ratio
(no target: it is a measure for A/B comparisons of a change, not a pass/fail line).
A process runs far slower under valgrind, so the defaults are small (1.5 min). Without
``valgrind`` on the PATH it prints one ``skipped`` line and exits 3.

Outputs in ``--out``: ``instructions.json``, ``instructions.md``.
"""

from __future__ import annotations

import asyncio
import dataclasses
import datetime
import re
import shutil
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from types import SimpleNamespace
from typing import Any, Final

import aiohttp
import click

from . import _report as rpt
from ._harness import (
    CONTEXT_SETTINGS,
    Service,
    open_client_and_emulator,
    run_collect,
    run_command,
    start_naive,
    start_proxy,
)
from ._workload import BenchProtocol, Corpus, build_small_body

__all__ = ["EXIT_SKIPPED", "KINDS", "TARGETS", "command", "main", "read_summary"]

#: Exit status when valgrind is not installed (nothing was measured).
EXIT_SKIPPED: Final = 3
#: Answer kinds, in the order they are measured.
KINDS: Final = ("json", "streamed")
#: Targets, in the order they run.
TARGETS: Final = ("ours", "naive")
#: Seconds a process under valgrind gets to answer its readiness probe.
_START_TIMEOUT: Final = 300.0
#: Seconds ``callgrind_control`` gets to reach the process.
_CONTROL_TIMEOUT: Final = 120.0
_SUMMARY: Final = re.compile(rb"^summary:\s+(\d+)", re.MULTILINE)


@click.command(
    context_settings=CONTEXT_SETTINGS,
    help="Instructions (callgrind Ir) per small request, this proxy and the naive proxy.",
)
@click.option("--requests", type=click.IntRange(min=1), default=500, help="measured per kind [500]")
@click.option(
    "--warmup", type=click.IntRange(min=0), default=200, help="unmeasured, per kind [200]"
)
@click.option("--concurrency", type=click.IntRange(min=1), default=50, help="requests at once [50]")
@click.option("--bytes", "size", type=click.IntRange(min=1), default=1024, help="body [1024]")
@click.option(
    "--out", type=click.Path(path_type=Path), default=Path("bench-results"), help="output dir"
)
@click.option("--quiet", is_flag=True, help="no progress bar")
@click.pass_context
def command(ctx: click.Context, /, **options: Any) -> int:
    """``context-proxy bench instructions``."""
    return _run(SimpleNamespace(**options), list(ctx.obj or []))


def read_summary(dump: Path) -> int:
    """The ``summary:`` of a callgrind dump file: instructions executed (Ir).

    Raises:
        ValueError: the file has no ``summary:`` line.
    """
    match = _SUMMARY.search(dump.read_bytes())
    if match is None:
        raise ValueError(f"{dump}: no summary line")
    return int(match.group(1))


@dataclasses.dataclass(slots=True)
class Results:
    """Ir/request by target then kind, non-200 answers, and when the run started."""

    started: datetime.datetime
    ir_per_request: dict[str, dict[str, float]] = dataclasses.field(default_factory=dict)
    failures: int = 0
    wall_s: float = 0.0


async def _burst(
    session: aiohttp.ClientSession, url: str, body: bytes, count: int, workers: int
) -> int:
    """Send ``count`` requests with ``workers`` at once; the number of non-200 answers."""
    headers = BenchProtocol.CHAT.headers()
    tickets = iter(range(count))
    failures = 0

    async def worker() -> None:
        nonlocal failures
        for _ in tickets:  # bounded: count tickets
            async with session.post(url, data=body, headers=headers) as resp:
                await resp.read()
                failures += resp.status != 200

    await asyncio.gather(*(worker() for _ in range(workers)))
    return failures


def _control(flag: str, pid: int) -> None:
    # -z zeroes the counters, -d dumps what they counted since; both wait for the process.
    done = subprocess.run(
        ["callgrind_control", flag, str(pid)],
        capture_output=True,
        timeout=_CONTROL_TIMEOUT,
        check=False,
    )
    if done.returncode != 0:
        raise RuntimeError(f"callgrind_control {flag} {pid} failed: {done.stderr[-300:]!r}")


async def _measure(
    session: aiohttp.ClientSession,
    svc: Service,
    bodies: dict[str, bytes],
    args: SimpleNamespace,
    dump_base: Path,
) -> tuple[dict[str, float], int]:
    url = svc.url + BenchProtocol.CHAT.path
    await svc.wait_ready(session, _START_TIMEOUT)
    failures = 0
    for kind in KINDS:
        await _burst(session, url, bodies[kind], args.warmup, args.concurrency)
    figures: dict[str, float] = {}
    for kind in KINDS:
        before = set(dump_base.parent.glob(dump_base.name + ".*"))
        await asyncio.to_thread(_control, "-z", svc.pid)
        failures += await _burst(session, url, bodies[kind], args.requests, args.concurrency)
        await asyncio.to_thread(_control, "-d", svc.pid)
        new = set(dump_base.parent.glob(dump_base.name + ".*")) - before
        if len(new) != 1:
            raise RuntimeError(f"{svc.name}: expected one new callgrind dump, found {len(new)}")
        figures[kind] = read_summary(new.pop()) / args.requests
    svc.check_alive()
    return figures, failures


async def _collect(args: SimpleNamespace, reporter: rpt.Reporter, log_dir: Path) -> Results:
    results = Results(started=datetime.datetime.now(datetime.UTC))
    started = time.monotonic()
    streamed = build_small_body(BenchProtocol.CHAT, args.size, Corpus.load())
    bodies = {
        "streamed": streamed,
        "json": streamed.replace(b'"stream":true', b'"stream":false', 1),
    }
    env = {"PYTHONHASHSEED": "0"}  # the same hashes, so the same dict probes, in every run
    async with open_client_and_emulator(log_dir) as (session, emulator):
        with reporter.progress(len(TARGETS), "instructions") as steps:
            for name in TARGETS:
                steps.describe(f"{name} under callgrind")
                dump_base = log_dir / f"callgrind.{name}"
                wrapper = [
                    "valgrind",
                    "--tool=callgrind",
                    f"--callgrind-out-file={dump_base}",
                    "--dump-line=no",
                ]
                if name == "ours":
                    svc = start_proxy(emulator.url, log_dir, env=env, wrapper=wrapper)
                else:
                    svc = start_naive(emulator.url, log_dir, env=env, wrapper=wrapper)
                async with svc:
                    figures, failures = await _measure(session, svc, bodies, args, dump_base)
                results.ir_per_request[name] = figures
                results.failures += failures
                steps.advance()
    results.wall_s = time.monotonic() - started
    return results


def _table(results: Results, args: SimpleNamespace) -> rpt.Table:
    table = rpt.Table(
        title=(
            f"Instructions per request (callgrind Ir), {args.requests} x {args.size} B chat "
            f"per kind, {args.concurrency} at once, asyncio"
        ),
        columns=("answer", "ours Ir/request", "naive Ir/request", "÷ naive"),
    )
    for kind in KINDS:
        ours, naive = results.ir_per_request["ours"][kind], results.ir_per_request["naive"][kind]
        table.add(kind, f"{ours:,.0f}", f"{naive:,.0f}", rpt.fmt_ratio(ours / naive))
    if results.failures:
        table.notes.append(f"non-200 answers: {results.failures}")
    table.notes.append(
        f"user-space instructions of the proxy process after {args.warmup} warm-up requests "
        "per kind, PYTHONHASHSEED=0; no target (a measure for comparing changes)."
    )
    return table


def _document(results: Results, args: SimpleNamespace, argv: Sequence[str]) -> dict[str, Any]:
    ours, naive = results.ir_per_request["ours"], results.ir_per_request["naive"]
    return {
        "benchmark": "instructions",
        "started_at": results.started.isoformat(),
        "wall_s": results.wall_s,
        "command": " ".join(["context-proxy bench instructions", *argv]),
        "options": {
            "requests": args.requests,
            "warmup": args.warmup,
            "concurrency": args.concurrency,
            "bytes": args.size,
        },
        "ir_per_request": results.ir_per_request,
        "ratio": {kind: ours[kind] / naive[kind] for kind in KINDS},
        "failures": results.failures,
    }


def main(argv: list[str]) -> int:
    """Entry point of ``context-proxy bench instructions``.

    Returns 0 when the run completed, 1 when a server or valgrind failed, 2 for bad
    options, :data:`EXIT_SKIPPED` (3) when valgrind is not installed.
    """
    return run_command(command, "context-proxy bench instructions", argv)


def _run(args: SimpleNamespace, argv: Sequence[str]) -> int:
    reporter = rpt.Reporter(quiet=args.quiet)
    missing = [tool for tool in ("valgrind", "callgrind_control") if shutil.which(tool) is None]
    if missing:
        reporter.note(f"skipped: {', '.join(missing)} not found (apt-get install valgrind)")
        return EXIT_SKIPPED
    out: Path = args.out
    results = run_collect(_collect, args, reporter, out / "logs" / "instructions")
    if results is None:
        return 1
    table = _table(results, args)
    reporter.print_table(table)
    rpt.write_json(out / "instructions.json", _document(results, args, argv))
    rpt.write_markdown(
        out / "instructions.md",
        [table],
        f"Command: `{' '.join(['context-proxy bench instructions', *argv])}`, "
        f"wall time {results.wall_s:.0f} s.",
    )
    reporter.note(
        f"wall time {results.wall_s:.0f} s; "
        f"wrote {out / 'instructions.json'}, {out / 'instructions.md'}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

"""``context-proxy bench concurrency``: N large requests at once, answers held open.

For each variant of this proxy (see :mod:`benchmarks.memory`) and for the naive
baseline, a fresh process takes ``--repeats`` batches of ``-n`` (default 8)
concurrent streamed requests of ``--size`` MiB (default 16). All answers are
held open by the emulator until the benchmark has sampled the process, then
released. Figures are RSS growth over the idle process divided by N x B (the
bytes of all bodies in flight): peak, mid-stream (all N held open) and after.
The single-request targets apply to N x B unchanged.

Outputs in ``--out``: ``concurrency.json``, ``concurrency.md``, ``concurrency.png``.
"""

from __future__ import annotations

import datetime
import sys
import time
import types
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import click

from . import _report as rpt
from ._harness import CONTEXT_SETTINGS, raise_nofile_limit, run_collect, run_command
from ._workload import BenchProtocol, Corpus, MiB, build_body
from .memory import (
    VARIANTS,
    Case,
    _choices,
    _env_pair,
    build_tables,
    converted,
    open_bench,
    plot_document,
    plot_memory,
    run_json,
    run_process,
)

__all__ = ["command", "main"]

_WARMUP_BYTES = 64 * 1024


@click.command(
    context_settings=CONTEXT_SETTINGS,
    help="N concurrent large requests, answers held open: RSS against N x B.",
)
@click.option(
    "-n", "--concurrency", type=click.IntRange(min=1), default=8, help="requests at once [8]"
)
@click.option(
    "--size",
    type=click.FloatRange(min=0, min_open=True),
    default=16.0,
    help="MiB per request body [16]",
)
@click.option(
    "--protocol", type=click.Choice([p.value for p in BenchProtocol]), default="chat", help="[chat]"
)
@click.option(
    "--variants",
    default="plain,plugin,retry",
    callback=converted(_choices(list(VARIANTS))),
    help="variants of this proxy, comma-separated [plain,plugin,retry]",
)
@click.option("--repeats", type=click.IntRange(min=1), default=3, help="batches per process [3]")
@click.option(
    "--out", type=click.Path(path_type=Path), default=Path("bench-results"), help="output dir"
)
@click.option(
    "--proxy-env",
    multiple=True,
    callback=converted(_env_pair),
    metavar="NAME=VALUE",
    help="environment variable for this proxy's process (repeatable)",
)
@click.option("--proxy-module", default="proxy", help="`python -m MODULE serve`")
@click.option("--interval", type=float, default=0.005, help="RSS sampling, s")
@click.option("--quiet", is_flag=True, help="no progress bar")
@click.pass_context
def command(ctx: click.Context, /, **options: Any) -> int:
    """``context-proxy bench concurrency``."""
    return _run(types.SimpleNamespace(**options), list(ctx.obj or []))


async def _collect(
    args: types.SimpleNamespace, reporter: rpt.Reporter, log_dir: Path
) -> tuple[Case, float, datetime.datetime]:
    started = time.monotonic()
    started_wall = datetime.datetime.now(datetime.UTC)
    variants = [VARIANTS[name] for name in args.variants]
    protocol = BenchProtocol(args.protocol)
    corpus = Corpus.load()
    body = build_body(protocol, int(args.size * MiB), corpus)
    warmup = build_body(protocol, _WARMUP_BYTES, corpus, seed=2)
    n = args.concurrency
    case = Case(args.size * n, protocol, n * len(body), label=f"{n} x {args.size:g} MiB")
    bodies = [body] * args.repeats
    async with open_bench(args, log_dir, max(100 * MiB, int(args.size * MiB * 2))) as bench:
        with reporter.progress(len(variants) + 1, "concurrency") as progress:
            for variant in variants:
                progress.describe(f"{n} x {args.size:g} MiB ours/{variant.name}")
                await bench.control.reset()
                case.ours[variant.name] = await run_process(
                    bench, "ours", variant, protocol, bodies, warmup, variant.hold, concurrency=n
                )
                progress.advance()
            progress.describe(f"{n} x {args.size:g} MiB naive")
            await bench.control.reset()
            case.naive = await run_process(
                bench, "naive", None, protocol, bodies, warmup, "delta", concurrency=n
            )
            progress.advance()
    return case, time.monotonic() - started, started_wall


def main(argv: list[str]) -> int:
    """Entry point of ``context-proxy bench concurrency`` and ``python -m benchmarks.concurrency``.

    Returns 0 when the run completed (targets missed are reported, not an error),
    1 when a server failed, 2 for bad options.
    """
    return run_command(command, "context-proxy bench concurrency", argv)


def _run(args: types.SimpleNamespace, argv: Sequence[str]) -> int:
    raise_nofile_limit()
    reporter = rpt.Reporter(quiet=args.quiet)
    out: Path = args.out
    collected = run_collect(_collect, args, reporter, out / "logs" / "concurrency")
    if collected is None:
        return 1
    case, wall, started = collected
    variants = [VARIANTS[name] for name in args.variants]
    tables = build_tables(
        [case],
        [],
        variants,
        args.repeats,
        title=(
            f"Concurrency: {args.concurrency} requests of {args.size:g} MiB at once, RSS growth "
            f"over idle as a multiple of N x B (median [min, max] of {args.repeats} batches)"
        ),
    )
    for table in tables:
        reporter.print_table(table)
    doc: dict[str, Any] = {
        "benchmark": "concurrency",
        "started_at": started.isoformat(),
        "wall_s": wall,
        "command": " ".join(["context-proxy bench concurrency", *argv]),
        "options": {
            "concurrency": args.concurrency,
            "size_mib": args.size,
            "protocol": args.protocol,
            "variants": args.variants,
            "repeats": args.repeats,
        },
        "total_body_bytes": case.body_bytes,
        "ours": {name: run_json(run) for name, run in case.ours.items()},
        "naive": run_json(case.naive),
    }
    out.mkdir(parents=True, exist_ok=True)
    rpt.write_json(out / "concurrency.json", doc)
    rpt.write_markdown(
        out / "concurrency.md",
        tables,
        f"Command: `{doc['command']}`, wall time {wall:.0f} s.",
    )
    plot_memory(
        out / "concurrency.png",
        plot_document([case], [], variants),
        title=f"{args.concurrency} concurrent {args.size:g} MiB requests: RSS over time",
    )
    reporter.note(
        f"wall time {wall:.0f} s; wrote {out / 'concurrency.json'}, {out / 'concurrency.md'}, "
        f"{out / 'concurrency.png'}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

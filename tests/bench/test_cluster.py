"""``context-proxy bench cluster``, run through the command line with tiny counts,
so the command (its dispatch, the nginx configuration it reads from
docs/cluster.md, its servers and its report) cannot rot unnoticed.
Real redis-server and nginx, as in the benchmark itself; no timing is asserted.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.support.cluster import need_binary
from tests.support.process import run_cli

pytestmark = pytest.mark.timeout(180)


def test_bench_cluster_smoke_run(tmp_path: Path) -> None:
    need_binary("redis-server")
    need_binary("nginx")
    out = tmp_path / "results"
    argv = [
        sys.executable, "-m", "proxy", "bench", "cluster",
        "--rtt", "20",
        "--requests", "2",
        "--concurrency", "2",
        "--concurrent-requests", "6",
        "--sessions", "3",
        "--out", str(out),
        "--quiet",
    ]  # fmt: skip
    run = subprocess.run(argv, capture_output=True, text=True, timeout=150, check=False)
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-2000:]

    data = json.loads((out / "cluster.json").read_text())
    assert len(data["admission_rtt_s"]) == 20
    assert all(0 < s < 5 for s in data["admission_rtt_s"])
    assert {name: len(v) for name, v in data["sequential_s"].items()} == {
        "single": 2,
        "single+redis": 2,
        "three+nginx": 2,
    }
    summary = data["summary"]
    assert summary["admission_target_s"] == 0.0003
    assert summary["rps"]["single"] > 0 and summary["rps"]["three+nginx"] > 0
    table = (out / "cluster.md").read_text()
    assert "admission round trip, median" in table
    assert "| requests/s |" in table


def test_bench_cluster_help_lists_its_options_and_a_bad_value_is_a_usage_error() -> None:
    run = run_cli("bench", "cluster", "--help")
    assert run.returncode == 0, run.stderr
    assert run.stdout.startswith("Usage: context-proxy bench cluster [OPTIONS]")
    for option in ("--rtt", "--requests", "--concurrency", "--concurrent-requests", "--sessions"):
        assert option in run.stdout, option
    assert "admission calls timed [2000]" in run.stdout
    bad = run_cli("bench", "cluster", "--sessions", "0")
    assert bad.returncode == 2
    assert "Usage: context-proxy bench cluster" in bad.stderr
    assert "Invalid value for '--sessions'" in bad.stderr


def test_the_cluster_table_fits_80_columns() -> None:
    from rich.console import Console

    from benchmarks import cluster

    # Figures as wide as a slow run gives: seconds of latency, five-digit requests/s.
    data = {
        "admission_rtt_s": [0.0123456],
        "sequential_s": {"single": [1.23456], "single+redis": [12.3456], "three+nginx": [123.456]},
        "rps": {"single": 12345.0, "three+nginx": 98765.0},
    }
    options = cluster.Options(
        rtt=2000,
        requests=300,
        concurrency=32,
        concurrent_requests=2000,
        sessions=64,
        out=Path("."),
        quiet=True,
    )
    table = cluster.summary_table(data, options).to_rich()
    table.caption = None  # the notes are prose below the table: they wrap, as prose does
    width = Console(width=200).measure(table).maximum
    assert width <= 80, f"the table needs {width} columns"

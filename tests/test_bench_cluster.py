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

from .cluster_support import need_binary

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

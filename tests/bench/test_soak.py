"""``context-proxy bench soak``: a small real run, and its slope arithmetic."""

from __future__ import annotations

import json
import math
from pathlib import Path

from benchmarks import soak
from tests.support.process import run_cli


def test_rss_slope_is_kib_per_thousand_requests() -> None:
    # 1 KiB more per 1,000 requests, exactly.
    points = [(n, 50 * 2**20 + n * 1024 // 1000) for n in range(0, 10_001, 1000)]
    assert math.isclose(soak.rss_slope(points), 1.0, rel_tol=1e-3)
    assert soak.rss_slope([(1000, 5), (2000, 5)]) == 0.0
    assert math.isnan(soak.rss_slope([(1000, 5)]))
    assert math.isnan(soak.rss_slope([(1000, 5), (1000, 9)]))


def test_soak_smoke_run_books_every_admitted_exchange(tmp_path: Path) -> None:
    # About 10 s: one proxy process, 150 requests of 20 KiB, half the clients hanging up.
    out = tmp_path / "results"
    argv = [
        "-n", "150", "-c", "25", "--size", "20", "--hangup", "0.5",
        "--every", "50", "--seed", "3", "--out", str(out), "--quiet",
    ]  # fmt: skip
    assert soak.main(argv) == 0
    doc = json.loads((out / "soak.json").read_text())
    assert doc["benchmark"] == "soak" and doc["options"]["requests"] == 150
    # Every phase of hanging up happened, and every other client got its whole answer.
    assert all(doc["fates"][fate] > 0 for fate in soak.FATES)
    assert sum(doc["fates"].values()) == 150
    assert doc["completed"]["complete"] == doc["fates"]["complete"]
    assert doc["completed"]["after_last_byte"] == doc["fates"]["after_last_byte"]
    assert [s["requests"] for s in doc["samples"]] == [0, 50, 100, 150]
    assert all(s["rss"] > 0 and s["fds"] > 0 for s in doc["samples"])
    # Nothing left behind, and each exchange booked exactly once, mid-body hang-ups too.
    assert doc["exchanges_left"] == 0
    assert doc["fds_leaked"] == 0
    assert doc["commits_failed"] == 0
    # Mid-body hang-ups never had a whole body read; all those that read an answer did (a
    # client that hangs up as its upload ends may be seen gone before its body is read).
    # A reset may reach the proxy before the head it followed: that request never began.
    fates = doc["fates"]
    read_answer = 150 - fates["mid_body"] - fates["waiting_headers"]
    assert read_answer <= doc["exchanges_admitted"] <= 150 - fates["mid_body"]
    assert 150 - fates["mid_body"] <= doc["exchanges_finished"] <= 150
    assert doc["commits_booked"] == doc["exchanges_finished"]
    assert doc["targets_met"]["commits"] and doc["targets_met"]["exchanges_left"]


def test_bench_soak_help_lists_its_options_and_a_bad_value_is_a_usage_error() -> None:
    run = run_cli("bench", "soak", "--help")
    assert run.returncode == 0, run.stderr
    assert run.stdout.startswith("Usage: context-proxy bench soak [OPTIONS]")
    for option in ("-n, --requests", "-c, --concurrency", "--size", "--hangup", "--every",
                   "--warmup", "--seed", "--out", "--quiet"):  # fmt: skip
        assert option in run.stdout, option
    assert "fraction of clients that hang up [0.2]" in run.stdout
    for argv, option in ((["--hangup", "1.5"], "'--hangup'"), (["-n", "x"], "'-n' / '--requests'")):
        bad = run_cli("bench", "soak", *argv)
        assert bad.returncode == 2, argv
        assert "Usage: context-proxy bench soak" in bad.stderr
        assert f"Invalid value for {option}" in bad.stderr
    # The in-process entry point answers the same way (2, nothing run).
    assert soak.main(["--size", "0"]) == 2

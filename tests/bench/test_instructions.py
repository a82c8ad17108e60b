"""``context-proxy bench instructions``: callgrind Ir per request, this proxy and naive.

The tiny run starts the emulator and each proxy under valgrind on loopback (about
40 s on 2 cores, most of it the interpreter starting under callgrind) and checks what
a reader of the report relies on: a figure per proxy and answer kind, positive,
the ratio the table prints, no failed request. Without valgrind the run is skipped,
and the benchmark's own skip path is checked instead.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from benchmarks import instructions

HAVE_VALGRIND = all(shutil.which(t) for t in ("valgrind", "callgrind_control"))


@pytest.mark.skipif(not HAVE_VALGRIND, reason="valgrind not installed (apt-get install valgrind)")
def test_a_tiny_run_reports_positive_instructions_per_request_for_both_proxies(
    tmp_path: Path,
) -> None:
    argv = ["--requests", "20", "--warmup", "5", "--concurrency", "5", "--out", str(tmp_path)]
    done = subprocess.run(
        [sys.executable, "-m", "proxy", "bench", "instructions", *argv, "--quiet"],
        capture_output=True,
        text=True,
        timeout=400,
        check=False,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    doc = json.loads((tmp_path / "instructions.json").read_text(encoding="utf-8"))
    assert doc["benchmark"] == "instructions"
    assert doc["options"]["requests"] == 20
    assert doc["failures"] == 0
    figures = doc["ir_per_request"]
    assert set(figures) == {"ours", "naive"}
    for name in ("ours", "naive"):
        assert set(figures[name]) == {"json", "streamed"}
        for kind in ("json", "streamed"):
            # A Python HTTP proxy runs far more than 10k instructions for a request.
            assert figures[name][kind] > 10_000, (name, kind, figures[name][kind])
    for kind in ("json", "streamed"):
        assert doc["ratio"][kind] == pytest.approx(figures["ours"][kind] / figures["naive"][kind])
    table = (tmp_path / "instructions.md").read_text(encoding="utf-8")
    assert "| answer | ours Ir/request | naive Ir/request | ÷ naive |" in table
    for kind in ("json", "streamed"):
        assert f"\n| {kind} | " in table
    assert "Instructions per request" in done.stdout


def test_without_valgrind_it_says_skipped_and_exits_3(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("PATH", str(tmp_path))  # no valgrind here
    status = instructions.main(["--requests", "1", "--out", str(tmp_path / "out"), "--quiet"])
    assert status == instructions.EXIT_SKIPPED == 3
    out = capsys.readouterr().out
    assert "skipped: valgrind, callgrind_control not found" in out
    assert not (tmp_path / "out").exists()  # nothing measured, nothing written

"""``bench memory``'s measurements for the spool (issue 21): nginx beside the naive proxy,
time to first byte and CPU of spooled bodies against heap bodies, and CPU of small turns
with the spool on and off, each as ratios from the numbers the same run measured.

The runs are small (1 MiB bodies, spooled by lowering ``spool_above_bytes`` to 64 KiB;
two repeats; a few turns): no figure here is a target, and nothing is timed. What is
asserted is what a reader of the output relies on: the columns and tables are there,
every ratio is the ratio of the medians of the samples the JSON records, and nginx kept
the body out of its memory.
"""

from __future__ import annotations

import json
import statistics
from pathlib import Path
from typing import Any

import pytest

from benchmarks import _report as rpt
from benchmarks import memory
from benchmarks._nginx import find_nginx
from benchmarks._workload import BenchProtocol, MiB

_SPOOL_ABOVE = 64 * 1024


def _widest_table(text: str) -> int:
    """Columns of the widest table printed: its header rule spans the whole table."""
    return max((len(line.strip()) for line in text.splitlines() if "──" in line), default=0)


def _run(out: Path, *extra: str) -> tuple[str, dict[str, Any]]:
    argv = [
        "--sizes", "1",
        "--protocols", "chat",
        "--variants", "plain,heap",
        "--repeats", "2",
        "--sequential", "0",
        "--proxy-env", f"CONTEXT_PROXY_SPOOL_ABOVE_BYTES={_SPOOL_ABOVE}",
        "--out", str(out),
        "--quiet",
        *extra,
    ]  # fmt: skip
    assert memory.main(argv) == 0
    doc = json.loads((out / "memory.json").read_text())
    return (out / "memory.md").read_text(), doc


def _median(samples: list[dict[str, Any]], key: str) -> float:
    return statistics.median(s[key] for s in samples if s["complete"])


def _row(markdown: str, section: str, *cells: str) -> list[str]:
    """The cells of the Markdown table row under ``section`` that starts with ``cells``."""
    lines = markdown.split(f"**{section}", 1)[1].splitlines()
    prefix = "| " + " | ".join(cells) + " |"
    line = next(line for line in lines if line.startswith(prefix))
    return [cell.strip() for cell in line.strip("|").split("|")]


@pytest.mark.timeout(300)
def test_a_run_shows_nginx_and_the_spool_cost_ratios_of_its_own_samples(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    # About 25 s: two variants, the naive proxy and nginx, 1 MiB bodies twice each, then
    # two processes for the small turns. Every wait inside is bounded (10 min a request).
    if find_nginx() is None:
        pytest.skip("nginx is not installed (.ci/run installs it)")
    monkeypatch.setenv("COLUMNS", "200")
    # A relative --out, as the README's commands give it: nginx reads relative paths
    # from its prefix, not from the working directory.
    monkeypatch.chdir(tmp_path)
    markdown, doc = _run(Path("results"), "--turns", "4", "--turn-kb", "40")
    printed = capsys.readouterr().out
    assert 40 < _widest_table(printed) <= 80, printed
    assert "| variant | figure | ours | naive | nginx | target | verdict |" in markdown

    (case,) = doc["cases"]
    assert case["spool_above_bytes"] == _SPOOL_ABOVE
    nginx = case["nginx"]["samples"]
    assert len(nginx) == 2 and all(s["complete"] for s in nginx), nginx
    # nginx wrote the body to its temporary file: neither its own memory nor a mapping
    # holds it (the naive proxy's holds it several times over).
    naive = case["naive"]["samples"]
    for sample in nginx:
        assert sample["anon_peak_growth_x_body"] < 0.5 < naive[0]["anon_peak_growth_x_body"]
        assert sample["file_peak_growth_x_body"] < 0.5
    # This proxy spooled (64 KiB threshold): the body was file-backed; with the spool off not.
    plain = case["ours"]["plain"]["samples"]
    heap = case["ours"]["heap"]["samples"]
    assert all(s["file_peak_growth_x_body"] > 0.5 for s in plain)
    assert all(s["file_peak_growth_x_body"] < 0.5 for s in heap)
    # The nginx cells are the medians of nginx's samples.
    section = "1 MiB chat (B = "
    for figure, key in (("anon peak", "anon_peak_growth_x_body"), ("peak", "peak_growth_x_body")):
        cells = _row(markdown, section, "plain", figure)
        assert cells[4] == rpt.fmt_ratio(_median(nginx, key)), cells
    assert any(t["proxy"] == "nginx" for t in doc["timelines"])

    # Time to first byte and CPU per request, spooled against heap, from those samples.
    (cost,) = doc["spool_cost"]
    for sample in plain + heap:
        assert sample["ttfb_s"] > 0 and sample["cpu_s"] > 0, sample
    ttfb = _median(plain, "ttfb_s") / _median(heap, "ttfb_s")
    cpu = _median(plain, "cpu_s") / _median(heap, "cpu_s")
    assert cost["ttfb_ratio"] == pytest.approx(ttfb, rel=1e-9)
    assert cost["cpu_ratio"] == pytest.approx(cpu, rel=1e-9)
    assert cost["cpu_spooled"]["n"] == cost["cpu_heap"]["n"] == 2
    assert "Spooled bodies against heap bodies" in markdown
    cells = _row(markdown, "1 MiB chat (B = ", "CPU/request, ms")
    assert cells[3] == rpt.fmt_ratio(cpu)

    # Small turns: one CPU figure per round and process, the ratio of their medians.
    turns = doc["turn_cpu"]
    assert turns["protocol"] == BenchProtocol.MESSAGES.value and turns["turns"] == 4
    assert 40_000 <= turns["body_bytes"] < 4 * MiB  # below the default spool threshold
    assert turns["failures"] == 0
    assert len(turns["on"]) == len(turns["off"]) == 2
    assert all(v > 0 for v in turns["on"] + turns["off"])
    ratio = statistics.median(turns["on"]) / statistics.median(turns["off"])
    assert turns["ratio"] == pytest.approx(ratio, rel=1e-9)
    assert "Below the spool threshold: CPU per" in markdown


@pytest.mark.timeout(200)
def test_without_nginx_the_run_says_so_and_has_no_nginx_figures(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    # About 10 s: the same run without nginx and without the small turns, published.
    monkeypatch.setattr(memory, "find_nginx", lambda: None)
    docs = tmp_path / "docs"
    markdown, doc = _run(
        tmp_path / "results", "--turns", "0", "--publish", "--publish-dir", str(docs),
        "--publish-name", "bench-spool",
    )  # fmt: skip
    # Published under the name asked for (the spool's run is docs/bench-spool.*).
    assert (docs / "bench-spool.md").read_text() == markdown
    assert sorted(p.name for p in docs.iterdir()) == [
        "bench-spool.json", "bench-spool.md", "bench-spool.png"
    ]  # fmt: skip
    printed = capsys.readouterr().out
    assert "skipped: nginx is not installed" in printed
    assert "Skipped: nginx is not installed" in markdown
    (case,) = doc["cases"]
    assert case["nginx"] is None
    assert doc["nginx_skipped"] and doc["turn_cpu"] is None
    assert all(t["proxy"] != "nginx" for t in doc["timelines"])
    assert _row(markdown, "1 MiB chat (B = ", "plain", "peak")[4] == "-"


def _sample(ttfb: float, cpu: float) -> memory.Sample:
    return memory.Sample(body_bytes=MiB, idle_rss=0, complete=True, ttfb_s=ttfb, cpu_s=cpu)


def _process(variant: str, samples: list[memory.Sample]) -> memory.ProcessRun:
    return memory.ProcessRun("ours", variant, "chat", samples, 1, [], [], [])


def test_spool_costs_are_ratios_of_medians_for_spooled_cases_only() -> None:
    plain = _process("plain", [_sample(0.30, 0.20), _sample(0.34, 0.26), _sample(0.50, 0.22)])
    heap = _process("heap", [_sample(0.40, 0.30), _sample(0.36, 0.24), _sample(0.38, 0.25)])
    spooled = memory.Case(64, BenchProtocol.CHAT, 64 * MiB, ours={"plain": plain, "heap": heap})
    small = memory.Case(1, BenchProtocol.CHAT, MiB, ours={"plain": plain, "heap": heap})
    never = memory.Case(
        64, BenchProtocol.CHAT, 64 * MiB, ours={"plain": plain, "heap": heap}, spool_above=0
    )
    (cost,) = memory.spool_costs([spooled, small, never])
    assert cost.label == "64 MiB chat"
    assert cost.ttfb_ratio == pytest.approx(0.34 / 0.38)
    assert cost.cpu_ratio == pytest.approx(0.22 / 0.25)
    # A spooled median over the heap median but within the heap's own spread passes;
    # over its largest sample it misses.
    assert memory.no_worse(rpt.stat([0.27]), rpt.stat([0.24, 0.25, 0.30])) == rpt.PASS
    assert memory.no_worse(rpt.stat([0.31]), rpt.stat([0.24, 0.25, 0.30])) == rpt.MISS
    assert memory.no_worse(rpt.stat([]), rpt.stat([0.25])) == rpt.MISS
    turns = memory.TurnCpu("messages", 100_000, 50, on=[1.0e-3, 1.2e-3], off=[1.0e-3, 1.0e-3])
    assert turns.ratio == pytest.approx(1.1)

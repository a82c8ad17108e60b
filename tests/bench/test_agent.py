"""``context-proxy bench agent``: a small real run, its histories and its arithmetic."""

from __future__ import annotations

import json
import math
from pathlib import Path

from benchmarks import agent
from benchmarks._workload import BenchProtocol
from tests.support.process import run_cli


def test_each_turn_repeats_the_last_body_and_adds_one_paired_tool_exchange() -> None:
    for protocol in BenchProtocol:
        history = agent.AgentHistory(protocol, "s-1", result_bytes=5000)
        history.add_turn(1)
        first = history.body("m")
        history.add_turn(2)
        second = history.body("m")
        doc = json.loads(second)
        items = doc.get("messages", doc.get("input"))
        # The first turn's entries are a byte-identical prefix of the second's body, up to
        # where the first body closes its history list.
        cut = first.rindex(b"]")
        assert second[:cut] == first[:cut], protocol
        assert 5000 < len(second) - len(first) < 5000 + 400, protocol
        if protocol is BenchProtocol.RESPONSES:
            assert doc["prompt_cache_key"] == "s-1"
            assert [i["type"] for i in items[1:]] == ["function_call", "function_call_output"] * 2
        elif protocol is BenchProtocol.MESSAGES:
            uses = [b["id"] for m in items for b in m["content"] if isinstance(b, dict)
                    and b.get("type") == "tool_use"]  # fmt: skip
            results = [b["tool_use_id"] for m in items for b in m["content"]
                       if isinstance(b, dict) and b.get("type") == "tool_result"]  # fmt: skip
            assert uses == results == ["toolu_0001", "toolu_0002"]
        else:
            assert [m["role"] for m in items] == ["system", "user", *["assistant", "tool"] * 2]


def test_the_summary_counts_only_the_turns_after_the_first_overflow() -> None:
    def turn(n: int, rejected: int, cached: int) -> agent.TurnFigures:
        return agent.TurnFigures(
            turn=n,
            client_bytes=100,
            upstream_requests=1 + rejected,
            rejected=rejected,
            upstream_bytes=100 + 90 * rejected,
            input_tokens=100,
            cached_tokens=cached,
            client_error=False,
        )

    figures = [turn(1, 0, 0), turn(2, 1, 10), turn(3, 0, 90), turn(4, 1, 50)]
    summary = agent.summarize(figures)
    assert summary.first_overflow == 2
    assert (summary.after_turns, summary.after_rejected) == (2, 1)
    assert summary.rejected_per_10 == 5.0
    assert summary.after_cached_share == 140 / 200
    assert summary.upstream_requests == 6 and summary.rejected == 2
    assert math.isnan(agent.summarize([turn(1, 0, 0)]).rejected_per_10)


def test_a_small_run_overflows_and_the_client_never_sees_it(tmp_path: Path) -> None:
    # About 5 s: 16 turns growing to 3x a 4,096-token window, each protocol, both modes.
    out = tmp_path / "results"
    argv = ["--turns", "16", "--window-tokens", "4096", "--out", str(out), "--quiet"]
    assert agent.main(argv) == 0
    doc = json.loads((out / "agent.json").read_text())
    assert (out / "agent.png").stat().st_size > 10_000
    assert "| fresh | messages |" in (out / "agent.md").read_text()
    for mode in agent.MODES:
        for protocol in ("messages", "responses", "chat"):
            summary = doc["summary"][mode][protocol]
            turns = doc["figures"][mode][protocol]
            assert len(turns) == 16
            # The history outgrew the window, and the proxy folded every time it had to:
            # the client got a complete answer on every turn.
            assert summary["first_overflow"] is not None, (mode, protocol)
            assert summary["client_errors"] == 0, (mode, protocol)
            assert turns[-1]["client_bytes"] > 3 * 4 * 4096 * 0.9
            assert all(t["upstream_requests"] >= 1 for t in turns)
    fresh, carried = doc["summary"]["fresh"], doc["summary"]["carried"]
    for protocol in ("messages", "responses", "chat"):
        # Without carried folds every turn after the first overflow starts at fold level 0
        # and is rejected; with them, the session's fold is applied before the first send.
        assert fresh[protocol]["after_rejected"] >= fresh[protocol]["after_turns"]
        assert carried[protocol]["after_rejected"] <= 1, carried[protocol]
        assert carried[protocol]["upstream_bytes"] < fresh[protocol]["upstream_bytes"] / 2
        assert carried[protocol]["after_cached_share"] > fresh[protocol]["after_cached_share"]


def test_bench_agent_is_listed_and_its_help_names_its_options() -> None:
    run = run_cli("bench", "agent", "--help")
    assert run.returncode == 0, run.stderr
    assert run.stdout.startswith("Usage: context-proxy bench agent [OPTIONS]")
    for option in ("--turns", "--window-tokens", "--growth", "--protocols", "--modes", "--out"):
        assert option in run.stdout, option
    bad = run_cli("bench", "agent", "--modes", "sideways")
    assert bad.returncode == 2 and "unknown mode" in bad.stderr

"""docs/plugins.md tells a plugin author what they need without reading source (issue 12, 7)."""

from __future__ import annotations

import contextlib
import dataclasses
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from proxy import ExchangeRecord, Outcome, WireMetadata
from tests.support.cluster import need_binary
from tests.support.ports import free_port

ROOT = Path(__file__).resolve().parents[2]
GUIDE = ROOT / "docs" / "plugins.md"


def _fields_table(cls: type[Any]) -> dict[str, list[str]]:
    """The guide's ``### `cls` fields`` table, ``{field: [type, unit, meaning]}``, after
    checking it lists every field of the dataclass ``cls`` in order, with its declared
    type and a meaning."""
    text = GUIDE.read_text(encoding="utf-8")
    section = text[text.index(f"### `{cls.__name__}` fields") :]
    section = section[: section.index("\n### ", 10)]
    rows: dict[str, list[str]] = {}
    for line in section.splitlines():
        match = re.match(r"\| `(\w+)` \| (.*) \|$", line)
        if match:
            rows[match[1]] = [cell.strip() for cell in re.split(r"(?<!\\)\|", match[2])]
    fields = {f.name: f for f in dataclasses.fields(cls)}
    assert list(rows) == list(fields), "the table lists the fields in declaration order"
    for name, (type_cell, _unit, meaning) in rows.items():
        declared = str(fields[name].type).replace(" ", "")
        assert type_cell.strip("`").replace("\\", "").replace(" ", "") == declared, name
        assert len(meaning) > 10, name
    return rows


def test_every_record_field_is_listed_with_type_unit_and_meaning() -> None:
    rows = _fields_table(ExchangeRecord)
    for name in ("request_bytes", "outbound_bytes", "response_bytes"):
        assert rows[name][1] == "bytes"
    for name in ("ttfb_s", "duration_s"):
        assert rows[name][1] == "seconds"
    for outcome in Outcome:
        assert f"`{outcome.value}`" in rows["outcome"][2], outcome


def test_every_wire_metadata_field_is_listed_with_its_type() -> None:
    rows = _fields_table(WireMetadata)
    assert rows["byte_length"][1] == "bytes"


def test_the_fixture_needs_no_conftest_and_the_manual_try_waits_for_readiness() -> None:
    text = GUIDE.read_text(encoding="utf-8")
    assert 'pytest_plugins = ["proxy.pytest_plugin"]' not in text
    assert "pytest11" in text
    assert not (ROOT / "examples" / "count_per_model" / "conftest.py").exists()
    block = text[text.index("Try it by hand") :]
    block = block[: block.index("```\n", block.index("```sh") + 5)]
    assert block.index("/readyz") < block.index("/v1/chat/completions")


def _try_block() -> str:
    text = GUIDE.read_text(encoding="utf-8")
    block = text[text.index("Try it by hand") :]
    start = block.index("```sh\n") + len("```sh\n")
    return block[start : block.index("```\n", start)]


@pytest.mark.timeout(90)
def test_the_manual_try_runs_as_pasted_and_stops_what_it_started(tmp_path: Path) -> None:
    """The block, from a copy of the example project, on free ports instead of 8787/8788:
    the answer ends its line, the plugin's counter shows, and both processes are gone."""
    need_binary("curl")
    project = tmp_path / "count_per_model"
    shutil.copytree(ROOT / "examples" / "count_per_model", project)
    proxy_port, emulator_port = free_port(), free_port()
    script = _try_block().replace("8787", str(proxy_port)).replace("8788", str(emulator_port))
    script = script.replace(
        "context-proxy sessions", f"context-proxy sessions --url http://127.0.0.1:{proxy_port}"
    )
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}"}
    env = {k: v for k, v in env.items() if not k.startswith("CONTEXT_PROXY_")}
    # Its own process group, so that whatever a failed run left behind is ended below.
    proc = subprocess.Popen(
        ["bash", "-e", "-c", script],
        cwd=project,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        stdout, stderr = proc.communicate(timeout=60)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    done = subprocess.CompletedProcess(proc.args, proc.returncode, stdout, stderr)
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    answer = next(i for i, line in enumerate(lines) if line.startswith('{"id":'))
    assert lines[answer].endswith("}")
    assert lines[answer + 1].startswith("# HELP count_per_model_requests_total")
    assert 'count_per_model_requests_total{model="m1"} 1.0' in lines
    assert "requests per model: {'m1': 1}" in done.stderr  # the drain ran to its end
    for port in (proxy_port, emulator_port):
        with socket.socket() as sock:
            assert sock.connect_ex(("127.0.0.1", port)) != 0, f"something still listens on {port}"

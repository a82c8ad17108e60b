"""The docs/cluster.md recipe, pasted: three nodes, Redis and nginx on one host.

The page's shell blocks run as written, with three changes a reader is told to
make or would make: the scratch directory is this test's, the ports are free
ones (the page says to change taken ones), and the nodes use the emulator as
the page's "without an API key" paragraph says. Then a request goes through
nginx, and the stop block must end every process by its PID file.
"""

from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from benchmarks._cluster import DOCS
from tests.support.cluster import need_binary
from tests.support.ports import free_port

pytestmark = pytest.mark.timeout(240)

_RUN_WITHIN = 90.0  # seconds per shell block: the start waits for three Python start-ups


def _blocks(kind: str) -> list[str]:
    return [
        body for k, body in re.findall(r"```(\w+)\n(.*?)```", DOCS.read_text(), re.S) if k == kind
    ]


def _alive(pid: int) -> bool:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"  # a zombie has exited


def _run(script: str, cwd: Path, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        ["bash", "-e", "-c", script],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=_RUN_WITHIN,
        check=False,
    )


def test_the_recipe_runs_as_pasted_and_stops_by_pid_files(tmp_path: Path) -> None:
    for binary in ("redis-server", "nginx", "curl"):
        need_binary(binary)
    start, trial, stop = _blocks("sh")
    (nginx,) = _blocks("nginx")
    text = DOCS.read_text()
    emulate = re.search(r"\(`(context-proxy emulate [^`]+)`\)", text, re.S)
    assert emulate is not None, "the page no longer says how to start the emulator"

    ports = {old: str(free_port()) for old in ("6380", "8080", "8781", "8782", "8783", "8790")}

    def adapt(script: str) -> str:
        script = script.replace("/tmp/context-proxy-cluster", str(tmp_path / "cluster"))
        for old, new in ports.items():
            script = script.replace(old, new)
        return script

    real = "--upstream-openai https://api.openai.com --upstream-anthropic https://api.anthropic.com"
    assert real in start
    start = start.replace(
        real, "--upstream-openai http://127.0.0.1:8790 --upstream-anthropic http://127.0.0.1:8790"
    )
    first, rest = start.split("\n", 1)  # the mkdir/cd line, then the emulator, as the page says
    start = f"{first}\n{' '.join(emulate.group(1).split())}\n{rest}"
    scratch = tmp_path / "cluster"
    scratch.mkdir()
    (scratch / "nginx.conf").write_text(adapt(nginx))  # "Save ... as nginx.conf here first"

    env = dict(os.environ)
    env = {k: v for k, v in env.items() if not k.startswith("CONTEXT_PROXY_")}
    env["PATH"] = os.pathsep.join([str(Path(sys.executable).parent), env.get("PATH", "")])
    env["PATH"] += ":/usr/sbin:/usr/local/sbin"
    pids: list[int] = []
    try:
        started = _run(adapt(start), tmp_path, env)
        pid_files = sorted(scratch.glob("*.pid"))
        pids = [int(p.read_text().split()[0]) for p in pid_files if p.read_text().strip()]
        assert started.returncode == 0, started.stderr[-2000:]
        assert {p.name for p in pid_files} == {
            "redis.pid", "nginx.pid", "emulator.pid",
            *(f"node-{ports[n]}.pid" for n in ("8781", "8782", "8783")),
        }  # fmt: skip
        assert all(_alive(pid) for pid in pids)

        tried = _run(adapt(trial), tmp_path, env)
        assert tried.returncode == 0, tried.stderr[-2000:]
        assert "Hello from the emulator" in tried.stdout, tried.stdout[-2000:]
        assert '"already_closed": false' in tried.stdout, tried.stdout[-2000:]

        stopped = _run(adapt(stop), tmp_path, env)
        assert stopped.returncode == 0, stopped.stderr[-2000:]
        # The nodes were waited for; Redis and the emulator exit a moment after kill.
        deadline = time.monotonic() + 10.0
        while any(_alive(pid) for pid in pids) and time.monotonic() < deadline:  # bounded
            time.sleep(0.05)
        assert [pid for pid in pids if _alive(pid)] == []
        assert sorted(p.name for p in scratch.glob("*.pid")) == []
        # Redis kept its data in the scratch directory, not in the shell's cwd.
        assert (scratch / "appendonlydir").is_dir()
        assert not (tmp_path / "appendonlydir").exists()
    finally:
        for pid in pids:  # whatever the stop block left, by PID
            if _alive(pid):
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)


def _next_upstream(block: str) -> set[str]:
    (line,) = re.findall(r"^ *proxy_next_upstream ([^;]+);", block, re.MULTILINE)
    return set(line.split())


def test_the_nginx_blocks_retry_a_draining_nodes_503_on_the_next_node() -> None:
    """docs/cluster.md's nginx block (the one the cluster tests run) and docs/deploy.md's
    both pass a draining node's 503 to the next node, POSTs included (issue 20, item 9)."""
    (cluster,) = _blocks("nginx")
    (deploy,) = [
        body
        for k, body in re.findall(
            r"```(\w+)\n(.*?)```", (DOCS.parent / "deploy.md").read_text(), re.S
        )
        if k == "nginx"
    ]
    wanted = {"error", "timeout", "http_503", "non_idempotent"}
    assert _next_upstream(cluster) == wanted
    assert _next_upstream(deploy) == wanted

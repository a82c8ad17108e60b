"""A ``python -m proxy ...`` child process whose output lines a test can wait for."""

from __future__ import annotations

import asyncio
import os
import re
import subprocess
import sys
from collections.abc import Callable, Mapping

#: Seconds a wait for a child's output line may take by default.
BOUND_S = 5.0


class Proc:
    """A child process whose output lines are collected by a background task."""

    def __init__(self, proc: asyncio.subprocess.Process, name: str) -> None:
        self.proc = proc
        self.name = name
        self.lines: list[str] = []
        self._changed = asyncio.Event()
        assert proc.stdout is not None
        self._reader = asyncio.create_task(self._read(proc.stdout))

    @classmethod
    async def start(
        cls,
        name: str,
        *args: str,
        env: Mapping[str, str] | None = None,
        preexec_fn: Callable[[], object] | None = None,
    ) -> Proc:
        """Start ``python -m proxy ARGS`` with stdout and stderr merged.

        The ``CONTEXT_PROXY_*`` variables of this process are dropped; ``env``
        adds variables of its own. ``preexec_fn`` runs in the child before exec
        (e.g. to lower a resource limit).
        """
        child_env = {k: v for k, v in os.environ.items() if not k.startswith("CONTEXT_PROXY_")}
        child_env["PYTHONUNBUFFERED"] = "1"
        child_env.update(env or {})
        proc = await asyncio.create_subprocess_exec(
            sys.executable,
            "-m",
            "proxy",
            *args,
            stdin=asyncio.subprocess.DEVNULL,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.STDOUT,
            env=child_env,
            preexec_fn=preexec_fn,
        )
        return cls(proc, name)

    @classmethod
    async def serve(
        cls,
        upstream_url: str,
        *,
        grace: float = 1.0,
        quiet: bool = True,
        env: Mapping[str, str] | None = None,
        preexec_fn: Callable[[], object] | None = None,
        within: float = BOUND_S,
    ) -> tuple[Proc, int]:
        """``serve`` on an ephemeral port, both upstreams at ``upstream_url``, a
        ``grace`` seconds shutdown grace: the child and its port once it says it
        listens (within ``within`` seconds). ``quiet``: no access log and no plugins;
        else the settings' own defaults (the access log, the ``fold`` plugin).
        ``env`` adds variables (and wins over ``quiet``'s).

        Raises:
            AssertionError: it did not say it listens in time (the child is stopped first).
        """
        defaults = {"CONTEXT_PROXY_ACCESS_LOG": "false", "CONTEXT_PROXY_PLUGINS": ""}
        proc = await cls.start(
            "proxy",
            "serve",
            "--port",
            "0",
            "--upstream-openai",
            upstream_url,
            "--upstream-anthropic",
            upstream_url,
            "--shutdown-grace",
            str(grace),
            env={**(defaults if quiet else {}), **(env or {})},
            preexec_fn=preexec_fn,
        )
        try:
            port = int((await proc.wait_line(r"listening on http://[\d.]+:(\d+)", within))[1])
        except BaseException:
            await proc.stop()
            raise
        return proc, port

    async def _read(self, stream: asyncio.StreamReader) -> None:
        # Chunks, not readline(): an over-long line must not stop the draining of
        # the pipe (a full pipe would block the child).
        pending = b""
        while chunk := await stream.read(64 * 1024):
            *complete, pending = (pending + chunk).split(b"\n")
            self.lines.extend(line.decode(errors="replace") for line in complete)
            self._changed.set()
        if pending:
            self.lines.append(pending.decode(errors="replace"))
        self._changed.set()

    @property
    def output(self) -> str:
        return "\n".join(self.lines)

    async def wait_line(self, pattern: str, within: float = BOUND_S) -> re.Match[str]:
        """The first output line matching ``pattern``; raises at EOF or after ``within`` s."""
        regex = re.compile(pattern)
        checked = 0
        async with asyncio.timeout(within):
            while True:
                for line in self.lines[checked:]:
                    match = regex.search(line)
                    if match:
                        return match
                checked = len(self.lines)
                if self._reader.done():
                    raise AssertionError(f"{self.name} exited without {pattern!r}:\n{self.output}")
                self._changed.clear()
                await self._changed.wait()

    async def wait_exit(self, within: float = BOUND_S) -> int:
        """The exit status, once the child exited and its output is read."""
        async with asyncio.timeout(within):
            code = await self.proc.wait()
            await self._reader
        return code

    async def stop(self) -> None:
        if self.proc.returncode is None:
            self.proc.kill()
            await self.proc.wait()
        await self._reader


def run_cli(*args: str, timeout: float = 60.0) -> subprocess.CompletedProcess[str]:
    """``python -m proxy ARGS`` run to its end (at most ``timeout`` seconds): exit
    status, stdout and stderr as text."""
    return subprocess.run(
        [sys.executable, "-m", "proxy", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )

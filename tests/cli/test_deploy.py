"""Running under a service manager (issue 12, item 4).

A start-up on a busy port is one line naming the address, a non-zero exit
status, and no traceback, for ``serve``, ``emulate`` and ``demo``; the systemd
unit in docs/deploy.md stops gracefully within its ``TimeoutStopSec``.
"""

from __future__ import annotations

import configparser
import re
import socket
from collections.abc import Iterator
from pathlib import Path

import pytest

from proxy._config import load_settings
from proxy._plugins import load_plugins
from tests.support.process import Proc

DEPLOY = Path(__file__).resolve().parents[2] / "docs" / "deploy.md"


@pytest.fixture
def busy_port() -> Iterator[int]:
    """A loopback port held by a listening socket of this process."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen()
        yield sock.getsockname()[1]


@pytest.mark.timeout(60)
@pytest.mark.parametrize(
    "command",
    [["serve", "--port", "{port}"], ["emulate", "--port", "{port}"], ["demo", "--port", "{port}"]],
    ids=["serve", "emulate", "demo"],
)
async def test_a_busy_port_is_one_line_naming_the_address(
    busy_port: int, command: list[str]
) -> None:
    proc = await Proc.start(command[0], *(arg.format(port=busy_port) for arg in command))
    try:
        code = await proc.wait_exit(within=30)
    finally:
        await proc.stop()
    lines = [line for line in proc.lines if line.strip()]
    assert code != 0
    assert lines == [f"Error: cannot listen on 127.0.0.1:{busy_port}: address already in use"], (
        proc.output
    )


def _unit() -> configparser.ConfigParser:
    text = DEPLOY.read_text()
    match = re.search(r"```ini title=\"context-proxy.service\"\n(.*?)```", text, re.S)
    assert match, "docs/deploy.md has no context-proxy.service block"
    unit = configparser.ConfigParser(strict=False, interpolation=None)
    unit.optionxform = str  # type: ignore[assignment,method-assign]
    unit.read_string(match.group(1))
    return unit


def _seconds(value: str) -> float:
    match = re.fullmatch(r"(\d+)(s|min)?", value.strip())
    assert match, value
    return int(match[1]) * (60 if match[2] == "min" else 1)


def _settings_file(tmp_path: Path) -> Path:
    """The unit's settings file, as docs/deploy.md gives it, written to ``tmp_path``."""
    match = re.search(
        r"```toml title=\"/etc/context-proxy/context-proxy.toml\"\n(.*?)```",
        DEPLOY.read_text(),
        re.S,
    )
    assert match, "docs/deploy.md has no settings file for the unit"
    path = tmp_path / "context-proxy.toml"
    path.write_text(match.group(1))
    return path


def test_the_documented_unit_stops_gracefully_within_its_timeout(tmp_path: Path) -> None:
    unit = _unit()
    service = unit["Service"]
    assert service["KillSignal"] == "SIGTERM"
    assert service["Restart"] in ("on-failure", "always")
    assert service["StateDirectory"] == "context-proxy"
    assert "ExecStart" in service and "serve" in service["ExecStart"]
    assert "ExecStartPre" in service and "check" in service["ExecStartPre"]
    environment = dict(item.split("=", 1) for item in service["Environment"].split() if "=" in item)
    settings = load_settings(_settings_file(tmp_path), environ=environment)
    host = load_plugins(settings.plugins, settings.plugin, timeout=settings.plugin_timeout)
    per_hook = settings.plugin_timeout
    # AppState.drain, step by step: the grace; 5 s for cancelled streams to wind down;
    # one commit's bound for all pending commits; each plugin's shutdown hook in turn
    # (PluginHost gives shutdown at least 10 s); aiohttp's runner shutdown_timeout (1 s).
    worst = (
        settings.shutdown_grace
        + 5.0
        + per_hook * (len(host.plugins) + 1)
        + sum(max(per_hook, 10.0) for _ in host.implementing("shutdown"))
        + 1.0
    )
    text = DEPLOY.read_text()
    assert f"**{worst:.0f} s**" in text, "the documented worst case is not the computed one"
    # Above it, with room for the session closes (the one step without a total bound).
    assert _seconds(service["TimeoutStopSec"]) >= worst + 30
    assert "/var/lib/context-proxy/" in DEPLOY.read_text()
    assert "/readyz" in DEPLOY.read_text()

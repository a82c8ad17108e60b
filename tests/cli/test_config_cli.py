"""Settings layers and the command line, as a user meets them."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import aiohttp
import pytest
from click.testing import CliRunner

from proxy._cli import main
from proxy._config import ConfigError, load_settings
from proxy.testing import proxy_with_emulator


def test_layers_apply_in_order_defaults_toml_env_flags(tmp_path: Path) -> None:
    config = tmp_path / "proxy.toml"
    config.write_text('port = 9001\nmax_refolds = 3\nplugins = ["fold", "ledger"]\n')
    env = {"CONTEXT_PROXY_MAX_REFOLDS": "4", "CONTEXT_PROXY_PLUGINS": "ledger"}
    settings = load_settings(config, environ=env, overrides={"plugins": ["usage"], "host": None})
    assert settings.port == 9001  # TOML over the default
    assert settings.max_refolds == 4  # environment over TOML
    assert settings.plugins == ["usage"]  # flags over everything
    assert settings.host == "127.0.0.1"  # an unset flag leaves the lower layers alone


@pytest.mark.parametrize(
    ("raw", "expected"),
    [("true", True), ("1", True), ("yes", True), ("ON", True), ("false", False), ("0", False)],
)
def test_environment_booleans_read_as_people_write_them(raw: str, expected: bool) -> None:
    settings = load_settings(environ={"CONTEXT_PROXY_REQUIRE_SESSION": raw})
    assert settings.require_session is expected


@pytest.mark.parametrize(
    ("environ", "message"),
    [
        ({"CONTEXT_PROXY_PROT": "1"}, "unknown setting: environment variable CONTEXT_PROXY_PROT"),
        (
            {"CONTEXT_PROXY_REQUIRE_SESSION": "maybe"},
            "CONTEXT_PROXY_REQUIRE_SESSION: Expected `bool`",
        ),
        ({"CONTEXT_PROXY_PORT": "99999"}, "CONTEXT_PROXY_PORT: Expected `int` <= 65535"),
        ({"CONTEXT_PROXY_PORT": "eighty"}, "CONTEXT_PROXY_PORT: Expected `int`"),
        ({"CONTEXT_PROXY_LOG_LEVEL": "LOUD"}, "CONTEXT_PROXY_LOG_LEVEL: unknown level"),
        ({"CONTEXT_PROXY_PLUGIN": "{not json"}, "plugin (env CONTEXT_PROXY_PLUGIN)"),
    ],
)
def test_a_bad_environment_variable_is_one_line_naming_it(
    environ: dict[str, str], message: str
) -> None:
    with pytest.raises(ConfigError) as info:
        load_settings(environ=environ)
    text = str(info.value)
    assert text.startswith(message)
    assert "\n" not in text


def test_unknown_toml_key_is_one_line(tmp_path: Path) -> None:
    config = tmp_path / "proxy.toml"
    config.write_text("prot = 1\n")
    result = CliRunner().invoke(main, ["plugins", "--config", str(config)], env={})
    assert result.exit_code == 1
    assert result.output.strip() == "Error: bad setting: unknown setting: prot"


def test_bench_help_lists_the_benchmarks_and_rejects_unknown_ones() -> None:
    runner = CliRunner()
    shown = runner.invoke(main, ["bench", "--help"])
    assert shown.exit_code == 0
    assert "memory | overhead | concurrency" in " ".join(shown.output.split())  # click wraps
    assert "| instructions." in " ".join(shown.output.split())
    wrong = runner.invoke(main, ["bench", "speed"])
    assert wrong.exit_code == 2
    assert "'speed' is not one of memory, overhead, concurrency" in wrong.output


async def test_the_proxys_own_404_and_405_are_json() -> None:
    async with proxy_with_emulator() as h, aiohttp.ClientSession() as session:
        async with session.get(f"{h.url}/nowhere") as resp:
            assert resp.status == 404
            assert resp.content_type == "application/json"
            error = (await resp.json())["error"]
            assert error["type"] == "not_found_error"
            assert "/nowhere" in error["message"]
        async with session.post(f"{h.url}/healthz") as resp:
            assert resp.status == 405
            assert resp.content_type == "application/json"
            assert set(resp.headers["Allow"].split(",")) == {"GET", "HEAD"}
        assert h.emulator.stats == []


def test_context_proxy_config_names_the_file_when_no_flag_is_given(tmp_path: Path) -> None:
    config = tmp_path / "proxy.toml"
    config.write_text('plugins = ["ledger"]\n')
    result = CliRunner().invoke(
        main, ["plugins", "--json"], env={"CONTEXT_PROXY_CONFIG": str(config)}
    )
    assert result.exit_code == 0, result.output
    enabled = {p["name"] for p in json.loads(result.output)["plugins"] if p["enabled"]}
    assert enabled == {"ledger"}


def test_the_config_flag_wins_over_context_proxy_config(tmp_path: Path) -> None:
    from_env = tmp_path / "env.toml"
    from_env.write_text('port = "eighty"\n')
    from_flag = tmp_path / "flag.toml"
    from_flag.write_text("port = 9001\n")
    result = CliRunner().invoke(
        main, ["check", "--config", str(from_flag)], env={"CONTEXT_PROXY_CONFIG": str(from_env)}
    )
    assert result.exit_code == 0, result.output
    assert result.output.startswith("ok: ")


def test_a_bad_file_named_by_context_proxy_config_is_reported_by_check(tmp_path: Path) -> None:
    config = tmp_path / "proxy.toml"
    config.write_text('port = "eighty"\n')
    result = CliRunner().invoke(main, ["check"], env={"CONTEXT_PROXY_CONFIG": str(config)})
    assert result.exit_code == 1
    assert "port: Expected `int`" in result.output


def test_a_missing_file_named_by_context_proxy_config_is_one_line_naming_the_variable(
    tmp_path: Path,
) -> None:
    missing = tmp_path / "nowhere.toml"
    env = {"CONTEXT_PROXY_CONFIG": str(missing)}
    result = CliRunner().invoke(main, ["plugins"], env=env)
    assert result.exit_code == 1
    assert f"CONTEXT_PROXY_CONFIG: file not found: {missing}" in result.output
    check = CliRunner().invoke(main, ["check"], env=env)
    assert check.exit_code == 1
    assert check.output.strip() == f"problem: CONTEXT_PROXY_CONFIG: file not found: {missing}"


def test_version_has_one_source_and_the_cli_prints_it() -> None:
    import tomllib

    import proxy

    declared = tomllib.loads((Path(__file__).parents[2] / "pyproject.toml").read_text())
    assert proxy.__version__ == declared["project"]["version"]
    result = CliRunner().invoke(main, ["--version"])
    assert result.exit_code == 0
    assert result.output == f"context-proxy {proxy.__version__}\n"


@pytest.mark.parametrize(
    ("env", "line"),
    [
        (
            {"CONTEXT_PROXY_CONFIG": "/nonexistent/proxy.toml"},
            "CONTEXT_PROXY_CONFIG: file not found",
        ),
        ({"CONTEXT_PROXY_FOO": "1"}, "unknown setting: environment variable CONTEXT_PROXY_FOO"),
        ({"CONTEXT_PROXY_PLUGINS": "nosuch"}, "plugin 'nosuch'"),
    ],
    ids=["missing-config-file", "unknown-variable", "unknown-plugin"],
)
def test_demo_reports_a_bad_setting_in_one_line_like_serve(env: dict[str, str], line: str) -> None:
    result = CliRunner().invoke(main, ["demo", "--port", "0", "--once"], env=env)
    assert result.exit_code == 1
    assert result.exception is None or isinstance(result.exception, SystemExit)
    assert result.output.startswith("Error: ") and line in result.output, result.output
    assert len(result.output.strip().splitlines()) == 1, result.output


def test_demo_stops_on_ctrl_c_sent_while_its_first_stream_runs() -> None:
    """A SIGINT right after the first line (the demo's first stream still running) stops it.

    Started as a background job is (SIGINT ignored on entry, so Python installs no handler
    of its own): only the demo's own handler can take the signal, and it must be in place
    from the first line on, not only once the "Serving." line is printed.
    """
    proc = subprocess.Popen(
        [sys.executable, "-m", "proxy", "demo", "--port", "0"],
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_IGN),
    )
    try:
        assert proc.stdout is not None
        first = proc.stdout.readline()
        assert first.startswith("context-proxy on "), first
        os.kill(proc.pid, signal.SIGINT)
        assert proc.wait(timeout=30) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=10)

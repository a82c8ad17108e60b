"""``context-proxy check [--config FILE]`` (issue 12, item 3): like ``nginx -t``.

Exit 1 with one line per problem (a bad setting, a misspelt plugin option, an
unopenable ledger path: each named), exit 0 with a one-line summary on a good
file; storage is opened read-only, nothing is created or changed.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

from click.testing import CliRunner, Result

from plugins.ledger import LedgerPlugin
from proxy._cli import main


def _check(path: Path, **env: str) -> Result:
    return CliRunner().invoke(main, ["check", "--config", str(path)], env=env)


def test_each_problem_is_one_line_naming_it_and_the_exit_status_is_1(tmp_path: Path) -> None:
    config = tmp_path / "proxy.toml"
    config.write_text(
        'port = "eighty"\n'
        "max_body_bytes = 0\n"
        'plugins = ["fold", "ledger", "nosuchplugin"]\n'
        "[plugin.fold]\n"
        "keep_lastt = 3\n"
        "[plugin.ledger]\n"
        f'path = "{tmp_path}/missing-dir/ledger.db"\n'
    )
    result = _check(config)
    assert result.exit_code == 1
    lines = result.output.strip().splitlines()
    assert len(lines) == 5, result.output
    assert all(line.startswith("problem: ") for line in lines)
    text = result.output
    assert "port: Expected `int`" in text
    assert "max_body_bytes: Expected `int` >= 1" in text
    assert "'fold'" in text and "keep_lastt" in text
    assert "nosuchplugin" in text
    assert f"{tmp_path}/missing-dir" in text and "does not exist" in text


def test_a_bad_environment_variable_is_named_by_its_variable(tmp_path: Path) -> None:
    config = tmp_path / "proxy.toml"
    config.write_text('plugins = ["fold"]\n')
    result = _check(config, CONTEXT_PROXY_SHUTDOWN_GRACE="soon")
    assert result.exit_code == 1
    assert result.output.strip().startswith("problem: CONTEXT_PROXY_SHUTDOWN_GRACE: ")


def test_a_corrupt_or_foreign_ledger_file_is_a_problem(tmp_path: Path) -> None:
    junk = tmp_path / "junk.db"
    junk.write_bytes(b"this is not a database" * 100)
    config = tmp_path / "proxy.toml"
    config.write_text(f'plugins = ["ledger"]\n[plugin.ledger]\npath = "{junk}"\n')
    result = _check(config)
    assert result.exit_code == 1
    assert f"ledger database {junk}" in result.output
    assert len(result.output.strip().splitlines()) == 1


def test_two_plugins_keeping_their_state_in_one_file_is_a_problem(tmp_path: Path) -> None:
    # Each check passes alone (the file does not exist yet); serve would then refuse the
    # second store at start-up, so check must say so first.
    shared = tmp_path / "state.db"
    config = tmp_path / "proxy.toml"
    config.write_text(
        'plugins = ["fold", "ledger", "usage"]\n'
        f'[plugin.ledger]\npath = "{shared}"\n[plugin.usage]\npath = "{tmp_path}/./state.db"\n'
    )
    result = _check(config)
    assert result.exit_code == 1, result.output
    assert "plugins 'ledger' and 'usage' both keep their state in" in result.output
    apart = tmp_path / "apart.toml"
    apart.write_text(
        'plugins = ["fold", "ledger", "usage"]\n'
        f'[plugin.ledger]\npath = "{shared}"\n[plugin.usage]\npath = ":memory:"\n'
    )
    assert _check(apart).exit_code == 0


async def test_a_good_file_passes_with_a_summary_and_storage_is_left_untouched(
    tmp_path: Path,
) -> None:
    db = tmp_path / "state" / "ledger.db"
    db.parent.mkdir()
    config = tmp_path / "proxy.toml"
    config.write_text(
        'port = 9100\nplugins = ["fold", "ledger", "usage"]\n'
        f'[plugin.ledger]\npath = "{db}"\n[plugin.fold]\nkeep_last = 4\n'
    )
    # Not there yet: the directory is writable, start-up would create it.
    result = _check(config)
    assert result.exit_code == 0, result.output
    assert not db.exists(), "check must not create the ledger"
    # A real ledger's file (WAL mode, schema) checks too, and stays byte-identical.
    ledger = LedgerPlugin(path=str(db))
    await ledger.startup()
    try:
        # While a proxy holds it open (its write-ahead log exists), check reads it too.
        assert _check(config).exit_code == 0
    finally:
        await ledger.shutdown()
    before = {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in db.parent.iterdir()}
    result = _check(config)
    assert result.exit_code == 0, result.output
    lines = result.output.strip().splitlines()
    assert len(lines) == 1
    assert lines[0].startswith(f"ok: {config}")
    assert "3 plugin(s) ok (fold, ledger, usage)" in lines[0]
    assert "127.0.0.1:9100" in lines[0]
    after = {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in db.parent.iterdir()}
    assert after == before


def test_plugins_command_still_lists_without_constructing(tmp_path: Path) -> None:
    """``plugins --config`` lists; ``check`` is the command that refuses a bad option."""
    config = tmp_path / "proxy.toml"
    config.write_text('plugins = ["fold"]\n[plugin.fold]\nkeep_lastt = 3\n')
    assert CliRunner().invoke(main, ["plugins", "--config", str(config)]).exit_code == 0
    assert _check(config).exit_code == 1


def test_a_table_no_plugin_takes_is_one_problem_line(tmp_path: Path) -> None:
    """A misspelt ``[plugin.<key>]`` header is reported once; the plugins it does name pass."""
    config = tmp_path / "proxy.toml"
    config.write_text('plugins = ["fold"]\n[plugin.fold]\nkeep_last = 3\n[plugin.flod]\n')
    result = _check(config)
    assert result.exit_code == 1
    problems = [line for line in result.output.splitlines() if "plugin.flod" in line]
    assert len(problems) == 1
    assert "plugin.fold" not in result.output


def test_an_unimportable_plugin_is_one_problem_and_its_table_is_not_reported_again(
    tmp_path: Path,
) -> None:
    """The import failure is the problem; its own options table is not 'taken by no plugin'."""
    config = tmp_path / "proxy.toml"
    config.write_text(
        'plugins = ["fold", "no_such_module:Counter", "nosuchplugin"]\n'
        '[plugin."no_such_module:Counter"]\nlimit = 3\n[plugin.nosuchplugin]\nx = 1\n'
    )
    result = _check(config)
    assert result.exit_code == 1
    lines = result.output.strip().splitlines()
    assert len(lines) == 2, result.output
    assert "cannot import no_such_module:Counter" in lines[0]
    assert "nosuchplugin" in lines[1]
    assert "no plugin in the plugins list takes this table" not in result.output


def test_a_descriptor_reserve_the_limit_cannot_hold_is_a_problem_for_check_and_serve(
    tmp_path: Path,
) -> None:
    """``fd_reserve`` over half the descriptor limit (the limit ``serve`` raises to):
    ``check`` names it and ``serve`` refuses to start, instead of listening and then
    answering no connection at all, probes included (seen: fd_reserve 100000 under a
    limit of 20000)."""
    import resource
    import subprocess
    import sys

    config = tmp_path / "proxy.toml"
    config.write_text("fd_reserve = 100000\nport = 0\nplugins = []\n")

    def limited() -> None:
        resource.setrlimit(resource.RLIMIT_NOFILE, (20_000, 20_000))

    for command in ("check", "serve"):
        done = subprocess.run(
            [sys.executable, "-m", "proxy", command, "--config", str(config)],
            preexec_fn=limited,  # the limit is the child's only
            capture_output=True,
            text=True,
            timeout=60,
            check=False,
        )
        assert done.returncode == 1, (command, done.stdout, done.stderr)
        output = done.stdout + done.stderr
        assert "fd_reserve: 100000 leaves too few of the 20000 file descriptors" in output
        assert "listening" not in output
    config.write_text("fd_reserve = 16\nplugins = []\n")
    assert _check(config).exit_code == 0


async def test_a_store_pointed_at_the_other_plugins_file_says_so(tmp_path: Path) -> None:
    from plugins.ledger import LedgerPlugin
    from plugins.usage import UsagePlugin

    ledger_db, usage_db = tmp_path / "ledger.db", tmp_path / "usage.db"
    for plugin in (LedgerPlugin(path=str(ledger_db)), UsagePlugin(path=str(usage_db))):
        await plugin.startup()
        await plugin.shutdown()
    crossed = tmp_path / "crossed.toml"
    crossed.write_text(
        'plugins = ["fold", "ledger", "usage"]\n'
        f'[plugin.ledger]\npath = "{usage_db}"\n[plugin.usage]\npath = "{ledger_db}"\n'
    )
    result = _check(crossed)
    assert result.exit_code == 1
    assert (
        f"ledger database {usage_db} holds tables ['usage'] and no sessions table" in result.output
    ), result.output
    assert f"usage store {ledger_db} holds tables ['sessions'] and no usage table" in result.output

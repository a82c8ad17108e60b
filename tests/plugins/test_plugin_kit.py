"""The plugin author's kit: the ``context_proxy`` fixture, jsonlog through a real proxy,
``context-proxy plugins``, and the guide's walk-through (examples/count_per_model) working
verbatim: its code equals the example files, its tests pass, its config serves.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import importlib.metadata
import json
import os
import re
import shutil
import sys
from pathlib import Path
from typing import Any, Final, cast

import aiohttp
import anthropic
import openai
import pytest
from click.testing import CliRunner

from plugins.jsonlog import JsonLogPlugin
from plugins.usage import UsagePlugin
from proxy import ExchangeRecord, Plugin
from proxy._cli import main as cli_main
from proxy._emulator import start_emulator
from proxy._plugins import PluginError
from proxy._protocols import Protocol
from proxy.pytest_plugin import ProxyFactory
from proxy.testing import make_record, proxy_process

ROOT: Final = Path(__file__).resolve().parents[2]
EXAMPLE: Final = ROOT / "examples" / "count_per_model"
GUIDE: Final = ROOT / "docs" / "plugins.md"
SECRET: Final = "sk-plugin-kit-5d1e8c2b7a9f4036b1c8e2d7a5f9c3b1"
PROMPT_MARKER: Final = "prompt-marker-7f3a9c1e5b"
ANSWER_MARKER: Final = "answer-marker-2d8b6e4f0a"
VERSION: Final = importlib.metadata.version("context-proxy")


class Gate(Plugin):
    """Its commit waits until the test opens ``gate``; counts finished commits."""

    name = "gate"

    def __init__(self) -> None:
        self.gate = asyncio.Event()
        self.commits = 0

    async def commit(self, record: ExchangeRecord) -> None:
        await self.gate.wait()
        self.commits += 1


class Lifecycle(Plugin):
    """Counts its startup and shutdown calls."""

    name = "lifecycle"

    def __init__(self) -> None:
        self.started = 0
        self.stopped = 0

    async def startup(self) -> None:
        self.started += 1

    async def shutdown(self) -> None:
        self.stopped += 1


class Keep(Plugin):
    """Keeps every commit record."""

    name = "keep"

    def __init__(self) -> None:
        self.records: list[ExchangeRecord] = []

    async def commit(self, record: ExchangeRecord) -> None:
        self.records.append(record)


class RefusesToStart(Plugin):
    name = "refuses"

    async def startup(self) -> None:
        raise OSError("cannot open /nowhere/file")


async def chat(base_url: str, sid: str, content: str = "hi", **extra: str) -> str:
    client = openai.AsyncOpenAI(
        base_url=base_url, api_key=SECRET, default_headers={"x-session-id": sid, **extra}
    )
    completion = await client.chat.completions.create(
        model="m1", messages=[{"role": "user", "content": content}]
    )
    return completion.choices[0].message.content or ""


async def refused(url: str) -> bool:
    """Whether nothing listens at ``url`` any more."""
    try:
        async with aiohttp.ClientSession() as http, http.get(f"{url}/healthz"):
            return False
    except aiohttp.ClientConnectionError:
        return True


# -- the context_proxy fixture ---------------------------------------------------------------


async def test_settle_waits_for_the_commit_the_client_does_not_wait_for(
    context_proxy: ProxyFactory,
) -> None:
    plugin = Gate()
    h = await context_proxy(plugin)
    assert await chat(h.openai_base_url, "s1") == "Hello from the emulator."
    assert plugin.commits == 0  # the answer arrived; its commit is still waiting
    plugin.gate.set()
    await h.settle()
    assert plugin.commits == 1


async def test_stop_runs_shutdown_hooks_once_and_teardown_stops_the_rest() -> None:
    first, second = Lifecycle(), Lifecycle()
    async with contextlib.AsyncExitStack() as stack:
        factory = ProxyFactory(stack)
        h1 = await factory(first)
        h2 = await factory(second)
        assert (first.started, second.started) == (1, 1)
        await h1.stop()
        await h1.stop()  # idempotent
        assert (first.stopped, second.stopped) == (1, 0)
        assert await refused(h1.url)
        assert not await refused(h2.url)
    assert (first.stopped, second.stopped) == (1, 1)
    assert await refused(h2.url)


async def test_plugins_named_in_settings_load_as_serve_loads_them(
    context_proxy: ProxyFactory, tmp_path: Path
) -> None:
    log = tmp_path / "exchanges.jsonl"
    h = await context_proxy(plugins=["usage", "jsonlog"], plugin={"jsonlog": {"path": str(log)}})
    usage, jsonlog = h.state.host.plugins
    assert isinstance(usage, UsagePlugin)
    assert isinstance(jsonlog, JsonLogPlugin) and jsonlog.path == str(log)
    await chat(h.openai_base_url, "s1")
    await h.settle()
    assert h.metric("context_proxy_output_tokens_total", protocol="openai-chat", model="m1") == 3
    await h.stop()
    assert len(log.read_text(encoding="utf-8").splitlines()) == 1


async def test_a_config_file_is_read_as_serve_reads_it(
    context_proxy: ProxyFactory, tmp_path: Path
) -> None:
    log = tmp_path / "exchanges.jsonl"
    config = tmp_path / "proxy.toml"
    config.write_text(
        'plugins = ["jsonlog"]\nplugin_timeout = 2.5\nport = 9\n\n'
        f"[plugin.jsonlog]\npath = {json.dumps(str(log))}\nbackups = 2\n",
        encoding="utf-8",
    )
    h = await context_proxy(config=config)
    (jsonlog,) = h.state.host.plugins
    assert isinstance(jsonlog, JsonLogPlugin)
    assert (jsonlog.path, jsonlog.backups, h.state.host.timeout) == (str(log), 2, 2.5)
    # The harness still listens on an ephemeral port and talks to its own emulator.
    assert not h.url.endswith(":9")
    assert await chat(h.openai_base_url, "s1") == "Hello from the emulator."


async def test_a_plugin_refusing_to_start_fails_the_start(context_proxy: ProxyFactory) -> None:
    with pytest.raises(PluginError, match=r"plugin refuses: startup failed: .*/nowhere/file"):
        await context_proxy(RefusesToStart())


async def test_instances_and_names_mix_in_one_ordered_list(context_proxy: ProxyFactory) -> None:
    lifecycle = Lifecycle()
    h = await context_proxy("usage", lifecycle, plugin={"usage": {"max_models": 1}})
    usage, second = h.state.host.plugins
    assert isinstance(usage, UsagePlugin) and usage.max_models == 1
    assert second is lifecycle and lifecycle.started == 1
    with pytest.raises(TypeError, match="not both"):
        await context_proxy(Lifecycle(), plugins=["usage"])


async def test_session_view_of_an_unknown_session_is_none(context_proxy: ProxyFactory) -> None:
    h = await context_proxy(UsagePlugin())
    assert await h.session_view("never-seen") is None
    await chat(h.openai_base_url, "seen")
    await h.settle()
    view = await h.session_view("seen")
    assert view is not None
    assert (view["id"], view["in_flight"], view["requests"]) == ("seen", 0, 1)
    assert view["plugins"]["usage"]["output_tokens"] == 3


# -- the example plugin (jsonlog) through the proxy ------------------------------------------


RECORD_FIELDS: Final = {field.name for field in dataclasses.fields(ExchangeRecord)}


async def send_all_protocols(h_url: str) -> list[tuple[str, str, bool]]:
    """Four requests (chat JSON and SSE, Responses SSE, Anthropic JSON) carrying the markers.

    Returns ``(protocol, model, stream)`` of each, in order.
    """
    script = {"x-emulator": f"text={ANSWER_MARKER}", "x-session-id": "log-1"}
    oai = openai.AsyncOpenAI(base_url=f"{h_url}/v1", api_key=SECRET, default_headers=script)
    prompt = f"please keep this secret: {PROMPT_MARKER}"
    answer = await oai.chat.completions.create(
        model="chat-model", messages=[{"role": "user", "content": prompt}]
    )
    assert answer.choices[0].message.content == ANSWER_MARKER
    chunks = await oai.chat.completions.create(
        model="chat-model", messages=[{"role": "user", "content": prompt}], stream=True
    )
    text = "".join([c.choices[0].delta.content or "" async for c in chunks if c.choices])
    assert text == ANSWER_MARKER
    events = await oai.responses.create(model="resp-model", input=prompt, stream=True)
    deltas = [e.delta async for e in events if e.type == "response.output_text.delta"]
    assert "".join(deltas) == ANSWER_MARKER
    claude = anthropic.AsyncAnthropic(base_url=h_url, api_key=SECRET, default_headers=script)
    message = await claude.messages.create(
        model="claude-model", max_tokens=32, messages=[{"role": "user", "content": prompt}]
    )
    assert message.content[0].type == "text" and message.content[0].text == ANSWER_MARKER
    return [
        ("openai-chat", "chat-model", False),
        ("openai-chat", "chat-model", True),
        ("openai-responses", "resp-model", True),
        ("anthropic-messages", "claude-model", False),
    ]


async def test_jsonlog_writes_one_line_per_request_and_no_content(
    context_proxy: ProxyFactory, tmp_path: Path
) -> None:
    log = tmp_path / "exchanges.jsonl"
    h = await context_proxy(plugins=["jsonlog"], plugin={"jsonlog": {"path": str(log)}})
    sent = await send_all_protocols(h.url)
    await h.stop()

    text = log.read_text(encoding="utf-8")
    lines = [json.loads(line) for line in text.splitlines()]
    assert [(line["protocol"], line["model"], line["stream"]) for line in lines] == sent
    body_sizes = [record.body_bytes for record in h.emulator.stats]
    for line, size in zip(lines, body_sizes, strict=True):
        assert set(line) == RECORD_FIELDS
        assert (line["session_id"], line["status"], line["outcome"]) == ("log-1", 200, "ok")
        assert line["request_bytes"] == size > len(PROMPT_MARKER)
    # Neither the prompt, nor the answer, nor the key reaches the file.
    for secret in (PROMPT_MARKER, ANSWER_MARKER, SECRET):
        assert secret not in text


async def test_jsonlog_records_failed_exchanges_too(
    context_proxy: ProxyFactory, tmp_path: Path
) -> None:
    log = tmp_path / "exchanges.jsonl"
    h = await context_proxy(JsonLogPlugin(path=str(log)))
    client = openai.AsyncOpenAI(
        base_url=h.openai_base_url,
        api_key=SECRET,
        max_retries=0,
        default_headers={"x-emulator": "status=503", "x-session-id": "s-err"},
    )
    with pytest.raises(openai.InternalServerError):
        await client.chat.completions.create(
            model="m1", messages=[{"role": "user", "content": PROMPT_MARKER}]
        )
    await h.stop()
    (line,) = [json.loads(x) for x in log.read_text(encoding="utf-8").splitlines()]
    assert (line["status"], line["outcome"], line["session_id"]) == (503, "upstream_error", "s-err")
    assert line["input_tokens"] is None


# -- make_record: records for unit tests of commit hooks -------------------------------------


def test_make_record_fills_every_field_and_any_can_be_overridden() -> None:
    default = make_record()
    assert set(default.as_dict()) == RECORD_FIELDS
    for name in sorted(RECORD_FIELDS):  # 25 fields
        changed = make_record(**{name: "changed"})
        assert changed.as_dict() == {**default.as_dict(), name: "changed"}, name
    assert make_record() == default  # overrides never leak into later defaults
    with pytest.raises(TypeError, match="no_such_field"):
        make_record(no_such_field=1)
    with pytest.raises(TypeError, match="must be a scalar"):
        make_record(error=cast(Any, ["a", "list"]))


async def test_make_record_defaults_are_those_of_a_real_chat_exchange(
    context_proxy: ProxyFactory,
) -> None:
    keep = Keep()
    h = await context_proxy(keep)
    assert await chat(h.openai_base_url, "s1") == "Hello from the emulator."
    await h.stop()
    (real,) = keep.records
    made = make_record()
    # The member itself, typed as the public API says (not only its string).
    assert made.protocol is Protocol.CHAT and real.protocol is Protocol.CHAT
    same = ("protocol", "path", "session_id", "status", "outcome", "fold_level", "refolds")
    assert {name: getattr(made, name) for name in same} == {
        name: getattr(real, name) for name in same
    }
    # Same field types as the proxy's record, so a hook tested with it sees what it will see.
    for name in sorted(RECORD_FIELDS):
        ours, theirs = getattr(made, name), getattr(real, name)
        if ours is not None and theirs is not None:
            assert type(ours) is type(theirs), name


# -- `context-proxy plugins` -----------------------------------------------------------------


def plugins_table(output: str) -> dict[str, tuple[str, str, str]]:
    """``{name: (enabled, version, target)}`` from the command's ``--json`` output."""
    table: dict[str, tuple[str, str, str]] = {}
    for entry in json.loads(output)["plugins"]:
        enabled = "yes" if entry["enabled"] else "no"
        table[entry["name"]] = (enabled, entry["version"] or "-", entry["target"])
    return table


def plugins_text_fits(output: str) -> None:
    """The table form: a header naming the columns, every line within 80 columns."""
    lines = output.rstrip("\n").split("\n")
    assert lines[0].split() == ["name", "enabled", "version", "target"]
    assert all(len(line) <= 80 for line in lines), output


def invoke(*args: str) -> Any:
    result = CliRunner().invoke(cli_main, list(args), env={"CONTEXT_PROXY_PLUGINS": None})
    return result


def test_plugins_command_lists_the_installed_plugins_with_versions() -> None:
    plugins_text_fits(invoke("plugins").output)
    result = invoke("plugins", "--json")
    assert result.exit_code == 0, result.output
    table = plugins_table(result.output)
    assert table["fold"] == ("yes", VERSION, "plugins.fold:FoldPlugin")  # on by default
    assert table["ledger"] == ("no", VERSION, "plugins.ledger:LedgerPlugin")
    assert table["usage"] == ("no", VERSION, "plugins.usage:UsagePlugin")
    assert table["jsonlog"] == ("no", VERSION, "plugins.jsonlog:JsonLogPlugin")


def test_plugins_command_marks_what_the_config_enables(tmp_path: Path) -> None:
    config = tmp_path / "proxy.toml"
    config.write_text(
        'plugins = ["ledger", "usage", "my_pkg.audit:AuditPlugin"]\n', encoding="utf-8"
    )
    result = invoke("plugins", "--config", str(config), "--json")
    assert result.exit_code == 0, result.output
    table = plugins_table(result.output)
    assert table["fold"][0] == "no"
    assert table["ledger"][:2] == ("yes", VERSION)
    assert table["usage"][:2] == ("yes", VERSION)
    assert table["my_pkg.audit:AuditPlugin"] == ("yes", "-", "my_pkg.audit:AuditPlugin")


def test_plugins_command_reports_a_bad_config_in_one_line(tmp_path: Path) -> None:
    config = tmp_path / "proxy.toml"
    config.write_text('plugins = "ledger"\n', encoding="utf-8")
    result = invoke("plugins", "--config", str(config))
    assert result.exit_code == 1
    assert result.output.startswith("Error: bad setting: plugins:")
    assert len(result.output.strip().split("\n")) == 1


# -- the guide's walk-through, verbatim --------------------------------------------------------

_TITLED_BLOCK: Final = re.compile(r'^```\w+ title="([^"]+)"\n(.*?)^```$', re.MULTILINE | re.DOTALL)


def test_the_guide_shows_the_example_files_verbatim() -> None:
    blocks = dict(_TITLED_BLOCK.findall(GUIDE.read_text(encoding="utf-8")))
    shown = {
        "count_per_model.py",
        "test_count_per_model.py",
        "context-proxy.toml",
        "pyproject.toml",
    }
    assert set(blocks) == shown
    for name, code in blocks.items():
        assert code == (EXAMPLE / name).read_text(encoding="utf-8"), name


@pytest.fixture
def example_project(tmp_path: Path) -> Path:
    """A copy of examples/count_per_model outside the repository, as a newcomer has it."""
    project = tmp_path / "count_per_model"
    shutil.copytree(EXAMPLE, project, ignore=shutil.ignore_patterns("__pycache__", ".*cache"))
    return project


def clean_environ(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("CONTEXT_PROXY_", "PYTEST_"))}
    env.update(extra)
    return env


async def test_the_example_projects_own_tests_pass(example_project: Path) -> None:
    # A second interpreter running pytest costs ~3 s (imports of both SDKs); it is
    # the only way to prove the project works as a newcomer runs it.
    pytest_bin = Path(sys.executable).with_name("pytest")
    proc = await asyncio.create_subprocess_exec(
        str(pytest_bin),
        "-q",
        "-p",
        "no:cacheprovider",
        cwd=example_project,
        env=clean_environ(),
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.STDOUT,
    )
    async with asyncio.timeout(60):
        output, _ = await proc.communicate()
    text = output.decode()
    assert proc.returncode == 0, text
    assert re.search(r"^4 passed", text, re.MULTILINE), text


def test_the_example_config_is_listed_by_the_plugins_command(example_project: Path) -> None:
    config = str(example_project / "context-proxy.toml")
    plugins_text_fits(invoke("plugins", "--config", config).output)
    result = invoke("plugins", "--config", config, "--json")
    assert result.exit_code == 0, result.output
    table = plugins_table(result.output)
    target = "count_per_model:CountPerModelPlugin"
    assert table[target] == ("yes", "-", target)
    assert table["fold"][0] == "yes"


async def test_the_example_serves_with_the_console_script(example_project: Path) -> None:
    cli = Path(sys.executable).with_name("context-proxy")
    async with (
        await start_emulator() as emulator,
        proxy_process(
            "--upstream-openai",
            emulator.url,
            "--upstream-anthropic",
            emulator.url,
            command=[str(cli)],
            config="context-proxy.toml",
            cwd=example_project,
            env=clean_environ(PYTHONPATH="."),
        ) as proxy,
    ):
        for _ in range(2):
            await chat(f"{proxy.url}/v1", "s1")
        view = await proxy.session_view("s1")  # waits for the last commit
        async with aiohttp.ClientSession() as http, http.get(f"{proxy.url}/metrics") as resp:
            metrics = await resp.text()
        assert await proxy.stop() == 0
    assert view is not None
    assert view["plugins"]["count_per_model"] == {"requests": 2}
    assert 'count_per_model_requests_total{model="m1"} 2.0' in metrics
    assert "requests per model: {'m1': 2}" in proxy.output

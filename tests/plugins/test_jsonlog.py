"""The jsonlog example plugin: one JSON line per exchange, size rotation, no root logging."""

from __future__ import annotations

import json
import logging
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import pytest

from plugins.jsonlog import JsonLogPlugin
from proxy._plugins import PluginError, load_plugins
from proxy.testing import make_record


def lines_of(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines()]


def listing(directory: Path) -> list[Path]:
    return sorted(directory.iterdir())


@pytest.fixture
async def jsonlog(tmp_path: Path) -> AsyncIterator[JsonLogPlugin]:
    plugin = JsonLogPlugin(path=str(tmp_path / "exchanges.jsonl"))
    await plugin.startup()
    yield plugin
    await plugin.shutdown()


class _Collect(logging.Handler):
    """Collects the jsonlog plugin's records that reach the logger it is attached to."""

    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        if record.name.startswith("context_proxy.jsonlog"):
            self.records.append(record)


@pytest.fixture
def root_records() -> Iterator[list[logging.LogRecord]]:
    """Records of jsonlog loggers that reach the root logger (where the proxy's own log goes)."""
    root = logging.getLogger()
    handler = _Collect()
    level = root.level
    root.addHandler(handler)
    root.setLevel(logging.DEBUG)
    try:
        yield handler.records
    finally:
        root.removeHandler(handler)
        root.setLevel(level)


async def test_one_json_line_per_record_and_nothing_reaches_the_root_logger(
    jsonlog: JsonLogPlugin, root_records: list[logging.LogRecord]
) -> None:
    records = [
        make_record(exchange_id=f"x{n}", error='bad "quote" 100% \n newline' if n else None)
        for n in range(3)
    ]
    for record in records:
        await jsonlog.commit(record)
    await jsonlog.shutdown()

    assert lines_of(Path(jsonlog.path)) == [record.as_dict() for record in records]
    assert root_records == []


async def test_the_file_rotates_by_size_and_keeps_every_line(tmp_path: Path) -> None:
    path = tmp_path / "exchanges.jsonl"
    plugin = JsonLogPlugin(path=str(path), max_bytes=2048, backups=20)
    await plugin.startup()
    count = 30  # about 700 bytes a line: several rotations
    for n in range(count):
        await plugin.commit(make_record(exchange_id=f"x{n:02}"))
    await plugin.shutdown()

    files = listing(tmp_path)
    assert len(files) > 3
    assert all(f.stat().st_size <= 2048 for f in files)
    # path.N is older than path.N-1, and path itself is the newest.
    ordered = [tmp_path / f"exchanges.jsonl.{n}" for n in range(len(files) - 1, 0, -1)] + [path]
    ids = [line["exchange_id"] for f in ordered for line in lines_of(f)]
    assert ids == [f"x{n:02}" for n in range(count)]


async def test_rotation_drops_the_oldest_beyond_backups(tmp_path: Path) -> None:
    path = tmp_path / "exchanges.jsonl"
    plugin = JsonLogPlugin(path=str(path), max_bytes=1024, backups=2)
    await plugin.startup()
    for n in range(10):
        await plugin.commit(make_record(exchange_id=f"x{n:02}"))
    await plugin.shutdown()

    assert [f.name for f in listing(tmp_path)] == [
        "exchanges.jsonl",
        "exchanges.jsonl.1",
        "exchanges.jsonl.2",
    ]
    assert lines_of(path)[-1]["exchange_id"] == "x09"


async def test_shutdown_releases_the_file_for_a_new_instance(tmp_path: Path) -> None:
    path = str(tmp_path / "exchanges.jsonl")
    first = JsonLogPlugin(path=path)
    await first.startup()
    await first.commit(make_record(exchange_id="first"))

    clash = JsonLogPlugin(path=path)
    with pytest.raises(RuntimeError, match="already written"):
        await clash.startup()

    await first.shutdown()
    second = JsonLogPlugin(path=path)
    await second.startup()
    await second.commit(make_record(exchange_id="second"))
    await second.shutdown()
    assert [line["exchange_id"] for line in lines_of(Path(path))] == ["first", "second"]


async def test_commit_before_startup_refuses_instead_of_logging_to_root(
    tmp_path: Path, root_records: list[logging.LogRecord]
) -> None:
    plugin = JsonLogPlugin(path=str(tmp_path / "exchanges.jsonl"))
    with pytest.raises(RuntimeError, match="before startup"):
        await plugin.commit(make_record())
    assert root_records == []
    assert listing(tmp_path) == []  # constructing opened nothing


async def test_unwritable_path_fails_at_startup(tmp_path: Path) -> None:
    plugin = JsonLogPlugin(path=str(tmp_path / "missing-dir" / "exchanges.jsonl"))
    with pytest.raises(FileNotFoundError):
        await plugin.startup()


async def test_non_finite_timing_is_refused_not_written(jsonlog: JsonLogPlugin) -> None:
    with pytest.raises(ValueError):
        await jsonlog.commit(make_record(duration_s=float("nan")))
    await jsonlog.commit(make_record())
    await jsonlog.shutdown()
    assert len(lines_of(Path(jsonlog.path))) == 1


@pytest.mark.parametrize(
    "options", [{"path": ""}, {"max_bytes": -1}, {"backups": 0}], ids=lambda o: next(iter(o))
)
def test_bad_options_are_rejected(options: dict[str, Any]) -> None:
    with pytest.raises(ValueError, match=next(iter(options))):
        JsonLogPlugin(**options)


async def test_loads_from_config_shaped_options(tmp_path: Path) -> None:
    # What the proxy does with `plugins = ["plugins.jsonlog:JsonLogPlugin"]` and the
    # table `[plugin."plugins.jsonlog:JsonLogPlugin"]` of the TOML config.
    spec = "plugins.jsonlog:JsonLogPlugin"
    path = tmp_path / "exchanges.jsonl"
    host = load_plugins(
        [spec], {spec: {"path": str(path), "max_bytes": 4096, "backups": 1}}, timeout=1.0
    )
    (plugin,) = host.plugins
    assert isinstance(plugin, JsonLogPlugin)
    assert (plugin.path, plugin.max_bytes, plugin.backups) == (str(path), 4096, 1)

    await host.startup()
    await host.run_commit(make_record())
    await host.shutdown()
    assert len(lines_of(path)) == 1

    with pytest.raises(PluginError, match="bad options: backups"):
        load_plugins([spec], {spec: {"backups": 0}}, timeout=1.0)
    with pytest.raises(PluginError, match="bad options"):
        load_plugins([spec], {spec: {"max_byte": 10}}, timeout=1.0)  # a typo is not ignored

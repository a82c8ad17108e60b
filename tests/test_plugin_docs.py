"""docs/plugins.md tells a plugin author what they need without reading source (issue 12, 7)."""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path
from typing import Any

from proxy import ExchangeRecord, Outcome, WireMetadata

ROOT = Path(__file__).resolve().parents[1]
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

"""The tests mirror the code: one folder per area, as docs/design.md §10 lists them.

A test file dropped at the top of ``tests/`` (or into a folder the design does not
name) is one a reader of the map cannot find; a folder without ``__init__.py`` makes
two ``test_client.py`` of different areas clash as modules.
"""

from __future__ import annotations

import pathlib
import re
from typing import Final

ROOT: Final = pathlib.Path(__file__).resolve().parents[2]
TESTS: Final = ROOT / "tests"


def _design_folders() -> set[str]:
    """The folder names in the first column of docs/design.md §10's table."""
    text = (ROOT / "docs" / "design.md").read_text(encoding="utf-8")
    section = text[text.index("## §10 ") :]
    return set(re.findall(r"^\| `(\w+)/` \|", section, flags=re.M))


def _folders() -> set[str]:
    return {
        path.name
        for path in TESTS.iterdir()
        if path.is_dir() and not path.name.startswith((".", "__"))
    }


def test_no_test_file_lies_at_the_top_of_tests() -> None:
    assert sorted(path.name for path in TESTS.glob("test_*.py")) == []


def test_every_folder_of_tests_is_an_area_of_the_design_and_every_area_a_folder() -> None:
    assert _folders() == _design_folders()


def test_every_folder_is_a_package_and_support_holds_no_tests() -> None:
    for folder in sorted(_folders()):
        assert (TESTS / folder / "__init__.py").is_file(), folder
    assert sorted(path.name for path in (TESTS / "support").glob("test_*.py")) == []

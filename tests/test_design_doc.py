"""The design document the code cites exists, and every citation names one of its sections."""

from __future__ import annotations

import pathlib
import re

ROOT = pathlib.Path(__file__).resolve().parent.parent
DOC = ROOT / "docs" / "design.md"
OLD_CITATION = "DESIGN " + "section"  # split, so this file does not match itself
CITATION = re.compile(r"docs/design\.md §(\d+)(?: and §(\d+))?")


def sections() -> set[str]:
    return set(re.findall(r"^## §(\d+) ", DOC.read_text(encoding="utf-8"), flags=re.M))


def test_every_citation_of_the_design_names_a_section_it_has() -> None:
    have = sections()
    assert have == {str(n) for n in range(1, 10)}
    cited: dict[str, list[str]] = {}
    for folder in ("proxy", "plugins", "tests", "benchmarks"):
        for path in sorted((ROOT / folder).rglob("*.py")):
            for match in CITATION.finditer(path.read_text(encoding="utf-8")):
                for number in filter(None, match.groups()):
                    cited.setdefault(number, []).append(path.name)
    assert cited, "no citation found: the pattern is wrong"
    missing = {n: files for n, files in cited.items() if n not in have}
    assert missing == {}


def test_no_reference_to_the_old_unshipped_design_file_is_left() -> None:
    for folder in ("proxy", "plugins", "tests", "benchmarks"):
        for path in sorted((ROOT / folder).rglob("*.py")):
            assert OLD_CITATION not in path.read_text(encoding="utf-8"), path

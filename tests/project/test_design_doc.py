"""The design document the code cites exists, and every citation names one of its sections."""

from __future__ import annotations

import pathlib
import re

ROOT = pathlib.Path(__file__).resolve().parents[2]
DOC = ROOT / "docs" / "design.md"
OLD_CITATION = "DESIGN " + "section"  # split, so this file does not match itself
CITATION = re.compile(r"docs/design\.md §(\d+)(?: and §(\d+))?")


def sections() -> set[str]:
    return set(re.findall(r"^## §(\d+) ", DOC.read_text(encoding="utf-8"), flags=re.M))


def test_every_citation_of_the_design_names_a_section_it_has() -> None:
    have = sections()
    assert have == {str(n) for n in range(1, 11)}
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


# The module maps (docs/design.md §8 and README's development section) name the real files.


def _package_entries() -> set[str]:
    """``name.py`` for each module of ``proxy/``, ``name/`` for each subpackage."""
    package = ROOT / "proxy"
    modules = {path.name for path in package.glob("*.py")}
    subpackages = {f"{path.name}/" for path in package.iterdir() if (path / "__init__.py").exists()}
    return modules | subpackages


def _design_map() -> str:
    text = DOC.read_text(encoding="utf-8")
    section = text[text.index("## §8 ") : text.index("## §9 ")]
    return section[section.index("| module | job | kind |") :]


def test_the_design_module_map_lists_every_module_by_its_real_name() -> None:
    rows = [line for line in _design_map().splitlines() if line.startswith("| `")]
    named: set[str] = set()
    for row in rows:
        named.update(re.findall(r"`([\w.]+\.py|\w+/)`", row.split("|")[1]))
    assert named == _package_entries()
    cluster_row = next(row for row in rows if row.startswith("| `_cluster/`"))
    for path in sorted((ROOT / "proxy" / "_cluster").glob("*.py")):
        if path.name != "__init__.py":
            assert f"`{path.name}`" in cluster_row, path.name


def test_the_readme_module_map_lists_every_module_by_its_real_name() -> None:
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    section = text[text.index("## Development") :]
    block = section[section.index("```\nproxy/") : section.index("\nplugins/")]
    named = set(re.findall(r"(?<![\w/.])(\w+\.py|_\w+/)", block))
    assert named == _package_entries()

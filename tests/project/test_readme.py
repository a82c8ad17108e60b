"""README's first screen and the links of the documentation (issue 24, item 7).

A reader who opens the README sees what the proxy is, the two set-up commands and how
to point each client at it before scrolling; the benchmark record lives in
docs/benchmarks.md, with the headline figures left in README; every relative link
and image of README.md and docs/*.md names a file that exists, and an anchor a
heading of that file (GitHub's heading ids).
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Final

ROOT: Final = Path(__file__).resolve().parents[2]
README: Final = ROOT / "README.md"
#: Lines of a first screen (a laptop's browser window at GitHub's line height).
FIRST_SCREEN: Final = 45
SET_UP: Final = (
    "python3 -m venv .venv && . .venv/bin/activate && pip install '.[testing]'"
    " && context-proxy demo",
    "python3 -m venv .venv && . .venv/bin/activate && pip install -e '.[dev]' && python -m pytest",
)
#: ``[text](target)`` and ``![alt](target)``, outside code spans.
LINK: Final = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)\)")
CODE_BLOCK: Final = re.compile(r"^```.*?^```", re.M | re.S)
CODE_SPAN: Final = re.compile(r"`[^`\n]*`")


def _section(text: str, heading: str) -> str:
    """The body of the ``## heading`` section, up to the next ``## `` heading."""
    start = text.index(f"\n## {heading}\n")
    end = text.find("\n## ", start + 1)
    return text[start : end if end != -1 else len(text)]


def _anchor(heading: str) -> str:
    """GitHub's id for a Markdown heading: lower case, punctuation dropped, spaces to ``-``."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def _anchors(path: Path) -> set[str]:
    text = CODE_BLOCK.sub("", path.read_text(encoding="utf-8"))
    return {_anchor(m[1]) for m in re.finditer(r"^#{1,6} (.+)$", text, re.M)}


def test_the_first_screen_says_what_it_is_and_holds_the_set_up_and_the_clients() -> None:
    lines = README.read_text(encoding="utf-8").splitlines()[:FIRST_SCREEN]
    screen = "\n".join(lines)
    assert "request-memory lifetime" in screen
    for command in SET_UP:
        assert command in lines, command
    for client in ("Claude Code", "Codex", "`openai` SDK", "`anthropic` SDK"):
        assert any(line.startswith(f"| {client} |") for line in lines), client
    assert "ANTHROPIC_BASE_URL=http://127.0.0.1:8787 claude" in screen
    assert 'base_url = "http://127.0.0.1:8787/v1"' in screen  # Codex's provider entry


def test_the_readme_keeps_the_headline_benchmarks_and_links_the_full_record() -> None:
    text = README.read_text(encoding="utf-8")
    section = _section(text, "Benchmarks")
    assert len(section.splitlines()) <= 60
    assert "context-proxy bench memory --publish" in section
    assert "](docs/bench-memory.png)" in section
    assert "| peak, default plugins | ≤ 1.1 | 1.04 | **1.02** | 5.2 / 6.3 |" in section
    assert "](docs/benchmarks.md)" in section
    record = (ROOT / "docs" / "benchmarks.md").read_text(encoding="utf-8")
    for heading in ("Method", "Soak", "What the numbers mean, and the honest misses"):
        assert f"\n## {heading}\n" in record, heading
    assert "| holder | before | aiohttp's client replaced | now |" in record


def test_every_relative_link_of_the_documentation_resolves() -> None:
    pages = [README, ROOT / "CHANGELOG.md", *sorted((ROOT / "docs").glob("*.md"))]
    checked = 0
    broken: list[str] = []
    for page in pages:
        text = CODE_SPAN.sub("", CODE_BLOCK.sub("", page.read_text(encoding="utf-8")))
        for target in LINK.findall(text):
            if re.match(r"[a-z]+:", target):
                continue  # https:, mailto: — not ours to check offline
            path_part, _, anchor = target.partition("#")
            linked = (page.parent / path_part).resolve() if path_part else page
            checked += 1
            if not linked.exists():
                broken.append(f"{page.name}: {target}")
            elif anchor and linked.suffix == ".md" and anchor not in _anchors(linked):
                broken.append(f"{page.name}: {target} (no such heading)")
    assert checked > 10, "no links found: the pattern is wrong"
    assert broken == []

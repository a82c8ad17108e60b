"""Output of the benchmarks: terminal tables, progress bar, JSON, Markdown and PNG plots.

A benchmark fills :class:`Table` objects (plain strings, one verdict column at
most) and hands them to :class:`Reporter`, which prints them with rich and
writes the same tables as Markdown (for the README) next to the JSON of every
figure. Plots use matplotlib's Agg backend, so no display is needed.
"""

from __future__ import annotations

import dataclasses
import json
import math
import statistics
from collections.abc import Iterable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Final

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table as RichTable

__all__ = [
    "MISS",
    "PASS",
    "Reporter",
    "Stat",
    "Table",
    "fmt_bytes",
    "fmt_ratio",
    "plot_series",
    "stat",
    "verdict",
    "write_json",
]

PASS: Final = "PASS"
MISS: Final = "MISS"
MiB: Final = 1024 * 1024


@dataclasses.dataclass(frozen=True, slots=True)
class Stat:
    """Median, minimum and maximum of a set of repeats (same unit as the inputs)."""

    median: float
    min: float
    max: float
    n: int

    def as_dict(self) -> dict[str, float | int]:
        """``{"median", "min", "max", "n"}`` for the JSON file."""
        return {"median": self.median, "min": self.min, "max": self.max, "n": self.n}


def stat(values: Iterable[float]) -> Stat:
    """The :class:`Stat` of ``values``; NaNs everywhere when ``values`` is empty."""
    data = [v for v in values if not math.isnan(v)]
    if not data:
        return Stat(math.nan, math.nan, math.nan, 0)
    return Stat(statistics.median(data), min(data), max(data), len(data))


def fmt_ratio(value: Stat | float, digits: int = 2) -> str:
    """``1.02 [0.98, 1.05]`` (median [min, max]) for a :class:`Stat` of several
    repeats, ``1.02`` for one value."""
    if isinstance(value, Stat):
        if value.n == 0:
            return "n/a"
        if value.n == 1 or value.min == value.max:
            return f"{value.median:.{digits}f}"
        return f"{value.median:.{digits}f} [{value.min:.{digits}f}, {value.max:.{digits}f}]"
    return "n/a" if math.isnan(value) else f"{value:.{digits}f}"


def fmt_bytes(value: float) -> str:
    """Bytes as ``12.3 MiB`` / ``45.6 KiB`` / ``78 B`` (signed)."""
    if math.isnan(value):
        return "n/a"
    size = abs(value)
    sign = "-" if value < 0 else ""
    if size >= MiB:
        return f"{sign}{size / MiB:.1f} MiB"
    if size >= 1024:
        return f"{sign}{size / 1024:.1f} KiB"
    return f"{sign}{size:.0f} B"


def verdict(value: float, limit: float) -> str:
    """:data:`PASS` when ``value <= limit``, else :data:`MISS` (a NaN misses)."""
    return PASS if not math.isnan(value) and value <= limit else MISS


@dataclasses.dataclass(slots=True)
class Table:
    """A table of strings: ``title``, column headers, rows and footnotes.

    A cell equal to :data:`PASS` or :data:`MISS` is coloured on the terminal.
    ``section`` rows (a one-cell tuple) print as a separator line with a label.
    """

    title: str
    columns: Sequence[str]
    rows: list[Sequence[str]] = dataclasses.field(default_factory=list)
    notes: list[str] = dataclasses.field(default_factory=list)

    def add(self, *cells: str) -> None:
        """Append one row (as many cells as columns)."""
        if len(cells) != len(self.columns):
            raise ValueError(f"{len(cells)} cells for {len(self.columns)} columns")
        self.rows.append(cells)

    def section(self, label: str) -> None:
        """Append a separator row labelled ``label``."""
        self.rows.append((label,))

    def to_rich(self) -> RichTable:
        """The table for a rich console."""
        table = RichTable(title=self.title, title_justify="left", show_lines=False)
        for column in self.columns:
            table.add_column(column, overflow="fold")
        for row in self.rows:
            if len(row) == 1:
                table.add_section()
                table.add_row(f"[bold]{row[0]}[/bold]", *([""] * (len(self.columns) - 1)))
                continue
            table.add_row(*(_colour(cell) for cell in row))
        if self.notes:
            table.caption = "\n".join(self.notes)
            table.caption_justify = "left"
        return table

    def to_markdown(self) -> str:
        """The table as GitHub Markdown, notes as a list below it."""
        lines = [f"**{self.title}**", ""]
        lines.append("| " + " | ".join(self.columns) + " |")
        lines.append("|" + "|".join("---" for _ in self.columns) + "|")
        for row in self.rows:
            cells = [f"**{row[0]}**", *([""] * (len(self.columns) - 1))] if len(row) == 1 else row
            lines.append("| " + " | ".join(c.replace("|", "\\|") for c in cells) + " |")
        if self.notes:
            lines.append("")
            lines.extend(f"- {note}" for note in self.notes)
        return "\n".join(lines) + "\n"


def _colour(cell: str) -> str:
    if cell == PASS:
        return "[green]PASS[/green]"
    if cell == MISS:
        return "[bold red]MISS[/bold red]"
    return cell


def write_json(path: Path, data: Any) -> None:
    """Write ``data`` as indented JSON (NaN becomes ``null``); creates the directory."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(_finite(data), indent=2, sort_keys=False) + "\n", encoding="utf-8")


def _finite(value: Any) -> Any:
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_finite(v) for v in value]
    return value


class Reporter:
    """Terminal output of one benchmark run: a progress bar, then tables.

    ``quiet`` suppresses the progress bar (tables are still printed).
    """

    __slots__ = ("console", "quiet")

    def __init__(self, *, quiet: bool = False, console: Console | None = None) -> None:
        self.console = console or Console()
        self.quiet = quiet

    @contextmanager
    def progress(self, total: int, description: str) -> Iterator[Progress]:
        """A progress bar of ``total`` steps; advance it with ``progress.advance(task_id)``.

        The first task's id is 0; update the description with
        ``progress.update(0, description=...)``.
        """
        progress = Progress(
            TextColumn("[progress.description]{task.description}"),
            BarColumn(),
            MofNCompleteColumn(),
            TimeElapsedColumn(),
            console=self.console,
            disable=self.quiet,
            transient=False,
        )
        with progress:
            progress.add_task(description, total=total)
            yield progress

    def print_table(self, table: Table) -> None:
        """Print ``table`` to the terminal."""
        self.console.print(table.to_rich())

    def note(self, text: str) -> None:
        """Print one line of commentary."""
        self.console.print(text)


def write_markdown(path: Path, tables: Sequence[Table], preamble: str = "") -> None:
    """Write ``tables`` as Markdown to ``path`` (what the README includes)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    parts = [preamble.strip() + "\n"] if preamble else []
    parts.extend(table.to_markdown() for table in tables)
    path.write_text("\n".join(parts), encoding="utf-8")


@dataclasses.dataclass(frozen=True, slots=True)
class Series:
    """One line of a plot: ``label``, x values (seconds) and y values (MiB)."""

    label: str
    x: Sequence[float]
    y: Sequence[float]
    marks: Sequence[tuple[float, str]] = ()


@dataclasses.dataclass(frozen=True, slots=True)
class Panel:
    """One subplot: a title, axis labels, its series and horizontal reference lines."""

    title: str
    xlabel: str
    ylabel: str
    series: Sequence[Series]
    hlines: Sequence[tuple[float, str]] = ()
    step: bool = False


_COLOURS: Final = ("#1f77b4", "#d62728", "#2ca02c", "#9467bd", "#ff7f0e", "#8c564b")


def plot_series(path: Path, title: str, panels: Sequence[Panel], *, columns: int = 2) -> None:
    """Save ``panels`` as one PNG at ``path`` (matplotlib, Agg backend).

    A series' ``marks`` draw dotted vertical lines labelled with the phase name
    (on the first series of a panel only the labels are written, to avoid
    clutter when two series share the phase times).
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = max(1, math.ceil(len(panels) / columns))
    cols = min(columns, max(1, len(panels)))
    fig, axes = plt.subplots(rows, cols, figsize=(7.0 * cols, 4.2 * rows), squeeze=False)
    for index, panel in enumerate(panels):
        ax = axes[index // cols][index % cols]
        for number, series in enumerate(panel.series):
            colour = _COLOURS[number % len(_COLOURS)]
            if panel.step:
                ax.plot(series.x, series.y, marker="o", ms=3, color=colour, label=series.label)
            else:
                ax.plot(series.x, series.y, lw=1.2, color=colour, label=series.label)
            top = max(series.y) if series.y else 0.0
            for at, label in series.marks:
                ax.axvline(at, color=colour, ls=":", lw=0.8, alpha=0.7)
                ax.annotate(
                    label,
                    (at, top),
                    xytext=(2, -10 - 9 * (number % 2)),
                    textcoords="offset points",
                    fontsize=6.5,
                    color=colour,
                    rotation=0,
                )
        for level, label in panel.hlines:
            ax.axhline(level, color="grey", ls="--", lw=0.8)
            ax.annotate(label, (0.0, level), xytext=(2, 2), textcoords="offset points", fontsize=7)
        ax.set_title(panel.title, fontsize=10)
        ax.set_xlabel(panel.xlabel)
        ax.set_ylabel(panel.ylabel)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8, loc="upper right")
    for index in range(len(panels), rows * cols):
        axes[index // cols][index % cols].set_visible(False)
    fig.suptitle(title, fontsize=11)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)

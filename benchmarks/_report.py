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
import os
import statistics
from collections.abc import Iterable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Final

from rich import box
from rich.console import Console
from rich.markup import escape
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    TaskID,
    TextColumn,
    TimeElapsedColumn,
)
from rich.table import Table as RichTable

__all__ = [
    "MISS",
    "PASS",
    "Reporter",
    "Stat",
    "Steps",
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
#: Columns the tables fit when the output is not a terminal (a classic terminal's width).
TABLE_WIDTH: Final = 80


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

    A cell that is or ends with :data:`PASS` or :data:`MISS` is coloured on the terminal.
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
        # No vertical rules and no outer padding: a column costs its cells and two
        # spaces, so eight columns of figures fit 80 columns.
        table = RichTable(
            title=escape(self.title),
            title_justify="left",
            show_lines=False,
            box=box.SIMPLE_HEAD,
            show_edge=False,
            pad_edge=False,
            collapse_padding=True,
        )
        # A section label may be long ("1 MiB chat (B = 1,071,404 bytes)"): it wraps
        # inside the first column rather than widening it for every row.
        first = max([len(self.columns[0]), *(len(row[0]) for row in self.rows if len(row) > 1)])
        for index, column in enumerate(self.columns):
            table.add_column(
                escape(column), overflow="fold", max_width=max(first, 12) if index == 0 else None
            )
        for row in self.rows:
            if len(row) == 1:
                table.add_section()
                table.add_row(f"[bold]{escape(row[0])}[/bold]", *([""] * (len(self.columns) - 1)))
                continue
            table.add_row(*(_colour(cell) for cell in row))
        if self.notes:
            table.caption = escape("\n".join(self.notes))
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
    head, _, word = cell.rpartition(" ")
    if word == PASS and cell in (PASS, f"{head} {PASS}"):
        return f"{escape(head)} [green]PASS[/green]".lstrip()
    if word == MISS and cell in (MISS, f"{head} {MISS}"):
        return f"{escape(head)} [bold red]MISS[/bold red]".lstrip()
    return escape(cell)


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


class Steps:
    """Handle of a running progress bar: :meth:`describe` the current step, :meth:`advance`."""

    __slots__ = ("_progress", "_task")

    def __init__(self, progress: Progress, task: TaskID) -> None:
        self._progress = progress
        self._task = task

    def describe(self, text: str) -> None:
        """Show ``text`` as what is running now."""
        self._progress.update(self._task, description=text)

    def advance(self) -> None:
        """One step done."""
        self._progress.advance(self._task)


class Reporter:
    """Terminal output of one benchmark run: a progress bar, then tables.

    ``quiet`` suppresses the progress bar (tables are still printed).
    """

    __slots__ = ("console", "quiet")

    def __init__(self, *, quiet: bool = False, console: Console | None = None) -> None:
        if console is None:
            # On a terminal (or with COLUMNS set) rich uses that width; piped to a file
            # or a CI log the tables are laid out for 80 columns, which every
            # benchmark's table fits without folding a cell.
            console = Console()
            if not console.is_terminal and "COLUMNS" not in os.environ:
                console = Console(width=TABLE_WIDTH)
        self.console = console
        self.quiet = quiet

    @contextmanager
    def progress(self, total: int, description: str) -> Iterator[Steps]:
        """A progress bar of ``total`` steps (shown on the terminal, removed at the end)."""
        progress = Progress(
            TextColumn("[progress.description]{task.description}"),
            BarColumn(),
            MofNCompleteColumn(),
            TimeElapsedColumn(),
            console=self.console,
            disable=self.quiet,
            transient=True,
        )
        with progress:
            yield Steps(progress, progress.add_task(description, total=total))

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
    """One line of a plot: ``label``, x and y values, a matplotlib ``colour``, and
    ``spans``: ``(start, end)`` x ranges shaded in the series' colour (phases such as
    "answer held open"), named ``span_label`` in the legend; ``style`` is the
    matplotlib line style (``"-"``, ``"--"``, ``":"``)."""

    label: str
    x: Sequence[float]
    y: Sequence[float]
    colour: str = "#1f77b4"
    spans: Sequence[tuple[float, float]] = ()
    span_label: str = ""
    style: str = "-"


@dataclasses.dataclass(frozen=True, slots=True)
class Panel:
    """One subplot: a one-line title saying what is measured, axis labels, its series
    and horizontal reference lines (``(y, label)``: each drawn in its own colour and
    style, labelled on the plot at its right end and in the legend)."""

    title: str
    xlabel: str
    ylabel: str
    series: Sequence[Series]
    hlines: Sequence[tuple[float, str]] = ()
    step: bool = False


#: (colour, line style) of the 1st, 2nd, 3rd reference line of a panel: distinguishable
#: from each other and from the data lines (which are solid).
_HLINE_STYLES: Final = (("black", "--"), ("#e67e00", ":"), ("#7f7f7f", "-."))


def plot_series(path: Path, title: str, panels: Sequence[Panel], *, columns: int = 2) -> None:
    """Save ``panels`` as one PNG at ``path`` (matplotlib, Agg backend), ``columns`` wide.

    Legends go below their panel, outside the plotting area, so they never cover data.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    rows = max(1, math.ceil(len(panels) / columns))
    cols = min(columns, max(1, len(panels)))
    fig, axes = plt.subplots(
        rows, cols, figsize=(7.0 * cols, 5.0 * rows), squeeze=False, layout="constrained"
    )
    for index, panel in enumerate(panels):
        ax = axes[index // cols][index % cols]
        for series in panel.series:
            if panel.step:
                ax.plot(
                    series.x, series.y, marker="o", ms=3, color=series.colour, label=series.label
                )
            else:
                ax.plot(
                    series.x,
                    series.y,
                    lw=1.2,
                    ls=series.style,
                    color=series.colour,
                    label=series.label,
                )
            for number, (start, end) in enumerate(series.spans):
                ax.axvspan(
                    start,
                    end,
                    color=series.colour,
                    alpha=0.12,
                    lw=0,
                    label=series.span_label if number == 0 and series.span_label else None,
                )
        for number, (level, label) in enumerate(panel.hlines):
            colour, style = _HLINE_STYLES[number % len(_HLINE_STYLES)]
            ax.axhline(level, color=colour, ls=style, lw=1.4, label=label)
            # The first label sits above its line, the second below: two targets close
            # together (1.1 and 1.05) keep readable labels.
            ax.annotate(
                label,
                xy=(0.995, level),
                xycoords=("axes fraction", "data"),
                ha="right",
                va="bottom" if number % 2 == 0 else "top",
                fontsize=7.5,
                color=colour,
                bbox={"boxstyle": "square,pad=0.1", "fc": "white", "ec": "none", "alpha": 0.8},
            )
        ax.set_title(panel.title, fontsize=9.5)
        ax.set_xlabel(panel.xlabel)
        ax.set_ylabel(panel.ylabel)
        ax.grid(alpha=0.3)
        if panel.step:
            ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.legend(
            fontsize=7.5,
            loc="upper center",
            bbox_to_anchor=(0.5, -0.14),
            ncol=3,
            frameon=False,
        )
    for index in range(len(panels), rows * cols):
        axes[index // cols][index % cols].set_visible(False)
    fig.suptitle(title, fontsize=11)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)

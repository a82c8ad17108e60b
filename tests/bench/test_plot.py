"""The benchmark plot reads at a glance (issue 12, item 8), redrawn from the published JSON."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from benchmarks import memory

ROOT = Path(__file__).resolve().parents[2]
PUBLISHED = ROOT / "docs" / "bench-memory.json"


@pytest.fixture
def figure(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Any:
    """The matplotlib figure ``bench memory --replot`` draws from docs/bench-memory.json."""
    from matplotlib.figure import Figure

    saved: list[Figure] = []
    real_savefig = Figure.savefig

    def keep(self: Figure, *args: Any, **kwargs: Any) -> None:
        real_savefig(self, *args, **kwargs)
        saved.append(self)

    monkeypatch.setattr(Figure, "savefig", keep)
    out = tmp_path / "out"
    assert memory.main(["--replot", str(PUBLISHED), "--out", str(out)]) == 0
    assert (out / "memory.png").read_bytes().startswith(b"\x89PNG\r\n\x1a\n")
    assert len(saved) == 1
    fig = saved[0]
    from matplotlib.backends.backend_agg import FigureCanvasAgg

    FigureCanvasAgg(fig).draw()  # closed by the report: give it a canvas to measure on
    return fig


def test_legends_are_outside_the_data_and_targets_are_labelled_and_distinct(figure: Any) -> None:
    axes = [ax for ax in figure.axes if ax.get_visible()]
    assert len(axes) == 4
    renderer = figure.canvas.get_renderer()
    for ax in axes:
        assert ax.get_ylabel() == "RSS growth ÷ request body size"
        title = ax.get_title()
        assert "\n" not in title and title.startswith("RSS ")
        # The title fits over its panel on one line.
        assert ax.title.get_window_extent(renderer).width <= ax.get_window_extent(renderer).width
        legend = ax.get_legend()
        assert legend is not None
        plot_area = ax.get_window_extent(renderer)
        assert not legend.get_window_extent(renderer).overlaps(plot_area), title
        targets = [line for line in ax.get_lines() if "target" in str(line.get_label())]
        assert targets, title
        styles = {(str(line.get_color()), line.get_linestyle()) for line in targets}
        data_styles = {
            (str(line.get_color()), line.get_linestyle())
            for line in ax.get_lines()
            if line not in targets
        }
        assert len(styles) == len(targets), f"target lines look alike in {title!r}"
        assert not styles & data_styles
        labels = {text.get_text() for text in ax.texts}
        for line in targets:
            assert line.get_label() in labels, f"{line.get_label()} is not written on the plot"

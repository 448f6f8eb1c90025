"""The figures (matplotlib, Agg): a heatmap has its colour bar and labelled axes, bars and lines their
axes' labels, and each writes a PNG (#26: they were hand-drawn with PIL, without scales)."""

import numpy as np
from matplotlib.backends.backend_agg import FigureCanvasAgg

from vismmoe_kt.apps import plots


def test_heatmap_has_a_colour_bar_and_labelled_axes(tmp_path):
    panels = [("prefill", np.array([[0.5, 0.25, 0.25], [0.0, 1.0, 0.0]])), ("decode", np.full((2, 3), 1 / 3))]
    figure = plots.heatmap_figure(panels)
    heat = [ax for ax in figure.axes if ax.images]
    assert [ax.get_title() for ax in heat] == ["prefill", "decode"]
    assert all(ax.get_xlabel() == "expert" and ax.get_ylabel() == "layer" for ax in heat)
    bars = [ax.images[0].colorbar for ax in heat if ax.images[0].colorbar is not None]
    assert len(bars) == 1 and bars[0].ax.get_ylabel() == "share of the layer's activations"
    assert all(ax.images[0].get_clim() == (0.0, 1.0) for ax in heat)  # one scale for all panels, the bar's
    plots.heatmap_png(panels, tmp_path / "heat.png")
    assert (tmp_path / "heat.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_bars_have_ticks_labels_and_a_legend(tmp_path):
    figure = plots.bars_figure({"prefill": [0.5, 0.7], "decode": [0.4, 0.9]}, ["0-1", "1-2"], "similarity",
                               x_label="MoE layer pair", y_label="Jaccard similarity")
    ax = figure.axes[0]
    assert (ax.get_xlabel(), ax.get_ylabel(), ax.get_title()) == ("MoE layer pair", "Jaccard similarity", "similarity")
    assert [t.get_text() for t in ax.get_xticklabels()] == ["0-1", "1-2"]
    assert [t.get_text() for t in ax.get_legend().get_texts()] == ["prefill", "decode"]
    assert len(ax.patches) == 4


def test_horizontal_bars_name_each_row_and_mark_skipped_ones():
    figure = plots.hbars_figure([("decode tokens/s", [("gpu", 10.0), ("lru", None)])])
    FigureCanvasAgg(figure).draw()  # tick labels are set when drawn
    ax = figure.axes[0]
    assert [t.get_text() for t in ax.get_yticklabels()] == ["gpu", "lru"]
    assert [t.get_text() for t in ax.texts] == ["10", "skipped"]


def test_lines_have_labelled_axes_and_a_log_scale(tmp_path):
    figure = plots.line_figure({"loss": ([1, 2, 3], [1.0, 0.1, 0.01])}, "training", x_label="step", y_label="loss",
                               log_y=True)
    ax = figure.axes[0]
    assert (ax.get_xlabel(), ax.get_ylabel(), ax.get_yscale()) == ("step", "loss", "log")

"""PNG figures drawn with matplotlib: heatmaps with a colour bar, grouped and horizontal bars, lines.

Each `*_figure` builds a `matplotlib.figure.Figure` (tests read its axes, labels and colour bar) and
`*_png` writes it. Figures are made without pyplot: no global state, no display needed, Agg renders.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
from matplotlib.figure import Figure

DPI = 120


def save(figure: Figure, path: str | Path) -> None:
    figure.savefig(path, dpi=DPI)


def heatmap_figure(panels: list[tuple[str, np.ndarray]], value_label: str = "share of the layer's activations",
                   x_label: str = "expert", y_label: str = "layer") -> Figure:
    """Side-by-side (layers x experts) panels on one colour scale, with its colour bar."""
    top = max(float(data.max()) for _, data in panels) or 1.0
    figure = Figure(figsize=(1.5 + 4.5 * len(panels), 3.6), layout="constrained")
    axes = figure.subplots(1, len(panels), squeeze=False)[0]
    for ax, (title, data) in zip(axes, panels):
        image = ax.imshow(data, aspect="auto", cmap="viridis", vmin=0.0, vmax=top, interpolation="nearest")
        ax.set(title=title, xlabel=x_label, ylabel=y_label)
        ax.yaxis.get_major_locator().set_params(integer=True)
    figure.colorbar(image, ax=list(axes), label=value_label)
    return figure


def heatmap_png(panels: list[tuple[str, np.ndarray]], path: str | Path, **labels: str) -> None:
    save(heatmap_figure(panels, **labels), path)


def bars_figure(series: dict[str, list[float]], labels: list[str], title: str, top: float = 1.0,
                x_label: str = "", y_label: str = "") -> Figure:
    """Grouped bars: one group per label, one bar per series, values on [0, top]."""
    figure = Figure(figsize=(max(5.0, 0.5 * len(labels) * len(series) + 2), 3.6), layout="constrained")
    ax = figure.subplots()
    width = 0.8 / len(series)
    positions = np.arange(len(labels))
    for index, (name, values) in enumerate(series.items()):
        ax.bar(positions + (index - (len(series) - 1) / 2) * width, values, width, label=name)
    ax.set(title=title, xlabel=x_label, ylabel=y_label, ylim=(0, top), xticks=positions)
    ax.set_xticklabels(labels)
    ax.legend()
    return figure


def bars_png(series: dict[str, list[float]], labels: list[str], path: str | Path, title: str, top: float = 1.0,
             x_label: str = "", y_label: str = "") -> None:
    save(bars_figure(series, labels, title, top, x_label, y_label), path)


def hbars_figure(panels: list[tuple[str, list[tuple[str, float | None]]]]) -> Figure:
    """Horizontal bars, one panel per metric (its title names the unit), one bar per labelled row; a None
    value is written "skipped"."""
    rows = max(len(r) for _, r in panels)
    figure = Figure(figsize=(8, 0.8 + 0.3 * rows * len(panels) + 0.6 * len(panels)), layout="constrained")
    for ax, (title, values) in zip(figure.subplots(len(panels), 1, squeeze=False)[:, 0], panels):
        labels = [label for label, _ in values]
        numbers = [value or 0.0 for _, value in values]
        positions = np.arange(len(values))
        ax.barh(positions, numbers)
        ax.set(title=title, yticks=positions)
        ax.set_yticklabels(labels)
        ax.invert_yaxis()  # the first row on top, as listed
        for position, (_, value) in zip(positions, values):
            ax.annotate("skipped" if value is None else f"{value:.3g}", (value or 0.0, position),
                        xytext=(3, 0), textcoords="offset points", va="center", fontsize=8)
        ax.margins(x=0.15)
    return figure


def hbars_png(panels: list[tuple[str, list[tuple[str, float | None]]]], path: str | Path) -> None:
    save(hbars_figure(panels), path)


def line_figure(series: dict[str, tuple[list[float], list[float]]], title: str, x_label: str = "",
                y_label: str = "", log_y: bool = False) -> Figure:
    """Lines of (x, y) points on shared axes (e.g. a training loss curve), y log-scaled with `log_y`."""
    figure = Figure(figsize=(6.5, 3.6), layout="constrained")
    ax = figure.subplots()
    for name, (xs, ys) in series.items():
        ax.plot(xs, ys, label=name)
    ax.set(title=title, xlabel=x_label, ylabel=y_label)
    if log_y:
        ax.set_yscale("log")
    ax.grid(True, alpha=0.3)
    ax.legend()
    return figure


def line_png(series: dict[str, tuple[list[float], list[float]]], path: str | Path, title: str, x_label: str = "",
             log_y: bool = False, y_label: str = "") -> None:
    save(line_figure(series, title, x_label, y_label, log_y), path)

"""Small PNG figures drawn with PIL (no plotting library needed): heatmaps and grouped bars."""

from __future__ import annotations

from pathlib import Path

import numpy as np
from PIL import Image, ImageDraw

PALETTE = [(66, 103, 210), (230, 126, 34), (46, 160, 67), (150, 150, 150)]


def heatmap_png(panels: list[tuple[str, np.ndarray]], path: str | Path, note: str = "rows: layers, columns: experts") -> None:
    """Side-by-side (layers x experts) panels, darker = larger share; one colour scale for all."""
    scale = max(float(data.max()) for _, data in panels) or 1.0
    layers, experts = panels[0][1].shape
    cell = max(2, 600 // experts)
    row = max(3, 240 // layers)
    width, height, pad = experts * cell, layers * row, 28
    image = Image.new("RGB", (len(panels) * (width + pad) + pad, height + 2 * pad), "white")
    draw = ImageDraw.Draw(image)
    for index, (label, data) in enumerate(panels):
        x0 = pad + index * (width + pad)
        draw.text((x0, 4), f"{label}; {note}", fill="black")
        for layer in range(layers):
            for expert in range(experts):
                shade = int(255 * (1 - float(data[layer, expert]) / scale))
                y = pad + layer * row
                draw.rectangle([x0 + expert * cell, y, x0 + (expert + 1) * cell - 1, y + row - 1], fill=(shade, shade, 255))
    image.save(path)


def bars_png(series: dict[str, list[float]], labels: list[str], path: str | Path, title: str, top: float = 1.0) -> None:
    """Grouped bars: one group per label, one bar per series (values in [0, top])."""
    groups, names = len(labels), list(series)
    bar, gap, pad, height = 10, 8, 34, 220
    width = groups * (len(names) * bar + gap) + 2 * pad
    image = Image.new("RGB", (max(width, 360), height + 2 * pad + 14 * len(names)), "white")
    draw = ImageDraw.Draw(image)
    draw.text((pad, 6), title, fill="black")
    base = pad + height
    draw.line([(pad - 4, base), (width - pad, base)], fill="black")
    draw.line([(pad - 4, base), (pad - 4, pad)], fill="black")
    draw.text((2, pad - 6), f"{top:g}", fill="black")
    draw.text((2, base - 6), "0", fill="black")
    for g, label in enumerate(labels):
        x = pad + g * (len(names) * bar + gap)
        for s, name in enumerate(names):
            value = max(0.0, min(series[name][g], top))
            y = base - int(height * value / top)
            draw.rectangle([x + s * bar, y, x + (s + 1) * bar - 2, base], fill=PALETTE[s % len(PALETTE)])
        draw.text((x, base + 2), str(label), fill="black")
    for s, name in enumerate(names):
        y = base + 18 + 14 * s
        draw.rectangle([pad, y, pad + 10, y + 10], fill=PALETTE[s % len(PALETTE)])
        draw.text((pad + 16, y - 1), name, fill="black")
    image.save(path)


def hbars_png(panels: list[tuple[str, list[tuple[str, float | None]]]], path: str | Path) -> None:
    """Horizontal bars, one panel per metric, one bar per labelled row; a None value reads "skipped"."""
    label_width, bar_width, row, pad = 7 * max(len(label) for _, rows in panels for label, _ in rows) + 12, 320, 14, 10
    height = sum(pad + 16 + row * len(rows) for _, rows in panels) + pad
    image = Image.new("RGB", (label_width + bar_width + 90, height), "white")
    draw = ImageDraw.Draw(image)
    y = pad
    for index, (title, rows) in enumerate(panels):
        draw.text((pad, y), title, fill="black")
        y += 16
        top = max((v for _, v in rows if v is not None), default=0) or 1.0
        for label, value in rows:
            draw.text((pad, y), label, fill="black")
            if value is None:
                draw.text((label_width, y), "skipped", fill=(150, 150, 150))
            else:
                right = label_width + max(1, int(bar_width * value / top))
                draw.rectangle([label_width, y + 2, right, y + row - 3], fill=PALETTE[index % len(PALETTE)])
                draw.text((right + 4, y), f"{value:.3g}", fill="black")
            y += row
        y += pad
    image.save(path)


def line_png(series: dict[str, tuple[list[float], list[float]]], path: str | Path, title: str, x_label: str = "",
             log_y: bool = False) -> None:
    """Lines of (x, y) points on shared axes (e.g. a training loss curve); y from 0, or log-scaled between
    the smallest and largest value with `log_y` (a loss falls by orders of magnitude)."""
    pad, width, height = 48, 560, 260
    x_max = max(max(xs) for xs, _ in series.values()) or 1.0
    values = [float(y) for _, ys in series.values() for y in ys]
    if log_y:
        low, high = np.log10(min(values)), np.log10(max(values))
        scale = lambda y: (np.log10(float(y)) - low) / ((high - low) or 1.0)  # noqa: E731
        bottom, top = f"{min(values):.3g}", f"{max(values):.3g} (log)"
    else:
        high = max(values) or 1.0
        scale = lambda y: float(y) / high  # noqa: E731
        bottom, top = "0", f"{high:.3g}"
    image = Image.new("RGB", (width + 2 * pad, height + 2 * pad + 14 * len(series)), "white")
    draw = ImageDraw.Draw(image)
    draw.text((pad, 6), title, fill="black")
    base = pad + height
    draw.line([(pad, base), (pad + width, base)], fill="black")
    draw.line([(pad, base), (pad, pad)], fill="black")
    draw.text((4, pad - 16), top, fill="black")
    draw.text((4, base - 6), bottom, fill="black")
    draw.text((pad + width - 40, base + 4), f"{x_max:g} {x_label}", fill="black")
    for s, (name, (xs, ys)) in enumerate(series.items()):
        points = [(pad + width * float(x) / x_max, base - height * scale(y)) for x, y in zip(xs, ys)]
        draw.line(points, fill=PALETTE[s % len(PALETTE)], width=2)
        y = base + 18 + 14 * s
        draw.rectangle([pad, y, pad + 10, y + 10], fill=PALETTE[s % len(PALETTE)])
        draw.text((pad + 16, y - 1), name, fill="black")
    image.save(path)

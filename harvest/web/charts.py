"""Small inline SVG charts, drawn on the server: no JavaScript, no CDN, nothing to fetch.

Colours come from the page's stylesheet (classes ``s0``..``s2``), so the charts follow it.
Every mark has a ``<title>`` (a browser shows it on hover) with its exact figure.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from markupsafe import Markup, escape

WIDTH = 600  # default size in user units; the SVG scales to its box, so give a wide
HEIGHT = 200  # chart a wide viewBox to keep its text at the page's size
LEFT = 56  # room for the y axis labels
RIGHT = 8
TOP = 26  # room for the legend
BOTTOM = 22  # room for the time labels


@dataclass(frozen=True, slots=True)
class Series:
    """One named line or bar layer; ``None`` values are gaps."""

    name: str
    values: Sequence[float | None]


def nice_max(value: float) -> float:
    """The smallest of 1, 2, 2.5 or 5 times a power of ten that is >= ``value`` (> 0)."""
    if value <= 0 or not math.isfinite(value):
        return 1.0
    power = 10 ** math.floor(math.log10(value))
    for step in (1, 2, 2.5, 5, 10):
        if step * power >= value:
            return float(step * power)
    return float(10 * power)  # pragma: no cover - the loop always returns


def _number(value: float) -> str:
    """Three significant digits, never in exponent form: 1000 -> "1,000", 25000 -> "25k"."""
    if abs(value) >= 10_000:
        return f"{value / 1000:,.0f}k"
    if abs(value) >= 100 or value == int(value):
        return f"{value:,.0f}"
    return f"{value:.3g}"


def _fmt(value: float, unit: str) -> str:
    if unit == "s":
        if value >= 1:
            return f"{_number(value)} s"
        return f"{_number(value * 1000)} ms"
    return f"{_number(value)}{unit}"


@dataclass(frozen=True, slots=True)
class Box:
    width: int = WIDTH
    height: int = HEIGHT

    @property
    def plot_w(self) -> float:
        return float(self.width - LEFT - RIGHT)

    @property
    def plot_h(self) -> float:
        return float(self.height - TOP - BOTTOM)


def _frame(box: Box, title: str, labels: Sequence[str], top: float, unit: str) -> list[str]:
    plot_w, plot_h = box.plot_w, box.plot_h
    parts = [
        f'<svg class="chart" viewBox="0 0 {box.width} {box.height}" role="img" '
        f'aria-label="{escape(title)}" xmlns="http://www.w3.org/2000/svg">',
        f"<title>{escape(title)}</title>",
    ]
    for i in range(5):
        value = top * i / 4
        y = TOP + plot_h - plot_h * i / 4
        parts.append(f'<line class="grid" x1="{LEFT}" y1="{y:.1f}" x2="{box.width - RIGHT}" '
                     f'y2="{y:.1f}"/>')  # fmt: skip
        parts.append(
            f'<text class="axis" x="{LEFT - 6}" y="{y + 4:.1f}" text-anchor="end">'
            f"{escape(_fmt(value, unit))}</text>"
        )
    n = len(labels)
    if n:
        every = max(1, math.ceil(n / 6))
        for i in range(0, n, every):
            x = LEFT + plot_w * (i + 0.5) / n
            parts.append(
                f'<text class="axis" x="{x:.1f}" y="{box.height - 6}" text-anchor="middle">'
                f"{escape(labels[i])}</text>"
            )
    return parts


def bars(
    title: str,
    labels: Sequence[str],
    layers: Sequence[Series],
    *,
    unit: str = "",
    box: Box = Box(),
) -> Markup:
    """Stacked bars, one per label; layer ``i`` gets class ``s{i}``."""
    totals = [sum(layer.values[i] or 0 for layer in layers) for i in range(len(labels))]
    top = nice_max(max(totals, default=0))
    parts = _frame(box, title, labels, top, unit)
    plot_w, plot_h = box.plot_w, box.plot_h
    n = max(len(labels), 1)
    slot = plot_w / n
    width = max(slot * 0.7, 1)
    for i, label in enumerate(labels):
        base: float = TOP + plot_h
        x = LEFT + slot * i + (slot - width) / 2
        detail = ", ".join(f"{_fmt(layer.values[i] or 0, unit)} {layer.name}" for layer in layers)
        parts.append(f"<g><title>{escape(label)}: {escape(detail)}</title>")
        for k, layer in enumerate(layers):
            value = layer.values[i] or 0
            if value <= 0:
                continue
            h = plot_h * value / top
            base -= h
            parts.append(
                f'<rect class="s{k}" x="{x:.1f}" y="{base:.1f}" width="{width:.1f}" '
                f'height="{h:.1f}"/>'
            )
        parts.append(
            f'<rect class="hit" x="{LEFT + slot * i:.1f}" y="{TOP}" width="{slot:.1f}" '
            f'height="{plot_h}"/></g>'
        )
    parts.append(_legend(layers))
    parts.append("</svg>")
    return Markup("".join(parts))  # noqa: S704 - every text piece above is escaped


def lines(
    title: str,
    labels: Sequence[str],
    series: Sequence[Series],
    *,
    unit: str = "",
    box: Box = Box(),
) -> Markup:
    """One polyline per series (broken at gaps), with a dot per point; class ``s{i}``."""
    values = [v for s in series for v in s.values if v is not None]
    top = nice_max(max(values, default=0))
    parts = _frame(box, title, labels, top, unit)
    plot_w, plot_h = box.plot_w, box.plot_h
    n = max(len(labels), 1)
    for k, one in enumerate(series):
        segment: list[str] = []
        dots: list[str] = []
        for i, value in enumerate(one.values):
            if value is None:
                parts.append(_polyline(k, segment))
                segment = []
                continue
            x = LEFT + plot_w * (i + 0.5) / n
            y = TOP + plot_h - plot_h * min(value, top) / top
            segment.append(f"{x:.1f},{y:.1f}")
            label = labels[i] if i < len(labels) else ""
            dots.append(
                f'<circle class="s{k}" cx="{x:.1f}" cy="{y:.1f}" r="2.5"><title>'
                f"{escape(label)}: {escape(one.name)} {escape(_fmt(value, unit))}"
                "</title></circle>"
            )
        parts.append(_polyline(k, segment))
        parts.extend(dots)
    parts.append(_legend(series))
    parts.append("</svg>")
    return Markup("".join(parts))  # noqa: S704 - every text piece above is escaped


def _polyline(k: int, points: list[str]) -> str:
    if len(points) < 2:
        return ""
    return f'<polyline class="line s{k}" points="{" ".join(points)}"/>'


def _legend(series: Sequence[Series]) -> str:
    parts = []
    x = LEFT
    for k, one in enumerate(series):
        parts.append(
            f'<rect class="s{k}" x="{x}" y="4" width="10" height="10"/>'
            f'<text class="legend" x="{x + 14}" y="13">{escape(one.name)}</text>'
        )
        x += 24 + 7 * len(one.name)
    return "".join(parts)

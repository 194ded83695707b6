"""The inline SVG charts (pure: no services)."""

from __future__ import annotations

import re
import xml.etree.ElementTree as ET

import pytest

from harvest.web import charts

SVG = "{http://www.w3.org/2000/svg}"


@pytest.mark.parametrize(
    ("value", "expected"),
    [(0, 1.0), (-3, 1.0), (float("nan"), 1.0), (0.3, 0.5), (1, 1.0), (7, 10.0), (11, 20.0),
     (21, 25.0), (26, 50.0), (120, 200.0), (1e-4, 1e-4)],
)  # fmt: skip
def test_nice_max_is_a_round_ceiling(value: float, expected: float) -> None:
    assert charts.nice_max(value) == pytest.approx(expected)


def test_bars_stack_their_layers_to_scale_and_escape_text() -> None:
    svg = charts.bars(
        "ended <per> minute",
        ["12:00", "12:01", "<script>"],
        [charts.Series("ok", [3, 0, 1]), charts.Series("bad & worse", [1, 0, None])],
    )
    root = ET.fromstring(str(svg))  # well-formed XML: nothing unescaped got through
    assert root.find(f"{SVG}title").text == "ended <per> minute"  # type: ignore[union-attr]
    assert "<script>" not in str(svg) and "&lt;script&gt;" in str(svg)
    bars = [r for r in root.iter(f"{SVG}rect") if r.get("class") in {"s0", "s1"}]
    heights = [float(r.get("height", 0)) for r in bars if float(r.get("y", 0)) > 20]
    # Minute 1: 3 + 1 = 4 of a scale of 5: the stack is 4/5 of the plot's height.
    plot = charts.Box().plot_h
    assert heights[0] + heights[1] == pytest.approx(plot * 4 / 5, abs=0.2)
    titles = [t.text for t in root.iter(f"{SVG}title")]
    assert "12:00: 3 ok, 1 bad & worse" in titles


def test_lines_break_at_gaps_and_carry_each_value() -> None:
    svg = str(
        charts.lines(
            "latency",
            ["a", "b", "c", "d"],
            [charts.Series("p50", [0.01, None, 0.02, 0.03]), charts.Series("p99", [None] * 4)],
            unit="s",
        )
    )
    root = ET.fromstring(svg)
    polylines = list(root.iter(f"{SVG}polyline"))
    assert len(polylines) == 1  # a, then the gap, then c-d: only c-d is a line
    assert len(polylines[0].get("points", "").split()) == 2
    assert len(list(root.iter(f"{SVG}circle"))) == 3
    assert re.search(r"d: p50 30 ms", svg)


def test_an_empty_chart_still_draws() -> None:
    root = ET.fromstring(str(charts.bars("nothing", [], [])))
    assert root.get("viewBox") == f"0 0 {charts.WIDTH} {charts.HEIGHT}"


def test_axis_numbers_are_never_in_exponent_form() -> None:
    from harvest.web.charts import _fmt

    assert [_fmt(v, "") for v in (1000, 2500, 25_000, 0.5, 12.5, 0)] == [
        "1,000", "2,500", "25k", "0.5", "12.5", "0",
    ]  # fmt: skip
    assert _fmt(0.0123, "s") == "12.3 ms" and _fmt(1500, "/s") == "1,500/s"

"""What a benchmark produces: rows of repeated measurements, the comparisons between them and
the targets they are judged against. Pure: no I/O here."""

from __future__ import annotations

import math
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any, Literal

Kind = Literal["ratio_min", "ratio_max", "value_min", "value_max"]
Verdict = Literal["met", "floor", "missed", "n/a"]


@dataclass(frozen=True)
class Target:
    """A bar a figure must clear.

    ``ratio_min``: median ÷ baseline median ≥ threshold (``floor``: a lower bar that still
    counts as the minimum acceptable); ``ratio_max``: that ratio ≤ threshold; ``value_min`` /
    ``value_max``: the median itself against the threshold.
    """

    kind: Kind
    threshold: float
    text: str
    floor: float | None = None

    def judge(self, figure: float | None) -> Verdict:
        if figure is None or math.isnan(figure):
            return "n/a"
        if self.kind in ("ratio_min", "value_min"):
            if figure >= self.threshold:
                return "met"
            if self.floor is not None and figure >= self.floor:
                return "floor"
            return "missed"
        return "met" if figure <= self.threshold else "missed"


@dataclass(frozen=True)
class Comparison:
    """This row against another row of the same scenario (``baseline`` names its subject)."""

    baseline: str
    target: Target | None = None
    label: str = ""  # shown before the ratio, e.g. "vs PgQueuer"


@dataclass
class Row:
    """One subject's repeated measurement in one scenario."""

    scenario: str
    subject: str
    unit: str
    values: list[float] = field(default_factory=list)
    comparisons: list[Comparison] = field(default_factory=list)
    target: Target | None = None  # on the median itself
    higher_is_better: bool = True
    note: str = ""
    unavailable: str = ""  # why it was not measured (the row then shows "not available")
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def median(self) -> float | None:
        return statistics.median(self.values) if self.values else None

    @property
    def min(self) -> float | None:
        return min(self.values) if self.values else None

    @property
    def max(self) -> float | None:
        return max(self.values) if self.values else None


@dataclass(frozen=True)
class Judged:
    """A comparison worked out: the ratio of medians and the verdict."""

    baseline: str
    label: str
    ratio: float | None
    target: str
    verdict: Verdict


def ratio(a: float | None, b: float | None) -> float | None:
    if a is None or b is None or b == 0:
        return None
    return a / b


def judge_row(row: Row, rows: Sequence[Row]) -> tuple[list[Judged], Verdict]:
    """The row's comparisons (against rows of the same scenario) and its own target."""
    by_subject = {r.subject: r for r in rows if r.scenario == row.scenario}
    judged = []
    for comp in row.comparisons:
        base = by_subject.get(comp.baseline)
        value = ratio(row.median, base.median if base else None)
        verdict = comp.target.judge(value) if comp.target else "n/a"
        text = comp.target.text if comp.target else ""
        judged.append(Judged(comp.baseline, comp.label, value, text, verdict))
    own = row.target.judge(row.median) if row.target else "n/a"
    return judged, own


def row_dict(row: Row, rows: Sequence[Row]) -> dict[str, Any]:
    judged, own = judge_row(row, rows)
    data = asdict(row)
    data.pop("comparisons")
    data.update(
        median=row.median,
        min=row.min,
        max=row.max,
        target=asdict(row.target) if row.target else None,
        target_verdict=own,
        comparisons=[asdict(j) for j in judged],
    )
    return data


def percentile(values: Sequence[float], q: float) -> float:
    """Linear-interpolated percentile (``q`` in 0..100) of a non-empty sequence."""
    ordered = sorted(values)
    if not ordered:
        raise ValueError("percentile of no values")
    pos = (len(ordered) - 1) * q / 100.0
    lo = math.floor(pos)
    hi = min(lo + 1, len(ordered) - 1)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (pos - lo)


class Deadline:
    """A point in monotonic time after which a loop must stop."""

    def __init__(self, seconds: float) -> None:
        self.seconds = seconds
        self.at = time.monotonic() + seconds

    def left(self) -> float:
        return self.at - time.monotonic()

    def passed(self) -> bool:
        return time.monotonic() >= self.at


class BenchTimeout(RuntimeError):
    """A bounded wait ran out (the scenario is reported as failed, with this message)."""


def wait_for(
    check: Callable[[], bool], *, timeout: float, interval: float = 0.1, what: str = "condition"
) -> None:
    """Poll ``check`` until true; BenchTimeout after ``timeout`` seconds."""
    deadline = Deadline(timeout)
    while not check():
        if deadline.passed():
            raise BenchTimeout(f"timed out after {timeout:g}s waiting for {what}")
        time.sleep(min(interval, max(0.0, deadline.left())))

"""Tables that stay readable in any terminal: in a narrow one the columns that matter least are
left out (each column says the narrowest terminal it still appears in) and long values fold
onto more lines; no cell is cut to an ellipsis."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime

from rich.table import Table

WIDE = 120  # from this many columns on, times are shown whole (ISO 8601, milliseconds)


@dataclass(frozen=True, slots=True)
class Column:
    header: str
    shown_from: int = 0  # the narrowest terminal (in columns) that still shows it


def fit(
    columns: Sequence[Column],
    rows: Iterable[Sequence[str]],
    *,
    width: int,
    title: str | None = None,
) -> Table:
    """A table of the columns a terminal ``width`` columns wide shows, long values folded."""
    kept = [i for i, column in enumerate(columns) if width >= column.shown_from]
    table = Table(title=title)
    for i in kept:
        table.add_column(columns[i].header, overflow="fold")
    for row in rows:
        table.add_row(*(row[i] for i in kept))
    return table


def when(value: datetime | None, width: int) -> str:
    """A time for a table cell: whole in a wide terminal, to the second (UTC) otherwise."""
    if value is None:
        return "-"
    if width >= WIDE:
        return value.isoformat(timespec="milliseconds")
    return value.astimezone(UTC).strftime("%m-%d %H:%M:%S")

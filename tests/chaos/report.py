"""The chaos suite's figures: one row per case, printed as one table at the end of the run and
written to ``tests/chaos/latest.md`` (with the date and the machine) after a full run."""

from __future__ import annotations

import os
import platform
import socket
import subprocess
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path

from rich.console import Console
from rich.table import Table

CASES = (
    "F1", "F2", "F3", "F4", "F5", "F6", "F7", "F8", "F9", "F10", "F11", "F12", "F13",
    "S1", "S2", "S3", "S4", "S5",
)  # fmt: skip
LATEST = Path(__file__).resolve().parent / "latest.md"
COLUMNS = (
    "case",
    "jobs",
    "lost",
    "duplicate effects",
    "duplicate executions",
    "worst recovery",
    "overlaps",
    "notes",
)


@dataclass
class Row:
    """What one case measured. ``None`` means the figure does not apply to the case."""

    case: str
    title: str
    jobs: int | None = None
    lost: int | None = None
    duplicate_effects: int | None = None
    duplicate_executions: int | None = None
    worst_recovery: float | None = None  # seconds
    overlaps: int | None = None
    notes: str = ""
    outcome: str = "passed"  # passed | FAILED | skipped

    def cells(self) -> list[str]:
        def n(value: int | None) -> str:
            return "-" if value is None else f"{value:,}"

        recovery = "-" if self.worst_recovery is None else f"{self.worst_recovery:.1f} s"
        note = self.notes if self.outcome == "passed" else f"{self.outcome}: {self.notes}"
        return [
            f"{self.case} {self.title}",
            n(self.jobs),
            n(self.lost),
            n(self.duplicate_effects),
            n(self.duplicate_executions),
            recovery,
            n(self.overlaps),
            note,
        ]


@dataclass
class Report:
    rows: dict[str, Row] = field(default_factory=dict)
    started: datetime = field(default_factory=lambda: datetime.now(UTC))
    seconds: float | None = None

    def add(self, row: Row) -> Row:
        self.rows[row.case] = row
        print(
            " | ".join(row.cells())
        )  # each case reports its figures (shown with -s or on failure)
        return row

    def ordered(self) -> list[Row]:
        return sorted(self.rows.values(), key=lambda r: CASES.index(r.case))

    def complete(self) -> bool:
        return set(self.rows) == set(CASES)

    def table(self) -> Table:
        table = Table(title="harvest chaos suite")
        for name in COLUMNS:
            table.add_column(
                name, overflow="fold", justify="left" if name in ("case", "notes") else "right"
            )
        for row in self.ordered():
            table.add_row(*row.cells())
        return table

    def text(self, width: int = 160) -> str:
        console = Console(width=width, record=True, force_terminal=False, color_system=None)
        with console.capture() as capture:
            console.print(self.table())
        return capture.get()

    def markdown(self) -> str:
        lines = [
            "# harvest chaos suite: latest full run",
            "",
            f"- date: {self.started:%Y-%m-%d %H:%M} UTC",
            f"- machine: {machine()}",
            f"- wall clock of `pytest tests/chaos`: {self.seconds:.0f} s" if self.seconds else "",
            "",
            "| " + " | ".join(COLUMNS) + " |",
            "|" + "|".join(" --- " for _ in COLUMNS) + "|",
        ]
        lines += ["| " + " | ".join(row.cells()) + " |" for row in self.ordered()]
        return "\n".join(line for line in lines if line is not None) + "\n"

    def write(self, path: Path = LATEST) -> None:
        path.write_text(self.markdown(), encoding="utf-8")


def machine() -> str:
    """Host name, CPU model and count, memory, kernel, Python, and the server versions."""
    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    memory = ""
    try:
        kib = int(Path("/proc/meminfo").read_text().split()[1])
        memory = f", {kib / 1024 / 1024:.0f} GiB RAM"
    except (OSError, ValueError, IndexError):
        pass
    return (
        f"{socket.gethostname()} ({os.cpu_count()} x {cpu}{memory}; Linux {platform.release()}; "
        f"Python {platform.python_version()}; {_version('postgres')}; {_version('redis-server')})"
    )


def _version(exe: str) -> str:
    try:
        out = subprocess.run(
            [exe, "--version"], capture_output=True, text=True, timeout=10, check=False
        ).stdout
    except OSError:
        return f"{exe} ?"
    return " ".join(out.split()[:3]) if out else f"{exe} ?"

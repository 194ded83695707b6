"""What a call counts as (pure), and the process's tally of calls not yet written."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterable
from dataclasses import dataclass

MAX_ROWS = 100_000  # rows a tally keeps when flushes fail; beyond, the oldest minutes go

Bucket = tuple[float, str, int, str]  # (minute as epoch seconds, pool, key id, tenant)
Counts = tuple[int, int, int, int]  # (requests, tokens, 429s, errors)


@dataclass(frozen=True, slots=True)
class Call:
    """One call made with a leased key: its pool and key, the tokens it used (what the handler
    reported, else the tokens reserved for it), whether the service answered 429, and whether
    it ended in another error."""

    pool: str
    key_id: int
    tokens: int
    limited: bool = False
    error: bool = False
    tenant: str = ""


def call(
    pool: str,
    key_id: int,
    *,
    reported: int | None,
    reserved: int,
    limited: bool,
    error: bool,
    tenant: str = "",
) -> Call:
    """A handler that held a key ran: one request. Its tokens are what it reported with
    ``ctx.used``; without a report, its reservation stands (what the key was charged). A 429
    (the handler raised ``RateLimited``) is not also an error."""
    tokens = reported if reported is not None else reserved
    return Call(
        pool, key_id, max(tokens, 0), limited=limited, error=error and not limited, tenant=tenant
    )


def minute_of(at: float) -> float:
    return at - at % 60.0


class Tally:
    """Counts per (minute, pool, key, tenant) added in memory by any thread, taken by the
    flusher. Thread-safe; adding is a dict update under a lock (no I/O)."""

    def __init__(self, *, max_rows: int = MAX_ROWS) -> None:
        self.max_rows = max_rows
        self.dropped = 0  # rows given up when flushes kept failing
        self._rows: dict[Bucket, list[int]] = {}
        self._lock = threading.Lock()

    def add(self, one: Call, *, at: float | None = None) -> None:
        bucket = (minute_of(time.time() if at is None else at), one.pool, one.key_id, one.tenant)
        counts = (1, one.tokens, int(one.limited), int(one.error))
        self.merge([(bucket, counts)])

    def take(self) -> list[tuple[Bucket, Counts]]:
        """Everything counted so far, sorted (flushes of several processes lock rows in the
        same order), and the tally emptied."""
        with self._lock:
            rows, self._rows = self._rows, {}
        return sorted((b, (c[0], c[1], c[2], c[3])) for b, c in rows.items())

    def merge(self, rows: Iterable[tuple[Bucket, Counts]]) -> None:
        """Add ``rows`` (a flush that failed puts its rows back)."""
        with self._lock:
            for bucket, counts in rows:
                have = self._rows.setdefault(bucket, [0, 0, 0, 0])
                for i, n in enumerate(counts):
                    have[i] += n
            while len(self._rows) > self.max_rows:
                del self._rows[min(self._rows)]
                self.dropped += 1

    def __len__(self) -> int:
        with self._lock:
            return len(self._rows)

"""Counters and figures for stats, the demo summary, metrics and the dashboard's charts."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from sqlalchemy import Connection, text

# --- counters -------------------------------------------------------------------------------

_BUMP = text(
    """
    INSERT INTO harvest_counters (name, value) VALUES (:name, :n)
    ON CONFLICT (name) DO UPDATE SET value = harvest_counters.value + EXCLUDED.value
    """
)


def bump(conn: Connection, name: str, n: int = 1) -> None:
    if n:
        conn.execute(_BUMP, {"name": name, "n": n})


def counters(conn: Connection) -> dict[str, int]:
    rows = conn.execute(text("SELECT name, value FROM harvest_counters"))
    return {r.name: int(r.value) for r in rows}


# Every job: those in the jobs table and those in the history (harvest_jobs_all, a view).
_BY_STATUS = text("SELECT status, count(*) AS n FROM harvest_jobs_all GROUP BY status")


def counts_by_status(conn: Connection, names: Iterable[str] | None = None) -> dict[str, int]:
    if names is None:
        rows = conn.execute(_BY_STATUS)
    else:
        rows = conn.execute(
            text(
                "SELECT status, count(*) AS n FROM harvest_jobs_all "
                "WHERE name = ANY(:names) GROUP BY status"
            ),
            {"names": list(names)},
        )
    return {r.status: int(r.n) for r in rows}


# --- figures for stats, the demo summary and metrics -----------------------------------------

_DEPTH = text("SELECT queue, status, count(*) AS n FROM harvest_jobs_all GROUP BY queue, status")


def depth(conn: Connection) -> list[tuple[str, str, int]]:
    return [(r.queue, r.status, int(r.n)) for r in conn.execute(_DEPTH)]


_WINDOW = text(
    """
    SELECT
      count(*) FILTER (WHERE status = 'succeeded') AS succeeded,
      count(*) FILTER (WHERE status = 'failed') AS failed,
      count(*) FILTER (WHERE status = 'cancelled') AS cancelled,
      count(*) FILTER (WHERE attempts > 1) AS retried,
      percentile_cont(ARRAY[0.5, 0.95, 0.99]) WITHIN GROUP (
          ORDER BY extract(epoch FROM started_at - run_at))
          FILTER (WHERE attempts = 1 AND started_at IS NOT NULL) AS wait_p,
      percentile_cont(ARRAY[0.5, 0.95, 0.99]) WITHIN GROUP (
          ORDER BY extract(epoch FROM finished_at - started_at))
          FILTER (WHERE status = 'succeeded') AS run_p,
      extract(epoch FROM max(finished_at) - min(created_at)) AS span
    FROM harvest_jobs_all
    WHERE finished_at >= now() - make_interval(secs => :seconds)
      AND (CAST(:ids AS bigint[]) IS NULL OR id = ANY(CAST(:ids AS bigint[])))
    """
)


@dataclass(frozen=True, slots=True)
class Window:
    """Jobs that ended within a window (or among given ids): outcome counts and latencies."""

    succeeded: int
    failed: int
    cancelled: int
    retried: int
    wait_p: tuple[float, float, float] | None  # enqueue (due) to start: p50, p95, p99 seconds
    run_p: tuple[float, float, float] | None  # start to finish of successful attempts
    span: float | None  # first created to last finished, seconds


def window(conn: Connection, *, seconds: float, ids: Sequence[int] | None = None) -> Window:
    r = conn.execute(_WINDOW, {"seconds": seconds, "ids": list(ids) if ids else None}).one()

    def triple(v: Any) -> tuple[float, float, float] | None:
        return (float(v[0]), float(v[1]), float(v[2])) if v else None

    return Window(
        int(r.succeeded),
        int(r.failed),
        int(r.cancelled),
        int(r.retried),
        triple(r.wait_p),
        triple(r.run_p),
        float(r.span) if r.span is not None else None,
    )


def status_counts(conn: Connection, ids: Sequence[int]) -> dict[str, int]:
    """Jobs among ``ids`` by status."""
    rows = conn.execute(
        text("SELECT status, count(*) FROM harvest_jobs_all WHERE id = ANY(:ids) GROUP BY status"),
        {"ids": list(ids)},
    )
    return {r[0]: int(r[1]) for r in rows}


_MINUTES = text(
    """
    SELECT date_trunc('minute', finished_at) AS minute,
      count(*) FILTER (WHERE status = 'succeeded') AS succeeded,
      count(*) FILTER (WHERE status = 'failed') AS failed,
      count(*) FILTER (WHERE status = 'cancelled') AS cancelled,
      percentile_cont(ARRAY[0.5, 0.95, 0.99]) WITHIN GROUP (
          ORDER BY extract(epoch FROM started_at - run_at))
          FILTER (WHERE attempts = 1 AND started_at IS NOT NULL) AS wait_p,
      percentile_cont(ARRAY[0.5, 0.95, 0.99]) WITHIN GROUP (
          ORDER BY extract(epoch FROM finished_at - started_at))
          FILTER (WHERE status = 'succeeded' AND started_at IS NOT NULL) AS run_p
    FROM harvest_jobs_all
    WHERE status IN ('succeeded', 'failed', 'cancelled')
      AND finished_at >= date_trunc('minute', now()) - make_interval(mins => :minutes - 1)
    GROUP BY 1
    ORDER BY 1
    """
)


def minute_rows(conn: Connection, *, minutes: int) -> tuple[datetime, list[Any]]:
    """Jobs that ended in each of the last ``minutes`` minutes (the current one included):
    outcome counts and p50/p95/p99 of enqueue-to-start and run time. Returns the database's
    current minute and the rows of minutes that had any."""
    current: datetime = conn.execute(text("SELECT date_trunc('minute', now())")).scalar_one()
    return current, list(conn.execute(_MINUTES, {"minutes": minutes}))

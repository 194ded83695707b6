"""Scenario 3, enqueue: single enqueues per second and bulk enqueue rows per second, against a
raw INSERT and a raw COPY of the same rows into the same table (one process each, no workers:
what is measured is the write path alone)."""

from __future__ import annotations

import time
from typing import Any

import psycopg

from bench import jobs as bench_jobs
from bench.core import Comparison, Row, Target
from bench.env import Ctx

RAW_INSERT = (
    "INSERT INTO harvest_jobs (name, queue, payload, priority, run_at, max_attempts, timeout)"
    " VALUES (%s, 'execution', %s::jsonb, 0, now(), 3, 60) RETURNING id"
)
COPY = "COPY harvest_jobs (name, queue, payload, max_attempts, timeout) FROM STDIN"


def _timed_loop(seconds: float, once: Any) -> float:
    """Calls of ``once()`` per second over ``seconds``."""
    count = 0
    started = time.perf_counter()
    end = started + seconds
    while True:
        once()
        count += 1
        now = time.perf_counter()
        if now >= end:
            return count / (now - started)


def run(ctx: Ctx) -> list[Row]:
    from harvest import Harvest

    quick = ctx.cfg.quick
    seconds = 1.5 if quick else 5.0
    bulk_n = 5_000 if quick else 20_000
    reps = ctx.cfg.reps
    db = ctx.database()
    client = Harvest(ctx.migrated(db))
    client.jobs.update(bench_jobs.app.jobs)
    ctx.later(client.close)
    conn = psycopg.connect(db.url, autocommit=True)
    ctx.later(conn.close)

    def truncate() -> None:
        conn.execute("TRUNCATE harvest_jobs CASCADE")  # and the attempts (0007)

    def harvest_single() -> None:
        client.enqueue(bench_jobs.NOOP, {})

    def raw_single() -> None:
        conn.execute(RAW_INSERT, (bench_jobs.NOOP, "{}"), prepare=True).fetchone()

    def harvest_bulk() -> float:
        started = time.perf_counter()
        client.enqueue_many(bench_jobs.NOOP, [{}] * bulk_n)
        return bulk_n / (time.perf_counter() - started)

    def raw_copy() -> float:
        started = time.perf_counter()
        with conn.transaction(), conn.cursor() as cur, cur.copy(COPY) as copy:
            for _ in range(bulk_n):
                copy.write_row((bench_jobs.NOOP, "execution", "{}", 3, 60.0))
        return bulk_n / (time.perf_counter() - started)

    rows = {
        "single": Row(
            "enqueue",
            "harvest enqueue()",
            "jobs/s",
            comparisons=[
                Comparison("raw INSERT", Target("ratio_min", 0.7, "≥ 0.7x"), "vs raw INSERT")
            ],
            note="one job per call and transaction, 1 process",
        ),
        "insert": Row("enqueue", "raw INSERT", "jobs/s", note="psycopg, prepared, autocommit"),
        "bulk": Row(
            "enqueue",
            "harvest enqueue_many()",
            "rows/s",
            comparisons=[Comparison("raw COPY", Target("ratio_min", 0.7, "≥ 0.7x"), "vs COPY")],
            note=f"{bulk_n:,} rows per call, one transaction",
        ),
        "copy": Row("enqueue", "raw COPY", "rows/s", note=f"{bulk_n:,} rows, one transaction"),
    }
    ctx.record(*rows.values())
    ctx.plan(1 + reps)
    ctx.step("enqueue: warm-up")
    for fn in (harvest_single, raw_single):
        _timed_loop(min(1.0, seconds / 2), fn)
    truncate()
    harvest_bulk()
    truncate()
    raw_copy()
    ctx.step("enqueue: warm-up done", 1)
    for rep in range(reps):
        ctx.step(f"enqueue: rep {rep + 1}/{reps}")
        truncate()
        rows["single"].values.append(_timed_loop(seconds, harvest_single))
        truncate()
        rows["insert"].values.append(_timed_loop(seconds, raw_single))
        truncate()
        rows["bulk"].values.append(harvest_bulk())
        truncate()
        rows["copy"].values.append(raw_copy())
        ctx.step("enqueue", 1)
    return list(rows.values())

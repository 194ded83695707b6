"""Scenario 5, latency: enqueue-to-start (``started_at - run_at``, both read from the database
clock) at p50/p95/p99, when idle and at a steady moderate rate.

Idle: one job at a time, each enqueued after the previous one finished and the system has been
quiet for longer than the nudge coalescing window (so each enqueue finds the system idle).
Steady: single enqueues paced at ``RATE`` jobs/s for a while, then every job waited for.
"""

from __future__ import annotations

import time
from typing import Any

import psycopg

from bench import jobs as bench_jobs
from bench.core import BenchTimeout, Deadline, Row, Target, percentile
from bench.env import Ctx

RATE = 200.0
TERMINAL = ("succeeded", "failed", "cancelled")


def _wait_done(conn: psycopg.Connection[Any], ids: list[int], timeout: float) -> None:
    deadline = Deadline(timeout)
    while True:
        row = conn.execute(
            "SELECT count(*) FROM harvest_jobs WHERE id = ANY(%s) AND status <> ALL(%s)",
            (ids, list(TERMINAL)),
        ).fetchone()
        if row is not None and int(row[0]) == 0:
            return
        if deadline.passed():
            raise BenchTimeout(f"{row[0] if row else '?'} jobs not finished after {timeout:g}s")
        time.sleep(0.005 if len(ids) == 1 else 0.1)


def _waits_ms(conn: psycopg.Connection[Any], ids: list[int]) -> list[float]:
    rows = conn.execute(
        "SELECT extract(epoch FROM started_at - run_at) * 1000 FROM harvest_jobs"
        " WHERE id = ANY(%s) AND started_at IS NOT NULL",
        (ids,),
    ).fetchall()
    if len(rows) < len(ids):
        raise RuntimeError(f"{len(ids) - len(rows)} of {len(ids)} jobs never started")
    return [float(r[0]) for r in rows]


def run(ctx: Ctx) -> list[Row]:
    from harvest import Harvest

    quick, reps = ctx.cfg.quick, ctx.cfg.reps
    idle_samples = 4 if quick else 15
    steady_seconds = 3.0 if quick else 10.0
    knobs = dict(ctx.cfg.harvest_knobs)
    db = ctx.database()
    settings = ctx.migrated(db)
    quiet = int(knobs.get("HARVEST_NUDGE_COALESCE_MS", settings.nudge_coalesce_ms)) / 1000 + 0.15
    client = Harvest(settings)
    client.jobs.update(bench_jobs.app.jobs)
    ctx.later(client.close)
    conn = psycopg.connect(db.url, autocommit=True)
    ctx.later(conn.close)
    ctx.plan(1 + 2 * reps)
    ctx.step("latency: starting harvest")
    ctx.harvest_workers(settings, knobs, tag="harvest")

    def idle_run(samples: int) -> list[float]:
        ids = []
        for _ in range(samples):
            time.sleep(quiet)
            ids.append(client.enqueue(bench_jobs.NOOP, {}).id)
            _wait_done(conn, ids[-1:], 30.0)
        return _waits_ms(conn, ids)

    def steady_run(seconds: float) -> tuple[list[float], float]:
        time.sleep(quiet)
        ids = []
        total = int(RATE * seconds)
        started = time.perf_counter()
        for i in range(total):
            delay = started + i / RATE - time.perf_counter()
            if delay > 0:
                time.sleep(delay)
            ids.append(client.enqueue(bench_jobs.NOOP, {}).id)
        achieved = total / (time.perf_counter() - started)
        _wait_done(conn, ids, 60.0 + seconds)
        return _waits_ms(conn, ids), achieved

    ctx.step("latency: warm-up")
    idle_run(1 if quick else 3)
    steady_run(0.5 if quick else 2.0)
    ctx.step("latency: warm-up done", 1)
    idle_rows = [
        Row(
            "latency",
            f"idle p{q}",
            "ms",
            higher_is_better=False,
            target=Target("value_max", 20.0, "≤ 20 ms") if q == 50 else None,
            note=f"{idle_samples} jobs per rep, one at a time" if q == 50 else "",
        )
        for q in (50, 95, 99)
    ]
    steady_rows = [
        Row(
            "latency",
            f"{RATE:.0f}/s p{q}",
            "ms",
            higher_is_better=False,
            note=f"{steady_seconds:g} s of single enqueues per rep" if q == 50 else "",
        )
        for q in (50, 95, 99)
    ]
    ctx.record(*idle_rows, *steady_rows)
    for rep in range(reps):
        ctx.step(f"latency: idle rep {rep + 1}/{reps}")
        waits = idle_run(idle_samples)
        for row, q in zip(idle_rows, (50, 95, 99), strict=True):
            row.values.append(percentile(waits, q))
        ctx.step("latency", 1)
        ctx.step(f"latency: {RATE:.0f}/s rep {rep + 1}/{reps}")
        waits, achieved = steady_run(steady_seconds)
        for row, q in zip(steady_rows, (50, 95, 99), strict=True):
            row.values.append(percentile(waits, q))
        steady_rows[0].extra.setdefault("achieved_rate", []).append(round(achieved, 1))
        ctx.step("latency", 1)
    return idle_rows + steady_rows

"""Scenario 6, growth: how long the dispatch claim (``store.claim_due`` of one default batch,
through harvest's engine) takes with 10k, 100k and 1M pending rows, and with 1M finished rows
beside them.

The table is grown level by level. Each claim runs in its own transaction and is rolled back,
so every claim sees the same backlog; each rep starts from a vacuumed, analysed table (as
autovacuum would keep it) and reports the median of its claims.
"""

from __future__ import annotations

import statistics
import time
from typing import Any

import psycopg

from bench.claim import dispatch_claimer
from bench.core import Comparison, Row, Target, percentile
from bench.env import Ctx

FILL_CHUNK = 100_000
PENDING = "INSERT INTO harvest_jobs (name) SELECT 'bench.noop' FROM generate_series(1, %s)"
FINISHED = """
INSERT INTO harvest_jobs (name, status, attempts, run_at, started_at, finished_at, created_at)
SELECT 'bench.noop', 'succeeded', 1, t, t, t, t
FROM (SELECT now() - interval '1 day' AS t FROM generate_series(1, %s)) AS s
"""


def _label(n: int) -> str:
    return f"{n // 1_000_000}M" if n >= 1_000_000 else f"{n // 1000}k"


def _fill(conn: psycopg.Connection[Any], sql: str, n: int) -> None:
    for start in range(0, n, FILL_CHUNK):
        conn.execute(sql, (min(FILL_CHUNK, n - start),))


def run(ctx: Ctx) -> list[Row]:
    from sqlalchemy import Engine

    from harvest.db import make_engine

    quick, reps = ctx.cfg.quick, ctx.cfg.reps
    levels = [10_000, 50_000, 100_000] if quick else [10_000, 100_000, 1_000_000]
    finished = levels[-1]
    claims = 30 if quick else 150
    db = ctx.database()
    settings = ctx.migrated(db)
    batch = settings.claim_batch_size
    engine: Engine = make_engine(settings, pool_size=1)
    ctx.later(engine.dispose)
    conn = psycopg.connect(db.url, autocommit=True)
    ctx.later(conn.close)

    def measure(count: int) -> list[float]:
        conn.execute("VACUUM ANALYZE harvest_jobs")
        times = []
        with engine.connect() as sa_conn:
            claim = dispatch_claimer(sa_conn, settings, batch)
            for _ in range(count):
                tx = sa_conn.begin()
                started = time.perf_counter()
                got = claim()
                times.append((time.perf_counter() - started) * 1000)
                tx.rollback()
                if len(got) != min(batch, levels[0]):
                    raise RuntimeError(f"claimed {len(got)} rows, expected {batch}")
        return times

    base = f"{_label(levels[0])} pending"
    subjects = [(f"{_label(n)} pending", n, 0) for n in levels]
    subjects.append(
        (f"{_label(levels[-1])} pending + {_label(finished)} finished", levels[-1], finished)
    )
    ctx.plan(len(subjects) * (1 + reps))
    rows = []
    have_pending = have_finished = 0
    for name, pending, done in subjects:
        ctx.step(f"growth: filling {name}")
        _fill(conn, PENDING, pending - have_pending)
        _fill(conn, FINISHED, done - have_finished)
        have_pending, have_finished = pending, done
        row = Row(
            "growth",
            name,
            "ms",
            higher_is_better=False,
            note=f"claim of {batch} (median of {claims} claims per rep)" if name == base else "",
        )
        ctx.record(row)
        if name != base:
            last = pending == levels[-1] and not done
            target = Target("ratio_max", 1.5, "≤ 1.5x") if last else None
            row.comparisons.append(Comparison(base, target, f"vs {_label(levels[0])}"))
        ctx.step(f"growth: {name} warm-up")
        measure(10)
        ctx.step(f"growth: {name}", 1)
        p95s = []
        for rep in range(reps):
            ctx.step(f"growth: {name} rep {rep + 1}/{reps}")
            times = measure(claims)
            row.values.append(statistics.median(times))
            p95s.append(round(percentile(times, 95), 3))
            ctx.step(f"growth: {name}", 1)
        row.extra["p95_ms"] = p95s
        rows.append(row)
    return rows

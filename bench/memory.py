"""Scenario 7, memory: resident memory of harvest's execution worker processes (the prefork
children that run jobs) over 100k jobs: after the first 10k, after all 100k, and the peak.

One long run (the first 10k jobs are its warm-up); RSS is sampled twice a second with psutil.
"""

from __future__ import annotations

import time
from typing import Any

import psutil
import psycopg

from bench import jobs as bench_jobs
from bench.core import BenchTimeout, Comparison, Deadline, Row, Target
from bench.env import Ctx

MIB = 1024 * 1024


def _execution_children(group: Any) -> list[psutil.Process]:
    """The prefork children of the execution worker (its command line has ``-Q execution``)."""
    for proc in group.procs:
        try:
            main = psutil.Process(proc.pid)
            if "execution" in main.cmdline():
                return main.children(recursive=True)
        except psutil.Error:
            continue
    raise RuntimeError("no execution worker found among harvest's processes")


def _rss(procs: list[psutil.Process]) -> float:
    sizes = []
    for proc in procs:
        try:
            sizes.append(proc.memory_info().rss)
        except psutil.Error:
            continue
    return max(sizes) / MIB if sizes else 0.0


def run(ctx: Ctx) -> list[Row]:
    from harvest import Harvest

    quick = ctx.cfg.quick
    total = 5_000 if quick else 100_000
    checkpoint = total // 10
    knobs = dict(ctx.cfg.harvest_knobs)
    db = ctx.database()
    settings = ctx.migrated(db)
    client = Harvest(settings)
    client.jobs.update(bench_jobs.app.jobs)
    ctx.later(client.close)
    conn = psycopg.connect(db.url, autocommit=True)
    ctx.later(conn.close)
    ctx.plan(total)
    ctx.step("memory: starting harvest")
    group = ctx.harvest_workers(settings, knobs, tag="harvest")
    baseline = _rss(_execution_children(group))
    ctx.step(f"memory: enqueueing {total:,} jobs")
    for start in range(0, total, 20_000):
        client.enqueue_many(bench_jobs.NOOP, [{}] * min(20_000, total - start))
    k = _label(checkpoint)
    first = Row(
        "memory",
        f"RSS after {k}",
        "MiB",
        higher_is_better=False,
        note=f"largest execution child; {baseline:.1f} MiB when idle before the run",
    )
    last = Row(
        "memory",
        f"RSS after {_label(total)}",
        "MiB",
        higher_is_better=False,
        comparisons=[
            Comparison(f"RSS after {k}", Target("ratio_max", 1.10, "≤ 1.10x"), f"vs after {k}")
        ],
    )
    peak = Row("memory", "peak RSS", "MiB", [0.0], higher_is_better=False,
               note=f"over {total:,} jobs, sampled every 0.5 s")  # fmt: skip
    ctx.record(first, last, peak)
    samples: list[tuple[int, float]] = []
    peak.extra["samples"] = samples
    deadline = Deadline(total / 25 + 120)
    done = 0
    while done < total:
        if deadline.passed():
            raise BenchTimeout(f"memory: {total - done:,} jobs not run at the deadline")
        time.sleep(0.5)
        row = conn.execute(
            "SELECT count(*) FROM harvest_jobs WHERE status IN ('succeeded', 'failed')"
        ).fetchone()
        now_done = int(row[0]) if row else 0
        rss = _rss(_execution_children(group))
        if len(samples) < 2000:
            samples.append((now_done, round(rss, 2)))
        peak.values[0] = max(peak.values[0], rss)
        if not first.values and now_done >= checkpoint:
            first.values.append(rss)
        ctx.step(f"memory: {now_done:,}/{total:,} jobs, {rss:.1f} MiB", now_done - done)
        done = now_done
    last.values.append(_rss(_execution_children(group)))
    peak.extra["samples"] = samples[:: max(1, len(samples) // 200)]
    return [first, last, peak]


def _label(n: int) -> str:
    return f"{n // 1000}k" if n % 1000 == 0 else f"{n:,}"

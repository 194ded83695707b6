"""Scenario 7, memory: resident memory of harvest's execution worker processes (the prefork
children that run jobs) over 100k jobs: after the first 10k, after all 100k, and the peak.
Twice: no-op sync jobs, then async jobs that each wait 1 s with 1,000 of them in flight (2
processes x ``HARVEST_ASYNC_CONCURRENCY=500``: the one documented setting).

One long run each (the first 10k jobs are its warm-up); RSS is sampled twice a second with
psutil.
"""

from __future__ import annotations

import time
from typing import Any

import psutil
import psycopg

from bench import jobs as bench_jobs
from bench import jobs_async as bench_async
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


ASYNC_IN_FLIGHT = 1000


def run(ctx: Ctx) -> list[Row]:
    return [*_run(ctx, asynchronous=False), *_run(ctx, asynchronous=True)]


def _run(ctx: Ctx, *, asynchronous: bool) -> list[Row]:
    from harvest import Harvest

    quick = ctx.cfg.quick
    total = 5_000 if quick else 100_000
    what = f"async, {ASYNC_IN_FLIGHT:,} in flight: " if asynchronous else ""
    checkpoint = total // 10
    knobs = dict(ctx.cfg.harvest_knobs)
    db = ctx.database()
    settings = ctx.migrated(db)
    client = Harvest(settings)
    client.jobs.update((bench_async if asynchronous else bench_jobs).app.jobs)
    ctx.later(client.close)
    conn = psycopg.connect(db.url, autocommit=True)
    ctx.later(conn.close)
    ctx.plan(total)
    ctx.step("memory: starting harvest")
    if asynchronous:
        knobs["HARVEST_ASYNC_CONCURRENCY"] = str(ASYNC_IN_FLIGHT // 2)
    group = ctx.harvest_workers(
        settings,
        knobs,
        tag="harvest-async" if asynchronous else "harvest",
        imports="bench.jobs_async" if asynchronous else "bench.jobs",
    )
    baseline = _rss(_execution_children(group))
    ctx.step(f"memory: enqueueing {total:,} jobs")
    name, payload = (bench_async.WAIT, {"seconds": 1.0}) if asynchronous else (bench_jobs.NOOP, {})
    for start in range(0, total, 20_000):
        client.enqueue_many(name, [payload] * min(20_000, total - start))
    k = _label(checkpoint)
    first = Row(
        "memory",
        f"{what}RSS after {k}",
        "MiB",
        higher_is_better=False,
        note=f"largest execution child; {baseline:.1f} MiB when idle before the run",
    )
    last = Row(
        "memory",
        f"{what}RSS after {_label(total)}",
        "MiB",
        higher_is_better=False,
        comparisons=[
            Comparison(
                f"{what}RSS after {k}", Target("ratio_max", 1.10, "≤ 1.10x"), f"vs after {k}"
            )
        ],
    )
    peak = Row("memory", f"{what}peak RSS", "MiB", [0.0], higher_is_better=False,
               note=f"over {total:,} jobs, sampled every 0.5 s")  # fmt: skip
    ctx.record(first, last, peak)
    samples: list[tuple[int, float]] = []
    peak.extra["samples"] = samples
    deadline = Deadline(total / (100 if asynchronous else 25) + 120)
    running_max = 0
    done = 0
    while done < total:
        if deadline.passed():
            raise BenchTimeout(f"memory: {total - done:,} jobs not run at the deadline")
        time.sleep(0.5)
        row = conn.execute(
            "SELECT count(*) FILTER (WHERE status IN ('succeeded', 'failed')),"
            " count(*) FILTER (WHERE status = 'running') FROM harvest_jobs"
        ).fetchone()
        now_done, running = (int(row[0]), int(row[1])) if row else (0, 0)
        running_max = max(running_max, running)
        rss = _rss(_execution_children(group))
        if len(samples) < 2000:
            samples.append((now_done, round(rss, 2)))
        peak.values[0] = max(peak.values[0], rss)
        if not first.values and now_done >= checkpoint:
            first.values.append(rss)
        ctx.step(
            f"memory: {what}{now_done:,}/{total:,} jobs, {running:,} running, {rss:.1f} MiB",
            now_done - done,
        )
        done = now_done
    last.values.append(_rss(_execution_children(group)))
    peak.note += f"; at most {running_max:,} jobs running at once"
    group.stop()  # the next run's workers share the broker: none of these may take its messages
    peak.extra["samples"] = samples[:: max(1, len(samples) // 200)]
    return [first, last, peak]


def _label(n: int) -> str:
    return f"{n // 1000}k" if n % 1000 == 0 else f"{n:,}"

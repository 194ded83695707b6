"""Scenarios 1 and 2, end to end: N no-op jobs enqueued in bulk and drained by two processes.

1. ``e2e``: harvest against plain Celery (same Redis broker), procrastinate and PgQueuer (their
   own workers, same Postgres).
2. ``gate``: harvest with and without the key pool gate (8 keys, no rate limit).

Subjects run interleaved (rep 1 of each, then rep 2 of each, ...) so that a change in the
machine's load weighs on all of them alike. A subject that fails is reported as such; the
others go on.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from cryptography.fernet import Fernet

from bench import jobs as bench_jobs
from bench import jobs_pooled
from bench.core import Comparison, Row, Target
from bench.env import Ctx
from bench.subjects import (
    KEYS,
    CelerySubject,
    HarvestSubject,
    PgQueuerSubject,
    ProcrastinateSubject,
    Subject,
    drain,
)

UNIT = "jobs/s"
ASYNC = "harvest async"
THREADS = "harvest threads"
THREAD_POOL = ("--pool", "threads", "-c", "32")  # one process: within the 2-process budget


def warmup_jobs(ctx: Ctx) -> int:
    return min(ctx.cfg.jobs, 200 if ctx.cfg.quick else 2000)


def measure(
    ctx: Ctx,
    scenario: str,
    subjects: Sequence[Subject],
    rows: Mapping[str, Row],
    warm: Sequence[Subject] = (),
) -> list[Subject]:
    """Start each subject, warm it up (unless in ``warm``), then run the reps interleaved.
    Returns the subjects that ran (a failed one gets its row marked and is left out)."""
    n, reps = ctx.cfg.jobs, ctx.cfg.reps
    live: list[Subject] = []
    for subject in subjects:
        if rows[subject.name].unavailable:  # found wanting before it came here
            ctx.step(f"{scenario}: {subject.name} skipped", 1 + ctx.cfg.reps)
            continue
        ctx.step(f"{scenario}: starting {subject.name}")
        try:
            subject.start()
            if all(subject is not w for w in warm):
                ctx.step(f"{scenario}: warm-up {subject.name}")
                drain(subject, warmup_jobs(ctx))
            live.append(subject)
        except Exception as exc:
            rows[subject.name].unavailable = f"failed: {type(exc).__name__}: {exc}"[:300]
        ctx.step(f"{scenario}: {subject.name} ready", 1)
    for rep in range(reps):
        for subject in list(live):
            ctx.step(f"{scenario}: {subject.name} rep {rep + 1}/{reps} ({n:,} jobs)")
            row = rows[subject.name]
            try:
                run = drain(subject, n)
            except Exception as exc:
                row.unavailable = f"failed: {type(exc).__name__}: {exc}"[:300]
                row.values.clear()
                live.remove(subject)
                continue
            row.values.append(run.rate)
            row.extra.setdefault("enqueue_seconds", []).append(round(run.enqueue_seconds, 3))
            row.extra.setdefault("total_seconds", []).append(round(run.seconds, 3))
            ctx.step(f"{scenario}: {subject.name} {run.rate:,.0f} jobs/s", 1)
    return live


def run(ctx: Ctx) -> list[Row]:
    knobs = dict(ctx.cfg.harvest_knobs)
    subjects: list[Subject] = [
        HarvestSubject(ctx, knobs),
        HarvestSubject(ctx, knobs, name=ASYNC, job=bench_jobs.NOOP_ASYNC, tag="async"),
        HarvestSubject(ctx, knobs, name=THREADS, tag="threads", execution=THREAD_POOL),
        CelerySubject(ctx),
        ProcrastinateSubject(ctx),
        PgQueuerSubject(ctx),
    ]
    ctx.plan(len(subjects) * (1 + ctx.cfg.reps))
    setup = ", ".join(f"{k}={v}" for k, v in knobs.items()) or "defaults"
    rows = {
        name: Row(
            "e2e",
            name,
            UNIT,
            comparisons=[
                Comparison("PgQueuer", Target("ratio_min", 1.0, "≥ 1x"), "vs PgQueuer"),
                Comparison(
                    "plain Celery",
                    Target("ratio_min", 2.0, "≥ 2x (floor 1x)", floor=1.0),
                    "vs plain Celery",
                ),
                Comparison("procrastinate", None, "vs procrastinate"),
            ],
            note=f"{handler} handler, {how} (+ schedule worker, beat); knobs: {setup}",
        )
        for name, handler, how in (
            ("harvest", "def", "2 execution processes"),
            (ASYNC, "async def", "2 execution processes"),
            (THREADS, "def", "1 execution process, " + " ".join(THREAD_POOL)),
        )
    }
    rows |= {
        "plain Celery": Row(
            "e2e", "plain Celery", UNIT, note="prefork -c 2, acks_late, no result backend"
        ),
        "procrastinate": Row("e2e", "procrastinate", UNIT, note="2 processes, concurrency 10 each"),
        "PgQueuer": Row("e2e", "PgQueuer", UNIT, note="2 processes, batch 10, psycopg driver"),
    }
    for row in rows.values():
        row.extra["jobs_per_run"] = ctx.cfg.jobs
    ctx.record(*rows.values())
    measure(ctx, "e2e", subjects, rows)
    return list(rows.values())


def run_gate(ctx: Ctx) -> list[Row]:
    """The key pool's cost: each handler kind (``def``, ``async def``) with and without it."""
    knobs = {**ctx.cfg.harvest_knobs, "HARVEST_SECRET_KEY": Fernet.generate_key().decode()}
    kinds = (
        ("harvest", "", bench_jobs.NOOP, jobs_pooled.NOOP_POOLED),
        (ASYNC, "async-", bench_jobs.NOOP_ASYNC, jobs_pooled.NOOP_POOLED_ASYNC),
    )
    plain: list[Subject] = []
    gated: list[HarvestSubject] = []
    rows: dict[str, Row] = {}
    for name, tag, job, pooled in kinds:
        bare = HarvestSubject(ctx, knobs, name=name, job=job, tag=f"{tag}plain")
        pool = HarvestSubject(
            ctx,
            knobs,
            name=f"{name} + key pool",
            job=pooled,
            pool_keys=KEYS,
            tag=f"{tag}gated",
            imports="bench.jobs_pooled",
        )
        plain.append(bare)
        gated.append(pool)
        rows[bare.name] = Row("gate", bare.name, UNIT, note="no pool")
        rows[pool.name] = Row(
            "gate",
            pool.name,
            UNIT,
            comparisons=[
                Comparison(bare.name, Target("ratio_min", 0.85, "cost ≤ 15 %"), "vs no pool")
            ],
            note=f"@app.job(pool=...): {KEYS} keys x 64 leases, no rate limit",
        )
    ctx.plan(len(rows) * (1 + ctx.cfg.reps))
    ctx.record(*rows.values())
    for subject in gated:  # a gated subject's leases a job: the gate is really on the way
        ctx.step(f"gate: starting {subject.name}")
        _leases_per_job(ctx, subject, rows[subject.name])
    measure(ctx, "gate", [*plain, *gated], rows, warm=gated)
    return list(rows.values())


def _leases_per_job(ctx: Ctx, subject: HarvestSubject, row: Row) -> None:
    """Start ``subject`` and record how many key leases its jobs took from Redis a job (one;
    less where a key passed from a job to the next in its process, down to none when every
    job of the probe took over a lease granted within ``handoff.PASS_FOR``; more where a lease
    was lost and taken again). Every job fails without a lease (``bench.jobs_pooled``), so the
    gate is on the way whatever this says; a subject whose pool never granted a lease at all
    is marked."""
    probe = warmup_jobs(ctx)
    try:
        subject.start()
        drain(subject, probe)  # the pool's fence counter exists once a lease was granted
        before = subject.leases_granted()
        drain(subject, probe)
        granted = subject.leases_granted() - before
    except Exception as exc:
        row.unavailable = f"failed: {type(exc).__name__}: {exc}"[:300]
        return
    if before < 1:
        row.unavailable = f"not measured: {probe} jobs ran but no key was ever leased"
        return
    row.extra["leases_per_job"] = round(granted / probe, 3)

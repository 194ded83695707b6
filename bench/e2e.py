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
        CelerySubject(ctx),
        ProcrastinateSubject(ctx),
        PgQueuerSubject(ctx),
    ]
    ctx.plan(len(subjects) * (1 + ctx.cfg.reps))
    rows = {
        "harvest": Row(
            "e2e",
            "harvest",
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
            note="2 execution processes (+ schedule worker, beat); knobs: "
            + (", ".join(f"{k}={v}" for k, v in knobs.items()) or "defaults"),
        ),
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
    knobs = {**ctx.cfg.harvest_knobs, "HARVEST_SECRET_KEY": Fernet.generate_key().decode()}
    plain = HarvestSubject(ctx, knobs, name="harvest", tag="plain")
    gated = HarvestSubject(
        ctx,
        knobs,
        name="harvest + key pool",
        job=jobs_pooled.NOOP_POOLED,
        pool_keys=KEYS,
        tag="gated",
        imports="bench.jobs_pooled",
    )
    ctx.plan(2 * (1 + ctx.cfg.reps))
    rows = {
        plain.name: Row("gate", plain.name, UNIT, note="no pool"),
        gated.name: Row(
            "gate",
            gated.name,
            UNIT,
            comparisons=[
                Comparison("harvest", Target("ratio_min", 0.85, "cost ≤ 15 %"), "vs no pool")
            ],
            note=f"@app.job(pool=...): {KEYS} keys x 64 leases, no rate limit",
        ),
    }
    ctx.record(*rows.values())
    # Start the gated subject alone first: when the gate is not wired in yet, say so and
    # spend no time on the rest.
    ctx.step("gate: starting harvest + key pool")
    row = rows[gated.name]
    probe = warmup_jobs(ctx)
    try:
        gated.start()
        drain(gated, probe)  # the pool's fence counter exists once a lease was granted
        before = gated.leases_granted()
        drain(gated, probe)
        granted = gated.leases_granted() - before if before else 0
    except Exception as exc:
        row.unavailable = f"failed: {type(exc).__name__}: {exc}"[:300]
        return list(rows.values())
    if granted < probe:
        row.unavailable = (
            f"not available: {probe} jobs ran but {granted} keys were leased"
            " (the execution task does not honour JobSpec.pool yet)"
        )
        return list(rows.values())
    row.extra["leases_per_job"] = round(granted / probe, 3)
    measure(ctx, "gate", [plain, gated], rows, warm=[gated])
    return list(rows.values())

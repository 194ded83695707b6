"""The tick of the ``harvest.schedules`` task: every due schedule fired in its own
transaction (SKIP LOCKED), one job per fire time not recorded before."""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

from sqlalchemy import Connection, RowMapping

from harvest import store, validation
from harvest.schedules.admin import Schedule
from harvest.schedules.timing import MAX_SCHEDULES_PER_TICK, MAX_TICK_SECONDS, plan

if TYPE_CHECKING:
    from harvest.app import Harvest

# The logger keeps the name it had before the split (one module, harvest.schedules).
log = logging.getLogger("harvest.schedules")


# --- the tick ----------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class FireReport:
    schedules: int  # schedules that were due and handled
    jobs: int  # jobs enqueued


def fire_due(
    app: Harvest,
    *,
    max_schedules: int = MAX_SCHEDULES_PER_TICK,
    max_seconds: float = MAX_TICK_SECONDS,
) -> FireReport:
    """Fire every due schedule, each in its own transaction: lock it (SKIP LOCKED), record its
    due fire times, enqueue one job per fire time not recorded before, advance next_run_at."""
    skip: list[int] = []
    handled = jobs = 0
    started = time.monotonic()
    while handled < max_schedules and time.monotonic() - started < max_seconds:
        row: RowMapping | None = None
        try:
            with app.engine.begin() as conn:
                row = store.claim_due_schedule(conn, skip=skip)
                if row is None:
                    break
                handled += 1
                jobs += _fire_one(app, conn, row, skip)
        except Exception:
            if row is None:
                raise
            log.exception("schedule %r could not fire; it is retried at the next tick", row["name"])
            skip.append(row["id"])
    if jobs:
        app.nudge()
    return FireReport(handled, jobs)


def _fire_one(app: Harvest, conn: Connection, row: RowMapping, skip: list[int]) -> int:
    schedule = Schedule.from_row(row)
    spec = app.jobs.get(schedule.job)
    if spec is None:
        log.error(
            "schedule %r: job %r is not registered in this worker (HARVEST_IMPORTS); not fired",
            schedule.name,
            schedule.job,
        )
        skip.append(schedule.id)
        return 0
    due = plan(
        schedule.timing,
        schedule.next_run_at,
        row["now"],
        misfire=schedule.misfire,
        catch_up=schedule.catch_up,
        grace=app.settings.schedule_grace,
    )
    template = store.NewJob(
        name=spec.name,
        queue=spec.queue,
        payload_json=validation.encode_payload(
            schedule.payload, limit=app.settings.max_payload_bytes
        ),  # the encoder that keeps large floats floats through jsonb
        priority=schedule.priority,
        run_at=None,
        delay=None,
        max_attempts=spec.max_attempts,
        timeout=spec.timeout,
        idempotency_key=None,
        pool=spec.pool,
    )
    ids = store.fire_schedule(conn, schedule.id, due.fires, template)
    store.advance_schedule(
        conn,
        schedule.id,
        next_run_at=due.next_run_at,
        fired_at=due.fires[-1] if due.fires else None,
    )
    return len(ids)

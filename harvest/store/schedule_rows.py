"""The statements on recurring schedules' rows and their fire records (the logic lives in
harvest.schedules)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from datetime import datetime
from typing import Any

from sqlalchemy import Connection, RowMapping, text
from sqlalchemy.orm import Session

from harvest.db import get_or_create
from harvest.models import ScheduleRow
from harvest.store.enqueue import NewJob, _params

# --- recurring schedules ------------------------------------------------------------------------

_SCHEDULE_COLUMNS = (
    "id, name, job_name, payload, cron, every_seconds, timezone, enabled, misfire, catch_up, "
    "priority, next_run_at, last_fired_at, created_at, updated_at"
)

_CLAIM_SCHEDULE = text(
    f"""
    SELECT {_SCHEDULE_COLUMNS}, now() AS now
    FROM harvest_schedules
    WHERE enabled AND next_run_at <= now() AND id <> ALL(CAST(:skip AS bigint[]))
    ORDER BY next_run_at
    LIMIT 1
    FOR UPDATE SKIP LOCKED
    """
)


def claim_due_schedule(conn: Connection, *, skip: Sequence[int] = ()) -> RowMapping | None:
    """Lock one due, enabled schedule (SKIP LOCKED: another schedule worker holding one makes
    this one take the next). The row (with the database's ``now``) or None."""
    return conn.execute(_CLAIM_SCHEDULE, {"skip": list(skip)}).mappings().one_or_none()


# The fire records and the jobs, in one statement: a fire time already recorded (by any worker,
# ever) inserts nothing, so it enqueues nothing. Job ids are drawn first so that each record
# names its job.
_FIRE = text(
    """
    WITH fired AS (
        INSERT INTO harvest_schedule_fires (schedule_id, fire_at, job_id)
        SELECT :schedule_id, t, nextval(pg_get_serial_sequence('harvest_jobs', 'id'))
        FROM unnest(CAST(:times AS timestamptz[])) AS t
        ON CONFLICT (schedule_id, fire_at) DO NOTHING
        RETURNING fire_at, job_id
    )
    INSERT INTO harvest_jobs (id, name, queue, payload, priority, run_at, max_attempts, timeout,
                              pool)
    SELECT job_id, :name, :queue, CAST(:payload AS jsonb), :priority, fire_at, :max_attempts,
           :timeout, :pool
    FROM fired ORDER BY fire_at
    RETURNING id
    """
)


def fire_schedule(
    conn: Connection, schedule_id: int, times: Sequence[datetime], job: NewJob
) -> list[int]:
    """One job per fire time not recorded yet (``job.run_at`` is replaced by the fire time).
    Returns the new jobs' ids."""
    if not times:
        return []
    params = _params(job) | {"schedule_id": schedule_id, "times": list(times)}
    return [int(i) for i in conn.execute(_FIRE, params).scalars()]


def advance_schedule(
    conn: Connection, schedule_id: int, *, next_run_at: datetime, fired_at: datetime | None
) -> None:
    conn.execute(
        text(
            "UPDATE harvest_schedules SET next_run_at = :next, "
            "last_fired_at = COALESCE(CAST(:fired AS timestamptz), last_fired_at) WHERE id = :id"
        ),
        {"id": schedule_id, "next": next_run_at, "fired": fired_at},
    )


def get_or_create_schedule(
    session: Session, name: str, values: Mapping[str, Any]
) -> tuple[int, bool]:
    """The schedule named ``name``, created from ``values`` when missing. (id, created)."""
    row, created = get_or_create(session, ScheduleRow, lookup={"name": name}, defaults=values)
    return row.id, created


def get_schedule(conn: Connection, name: str) -> RowMapping | None:
    return (
        conn.execute(
            text(f"SELECT {_SCHEDULE_COLUMNS} FROM harvest_schedules WHERE name = :name"),
            {"name": name},
        )
        .mappings()
        .one_or_none()
    )


def lock_schedule(conn: Connection, name: str) -> RowMapping | None:
    """The schedule's row, locked until the transaction ends (waits for a firing tick), with
    the database's ``now``."""
    return (
        conn.execute(
            text(
                f"SELECT {_SCHEDULE_COLUMNS}, now() AS now FROM harvest_schedules "
                "WHERE name = :name FOR UPDATE"
            ),
            {"name": name},
        )
        .mappings()
        .one_or_none()
    )


def list_schedules(conn: Connection) -> list[RowMapping]:
    return list(
        conn.execute(
            text(f"SELECT {_SCHEDULE_COLUMNS} FROM harvest_schedules ORDER BY name")
        ).mappings()
    )


_SCHEDULE_FIELDS = frozenset(
    {
        "job_name", "payload", "cron", "every_seconds", "timezone", "enabled", "misfire",
        "catch_up", "priority", "next_run_at",
    }
)  # fmt: skip


def update_schedule(conn: Connection, schedule_id: int, values: Mapping[str, Any]) -> None:
    """Set the given fields (names from a fixed set; payload as JSON text)."""
    unknown = set(values) - _SCHEDULE_FIELDS
    if unknown:
        raise ValueError(f"not schedule fields: {sorted(unknown)}")
    sets = [
        f"{column} = CAST(:{column} AS jsonb)" if column == "payload" else f"{column} = :{column}"
        for column in values
    ]
    conn.execute(
        text(f"UPDATE harvest_schedules SET {', '.join(sets)}, updated_at = now() WHERE id = :id"),
        {**values, "id": schedule_id},
    )


def delete_schedule(conn: Connection, name: str) -> bool:
    """Delete a schedule and its fire records; False when there was none."""
    result = conn.execute(text("DELETE FROM harvest_schedules WHERE name = :name"), {"name": name})
    return bool(result.rowcount)


def db_now(conn: Connection) -> datetime:
    value: datetime = conn.execute(text("SELECT now()")).scalar_one()
    return value

"""Schedules as callers see them (:class:`Schedule`) and the calls that make, change, pause,
delete and read them (through Harvest), each in one transaction."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import TYPE_CHECKING, Any, TypedDict

from harvest import store, validation
from harvest.db import translate_errors
from harvest.errors import InvalidSchedule, ScheduleNotFound
from harvest.schedules.timing import (
    Misfire,
    Timing,
    check_misfire,
    check_name,
    check_start_at,
    check_timing,
)

if TYPE_CHECKING:
    from harvest.app import Harvest, JobSpec


# --- values ------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Schedule:
    """A schedule as callers see it. ``created``: this call created it (``app.schedule``)."""

    id: int
    name: str
    job: str
    payload: dict[str, Any]
    cron: str | None
    every: float | None
    timezone: str
    enabled: bool
    misfire: Misfire
    catch_up: int
    priority: int
    next_run_at: datetime
    last_fired_at: datetime | None
    created_at: datetime
    updated_at: datetime
    created: bool = False

    @classmethod
    def from_row(cls, row: Mapping[Any, Any], *, created: bool = False) -> Schedule:
        return cls(
            id=row["id"],
            name=row["name"],
            job=row["job_name"],
            payload=row["payload"],
            cron=row["cron"],
            every=row["every_seconds"],
            timezone=row["timezone"],
            enabled=row["enabled"],
            misfire=Misfire(row["misfire"]),
            catch_up=row["catch_up"],
            priority=row["priority"],
            next_run_at=row["next_run_at"],
            last_fired_at=row["last_fired_at"],
            created_at=row["created_at"],
            updated_at=row["updated_at"],
            created=created,
        )

    @property
    def timing(self) -> Timing:
        return Timing(cron=self.cron, every=self.every, timezone=self.timezone)


class ScheduleChanges(TypedDict, total=False):
    """The keyword arguments of :meth:`Harvest.update_schedule` (those of :func:`update`): the
    fields to change; one left out, or None, is unchanged."""

    job: str | None
    cron: str | None
    every: float | timedelta | None
    payload: Mapping[str, Any] | None
    timezone: str | None
    misfire: str | None
    catch_up: int | None
    priority: int | None
    start_at: datetime | None


# --- the API (called through Harvest) ----------------------------------------------------------


def create(
    app: Harvest,
    name: str,
    job: str,
    *,
    cron: str | None,
    every: float | timedelta | None,
    payload: Mapping[str, Any] | None,
    timezone: str,
    misfire: str,
    catch_up: int,
    priority: int,
    enabled: bool,
    start_at: datetime | None,
) -> Schedule:
    """Get or create the schedule ``name`` (see :meth:`Harvest.schedule`)."""
    name = check_name(name)
    spec = app.spec(job)
    timing = check_timing(cron, every, timezone)
    policy, catch_up = check_misfire(misfire, catch_up)
    start = check_start_at(start_at)
    payload_json = app.encode_payload(spec, {} if payload is None else payload)
    validation.check_priority(priority)
    if not isinstance(enabled, bool):
        raise InvalidSchedule("enabled", f"must be True or False, got {validation.shown(enabled)}")
    with translate_errors(), app.sessions.begin() as session:
        now = store.db_now(session.connection())
        values = {
            "job_name": spec.name,
            "payload": store.json_value(payload_json),  # as checked: floats stay floats
            "cron": timing.cron,
            "every_seconds": timing.every,
            "timezone": timing.timezone,
            "enabled": enabled,
            "misfire": str(policy),
            "catch_up": catch_up,
            "priority": priority,
            "next_run_at": timing.first(now, start),
        }
        _, made = store.get_or_create_schedule(session, name, values)
        row = store.get_schedule(session.connection(), name)
    assert row is not None
    return Schedule.from_row(row, created=made)


def update(
    app: Harvest,
    name: str,
    *,
    job: str | None = None,
    cron: str | None = None,
    every: float | timedelta | None = None,
    payload: Mapping[str, Any] | None = None,
    timezone: str | None = None,
    misfire: str | None = None,
    catch_up: int | None = None,
    priority: int | None = None,
    start_at: datetime | None = None,
) -> Schedule:
    """Change the given fields (None: unchanged). A new cron, interval, timezone or start_at
    re-times the schedule from now; other changes keep its next fire time."""
    with translate_errors(), app.engine.begin() as conn:
        row = store.lock_schedule(conn, name)
        if row is None:
            raise ScheduleNotFound(name)
        current = Schedule.from_row(row)
        values = _changes(app, current, job=job, payload=payload, misfire=misfire,
                          catch_up=catch_up, priority=priority)  # fmt: skip
        retime = cron is not None or every is not None or timezone is not None
        if retime or start_at is not None:
            timing = check_timing(
                cron if cron is not None or every is not None else current.cron,
                every if cron is not None or every is not None else current.every,
                timezone if timezone is not None else current.timezone,
            )
            values |= {
                "cron": timing.cron,
                "every_seconds": timing.every,
                "timezone": timing.timezone,
                "next_run_at": timing.first(row["now"], check_start_at(start_at)),
            }
        if values:
            store.update_schedule(conn, current.id, values)
        after = store.get_schedule(conn, name)
    assert after is not None
    return Schedule.from_row(after)


def _changes(
    app: Harvest,
    current: Schedule,
    *,
    job: str | None,
    payload: Mapping[str, Any] | None,
    misfire: str | None,
    catch_up: int | None,
    priority: int | None,
) -> dict[str, Any]:
    values: dict[str, Any] = {}
    if job is not None or payload is not None:
        spec: JobSpec = app.spec(job if job is not None else current.job)
        body = payload if payload is not None else current.payload
        values["job_name"] = spec.name
        values["payload"] = app.encode_payload(spec, body)
    if misfire is not None or catch_up is not None:
        policy, n = check_misfire(
            misfire if misfire is not None else current.misfire,
            catch_up if catch_up is not None else current.catch_up,
        )
        values |= {"misfire": str(policy), "catch_up": n}
    if priority is not None:
        values["priority"] = validation.check_priority(priority)
    return values


def set_enabled(app: Harvest, name: str, enabled: bool) -> Schedule:
    """Pause (False) or resume (True). Resuming re-times the schedule from now: fire times that
    fell in the pause are not owed."""
    with translate_errors(), app.engine.begin() as conn:
        row = store.lock_schedule(conn, name)
        if row is None:
            raise ScheduleNotFound(name)
        current = Schedule.from_row(row)
        if current.enabled != enabled:
            values: dict[str, Any] = {"enabled": enabled}
            if enabled:
                values["next_run_at"] = current.timing.first(row["now"])
            store.update_schedule(conn, current.id, values)
        after = store.get_schedule(conn, name)
    assert after is not None
    return Schedule.from_row(after)


def delete(app: Harvest, name: str) -> None:
    with translate_errors(), app.engine.begin() as conn:
        if not store.delete_schedule(conn, name):
            raise ScheduleNotFound(name)


def get(app: Harvest, name: str) -> Schedule:
    with translate_errors(), app.engine.connect() as conn:
        row = store.get_schedule(conn, name)
    if row is None:
        raise ScheduleNotFound(name)
    return Schedule.from_row(row)


def list_all(app: Harvest) -> list[Schedule]:
    with translate_errors(), app.engine.connect() as conn:
        return [Schedule.from_row(r) for r in store.list_schedules(conn)]

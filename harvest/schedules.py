"""Recurring schedules kept in Postgres: a job enqueued at every fire time of a cron expression
(in the schedule's timezone) or of a fixed interval.

The ``harvest.schedules`` task (schedule queue, ticked by beat every second) locks one due
schedule at a time with ``FOR UPDATE SKIP LOCKED`` and, in that schedule's transaction, records
its due fire times in ``harvest_schedule_fires`` (primary key (schedule, fire time), ``ON
CONFLICT DO NOTHING``), inserts one job per newly recorded fire time, and advances
``next_run_at``. However many beats and schedule workers run, a fire time yields one job.

Misfire policies (which of the due fire times a tick runs; "missed" means later than
``HARVEST_SCHEDULE_GRACE`` seconds when the tick looks):

* ``skip``: run the fire times that are not missed; missed ones are dropped.
* ``run_once`` (default): as ``skip``, plus one job for all the missed ones (the latest).
* ``catch_up`` (at most ``catch_up`` = N): run the latest N due fire times, missed or not.
"""

from __future__ import annotations

import enum
import json
import logging
import math
import time
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import TYPE_CHECKING, Any, TypedDict
from zoneinfo import ZoneInfo, ZoneInfoNotFoundError

from croniter import croniter
from sqlalchemy import Connection, RowMapping

from harvest import store, validation
from harvest.db import translate_errors
from harvest.errors import InvalidOption, InvalidSchedule, ScheduleNotFound

if TYPE_CHECKING:
    from harvest.app import Harvest, JobSpec

log = logging.getLogger(__name__)

TASK = "harvest.schedules"  # routed to the schedule queue by harvest.broker
MIN_EVERY = 1.0  # seconds: the schedules task ticks once a second
MAX_EVERY = validation.MAX_DELAY
MAX_CATCH_UP = 1000
MAX_FIRES_PER_TICK = 1000  # bounds one schedule's work in one tick, whatever the policy
MAX_NAME = 200
MAX_SCHEDULES_PER_TICK = 500
MAX_TICK_SECONDS = 2.0


class Misfire(enum.StrEnum):
    SKIP = "skip"
    RUN_ONCE = "run_once"
    CATCH_UP = "catch_up"


# --- timing (pure) -----------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Timing:
    """When a schedule fires: a cron expression in ``timezone``, or every ``every`` seconds."""

    cron: str | None = None
    every: float | None = None
    timezone: str = "UTC"

    @property
    def step(self) -> timedelta:
        assert self.every is not None
        return timedelta(microseconds=round(self.every * 1_000_000))

    def first(self, now: datetime, start_at: datetime | None = None) -> datetime:
        """The first fire time of a new (or resumed, or re-timed) schedule: the first cron time
        after ``now`` (or at/after ``start_at``); for an interval, ``start_at``, else one interval
        from ``now`` (on a whole second when the interval is whole seconds)."""
        if self.cron is not None:
            after = max(now, start_at - timedelta(microseconds=1)) if start_at else now
            return self._cron_next(after)
        if start_at is not None:
            return start_at
        base = now + self.step
        if self.step % timedelta(seconds=1) == timedelta(0):
            base = base.replace(microsecond=0) + timedelta(seconds=1 if base.microsecond else 0)
        return base

    def after(self, anchor: datetime, now: datetime) -> datetime:
        """The first fire time strictly after ``now``, on the grid of ``anchor`` (a fire time)."""
        if self.cron is not None:
            return self._cron_next(now)
        step = self.step
        if now < anchor:
            return anchor
        return anchor + ((now - anchor) // step + 1) * step

    def due(self, anchor: datetime, now: datetime) -> Iterator[datetime]:
        """Fire times from ``anchor`` (a fire time) up to ``now``, latest first."""
        if now < anchor:
            return
        if self.cron is not None:
            it = croniter(self.cron, (now + timedelta(microseconds=1)).astimezone(self.zone))
            while (t := it.get_prev(datetime).astimezone(UTC)) >= anchor:
                yield t
            return
        step = self.step
        k = (now - anchor) // step
        while k >= 0:
            yield anchor + k * step
            k -= 1

    @property
    def zone(self) -> ZoneInfo:
        return ZoneInfo(self.timezone)

    def _cron_next(self, after: datetime) -> datetime:
        assert self.cron is not None
        value: datetime = croniter(self.cron, after.astimezone(self.zone)).get_next(datetime)
        return value.astimezone(UTC)

    def describe(self) -> str:
        if self.cron is not None:
            return f"cron {self.cron} ({self.timezone})"
        return f"every {self.every:g}s"


@dataclass(frozen=True, slots=True)
class Plan:
    fires: list[datetime]  # ascending
    next_run_at: datetime


def plan(
    timing: Timing,
    next_run_at: datetime,
    now: datetime,
    *,
    misfire: Misfire,
    catch_up: int = 1,
    grace: float,
) -> Plan:
    """Which due fire times one tick runs, and the schedule's next fire time (strictly after
    ``now``). Pure: the database's ``now`` is passed in."""
    missed_before = now - timedelta(seconds=grace)
    limit = min(catch_up, MAX_FIRES_PER_TICK) if misfire is Misfire.CATCH_UP else MAX_FIRES_PER_TICK
    fires: list[datetime] = []
    for t in timing.due(next_run_at, now):
        if misfire is Misfire.CATCH_UP or t >= missed_before:
            fires.append(t)
        else:
            if misfire is Misfire.RUN_ONCE:
                fires.append(t)
            break
        if len(fires) >= limit:
            break
    return Plan(sorted(fires), timing.after(next_run_at, now))


# --- checks at the door ------------------------------------------------------------------------


def check_name(name: Any) -> str:
    if (
        not isinstance(name, str)
        or not 1 <= len(name) <= MAX_NAME
        or any(ord(c) < 32 or ord(c) == 127 for c in name)
    ):
        raise InvalidSchedule(
            "name", f"must be 1-{MAX_NAME} printable characters, got {name!r:.80}"
        )
    return name


def check_timing(cron: Any, every: Any, timezone: Any) -> Timing:
    zone = check_timezone(timezone)
    if (cron is None) == (every is None):
        raise InvalidSchedule(
            "cron", "give exactly one of cron=... (an expression) or every=... (seconds)"
        )
    if cron is not None:
        if not isinstance(cron, str) or "\x00" in cron or not croniter.is_valid(cron):
            raise InvalidSchedule(
                "cron", f"{cron!r:.80} is not a cron expression (e.g. '*/5 * * * *', '@hourly')"
            )
        return Timing(cron=cron.strip(), timezone=zone)
    if isinstance(every, timedelta):
        every = every.total_seconds()
    if isinstance(every, bool) or not isinstance(every, int | float) or not math.isfinite(every):
        raise InvalidSchedule("every", f"must be seconds or a timedelta, got {every!r:.80}")
    if not MIN_EVERY <= every <= MAX_EVERY:
        raise InvalidSchedule("every", f"must be from {MIN_EVERY:g} s to ten years, got {every!r}")
    return Timing(every=float(every), timezone=zone)


def check_timezone(timezone: Any) -> str:
    if not isinstance(timezone, str) or not timezone or "\x00" in timezone:
        raise InvalidSchedule(
            "timezone", f"must be an IANA name like 'Europe/Paris', got {timezone!r:.80}"
        )
    try:
        ZoneInfo(timezone)
    except (ZoneInfoNotFoundError, ValueError, OSError):
        raise InvalidSchedule(
            "timezone", f"unknown timezone {timezone!r:.80} (an IANA name like 'Europe/Paris')"
        ) from None
    return timezone


def check_misfire(misfire: Any, catch_up: Any) -> tuple[Misfire, int]:
    try:
        policy = Misfire(misfire)
    except ValueError:
        raise InvalidSchedule(
            "misfire", f"must be one of {', '.join(m.value for m in Misfire)}, got {misfire!r:.80}"
        ) from None
    if isinstance(catch_up, bool) or not isinstance(catch_up, int):
        raise InvalidSchedule("catch_up", f"must be an integer, got {catch_up!r:.80}")
    if not 1 <= catch_up <= MAX_CATCH_UP:
        raise InvalidSchedule("catch_up", f"must be from 1 to {MAX_CATCH_UP}, got {catch_up}")
    return policy, catch_up


def check_start_at(start_at: Any) -> datetime | None:
    try:
        return validation.check_run_at(start_at)
    except InvalidOption as exc:
        raise InvalidSchedule("start_at", str(exc).removeprefix("invalid run_at: ")) from None


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
    payload_json = app.encode_payload(spec, payload or {})
    validation.check_priority(priority)
    if not isinstance(enabled, bool):
        raise InvalidSchedule("enabled", f"must be True or False, got {enabled!r:.80}")
    with translate_errors(), app.sessions.begin() as session:
        now = store.db_now(session.connection())
        values = {
            "job_name": spec.name,
            "payload": json.loads(payload_json),
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
        payload_json=json.dumps(schedule.payload),
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

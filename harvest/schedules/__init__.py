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

The package: :mod:`~harvest.schedules.timing` (pure: limits, :func:`plan`, checks at the door),
:mod:`~harvest.schedules.admin` (:class:`Schedule` and the calls through Harvest) and
:mod:`~harvest.schedules.tick` (:func:`fire_due`); the statements are in
:mod:`harvest.store.schedule_rows`. Every public name is re-exported here.
"""

from __future__ import annotations

from harvest.schedules.admin import (
    Schedule,
    ScheduleChanges,
    create,
    delete,
    get,
    list_all,
    set_enabled,
    update,
)
from harvest.schedules.tick import (
    FireReport,
    fire_due,
)
from harvest.schedules.timing import (
    MAX_CATCH_UP,
    MAX_EVERY,
    MAX_FIRES_PER_TICK,
    MAX_NAME,
    MAX_SCHEDULES_PER_TICK,
    MAX_TICK_SECONDS,
    MIN_EVERY,
    TASK,
    Misfire,
    Plan,
    Timing,
    check_misfire,
    check_name,
    check_start_at,
    check_timezone,
    check_timing,
    plan,
)

__all__ = [
    "MAX_CATCH_UP",
    "MAX_EVERY",
    "MAX_FIRES_PER_TICK",
    "MAX_NAME",
    "MAX_SCHEDULES_PER_TICK",
    "MAX_TICK_SECONDS",
    "MIN_EVERY",
    "TASK",
    "FireReport",
    "Misfire",
    "Plan",
    "Schedule",
    "ScheduleChanges",
    "Timing",
    "check_misfire",
    "check_name",
    "check_start_at",
    "check_timezone",
    "check_timing",
    "create",
    "delete",
    "fire_due",
    "get",
    "list_all",
    "plan",
    "set_enabled",
    "update",
]

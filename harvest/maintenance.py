"""Retention: move finished jobs to the partitioned history and drop its days past retention;
prune finished and dead jobs not moved, completed batches, old schedule fire records and old
usage minutes (:mod:`harvest.usage`; the running totals stay).

The ``harvest.maintenance`` task (schedule queue, ticked by beat every
``HARVEST_MAINTENANCE_INTERVAL`` seconds) runs :func:`run`. One run at a time across the
cluster (a Redis lock; if Redis is down it runs anyway: pruning twice at once is safe). Each
statement deletes at most ``HARVEST_PRUNE_BATCH_SIZE`` rows in its own short transaction,
skipping rows locked by anyone, and touches only terminal jobs: the claim path (pending rows)
never waits on it. A run stops after a time budget; the next one continues.

The history (migration 0013, :mod:`harvest.store.history_rows`): jobs that ended more than
``HARVEST_HISTORY_AFTER`` seconds ago move, ``HARVEST_HISTORY_BATCH_SIZE`` a statement, into
day partitions of their kind (``done``: succeeded and cancelled; ``dead``: failed), each day's
partition made first. A day whose end is past the kind's retention is dropped whole: no DELETE,
no dead tuples. A kind whose retention is under a day is not moved (a day partition would keep
its rows longer than asked); its rows are pruned in place as before.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from datetime import datetime
from typing import TYPE_CHECKING

from redis import RedisError
from sqlalchemy import Connection
from sqlalchemy.exc import DBAPIError

from harvest import store
from harvest.coordination.lock import Lock
from harvest.store import history_rows
from harvest.usage import rows as usage_rows

if TYPE_CHECKING:
    from harvest.app import Harvest

log = logging.getLogger(__name__)

TASK = "harvest.maintenance"  # routed to the schedule queue by harvest.broker
LOCK_NAME = "maintenance"
MAX_SECONDS = 20.0


@dataclass(frozen=True, slots=True)
class PruneReport:
    finished: int = 0  # succeeded and cancelled jobs
    dead: int = 0  # failed jobs
    batches: int = 0
    fires: int = 0
    usage: int = 0  # usage rows (a key's minute)
    skipped: bool = False  # another run held the lock
    moved: int = 0  # jobs moved to the history
    dropped: int = 0  # day partitions of the history dropped

    @property
    def total(self) -> int:
        return self.finished + self.dead + self.batches + self.fires + self.usage + self.moved


def prune(app: Harvest, *, max_seconds: float = MAX_SECONDS) -> PruneReport:
    """Delete what is past its retention, in small batches, within ``max_seconds``."""
    settings = app.settings
    deadline = time.monotonic() + max_seconds
    ages = {
        "finished": settings.retention_seconds,
        "dead": settings.dead_retention_seconds,
        "batches": settings.dead_retention_seconds,
        "fires": settings.dead_retention_seconds,
        "usage": settings.usage_retention_seconds,
    }
    counts = dict.fromkeys(ages, 0)
    history = {"done": settings.retention_seconds, "dead": settings.dead_retention_seconds}
    dropped = sum(drop_history(app, kind, retention) for kind, retention in history.items())
    moved = sum(
        move_history(app, kind, retention, deadline)
        for kind, retention in history.items()
        if retention >= history_rows.DAY.total_seconds()
    )
    for what, age in ages.items():
        while time.monotonic() < deadline:
            with app.engine.begin() as conn:
                n = _prune(conn, what, age, settings.prune_batch_size)
            counts[what] += n
            if n < settings.prune_batch_size:
                break
    report = PruneReport(
        counts["finished"],
        counts["dead"],
        counts["batches"],
        counts["fires"],
        counts["usage"],
        moved=moved,
        dropped=dropped,
    )
    if report.total or dropped:
        log.info(
            "moved %d jobs to the history, dropped %d of its day partitions; pruned %d finished "
            "and %d dead jobs, %d batches, %d schedule fire records, %d usage rows",
            report.moved,
            report.dropped,
            report.finished,
            report.dead,
            report.batches,
            report.fires,
            report.usage,
        )
    return report


def move_history(app: Harvest, kind: str, retention: float, deadline: float) -> int:
    """Move the due jobs of ``kind`` into the history, oldest first, until none is left or the
    deadline passes. Each day partition a batch needs is made first, in its own transaction."""
    settings = app.settings
    limit = settings.history_batch_size
    window = {"after": settings.history_after, "retention": retention}
    moved = 0
    while time.monotonic() < deadline:
        with app.engine.connect() as conn:
            days = history_rows.days_due(conn, kind, limit=limit, **window)
        if not days or not all(_made(app, kind, day) for day in days):
            break
        with app.engine.begin() as conn:
            n = history_rows.move(conn, kind, days=days, limit=limit, **window)
        moved += n
        if n < limit:
            break
    return moved


def _made(app: Harvest, kind: str, day: datetime) -> bool:
    """The day partition exists (made now if it did not). False if it could not be made now
    (a lock not granted in time, or another run making it): the move waits for the next run."""
    with app.engine.connect() as conn:
        if history_rows.has_partition(conn, kind, day):
            return True
    try:
        with app.engine.begin() as conn:
            history_rows.make_partition(conn, kind, day)
    except DBAPIError as exc:
        log.warning(
            "history partition %s not made now (%s)",
            history_rows.partition_name(kind, day),
            type(exc.orig).__name__,
        )
        return False
    return True


def drop_history(app: Harvest, kind: str, retention: float) -> int:
    """Drop the history's day partitions of ``kind`` past ``retention``; returns how many."""
    with app.engine.connect() as conn:
        names = history_rows.droppable(conn, kind, retention=retention)
    dropped = 0
    for name in names:
        try:
            with app.engine.begin() as conn:
                history_rows.drop_partition(conn, name)
        except DBAPIError as exc:
            log.warning("history partition %s not dropped now (%s)", name, type(exc.orig).__name__)
            continue
        dropped += 1
    return dropped


def _prune(conn: Connection, what: str, age: float, limit: int) -> int:
    if what == "usage":
        return usage_rows.prune(conn, older_than=age, limit=limit)
    return store.prune(conn, what, older_than=age, limit=limit)


def run(app: Harvest) -> PruneReport:
    """:func:`prune`, unless another maintenance run holds the lock."""
    lock = Lock(app.redis, LOCK_NAME, ttl=MAX_SECONDS * 3, auto_renew=True)
    try:
        acquired = lock.acquire(blocking=False)
    except RedisError as exc:
        log.warning("maintenance lock unavailable (%s): pruning anyway", type(exc).__name__)
        return prune(app)
    if not acquired:
        return PruneReport(skipped=True)
    try:
        return prune(app)
    finally:
        try:
            lock.release()
        except RedisError:
            log.warning("maintenance lock not released (Redis); it expires by itself")

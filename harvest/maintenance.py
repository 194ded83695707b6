"""Retention: prune finished jobs, dead jobs, completed batches, old schedule fire records and
old usage minutes (:mod:`harvest.usage`; the running totals stay).

The ``harvest.maintenance`` task (schedule queue, ticked by beat every
``HARVEST_MAINTENANCE_INTERVAL`` seconds) runs :func:`run`. One run at a time across the
cluster (a Redis lock; if Redis is down it runs anyway: pruning twice at once is safe). Each
statement deletes at most ``HARVEST_PRUNE_BATCH_SIZE`` rows in its own short transaction,
skipping rows locked by anyone, and touches only terminal jobs: the claim path (pending rows)
never waits on it. A run stops after a time budget; the next one continues.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

from redis import RedisError
from sqlalchemy import Connection

from harvest import store
from harvest.coordination.lock import Lock
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

    @property
    def total(self) -> int:
        return self.finished + self.dead + self.batches + self.fires + self.usage


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
    for what, age in ages.items():
        while time.monotonic() < deadline:
            with app.engine.begin() as conn:
                n = _prune(conn, what, age, settings.prune_batch_size)
            counts[what] += n
            if n < settings.prune_batch_size:
                break
    report = PruneReport(
        counts["finished"], counts["dead"], counts["batches"], counts["fires"], counts["usage"]
    )
    if report.total:
        log.info(
            "pruned %d finished and %d dead jobs, %d batches, %d schedule fire records, "
            "%d usage rows",
            report.finished,
            report.dead,
            report.batches,
            report.fires,
            report.usage,
        )
    return report


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

"""The schedule side: claim due jobs and publish them (dispatch); take back expired leases
(rescue). Both run as tasks on the ``schedule`` queue, driven by beat and by nudges; so do
recurring schedules (:mod:`harvest.schedules`) and retention (:mod:`harvest.maintenance`)."""

from __future__ import annotations

import logging
import time
from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from sqlalchemy import Connection

from harvest import keystore, store
from harvest.broker import chunk, jobs_per_message
from harvest.coordination import keys as rkeys
from harvest.coordination.key_pool import KeyPool

if TYPE_CHECKING:
    from harvest.app import Harvest
    from harvest.settings import Settings

log = logging.getLogger(__name__)

RESCUED = "rescued"
LINGER_POLL = 0.02
MAX_ROUNDS = 200  # bounds one dispatch call; beat or the next nudge continues
MAX_SECONDS = 2.0


@dataclass(frozen=True, slots=True)
class DispatchReport:
    claimed: int
    messages: int
    rounds: int


def dispatch(app: Harvest) -> DispatchReport:
    """Claim due jobs, commit, then publish them, until none are due or the in-flight window
    is full. Claims go by priority, except an aging share (``settings.starvation_after``):
    see :func:`harvest.store.claim_due`. Commit comes first: a crash between commit and
    publish leaves rows dispatched with no message, and rescue re-queues them when their
    dispatch lease expires.

    One connection serves the whole call, in autocommit: every claim is one statement (atomic
    on its own, committed when it returns), so a round costs two round trips (the in-flight
    count and the claim), not five. While jobs are in flight, a round claims only once
    :func:`refill_at` slots are free: topping up a few freed slots at a time made messages of
    one or two jobs under a deep backlog, and the per-message cost is what Celery pays most."""
    settings = app.settings
    claimed_total = messages = rounds = 0
    started = time.monotonic()
    linger_until = 0.0
    with app.engine.connect() as conn:
        conn.execution_options(isolation_level="AUTOCOMMIT")
        while rounds < MAX_ROUNDS and time.monotonic() - started < MAX_SECONDS:
            rounds += 1
            inflight = store.inflight(conn)
            limit = min(settings.claim_batch_size, settings.inflight_window - inflight)
            if inflight and limit < refill_at(settings):
                limit = 0  # busy: let more slots free up, then fill them in bigger messages
            budgets = pool_budgets(app, conn) if limit > 0 else None
            claimed = store.claim_due(
                conn,
                limit=limit,
                ttl=settings.dispatch_ttl,
                budgets=budgets,
                starvation_after=settings.starvation_after or None,
            )
            if not claimed:
                # While the nudge marker lives, enqueuers and workers send no nudge
                # (coalescing): keep looking every LINGER_POLL seconds until it expires, so
                # their jobs wait milliseconds, not until the next beat tick.
                linger_until = linger_until or _nudge_expires(app)
                if time.monotonic() >= linger_until:
                    break
                time.sleep(LINGER_POLL)
                continue
            linger_until = 0.0
            counts = Counter(job.name for job in claimed)
            runs = _RUN_TIMES.get(app, conn, counts)
            sizes = {
                name: jobs_per_message(
                    n, settings.max_jobs_per_message, settings.worker_concurrency, runs.get(name)
                )
                for name, n in counts.items()
            }
            batches = chunk(claimed, sizes)
            app.broker.publish_jobs(batches)
            claimed_total += len(claimed)
            messages += len(batches)
    return DispatchReport(claimed_total, messages, rounds)


class _RunTimes:
    """Recent median run time of each job name (it decides how many jobs share a message:
    only short ones do), read at most every ``REFRESH`` seconds per database, or every
    ``RETRY`` seconds while a claimed name has none yet (a fresh start, a new job)."""

    REFRESH = 2.0
    RETRY = 0.25

    def __init__(self) -> None:
        self._cache: dict[str, tuple[float, dict[str, float]]] = {}

    def get(self, app: Harvest, conn: Connection, names: Iterable[str]) -> dict[str, float]:
        key = app.settings.database_url
        now = time.monotonic()
        read_at, runs = self._cache.get(key, (-1e9, {}))
        age = now - read_at
        if age >= self.REFRESH or (age >= self.RETRY and any(n not in runs for n in names)):
            runs = store.recent_run_seconds(conn)
            self._cache[key] = (now, runs)
        return runs


_RUN_TIMES = _RunTimes()


def refill_at(settings: Settings) -> int:
    """Free slots a round waits for while jobs are in flight: half a claim batch (or half the
    window, when that is smaller), at least one."""
    return max(1, min(settings.claim_batch_size, settings.inflight_window) // 2)


def _nudge_expires(app: Harvest) -> float:
    """When (monotonic) the current nudge marker expires; now when there is none."""
    try:
        ttl_ms = app.redis.pttl(rkeys.nudge())
    except Exception:  # Redis down: no lingering, beat carries on
        return time.monotonic()
    return time.monotonic() + max(0, int(ttl_ms)) / 1000


def pool_budgets(app: Harvest, conn: Connection) -> dict[str, int]:
    """How many more jobs of each key pool to dispatch now: the leases its keys could grant
    now, less the jobs of that pool already dispatched and waiting to start. A pool whose
    state cannot be read gets a budget of 0 this round (its jobs wait; nothing over-admits)."""
    pools = sorted({spec.pool for spec in app.jobs.values() if spec.pool})
    if not pools:
        return {}
    waiting = store.dispatched_by_pool(conn, pools)
    budgets = {}
    for pool in pools:
        try:
            keystore.ensure_pool_loaded(app.engine, app.redis, pool)
            capacity = KeyPool(app.redis, pool).capacity()
        except Exception as exc:
            log.warning(
                "key pool %r capacity unknown (%s); dispatching none of its jobs",
                pool,
                type(exc).__name__,
            )
            capacity = 0
        budgets[pool] = max(0, capacity - waiting.get(pool, 0))
    return budgets


@dataclass(frozen=True, slots=True)
class RescueReport:
    requeued: int
    failed: int
    cancelled: int


def rescue(app: Harvest, *, batch: int = 500) -> RescueReport:
    """Return jobs whose lease expired to pending (or failed, when no attempts remain)."""
    requeued = failed = cancelled = 0
    for _ in range(MAX_ROUNDS):
        with app.engine.begin() as conn:
            rescued = store.rescue_expired(conn, limit=batch)
            n = len(rescued.requeued) + len(rescued.failed) + len(rescued.cancelled)
            store.bump(conn, RESCUED, n)
        requeued += len(rescued.requeued)
        failed += len(rescued.failed)
        cancelled += len(rescued.cancelled)
        if n < batch:
            break
    if requeued or failed or cancelled:
        log.warning(
            "rescued expired leases: %d re-queued, %d failed, %d cancelled",
            requeued,
            failed,
            cancelled,
        )
    if requeued:
        app.nudge()
    return RescueReport(requeued, failed, cancelled)

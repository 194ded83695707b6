"""The schedule side: claim due jobs and publish them (dispatch); take back expired leases
(rescue). Both run as tasks on the ``schedule`` queue, driven by beat and by nudges; so do
recurring schedules (:mod:`harvest.schedules`) and retention (:mod:`harvest.maintenance`)."""

from __future__ import annotations

import contextlib
import logging
import math
import time
import weakref
from collections import Counter
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from sqlalchemy import Connection

from harvest import capacity, store
from harvest.broker import chunk, jobs_per_message
from harvest.coordination import fallback
from harvest.coordination import keys as rkeys
from harvest.coordination.key_pool import KeyState
from harvest.execution import registry

if TYPE_CHECKING:
    from harvest.app import Harvest
    from harvest.jobs import Claimed
    from harvest.settings import Settings

log = logging.getLogger(__name__)

RESCUED = "rescued"
LINGER_POLL = 0.02
ROOM_LINGER = 0.1  # seconds a full window's in-flight count may stand still and be waited for
MAX_ROUNDS = 200  # bounds one dispatch call; beat or the next nudge continues
MAX_SECONDS = 2.0
REQUEUE_BATCH = 1000


@dataclass(frozen=True, slots=True)
class DispatchReport:
    claimed: int
    messages: int
    rounds: int


def dispatch(app: Harvest) -> DispatchReport:
    """Claim due jobs, commit, then publish them, until none are due or the in-flight window
    is full. Each claim (and each pool's budget) is shared round-robin by the tenants with due
    jobs (``settings.tenant_weights``), by priority within a tenant, except an aging share
    (``settings.starvation_after``; looked for at every claim while some are found, else once
    a second: :class:`harvest.store.ClaimWatch`): see :func:`harvest.store.claim_due`. Commit
    comes first: a crash between commit and publish leaves rows dispatched with no message,
    and rescue re-queues them when their dispatch lease expires.

    One connection serves the whole call, in autocommit: every claim is one statement (atomic
    on its own, committed when it returns), so a round costs two round trips (the in-flight
    count and the claim), not five. While jobs are in flight, a round claims only once
    :func:`refill_at` slots are free: topping up a few freed slots at a time made messages of
    one or two jobs under a deep backlog, and the per-message cost is what Celery pays most."""
    started = time.monotonic()
    _requeue_if_broker_lost(app)
    looking = _Looking(app)
    room = _WORKERS.capacity(app)
    with app.engine.connect() as conn:
        conn.execution_options(isolation_level="AUTOCOMMIT")
        store.quarantine_pending(conn)  # rows the claim skips: failed, with the reason
        with store.claim_round(conn):
            claimed_total, messages, rounds = _rounds(app, conn, looking, room, started)
    return DispatchReport(claimed_total, messages, rounds)


def _requeue_if_broker_lost(app: Harvest) -> int:
    """When the broker lost its messages (a Redis broker found without harvest's mark:
    :meth:`~harvest.broker.Broker.marked_anew`), take every dispatched job back now, so the
    claim that follows sends it again: not after ``HARVEST_DISPATCH_TTL`` (2 minutes by
    default), by rescue. Checked before the claim, so no job of this call's own is taken back.
    Only the process that sets the mark again takes them back; a job's message that survived
    (in a worker's prefetch) finds its token gone at its hold, and is suppressed."""
    try:
        lost = app.broker.marked_anew()
    except Exception:  # the broker is away: publishing will fail and say so
        return 0
    if not lost:
        return 0
    back = _take_back(app, store.requeue_dispatched, REQUEUE_BATCH)
    taken = back.requeued + back.failed + back.cancelled
    if taken:
        log.warning(
            "the broker holds no mark of harvest's (a Redis restarted without persistence, "
            "flushed, or failed over to an empty replica): its messages are gone, so %d "
            "dispatched jobs were taken back to be sent again",
            taken,
        )
    return taken


def _rounds(
    app: Harvest, conn: Connection, looking: _Looking, room: Room, started: float
) -> tuple[int, int, int]:
    """The rounds of one dispatch call: (jobs claimed, messages sent, rounds)."""
    settings = app.settings
    watch = _WATCHES.setdefault(app, store.ClaimWatch())
    stats = _STATS.setdefault(app, store.StatsWatch())
    claimed_total = messages = rounds = 0
    while rounds < MAX_ROUNDS and time.monotonic() - started < MAX_SECONDS:
        rounds += 1
        inflight = store.inflight(conn)
        limit = min(settings.claim_batch_size, room.window - inflight)
        full = inflight > 0 and limit < refill_at(settings)
        if full:
            limit = 0  # busy: let more slots free up, then fill them in bigger messages
        budgets = pool_budgets(app, conn) if limit > 0 else None
        claimed = store.claim_due(
            conn,
            limit=limit,
            ttl=settings.dispatch_ttl,
            budgets=budgets,
            starvation_after=settings.starvation_after or None,
            weights=settings.tenant_weights,
            watch=watch,
        )
        if limit > 0:
            _check_statistics(stats, conn, len(claimed))
        if not claimed:
            if not looking.on(full=full, inflight=inflight):
                break
            time.sleep(LINGER_POLL)
            continue
        looking = _Looking(app)
        messages += _publish(app, conn, claimed, consumers=room.consumers)
        claimed_total += len(claimed)
    return claimed_total, messages, rounds


# Each app's claim watch (store.ClaimWatch): its claims look for starving jobs at every claim
# only while some are found, else once a second, and take the plain claim while no other
# tenant than '' has pending jobs.
_WATCHES: weakref.WeakKeyDictionary[Harvest, store.ClaimWatch] = weakref.WeakKeyDictionary()
# Each app's watch of the planner's statistics (store.StatsWatch): made afresh when the
# pending jobs outnumber its figure tenfold, rather than claims sorting every pending row
# until autovacuum comes by.
_STATS: weakref.WeakKeyDictionary[Harvest, store.StatsWatch] = weakref.WeakKeyDictionary()


def _check_statistics(stats: store.StatsWatch, conn: Connection, got: int) -> None:
    try:
        analyzed = stats.claimed(conn, got)
    except Exception as exc:  # the claim stands; its plan stays as it was
        log.warning("statistics of harvest_jobs not checked (%s)", type(exc).__name__)
        return
    if analyzed is not None:
        log.info(
            "statistics of harvest_jobs were stale (the planner expected %d pending jobs, "
            "there are %s): analyzed in %.0f ms; it expects %d now",
            analyzed.planned,
            f"{analyzed.pending} or more"
            if analyzed.pending >= store.StatsWatch.COUNT_UP_TO
            else analyzed.pending,
            analyzed.seconds * 1000,
            analyzed.after,
        )


@dataclass
class _Looking:
    """Whether a dispatch call that claimed nothing keeps looking (every ``LINGER_POLL``
    seconds, within the call's bounds) rather than leave the next claim to a nudge or beat.

    While the nudge marker lives, enqueuers and workers send no nudge (coalescing): it keeps
    looking until the marker expires, so their jobs wait milliseconds, not until the next
    beat tick. And while the in-flight window is full of jobs that keep ending (the count fell
    within the last ``ROOM_LINGER`` seconds), it keeps looking for the room they free: the
    workers nudge at most once a second each, so short jobs that emptied the window just after
    their nudges left it idle until beat (measured: 0.85 s of a 7 s drain of no-op jobs). Long
    jobs, whose count does not move, are not waited for."""

    app: Harvest
    nudge_until: float = 0.0
    room_until: float = 0.0
    last_inflight: int = 0

    def on(self, *, full: bool, inflight: int) -> bool:
        now = time.monotonic()
        if full:
            if not self.room_until or inflight < self.last_inflight:
                self.room_until = now + ROOM_LINGER
            self.last_inflight = inflight
            if now < self.room_until:
                return True
        self.nudge_until = self.nudge_until or _nudge_expires(self.app)
        return now < self.nudge_until


def _publish(app: Harvest, conn: Connection, claimed: list[Claimed], *, consumers: int) -> int:
    """Publish claimed (committed) jobs, grouped into messages sized by each name's recent
    run time; returns how many messages were sent."""
    counts = Counter(job.name for job in claimed)
    runs = _RUN_TIMES.get(app, conn, counts)
    sizes = {
        name: jobs_per_message(
            n,
            app.settings.max_jobs_per_message,
            consumers,
            runs.get(name),
            concurrent=name in app.jobs and app.jobs[name].is_async,
        )
        for name, n in counts.items()
    }
    batches = chunk(claimed, sizes)
    app.broker.publish_jobs(batches)
    return len(batches)


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


@dataclass(frozen=True, slots=True)
class Room:
    """How much the execution side can take."""

    window: int  # most jobs dispatched or running at once
    consumers: int  # execution processes a claim is spread over


class _Workers:
    """The live execution processes (``harvest.execution.registry``), read at most every
    ``REFRESH`` seconds: the in-flight window is what they can run at once plus one claim
    batch waiting (never below ``DEFAULT_WINDOW``), unless ``HARVEST_INFLIGHT_WINDOW`` says;
    a claim is spread over as many messages as there are processes."""

    REFRESH = 1.0
    DEFAULT_WINDOW = 400

    def __init__(self) -> None:
        self._cache: dict[tuple[str, int | None, int, int], tuple[float, Room]] = {}

    def capacity(self, app: Harvest) -> Room:
        settings = app.settings
        # The registry read is shared by apps of one Redis; the room also depends on the
        # settings (two apps of one process with different windows must not share one).
        key = (
            settings.redis_url,
            settings.inflight_window,
            settings.claim_batch_size,
            settings.worker_concurrency,
        )
        read_at, room = self._cache.get(key, (-1e9, None))
        if room is not None and time.monotonic() - read_at < self.REFRESH:
            return room
        try:
            live = registry.live(app.redis)
        except Exception:  # Redis down: the defaults (dispatch still works)
            live = []
        slots = sum(w.slots for w in live)
        window = settings.inflight_window or max(
            self.DEFAULT_WINDOW, slots + settings.claim_batch_size
        )
        room = Room(window, len(live) or settings.worker_concurrency)
        self._cache[key] = (time.monotonic(), room)
        return room


_WORKERS = _Workers()


def refill_at(settings: Settings) -> int:
    """Free slots a round waits for while jobs are in flight: half a claim batch (or half the
    window, when that is smaller), at least one."""
    window = settings.inflight_window or _Workers.DEFAULT_WINDOW
    return max(1, min(settings.claim_batch_size, window) // 2)


def _nudge_expires(app: Harvest) -> float:
    """When (monotonic) the current nudge marker expires; now when there is none."""
    try:
        ttl_ms = app.redis.pttl(rkeys.nudge())
    except Exception:  # Redis down: no lingering, beat carries on
        return time.monotonic()
    return time.monotonic() + max(0, int(ttl_ms)) / 1000


PREFETCH = 0.5  # of a pool's serving concurrency: jobs sent ahead to wait at the gate
PREFETCH_MAX = 512


def pool_budget(
    states: Sequence[KeyState],
    in_flight: int,
    *,
    run_seconds: float | None = None,
    key_wait: float | None = None,
    batch: int = 1,
) -> int:
    """How many more jobs of one pool to send now: the leases its keys could grant now, plus
    some sent ahead (:func:`ahead`) so that a job is already waiting at the gate when a key
    frees (a release in the same process hands the key over at once), less the jobs that wait
    for a key: of the pool's jobs dispatched or running (``in_flight``), those beyond its live
    leases (sent and not started, or started and waiting at the gate). The gate, not this
    number, keeps every key within its limits.

    While jobs wait, the pool is topped up only once ``batch`` (a message's jobs, at most a
    quarter of those sent ahead) can go: topping up the few slots freed since the last round
    made messages of one to four jobs under load (half of them in the huge goodput case), and
    the per-message cost is what Celery pays most; the jobs still waiting cover the rest."""
    free = sum(state.available for state in states)
    waiting = max(0, in_flight - sum(state.live_leases for state in states))
    serving = sum(state.max_concurrency for state in states if state.serving)
    sent_ahead = ahead(serving, run_seconds, key_wait)
    budget = max(0, free + sent_ahead - waiting)
    refill = min(batch, max(1, sent_ahead // 4))
    return budget if budget >= refill or not waiting else 0


def ahead(serving: int, run_seconds: float | None, key_wait: float | None) -> int:
    """Jobs of a pool sent ahead of its free keys: half its serving concurrency, at most
    ``PREFETCH_MAX``, and no more than its keys free up in half of ``key_wait`` at the jobs'
    recent run time (``run_seconds``; unknown: not bounded by it), so that a job sent ahead
    gets a key before its wait runs out rather than going back to pending. Under load the jobs
    between dispatch and the gate (claimed, in the broker, being held), those writing their
    ending (running, their key given back) and the waiters spread over several processes all
    come out of it: a tenth, at most 64, left keys of the huge goodput case idle between
    calls. The worker's room (``HARVEST_ASYNC_CONCURRENCY``) bounds how many wait in it."""
    n = min(PREFETCH_MAX, math.ceil(serving * PREFETCH))
    if key_wait is not None and run_seconds is not None and run_seconds > 0:
        n = min(n, math.ceil(serving * key_wait / 2 / run_seconds))
    return n


def pool_budgets(app: Harvest, conn: Connection) -> dict[str, int]:
    """:func:`pool_budget` of each key pool the registered jobs use, by the ``pool`` text of
    their rows. A job with fallback pools (``"a,b"``) counts its pools together: their keys'
    capacity, less the jobs waiting for any of them (:func:`waiting_for`). A pool whose state
    cannot be read counts as no capacity this round (its jobs wait; nothing over-admits).

    The jobs in flight are counted every round; the keys' state is read again every round
    only while a route's budget could bind a claim (:class:`harvest.capacity.Ample`)."""
    routes = sorted({spec.pool for spec in app.jobs.values() if spec.pool})
    if not routes:
        return {}
    in_flight = store.in_flight_by_pool(conn, routes)
    ample = capacity.AMPLE.setdefault(app, capacity.Ample())
    pools = {pool for route in routes for pool in fallback.pools(route)}
    states = {pool: ample.states(pool) or capacity.pool_states(app, pool) for pool in pools}
    runs = _RUN_TIMES.get(app, conn, ())  # as known (refreshed every 2 s): no read per round
    budgets = {}
    for route in routes:
        known = [state for pool in fallback.pools(route) for state in states[pool]]
        names = [spec.name for spec in app.jobs.values() if spec.pool == route]
        slowest = max((runs[n] for n in names if n in runs), default=None)
        budgets[route] = (
            pool_budget(
                known,
                waiting_for(route, in_flight),
                run_seconds=slowest,
                key_wait=app.settings.key_wait,
                batch=app.settings.max_jobs_per_message,
            )
            if known
            else 0
        )
    binding = {
        pool
        for route, budget in budgets.items()
        if budget < app.settings.claim_batch_size
        for pool in fallback.pools(route)
    }
    for pool in pools:
        ample.keep(pool, states[pool], ample=pool not in binding)
    return budgets


def waiting_for(route: str, in_flight: Mapping[str, int]) -> int:
    """Jobs in flight that hold or may take a key of one of ``route``'s pools: those of every
    route sharing a pool with it (for one pool alone: that pool's own)."""
    mine = set(fallback.pools(route))
    return sum(n for other, n in in_flight.items() if mine.intersection(fallback.pools(other)))


@dataclass(frozen=True, slots=True)
class RescueReport:
    requeued: int
    failed: int
    cancelled: int


def rescue_if_due(app: Harvest) -> RescueReport | None:
    """:func:`rescue`, when none ran (in any process of this Redis) for
    ``HARVEST_RESCUE_INTERVAL``; None otherwise, and when Redis cannot say.

    Dispatch ticks call it: rescue's own ticks share the ``schedule`` queue with dispatch ticks
    and nudges, and where those keep its process busy (a full in-flight window makes each
    dispatch linger) rescue ticks waited past their ``expires`` and were dropped unrun, so
    killed workers' jobs waited a minute instead of a lease (chaos case F1)."""
    try:
        due = app.redis.set(
            rkeys.rescue_ran(), b"1", nx=True, px=int(app.settings.rescue_interval * 1000)
        )
    except Exception:  # Redis down: rescue's own ticks carry on
        return None
    return rescue(app) if due else None


def rescue(app: Harvest, *, batch: int = 500) -> RescueReport:
    """Return jobs whose lease expired to pending (or failed, when no attempts remain)."""
    with contextlib.suppress(Exception):  # Redis down: rescue needs Postgres only
        # Dispatch ticks run no other rescue for an interval (rescue_if_due).
        app.redis.set(rkeys.rescue_ran(), b"1", px=int(app.settings.rescue_interval * 1000))
    with app.engine.begin() as conn:
        store.quarantine_pending(conn)
    report = _take_back(app, store.rescue_expired, batch)
    if report.requeued or report.failed or report.cancelled:
        log.warning(
            "rescued expired leases: %d re-queued, %d failed, %d cancelled",
            report.requeued,
            report.failed,
            report.cancelled,
        )
    if report.requeued:
        app.nudge()
    return report


def _take_back(app: Harvest, take: Callable[..., store.Rescued], batch: int) -> RescueReport:
    """Jobs taken back by ``take`` (``store.rescue_expired`` or ``store.requeue_dispatched``),
    ``batch`` rows a transaction until a batch comes back short, each counted as rescued."""
    requeued = failed = cancelled = 0
    for _ in range(MAX_ROUNDS):
        with app.engine.begin() as conn:
            back = take(conn, limit=batch)
            n = len(back.requeued) + len(back.failed) + len(back.cancelled)
            store.bump(conn, RESCUED, n)
        requeued += len(back.requeued)
        failed += len(back.failed)
        cancelled += len(back.cancelled)
        if n < batch:
            break
    return RescueReport(requeued, failed, cancelled)

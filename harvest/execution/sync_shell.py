"""The blocking shell: drives :mod:`harvest.execution.core` for sync handlers, in whatever
thread Celery runs the task (a prefork child, ``-P solo``, ``-P threads``, ``-P gevent``).

No state is shared between threads except through locks: every statement checks a connection
out of the process's pool and gives it back at once (so ``-P threads -c N`` needs a pool of
about N, which the worker sizes), the heartbeat thread renews the leases of every job this
process holds in one statement per round, and the watchdog ends attempts at their deadline
where no signal can reach the handler. Where a process runs sync jobs in several threads, their
holds, starts, finishes and deferrals are grouped into one statement of each kind
(:mod:`~harvest.execution.thread_writer`; ``lingers`` of :class:`SyncShell`).
"""

from __future__ import annotations

import logging
import threading
import time
from collections import Counter
from collections.abc import Callable, Generator, Sequence
from typing import TYPE_CHECKING, Any, TypeVar

import httpx
import psycopg

from harvest.clients import ClientPool, http_client
from harvest.context import JobContext
from harvest.coordination.key_pool import Lease
from harvest.errors import JobTimeout
from harvest.execution import core, delivery, handoff, limits, patience, sql, tracking
from harvest.execution import effects as fx
from harvest.execution.delivery import Keyed
from harvest.execution.heartbeat import HeartbeatThread
from harvest.execution.messages import Item
from harvest.execution.observe import Received, notify
from harvest.execution.run_ahead import Message, Paused, Taken, caught
from harvest.execution.thread_writer import ThreadWriter, Writes
from harvest.execution.tracking import Tracked
from harvest.execution.windows import RunTimes, at_hold
from harvest.gate import Gate
from harvest.jobs import Started
from harvest.outage import POSTGRES, service_of
from harvest.usage import Tally

if TYPE_CHECKING:
    from harvest.app import Harvest

log = logging.getLogger("harvest.runner")

T = TypeVar("T")
GRACE = 5.0  # seconds past a blocking job's time limit before this process counts as wedged


class SyncShell:
    """``lingers`` (the write linger and the settle linger, in seconds) gathers the holds,
    starts, finishes and deferrals of the jobs this process's threads run into one statement of
    each kind (``-P threads`` and ``-P gevent``: several jobs in flight), as the asyncio shell
    does for its jobs; None writes each alone."""

    def __init__(
        self, app: Harvest, plan: core.Plan, *, lingers: tuple[float, float] | None = None
    ) -> None:
        self.app = app
        self.plan = plan
        self.gate = Gate(app)
        settings = app.settings
        self.lingers = (settings.write_linger_ms / 1000, settings.settle_linger_ms / 1000)
        self.run_times = RunTimes()  # of this process's handlers, by job name (run_ahead)
        # No cap of its own: a job borrows a key's client only while it holds a lease on the
        # key, so the key's declared concurrency bounds the clients out (a cap below it, the
        # old 4, held a thread pool to 4 calls a key whatever the key allowed).
        self.clients: ClientPool[httpx.Client] = ClientPool(
            http_client, max_per_key=None, healthy=lambda client: not client.is_closed
        )
        self.heartbeat = HeartbeatThread(self)
        self.watchdog = limits.Watchdog()
        self.usage = Tally()  # calls made with keys, written in windows by the executor
        self._keys_lock = threading.Lock()
        self._keys_freed: dict[str, threading.Condition] = {}  # a pool -> its waiters
        ttl, worker = plan.lease_ttl, plan.worker

        def run(query: sql.Query[T]) -> T:  # whatever self.db is when it runs
            return self.db(query)

        self.writer: Writes = (
            Writes(run, ttl=ttl, worker=worker)
            if lingers is None
            else ThreadWriter(run, ttl=ttl, worker=worker, linger=lingers[0], settle=lingers[1])
        )
        # A key the last job of a message gives back, kept for the next message's first job
        # (:class:`~harvest.execution.handoff.Parking`): in a process that runs its messages
        # one after another; a thread pool's jobs pass keys through Redis.
        self.parked: handoff.Parking | None = None
        if lingers is None:
            self.parked = handoff.Parking(
                self._give_back,
                ttl,
                self.gate.faults,
                lambda delay, fn: self.watchdog.at(time.monotonic() + delay, fn),
            )

    def _key_freed(self, pool: str) -> threading.Condition:
        with self._keys_lock:
            return self._keys_freed.setdefault(pool, threading.Condition(self._keys_lock))

    # --- a message ------------------------------------------------------------------------

    def hold(self, pairs: Sequence[sql.Pair]) -> dict[int, sql.Held]:
        """Take a message's jobs (extend their dispatch leases); duplicates are left out."""
        held = self.writer.hold(pairs)
        if len(held) < len(pairs):
            self.db(sql.bump({core.DUPLICATES: len(pairs) - len(held)}))
            log.info("suppressed %d duplicate or stale deliveries", len(pairs) - len(held))
        return held

    def take(self, items: Sequence[Item]) -> tuple[list[Taken], Counter[str]]:
        """A message's jobs taken, in its order, and the counts of those not taken (duplicate
        or stale deliveries; jobs cancelled meanwhile). Its first jobs that need nothing of the
        gate are held and started in one write (:func:`windows.at_hold`: the first job, and
        after it the short ones of a window); so are those that need only a key of one pool,
        when the first of them finds one at once (:meth:`_key_first`; the key is then lent
        along them, :class:`~run_ahead.Message`); the others are held."""
        n = at_hold(items, self.app.jobs, self.run_times, self.lingers[0])
        key = None if n or self.writer.grouped else self._key_first(items)
        if key is not None:
            n = at_hold(items, self.app.jobs, self.run_times, self.lingers[0], key[0])
        if self.writer.grouped:
            n = min(n, 1)  # the first runs at once; its thread's next jobs start in their turn
        counts: Counter[str] = Counter()
        started: dict[int, Started | delivery.Keyed] = {}
        if n:
            try:
                answers = self.writer.write("start", [item.pair for item in items[:n]])
            except BaseException:
                if key is not None:  # the key goes back now, not when its lease expires
                    caught(self.perform, fx.ReleaseKey(key[0], used=0))
                raise
            for item, answer in zip(items[:n], answers, strict=True):
                if isinstance(answer, Started):
                    started[item.job_id] = answer if key is None else delivery.Keyed(answer, *key)
                else:  # a duplicate or stale delivery, or a job cancelled before it started
                    counts.update(self.drive(core.not_started(answer)))
            if key is not None and not started:
                self.perform(fx.ReleaseKey(key[0], used=0))
        rest = [item.pair for item in items[n:]]
        held = self.hold(rest) if rest else {}
        counts["suppressed"] += len(rest) - len(held)
        taken: list[Taken] = []
        for item in items:
            job = started.pop(item.job_id, None) or held.get(item.job_id)
            if job is not None:  # (a job started with its hold is taken once, however listed)
                taken.append((item.pair, job))
        return taken, counts

    def _key_first(self, items: Sequence[Item]) -> tuple[Lease, float] | None:
        """A key for a message's first job, when it needs only a key of one pool
        (:func:`~harvest.execution.delivery.leases_first`) and one is free now: one lease try,
        before its hold (which is then its start, one write;
        :func:`~harvest.execution.delivery.lease_first`, as the asyncio shell's ``key_first``).
        The lease and when it was asked for; None: it is held and goes through the gate in its
        turn."""
        first = items[0]
        spec = self.app.jobs.get(first.name or "")
        if spec is None or spec.is_async or not delivery.leases_first(spec):
            return None
        return self.drive(delivery.lease_first(first.job_id, spec, self.plan))

    def run_held(self, jobs: Sequence[Taken]) -> Counter[str]:
        """Run taken jobs one after another in this thread (they were sized to fit). Where jobs'
        ends and starts meet, they share statements (:class:`~run_ahead.Message`), unless this
        process groups its threads' writes (``lingers``)."""
        tracked = [self.track(pair, h.job if isinstance(h, Keyed) else h) for pair, h in jobs]
        specs = [self.app.jobs.get(h.job.name if isinstance(h, Keyed) else h.name) for _, h in jobs]
        attempts = []
        for one, spec, (_, h) in zip(tracked, specs, jobs, strict=True):
            if isinstance(h, Keyed):  # its key leased first (lent it, after the first)
                one.key_renewed(h.asked_at, self.plan.lease_ttl)
                attempts.append(core.attempt(one, spec, self.plan, leased=h.lease))
            elif isinstance(h, Started):
                attempts.append(core.attempt(one, spec, self.plan))
            else:
                attempts.append(
                    core.attempt(
                        one, spec, self.plan, deferred_for=h.deferred_for, payload=h.payload
                    )
                )
        try:
            if self.writer.grouped:
                counts: Counter[str] = Counter()
                for gen in attempts:
                    counts.update(self.drive(gen))
                return counts
            message = Message(self, attempts, specs, jobs)
            try:
                return message.run()
            finally:
                message.close()
        finally:
            for one in tracked:
                self.heartbeat.untrack(one)

    def track(self, pair: sql.Pair, held: sql.Held | Started) -> Tracked:
        tracked = Tracked.taken(pair, held)
        self.heartbeat.track(tracked)
        notify(self.app.observers, Received(pair[0], held.name, tracked.attempt, self.plan.worker))
        return tracked

    # --- the driver -----------------------------------------------------------------------

    def drive(self, gen: Generator[fx.Effect, Any, T]) -> T:
        """Run ``gen`` to its end, performing each effect it yields."""
        return self.advance(gen).returned  # type: ignore[no-any-return]

    def advance(
        self,
        gen: Generator[fx.Effect, Any, Any],
        value: Any = None,
        error: BaseException | None = None,
        stop: Callable[[fx.Effect], bool] | None = None,
    ) -> Paused:
        """Send ``value`` (or throw ``error``) into ``gen`` and perform what it yields, until
        it yields an effect ``stop`` picks (returned, not performed) or ends."""
        while True:
            try:
                effect = gen.throw(error) if error is not None else gen.send(value)
            except StopIteration as end:
                return Paused(done=True, returned=end.value)
            if stop is not None and stop(effect):
                return Paused(effect)
            value, error = caught(self.perform, effect)

    def release_then_lease(self, done: fx.ReleaseKey, e: fx.LeaseKey) -> Any:
        """The job before's key given back and the next job's lease, in one round trip; or,
        where the key's limits allow, no round trip at all: the lease passes to the next job
        (:func:`harvest.execution.handoff.passes_on`)."""
        now, ttl = time.time(), self.plan.lease_ttl
        if handoff.passes_on(done, e.pool, e.cost, now, ttl, faults=self.gate.faults):
            self.gate.reused(done.lease)
            return done.lease
        result = self.gate.release_then_lease(
            done.lease, e.pool, e.holder, e.cost, used=done.used, succeeded=done.succeeded,
            announced=done.announced,
        )  # fmt: skip
        if not isinstance(result, Lease):
            self._wake_one(done.lease.pool)  # the freed key is not this job's: a waiter's
        return result

    def _release(self, done: fx.ReleaseKey) -> None:
        """A key lease back to Redis, and one waiter of its pool woken."""
        self.gate.release(done.lease, done.used, done.succeeded, done.announced)
        self._wake_one(done.lease.pool)

    def _give_back(self, done: fx.ReleaseKey) -> None:
        """A parked key lease back to Redis (in the watchdog thread, when no job took it)."""
        try:
            self._release(done)
        except Exception as exc:
            log.warning("a key lease kept between messages did not go back to Redis (%s): it "
                        "is free again when it expires", type(exc).__name__)  # fmt: skip

    def _wake_one(self, pool: str) -> None:
        freed = self._key_freed(pool)
        with freed:
            freed.notify()  # one key freed: one waiter tries it (not a stampede)

    def perform(self, e: fx.Effect) -> Any:
        match e:
            case fx.Clock():
                return time.monotonic()
            case fx.RatePermit(spec):
                return self.gate.rate_permit(spec)
            case fx.LeaseKey(pool, holder, cost):
                passed = self.parked.take(pool, cost) if self.parked is not None else None
                if passed is not None:
                    self.gate.reused(passed)
                    return passed
                return self.gate.try_lease(pool, holder, cost)
            case fx.LoadPool(pool):
                return self.gate.load_pool(pool)
            case fx.AwaitKey(pool, seconds, until=until):
                wait = seconds if until is None else min(seconds, until)
                if self.parked is not None:  # one job at a time: only another process frees
                    self.gate.await_freed(pool, wait)  # a key now, and Redis says when
                    return None
                freed = self._key_freed(pool)  # a thread pool: woken by its own threads
                with freed:
                    freed.wait(wait)
                return None
            case fx.Defer(row):
                return self.writer.defer(row)
            case fx.Start(job_id, token):
                return self.writer.start((job_id, token))
            case fx.Secret(lease):
                return self.gate.secret(lease)
            case fx.RunHandler():
                return self.run_handler(e)
            case fx.CoolKey(lease, seconds, exhausted):
                if self.parked is not None:
                    self.parked.drop_key(lease)
                return self.gate.rate_limited(lease, seconds, exhausted)
            case fx.DisableKey(lease):
                if self.parked is not None:
                    self.parked.drop_key(lease)
                return self.gate.rejected(lease)
            case fx.Finish(row, ran):
                return self.writer.finish(row, ran)
            case fx.ReleaseKey():
                if self.parked is not None and handoff.passable(
                    e, time.time(), self.plan.lease_ttl, faults=self.gate.faults
                ):
                    self.parked.park(e)  # for the next message's first job, or back soon
                else:
                    self._release(e)
                return None
            case fx.RenewKey(lease):
                return self.gate.heartbeat_many([lease])[0]
            case fx.CountUsage(call):
                return self.usage.add(call)
            case fx.Bump(name, n):
                return self.db(sql.bump({name: n}))
            case fx.Notify(event):
                return notify(self.app.observers, event)
        raise TypeError(f"unknown effect {e!r}")

    def db(self, query: sql.Query[T]) -> T:
        """One statement, autocommit, on a connection of the process's pool checked out for
        it (the driver's own, without SQLAlchemy's per-checkout transaction and isolation
        bookkeeping: a tenth of this process's time at hundreds of jobs a second). While
        Postgres does not answer (restarted, a backend terminated, stopped for seconds) it is
        tried again as :mod:`~harvest.execution.patience` says, as the asyncio shell's writes
        are: a finish given up too soon would have rescue run a call that was made again."""
        waits = patience.pauses(self.plan.lease_ttl / 2)
        while True:
            try:
                return self._db_once(query)
            except _Away as away:
                pause = next(waits, None)
                if pause is None:
                    raise away.error from None
                patience.retrying(away.error, pause)
                time.sleep(pause)

    def _db_once(self, query: sql.Query[T]) -> T:
        """One try; :class:`_Away` when Postgres did not answer (no connection, or it broke) or
        rolled the statement back to break a deadlock."""
        try:
            pooled = self.app.engine.raw_connection()
        except Exception as exc:
            if service_of(exc) == POSTGRES:
                raise _Away(exc) from exc
            raise
        driver = pooled.driver_connection
        assert isinstance(driver, psycopg.Connection)
        try:
            driver.autocommit = True
            try:
                return sql.run(driver, query)
            finally:
                if not driver.closed:
                    driver.autocommit = False  # as the pool's other users expect it
        except psycopg.OperationalError as exc:
            if not patience.worth_retrying(exc, driver):
                raise
            if patience.unanswered(exc, driver):  # not a rollback: the connection is gone
                pooled.invalidate()
                self.app.engine.dispose(close=False)  # its pool-mates died with it
            raise _Away(exc) from exc
        finally:
            pooled.close()

    # --- running a handler ----------------------------------------------------------------

    def run_handler(self, e: fx.RunHandler) -> fx.HandlerResult:
        ctx = self.context(e)
        timeout = e.job.timeout or e.spec.timeout
        how = limits.mode()
        if how != "watchdog":
            e.tracked.deadline = time.monotonic() + timeout + GRACE
        started = time.monotonic()

        def took() -> float:
            return time.monotonic() - started

        try:
            with limits.limit(timeout, how, self.watchdog, lambda: self._expire(e)):
                value = e.spec.func(ctx, **e.job.payload)
        except JobTimeout:
            return fx.HandlerResult(seconds=took(), timed_out=True, ended_elsewhere=e.tracked.ended)
        except (KeyboardInterrupt, SystemExit):
            raise
        except BaseException as exc:
            return fx.HandlerResult(
                error=exc, seconds=took(), cancelled=ctx.cancelled, ended_elsewhere=e.tracked.ended
            )
        finally:
            e.tracked.deadline = float("inf")
            self.run_times.saw(e.spec.name, took())
        return fx.HandlerResult(
            value=value, seconds=took(), cancelled=ctx.cancelled, ended_elsewhere=e.tracked.ended
        )

    def context(self, e: fx.RunHandler) -> JobContext:
        tracked = e.tracked
        return JobContext(
            job_id=e.job.id,
            attempt=e.job.attempt,
            max_attempts=e.job.max_attempts,
            name=e.job.name,
            key=e.secret,
            lease=e.lease,
            clients=self.clients,
            _lease_check=(
                (lambda: self.drive(tracking.key_still_held(tracked, self.plan.lease_ttl)))
                if e.lease is not None
                else None
            ),
            _cancel=tracked.cancel,
            _used=tracked.used,
            _observe=tracked.observe,
        )

    def _expire(self, e: fx.RunHandler) -> None:
        """In the watchdog thread, at a threaded handler's deadline."""
        if self.drive(core.expire(e.tracked, e.job, e.spec, self.plan)):
            log.warning(
                "job %s attempt %s ran past its time limit of %gs: ended as timed out; the "
                "thread runs on (Python cannot stop it) and its result will be dropped",
                e.job.id,
                e.job.attempt,
                e.job.timeout or e.spec.timeout,
            )


class _Away(Exception):
    """Postgres did not answer a statement's try (``error``), or rolled it back: try again."""

    def __init__(self, error: BaseException) -> None:
        self.error = error

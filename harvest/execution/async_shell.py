"""The asyncio shell: drives :mod:`harvest.execution.core` for ``async def`` handlers, many at
once on one event loop per worker process (started after fork, never before).

Its I/O never blocks the loop: Postgres through psycopg's async connections (grouped fenced
writes, :mod:`harvest.execution.writer`), Redis through ``redis.asyncio`` (the same Lua
scripts), HTTP through one ``httpx.AsyncClient`` per key. Each job is one task, its handler
included, so a time limit or a cancellation really stops it (it gets ``CancelledError``). One
heartbeat task renews the leases of every job in flight in one statement per tick.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import time
from collections.abc import Generator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, TypeVar

from psycopg_pool import AsyncConnectionPool
from redis.asyncio import Redis as AsyncRedis

from harvest.clients import AsyncClients
from harvest.context import JobContext
from harvest.coordination.key_state import Busy, Lease
from harvest.execution import core, delivery, handoff, sql, tracking
from harvest.execution import effects as fx
from harvest.execution.handoff import Parking
from harvest.execution.observe import Received, notify
from harvest.execution.tracking import Tracked
from harvest.execution.writer import Writer
from harvest.gate import AsyncGate, Gate
from harvest.jobs import Started
from harvest.models import JobStatus
from harvest.usage import Tally

if TYPE_CHECKING:
    from harvest.app import Harvest

log = logging.getLogger("harvest.runner")

T = TypeVar("T")
MIN_POLL = 0.005  # shortest pause between two lease tries for the jobs waiting in line


@dataclass(slots=True, eq=False)
class Waiter:
    """A job of this process waiting for a key of a pool (:meth:`AsyncShell._await_key`)."""

    holder: str
    cost: int
    handed: asyncio.Future[Lease | None]  # a lease leased for it, or None: lease on your own
    poll: float  # seconds between lease tries for it while it is first in line
    patient: bool  # stays in line until a key is leased for it or its wait is over
    late: bool = False  # its time was up while a release leased for it: not back in line


def _give_up(queue: collections.deque[Waiter], waiter: Waiter) -> None:
    """A waiter's time is up: it leases on its own, unless a release is leasing for it (then
    it takes what that lease brings, and is not put back in line)."""
    if waiter.handed.done():
        return
    if waiter in queue:
        queue.remove(waiter)
        waiter.handed.set_result(None)
    else:
        waiter.late = True


class Stop:
    """Stops a running handler from another task of the loop (the heartbeat: its job was lost
    or cancelled; shutdown: it is handed back) by cancelling the job's task, and undoes those
    cancellations once the handler has ended, so the job's own ending runs uncancelled."""

    def __init__(self) -> None:
        task = asyncio.current_task()
        assert task is not None, "a handler runs in a task"
        self.task, self.sent = task, 0

    def cancel(self) -> None:
        self.sent += 1
        self.task.cancel()

    def undo(self) -> None:
        while self.sent and self.task.cancelling():
            self.task.uncancel()
            self.sent -= 1


class AsyncShell:
    def __init__(
        self,
        app: Harvest,
        plan: core.Plan,
        *,
        pool: AsyncConnectionPool[Any],
        redis: AsyncRedis,
        gate: Gate,
        writer: Writer,
        usage: Tally | None = None,
    ) -> None:
        self.app, self.plan = app, plan
        self.usage = usage if usage is not None else Tally()  # the process's, shared
        self.pool, self.redis, self.writer = pool, redis, writer
        self.gate = AsyncGate(gate, redis)
        self.clients = AsyncClients()
        self.tracked: dict[int, Tracked] = {}
        self._waiting: dict[str, collections.deque[Waiter]] = {}  # by pool, oldest first
        self._probes: dict[str, asyncio.Task[None]] = {}  # by pool, while jobs wait for it
        self._giving_back: set[asyncio.Task[None]] = set()  # parked leases going to Redis
        self.parked = Parking(
            self._give_back,
            plan.lease_ttl,
            gate.faults,
            lambda delay, fn: asyncio.get_running_loop().call_later(delay, fn),
        )

    # --- a message ------------------------------------------------------------------------

    def track(self, pair: sql.Pair, held: sql.Held | Started) -> Tracked:
        """A job held here (or held and started in one write: a :class:`Started`)."""
        tracked = Tracked.taken(pair, held)
        self.tracked[tracked.job_id] = tracked
        event = Received(pair[0], held.name, tracked.attempt, self.plan.worker)
        notify(self.app.observers, event)
        return tracked

    def untrack(self, tracked: Tracked) -> None:
        if self.tracked.get(tracked.job_id) is tracked:
            del self.tracked[tracked.job_id]

    async def run(
        self, tracked: Tracked, held: sql.Held | None, leased: Lease | None = None
    ) -> tuple[str, ...]:
        """One held job, start to end (``held`` None: it was held and started in one write,
        with its key ``leased`` first when it has a pool)."""
        spec = self.app.jobs.get(tracked.name)
        try:
            if held is None:
                attempt = core.attempt(tracked, spec, self.plan, leased=leased)
            else:
                attempt = core.attempt(
                    tracked, spec, self.plan, deferred_for=held.deferred_for, payload=held.payload
                )
            return await self.drive(attempt)
        finally:
            self.untrack(tracked)

    async def run_delivered(self, pair: sql.Pair, name: str | None) -> tuple[str, ...]:
        """A job of a message, from its hold to its end. One that needs nothing of the gate
        is held and started in one write (:func:`delivery.starts_at_hold`), and so is one that
        finds its key at once (:func:`delivery.key_first`); any other is held, and starts once the
        gate lets it."""
        spec = self.app.jobs.get(name or "")
        if spec is not None and delivery.leases_first(spec):
            first = await self.drive(delivery.key_first(pair, spec, self.plan))
            if isinstance(first, delivery.Keyed):
                tracked = self.track(pair, first.job)
                tracked.key_renewed(first.asked_at, self.plan.lease_ttl)
                return await self.run(tracked, None, first.lease)
            if first is not None:
                return first
        answer: Started | JobStatus | None
        if delivery.starts_at_hold(spec):
            answer = await self.writer.start(pair)
            if isinstance(answer, Started):
                return await self.run(self.track(pair, answer), None)
        else:
            held = await self.writer.hold(pair)
            if held is not None:
                return await self.run(self.track(pair, held), held)
            answer = None
        if answer is None:
            log.info("job %s: suppressed a duplicate or stale delivery", pair[0])
        return await self.drive(core.not_started(answer))

    # --- the driver -----------------------------------------------------------------------

    async def drive(self, gen: Generator[fx.Effect, Any, T]) -> T:
        """Run ``gen`` to its end, awaiting each effect it yields."""
        value: Any = None
        error: BaseException | None = None
        while True:
            try:
                effect = gen.throw(error) if error is not None else gen.send(value)
            except StopIteration as stop:
                return stop.value  # type: ignore[no-any-return]
            try:
                value, error = await self.perform(effect), None
            except BaseException as exc:
                value, error = None, exc

    async def perform(self, e: fx.Effect) -> Any:
        match e:
            case fx.Clock():
                return time.monotonic()
            case fx.RatePermit(spec):
                return await self.gate.rate_permit(spec)
            case fx.LeaseKey(pool, holder, cost):
                if self._first_waiting(pool) is not None:  # behind the jobs here waiting for it
                    return Busy(core.KEY_POLL)
                passed = self.parked.take(pool, cost)
                if passed is not None:
                    self.gate.reused(passed)
                    return passed
                return await self.gate.try_lease(pool, holder, cost)
            case fx.LoadPool(pool):
                return await self.gate.load_pool(pool)
            case fx.AwaitKey():
                return await self._await_key(e)
            case fx.Defer(row):
                return await self.writer.defer(row)
            case fx.Start(job_id, token):
                return await self.writer.start((job_id, token))
            case fx.Secret(lease):
                return await self.gate.secret(lease)
            case fx.RunHandler():
                return await self.run_handler(e)
            case fx.CoolKey(lease, seconds, exhausted):
                self.parked.drop_key(lease)
                return await self.gate.rate_limited(lease, seconds, exhausted)
            case fx.DisableKey(lease):
                self.parked.drop_key(lease)
                return await self.gate.rejected(lease)
            case fx.Finish(row, ran):
                return await self.writer.finish(row, ran)
            case fx.ReleaseKey():
                return await self._release(e)
            case fx.RenewKey(lease):
                return (await self.gate.heartbeat_many([lease]))[0]
            case fx.CountUsage(call):
                return self.usage.add(call)
            case fx.Bump(name, n):
                return self.writer.bump(name, n)
            case fx.Notify(event):
                return notify(self.app.observers, event)
        raise TypeError(f"unknown effect {e!r}")

    async def _await_key(self, e: fx.AwaitKey) -> Lease | None:
        """Wait until a key of the pool is leased for this job, or its time is up (None: lease
        on your own). First come, first served: a key freed in this process goes to the first
        in line, leased for it in the release's own round trip (:meth:`_release`), not to all
        of them (each a lease try in Redis: waking hundreds for one key is a stampede).

        A job whose only pool this is (``e.until``) stays in line until its wait is over, and
        one lease try every ``e.seconds`` serves the whole line (:meth:`_probe`): a try at a
        full pool reads every key of it, so one per waiting job would cost Redis more than the
        calls. A job with fallback pools comes back after ``e.seconds`` to try them in turn."""
        loop = asyncio.get_running_loop()
        waiter = Waiter(e.holder, e.cost, loop.create_future(), e.seconds, e.until is not None)
        queue = self._waiting.setdefault(e.pool, collections.deque())
        queue.append(waiter)
        timer = loop.call_later(e.seconds if e.until is None else e.until, _give_up, queue, waiter)
        if waiter.patient:
            self._probe_pool(e.pool)
        try:
            return await waiter.handed
        finally:
            timer.cancel()

    def _probe_pool(self, pool: str) -> None:
        if pool not in self._probes:
            self._probes[pool] = asyncio.get_running_loop().create_task(self._probe(pool))

    async def _probe(self, pool: str) -> None:
        """While jobs of this process wait in line for ``pool``: a lease try for the first in
        line every poll, at once when another process gives a key of the pool back to Redis
        (``pool_release.lua`` wakes one waiting process), and at once again after a grant, so
        that a key freed where no job was waiting (in another process, or by a lease that
        expired) is not left idle. A try that
        fails wakes the whole line: each job then leases on its own and meets the failure."""
        try:
            pause: float | None = None
            while (first := self._first_waiting(pool)) is not None:
                if pause != 0.0:  # until the next try, or a key freed in another process
                    await self.gate.await_freed(
                        pool, max(first.poll, MIN_POLL) if pause is None else pause
                    )
                    if (first := self._first_waiting(pool)) is None:
                        return
                result = await self.gate.try_lease(pool, first.holder, first.cost)
                if result is None:  # Redis lost the pool: rebuild it, then try again
                    await self.gate.load_pool(pool)
                    pause = 0.0
                elif isinstance(result, Busy):
                    pause = max(min(result.retry_after, first.poll), MIN_POLL)
                else:
                    pause = 0.0
                    await self._hand(pool, result)
        except Exception as exc:
            log.warning("leasing a key of pool %r for the jobs waiting here failed (%s): "
                        "each leases on its own", pool, type(exc).__name__)  # fmt: skip
            self._wake(pool)
        finally:
            self._probes.pop(pool, None)

    async def _hand(self, pool: str, lease: Lease) -> None:
        """Give ``lease`` (leased for the line) to the first job still waiting in it, or back."""
        waiter = self._next_waiter(pool)
        if waiter is not None:
            waiter.handed.set_result(lease)
        else:
            await self.gate.release(lease)

    async def _release(self, done: fx.ReleaseKey, *, park: bool = True) -> None:
        """Give a key back. Where its limits allow (:func:`handoff.passable`), with no Redis round
        trip: to the first job of this process waiting for its pool, or parked for a job of the
        pool that comes within ``handoff.PARK`` seconds (:class:`~handoff.Parking`), then back
        to Redis.
        Otherwise, when a job of this process waits for its pool, lease for it in the same
        round trip (the slot is taken as it is freed: no idle key between two jobs, no
        wake-up and second round trip before the waiter's call); when that lease finds no key
        that admits the call, a job that waits for this pool alone keeps its place in line."""
        lease, ttl = done.lease, self.plan.lease_ttl
        now = time.time()
        faults = self.gate.gate.faults
        passable = park and handoff.passable(done, now, ttl, faults=faults)
        waiter = self._next_waiter(lease.pool)
        if waiter is None:
            if passable:
                self.parked.park(done)
            else:
                await self.gate.release(lease, done.used, done.succeeded, done.announced)
            return
        if passable and handoff.takes_over(lease, lease.pool, waiter.cost, now, ttl, faults=faults):
            self.gate.reused(lease)
            waiter.handed.set_result(lease)
            return
        result = await self.gate.release_then_lease(
            lease, waiter.holder, waiter.cost, used=done.used, succeeded=done.succeeded,
            announced=done.announced,
        )  # fmt: skip
        handed = result if isinstance(result, Lease) else None
        if waiter.handed.done():  # it stopped waiting meanwhile (its task was cancelled)
            if handed is not None:
                await self._hand(lease.pool, handed)
        elif handed is None and waiter.patient and not waiter.late:
            self._waiting[lease.pool].appendleft(waiter)
            self._probe_pool(lease.pool)
        else:
            waiter.handed.set_result(handed)

    def _give_back(self, done: fx.ReleaseKey) -> None:
        """A parked lease back to Redis, in a task of its own (:class:`~handoff.Parking`)."""
        task = asyncio.get_running_loop().create_task(self._release(done, park=False))
        self._giving_back.add(task)
        task.add_done_callback(self._giving_back.discard)

    async def drain_parked(self) -> None:
        """Every parked lease back to Redis, and wait until they are (shutdown)."""
        self.parked.drain()
        while self._giving_back:
            await asyncio.gather(*list(self._giving_back), return_exceptions=True)

    def _first_waiting(self, pool: str) -> Waiter | None:
        queue = self._waiting.get(pool)
        while queue and queue[0].handed.done():
            queue.popleft()
        return queue[0] if queue else None

    def _next_waiter(self, pool: str) -> Waiter | None:
        waiter = self._first_waiting(pool)
        if waiter is not None:
            self._waiting[pool].popleft()
        return waiter

    def _wake(self, pool: str) -> None:
        """Wake every job waiting in line for ``pool`` (each leases on its own). The line is
        emptied in place: a waiter's own timer holds it (:func:`_give_up`)."""
        queue = self._waiting.get(pool, collections.deque())
        for waiter in queue:
            if not waiter.handed.done():
                waiter.handed.set_result(None)
        queue.clear()

    def wake_all(self) -> None:
        """Wake every job waiting for a key (shutdown: they hand themselves back)."""
        for pool in list(self._waiting):
            self._wake(pool)
        for probe in self._probes.values():
            probe.cancel()

    # --- running a handler ----------------------------------------------------------------

    async def run_handler(self, e: fx.RunHandler) -> fx.HandlerResult:
        """Run the handler in the job's own task: no task of its own, so no loop turn between
        the key's lease and the handler's first line, nor between its return and the key's
        release (under load a loop turn is milliseconds of a key leased and not called).
        A time limit or a cancellation is thrown into it as ``CancelledError``; a handler that
        ignores it keeps its key and its place until it returns, and its attempt still ends
        timed out or cancelled (its key is never given back while it may still call)."""
        ctx = self.context(e)
        timeout = e.job.timeout or e.spec.timeout
        started = time.monotonic()
        try:
            call = e.spec.func(ctx, **e.job.payload)
        except Exception as exc:  # the call itself failed (a payload that does not fit)
            return fx.HandlerResult(error=exc)
        stop = Stop()
        value: Any = None
        error: BaseException | None = None
        limit = asyncio.timeout(timeout)
        e.tracked.handler = stop
        try:
            async with limit:
                value = await call
        except (Exception, asyncio.CancelledError) as exc:
            error = exc
        finally:
            e.tracked.handler = None
            stop.undo()
        took = time.monotonic() - started
        if limit.expired():  # whatever it did after its cancellation: the time limit counts
            return fx.HandlerResult(seconds=took, timed_out=True)
        if isinstance(error, asyncio.CancelledError):
            if e.tracked.handing_back:
                return fx.HandlerResult(seconds=took, handed_back=True)
            stopped = asyncio.CancelledError("cancelled while it ran")
            return fx.HandlerResult(error=stopped, seconds=took, cancelled=True)
        if error is not None:
            return fx.HandlerResult(error=error, seconds=took, cancelled=ctx.cancelled)
        return fx.HandlerResult(value=value, seconds=took, cancelled=ctx.cancelled)

    def context(self, e: fx.RunHandler) -> JobContext:
        tracked = e.tracked

        async def key_check() -> bool:
            return await self.drive(tracking.key_still_held(tracked, self.plan.lease_ttl))

        return JobContext(
            job_id=e.job.id,
            attempt=e.job.attempt,
            max_attempts=e.job.max_attempts,
            name=e.job.name,
            key=e.secret,
            lease=e.lease,
            aclients=self.clients,
            _alease_check=key_check if e.lease is not None else None,
            _cancel=tracked.cancel,
            _used=tracked.used,
            _observe=tracked.observe,
        )

    # --- heartbeat ------------------------------------------------------------------------

    async def beat(self) -> None:
        """One renewal round for every job this loop holds: one statement, one round trip."""
        plan = tracking.renewal(self.tracked.values(), time.monotonic())
        if not plan.jobs:
            return
        keyed = [(t, t.key_lease) for t in plan.keys if not t.lost and t.key_lease is not None]
        try:
            if keyed:  # first, and whatever Postgres does: see tracking.renewal()
                sent_at = time.monotonic()
                renewed = await self.gate.heartbeat_many([lease for _, lease in keyed])
                tracking.keys_renewed(keyed, renewed, sent_at, self.plan.lease_ttl)
        finally:
            pairs = [(t.job_id, t.token) for t in plan.jobs]
            held = await self.writer.run(sql.heartbeat(pairs, ttl=self.plan.lease_ttl))
            lost, cancelled = tracking.settle(plan.jobs, held)
            for job in [*lost, *cancelled]:
                if job.handler is not None:
                    job.handler.cancel()  # a lost job's outcome is dropped; a cancelled one ends

    async def heartbeat_forever(self, interval: float) -> None:
        while True:
            await asyncio.sleep(interval)
            try:
                await self.beat()
                await self.clients.prune()
            except Exception as exc:
                log.warning("heartbeat round failed: %s", type(exc).__name__)

"""The process's event loop, where ``async def`` jobs run many at once.

A Celery task (in a prefork child, a thread or a greenlet) takes room for a message's async jobs
(:class:`Room`) and hands them to :class:`AsyncRuntime`; it returns at once, so Celery's
slot is free for the next message. On the loop each job is held (its dispatch lease extended,
grouped with every other hold of the moment into one statement by the writer), run, and
finished; the room is given back as it ends.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import gc
import logging
import threading
from collections import Counter
from collections.abc import Callable, Coroutine, Sequence
from typing import TYPE_CHECKING, Any, TypeVar

from psycopg_pool import AsyncConnectionPool
from redis.asyncio import BlockingConnectionPool
from redis.asyncio import Redis as AsyncRedis

from harvest.db import connect_options
from harvest.execution import core, sql
from harvest.execution.async_shell import AsyncShell
from harvest.execution.messages import Item
from harvest.execution.sync_shell import SyncShell
from harvest.execution.writer import Writer

if TYPE_CHECKING:
    from harvest.app import Harvest

log = logging.getLogger("harvest.runner")

T = TypeVar("T")


class Room:
    """How many async jobs the loop holds, bounded; taken by Celery's thread before a message
    is held, given back by the loop as each job ends. A job's end wakes a waiting thread only
    once what it waits for fits (each wake-up is a hand-over of the GIL: at hundreds of jobs a
    second, waking it at every end to find 1 of 16 places free cost 3 % of the process)."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.in_use = 0
        self.closed = False
        self._cond = threading.Condition()
        self._wanted: list[int] = []  # what each waiting thread asks for

    def _fits(self, n: int) -> bool:
        return self.closed or self.in_use == 0 or self.in_use + n <= self.capacity

    def take(self, n: int, timeout: float) -> bool:
        """Room for ``n`` more (a message larger than the capacity waits for an empty loop)."""
        with self._cond:
            if not self._wait(n, lambda: self._fits(n), timeout):
                return False
            self.in_use += n
            return True

    def take_some(self, n: int, timeout: float) -> int:
        """Room for as many of ``n`` as fit now, once one does (at least 1, at most ``n``);
        0 when ``timeout`` passed first or the room was closed. A message's jobs are handed
        to the loop as room frees (:meth:`Executor._run_async`), so a large message neither
        waits for a nearly empty loop nor overfills it."""
        with self._cond:
            if not self._wait(1, lambda: self.in_use < self.capacity, timeout):
                return 0
            taken = min(n, self.capacity - self.in_use)
            self.in_use += taken
            return taken

    def _wait(self, wanted: int, fits: Callable[[], bool], timeout: float) -> bool:
        """Under the lock: wait until ``fits`` (registered as wanting ``wanted`` places, so that
        :meth:`give` wakes this thread only when they fit); False on timeout or close."""
        self._wanted.append(wanted)
        try:
            ok = self._cond.wait_for(lambda: self.closed or fits(), timeout)
        finally:
            self._wanted.remove(wanted)
        return ok and not self.closed

    def give(self, n: int = 1) -> None:
        with self._cond:
            self.in_use -= n
            if self._wanted and self._fits(min(self._wanted)):
                self._cond.notify_all()

    def close(self) -> None:
        with self._cond:
            self.closed = True
            self._cond.notify_all()


YOUNG_THRESHOLD = 10_000  # allocations between two collections of the youngest generation


def settle_garbage_collector() -> None:
    """Move what the process holds once it is set up (its modules, the app, engines and pools:
    hundreds of thousands of objects that live as long as the process) out of the cyclic
    collector's sight (``gc.freeze``), after one collection of what setting up left behind.
    Each full collection walked all of them on the thread that runs the loop, and every job's
    round trips waited behind it: measured in the huge goodput case, pauses of up to 300 ms and
    3.5 s of a 40 s run spent collecting (frozen: 1.8 s). What jobs create is collected as
    before.

    Young objects are collected every ``YOUNG_THRESHOLD`` allocations, not Python's 700: a
    loop with a thousand jobs in flight makes cyclic garbage (futures, tasks, tracebacks) at
    every turn, and collecting it in small, frequent passes walked the same live jobs again and
    again (measured in the huge goodput case: 3.1 s of collection in 37 s across the two
    processes, 1.5 s with 10,000).
    """
    gc.collect()
    gc.freeze()
    _, older, oldest = gc.get_threshold()
    gc.set_threshold(YOUNG_THRESHOLD, older, oldest)


class AsyncRuntime:
    """The process's event loop, in a thread of its own, and everything that lives on it."""

    def __init__(self, app: Harvest, plan: core.Plan, sync: SyncShell, capacity: int) -> None:
        self.app, self.plan, self.sync = app, plan, sync
        self.admission = Room(capacity)
        self.loop = asyncio.new_event_loop()
        self.shell: AsyncShell | None = None
        self._jobs: set[asyncio.Task[Any]] = set()
        self._thread = threading.Thread(target=self._run, name="harvest-loop", daemon=True)
        self._thread.start()
        self.call(self._setup(), timeout=30.0)
        settle_garbage_collector()

    def _run(self) -> None:
        asyncio.set_event_loop(self.loop)
        self.loop.run_forever()

    def call(self, coro: Coroutine[Any, Any, T], timeout: float | None) -> T:
        """Run ``coro`` on the loop and wait for its result from another thread."""
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    async def _setup(self) -> None:
        settings = self.app.settings
        pool: AsyncConnectionPool[Any] = AsyncConnectionPool(
            settings.psycopg_url,
            min_size=1,
            max_size=settings.async_db_pool_size,
            kwargs={"autocommit": True, **connect_options(settings, generic_plans=True)},
            timeout=10.0,
            open=False,
        )
        await pool.open(wait=False)
        redis = AsyncRedis(
            connection_pool=BlockingConnectionPool.from_url(
                settings.redis_url,
                max_connections=64,
                timeout=10,
                socket_timeout=5,
                socket_connect_timeout=5,
            )
        )
        writer = Writer(
            pool,
            ttl=self.plan.lease_ttl,
            worker=self.plan.worker,
            linger=settings.write_linger_ms / 1000,
            settle=settings.settle_linger_ms / 1000,
            patience=settings.lease_ttl / 2,
        )
        self.shell = AsyncShell(self.app, self.plan, pool=pool, redis=redis, gate=self.sync.gate,
                                writer=writer, usage=self.sync.usage)  # fmt: skip
        self._spawn(self.shell.heartbeat_forever(settings.heartbeat_interval))

    def _spawn(self, coro: Coroutine[Any, Any, Any]) -> asyncio.Task[Any]:
        task = self.loop.create_task(coro)
        self._jobs.add(task)
        task.add_done_callback(self._jobs.discard)
        return task

    # --- from Celery's thread ---------------------------------------------------------

    def submit(
        self, jobs: Sequence[Item | tuple[sql.Pair, sql.Held]], *, wait: bool
    ) -> Counter[str]:
        """Run jobs on the loop (their room was taken with ``admission.take``): items are held
        there first, (pair, held) were held by the caller. Returns at once unless ``wait``; the
        calling thread never waits for the loop's other work."""
        future = self.start(jobs, wait=wait)
        if wait:
            return future.result()
        return Counter(accepted=len(jobs))

    def start(
        self, jobs: Sequence[Item | tuple[sql.Pair, sql.Held]], *, wait: bool
    ) -> concurrent.futures.Future[Counter[str]]:
        """:meth:`submit` without waiting: the future's counts are the jobs' own (``wait``:
        once they have all ended) or how many were accepted."""
        return asyncio.run_coroutine_threadsafe(self._run_all(jobs, wait=wait), self.loop)

    # --- on the loop ----------------------------------------------------------------------

    async def _run_all(
        self, jobs: Sequence[Item | tuple[sql.Pair, sql.Held]], *, wait: bool
    ) -> Counter[str]:
        shell = self.shell
        assert shell is not None
        tasks = [self._spawn(self._one(shell, job)) for job in jobs]
        counts: Counter[str] = Counter()
        if wait:
            for result in await asyncio.gather(*tasks):
                counts.update(result)
        else:
            counts["accepted"] += len(tasks)
        return counts

    async def _one(
        self, shell: AsyncShell, job: Item | tuple[sql.Pair, sql.Held]
    ) -> tuple[str, ...]:
        pair = job.pair if isinstance(job, Item) else job[0]
        try:
            if isinstance(job, Item):
                return await shell.run_delivered(pair, job.name)
            return await shell.run(shell.track(pair, job[1]), job[1])
        except Exception:
            log.exception(
                "job %s: its attempt failed inside harvest; its lease will expire and rescue "
                "takes it back",
                pair[0],
            )
            return ()
        finally:
            self.admission.give(1)
            self.app.nudge_soon()

    # --- shutdown -------------------------------------------------------------------------

    def shutdown(self, grace: float) -> tuple[int, int]:
        """Warm shutdown: take no more jobs, let those in flight run up to ``grace`` seconds,
        then hand the rest back (pending again at once, the attempt not counted). Returns
        (finished, handed back)."""
        self.admission.close()
        try:
            return self.call(self._drain(grace), timeout=grace + 60.0)
        finally:
            self.loop.call_soon_threadsafe(self.loop.stop)
            self._thread.join(10.0)

    async def _drain(self, grace: float) -> tuple[int, int]:
        shell = self.shell
        assert shell is not None
        jobs = [t for t in self._jobs if t.get_coro().__name__ == "_one"]  # type: ignore[union-attr]
        before = len(jobs)
        if jobs:
            await asyncio.wait(jobs, timeout=grace)
        left = [t for t in jobs if not t.done()]
        for tracked in list(shell.tracked.values()):
            tracked.handing_back = "the worker shut down"
            if tracked.handler is not None:
                tracked.handler.cancel()
        shell.wake_all()
        if left:
            await asyncio.wait(left, timeout=30.0)
        for task in list(self._jobs):  # the heartbeat, and anything abandoned
            task.cancel()
        await asyncio.gather(*self._jobs, return_exceptions=True)
        await shell.drain_parked()
        await shell.writer.drain()
        await shell.clients.close()
        await shell.pool.close()
        await shell.redis.aclose()
        return before - len(left), len(left)

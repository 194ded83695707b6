"""Grouped fenced writes for the jobs in flight in one process.

Holds, starts, finishes and deferrals are gathered by kind and written as one statement each
(one commit), every row still fenced by its own lease token: a row whose token no longer
matches is refused alone, never the group. A row waits at most its kind's linger after it
arrives, or until the statement of its kind in flight is done, whichever is later: each kind
has at most one statement in flight (group commit), so the busier the process, the larger each
statement, and no write waits on a timer while the database is idle.

Holds and starts linger ``linger`` (``HARVEST_WRITE_LINGER_MS``): a job that holds its key
writes its start before its call, so a start's wait is a key's idle time, and a held job goes on
to its gate. A finish lingers a fiftieth of its handler's run time (:data:`SETTLE_SHARE`), at
least ``linger`` and at most ``settle`` (``HARVEST_SETTLE_LINGER_MS``); deferrals ``settle``. No
key waits on them (a finish comes after its key is given back), and a job that ran for seconds
loses nothing by being recorded milliseconds later, while the process and Postgres write fewer
statements and commits. A job that ran for a millisecond is recorded as before: what waits while
a statement runs goes right after it (at 4,000 no-op jobs a second, a 20 ms linger for every
finish kept a fifth of the in-flight window full of jobs already done). Measured in the huge
goodput case (243 jobs/s a process, calls of 2 s): group commit alone wrote 2 to 3 rows a
statement, more than one statement a job.

A statement that fails for a transient reason (a restart, a terminated backend, a deadlock) is
retried with backoff for up to ``patience`` seconds; one that fails for a row's data is split
so that only that row fails. A crash loses at most the writes gathered and not yet committed:
their jobs keep their leases, which expire, and rescue takes them back exactly as it does a
single job's.
"""

from __future__ import annotations

import asyncio
import logging
from collections import Counter
from collections.abc import Callable, Sequence
from typing import Any

import psycopg
from psycopg_pool import AsyncConnectionPool

from harvest.execution import patience, sql

log = logging.getLogger("harvest.writer")

MAX_ROWS = 500  # rows of one statement
SETTLE_SHARE = 0.02  # of a handler's run time its finish may wait to share a statement
BUMP_EVERY = 1.0  # seconds between counter writes


class _Kind:
    """How one kind of write is grouped into a statement and read back per row."""

    def __init__(
        self,
        build: Callable[[Sequence[Any]], sql.Query[Any]],
        pick: Callable[[Any, Any], Any],
        linger: float,
    ) -> None:
        self.build, self.pick, self.linger = build, pick, linger
        self.waiting: list[tuple[Any, asyncio.Future[Any]]] = []
        self.due = 0.0  # loop time: when what waits must go (the earliest of its rows' lingers)
        self.timer: asyncio.TimerHandle | None = None
        self.busy = False  # a statement of this kind is in flight


class Writer:
    def __init__(
        self,
        pool: AsyncConnectionPool[Any],
        *,
        ttl: float,
        worker: str,
        linger: float,
        patience: float,
        settle: float | None = None,
    ) -> None:
        self.pool = pool
        self.patience, self._linger = patience, linger
        settle = linger if settle is None else settle
        self._kinds = {
            "hold": _Kind(
                lambda pairs: sql.hold(pairs, ttl=ttl),
                lambda found, pair: found.get(pair[0]),
                linger,
            ),
            "start": _Kind(
                lambda pairs: sql.start(pairs, ttl=ttl, worker=worker),
                lambda found, pair: found.get(pair[0]),
                linger,
            ),
            "finish": _Kind(sql.finish, lambda found, row: row.job_id in found, settle),
            "defer": _Kind(sql.defer, lambda found, row: row.job_id in found, settle),
        }
        self._counts: Counter[str] = Counter()
        self._tasks: set[asyncio.Task[None]] = set()
        self._bump_scheduled = False
        self._draining = False  # shutdown: nothing lingers
        self.statements = 0  # written so far (for tests and the log)
        self.rows = 0

    async def hold(self, pair: sql.Pair) -> sql.Held | None:
        """Take a delivered job (None: a duplicate or stale delivery, not ours to run)."""
        return await self._submit("hold", pair)  # type: ignore[no-any-return]

    async def start(self, pair: sql.Pair) -> sql.StartResult | None:
        return await self._submit("start", pair)  # type: ignore[no-any-return]

    async def finish(self, row: sql.Finish, ran: float = 0.0) -> bool:
        """The attempt's fenced ending. It gathers with others for :data:`SETTLE_SHARE` of
        ``ran`` (the seconds its handler ran), at least the write linger and at most the settle
        linger: a call of seconds can wait milliseconds for company, a short job cannot."""
        settle = self._kinds["finish"].linger
        linger = min(settle, max(self._linger, ran * SETTLE_SHARE))
        return bool(await self._submit("finish", row, linger))

    async def defer(self, row: sql.Defer) -> bool:
        return bool(await self._submit("defer", row))

    def bump(self, name: str, n: int = 1) -> None:
        """Add to a counter; counters are written together about once a second."""
        self._counts[name] += n
        if not self._bump_scheduled:
            self._bump_scheduled = True
            asyncio.get_running_loop().call_later(BUMP_EVERY, self._flush_counts)

    async def run(self, query: sql.Query[Any]) -> Any:
        """One statement on a pooled connection, retried while the failure is transient
        (:mod:`~harvest.execution.patience`)."""
        waits = patience.pauses(self.patience)
        while True:
            conn = None
            try:
                async with self.pool.connection() as conn:
                    return await sql.arun(conn, query)
            except psycopg.OperationalError as exc:
                pause = next(waits, None) if patience.worth_retrying(exc, conn) else None
                if pause is None:
                    raise
                patience.retrying(exc, pause)
                await asyncio.sleep(pause)

    async def drain(self) -> None:
        """Write everything gathered (shutdown)."""
        self._draining = True
        for name in self._kinds:
            self._flush(name)
        self._flush_counts()
        while self._tasks:
            await asyncio.gather(*list(self._tasks), return_exceptions=True)

    def _submit(self, name: str, item: Any, linger: float | None = None) -> asyncio.Future[Any]:
        kind = self._kinds[name]
        loop = asyncio.get_running_loop()
        future: asyncio.Future[Any] = loop.create_future()
        due = loop.time() + (kind.linger if linger is None else linger)
        kind.due = min(kind.due, due) if kind.waiting else due
        kind.waiting.append((item, future))
        if len(kind.waiting) >= MAX_ROWS or self._draining:
            self._flush(name)
        elif not kind.busy:
            self._schedule(name, kind)
        return future

    def _schedule(self, name: str, kind: _Kind) -> None:
        """Flush ``kind`` when it is due (now, if it is), unless a timer goes sooner."""
        loop = asyncio.get_running_loop()
        if kind.due <= loop.time():
            self._flush(name)
        elif kind.timer is None or kind.due < kind.timer.when():
            if kind.timer is not None:
                kind.timer.cancel()
            kind.timer = loop.call_at(kind.due, self._flush, name)

    def _flush(self, name: str) -> None:
        kind = self._kinds[name]
        if kind.timer is not None:
            kind.timer.cancel()
            kind.timer = None
        if kind.busy or not kind.waiting:
            return  # the statement in flight writes these next
        batch, kind.waiting = kind.waiting[:MAX_ROWS], kind.waiting[MAX_ROWS:]
        kind.due = asyncio.get_running_loop().time()  # what is left of a full statement goes next
        kind.busy = True
        self._spawn(self._write_then_next(name, kind, batch))

    def _next(self, name: str) -> None:
        """After a statement of a kind: what waits goes once a row of it has waited its
        linger (at once when one has: the statement took longer than that)."""
        kind = self._kinds[name]
        if not kind.waiting:
            return
        if len(kind.waiting) >= MAX_ROWS or self._draining:
            self._flush(name)
        else:
            self._schedule(name, kind)

    async def _write_then_next(
        self, name: str, kind: _Kind, batch: list[tuple[Any, asyncio.Future[Any]]]
    ) -> None:
        try:
            await self._write(kind, batch)
        finally:
            kind.busy = False
            self._next(name)

    def _flush_counts(self) -> None:
        self._bump_scheduled = False
        counts, self._counts = self._counts, Counter()
        if counts:
            self._spawn(self._write_counts(counts))

    def _spawn(self, coro: Any) -> None:
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _write(self, kind: _Kind, batch: list[tuple[Any, asyncio.Future[Any]]]) -> None:
        try:
            found = await self.run(kind.build([item for item, _ in batch]))
        except psycopg.Error as exc:
            if len(batch) > 1 and not isinstance(exc, psycopg.OperationalError):
                for one in batch:  # a row's data broke the statement: find it, alone
                    await self._write(kind, [one])
                return
            for _, future in batch:
                if not future.done():
                    future.set_exception(exc)
            return
        self.statements += 1
        self.rows += len(batch)
        for item, future in batch:
            if not future.done():
                future.set_result(kind.pick(found, item))

    async def _write_counts(self, counts: Counter[str]) -> None:
        try:
            await self.run(sql.bump(counts))
        except psycopg.Error as exc:
            log.warning("counters not written (%s): %s", type(exc).__name__, dict(counts))

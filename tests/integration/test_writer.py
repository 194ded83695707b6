"""The grouped writer of an execution process's event loop, against a real Postgres: what
gathers how long, and that shutdown waits for nothing."""

from __future__ import annotations

import asyncio
import time
import uuid
from typing import Any

from psycopg_pool import AsyncConnectionPool
from sqlalchemy import Engine, text

from harvest.db import connect_options
from harvest.execution import sql
from harvest.execution.writer import Writer
from harvest.settings import Settings
from tests.helpers import dispatched, succeeded


async def _with_writer(settings: Settings, settle: float, body: Any) -> Any:
    pool: AsyncConnectionPool[Any] = AsyncConnectionPool(
        settings.psycopg_url,
        min_size=1,
        max_size=2,
        kwargs={"autocommit": True, **connect_options(settings, generic_plans=True)},
        open=False,
    )
    await pool.open(wait=True)
    try:
        writer = Writer(pool, ttl=30.0, worker="w", linger=0.002, settle=settle, patience=5.0)
        return await body(writer)
    finally:
        await pool.close()


async def _started(writer: Writer, jobs: list[sql.Pair]) -> None:
    for started in await asyncio.gather(*(writer.start(pair) for pair in jobs)):
        assert started is not None


def test_finishes_of_long_calls_that_come_within_the_settle_linger_share_one_statement(
    clean_db: Engine, migrated: Settings
) -> None:
    jobs = dispatched(clean_db, 5)

    async def body(writer: Writer) -> tuple[list[bool], int, float]:
        await _started(writer, jobs)
        before = writer.written.statements
        began = time.monotonic()
        futures = []
        for pair in jobs:  # 30 ms apart: each would be a statement of its own at 2 ms
            futures.append(asyncio.ensure_future(writer.finish(succeeded(pair), ran=60.0)))
            await asyncio.sleep(0.03)
        recorded = await asyncio.gather(*futures)
        return recorded, writer.written.statements - before, time.monotonic() - began

    recorded, statements, took = asyncio.run(_with_writer(migrated, 0.3, body))
    assert all(recorded)  # every job finished, each by its own token
    assert statements == 1
    assert took >= 0.3  # the first waited the settle linger (a fiftieth of 60 s is more)


def test_a_short_job_is_not_held_by_the_settle_linger(clean_db: Engine, migrated: Settings) -> None:
    jobs = dispatched(clean_db, 3)

    async def body(writer: Writer) -> float:
        await _started(writer, jobs)
        began = time.monotonic()
        await writer.hold(jobs[0])  # a hold goes at the write linger
        await writer.finish(succeeded(jobs[1]), ran=0.001)  # so does a short job's finish
        await writer.finish(succeeded(jobs[2]), ran=50.0)  # a fiftieth of 50 s: 1 s, under 30 s
        return time.monotonic() - began

    took = asyncio.run(_with_writer(migrated, 30.0, body))
    assert 1.0 <= took < 5.0


def test_shutdown_writes_what_lingers_at_once(clean_db: Engine, migrated: Settings) -> None:
    (pair,) = dispatched(clean_db, 1)

    async def body(writer: Writer) -> tuple[bool, float]:
        await _started(writer, [pair])
        finishing = asyncio.ensure_future(writer.finish(succeeded(pair), ran=3600.0))
        await asyncio.sleep(0.05)
        began = time.monotonic()
        await writer.drain()
        return await finishing, time.monotonic() - began

    recorded, took = asyncio.run(_with_writer(migrated, 30.0, body))
    assert recorded and took < 5.0
    with clean_db.connect() as conn:
        status = conn.execute(
            text("SELECT status FROM harvest_jobs WHERE id = :id"), {"id": pair[0]}
        )
        assert status.scalar_one() == "succeeded"


def test_a_grouped_finish_rolled_back_to_break_a_deadlock_is_tried_again(
    clean_db: Engine, migrated: Settings, caplog: Any
) -> None:
    """The asyncio shell's twin of the blocking shell's deadlock test: a grouped finish of two
    jobs meets a transaction that locks their rows the other way round (as the process's
    heartbeat can); Postgres rolls the finish back, and the writer tries it again."""
    import threading

    import psycopg

    jobs = dispatched(clean_db, 2)
    first, second = sorted(jobs)
    other = psycopg.connect(migrated.psycopg_url)
    other.execute("SET deadlock_timeout = '30s'")  # the writer's check finds the cycle first

    async def body(writer: Writer) -> set[int]:
        await _started(writer, jobs)
        other.execute("UPDATE harvest_jobs SET attempts = attempts WHERE id = %s", (second[0],))

        def lock_first_later() -> None:
            time.sleep(0.3)  # the finish holds the first row and waits for the second
            other.execute("UPDATE harvest_jobs SET attempts = attempts WHERE id = %s", (first[0],))
            other.commit()

        locker = threading.Thread(target=lock_first_later)
        locker.start()
        finished = await writer.run(sql.finish([succeeded(first), succeeded(second)]))
        await asyncio.to_thread(locker.join, 15)
        return set(finished)

    try:
        finished = asyncio.run(_with_writer(migrated, 0.02, body))
    finally:
        other.close()
    assert finished == {first[0], second[0]}
    with clean_db.connect() as conn:
        ids = [pair[0] for pair in jobs]
        statuses = conn.execute(
            text("SELECT status FROM harvest_jobs WHERE id = ANY(:ids)"), {"ids": ids}
        ).scalars()
        assert set(statuses) == {"succeeded"}
    assert any("DeadlockDetected" in r.getMessage() for r in caplog.records)


def test_a_job_delivered_twice_at_once_is_held_and_started_once(
    clean_db: Engine, migrated: Settings
) -> None:
    """The message a rescue made stale (its old token) and the job's new one, then a second
    copy of the new one, come to the loop together: each kind's rows of one job go in separate
    statements, so only the current token holds it and only one delivery starts it."""
    ((job, token),) = dispatched(clean_db, 1)
    stale = (job, uuid.uuid4())

    async def body(writer: Writer) -> tuple[list[bool], list[bool]]:
        held = await asyncio.gather(writer.hold(stale), writer.hold((job, token)))
        started = await asyncio.gather(
            writer.start(stale), writer.start((job, token)), writer.start((job, token))
        )
        return [h is not None for h in held], [s is not None for s in started]

    held, started = asyncio.run(_with_writer(migrated, 0.02, body))
    assert held == [False, True]
    assert started == [False, True, False]

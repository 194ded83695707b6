"""The grouped writer of a ``-P threads`` / ``-P gevent`` process, against a real Postgres: the
writes of many threads share statements, each row keeps its own fenced answer, a row that breaks
a statement fails alone, and a failure that is not Postgres's leaves no thread waiting."""

from __future__ import annotations

import threading
import time
import uuid
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import psycopg
import pytest
from psycopg_pool import ConnectionPool
from sqlalchemy import Engine, text

from harvest.execution import sql
from harvest.execution.thread_writer import ThreadWriter
from harvest.models import JobStatus
from harvest.settings import Settings
from tests.helpers import dispatched, statuses, succeeded

THREADS = 32


def _writer(pool: ConnectionPool[Any], *, linger: float = 0.002) -> ThreadWriter:
    def run(query: sql.Query[Any]) -> Any:
        with pool.connection() as conn:
            return sql.run(conn, query)

    return ThreadWriter(run, ttl=30.0, worker="w", linger=linger, settle=0.02)


def _pool(settings: Settings) -> ConnectionPool[Any]:
    return ConnectionPool(
        settings.psycopg_url, min_size=1, max_size=4, kwargs={"autocommit": True}, open=True
    )


def _at_once(n: int, fn: Callable[[int], Any]) -> list[Any]:
    """``fn(0..n-1)``, each in its own thread, all let go together."""
    gate = threading.Barrier(n)

    def one(i: int) -> Any:
        gate.wait()
        return fn(i)

    with ThreadPoolExecutor(n) as threads:
        return list(threads.map(one, range(n)))


def test_the_starts_and_finishes_of_many_threads_share_statements(
    clean_db: Engine, migrated: Settings
) -> None:
    jobs = dispatched(clean_db, THREADS)
    with _pool(migrated) as pool:
        writer = _writer(pool)

        def life(i: int) -> tuple[bool, bool]:
            started = writer.start(jobs[i])
            return started is not None, writer.finish(succeeded(jobs[i]), ran=0.001)

        answers = _at_once(THREADS, life)
    assert answers == [(True, True)] * THREADS  # each job started and finished by its token
    assert statuses(clean_db, [pair[0] for pair in jobs]) == {"succeeded": THREADS}
    # 64 writes; one statement each without grouping. Started together, they gather behind
    # the statement in flight of their kind.
    assert writer.written.rows == 2 * THREADS
    assert writer.written.statements <= 16, writer.written.statements


def test_a_row_whose_lease_was_taken_is_refused_alone(clean_db: Engine, migrated: Settings) -> None:
    jobs = dispatched(clean_db, THREADS)
    with _pool(migrated) as pool:
        writer = _writer(pool, linger=0.05)  # long enough that all of them share a statement
        for pair in jobs:
            assert writer.start(pair) is not None
        stale = jobs[7]
        with clean_db.begin() as conn:  # rescued and taken by another worker meanwhile
            conn.execute(
                text("UPDATE harvest_jobs SET lease_token = :t WHERE id = :id"),
                {"t": str(uuid.uuid4()), "id": stale[0]},
            )
        before = writer.written.statements
        recorded = _at_once(THREADS, lambda i: writer.finish(succeeded(jobs[i]), ran=0.001))
    assert recorded == [pair != stale for pair in jobs]
    assert writer.written.statements - before <= 2
    assert statuses(clean_db, [pair[0] for pair in jobs]) == {
        "succeeded": THREADS - 1,
        "running": 1,
    }


def test_a_job_delivered_twice_at_once_is_started_once(
    clean_db: Engine, migrated: Settings
) -> None:
    """Four deliveries of one job start in the same linger: twice the message a rescue made
    stale (its old token), twice the current one (a redelivery). One starts it, with the
    current token. (Seen on -P gevent: both copies shared a statement, Postgres updated the row
    once for the two, both read as started, and the job ran twice.)"""
    ((job, token),) = dispatched(clean_db, 1)
    stale = (job, uuid.uuid4())
    deliveries = [stale, (job, token), stale, (job, token)]
    with _pool(migrated) as pool:
        writer = _writer(pool, linger=0.05)  # long enough that all four would share a statement
        started = _at_once(4, lambda i: writer.start(deliveries[i]))
    assert [i for i, s in enumerate(started) if s is not None] in ([1], [3])
    with clean_db.connect() as conn:
        attempts = conn.execute(
            text("SELECT attempts FROM harvest_jobs WHERE id = :id"), {"id": job}
        )
        assert attempts.scalar_one() == 1


def test_a_row_that_breaks_the_statement_fails_alone(clean_db: Engine, migrated: Settings) -> None:
    jobs = dispatched(clean_db, 8)
    with _pool(migrated) as pool:
        writer = _writer(pool, linger=0.05)
        for pair in jobs:
            assert writer.start(pair) is not None

        def finish(i: int) -> Any:
            row = succeeded(jobs[i])
            if i == 3:  # not JSON: the whole statement fails on it
                row = sql.Finish(row.job_id, row.token, JobStatus.SUCCEEDED, result_json="{oops")
            try:
                return writer.finish(row, ran=0.001)
            except psycopg.Error as exc:
                return type(exc).__name__

        answers = _at_once(8, finish)
    assert answers[3] == "InvalidTextRepresentation"
    assert answers[:3] + answers[4:] == [True] * 7
    assert statuses(clean_db, [pair[0] for pair in jobs]) == {"succeeded": 7, "running": 1}


def test_a_failure_that_is_not_postgres_s_reaches_every_waiting_thread(
    clean_db: Engine, migrated: Settings
) -> None:
    jobs = dispatched(clean_db, 8)
    calls = 0

    def broken(query: sql.Query[Any]) -> Any:
        nonlocal calls
        calls += 1
        time.sleep(0.05)  # the others gather behind it
        raise RuntimeError("the connection pool is closed")

    writer = ThreadWriter(broken, ttl=30.0, worker="w", linger=0.002, settle=0.02)

    def start(i: int) -> str:
        with pytest.raises(RuntimeError, match="pool is closed"):
            writer.start(jobs[i])
        return "raised"

    began = time.monotonic()
    assert _at_once(8, start) == ["raised"] * 8  # none left waiting for an answer
    assert time.monotonic() - began < 5
    assert calls <= 3


class _Stopped(BaseException):
    """Not an Exception: as gevent.Timeout or KeyboardInterrupt reach a thread."""


def test_a_leader_interrupted_mid_statement_leaves_no_thread_waiting_and_the_kind_usable(
    clean_db: Engine, migrated: Settings
) -> None:
    jobs = dispatched(clean_db, 9)
    with _pool(migrated) as pool:
        real = _writer(pool)._run
        calls = 0

        def interrupted_once(query: sql.Query[Any]) -> Any:
            nonlocal calls
            calls += 1
            if calls == 1:
                time.sleep(0.05)  # the others gather behind it
                raise _Stopped()
            return real(query)

        writer = ThreadWriter(interrupted_once, ttl=30.0, worker="w", linger=0.002, settle=0.02)

        def start(i: int) -> str:
            try:
                return "started" if writer.start(jobs[i]) is not None else "refused"
            except _Stopped:
                return "stopped"  # the leader itself
            except RuntimeError as exc:
                return type(exc).__name__  # Interrupted: the rows of its statement

        answers = _at_once(8, start)
        assert answers.count("stopped") == 1
        assert set(answers) <= {"stopped", "Interrupted", "started"}
        assert writer.start(jobs[8]) is not None  # the kind has a leader again


def test_a_thread_pool_process_writes_its_threads_jobs_together(
    jobs_app: Callable[..., Any], clean_db: Engine
) -> None:
    """What the Celery task does, in 16 threads of one process as ``-P threads -c 16`` runs it:
    16 messages of one job each (50 ms). Each job is held, started and finished; the threads'
    writes of a kind share statements. A prefork child (one thread) pairs each job's end with
    the next one's start instead."""
    from harvest.runner import Runner
    from tests.helpers import body, claim_all

    app = jobs_app()
    ids = [app.enqueue("sleepy", {"seconds": 0.05}).id for _ in range(16)]
    claimed = claim_all(clean_db)
    threads = Runner(app, pool="threads", concurrency=16)
    try:
        assert isinstance(threads.sync.writer, ThreadWriter)
        counts = _at_once(16, lambda i: threads.execute(body([claimed[i]])))
        written = threads.sync.writer.written
    finally:
        threads.close()
    assert sum(c["started"] for c in counts) == 16
    assert statuses(clean_db, ids) == {"succeeded": 16}
    assert written.rows == 3 * 16  # a hold, a start and a finish each
    assert written.statements <= 12, written.statements  # 48 one at a time
    prefork = Runner(app)
    try:
        assert not prefork.sync.writer.grouped
    finally:
        prefork.close()

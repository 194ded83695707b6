"""Grouped fenced writes lock their rows in one order (the jobs' ids), whatever order the jobs
came in: two of them sharing rows wait for each other instead of deadlocking. Against a real
Postgres: another transaction holds the lower row, the grouped statement (given the rows high
first) starts, then the other transaction takes the higher row too. Locking in the order given,
the statement held the higher row already and Postgres found a deadlock."""

from __future__ import annotations

import threading
import time
import uuid
from collections.abc import Callable, Iterator
from typing import Any

import psycopg
import pytest
from sqlalchemy import text

from harvest.app import Harvest
from harvest.execution import sql
from harvest.models import JobStatus
from harvest.settings import Settings


@pytest.fixture
def app(own_database: Settings) -> Iterator[Harvest]:
    harvest = Harvest(own_database)
    yield harvest
    harvest.close()


def _rows(app: Harvest, status: str, n: int) -> list[sql.Pair]:
    with app.engine.begin() as conn:
        # A table of some size, its statistics known: the plan a worker's statements get (each
        # row found by its id, in the arrays' order), not the hash join of a near-empty table.
        conn.execute(
            text(
                "INSERT INTO harvest_jobs (name, status, finished_at) "
                "SELECT 'lock.order', 'succeeded', now() FROM generate_series(1, 20000)"
            )
        )
        rows = conn.execute(
            text(
                "INSERT INTO harvest_jobs (name, status, lease_token, dispatched_at, "
                "lease_expires_at, started_at) SELECT 'lock.order', :s, gen_random_uuid(), "
                "now(), now() + interval '60 seconds', now() FROM generate_series(1, :n) "
                "RETURNING id, lease_token"
            ),
            {"s": status, "n": n},
        ).all()
    with app.engine.connect() as conn:
        conn.execution_options(isolation_level="AUTOCOMMIT").execute(text("ANALYZE harvest_jobs"))
    return sorted((int(r.id), uuid.UUID(str(r.lease_token))) for r in rows)


def _heartbeat(pairs: list[sql.Pair]) -> sql.Query[Any]:
    return sql.heartbeat(pairs, ttl=60.0)


def _finish(pairs: list[sql.Pair]) -> sql.Query[Any]:
    return sql.finish([sql.Finish(i, t, JobStatus.SUCCEEDED, "1") for i, t in pairs])


def _defer(pairs: list[sql.Pair]) -> sql.Query[Any]:
    return sql.defer([sql.Defer(i, t, 1.0, started=True) for i, t in pairs])


def _waits(conn: psycopg.Connection[Any], pid: int) -> bool:
    row = conn.execute(
        "SELECT wait_event_type FROM pg_stat_activity WHERE pid = %s", (pid,)
    ).fetchone()
    return row is not None and row[0] == "Lock"


@pytest.mark.parametrize(
    "grouped", [_heartbeat, _finish, _defer], ids=["heartbeat", "finish", "defer"]
)
def test_a_grouped_write_waits_for_rows_it_shares_instead_of_deadlocking(
    app: Harvest, own_database: Settings, grouped: Callable[[list[sql.Pair]], sql.Query[Any]]
) -> None:
    low, high = _rows(app, "running", 2)
    url = own_database.psycopg_url
    with (
        psycopg.connect(url, autocommit=True) as watch,
        psycopg.connect(url) as other,
        psycopg.connect(url) as writer,
    ):
        other.execute("SET deadlock_timeout = '100ms'")  # the cycle, if any, is found here
        other.execute("SELECT 1 FROM harvest_jobs WHERE id = %s FOR UPDATE", (low[0],))
        outcome: list[object] = []

        def write() -> None:
            try:
                outcome.append(sql.run(writer, grouped([high, low])))  # high first, as given
                writer.commit()
            except BaseException as exc:
                outcome.append(exc)

        thread = threading.Thread(target=write)
        thread.start()
        deadline = time.monotonic() + 10
        while not _waits(watch, writer.info.backend_pid) and time.monotonic() < deadline:
            time.sleep(0.02)
        assert _waits(watch, writer.info.backend_pid), "the grouped write never waited"
        # Taking the higher row too: it is free (the write waits for the lower one first).
        other.execute("SELECT 1 FROM harvest_jobs WHERE id = %s FOR UPDATE", (high[0],))
        other.commit()
        thread.join(10)
    assert len(outcome) == 1 and not isinstance(outcome[0], BaseException), outcome
    written = outcome[0]
    assert {low[0], high[0]} <= set(written)  # type: ignore[call-overload]

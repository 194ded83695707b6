"""A job's write waits out a short Postgres outage instead of failing: a finish given up too
soon leaves its job held until rescue runs its call again. The blocking shell's statements,
against a real Postgres whose database refuses connections for a while (its backends cut)."""

from __future__ import annotations

import threading
import time
import uuid
from collections.abc import Iterator

import pytest
from sqlalchemy import text

from harvest.app import Harvest
from harvest.execution import core, sql
from harvest.execution.sync_shell import SyncShell
from harvest.models import JobStatus
from harvest.settings import Settings
from tests.conftest import close_database


@pytest.fixture
def app(own_database: Settings) -> Iterator[Harvest]:
    harvest = Harvest(own_database)
    yield harvest
    harvest.close()


def _shell(app: Harvest, lease_ttl: float) -> SyncShell:
    plan = core.Plan(worker="test:1", key_wait=1.0, unknown_job_grace=60.0, retry_base=1.0,
                     lease_ttl=lease_ttl)  # fmt: skip
    return SyncShell(app, plan)


def _dispatched(app: Harvest) -> sql.Pair:
    with app.engine.begin() as conn:
        row = conn.execute(
            text(
                "INSERT INTO harvest_jobs (name, status, lease_token, dispatched_at, "
                "lease_expires_at) VALUES ('patience.test', 'dispatched', gen_random_uuid(), "
                "now(), now() + interval '60 seconds') RETURNING id, lease_token"
            )
        ).one()
    return (int(row.id), uuid.UUID(str(row.lease_token)))


def _running(app: Harvest, shell: SyncShell) -> sql.Pair:
    pair = _dispatched(app)
    assert shell.db(sql.start([pair], ttl=60.0, worker="test:1")).get(pair[0]) is not None
    return pair


def _status(app: Harvest, job_id: int) -> str:
    with app.engine.connect() as conn:
        return str(
            conn.execute(
                text("SELECT status FROM harvest_jobs WHERE id = :i"), {"i": job_id}
            ).scalar_one()
        )


def test_a_finish_during_a_postgres_outage_lands_when_postgres_answers_again(
    app: Harvest, own_database: Settings, caplog: pytest.LogCaptureFixture
) -> None:
    shell = _shell(app, lease_ttl=30.0)  # tries for 15 s
    pair = _running(app, shell)
    name = own_database.database_url.rsplit("/", 1)[1]
    close_database(name, closed=True)  # every connection of the pool cut; no new one
    reopen = threading.Timer(1.5, close_database, (name, False))
    reopen.start()
    began = time.monotonic()
    try:
        finished = shell.db(sql.finish([sql.Finish(*pair, JobStatus.SUCCEEDED, "1")]))
    finally:
        reopen.join()
    assert pair[0] in finished  # recorded, by its own token
    assert time.monotonic() - began >= 1.0  # it waited for Postgres rather than failing
    assert _status(app, pair[0]) == "succeeded"
    assert any("write failed" in r.getMessage() for r in caplog.records)


def test_a_write_gives_up_after_half_the_lease_and_says_what_failed(
    app: Harvest, own_database: Settings
) -> None:
    shell = _shell(app, lease_ttl=1.0)  # tries for 0.5 s: past it the lease may be gone
    pair = _running(app, shell)
    name = own_database.database_url.rsplit("/", 1)[1]
    close_database(name, closed=True)
    began = time.monotonic()
    try:
        with pytest.raises(Exception, match="not currently accepting connections") as raised:
            shell.db(sql.finish([sql.Finish(*pair, JobStatus.SUCCEEDED, "1")]))
        took = time.monotonic() - began
    finally:
        close_database(name, closed=False)
    assert 0.3 <= took < 5.0, took  # the last try starts within the 0.5 s
    assert "OperationalError" in type(raised.value).__name__
    assert _status(app, pair[0]) == "running"  # nothing half-written: rescue's to take back


def test_a_write_rolled_back_to_break_a_deadlock_is_tried_again(
    app: Harvest, own_database: Settings, caplog: pytest.LogCaptureFixture
) -> None:
    """As seen in CI: a job's finish and the next job's start (one statement, two rows) met the
    process's heartbeat, which extends every lease in flight in one statement and locked the
    two rows the other way round. Postgres broke the deadlock by rolling the finish back; the
    shell gave it up, the job's lease expired and rescue ran its handler a second time. Here
    another transaction takes the rows in the heartbeat's order (its deadlock check set late,
    so that the shell's statement is the one rolled back); the finish and start must land."""
    import psycopg

    shell = _shell(app, lease_ttl=30.0)
    ending, nxt = _running(app, shell), _dispatched(app)
    url = own_database.psycopg_url
    with psycopg.connect(url) as other:
        other.execute("SET deadlock_timeout = '30s'")  # the shell's check finds the cycle first
        other.execute("UPDATE harvest_jobs SET attempts = attempts WHERE id = %s", (nxt[0],))
        result: list[object] = []

        def write() -> None:
            query = sql.finish_then_start(
                [sql.Finish(*ending, JobStatus.SUCCEEDED, "1")], [nxt], ttl=60.0, worker="test:1"
            )
            try:
                result.append(shell.db(query))
            except BaseException as exc:
                result.append(exc)

        writer = threading.Thread(target=write)
        writer.start()
        time.sleep(0.3)  # the shell holds the ending job's row and waits for the next one's
        other.execute("UPDATE harvest_jobs SET attempts = attempts WHERE id = %s", (ending[0],))
        other.commit()
        writer.join(15)
    assert len(result) == 1 and not isinstance(result[0], BaseException), result
    finished, started = result[0]  # type: ignore[misc]
    assert ending[0] in finished and nxt[0] in started
    assert _status(app, ending[0]) == "succeeded" and _status(app, nxt[0]) == "running"
    assert any("DeadlockDetected" in r.getMessage() for r in caplog.records)

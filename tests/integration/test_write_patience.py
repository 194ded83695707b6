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


def _running(app: Harvest, shell: SyncShell) -> sql.Pair:
    with app.engine.begin() as conn:
        row = conn.execute(
            text(
                "INSERT INTO harvest_jobs (name, status, lease_token, dispatched_at, "
                "lease_expires_at) VALUES ('patience.test', 'dispatched', gen_random_uuid(), "
                "now(), now() + interval '60 seconds') RETURNING id, lease_token"
            )
        ).one()
    pair = (int(row.id), uuid.UUID(str(row.lease_token)))
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

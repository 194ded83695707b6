"""Rows written around enqueue's checks (by hand, an older version, another client) holding
values Python cannot read: the claim skips them and fails them with the reason, and every
reader lists them (issue 13). The same with real workers: tests/processes/test_poison_rows.py."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from sqlalchemy import Engine, text

from harvest import store
from harvest.app import Harvest
from harvest.dispatcher import rescue
from harvest.models import JobStatus
from harvest.settings import Settings

TOO_EARLY = "0001-12-31 00:01:00+00 BC"
INSERT = text(
    """
    INSERT INTO harvest_jobs (name, queue, payload, priority, run_at, max_attempts, timeout,
                              status, created_at)
    VALUES ('echo', 'execution', CAST(:payload AS jsonb), :priority,
            CAST(:run_at AS timestamptz), 3, 30, :status, CAST(:created_at AS timestamptz))
    RETURNING id
    """
)


@pytest.fixture
def app(migrated: Settings, clean_db: Engine, redis_client: object) -> Iterator[Harvest]:
    harvest = Harvest(migrated)
    harvest.load_imports(["tests.jobs"])
    yield harvest
    harvest.close()


def insert(engine: Engine, **values: object) -> int:
    row = {"payload": "{}", "priority": 0, "run_at": TOO_EARLY, "status": "pending"}
    row |= {"created_at": "2024-01-01 00:00:00+00"} | values
    with engine.begin() as conn:
        return int(conn.execute(INSERT, row).scalar_one())


def test_the_claim_skips_a_row_it_cannot_read_and_quarantine_fails_it(
    app: Harvest, clean_db: Engine
) -> None:
    bad = insert(clean_db, priority=1000)  # first in claim order: oldest and highest
    good = app.enqueue_many("echo", [{"value": i} for i in range(3)])
    with clean_db.begin() as conn:
        claimed = store.claim_due(conn, limit=10, ttl=60, starvation_after=1.0)
    assert sorted(c.id for c in claimed) == good  # the bad row neither claimed nor raising
    with clean_db.begin() as conn:
        done = store.quarantine_pending(conn)
        assert [(q.id, q.name) for q in done] == [(bad, "echo")]
        assert store.quarantine_pending(conn) == []  # once
        assert store.counters(conn)[store.QUARANTINED] == 1
    job = app.get(bad)
    assert job.status is JobStatus.FAILED and job.run_at is None and job.finished_at is not None
    assert job.last_error == (
        f"quarantined: run_at {TOO_EARLY} is outside the times harvest can read (years 1 to 9999)"
    )


def test_rescue_quarantines_a_row_handed_back_to_pending(app: Harvest, clean_db: Engine) -> None:
    bad = insert(clean_db, run_at="infinity")
    assert rescue(app).requeued == 0
    assert app.get(bad).status is JobStatus.FAILED


def test_readers_list_unreadable_rows_and_quarantine_unfinished_ones(
    app: Harvest, clean_db: Engine
) -> None:
    huge = "1" + "0" * 5000  # jsonb holds it; Python's json refuses more than 4300 digits
    ended = insert(
        clean_db, status="succeeded", run_at="2024-01-01 00:00:00+00", created_at="-infinity"
    )
    odd = insert(clean_db, run_at="2024-01-01 00:00:00+00", payload=f'{{"n": {huge}}}')
    fine = app.enqueue("echo", {"value": 1}).id
    with clean_db.begin() as conn:
        jobs = {j.id: j for j in store.list_jobs(conn)}
    assert set(jobs) == {ended, odd, fine}
    # An ended row is shown as it is, its unreadable value as None (its history is kept).
    assert jobs[ended].status is JobStatus.SUCCEEDED and jobs[ended].created_at is None
    assert jobs[ended].unreadable == (
        "created_at -infinity is outside the times harvest can read (years 1 to 9999)",
    )
    # An unfinished one would jam whatever runs it next: failed, with the reason.
    assert jobs[odd].status is JobStatus.FAILED and jobs[odd].payload is None
    assert jobs[odd].last_error is not None
    assert jobs[odd].last_error.startswith("quarantined: payload cannot be read as JSON here")
    assert app.get(odd).status is JobStatus.FAILED  # kept: the reader committed it
    assert jobs[fine].unreadable == () and jobs[fine].payload == {"value": 1}
    with clean_db.begin() as conn:
        page = store.list_jobs_page(conn, status="failed")
    assert [j.id for j in page] == [odd]

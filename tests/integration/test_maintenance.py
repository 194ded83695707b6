"""Retention: finished jobs pruned after their retention in small batches that skip locked
rows (never blocking claims); dead jobs kept longer, until retried or pruned; retry of dead
jobs one by one or all at once (API and CLI)."""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

import pytest
import redis
import typer
from sqlalchemy import Engine, text
from typer.testing import CliRunner

from harvest import maintenance, store, usage
from harvest.app import Harvest
from harvest.cli_schedules import retry_command
from harvest.coordination.lock import Lock
from harvest.errors import HarvestError, InvalidOption
from harvest.settings import Settings
from harvest.usage import rows as usage_rows

DAY = 86_400


@pytest.fixture
def app(migrated: Settings, clean_db: Engine, redis_client: redis.Redis) -> Iterator[Harvest]:
    settings = migrated.model_copy(
        update={"retention_seconds": DAY, "dead_retention_seconds": 30 * DAY, "prune_batch_size": 7}
    )
    harvest = Harvest(settings, redis_client=redis_client)
    harvest.load_imports(["tests.jobs"])
    yield harvest
    harvest.close()


def add_jobs(engine: Engine, n: int, status: str, age: float, name: str = "echo") -> list[int]:
    """``n`` jobs in ``status`` that finished ``age`` seconds ago (pending ones: due then)."""
    finished = "NULL" if status in ("pending", "running") else "now() - make_interval(secs => :a)"
    with engine.begin() as conn:
        return list(
            conn.execute(
                text(
                    "INSERT INTO harvest_jobs (name, status, attempts, finished_at, run_at) "
                    f"SELECT :name, :status, 1, {finished}, now() - make_interval(secs => :a) "
                    "FROM generate_series(1, :n) RETURNING id"
                ),
                {"name": name, "status": status, "a": age, "n": n},
            ).scalars()
        )


def remaining(engine: Engine, ids: list[int]) -> int:
    """How many of ``ids`` are kept: in the jobs table or moved to the history."""
    with engine.connect() as conn:
        return int(
            conn.execute(
                text("SELECT count(*) FROM harvest_jobs_all WHERE id = ANY(:ids)"), {"ids": ids}
            ).scalar_one()
        )


def test_prune_follows_the_retention_of_each_kind(app: Harvest, clean_db: Engine) -> None:
    old_ok = add_jobs(clean_db, 30, "succeeded", 2 * DAY)
    old_cancelled = add_jobs(clean_db, 5, "cancelled", 2 * DAY)
    recent_ok = add_jobs(clean_db, 10, "succeeded", 3600)
    dead = add_jobs(clean_db, 8, "failed", 2 * DAY)
    very_dead = add_jobs(clean_db, 9, "failed", 40 * DAY)
    waiting = add_jobs(clean_db, 4, "pending", 60 * DAY)
    running = add_jobs(clean_db, 2, "running", 60 * DAY)
    with clean_db.begin() as conn:
        batch_old = conn.execute(
            text(
                "INSERT INTO harvest_batches (total, completed_at) "
                "VALUES (1, now() - interval '40 days') RETURNING id"
            )
        ).scalar_one()
        conn.execute(
            text(
                "INSERT INTO harvest_batches (total, completed_at) "
                "VALUES (1, now() - interval '1 day'), (1, NULL)"
            )
        )
        sid = conn.execute(
            text(
                "INSERT INTO harvest_schedules (name, job_name, every_seconds, next_run_at) "
                "VALUES ('s', 'tick', 60, now()) RETURNING id"
            )
        ).scalar_one()
        conn.execute(
            text(
                "INSERT INTO harvest_schedule_fires (schedule_id, fire_at) "
                "SELECT :sid, now() - make_interval(days => d, hours => -12) "
                "FROM generate_series(1, 40) AS d"
            ),
            {"sid": sid},
        )
    report = maintenance.run(app)
    assert (report.finished, report.dead, report.batches, report.fires) == (35, 9, 1, 10)
    assert report.moved == 10 + 8  # kept, and ended more than HARVEST_HISTORY_AFTER ago
    assert not report.skipped
    assert remaining(clean_db, old_ok + old_cancelled + very_dead) == 0
    assert remaining(clean_db, recent_ok) == 10
    assert remaining(clean_db, dead) == 8  # dead jobs are kept until retried or pruned
    assert remaining(clean_db, waiting + running) == 6
    with clean_db.connect() as conn:
        assert conn.execute(text("SELECT count(*) FROM harvest_batches")).scalar_one() == 2
        assert not conn.execute(
            text("SELECT 1 FROM harvest_batches WHERE id = :id"), {"id": batch_old}
        ).all()
        assert conn.execute(text("SELECT count(*) FROM harvest_schedule_fires")).scalar_one() == 30
    assert maintenance.run(app).total == 0


def test_prune_skips_locked_rows_and_never_waits(app: Harvest, clean_db: Engine) -> None:
    ids = add_jobs(clean_db, 20, "succeeded", 2 * DAY)
    add_jobs(clean_db, 5, "pending", 0)
    with clean_db.connect() as holder:
        tx = holder.begin()
        holder.execute(
            text("SELECT id FROM harvest_jobs WHERE id = ANY(:ids) FOR UPDATE"), {"ids": ids[:3]}
        )
        started = time.monotonic()
        report = maintenance.prune(app)
        assert time.monotonic() - started < 5
        assert report.finished == 17
        with app.engine.begin() as conn:  # claims are not held up either
            assert len(store.claim_due(conn, limit=10, ttl=60)) == 5
        tx.rollback()
    assert maintenance.prune(app).finished == 3


def test_one_maintenance_run_at_a_time(
    app: Harvest, clean_db: Engine, redis_client: redis.Redis
) -> None:
    add_jobs(clean_db, 3, "succeeded", 2 * DAY)
    other = Lock(redis_client, maintenance.LOCK_NAME, ttl=30)
    assert other.acquire(blocking=False)
    try:
        assert maintenance.run(app).skipped
    finally:
        other.release()
    assert maintenance.run(app).finished == 3


def test_prune_and_aging_queries_use_their_indexes(clean_db: Engine) -> None:
    # The plans are judged on rows of each kind a running system has, with statistics taken
    # of them here: an emptied table keeps what earlier tests left in its statistics, and on
    # a fresh server those made the planner read the failed jobs by status and sort them.
    add_jobs(clean_db, 2000, "succeeded", 60)
    add_jobs(clean_db, 2000, "failed", 60)
    add_jobs(clean_db, 500, "pending", 600)
    with clean_db.begin() as conn:
        conn.execute(text("ANALYZE harvest_jobs"))
    with clean_db.connect() as conn:
        conn.execute(text("SET LOCAL enable_seqscan = off"))
        conn.execute(text("SET LOCAL enable_bitmapscan = off"))
        plans = {}
        for what in ("finished", "dead"):
            plans[what] = "\n".join(
                conn.execute(
                    text("EXPLAIN " + str(store.ending._PRUNES[what])), {"age": 10, "limit": 5}
                ).scalars()
            )
        aged = "\n".join(
            conn.execute(
                text("EXPLAIN " + str(store.claim._CLAIMS[False])),
                store.claim._claim_params(5, 5, None, 300, None),
            ).scalars()
        )
    assert "harvest_jobs_finished_idx" in plans["finished"], plans["finished"]
    assert "harvest_jobs_finished_idx" in plans["dead"], plans["dead"]
    assert "harvest_jobs_age_idx" in aged, aged


# --- retry of dead jobs ---------------------------------------------------------------------


def test_retry_one_and_all_failed(app: Harvest, clean_db: Engine) -> None:
    a = add_jobs(clean_db, 12, "failed", 60, name="echo")
    b = add_jobs(clean_db, 13, "failed", 60, name="noop")
    ok = add_jobs(clean_db, 2, "succeeded", 60)
    app.retry(a[0])
    assert app.get(a[0]).status == "pending"
    with pytest.raises(HarvestError, match="is pending, not failed"):
        app.retry(a[0])
    with pytest.raises(HarvestError, match="is succeeded, not failed"):
        app.retry(ok[0])
    assert app.retry_failed(name="echo", batch_size=5) == 11
    assert app.retry_failed(name="echo") == 0
    assert app.retry_failed() == 13
    with clean_db.connect() as conn:
        rows = conn.execute(
            text("SELECT status, max_attempts, finished_at FROM harvest_jobs WHERE id = ANY(:i)"),
            {"i": a + b},
        ).all()
    assert {r.status for r in rows} == {"pending"}
    assert all(r.max_attempts >= 2 and r.finished_at is None for r in rows)


def test_cli_retry(
    app: Harvest, migrated: Settings, clean_db: Engine, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("HARVEST_DATABASE_URL", migrated.database_url)
    monkeypatch.setenv("HARVEST_REDIS_URL", migrated.redis_url)
    monkeypatch.setenv("HARVEST_IMPORTS", "tests.jobs")
    jobs_cli = typer.Typer()
    jobs_cli.command("retry")(retry_command)
    jobs_cli.command("other")(lambda: None)  # a group, as in `harvest jobs ...`
    runner = CliRunner()

    def run(*args: str) -> Any:
        return runner.invoke(jobs_cli, ["retry", *args], catch_exceptions=True)

    a = add_jobs(clean_db, 3, "failed", 60, name="echo")
    add_jobs(clean_db, 2, "failed", 60, name="noop")
    one = run(str(a[0]))
    assert one.exit_code == 0 and f"job {a[0]}: pending" in one.output
    named = run("--failed", "--name", "echo")
    assert "2 failed job(s) of echo back to pending" in named.output
    everything = run("--failed")
    assert "2 failed job(s) back to pending" in everything.output
    assert isinstance(run().exception, InvalidOption)
    assert isinstance(run(str(a[0]), "--failed").exception, InvalidOption)
    assert isinstance(run(str(a[1]), "--name", "echo").exception, InvalidOption)
    assert isinstance(run(str(a[0])).exception, HarvestError)  # pending now, not failed


def test_prune_deletes_old_usage_minutes_and_keeps_the_totals(
    app: Harvest, clean_db: Engine
) -> None:
    now = time.time()
    one = usage.call("p", 1, reported=10, reserved=0, limited=False, error=False)
    tally = usage.Tally()
    for age in (40 * DAY, 31 * DAY, 29 * DAY, 60.0):
        tally.add(one, at=now - age)
    with clean_db.begin() as conn:
        usage_rows.add(conn, tally.take())
    report = maintenance.prune(app)
    assert report.usage == 2
    with clean_db.connect() as conn:
        assert [f.requests for f in usage_rows.per_key(conn, minutes=None)] == [4]
        assert [f.requests for f in usage_rows.per_key(conn, minutes=60 * 24 * 30)] == [2]

"""The partitioned history (migration 0013): finished jobs move out of ``harvest_jobs`` into day
partitions of their kind and read back the same; their attempts go with them; a dead job is
retried or deleted from there; an idempotency key still finds its job; retention drops a day
whole, leaving nothing to vacuum; and the move never holds up a claim."""

from __future__ import annotations

from collections.abc import Iterator
from datetime import UTC, datetime, timedelta

import pytest
import redis
from sqlalchemy import Engine, text

from harvest import history, maintenance, store
from harvest.app import Harvest
from harvest.settings import Settings
from harvest.store import history_rows

DAY = 86_400


def make_app(settings: Settings, redis_client: redis.Redis, **changes: object) -> Harvest:
    update = {"retention_seconds": 10 * DAY, "dead_retention_seconds": 30 * DAY, **changes}
    harvest = Harvest(settings.model_copy(update=update), redis_client=redis_client)
    harvest.load_imports(["tests.jobs"])
    return harvest


@pytest.fixture
def app(migrated: Settings, clean_db: Engine, redis_client: redis.Redis) -> Iterator[Harvest]:
    harvest = make_app(migrated, redis_client)
    yield harvest
    harvest.close()


def ended(engine: Engine, n: int, status: str, age: float, **columns: object) -> list[int]:
    """``n`` jobs of echo that ended ``age`` seconds ago in ``status``, with a result."""
    names = ", ".join(columns)
    values = ", ".join(f":{c}" for c in columns)
    with engine.begin() as conn:
        return list(
            conn.execute(
                text(
                    "INSERT INTO harvest_jobs (name, status, attempts, payload, result, "
                    f"run_at, started_at, finished_at{', ' + names if names else ''}) "
                    "SELECT 'echo', :status, 1, jsonb_build_object('i', i), "
                    "jsonb_build_object('value', i), t, t, t"
                    f"{', ' + values if values else ''} "
                    "FROM (SELECT i, now() - make_interval(secs => :age) AS t "
                    "      FROM generate_series(1, :n) AS i) AS s RETURNING id"
                ),
                {"status": status, "age": age, "n": n, **columns},
            ).scalars()
        )


def where(engine: Engine, ids: list[int]) -> dict[str, int]:
    """Which table holds each of ``ids`` (``harvest_jobs`` or a history partition)."""
    with engine.connect() as conn:
        rows = conn.execute(
            text(
                "SELECT CAST(tableoid::regclass AS text) AS rel, count(*) AS n FROM ("
                " SELECT tableoid, id FROM harvest_jobs UNION ALL"
                " SELECT tableoid, id FROM harvest_job_history) AS j"
                " WHERE id = ANY(:ids) GROUP BY 1"
            ),
            {"ids": ids},
        ).all()
    return {r.rel: int(r.n) for r in rows}


def utc_day(age: float) -> str:
    return f"{datetime.now(UTC) - timedelta(seconds=age):%Y%m%d}"


def test_finished_jobs_move_to_their_day_and_read_back_the_same(
    app: Harvest, clean_db: Engine
) -> None:
    ok = ended(clean_db, 20, "succeeded", 2 * DAY + 60)
    dead = ended(clean_db, 5, "failed", 3 * DAY + 60)
    cancelled = ended(clean_db, 3, "cancelled", 600)
    fresh = ended(clean_db, 4, "succeeded", 30)  # within HARVEST_HISTORY_AFTER: stays
    waiting = app.enqueue("echo", {"value": 1}).id
    before = {i: app.get(i) for i in ok + dead + cancelled}
    with clean_db.connect() as conn:
        by_status = store.counts_by_status(conn)

    report = maintenance.prune(app)

    assert report.moved == 28 and report.finished == report.dead == 0
    assert where(clean_db, ok) == {f"harvest_job_history_done_{utc_day(2 * DAY + 60)}": 20}
    assert where(clean_db, dead) == {f"harvest_job_history_dead_{utc_day(3 * DAY + 60)}": 5}
    assert where(clean_db, cancelled) == {f"harvest_job_history_done_{utc_day(600)}": 3}
    assert where(clean_db, [*fresh, waiting]) == {"harvest_jobs": 5}
    # Read back exactly as before the move, one by one and in listings and counts.
    assert {i: app.get(i) for i in before} == before
    with clean_db.connect() as conn:
        assert store.counts_by_status(conn) == by_status
        listed = store.list_jobs_page(conn, status="failed", limit=10)
        assert [j.id for j in listed] == sorted(dead, reverse=True)
        assert [j.result for j in listed] == [before[i].result for i in sorted(dead, reverse=True)]
    assert maintenance.prune(app).moved == 0  # each job moves once


def test_attempts_move_with_the_job_and_come_back_on_retry(app: Harvest, clean_db: Engine) -> None:
    (job,) = ended(clean_db, 1, "running", 0)
    with clean_db.begin() as conn:  # two attempts end: a retry, then the job fails
        for status in ("pending", "running", "failed"):
            conn.execute(
                text(
                    "UPDATE harvest_jobs SET status = :s, worker = 'w1', last_error = 'boom', "
                    "finished_at = CASE WHEN :s = 'failed' THEN now() - interval '1 hour' END "
                    "WHERE id = :id"
                ),
                {"s": status, "id": job},
            )
    with clean_db.connect() as conn:
        recorded = history.attempts(conn, job)
    assert [a.outcome for a in recorded] == ["retry", "failed"]

    assert maintenance.prune(app).moved == 1
    with clean_db.connect() as conn:
        assert history.attempts(conn, job) == recorded  # from the history's attempt_log
        assert not conn.execute(
            text("SELECT 1 FROM harvest_job_attempts WHERE job_id = :id"), {"id": job}
        ).all()

    app.retry(job)  # moves back to harvest_jobs, then pending with one more attempt
    assert where(clean_db, [job]) == {"harvest_jobs": 1}
    assert app.get(job).status == "pending"
    with clean_db.connect() as conn:
        assert history.attempts(conn, job) == recorded  # back in harvest_job_attempts


def test_dead_jobs_in_the_history_are_retried_and_deleted_in_bulk(
    app: Harvest, clean_db: Engine
) -> None:
    moved = ended(clean_db, 6, "failed", 2 * DAY)
    assert maintenance.prune(app).moved == 6
    here = ended(clean_db, 2, "failed", 60)  # not moved yet
    with clean_db.begin() as conn:  # the two here first, then three from the history
        assert len(store.retry_failed_many(conn, limit=5)) == 5
    assert where(clean_db, here) == {"harvest_jobs": 2}
    with clean_db.connect() as conn:
        pending = conn.execute(
            text("SELECT count(*) FROM harvest_jobs WHERE status = 'pending' AND id = ANY(:i)"),
            {"i": moved},
        ).scalar_one()
    assert pending == 3
    with clean_db.begin() as conn:
        assert store.delete_failed(conn, moved[-1])
        assert not store.delete_failed(conn, moved[-1])
        assert store.delete_failed_many(conn, name="echo", limit=10) == 2
    assert where(clean_db, moved) == {"harvest_jobs": 3}
    assert app.retry_failed() == 0


def test_an_idempotency_key_finds_its_job_in_the_history(app: Harvest, clean_db: Engine) -> None:
    (job,) = ended(clean_db, 1, "succeeded", 3600, idempotency_key="order-17")
    assert maintenance.prune(app).moved == 1
    again = app.enqueue("echo", {"value": 2}, idempotency_key="order-17")
    assert (again.id, again.created) == (job, False)
    # The race the lookup cannot see (the job moved after it looked): the insert finds it.
    spec = store.NewJob(
        name="echo",
        queue="execution",
        payload_json="{}",
        priority=0,
        run_at=None,
        delay=None,
        max_attempts=3,
        timeout=None,
        idempotency_key="order-17",
    )
    with app.sessions.begin() as session:
        assert store.insert_job(session, spec) == (job, False)
    with clean_db.connect() as conn:
        keyed = conn.execute(
            text("SELECT count(*) FROM harvest_jobs_all WHERE idempotency_key = 'order-17'")
        ).scalar_one()
    assert keyed == 1


def test_retention_drops_a_day_whole_and_leaves_nothing_to_vacuum(
    migrated: Settings, clean_db: Engine, redis_client: redis.Redis
) -> None:
    keep = make_app(migrated, redis_client)
    old = ended(clean_db, 300, "succeeded", 5 * DAY)
    recent = ended(clean_db, 7, "succeeded", 2 * DAY)
    assert maintenance.prune(keep).moved == 307
    keep.close()
    day = f"harvest_job_history_done_{utc_day(5 * DAY)}"

    short = make_app(migrated, redis_client, retention_seconds=3 * DAY)
    report = maintenance.prune(short)
    short.close()

    assert report.dropped >= 1 and report.finished == 0
    assert where(clean_db, old) == {}
    assert where(clean_db, recent) == {f"harvest_job_history_done_{utc_day(2 * DAY)}": 7}
    with clean_db.connect() as conn:
        assert conn.execute(text("SELECT to_regclass(:t)"), {"t": day}).scalar() is None
        dead_tuples = conn.execute(
            text("SELECT coalesce(sum(n_dead_tup), 0) FROM pg_stat_user_tables WHERE relname = :t"),
            {"t": f"harvest_job_history_done_{utc_day(2 * DAY)}"},
        ).scalar_one()
    # A catalog change, not a DELETE (its time: bench/scale.py): the day kept has no dead row.
    # (Only that day: other tests' DELETEs in other partitions reach pg_stat a while later.)
    assert dead_tuples == 0


def test_a_move_never_holds_up_a_claim_nor_takes_a_locked_row(
    app: Harvest, clean_db: Engine
) -> None:
    done = ended(clean_db, 50, "succeeded", 3600)
    for _ in range(5):
        app.enqueue("echo", {"value": 1})
    window = {"after": 0.0, "retention": 10.0 * DAY}
    with clean_db.connect() as conn:
        days = history_rows.days_due(conn, "done", limit=100, **window)
    assert all(maintenance._made(app, "done", day) for day in days)
    with clean_db.connect() as holder:
        tx = holder.begin()
        holder.execute(
            text("SELECT id FROM harvest_jobs WHERE id = ANY(:ids) FOR UPDATE"), {"ids": done[:3]}
        )
        with clean_db.begin() as conn:  # a move under way, not committed yet
            conn.execute(text("SET LOCAL lock_timeout = '2s'"))
            moved = history_rows.move(conn, "done", days=days, limit=100, **window)
            with app.engine.begin() as other:  # a claim meanwhile
                other.execute(text("SET LOCAL lock_timeout = '2s'"))
                assert len(store.claim_due(other, limit=10, ttl=60)) == 5
        tx.rollback()
    assert moved == 47  # the three locked rows stay for the next run
    assert where(clean_db, done[:3]) == {"harvest_jobs": 3}


def test_a_day_is_a_utc_day_whatever_the_session_time_zone(app: Harvest, clean_db: Engine) -> None:
    ended(clean_db, 2, "succeeded", 2 * DAY)
    with clean_db.connect() as conn:
        conn.execute(text("SET TIME ZONE 'America/New_York'"))
        days = history_rows.days_due(conn, "done", after=0, retention=10 * DAY, limit=10)
        conn.rollback()
    assert [(d.utcoffset(), d.hour) for d in days] == [(timedelta(0), 0)]
    assert history_rows.partition_name("done", days[0]).endswith(utc_day(2 * DAY))

"""Alembic migrations on a fresh database: empty -> head -> base -> head, and the migrated schema
is exactly what the models say (the claim and lease indexes partial, the table tuned to vacuum)."""

from __future__ import annotations

import secrets
import threading
import time
from collections.abc import Iterator

import psycopg
import pytest
from alembic.autogenerate import compare_metadata
from alembic.runtime.migration import MigrationContext
from alembic.script import ScriptDirectory
from sqlalchemy import Engine, inspect, text

from harvest import maintenance, migrate
from harvest.app import Harvest
from harvest.db import make_engine
from harvest.models import Base
from harvest.settings import Settings
from tests.conftest import ADMIN_URL

AUTOVACUUM = {
    "autovacuum_vacuum_scale_factor=0.01",
    "autovacuum_vacuum_threshold=1000",
    "autovacuum_analyze_scale_factor=0.02",
    "autovacuum_vacuum_cost_delay=0",
    "autovacuum_vacuum_insert_scale_factor=0.05",
    "fillfactor=80",
}


@pytest.fixture
def fresh(settings: Settings) -> Iterator[Settings]:
    """A database of its own, created empty and dropped at the end."""
    name = f"harvest_migrations_{secrets.token_hex(4)}"
    with psycopg.connect(ADMIN_URL, autocommit=True) as conn:
        conn.execute(f'CREATE DATABASE "{name}"')
    try:
        base = settings.database_url.rsplit("/", 1)[0]
        yield settings.model_copy(update={"database_url": f"{base}/{name}"})
    finally:
        with psycopg.connect(ADMIN_URL, autocommit=True) as conn:
            conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


@pytest.fixture
def fresh_engine(fresh: Settings) -> Iterator[Engine]:
    eng = make_engine(fresh, pool_size=1)
    yield eng
    eng.dispose()


def tables(engine: Engine) -> set[str]:
    with engine.connect() as conn:
        return set(inspect(conn).get_table_names())


def head() -> str:
    script = ScriptDirectory.from_config(migrate.alembic_config(Settings()))
    revision = script.get_current_head()
    assert revision is not None
    return revision


# The partitioned history (migration 0013): made by the migration and, a day at a time, by
# maintenance (harvest.store.history_rows); no model maps it (its rows are read through the
# harvest_jobs_all view).
HISTORY = "harvest_job_history"


def harvest_only(name: str | None, type_: str, parent_names: object) -> bool:
    """Leave out scratch tables other tests make in the shared test database, and the
    history's tables (not mapped by models)."""
    if type_ != "table":
        return True
    return (name or "").startswith("harvest_") and not (name or "").startswith(HISTORY)


def history_tables(engine: Engine) -> set[str]:
    return {t for t in tables(engine) if t.startswith(HISTORY)}


def schema_diff(engine: Engine) -> list[object]:
    with engine.connect() as conn:
        context = MigrationContext.configure(
            conn,
            opts={
                "version_table": migrate.VERSION_TABLE,
                "compare_type": True,
                "compare_server_default": True,
                "include_name": harvest_only,
            },
        )
        return list(compare_metadata(context, Base.metadata))


def test_upgrade_downgrade_upgrade_on_an_empty_database(
    fresh: Settings, fresh_engine: Engine
) -> None:
    assert tables(fresh_engine) == set()
    assert migrate.current(fresh) is None

    migrate.upgrade(fresh, "head")
    expected = set(Base.metadata.tables) | {migrate.VERSION_TABLE}
    assert tables(fresh_engine) - history_tables(fresh_engine) == expected
    assert history_tables(fresh_engine) == {HISTORY, f"{HISTORY}_done", f"{HISTORY}_dead"}
    assert {"harvest_jobs", "harvest_counters"} <= tables(fresh_engine)
    assert migrate.current(fresh) == head()

    migrate.downgrade(fresh, "base")
    assert tables(fresh_engine) <= {migrate.VERSION_TABLE}
    assert migrate.current(fresh) is None

    migrate.upgrade(fresh, "head")
    assert migrate.current(fresh) == head()
    assert schema_diff(fresh_engine) == []
    # The re-created schema works: a job goes in and is claimed.
    with fresh_engine.begin() as conn:
        conn.execute(text("INSERT INTO harvest_jobs (name) VALUES ('noop')"))
        claimed = conn.execute(
            text(
                "UPDATE harvest_jobs SET status = 'dispatched', lease_token = gen_random_uuid() "
                "WHERE status = 'pending' RETURNING id"
            )
        ).all()
    assert len(claimed) == 1


def test_models_match_the_migrated_schema(engine: Engine) -> None:
    """The session's database (migrated by the conftest) against the models."""
    assert schema_diff(engine) == []


def test_claim_and_lease_indexes_are_partial(engine: Engine) -> None:
    with engine.connect() as conn:
        rows = conn.execute(
            text(
                "SELECT c.relname AS name, pg_get_indexdef(i.indexrelid) AS definition, "
                "pg_get_expr(i.indpred, i.indrelid) AS predicate "
                "FROM pg_index i JOIN pg_class c ON c.oid = i.indexrelid "
                "WHERE i.indrelid = 'harvest_jobs'::regclass"
            )
        ).all()
    by_name = {r.name: r for r in rows}
    claim = by_name["harvest_jobs_claim_idx"]
    assert claim.predicate == "(status = 'pending'::text)"
    assert "(priority DESC, run_at, id)" in claim.definition
    lease = by_name["harvest_jobs_lease_idx"]
    assert lease.predicate is not None
    assert "'dispatched'::text" in lease.predicate and "'running'::text" in lease.predicate
    assert "(lease_expires_at)" in lease.definition
    idempotency = by_name["harvest_jobs_idempotency_key_idx"]
    assert "UNIQUE" in idempotency.definition
    assert idempotency.predicate == "(idempotency_key IS NOT NULL)"


def test_claim_query_can_use_the_claim_index(engine: Engine) -> None:
    with engine.connect() as conn:  # one transaction, rolled back: the backlog and its stats
        # A backlog of due jobs, with statistics taken of it: what a table that earlier tests
        # emptied keeps in its statistics made the planner read it by queue and sort instead.
        conn.execute(
            text(
                "INSERT INTO harvest_jobs (name, run_at) "
                "SELECT 'plan.test', now() - interval '1 minute' FROM generate_series(1, 2000)"
            )
        )
        conn.execute(text("ANALYZE harvest_jobs"))
        conn.execute(text("SET LOCAL enable_seqscan = off"))
        plan = "\n".join(
            conn.execute(
                text(
                    "EXPLAIN SELECT id FROM harvest_jobs WHERE status = 'pending' "
                    "AND run_at <= now() ORDER BY priority DESC, run_at, id LIMIT 50"
                )
            ).scalars()
        )
    assert "harvest_jobs_claim_idx" in plan, plan


def test_jobs_table_has_the_autovacuum_settings(engine: Engine, fresh: Settings) -> None:
    migrate.upgrade(fresh, "head")
    migrate.downgrade(fresh, "base")
    migrate.upgrade(fresh, "head")
    for settings in (None, fresh):
        eng = engine if settings is None else make_engine(settings, pool_size=1)
        try:
            with eng.connect() as conn:
                options = conn.execute(
                    text("SELECT reloptions FROM pg_class WHERE oid = 'harvest_jobs'::regclass")
                ).scalar_one()
        finally:
            if settings is not None:
                eng.dispose()
        assert set(options or []) >= AUTOVACUUM


def test_the_history_migration_is_online_and_moves_the_old_rows_in_batches(
    fresh: Settings, fresh_engine: Engine
) -> None:
    """0013 on a jobs table in use: it waits for no worker's transaction (it only makes new
    objects), and the finished rows already there move later, in short batches, none lost or
    doubled."""
    migrate.upgrade(fresh, "0012_usage")
    with fresh_engine.begin() as conn:
        conn.execute(
            text(
                "INSERT INTO harvest_jobs (name, status, attempts, started_at, finished_at) "
                "SELECT 'echo', CASE WHEN i % 5 = 0 THEN 'failed' ELSE 'succeeded' END, 1, t, t "
                "FROM (SELECT i, now() - make_interval(secs => 600 + i) AS t "
                "      FROM generate_series(1, 30000) AS i) AS s"
            )
        )
        conn.execute(
            text("INSERT INTO harvest_jobs (name) SELECT 'echo' FROM generate_series(1, 50)")
        )
    with fresh_engine.connect() as worker:  # a worker's transaction, open throughout
        tx = worker.begin()
        worker.execute(
            text(
                "UPDATE harvest_jobs SET status = 'dispatched' "
                "WHERE id = (SELECT max(id) FROM harvest_jobs)"
            )
        )
        done = threading.Event()
        thread = threading.Thread(
            target=lambda: (migrate.upgrade(fresh, "0013_job_history"), done.set())
        )
        thread.start()
        thread.join(60)
        assert done.is_set(), "the migration waited on a worker's open transaction"
        tx.commit()
    assert migrate.current(fresh) == "0013_job_history"
    migrate.upgrade(fresh, "head")

    app = Harvest(fresh.model_copy(update={"history_batch_size": 4000}))
    try:
        report = maintenance.prune(app)
    finally:
        app.close()
    assert report.moved == 30000 and report.finished == report.dead == 0
    with fresh_engine.connect() as conn:
        here = conn.execute(text("SELECT status, count(*) FROM harvest_jobs GROUP BY 1")).all()
        everything = conn.execute(
            text("SELECT count(*), count(DISTINCT id) FROM harvest_jobs_all")
        ).one()
    assert dict(here) == {"pending": 49, "dispatched": 1}
    assert tuple(everything) == (30050, 30050)


PENDING_ECHO = "SELECT count(*) FROM harvest_jobs WHERE status = 'pending' AND name = 'echo'"


def building_index(engine: Engine) -> bool:
    with engine.connect() as conn:
        return bool(
            conn.execute(
                text(
                    "SELECT count(*) FROM pg_stat_activity WHERE wait_event_type = 'Lock'"
                    " AND query LIKE 'CREATE INDEX CONCURRENTLY%'"
                )
            ).scalar_one()
        )


def test_the_pending_name_index_replaces_status_name_while_jobs_keep_coming(
    fresh: Settings, fresh_engine: Engine
) -> None:
    """0014 builds its index CONCURRENTLY: it waits for a worker's open transaction to end
    (as any concurrent build does), but enqueues go on meanwhile; after it, a name's pending
    depth is counted from the new partial index, and the (status, name) index is gone."""
    migrate.upgrade(fresh, "0013_job_history")
    with fresh_engine.begin() as conn:
        conn.execute(
            text("INSERT INTO harvest_jobs (name) SELECT 'echo' FROM generate_series(1, 500)")
        )
    with fresh_engine.connect() as worker:  # a worker's transaction, open while it builds
        tx = worker.begin()
        worker.execute(
            text(
                "UPDATE harvest_jobs SET status = 'dispatched'"
                " WHERE id = (SELECT min(id) FROM harvest_jobs)"
            )
        )
        done = threading.Event()
        thread = threading.Thread(target=lambda: (migrate.upgrade(fresh, "head"), done.set()))
        thread.start()
        deadline = time.monotonic() + 30
        while not building_index(fresh_engine):
            assert time.monotonic() < deadline, "the build never waited on the worker"
            time.sleep(0.05)
        with fresh_engine.begin() as conn:  # a new job while the build waits: not blocked
            conn.execute(text("SET LOCAL lock_timeout = '5s'"))
            conn.execute(text("INSERT INTO harvest_jobs (name) VALUES ('echo')"))
        assert not done.is_set()
        tx.commit()
        thread.join(60)
        assert done.is_set()
    assert migrate.current(fresh) == head()
    with fresh_engine.begin() as conn:
        indexes = set(
            conn.execute(
                text("SELECT indexname FROM pg_indexes WHERE tablename = 'harvest_jobs'")
            ).scalars()
        )
        conn.execute(text("SET LOCAL enable_seqscan = off"))
        plan = "\n".join(conn.execute(text("EXPLAIN " + PENDING_ECHO)).scalars())
        depth = conn.execute(text(PENDING_ECHO)).scalar_one()
    assert "harvest_jobs_pending_name_idx" in indexes
    assert "harvest_jobs_status_name_idx" not in indexes
    assert "harvest_jobs_pending_name_idx" in plan, plan
    assert depth == 500  # 499 left pending, and the one enqueued during the build
    assert schema_diff(fresh_engine) == []

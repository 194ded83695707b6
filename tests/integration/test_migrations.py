"""Alembic migrations on a fresh database: empty -> head -> base -> head, and the migrated schema
is exactly what the models say (the claim and lease indexes partial, the table tuned to vacuum)."""

from __future__ import annotations

import secrets
from collections.abc import Iterator

import psycopg
import pytest
from alembic.autogenerate import compare_metadata
from alembic.runtime.migration import MigrationContext
from alembic.script import ScriptDirectory
from sqlalchemy import Engine, inspect, text

from harvest import migrate
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


def harvest_only(name: str | None, type_: str, parent_names: object) -> bool:
    """Leave out scratch tables other tests make in the shared test database."""
    return type_ != "table" or (name or "").startswith("harvest_")


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
    assert tables(fresh_engine) == set(Base.metadata.tables) | {migrate.VERSION_TABLE}
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
    with engine.connect() as conn:
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

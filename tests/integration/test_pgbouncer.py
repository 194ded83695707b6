"""harvest's connections through a real PgBouncer in transaction mode (this run's own, see
``tests/pgbouncer.py``): what breaks without ``HARVEST_DATABASE_POOLER=transaction``, and that
the log scan of the process tests sees it."""

from __future__ import annotations

import logging
import secrets
from pathlib import Path

import httpx
import psycopg
import pytest
import redis
from sqlalchemy import text

from harvest import migrate, store
from harvest.app import Harvest
from harvest.db import make_engine, translate_errors
from harvest.errors import ServiceUnavailable, StartupProblem
from harvest.settings import Settings
from tests.conftest import ADMIN_URL
from tests.pgbouncer import PgBouncer, pooler_errors

CLAIM_PARAMS = {"limit": 10, "ttl": 30.0}
UP = b'harvest_up{service="postgres"} 1.0'


def _through(bouncer: PgBouncer, settings: Settings, *, pooler: str) -> Settings:
    database = settings.database_url.rsplit("/", 1)[1]
    return settings.model_copy(
        update={"database_url": bouncer.url(database), "database_pooler": pooler}
    )


def test_startup_options_are_refused_and_the_log_scan_sees_it(
    pgbouncer: PgBouncer, migrated: Settings, tmp_path: Path
) -> None:
    start = len(pgbouncer.log_text())
    unpooled = make_engine(_through(pgbouncer, migrated, pooler="none"), pool_size=1)
    try:
        with (
            pytest.raises(ServiceUnavailable, match="unsupported startup parameter"),
            translate_errors(),
            unpooled.connect() as conn,
        ):
            conn.execute(text("SELECT 1"))
    finally:
        unpooled.dispose()
    log = tmp_path / "pgbouncer.log"
    log.write_text(pgbouncer.log_text()[start:])
    assert any("unsupported startup parameter" in line for line in pooler_errors(log))

    pooled = make_engine(_through(pgbouncer, migrated, pooler="transaction"), pool_size=1)
    try:
        with pooled.connect() as conn:
            assert conn.execute(text("SHOW application_name")).scalar_one() == "harvest"
    finally:
        pooled.dispose()


def _switch_server(bouncer: PgBouncer, database: str) -> psycopg.Connection[object]:
    """Another client, holding the server connection PgBouncer would hand out next (it reuses
    the last one freed) in an open transaction, so the next transaction of anyone else gets
    another server connection."""
    other = psycopg.connect(
        host="127.0.0.1", port=bouncer.port, user="postgres", dbname=database,
        prepare_threshold=None,
    )  # fmt: skip
    other.execute("SELECT 1")  # BEGIN: the transaction stays open
    return other


def test_psycopg_prepared_statements_break_and_the_pooled_claim_does_not(
    pgbouncer: PgBouncer, migrated: Settings, clean_db: object
) -> None:
    database = migrated.database_url.rsplit("/", 1)[1]
    # The failure the setting exists for: psycopg prepares a statement run 5 times, on the
    # server connection of that transaction; the next transaction may get another one.
    with psycopg.connect(
        host="127.0.0.1", port=pgbouncer.port, user="postgres", dbname=database,
        autocommit=True,
    ) as conn:  # fmt: skip
        for _ in range(6):
            conn.execute("SELECT count(*) FROM harvest_jobs WHERE id = %s", (1,))
        other = _switch_server(pgbouncer, database)
        try:
            with pytest.raises(psycopg.errors.InvalidSqlStatementName, match="does not exist"):
                conn.execute("SELECT count(*) FROM harvest_jobs WHERE id = %s", (1,))
        finally:
            other.close()

    # harvest's claim (prepared on a direct connection) and any statement run many times,
    # with the server connection switched under them.
    engine = make_engine(_through(pgbouncer, migrated, pooler="transaction"), pool_size=1)

    def claim_and_count() -> None:
        with engine.begin() as conn:
            assert store.claim_due(conn, **CLAIM_PARAMS) == []
            conn.execute(text("SELECT count(*) FROM harvest_jobs WHERE id = :id"), {"id": 1})

    try:
        for _ in range(6):
            claim_and_count()
        other = _switch_server(pgbouncer, database)
        try:
            claim_and_count()
        finally:
            other.close()
    finally:
        engine.dispose()


def _fresh_database() -> str:
    name = f"harvest_test_{secrets.token_hex(4)}"
    with psycopg.connect(ADMIN_URL, autocommit=True) as conn:
        conn.execute(f'CREATE DATABASE "{name}"')
    return name


def _drop_database(name: str) -> None:
    with psycopg.connect(ADMIN_URL, autocommit=True) as conn:
        conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


def _tables(settings: Settings, database: str) -> set[str]:
    url = settings.psycopg_url.rsplit("/", 1)[0] + f"/{database}"
    with psycopg.connect(url) as conn:
        rows = conn.execute("SELECT tablename FROM pg_tables WHERE schemaname = 'public'")
        return {r[0] for r in rows}


def test_migrations_run_through_the_pooler_or_go_to_the_direct_url(
    pgbouncer: PgBouncer, settings: Settings, tmp_path: Path
) -> None:
    through, direct = _fresh_database(), _fresh_database()
    start = len(pgbouncer.log_text())
    try:
        pooled = settings.model_copy(
            update={"database_url": pgbouncer.url(through), "database_pooler": "transaction"}
        )
        # No direct URL: every migration through PgBouncer, one transaction each.
        migrate.upgrade(pooled)
        assert "harvest_jobs" in _tables(settings, through)
        assert migrate.current(pooled) is not None

        # A direct URL (another database here, to tell them apart): the migrations go there.
        with_direct = pooled.model_copy(
            update={
                "database_direct_url": settings.database_url.rsplit("/", 1)[0] + f"/{direct}",
            }
        )
        migrate.upgrade(with_direct)
        assert "harvest_jobs" in _tables(settings, direct)
    finally:
        _drop_database(through)
        _drop_database(direct)
    log = tmp_path / "pgbouncer.log"
    log.write_text(pgbouncer.log_text()[start:])
    assert pooler_errors(log) == []


def test_dashboard_and_metrics_through_the_pooler(
    pgbouncer: PgBouncer, migrated: Settings, clean_db: object, redis_client: redis.Redis
) -> None:
    from prometheus_client import generate_latest
    from pydantic import SecretStr

    from harvest.metrics import registry_for
    from harvest.web import auth, create_app
    from tests.web.conftest import Server

    pooled = _through(pgbouncer, migrated, pooler="transaction")
    app = Harvest(pooled)
    app.load_imports(["tests.jobs"])
    ref = app.enqueue("echo", {"value": 1})
    database = migrated.database_url.rsplit("/", 1)[1]
    credentials = auth.Credentials("operator", SecretStr("a long test password"))
    engine = make_engine(pooled, pool_size=1)
    registry = registry_for(engine, redis_client)
    paths = ["/", "/jobs", f"/jobs/{ref.id}", "/api/overview", "/api/jobs", "/api/keys"]
    try:
        with (
            Server(create_app(pooled, credentials=credentials)) as server,
            httpx.Client(base_url=server.url, auth=("operator", "a long test password")) as web,
        ):
            # Every role's statements many times over, then with a server connection taken.
            for _ in range(6):
                for path in paths:
                    assert web.get(path).status_code == 200, path
            for _ in range(6):
                assert UP in generate_latest(registry)
            other = _switch_server(pgbouncer, database)
            try:
                assert UP in generate_latest(registry)
                for path in paths:
                    assert web.get(path).status_code == 200, path
            finally:
                other.close()
    finally:
        engine.dispose()
        app.close()


def test_a_pooled_worker_warns_when_the_role_sets_no_timeouts(
    pgbouncer: PgBouncer, migrated: Settings, caplog: pytest.LogCaptureFixture
) -> None:
    from harvest.worker import checks

    with caplog.at_level(logging.WARNING, logger=checks.log.name):
        checks._postgres(_through(pgbouncer, migrated, pooler="transaction"))
    assert "harvest sends no statement_timeout or idle_in_transaction" in caplog.text

    caplog.clear()
    fresh = _fresh_database()  # new server connections: they get the database's settings
    try:
        with psycopg.connect(ADMIN_URL, autocommit=True) as conn:
            for name in ("statement_timeout", "idle_in_transaction_session_timeout"):
                conn.execute(f"ALTER DATABASE \"{fresh}\" SET {name} = '30s'")
        settings = migrated.model_copy(
            update={"database_url": pgbouncer.url(fresh), "database_pooler": "transaction"}
        )
        with (
            caplog.at_level(logging.WARNING, logger=checks.log.name),
            pytest.raises(StartupProblem, match="not migrated"),
        ):
            checks._postgres(settings)
        assert "sends no" not in caplog.text
    finally:
        _drop_database(fresh)

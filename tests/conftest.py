"""Shared fixtures: a private Postgres database and a private Redis db number per test run.

Tests share the machine's services with other runs, so each run creates its own database
(``harvest_test_<random>``) migrated by Alembic, and claims a free Redis db number (1-15) with a
``SET NX`` marker. Both are removed at the end of the run.
"""

from __future__ import annotations

import os
import secrets
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

import psycopg
import pytest
import redis
from psycopg import sql
from sqlalchemy import Engine, text

from harvest.settings import Settings

if TYPE_CHECKING:
    from harvest.app import Harvest
    from harvest.runner import Runner
    from tests.pgbouncer import PgBouncer


def _service_urls() -> tuple[str, str]:
    """(Postgres admin URL, Redis URL without db number): HARVEST_TEST_* variables, else the
    servers `harvest dev up` recorded (embedded ones on a machine with none), else localhost."""
    admin = os.environ.get("HARVEST_TEST_ADMIN_URL")
    redis_base = os.environ.get("HARVEST_TEST_REDIS_URL")
    if not (admin and redis_base):
        from harvest.dev import load_dev_urls

        urls = load_dev_urls() or {}
        if "database_url" in urls:
            server = urls["database_url"].split("://", 1)[1].rsplit("/", 1)[0]
            admin = admin or f"postgresql://{server}/postgres"
        if "redis_url" in urls:
            redis_base = redis_base or urls["redis_url"].rsplit("/", 1)[0]
    return (
        admin or "postgresql://postgres@127.0.0.1:5432/postgres",
        redis_base or "redis://127.0.0.1:6379",
    )


ADMIN_URL, REDIS_BASE = _service_urls()
OWNER_KEY = "harvest:test:owner"


# Replace the owner only if it is still the one seen (a compare-and-set).
_TAKE_OVER = (
    "if redis.call('GET', KEYS[1]) == ARGV[1] then "
    "return redis.call('SET', KEYS[1], ARGV[2], 'EX', ARGV[3]) else return nil end"
)


def _owner_gone(owner: bytes | None) -> bool:
    """True when the run that claimed a db number is no longer alive (a run killed before its
    teardown leaves its owner key for 4 hours)."""
    if owner is None:
        return False
    try:
        pid = int(owner.rsplit(b":", 1)[-1])  # "pid", or "label:pid"
    except ValueError:
        return False
    if pid == os.getpid():
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except PermissionError:  # alive, another user's
        return False
    return False


def _claim_redis_db() -> int:
    me = f"{os.getpid()}"
    for db in range(1, 16):
        client = redis.Redis.from_url(f"{REDIS_BASE}/{db}")
        try:
            claimed = client.set(OWNER_KEY, me, nx=True, ex=4 * 3600)
            if not claimed:
                owner = client.get(OWNER_KEY)
                claimed = _owner_gone(owner) and bool(
                    client.eval(_TAKE_OVER, 1, OWNER_KEY, owner, me, 4 * 3600)
                )
            if claimed:
                client.flushdb()
                client.set(OWNER_KEY, me, ex=4 * 3600)
                return db
        finally:
            client.close()
    raise RuntimeError("no free Redis db number (1-15): another test run holds each of them")


@pytest.fixture(scope="session")
def database_name() -> Iterator[str]:
    name = f"harvest_test_{secrets.token_hex(4)}"
    with psycopg.connect(ADMIN_URL, autocommit=True) as conn:
        conn.execute(f'CREATE DATABASE "{name}"')
    yield name
    with psycopg.connect(ADMIN_URL, autocommit=True) as conn:
        conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


@pytest.fixture(scope="session")
def redis_db() -> Iterator[int]:
    db = _claim_redis_db()
    yield db
    client = redis.Redis.from_url(f"{REDIS_BASE}/{db}")
    client.flushdb()
    client.close()


@pytest.fixture(scope="session")
def settings(database_name: str, redis_db: int) -> Settings:
    base = ADMIN_URL.rsplit("/", 1)[0].replace("postgresql://", "postgresql+psycopg://", 1)
    return Settings(
        database_url=f"{base}/{database_name}",
        redis_url=f"{REDIS_BASE}/{redis_db}",
        secret_key=None,
    )


@pytest.fixture(scope="session")
def pgbouncer() -> Iterator[PgBouncer]:
    """This run's own PgBouncer in transaction mode, in front of the test Postgres."""
    from tests.pgbouncer import PgBouncer

    server = psycopg.conninfo.conninfo_to_dict(ADMIN_URL)
    bouncer = PgBouncer(str(server.get("host") or "127.0.0.1"), int(server.get("port") or 5432))
    yield bouncer
    bouncer.stop()


@pytest.fixture(scope="session")
def migrated(settings: Settings) -> Settings:
    from harvest.migrate import upgrade

    upgrade(settings, "head")
    return settings


@pytest.fixture(scope="session")
def engine(migrated: Settings) -> Iterator[Engine]:
    from harvest.db import make_engine

    eng = make_engine(migrated, pool_size=4)
    yield eng
    eng.dispose()


@pytest.fixture
def clean_db(engine: Engine) -> Engine:
    """Empty every harvest table before the test (the schema stays)."""
    with engine.begin() as conn:
        tables = (
            conn.execute(
                text(
                    "SELECT tablename FROM pg_tables WHERE schemaname = 'public' "
                    "AND tablename LIKE 'harvest\\_%' AND tablename <> 'harvest_alembic_version'"
                )
            )
            .scalars()
            .all()
        )
        if tables:
            conn.execute(text(f"TRUNCATE {', '.join(tables)} RESTART IDENTITY CASCADE"))
    return engine


@pytest.fixture
def own_database(settings: Settings) -> Iterator[Settings]:
    """A migrated database of this test's own, which it may close to new connections."""
    name = f"harvest_test_{secrets.token_hex(4)}_outage"
    with psycopg.connect(ADMIN_URL, autocommit=True) as conn:
        conn.execute(sql.SQL("CREATE DATABASE {}").format(sql.Identifier(name)))
    own = settings.model_copy(
        update={"database_url": settings.database_url.rsplit("/", 1)[0] + "/" + name}
    )
    from harvest.migrate import upgrade

    upgrade(own)
    yield own
    with psycopg.connect(ADMIN_URL, autocommit=True) as conn:
        drop = sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)")
        conn.execute(drop.format(sql.Identifier(name)))


def close_database(name: str, closed: bool) -> None:
    """Refuse (or allow again) new connections to ``name`` and cut the ones it has."""
    with psycopg.connect(ADMIN_URL, autocommit=True) as conn:
        conn.execute(
            sql.SQL("ALTER DATABASE {} WITH ALLOW_CONNECTIONS {}").format(
                sql.Identifier(name), sql.SQL("false" if closed else "true")
            )
        )
        if closed:
            conn.execute(
                "SELECT pg_terminate_backend(pid) FROM pg_stat_activity "
                "WHERE datname = %s AND pid <> pg_backend_pid()",
                (name,),
            )


@pytest.fixture
def redis_client(settings: Settings) -> Iterator[redis.Redis]:
    """A client on this run's private Redis db, flushed before each test."""
    client = redis.Redis.from_url(settings.redis_url)
    client.flushdb()
    client.set(OWNER_KEY, f"{os.getpid()}", ex=4 * 3600)
    yield client
    client.close()


@pytest.fixture
def effects(engine: Engine) -> Engine:
    """An empty ``test_effects`` table, where the jobs of ``tests.jobs`` record each run."""
    with engine.begin() as conn:
        conn.execute(
            text(
                "CREATE TABLE IF NOT EXISTS test_effects (id bigserial PRIMARY KEY, job_id bigint, "
                "attempt int, pid int, at timestamptz DEFAULT clock_timestamp())"
            )
        )
        conn.execute(text("TRUNCATE test_effects"))
    return engine


@pytest.fixture
def jobs_app(
    migrated: Settings,
    clean_db: Engine,
    effects: Engine,
    redis_client: redis.Redis,
    monkeypatch: pytest.MonkeyPatch,
) -> Iterator[Callable[..., Harvest]]:
    """Make a Harvest with the jobs of ``tests.jobs`` on the emptied test database and Redis db:
    ``jobs_app({"lease_ttl": 0.6}, redis_client=...)`` (settings changed by the dict, keyword
    arguments for Harvest). Every one made is closed after the test."""
    from harvest.app import Harvest

    monkeypatch.setenv("HARVEST_DATABASE_URL", migrated.database_url)  # tests.jobs effects
    made: list[Harvest] = []

    def make(update: dict[str, Any] | None = None, **kwargs: Any) -> Harvest:
        harvest = Harvest(migrated.model_copy(update=update or {}), **kwargs)
        harvest.load_imports(["tests.jobs"])
        made.append(harvest)
        return harvest

    yield make
    for harvest in made:
        harvest.close()


@pytest.fixture
def runner(app: Harvest) -> Iterator[Runner]:
    """The worker's Runner, in-process, on the test module's ``app`` fixture."""
    from harvest.runner import Runner

    r = Runner(app)
    yield r
    r.close()

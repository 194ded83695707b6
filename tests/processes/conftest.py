"""Real Celery worker and beat processes, started as subprocesses against this run's
database and Redis db, and stopped (whole process groups) at the end of each test."""

from __future__ import annotations

import shutil
import signal
import socket
import subprocess
import time
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

import psycopg
import pytest
import redis
from sqlalchemy import Engine

from harvest.app import Harvest
from harvest.procs import ProcessGroup
from harvest.settings import Settings
from tests.pgbouncer import PgBouncer, pooler_errors
from tests.processes.api_server import ApiServer

FAST = {
    "HARVEST_LEASE_TTL": "3",
    "HARVEST_DISPATCH_TTL": "10",
    "HARVEST_RESCUE_INTERVAL": "1",
    "HARVEST_DISPATCH_INTERVAL": "0.5",
    "HARVEST_IMPORTS": "tests.jobs",
}


class Cluster(ProcessGroup):
    """Real worker and beat processes against this run's database and Redis db."""

    def __init__(self, settings: Settings, log_dir: Path, broker_url: str | None = None) -> None:
        env = {
            **FAST,
            "HARVEST_DATABASE_URL": settings.database_url,
            "HARVEST_REDIS_URL": settings.redis_url,
        }
        if broker_url:
            env["HARVEST_BROKER_URL"] = broker_url
        if settings.pooled:
            env["HARVEST_DATABASE_POOLER"] = settings.database_pooler
        if settings.database_direct_url:
            env["HARVEST_DATABASE_DIRECT_URL"] = settings.database_direct_url
        super().__init__(env, log_dir)
        self.settings = settings

    def worker_logs(self, queue: str) -> str:
        """Everything the workers of ``queue`` (``schedule``, ``execution``) logged so far."""
        logs = sorted(self.log_dir.glob(f"worker-{queue}-*.log"))
        return "".join(p.read_text(errors="replace") for p in logs)

    def kill(self, proc: subprocess.Popen[bytes], sig: int = signal.SIGKILL) -> None:
        self.signal(proc, sig)

    def children(self, proc: subprocess.Popen[bytes]) -> list[int]:
        out = subprocess.run(
            ["pgrep", "-P", str(proc.pid)], capture_output=True, text=True, check=False
        ).stdout
        return [int(p) for p in out.split()]


def with_keys(
    settings: Settings,
    redis_client: redis.Redis,
    keys: Iterable[tuple[str, str, str, dict[str, Any]]],
    *,
    disabled: Iterable[tuple[str, str]] = (),
) -> Settings:
    """``settings`` with a fresh secret key, and ``keys`` ((pool, name, secret, add_key's
    options), ...) stored in Postgres (``disabled`` ones disabled) and loaded into Redis."""
    from cryptography.fernet import Fernet
    from pydantic import SecretStr

    from harvest import keystore

    settings = settings.model_copy(update={"secret_key": SecretStr(Fernet.generate_key().decode())})
    cipher = keystore.Cipher.from_settings(settings)
    app = Harvest(settings)
    keys = list(keys)
    with app.sessions.begin() as session:
        for pool, name, secret, options in keys:
            keystore.add_key(session, cipher, pool=pool, name=name, secret=secret, **options)
    with app.engine.begin() as conn:
        for ref in disabled:
            keystore.set_status(conn, ref, "disabled")
    for pool in dict.fromkeys(k[0] for k in keys):
        keystore.sync_pool(app.engine, redis_client, pool)
    app.close()
    return settings


@pytest.fixture
def api() -> Iterator[tuple[ApiServer, str]]:
    """A stand-in for an external API that records every call (tests.processes.api_server),
    started on a free port: (server, url)."""
    server = ApiServer()
    url = server.start()
    yield server, url
    server.stop()


@pytest.fixture
def routed(
    request: pytest.FixtureRequest, migrated: Settings, tmp_path: Path
) -> Iterator[Settings]:
    """The settings every harvest process of the test uses: straight to Postgres ("direct",
    the default), or through this run's PgBouncer in transaction mode ("pgbouncer", by
    ``@pytest.mark.parametrize("routed", [...], indirect=True)``). Through PgBouncer, the test
    fails if any process's log or PgBouncer's says that the pooler broke something (a
    prepared statement that does not exist, an advisory lock, a startup parameter)."""
    if getattr(request, "param", "direct") == "direct":
        yield migrated
        return
    bouncer: PgBouncer = request.getfixturevalue("pgbouncer")
    database = migrated.database_url.rsplit("/", 1)[1]
    start = len(bouncer.log_text())
    yield migrated.model_copy(
        update={
            "database_url": bouncer.url(database),
            "database_pooler": "transaction",
            "database_direct_url": migrated.database_url,
        }
    )
    tmp_path.joinpath("pgbouncer.log").write_text(bouncer.log_text()[start:])
    errors = pooler_errors(*sorted(tmp_path.glob("*.log")))
    assert not errors, f"the pooler broke something ({len(errors)} lines):\n" + "\n".join(
        errors[:20]
    )


@pytest.fixture
def cluster(
    routed: Settings, clean_db: Engine, redis_client: object, tmp_path: Path
) -> Iterator[Cluster]:
    c = Cluster(routed, tmp_path)
    yield c
    c.stop()


@pytest.fixture
def client_app(routed: Settings) -> Iterator[Harvest]:
    """The enqueuing side, with the test jobs registered (through the pooler when the test
    is routed through one)."""
    app = Harvest(routed)
    app.load_imports(["tests.jobs"])
    yield app
    app.close()


def wait_until(predicate, timeout: float, interval: float = 0.2, what: str = "condition"):  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(interval)
    raise AssertionError(f"timed out after {timeout}s waiting for {what}")


def pg_count(settings: Settings, sql: str) -> int:
    with psycopg.connect(settings.psycopg_url) as conn:
        row = conn.execute(sql).fetchone()
        return int(row[0]) if row else 0


class PrivateRedis:
    """A redis-server of the test's own on a free port, without persistence, that the test
    may kill and start again (the machine's shared Redis is never stopped)."""

    def __init__(self) -> None:
        server = shutil.which("redis-server")
        if server is None:
            pytest.skip("no redis-server on PATH to start a private Redis")
        self.server = server
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            self.port: int = sock.getsockname()[1]
        self.url = f"redis://127.0.0.1:{self.port}/0"
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> PrivateRedis:
        self.proc = subprocess.Popen(
            [self.server, "--port", str(self.port), "--bind", "127.0.0.1", "--save", ""],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        client = redis.Redis.from_url(self.url, socket_connect_timeout=0.5)

        def answers() -> bool:
            try:
                return bool(client.ping())
            except redis.ConnectionError:
                return False

        try:
            wait_until(answers, 10, 0.1, "the private Redis")
        finally:
            client.close()
        return self

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait(5)
        self.proc = None


@pytest.fixture
def private_redis() -> Iterator[PrivateRedis]:
    """A started :class:`PrivateRedis`, killed at the end of the test."""
    server = PrivateRedis().start()
    yield server
    server.kill()

"""Once running, an outage of Postgres or Redis is logged once when it starts and once when it
ends (with a count), not once per tick, and the processes carry on after it."""

from __future__ import annotations

import secrets
import shutil
import signal
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import psycopg
import pytest
from psycopg import sql

from harvest import migrate
from harvest.app import Harvest
from harvest.models import JobStatus
from harvest.settings import Settings
from tests.conftest import ADMIN_URL
from tests.processes.conftest import Cluster, wait_until
from tests.processes.test_fail_fast import free_port

pytestmark = pytest.mark.slow


@pytest.fixture
def own_database(settings: Settings) -> Iterator[Settings]:
    """A migrated database of this test's own, which it may close to new connections."""
    name = f"harvest_test_{secrets.token_hex(4)}_outage"
    with psycopg.connect(ADMIN_URL, autocommit=True) as conn:
        conn.execute(sql.SQL("CREATE DATABASE {}").format(sql.Identifier(name)))
    own = settings.model_copy(
        update={"database_url": settings.database_url.rsplit("/", 1)[0] + "/" + name}
    )
    migrate.upgrade(own)
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


def lines_with(log_dir: Path, prefix: str, text: str) -> list[str]:
    return [
        line
        for path in log_dir.glob(f"{prefix}*.log")
        for line in path.read_text(errors="replace").splitlines()
        if text in line
    ]


def test_a_postgres_outage_is_logged_once_with_a_count(
    own_database: Settings, redis_client: object, tmp_path: Path
) -> None:
    cluster = Cluster(own_database, tmp_path)
    app = Harvest(own_database)
    app.load_imports(["tests.jobs"])
    name = own_database.database_url.rsplit("/", 1)[1]
    try:
        cluster.worker("schedule", concurrency=1)
        cluster.worker("execution", concurrency=1)
        cluster.beat()
        cluster.wait_ready()
        close_database(name, closed=True)
        time.sleep(5)  # 10 dispatch ticks (every 0.5 s), rescue ticks every 1 s
        close_database(name, closed=False)
        wait_until(
            lambda: lines_with(tmp_path, "worker-schedule", "Postgres answers again"),
            30,
            what="the recovery line",
        )
        ref = app.enqueue("echo", {"value": "after"})
        assert app.wait(ref.id, timeout=30).status is JobStatus.SUCCEEDED
        down = lines_with(tmp_path, "worker-schedule", "Postgres does not answer")
        up = lines_with(tmp_path, "worker-schedule", "Postgres answers again")
        assert len(down) == 1 and len(up) == 1, cluster.logs()
        failed = int(up[0].split("(")[-1].split(" failed")[0])
        assert failed >= 5, up[0]  # the ticks it skipped, counted on one line
        assert not lines_with(tmp_path, "worker-schedule", "Traceback"), cluster.logs()
    finally:
        close_database(name, closed=False)
        cluster.stop()
        app.close()


def test_a_redis_outage_is_logged_once_by_beat(migrated: Settings, tmp_path: Path) -> None:
    server = shutil.which("redis-server")
    if server is None:
        pytest.skip("no redis-server on PATH to start a private Redis")
    port = free_port()

    def redis_up() -> subprocess.Popen[bytes]:
        proc = subprocess.Popen(
            [server, "--port", str(port), "--bind", "127.0.0.1", "--save", ""],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        wait_until(
            lambda: (
                subprocess.run(
                    ["redis-cli", "-p", str(port), "ping"], capture_output=True, check=False
                ).stdout.strip()
                == b"PONG"
            ),
            10,
            0.1,
            "the private Redis",
        )
        return proc

    private = migrated.model_copy(update={"redis_url": f"redis://127.0.0.1:{port}/0"})
    redis_proc = redis_up()
    cluster = Cluster(private, tmp_path)
    try:
        cluster.beat()
        cluster.wait_ready()
        time.sleep(2)
        redis_proc.send_signal(signal.SIGKILL)
        redis_proc.wait(5)
        time.sleep(5)
        redis_proc = redis_up()
        wait_until(
            lambda: len(lines_with(tmp_path, "beat", "answers again")) == 2,
            30,
            what="both recovery lines",
        )
        logs = cluster.logs(tail=10**6)
        for service in ("Redis", "the broker"):
            assert len(lines_with(tmp_path, "beat", f"{service} does not answer")) == 1, logs
            assert len(lines_with(tmp_path, "beat", f"{service} answers again")) == 1, logs
        assert "Traceback" not in logs and "Message Error" not in logs, logs
    finally:
        cluster.stop()
        redis_proc.send_signal(signal.SIGKILL)
        redis_proc.wait(5)

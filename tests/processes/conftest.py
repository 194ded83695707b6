"""Real Celery worker and beat processes, started as subprocesses against this run's
database and Redis db, and stopped (whole process groups) at the end of each test."""

from __future__ import annotations

import signal
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import psycopg
import pytest
from sqlalchemy import Engine, text

from harvest.app import Harvest
from harvest.procs import ProcessGroup
from harvest.settings import Settings

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
        super().__init__(env, log_dir)
        self.settings = settings

    def kill(self, proc: subprocess.Popen[bytes], sig: int = signal.SIGKILL) -> None:
        self.signal(proc, sig)

    def children(self, proc: subprocess.Popen[bytes]) -> list[int]:
        out = subprocess.run(
            ["pgrep", "-P", str(proc.pid)], capture_output=True, text=True, check=False
        ).stdout
        return [int(p) for p in out.split()]


@pytest.fixture
def cluster(
    migrated: Settings, clean_db: Engine, redis_client: object, tmp_path: Path
) -> Iterator[Cluster]:
    c = Cluster(migrated, tmp_path)
    yield c
    c.stop()


@pytest.fixture
def client_app(migrated: Settings) -> Iterator[Harvest]:
    """The enqueuing side, with the test jobs registered."""
    app = Harvest(migrated)
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


def statuses(engine: Engine, ids: list[int]) -> dict[str, int]:
    """How many of the jobs ``ids`` are in each status: ``{"succeeded": 3, ...}``."""
    with engine.connect() as conn:
        rows = conn.execute(
            text("SELECT status, count(*) FROM harvest_jobs WHERE id = ANY(:ids) GROUP BY status"),
            {"ids": ids},
        ).all()
    return {r[0]: r[1] for r in rows}

"""A misconfigured worker or beat exits at start, within 10 s, non-zero, with one line on stderr
naming the problem (secrets masked) and no traceback; a well configured one starts."""

from __future__ import annotations

import os
import secrets
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import psycopg
import pytest
from alembic.script import ScriptDirectory

from harvest import migrate
from harvest.settings import Settings
from tests.conftest import ADMIN_URL

pytestmark = pytest.mark.slow

SECRET = "s3cret-pa55"
WORKER = ["worker", "-Q", "schedule", "-c", "1"]
# The revision this harvest needs, read from its own migrations (a new migration moves it).
HEAD = ScriptDirectory.from_config(migrate.alembic_config(Settings())).get_current_head()
BEAT = ["beat"]


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


@pytest.fixture(scope="module")
def databases() -> Iterator[dict[str, str]]:
    """An empty database and one migrated to the revision before the head, on the test server."""
    base = ADMIN_URL.rsplit("/", 1)[0].replace("postgresql://", "postgresql+psycopg://", 1)
    names = {kind: f"harvest_test_{secrets.token_hex(4)}_{kind}" for kind in ("empty", "old")}
    with psycopg.connect(ADMIN_URL, autocommit=True) as conn:
        for name in names.values():
            conn.execute(f'CREATE DATABASE "{name}"')
    urls = {kind: f"{base}/{name}" for kind, name in names.items()}
    migrate.upgrade(Settings(database_url=urls["old"]), "0004_flow_control")
    yield urls
    with psycopg.connect(ADMIN_URL, autocommit=True) as conn:
        for name in names.values():
            conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


def start(args: list[str], folder: Path, **env: str) -> tuple[int, list[str], float]:
    """``celery -A harvest.worker <args>`` in ``folder``: (exit code, stderr lines, seconds)."""
    environ = {k: v for k, v in os.environ.items() if not k.startswith("HARVEST_")}
    environ.update(HARVEST_DEV_DIR=str(folder / ".harvest"), **env)
    started = time.monotonic()
    try:
        done = subprocess.run(
            [sys.executable, "-m", "celery", "-A", "harvest.worker", *args, "-s", "sched"]
            if args == BEAT
            else [sys.executable, "-m", "celery", "-A", "harvest.worker", *args],
            cwd=folder,
            env=environ,
            capture_output=True,
            text=True,
            timeout=10,
            check=False,
        )
    except subprocess.TimeoutExpired as exc:
        raise AssertionError(f"still running after 10 s: {exc.stderr!r}") from None
    lines = [line for line in done.stderr.splitlines() if line.strip()]
    return done.returncode, lines, time.monotonic() - started


def assert_one_line(outcome: tuple[int, list[str], float], code: int, *words: str) -> str:
    rc, lines, seconds = outcome
    assert rc == code, lines
    assert len(lines) == 1, lines
    line = lines[0]
    assert "Traceback" not in line and SECRET not in line, line
    for word in words:
        assert word in line, line
    assert seconds < 10
    return line


@pytest.fixture
def folder(tmp_path: Path) -> Path:
    (tmp_path / "myjobs.py").write_text(
        "from harvest import Harvest, JobContext\n\napp = Harvest()\n\n\n"
        '@app.job("fetch_page")\ndef fetch_page(ctx: JobContext, url: str) -> None:\n    pass\n'
    )
    (tmp_path / "broken.py").write_text(
        f'raise RuntimeError("cannot start: postgresql://app:{SECRET}@db/prod")\n'
    )
    return tmp_path


@pytest.fixture
def good(migrated: Settings) -> dict[str, str]:
    return {
        "HARVEST_DATABASE_URL": migrated.database_url,
        "HARVEST_REDIS_URL": migrated.redis_url,
        "HARVEST_IMPORTS": "myjobs",
    }


@pytest.mark.parametrize("args", [WORKER, BEAT], ids=["worker", "beat"])
def test_unreachable_database(folder: Path, good: dict[str, str], args: list[str]) -> None:
    url = f"postgresql+psycopg://postgres:{SECRET}@127.0.0.1:{free_port()}/harvest"
    line = assert_one_line(
        start(args, folder, **{**good, "HARVEST_DATABASE_URL": url}), 69, "Postgres is unavailable"
    )
    assert "postgres:***@127.0.0.1" in line


@pytest.mark.parametrize("args", [WORKER, BEAT], ids=["worker", "beat"])
def test_unmigrated_database(
    folder: Path, good: dict[str, str], databases: dict[str, str], args: list[str]
) -> None:
    env = {**good, "HARVEST_DATABASE_URL": databases["empty"]}
    assert_one_line(start(args, folder, **env), 78, "not migrated", "harvest db upgrade")


def test_database_behind_this_version(
    folder: Path, good: dict[str, str], databases: dict[str, str]
) -> None:
    env = {**good, "HARVEST_DATABASE_URL": databases["old"]}
    assert_one_line(
        start(WORKER, folder, **env), 78, "0004_flow_control", f"needs {HEAD}", "harvest db upgrade"
    )


@pytest.mark.parametrize("args", [WORKER, BEAT], ids=["worker", "beat"])
def test_jobs_module_not_found(folder: Path, good: dict[str, str], args: list[str]) -> None:
    env = {**good, "HARVEST_IMPORTS": "myjobs,myjobz"}
    assert_one_line(start(args, folder, **env), 78, "HARVEST_IMPORTS", "'myjobz'", str(folder))


def test_jobs_module_raises_at_import(folder: Path, good: dict[str, str]) -> None:
    line = assert_one_line(
        start(WORKER, folder, **{**good, "HARVEST_IMPORTS": "broken"}),
        78,
        "importing 'broken' raised RuntimeError",
    )
    assert "postgresql://app:***@db/prod" in line


@pytest.mark.parametrize("args", [WORKER, BEAT], ids=["worker", "beat"])
def test_invalid_settings(folder: Path, good: dict[str, str], args: list[str]) -> None:
    env = {**good, "HARVEST_DISPATCH_INTERVAL": "-1", "HARVEST_LEASE_TTL": "soon"}
    assert_one_line(
        start(args, folder, **env), 78, "HARVEST_DISPATCH_INTERVAL", "HARVEST_LEASE_TTL"
    )
    url = f"mysql://app:{SECRET}@db/prod"
    line = assert_one_line(
        start(args, folder, **{**good, "HARVEST_DATABASE_URL": url}), 78, "HARVEST_DATABASE_URL"
    )
    assert "got a mysql:// URL" in line  # the scheme only: nothing else of the URL is echoed


def test_unreachable_redis(folder: Path, good: dict[str, str]) -> None:
    url = f"redis://:{SECRET}@127.0.0.1:{free_port()}/1"
    env = {**good, "HARVEST_REDIS_URL": url, "HARVEST_BROKER_URL": good["HARVEST_REDIS_URL"]}
    line = assert_one_line(start(WORKER, folder, **env), 69, "Redis is unavailable")
    assert ":***@127.0.0.1" in line


def test_a_well_configured_worker_starts(folder: Path, good: dict[str, str]) -> None:
    """The same command with good settings passes the checks and says "ready"."""
    environ = {k: v for k, v in os.environ.items() if not k.startswith("HARVEST_")}
    log = folder / "worker.log"
    with log.open("wb") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "celery", "-A", "harvest.worker", *WORKER, "-l", "INFO"],
            cwd=folder,
            env={**environ, **good},
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    try:
        deadline = time.monotonic() + 30
        while "ready." not in log.read_text() and proc.poll() is None:
            assert time.monotonic() < deadline, log.read_text()
            time.sleep(0.2)
        assert proc.poll() is None, log.read_text()
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(15)

"""The operating commands as a user runs them: the `harvest` console script in a subprocess,
against real Postgres and Redis (this run's private database and Redis db). Output is checked;
a user mistake is a non-zero exit with exactly one line on stderr and never a traceback."""

from __future__ import annotations

import os
import re
import secrets
import socket
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import psycopg
import pytest
import redis
from cryptography.fernet import Fernet
from sqlalchemy import Engine, text

from harvest import store
from harvest.app import Harvest
from harvest.coordination.key_pool import KeyPool, Lease
from harvest.runner import Runner
from harvest.settings import Settings
from tests.conftest import ADMIN_URL

HARVEST = str(Path(sys.executable).parent / "harvest")
ROOT = Path(__file__).resolve().parents[2]
SENTINEL = "sk-SENTINEL-stats-" + secrets.token_hex(16)
UNREACHABLE_DB = "postgresql+psycopg://harvest:SENTINEL-pw@127.0.0.1:1/nowhere"


def base_env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("HARVEST_")}
    env |= {"COLUMNS": "200", "PYTHONPATH": str(ROOT), "HARVEST_IMPORTS": "tests.jobs"}
    return env | extra


@dataclass
class Cli:
    env: dict[str, str]

    def run(
        self, *args: str, env: dict[str, str] | None = None
    ) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [HARVEST, *args],
            capture_output=True,
            text=True,
            env=env or self.env,
            timeout=120,
            check=False,
            stdin=subprocess.DEVNULL,
        )

    def ok(self, *args: str, env: dict[str, str] | None = None) -> str:
        done = self.run(*args, env=env)
        assert done.returncode == 0, done.stdout + done.stderr
        assert done.stderr == "", done.stderr
        return done.stdout

    def refused(self, *args: str, env: dict[str, str] | None = None) -> str:
        """A user mistake: non-zero exit, exactly one line on stderr (returned), no traceback."""
        done = self.run(*args, env=env)
        assert done.returncode != 0, done.stdout
        lines = done.stderr.strip().splitlines()
        assert len(lines) == 1, done.stderr
        assert "Traceback" not in done.stderr + done.stdout
        return lines[0]


@pytest.fixture
def cli(migrated: Settings, clean_db: Engine, redis_client: redis.Redis) -> Cli:
    return Cli(
        base_env(HARVEST_DATABASE_URL=migrated.database_url, HARVEST_REDIS_URL=migrated.redis_url)
    )


@pytest.fixture
def app(migrated: Settings) -> Iterator[Harvest]:
    harvest = Harvest(migrated)
    harvest.load_imports(["tests.jobs"])
    yield harvest
    harvest.close()


def row(table: str, label: str) -> str:
    """The value column of the row of a rendered table whose first column starts with label."""
    for line in table.splitlines():
        cells = [c.strip() for c in re.split(r"[│┃]", line) if c.strip()]
        if len(cells) >= 2 and cells[0].startswith(label):
            return cells[-1]
    raise AssertionError(f"no row {label!r} in:\n{table}")


def run_in_process(app: Harvest) -> None:
    """Run every due job once with the real runner, in this process (no Celery)."""
    with app.engine.begin() as conn:
        claimed = store.claim_due(conn, limit=100, ttl=300)
    runner = Runner(app)
    try:
        runner.execute([[c.id, str(c.token)] for c in claimed])
    finally:
        runner.close()


# --- help -------------------------------------------------------------------------------------


def test_help_documents_every_command(cli: Cli) -> None:
    top = cli.ok("--help")
    for command in ("dev", "db", "enqueue", "jobs", "stats", "top", "keys", "metrics", "demo"):
        assert re.search(rf"│ {command}\s", top), f"{command} missing from --help:\n{top}"
    for group, commands in {
        "dev": ("up", "down", "status"),
        "db": ("upgrade", "downgrade", "current"),
        "jobs": ("ls", "show", "retry", "cancel"),
        "keys": ("add", "ls", "disable", "enable", "rm", "sync"),
    }.items():
        listing = cli.ok(group, "--help")
        for command in commands:
            assert re.search(rf"│ {command}\s", listing), f"{group} {command} missing"
    enqueue = cli.ok("enqueue", "--help")
    for option in ("--payload", "--delay", "--priority", "--idempotency-key"):
        assert option in enqueue
    for option in ("--status", "--name", "--limit"):
        assert option in cli.ok("jobs", "ls", "--help")
    assert "--iterations" in cli.ok("top", "--help")
    assert "--port" in cli.ok("metrics", "--help")
    assert "--jobs" in cli.ok("demo", "--help")


# --- dev --------------------------------------------------------------------------------------


def test_dev_up_status_down_with_configured_services(cli: Cli, tmp_path: Path) -> None:
    env = cli.env | {"HARVEST_DEV_DIR": str(tmp_path / "dev")}
    up = cli.ok("dev", "up", env=env)
    assert re.search(r"│ postgres\s+│ postgresql\+psycopg://\S+\s+│ env", up), up
    assert re.search(r"│ redis\s+│ redis://\S+\s+│ env", up), up
    assert (tmp_path / "dev" / "dev.json").exists()
    status = cli.ok("dev", "status", env=env)
    assert re.search(r"│ postgres .*│ yes", status) and re.search(r"│ redis .*│ yes", status)
    assert cli.ok("dev", "down", env=env).strip() == "nothing to stop"  # it started nothing
    down_redis = env | {"HARVEST_REDIS_URL": "redis://127.0.0.1:1/0"}
    cli.ok("dev", "up", env=down_redis)
    done = cli.run("dev", "status", env=down_redis)
    assert done.returncode == 1  # a service that does not answer fails the status
    assert re.search(r"│ redis .*│ no: ", done.stdout), done.stdout
    fresh = env | {"HARVEST_DEV_DIR": str(tmp_path / "empty")}
    done = cli.run("dev", "status", env=fresh)
    assert done.returncode == 1 and "no services recorded" in done.stdout


# --- db ---------------------------------------------------------------------------------------


@pytest.fixture
def private_db(migrated: Settings) -> Iterator[str]:
    """An empty database of its own (URL), dropped after."""
    name = f"harvest_cli_{secrets.token_hex(4)}"
    with psycopg.connect(ADMIN_URL, autocommit=True) as conn:
        conn.execute(f'CREATE DATABASE "{name}"')
    yield migrated.database_url.rsplit("/", 1)[0] + "/" + name
    with psycopg.connect(ADMIN_URL, autocommit=True) as conn:
        conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


def test_db_upgrade_current_downgrade(cli: Cli, private_db: str) -> None:
    env = cli.env | {"HARVEST_DATABASE_URL": private_db}
    assert cli.ok("db", "current", env=env).strip() == "base (not migrated)"
    line = cli.refused("stats", env=env)
    assert line == "error: the database has no harvest tables: run `harvest db upgrade` first"

    upgraded = cli.ok("db", "upgrade", env=env)
    head = re.fullmatch(r"database at (\S+)\n", upgraded)
    assert head, upgraded
    assert cli.ok("db", "current", env=env).strip() == head.group(1)
    assert "depth" in cli.ok("stats", env=env)  # the schema is there now

    assert cli.ok("db", "downgrade", "base", env=env).strip() == "database at base"
    assert cli.ok("db", "current", env=env).strip() == "base (not migrated)"
    with psycopg.connect(private_db.replace("+psycopg", "")) as conn:
        tables = conn.execute(
            "SELECT count(*) FROM pg_tables WHERE tablename LIKE 'harvest%'"
        ).fetchone()
    assert tables == (1,)  # only Alembic's version table is left
    assert "migration" in cli.refused("db", "upgrade", "no-such-revision", env=env)


# --- enqueue and jobs -------------------------------------------------------------------------


def test_enqueue_ls_show_cancel(cli: Cli, clean_db: Engine) -> None:
    first = int(cli.ok("enqueue", "echo", "--payload", '{"value": 42}', "--delay", "600"))
    again = cli.ok("enqueue", "echo", "--payload", '{"value": 1}', "--idempotency-key", "k-1")
    same = cli.ok("enqueue", "echo", "--payload", '{"value": 1}', "--idempotency-key", "k-1")
    assert same.strip() == f"{int(again)} (already enqueued with this key)"
    urgent = int(cli.ok("enqueue", "noop", "--priority", "7"))

    listing = cli.ok("jobs", "ls")
    for job_id in (first, int(again), urgent):
        assert re.search(rf"│ {job_id}\s+│", listing)
    only_echo = cli.ok("jobs", "ls", "--name", "echo", "--status", "pending", "--limit", "1")
    assert re.search(rf"│ {int(again)}\s+│ echo", only_echo)  # newest first, limit 1
    assert not re.search(rf"│ {first}\s+│", only_echo)
    assert "noop" not in only_echo

    shown = cli.ok("jobs", "show", str(first))
    assert row(shown, "name") == "echo"
    assert row(shown, "status") == "pending"
    assert row(shown, "attempts") == "0/3"
    assert row(shown, "payload") == '{"value": 42}'
    assert row(shown, "priority") == "0"
    assert row(shown, "started") == "-"
    assert row(cli.ok("jobs", "show", str(urgent)), "priority") == "7"

    assert cli.ok("jobs", "cancel", str(first)).strip() == f"job {first}: cancelled"
    assert row(cli.ok("jobs", "show", str(first)), "status") == "cancelled"
    assert re.search(
        rf"│ {first}\s+│ echo\s+│ cancelled", cli.ok("jobs", "ls", "--status", "cancelled")
    )
    with clean_db.connect() as conn:
        assert conn.execute(text("SELECT count(*) FROM harvest_jobs")).scalar_one() == 3


def test_show_a_dead_job_with_its_traceback_then_retry_it(
    cli: Cli, app: Harvest, clean_db: Engine
) -> None:
    job_id = int(cli.ok("enqueue", "permanent_failure"))
    run_in_process(app)
    shown = cli.ok("jobs", "show", str(job_id))
    assert row(shown, "status") == "failed"
    assert row(shown, "attempts") == "1/5"
    assert "PermanentError: this input can never work" in row(shown, "last error")
    assert row(shown, "started") != "-" and row(shown, "finished") != "-"  # timings
    assert "last traceback" in shown
    assert "Traceback (most recent call last)" in shown
    assert 'raise PermanentError("this input can never work")' in shown
    assert "attempts (the last 20)" in shown  # the attempt history, one row per attempt
    [attempt] = [line for line in shown.splitlines() if re.match(r"^\s*│\s*1\s*│", line)]
    assert "failed" in attempt and "PermanentError" in attempt

    assert cli.ok("jobs", "retry", str(job_id)).strip() == f"job {job_id}: pending"
    shown = cli.ok("jobs", "show", str(job_id))
    assert row(shown, "status") == "pending"
    assert row(shown, "attempts") == "1/5"
    line = cli.refused("jobs", "retry", str(job_id))
    assert line == f"error: job {job_id} is pending, not failed (only dead jobs can be retried)"


# --- stats and top ----------------------------------------------------------------------------


def test_stats_and_top(cli: Cli, app: Harvest, clean_db: Engine, redis_client: redis.Redis) -> None:
    for _ in range(3):
        cli.ok("enqueue", "echo", "--payload", '{"value": "x"}')
    cli.ok("enqueue", "permanent_failure")
    run_in_process(app)
    cli.ok("enqueue", "noop", "--delay", "600")
    with clean_db.begin() as conn:
        conn.execute(text("UPDATE harvest_counters SET value = 0"))
        store.bump(conn, "rescued", 2)
        store.bump(conn, "duplicate_deliveries_suppressed", 5)
    env = cli.env | {"HARVEST_SECRET_KEY": Fernet.generate_key().decode()}
    done = subprocess.run(
        [HARVEST, "keys", "add", "ai", "main", "--max-concurrency", "3"],
        input=SENTINEL, env=env, capture_output=True, text=True, check=True, timeout=60,
    )  # fmt: skip
    assert "added key" in done.stdout
    subprocess.run(
        [HARVEST, "keys", "add", "ai", "spare", "--max-concurrency", "2"],
        input=SENTINEL + "-2", env=env, capture_output=True, text=True, check=True, timeout=60,
    )  # fmt: skip
    cli.ok("keys", "disable", "ai", "spare")
    assert isinstance(KeyPool(redis_client, "ai").lease("test", 60.0), Lease)

    table = cli.ok("stats")
    assert row(table, "depth execution / succeeded") == "3"
    assert row(table, "depth execution / failed") == "1"
    assert row(table, "depth execution / pending") == "1"
    assert row(table, "succeeded / failed / cancelled") == "3 / 1 / 0"
    assert row(table, "throughput (last minute)") == f"{4 / 60:.1f} jobs/s"
    assert re.fullmatch(r"[\d.]+ ms / [\d.]+ ms / [\d.]+ ms", row(table, "run time p50/p95/p99"))
    assert re.fullmatch(r"[\d.]+ ms / [\d.]+ ms / [\d.]+ ms", row(table, "enqueue-to-start"))
    assert row(table, "rescued") == "2"
    assert row(table, "duplicate deliveries suppressed") == "5"
    assert row(table, "lost outcomes dropped") == "0"
    assert row(table, "key pool ai: keys active / cooling / disabled") == "1 / 0 / 1"
    assert row(table, "key pool ai: leases / capacity") == "1 / 3 (33%)"
    assert SENTINEL not in table

    top = cli.ok("top", "--iterations", "2", "--interval", "0.1")
    assert top.count("harvest stats") == 2  # not a terminal: one table per refresh
    assert row(top, "depth execution / succeeded") == "3"
    assert row(top, "key pool ai: leases / capacity") == "1 / 3 (33%)"
    assert "every 0.1s" in top


def test_stats_without_redis_still_shows_postgres_figures(cli: Cli) -> None:
    cli.ok("enqueue", "noop", "--delay", "600")
    env = cli.env | {"HARVEST_SECRET_KEY": Fernet.generate_key().decode()}
    subprocess.run(
        [HARVEST, "keys", "add", "ai", "main"],
        input=SENTINEL, env=env, capture_output=True, text=True, check=True, timeout=60,
    )  # fmt: skip
    no_redis = cli.env | {"HARVEST_REDIS_URL": "redis://127.0.0.1:1/0"}
    table = cli.ok("stats", env=no_redis)
    assert row(table, "depth execution / pending") == "1"
    assert row(table, "key pools").startswith("Redis is unavailable: ")
    assert "Redis is unavailable" in cli.refused("keys", "ls", env=no_redis)


# --- user mistakes ----------------------------------------------------------------------------


def test_user_mistakes_are_one_line(cli: Cli, clean_db: Engine) -> None:
    line = cli.refused("enqueue", "no_such_job")
    assert line.startswith("error: unknown job 'no_such_job' (registered: ")
    line = cli.refused("enqueue", "echo", "--payload", "{not json")
    assert line.startswith("error: invalid payload: --payload is not JSON: ")
    assert "object" in cli.refused("enqueue", "echo", "--payload", "[1, 2]")
    assert "priority" in cli.refused("enqueue", "echo", "--priority", "5000")
    assert cli.refused("jobs", "show", "987654") == "error: no job with id 987654"
    assert cli.refused("jobs", "cancel", "987654") == "error: no job with id 987654"
    assert "987654" in cli.refused("jobs", "retry", "987654")
    assert cli.refused("jobs", "show", "abc").startswith("error: ")
    assert cli.refused("nonsense") == "error: No such command 'nonsense'."
    assert "--port" in cli.refused("metrics", "--port", "70000")
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        line = cli.refused("metrics", "--port", str(port))
    assert line == f"error: cannot listen on 127.0.0.1:{port}: Address already in use"
    bad = cli.env | {"HARVEST_LEASE_TTL": "soon", "HARVEST_SECRET_KEY": SENTINEL}
    line = cli.refused("stats", env=bad)
    assert line == (
        "error: bad configuration: HARVEST_LEASE_TTL: "
        "Input should be a valid number, unable to parse string as a number"
    )
    sqlite = cli.env | {"HARVEST_DATABASE_URL": "sqlite:///jobs.db"}
    assert "SQLite" in cli.refused("jobs", "ls", env=sqlite)
    with clean_db.connect() as conn:
        assert conn.execute(text("SELECT count(*) FROM harvest_jobs")).scalar_one() == 0


@pytest.mark.parametrize(
    "args",
    [
        ("stats",),
        ("top", "--iterations", "1"),
        ("jobs", "ls"),
        ("jobs", "show", "1"),
        ("jobs", "cancel", "1"),
        ("jobs", "retry", "1"),
        ("enqueue", "echo"),
        ("db", "current"),
        ("db", "upgrade"),
        ("keys", "ls"),
    ],
)
def test_an_unreachable_database_is_one_line(cli: Cli, args: tuple[str, ...]) -> None:
    env = cli.env | {"HARVEST_DATABASE_URL": UNREACHABLE_DB}
    line = cli.refused(*args, env=env)
    assert line.startswith("error: Postgres is unavailable: "), line
    assert "SENTINEL-pw" not in line


def test_workers_lists_live_processes_and_the_jobs_they_hold(cli: Cli, app: Harvest) -> None:
    """`harvest workers` reads the registry the execution processes write every 2 s, and
    names the jobs each holds (from Postgres)."""
    import time

    from harvest.coordination import keys
    from harvest.execution import registry

    app.redis.delete(keys.worker_index())  # processes other tests' runners left listed
    assert cli.ok("workers").strip() == "no execution process is alive"
    job_id = app.enqueue("echo", {"value": 1}).id
    with app.engine.begin() as conn:
        store.claim_due(conn, limit=10, ttl=60)  # dispatched: held by a worker
    info = registry.WorkerInfo(
        id="hostA:4242", hostname="hostA", pid=4242, queues=("execution",), pool="prefork",
        concurrency=1, async_concurrency=100, started_at=time.time(), in_flight=1,
        running=(job_id,),
    )  # fmt: skip
    registry.beat(app.redis, info, ttl=30)
    shown = cli.ok("workers")
    assert "hostA:4242" in shown and f"echo#{job_id}" in shown and "1+100" in shown
    registry.leave(app.redis, info.id)
    assert "hostA:4242" not in cli.ok("workers")


def test_bad_input_of_issue_13_is_one_line_and_stores_nothing(cli: Cli, clean_db: Engine) -> None:
    huge = "1" + "0" * 5000
    line = cli.refused("enqueue", "echo", "--payload", f'{{"a": {huge}}}')
    assert line.startswith("error: invalid payload: --payload cannot be read: "), line
    line = cli.refused("enqueue", "echo", "--payload", "null")
    assert line == (
        "error: invalid payload: --payload must be a JSON object (the handler's keyword "
        "arguments), got null"
    )
    # Bytes that are not UTF-8 (the shell passes them through; Python keeps them as
    # surrogates): refused, never echoed.
    for args in (("enqueue", "echo\udcff"), ("jobs", "ls", "--name", "\udcffx")):
        done = subprocess.run(
            [os.fsencode(HARVEST), *(os.fsencode(a) for a in args)],
            capture_output=True,
            env={k.encode(): v.encode() for k, v in cli.env.items()},
            timeout=60,
            check=False,
        )
        assert done.returncode == 2
        assert (
            done.stderr.decode().strip() == f"error: argument {len(args)} is not valid UTF-8 text"
        )
    line = cli.refused("jobs", "ls", "--status", "bogus")
    assert line.startswith("error: invalid status: must be one of pending, dispatched, running")
    with clean_db.connect() as conn:
        assert conn.execute(text("SELECT count(*) FROM harvest_jobs")).scalar_one() == 0


@pytest.mark.parametrize(
    ("url", "says"),
    [
        ("postgresql://harvest:SENTINEL-pw@db:abc/jobs", "the port is not a number"),
        ("mysql://harvest:SENTINEL-pw@db/jobs", "got a mysql:// URL"),
        ("SENTINEL-pw@db/jobs", "got a value that is not a URL"),
        ("harvest:SENTINEL-pw", "got a value that is not a URL"),
    ],
)
def test_a_bad_database_url_is_one_line_without_its_secret(cli: Cli, url: str, says: str) -> None:
    line = cli.refused("jobs", "ls", env=cli.env | {"HARVEST_DATABASE_URL": url})
    assert line.startswith("error: bad configuration: HARVEST_DATABASE_URL: ") and says in line
    assert "SENTINEL" not in line and "SQLite" not in line

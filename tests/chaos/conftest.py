"""The chaos suite's world: PRIVATE Postgres and Redis servers (started with ``harvest.dev`` on
free loopback ports for this session, stopped at its end), real worker and beat processes, a
loopback API server that logs every call (the overlap oracle), and the figures of each case.

Nothing here touches the machine's own services: every fault (restart, stop, terminate) is
applied to the private servers of this session only.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import psycopg
import pytest
import redis
from cryptography.fernet import Fernet
from pydantic import SecretStr
from sqlalchemy import Engine, create_engine, text

from harvest import dev, keystore
from harvest.app import Harvest
from harvest.dev import ServerRecord
from harvest.procs import ROOT, ProcessGroup
from harvest.settings import Settings
from tests.chaos import jobs as chaos_jobs
from tests.chaos.report import LATEST, Report, Row
from tests.helpers import statuses
from tests.processes.api_server import ApiServer, Call

T = TypeVar("T")

CHAOS_ENV = {
    "HARVEST_IMPORTS": "tests.chaos.jobs",
    "HARVEST_LEASE_TTL": "3",
    "HARVEST_RESCUE_INTERVAL": "1",
    "HARVEST_DISPATCH_TTL": "10",
    "HARVEST_DISPATCH_INTERVAL": "0.25",
    "HARVEST_NUDGE_COALESCE_MS": "100",
    "HARVEST_DEFAULT_TIMEOUT": "25",
    "HARVEST_MAX_TIMEOUT": "30",
    "HARVEST_KEY_WAIT": "1",
    "HARVEST_LEADER_TTL": "3",
    "HARVEST_RETRY_BASE": "0.2",
    "HARVEST_RETRY_MAX": "2",
}
KEYS = 16  # keys of the chaos pool, max_concurrency 1 each: any overlap is a violation
SENTINEL = "sk-chaosSENTINEL" + os.urandom(8).hex()  # planted as every key's secret (S5)

_report = Report()


def report() -> Report:
    return _report


# --- private services ---------------------------------------------------------------------


@dataclass
class Services:
    """The session's private Postgres and Redis, and the faults the suite applies to them."""

    state: Path
    database_url: str
    redis_url: str
    pg: ServerRecord
    rd: ServerRecord
    secret_key: str = field(default_factory=lambda: Fernet.generate_key().decode())

    @property
    def pg_port(self) -> int:
        return self.pg.port

    @property
    def redis_port(self) -> int:
        return self.rd.port

    @property
    def psycopg_url(self) -> str:
        return self.database_url.replace("postgresql+psycopg://", "postgresql://")

    def settings(self, **overrides: Any) -> Settings:
        values: dict[str, Any] = {
            "database_url": self.database_url,
            "redis_url": self.redis_url,
            "secret_key": SecretStr(self.secret_key),
            **overrides,
        }
        return Settings(**values)

    # Redis: stopped by its pid file, started again from its own config (same port).
    def _redis_pid(self) -> int | None:
        with contextlib.suppress(OSError, ValueError):
            pid = int((Path(self.rd.data_dir) / "redis.pid").read_text().strip())
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
            if b"redis-server" in cmdline and str(self.redis_port).encode() in cmdline:
                return pid
        return None

    def redis_stop(self) -> None:
        pid = self._redis_pid()
        if pid is not None:
            os.kill(pid, signal.SIGTERM)
            _wait(lambda: not Path(f"/proc/{pid}").exists(), 15, "redis to stop")

    def redis_start(self) -> None:
        conf = Path(self.rd.data_dir) / "redis.conf"
        subprocess.run([self.rd.executable, str(conf)], check=True, timeout=30)
        _wait(self.redis_answers, 30, "redis to answer")

    def redis_answers(self) -> bool:
        client = redis.Redis.from_url(self.redis_url, socket_timeout=1, socket_connect_timeout=1)
        try:
            return bool(client.ping())
        except redis.RedisError:
            return False
        finally:
            client.close()

    # Postgres: pg_ctl stop (fast) and start on the same data directory (same port).
    def _pg_ctl(self, *args: str) -> None:
        pg_ctl = str(Path(self.pg.executable).with_name("pg_ctl"))
        argv = [pg_ctl, "-D", self.pg.data_dir, *args]
        if self.pg.run_as:
            argv = ["runuser", "-u", self.pg.run_as, "--", *argv]
        subprocess.run(
            argv,
            check=True,
            timeout=60,
            cwd=Path(self.pg.data_dir).parent,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )

    def pg_stop(self) -> None:
        self._pg_ctl("-w", "-t", "30", "-m", "fast", "stop")

    def pg_start(self) -> None:
        self._pg_ctl("-l", self.pg.log_file, "-w", "-t", "30", "start")
        _wait(self.pg_answers, 30, "postgres to answer")

    def pg_running(self) -> bool:
        return (Path(self.pg.data_dir) / "postmaster.pid").exists()

    def pg_answers(self) -> bool:
        try:
            with psycopg.connect(self.psycopg_url, connect_timeout=2) as conn:
                conn.execute("SELECT 1")
            return True
        except psycopg.Error:
            return False

    def admin(self) -> psycopg.Connection[Any]:
        return psycopg.connect(self.psycopg_url, autocommit=True, application_name="chaos-test")


def _wait(predicate: Callable[[], bool], timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out after {timeout}s waiting for {what}")
        time.sleep(0.1)


def wait_until(
    predicate: Callable[[], T], timeout: float, interval: float = 0.2, what: str = "condition"
) -> T:
    """The predicate's first truthy value, polled for at most ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what}")
        time.sleep(interval)


@pytest.fixture(scope="session")
def services() -> Iterator[Services]:
    # Not under pytest's basetemp: when running as root the servers run as the postgres user,
    # which must traverse the parents, and any pytest session re-locks /tmp/pytest-of-<user>.
    state_dir = Path(tempfile.mkdtemp(prefix="harvest-chaos-"))
    state_dir.chmod(0o755)
    state = dev.up(state_dir, probe_postgres=None, probe_redis=None)
    pg, rd = state.server("postgres"), state.server("redis")
    assert pg is not None and rd is not None, "harvest.dev did not start private servers"
    svc = Services(state_dir, state.database_url, state.redis_url, pg, rd)
    try:
        from harvest.migrate import upgrade

        upgrade(svc.settings(), "head")
        with svc.admin() as conn:
            conn.execute(chaos_jobs.SCHEMA)
        yield svc
    finally:
        with contextlib.suppress(Exception):
            if svc.pg_running():
                svc.pg_stop()
        with contextlib.suppress(Exception):
            svc.redis_stop()
        dev.down(state_dir)
        shutil.rmtree(state_dir, ignore_errors=True)


# --- processes ----------------------------------------------------------------------------


class ChaosCluster(ProcessGroup):
    """Worker and beat processes against the private services; each may run in a network
    namespace (``netns``) with its own environment overrides."""

    def __init__(self, env: dict[str, str], log_dir: Path) -> None:
        super().__init__(env, log_dir)
        self.log_of: dict[int, Path] = {}

    def start(  # type: ignore[override]
        self, name: str, args: list[str], netns: str | None = None, **env: str
    ) -> subprocess.Popen[bytes]:
        path = self.log_dir / f"{name}-{len(self.procs)}.log"
        prefix = ["ip", "netns", "exec", netns] if netns else []
        with path.open("wb") as log:
            proc = subprocess.Popen(
                [*prefix, sys.executable, "-m", "celery", "-A", "workers", *args],
                cwd=ROOT,
                env={**self.env, **env},
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                start_new_session=True,
            )
        self.procs.append(proc)
        self.log_of[proc.pid] = path
        return proc

    def worker(  # type: ignore[override]
        self,
        queue: str,
        concurrency: int = 2,
        netns: str | None = None,
        *,
        celery_defaults: bool = False,
        **env: str,
    ) -> subprocess.Popen[bytes]:
        """A worker; ``celery_defaults``: with Celery's gossip, mingle and heartbeat on, as the
        README's worker commands run."""
        node = f"{queue}-{len(self.procs)}-{os.getpid()}@%h"
        quiet = [] if celery_defaults else ["--without-gossip", "--without-mingle",
                                            "--without-heartbeat"]  # fmt: skip
        args = [
            "worker", "-Q", queue, "-c", str(concurrency), "-n", node, "-l", "INFO", *quiet,
            "--pool", "prefork",
        ]  # fmt: skip
        return self.start(f"worker-{queue}", args, netns=netns, **env)

    def beat(self, **env: str) -> subprocess.Popen[bytes]:
        schedule = self.log_dir / f"beat-{len(self.procs)}-schedule"
        return self.start("beat", ["beat", "-l", "INFO", "-s", str(schedule)], **env)

    def stop(self, timeout: float = 15.0) -> None:
        """The case is over: SIGCONT (a paused process) and SIGKILL every process group."""
        for proc in self.procs:
            self.signal(proc, signal.SIGCONT)
            self.signal(proc, signal.SIGKILL)
        for proc in self.procs:
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout)
        self.procs.clear()

    def log(self, proc: subprocess.Popen[bytes]) -> str:
        return self.log_of[proc.pid].read_text(errors="replace")

    def wait_worker(self, proc: subprocess.Popen[bytes], timeout: float = 60) -> None:
        """Until this worker logged "ready." (raise if it exits first)."""

        def ready() -> bool:
            if proc.poll() is not None:
                raise RuntimeError(f"worker exited while starting:\n{self.log(proc)[-3000:]}")
            return "ready." in self.log(proc)

        wait_until(ready, timeout, 0.1, "a worker to be ready")

    def children(self, proc: subprocess.Popen[bytes]) -> list[int]:
        """The prefork children of a worker (``ip netns exec`` execs, so its pid is python's)."""
        out = subprocess.run(
            ["pgrep", "-P", str(proc.pid)], capture_output=True, text=True, check=False
        ).stdout
        return [int(p) for p in out.split()]

    def logs_all(self) -> str:
        return self.logs(tail=10**9)


@dataclass
class Roles:
    schedule: subprocess.Popen[bytes]
    execution: list[subprocess.Popen[bytes]]
    beat: subprocess.Popen[bytes]


# --- one case's world ---------------------------------------------------------------------


@dataclass
class Figures:
    jobs: int
    statuses: dict[str, int]
    lost: int  # not succeeded, or succeeded without its effect
    effects: int
    duplicate_effects: int
    executions: int
    duplicate_executions: int
    per_job: dict[int, int]  # executions per job -> how many jobs
    stale: int  # executions whose lease was taken back (their effect refused)
    double_claims: int  # (job, attempt) pairs executed more than once: a double start

    def row(self) -> dict[str, int]:
        """The table's per-case counts, as :func:`record` takes them."""
        return {
            "lost": self.lost,
            "duplicate_effects": self.duplicate_effects,
            "duplicate_executions": self.duplicate_executions,
        }

    def summary(self) -> str:
        spread = ", ".join(f"{n:,} jobs ran {k}x" for k, n in sorted(self.per_job.items()))
        return f"{spread}; stale effects refused {self.stale}"


class World:
    """One case: clean tables and Redis, the key pool, the API server, a cluster, a client."""

    def __init__(self, services: Services, log_dir: Path, env: dict[str, str]) -> None:
        self.services = services
        self.env = {
            **CHAOS_ENV,
            "HARVEST_DATABASE_URL": services.database_url,
            "HARVEST_REDIS_URL": services.redis_url,
            "HARVEST_SECRET_KEY": services.secret_key,
            **env,
        }
        self.settings = services.settings(
            **{
                k.removeprefix("HARVEST_").lower(): v
                for k, v in self.env.items()
                if k.startswith("HARVEST_") and k not in ("HARVEST_SECRET_KEY",)
            }
        )
        # The suite's own reads: not a harvest connection (F5 terminates those).
        self.engine: Engine = create_engine(
            self.settings.database_url,
            pool_size=2,
            pool_pre_ping=True,
            connect_args={"application_name": "chaos-test", "connect_timeout": 5},
        )
        self.cluster = ChaosCluster(self.env, log_dir)
        self.api = ApiServer()
        self.url = ""
        self.client = Harvest(self.settings)
        self.client.load_imports(["tests.chaos.jobs"])
        self.limits: dict[str, int] = {}

    def reset(self) -> None:
        with self.engine.begin() as conn:
            tables = conn.execute(
                text(
                    "SELECT tablename FROM pg_tables WHERE schemaname = 'public' AND "
                    "(tablename LIKE 'harvest\\_%' OR tablename LIKE 'chaos\\_%') "
                    "AND tablename <> 'harvest_alembic_version'"
                )
            ).scalars()
            conn.execute(text(f"TRUNCATE {', '.join(tables)} RESTART IDENTITY CASCADE"))
        r = redis.Redis.from_url(self.services.redis_url)
        r.flushall()
        r.close()

    def add_keys(self, n: int = KEYS, concurrency: int = 1, pool: str = chaos_jobs.POOL) -> None:
        from tests.processes.api_server import digest

        cipher = keystore.Cipher.from_settings(self.settings)
        with self.client.sessions.begin() as session:
            for i in range(n):
                secret = f"{SENTINEL}-{pool}-{i}"
                keystore.add_key(
                    session,
                    cipher,
                    pool=pool,
                    name=f"k{i}",
                    secret=secret,
                    max_concurrency=concurrency,
                )
                self.limits[digest(secret)] = concurrency
        keystore.sync_pool(self.client.engine, self.client.redis, pool)

    def start_api(self) -> str:
        self.url = self.api.start()
        return self.url

    def standard(self, execution: int = 2, concurrency: int = 2) -> Roles:
        """A schedule worker, ``execution`` execution workers and beat; waits until ready."""
        roles = Roles(
            schedule=self.cluster.worker("schedule", concurrency=1),
            execution=[
                self.cluster.worker("execution", concurrency=concurrency) for _ in range(execution)
            ],
            beat=self.cluster.beat(),
        )
        self.cluster.wait_ready()
        return roles

    def executions_of(self, pids: list[int], *, running_at: float | None = None) -> list[Any]:
        """Executions (job_id, attempt, pid) by these processes; with ``running_at`` (epoch
        seconds), only those started before then and not ended by then."""
        if running_at is None:
            return self.sql(
                "SELECT job_id, attempt, pid FROM chaos_executions WHERE pid = ANY(:pids)",
                pids=pids,
            )
        return self.sql(
            "SELECT job_id, attempt, pid FROM chaos_executions WHERE pid = ANY(:pids) "
            "AND started_at < to_timestamp(:t) "
            "AND (ended_at IS NULL OR ended_at > to_timestamp(:t))",
            pids=pids,
            t=running_at,
        )

    def counters(self) -> dict[str, int]:
        return {r[0]: int(r[1]) for r in self.sql("SELECT name, value FROM harvest_counters")}

    def enqueue(self, n: int, name: str = "chaos.work", **payload: Any) -> list[int]:
        if name == "chaos.work":
            payload.setdefault("url", self.url)
        ids = self.client.enqueue_many(name, [dict(payload) for _ in range(n)])
        assert len(ids) == n
        return ids

    def sql(self, query: str, **params: Any) -> list[Any]:
        with self.engine.connect() as conn:
            return list(conn.execute(text(query), params))

    def scalar(self, query: str, **params: Any) -> Any:
        with self.engine.connect() as conn:
            return conn.execute(text(query), params).scalar()

    def statuses(self, ids: list[int]) -> dict[str, int]:
        return statuses(self.engine, ids)

    def wait_done(self, ids: list[int], timeout: float, status: str = "succeeded") -> None:
        def done() -> bool:
            return self.statuses(ids).get(status, 0) == len(ids)

        try:
            wait_until(done, timeout, 0.25, f"{len(ids)} jobs to end {status}")
        except AssertionError:
            print("statuses:", self.statuses(ids))
            raise

    def succeeded_count(self, ids: list[int]) -> int:
        return int(
            self.scalar(
                "SELECT count(*) FROM harvest_jobs_all "
                "WHERE id = ANY(:ids) AND status = 'succeeded'",
                ids=ids,
            )
        )

    def figures(self, ids: list[int]) -> Figures:
        statuses = self.statuses(ids)
        effects = int(
            self.scalar("SELECT count(*) FROM chaos_effects WHERE job_id = ANY(:ids)", ids=ids)
        )
        lost = int(
            self.scalar(
                "SELECT count(*) FROM harvest_jobs_all j WHERE j.id = ANY(:ids) AND "
                "(j.status <> 'succeeded' OR NOT EXISTS "
                "(SELECT 1 FROM chaos_effects e WHERE e.job_id = j.id))",
                ids=ids,
            )
        )
        conflicts = int(
            self.scalar("SELECT count(*) FROM chaos_conflicts WHERE job_id = ANY(:ids)", ids=ids)
        )
        rows = self.sql(
            "SELECT job_id, count(*) FROM chaos_executions WHERE job_id = ANY(:ids) "
            "GROUP BY job_id",
            ids=ids,
        )
        per = Counter(int(n) for _, n in rows)
        per[0] = len(ids) - len(rows) if len(ids) > len(rows) else 0
        if not per[0]:
            del per[0]
        executions = sum(int(n) for _, n in rows)
        stale = int(
            self.scalar(
                "SELECT count(*) FROM chaos_executions WHERE job_id = ANY(:ids) "
                "AND outcome = 'stale'",
                ids=ids,
            )
        )
        double = int(
            self.scalar(
                "SELECT count(*) FROM (SELECT 1 FROM chaos_executions WHERE job_id = ANY(:ids) "
                "GROUP BY job_id, attempt HAVING count(*) > 1) AS d",
                ids=ids,
            )
        )
        return Figures(
            double_claims=double,
            jobs=len(ids),
            statuses=statuses,
            lost=lost,
            effects=effects,
            duplicate_effects=conflicts,
            executions=executions,
            duplicate_executions=executions - len(rows),
            per_job=dict(per),
            stale=stale,
        )

    def calls(self) -> list[Call]:
        with self.api.lock:
            return list(self.api.calls)

    def overlaps(self) -> int:
        """Calls that found their key already at its max concurrency at the service."""
        by_key: dict[str, list[Call]] = {}
        for call in self.calls():
            by_key.setdefault(call.key, []).append(call)
        found = 0
        for key, calls in by_key.items():
            limit = self.limits.get(key, 1)
            events = sorted([(c.start, 1) for c in calls] + [(c.end, -1) for c in calls])
            level = 0
            for _, step in events:  # at equal times an end (-1) sorts before a start
                level += step
                if step > 0 and level > limit:
                    found += 1
        return found

    def close(self) -> None:
        self.cluster.stop()
        with contextlib.suppress(Exception):
            self.api.stop()
        self.client.close()
        self.engine.dispose()


def new_world(services: Services, log_dir: Path, **env: str) -> World:
    """A fresh world: tables and Redis emptied, the chaos pool's keys added, the API up."""
    world = World(services, log_dir, env)
    world.reset()
    world.add_keys()
    world.start_api()
    return world


@pytest.fixture
def make_world(
    services: Services, tmp_path: Path, request: pytest.FixtureRequest
) -> Iterator[Callable[..., World]]:
    """``make_world(**env)``: a fresh world for one case (the env overrides CHAOS_ENV)."""
    made: list[World] = []

    def make(**env: str) -> World:
        world = new_world(services, tmp_path / f"logs-{len(made)}", **env)
        made.append(world)
        return world

    yield make
    report_logs(request, made)


def report_logs(request: pytest.FixtureRequest, worlds: list[World]) -> None:
    """Stop each world; print the tail of its logs when the case failed."""
    failed = getattr(request.node, "rep_call", None)
    for world in worlds:
        world.cluster.stop()
        if failed is not None and failed.failed:
            print(world.cluster.logs(tail=6000))
        world.close()


@dataclass
class Victim:
    """A job that was running in a process when it was killed."""

    job_id: int
    attempt: int
    killed_at: float  # monotonic
    rescued_after: float | None = None


def victims_of(
    world: World, killed_at: float, *, pids: list[int] | None = None, host: str | None = None
) -> list[Victim]:
    """The jobs these processes (just killed), or this host (just cut off), were running."""
    rows = world.sql(
        "SELECT job_id, attempt FROM chaos_executions WHERE ended_at IS NULL "
        "AND (pid = ANY(:pids) OR host = :host)",
        pids=pids or [],
        host=host or "",
    )
    return [Victim(int(r.job_id), int(r.attempt), killed_at) for r in rows]


def note_rescues(world: World, victims: list[Victim]) -> None:
    """A victim is rescued once its row no longer runs the killed attempt."""
    waiting = [v for v in victims if v.rescued_after is None]
    if not waiting:
        return
    rows = world.sql(
        "SELECT id, status, attempts FROM harvest_jobs_all WHERE id = ANY(:ids)",
        ids=[v.job_id for v in waiting],
    )
    now = time.monotonic()
    state = {int(r.id): (r.status, int(r.attempts)) for r in rows}
    for victim in waiting:
        status, attempts = state[victim.job_id]
        if not (status == "running" and attempts == victim.attempt):
            victim.rescued_after = now - victim.killed_at


def record(case: str, title: str, request: pytest.FixtureRequest, **figures: Any) -> Row:
    """Add a case's row to the final table (call it before the case's asserts)."""
    row = Row(case, title, **figures)
    request.node.chaos_row = row
    return report().add(row)


# --- reporting hooks ----------------------------------------------------------------------


_STARTED = time.monotonic()  # this conftest is imported as the chaos run is collected


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]) -> Any:
    rep = yield
    if rep.when == "call":
        item.rep_call = rep  # type: ignore[attr-defined]
        row = getattr(item, "chaos_row", None)
        if row is not None and rep.failed:
            row.outcome = "FAILED"
    return rep


def pytest_terminal_summary(terminalreporter: Any, exitstatus: int, config: pytest.Config) -> None:
    rep = report()
    if not rep.rows:
        return
    rep.seconds = time.monotonic() - _STARTED
    terminalreporter.write_line("")
    terminalreporter.write(rep.text(width=max(200, terminalreporter._tw.fullwidth)))
    terminalreporter.write_line(f"chaos suite wall clock: {rep.seconds:.0f} s")
    if rep.complete():
        rep.write()
        terminalreporter.write_line(f"written: {LATEST}")
